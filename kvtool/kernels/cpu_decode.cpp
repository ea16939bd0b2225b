// The ops of an fp32 decode step on the CPU (one new token for each of a few sequences): RMSNorm,
// silu * up, attention with RoPE and the KV write, and streaming gemvs for matmuls of few rows (fp32 or
// bf16 weights; 4-bit weights against 16-bit activations), as torch ops (torch.ops.kvtool_cpu.*).
// kvtool/kernels/cpu_decode.py builds this file and documents why.
//
// Activations are fp32, the KV cache fp32 or bf16 (rounded as written, widened as read; cpu_simd.h); every tensor is
// contiguous and on the CPU; each op checks what it indexes into.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/silu.h>
#include <c10/core/InferenceMode.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#include "cpu_simd.h"

namespace kvtool_cpu {

// Sum of a[i] * b[i] in eight partial sums, which the compiler vectorises without -ffast-math (cpu_prefill.cpp
// uses it too).
float dot(const float* a, const float* b, int64_t n) {
  float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    for (int j = 0; j < 8; ++j) acc[j] += a[i + j] * b[i + j];
  }
  float s = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

#if defined(__AVX2__) && defined(__FMA__)
// out[t] = dot(q, k + t * d, d) for t < 8 keys (d a multiple of 8): the same products, partial sums and order of
// adding them as dot's, eight keys at a time (their sums reduced together instead of one by one). bf16 keys take
// explicit FMAs, as dot_as does for one (the compiler contracts a product and its sum, or not, by its own choice).
template <class E>
inline void dot8(const float* q, const E* k, int64_t d, float* out) {
  __m256 acc[8];
  for (int t = 0; t < 8; ++t) acc[t] = _mm256_setzero_ps();
  for (int64_t i = 0; i < d; i += 8) {
    const __m256 qi = _mm256_loadu_ps(q + i);
    for (int t = 0; t < 8; ++t) {
      if constexpr (std::is_same_v<E, float>) {
        acc[t] = _mm256_add_ps(acc[t], _mm256_mul_ps(qi, _mm256_loadu_ps(k + t * d + i)));
      } else {
        acc[t] = _mm256_fmadd_ps(qi, load8(k + t * d + i), acc[t]);
      }
    }
  }
  // hadd(a, b) = [a0+a1, a2+a3, b0+b1, b2+b3 | a4+a5, a6+a7, b4+b5, b6+b7]; twice, then the halves: ((0+1)+(2+3)) +
  // ((4+5)+(6+7)) per key
  const __m256 lo = _mm256_hadd_ps(_mm256_hadd_ps(acc[0], acc[1]), _mm256_hadd_ps(acc[2], acc[3]));
  const __m256 hi = _mm256_hadd_ps(_mm256_hadd_ps(acc[4], acc[5]), _mm256_hadd_ps(acc[6], acc[7]));
  _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(lo), _mm256_extractf128_ps(lo, 1)));
  _mm_storeu_ps(out + 4, _mm_add_ps(_mm256_castps256_ps128(hi), _mm256_extractf128_ps(hi, 1)));
}
#endif

// dot(a, b, n) for b fp32 or bf16 (n <= 1024). A bf16 row takes dot8's steps for one key where dot8 runs (AVX2,
// n a multiple of 8), else is widened into a row first, so a key gives the same score on either path.
template <class E>
float dot_as(const float* a, const E* b, int64_t n) {
  if constexpr (std::is_same_v<E, float>) {
    return dot(a, b, n);
  } else {
#if defined(__AVX2__) && defined(__FMA__)
    if (n % 8 == 0) {
      __m256 acc = _mm256_setzero_ps();
      for (int64_t i = 0; i < n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), load8(b + i), acc);
      float p[8];
      _mm256_storeu_ps(p, acc);
      return ((p[0] + p[1]) + (p[2] + p[3])) + ((p[4] + p[5]) + (p[6] + p[7]));
    }
#endif
    float wide[1024];
    for (int64_t i = 0; i < n; ++i) wide[i] = widen(b[i]);
    return dot(a, wide, n);
  }
}

}  // namespace kvtool_cpu

namespace {

using kvtool_cpu::bf16_to_float;
using kvtool_cpu::dot;
using kvtool_cpu::dot_as;
using kvtool_cpu::widen;
#if defined(__AVX2__) && defined(__FMA__)
using kvtool_cpu::dot8;
#endif

// The weight rows oneDNN's packed fp32 layout interleaves: w [N / 64, K, 64] holds W[64 b + j, k] at
// [b, k, j] (kvtool.kernels.cpu_gemm checks each weight's layout before handing it here).
constexpr int64_t BLOCK = 64;
constexpr int PARTS = 4;

#if defined(__AVX2__) && defined(__FMA__)
// The sum of a vector's eight lanes.
inline float hsum(__m256 a) {
  __m128 v = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  v = _mm_hadd_ps(v, v);
  v = _mm_hadd_ps(v, v);
  return _mm_cvtss_f32(v);
}
#endif

// Sum of w[i] * x[i] for one weight row, reading the row front to back.
inline float row_dot(const float* w, const float* x, int64_t n) {
#if defined(__AVX2__) && defined(__FMA__)
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w + i), _mm256_loadu_ps(x + i), a0);
    a1 = _mm256_fmadd_ps(_mm256_loadu_ps(w + i + 8), _mm256_loadu_ps(x + i + 8), a1);
    a2 = _mm256_fmadd_ps(_mm256_loadu_ps(w + i + 16), _mm256_loadu_ps(x + i + 16), a2);
    a3 = _mm256_fmadd_ps(_mm256_loadu_ps(w + i + 24), _mm256_loadu_ps(x + i + 24), a3);
  }
  for (; i + 8 <= n; i += 8) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w + i), _mm256_loadu_ps(x + i), a0);
  float s = hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
  for (; i < n; ++i) s += w[i] * x[i];
  return s;
#else
  return dot(w, x, n);
#endif
}

// Sum of w[i] * x[i] for a bf16 weight row w (raw bits) and fp32 x: each weight widened to fp32 exactly.
inline float row_dot_bf16(const uint16_t* w, const float* x, int64_t n) {
  int64_t i = 0;
  float s = 0.f;
#if defined(__AVX2__) && defined(__FMA__)
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
  for (; i + 16 <= n; i += 16) {
    a0 = _mm256_fmadd_ps(kvtool_cpu::load8(w + i), _mm256_loadu_ps(x + i), a0);
    a1 = _mm256_fmadd_ps(kvtool_cpu::load8(w + i + 8), _mm256_loadu_ps(x + i + 8), a1);
  }
  s = hsum(_mm256_add_ps(a0, a1));
#endif
  for (; i < n; ++i) s += bf16_to_float(w[i]) * x[i];
  return s;
}

#if defined(__AVX2__) && defined(__FMA__)
using kvtool_cpu::load8;  // fp32, or bf16 widened exactly (cpu_simd.h)

constexpr int64_t ROWS_AHEAD_BYTES = 32768;  // how far ahead tiled_gemv and gemv_q8 prefetch their weight rows

// s[a * R + b] = weight row a . x row b for A weight rows (stride k; fp32, or bf16 widened exactly) and R x rows:
// each eight-wide chunk of an x row is loaded once for all A weight rows, and A weight streams are read side by
// side. Every (a, b) sum runs in one accumulator over the chunks, then the lanes and the tail: the same order
// for any A and R, so a row's product does not depend on how many rows share the step.
template <int A, int R, typename W>
inline void dots(const W* w, const float* x, int64_t k, float* s) {
  __m256 acc[A][R];
#pragma GCC unroll 8
  for (int a = 0; a < A; ++a)
#pragma GCC unroll 8
    for (int b = 0; b < R; ++b) acc[a][b] = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= k; i += 8) {
    __m256 wv[A];
#pragma GCC unroll 8
    for (int a = 0; a < A; ++a) wv[a] = load8(w + a * k + i);
#pragma GCC unroll 8
    for (int b = 0; b < R; ++b) {
      const __m256 xv = _mm256_loadu_ps(x + b * k + i);
#pragma GCC unroll 8
      for (int a = 0; a < A; ++a) acc[a][b] = _mm256_fmadd_ps(wv[a], xv, acc[a][b]);
    }
  }
#pragma GCC unroll 8
  for (int a = 0; a < A; ++a)
#pragma GCC unroll 8
    for (int b = 0; b < R; ++b) {
      float t = hsum(acc[a][b]);
      for (int64_t j = i; j < k; ++j) t += widen(w[a * k + j]) * x[b * k + j];
      s[a * R + b] = t;
    }
}

// gemv's product for R rows, A weight rows at a time (the last N % A one by one through the same order).
template <int A, int R, typename W, typename Finish>
void tiled_gemv(const W* wf, const float* xp, int64_t k, int64_t n, const Finish& finish) {
  at::parallel_for(0, (n + A - 1) / A, 64 / A, [&](int64_t begin, int64_t end) {
    float s[A * R];
    for (int64_t j = A * begin; j < std::min(A * end, n); j += A) {
      // every line of the rows ROWS_AHEAD_BYTES on, while these are summed (a prefetch past the end never faults)
      const char* ahead = reinterpret_cast<const char*>(wf + j * k) + ROWS_AHEAD_BYTES;
      for (int64_t b = 0; b < A * k * static_cast<int64_t>(sizeof(W)); b += 64) __builtin_prefetch(ahead + b);
      if (j + A <= n) {
        dots<A, R>(wf + j * k, xp, k, s);
        for (int a = 0; a < A; ++a)
          for (int r = 0; r < R; ++r) finish(r, j + a, s[a * R + r]);
        continue;
      }
      for (int64_t a = j; a < n; ++a) {
        dots<1, R>(wf + a * k, xp, k, s);
        for (int r = 0; r < R; ++r) finish(r, a, s[r]);
      }
    }
  });
}

#if defined(__AVX512F__)
#define KVTOOL_PS(op) _mm512_##op##_ps
using Vec = __m512; constexpr int VW = 16;
#else
#define KVTOOL_PS(op) _mm256_##op##_ps
using Vec = __m256; constexpr int VW = 8;
#endif
inline Vec vload(const float* p) { return KVTOOL_PS(loadu)(p); }
inline void vstore(float* p, Vec v) { KVTOOL_PS(storeu)(p, v); }
inline Vec vfma(Vec a, Vec b, Vec c) { return KVTOOL_PS(fmadd)(a, b, c); }
inline Vec vset(float f) { return KVTOOL_PS(set1)(f); }

// gemv's fp32 product for R rows over a blocked weight. Each output sums the four quarters of K (PARTS), each in
// one chain of FMAs in a lane of its own, then ((q0 + q1) + q2) + q3: the same bits whatever the vector width
// (AVX2 or AVX-512), R or thread count. The quarters are read side by side, four weight streams for one row and
// two for more, KT k values at a time, C vectors of outputs per pass (as many accumulators as the registers
// hold). Streams side by side read faster than one stream, or than blocks side by side (docs/benchmarks.md,
// "kvtool.kernels.cpu_decode").
// The most vectors of a block's outputs a pass can hold in `most` registers, such that passes cover the block
// exactly (a divisor of `per`: a pass past its end would read and write beyond the accumulators).
constexpr int whole_passes(int per, int most) {
  int c = std::max(1, std::min(per, most));
  while (per % c != 0) --c;
  return c;
}

template <int R, typename Finish>
void blocked_gemv(const float* w, const float* xp, int64_t k, int64_t blocks, const Finish& finish) {
  constexpr int PER = BLOCK / VW, BUDGET = VW == 16 ? 16 : 12;  // accumulator registers
  constexpr int P = R == 1 ? 4 : 2;  // parts in flight: four weight streams for one row, two for more
  constexpr int C = whole_passes(PER, BUDGET / (R * P));
  constexpr int64_t KT = 16;
  const int64_t len = k / PARTS;
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    alignas(64) float acc[PARTS][R][BLOCK];
    for (int64_t b = begin; b < end; ++b) {
      const float* wb = w + b * k * BLOCK;
      std::fill(&acc[0][0][0], &acc[0][0][0] + PARTS * R * BLOCK, 0.f);
      for (int p0 = 0; p0 < PARTS; p0 += P) {
        for (int64_t t0 = 0; t0 < len; t0 += KT) {
          const int64_t t1 = std::min(len, t0 + KT);
          for (int c = 0; c < PER; c += C) {
            Vec a[P][R][C];
            for (int p = 0; p < P; ++p)
              for (int r = 0; r < R; ++r)
                for (int i = 0; i < C; ++i) a[p][r][i] = vload(acc[p0 + p][r] + (c + i) * VW);
            for (int64_t kk = t0; kk < t1; ++kk) {
              for (int p = 0; p < P; ++p) {
                const int64_t at = (p0 + p) * len + kk;
                Vec wv[C];
                for (int i = 0; i < C; ++i) wv[i] = vload(wb + at * BLOCK + (c + i) * VW);
                for (int r = 0; r < R; ++r) {
                  const Vec xv = vset(xp[r * k + at]);
                  for (int i = 0; i < C; ++i) a[p][r][i] = vfma(wv[i], xv, a[p][r][i]);
                }
              }
            }
            for (int p = 0; p < P; ++p)
              for (int r = 0; r < R; ++r)
                for (int i = 0; i < C; ++i) vstore(acc[p0 + p][r] + (c + i) * VW, a[p][r][i]);
          }
        }
      }
      for (int r = 0; r < R; ++r)
        for (int64_t j = 0; j < BLOCK; ++j)
          finish(r, b * BLOCK + j, ((acc[0][r][j] + acc[1][r][j]) + acc[2][r][j]) + acc[3][r][j]);
    }
  });
}
#endif

// y [rows, N] = x [rows, K] @ w [N, K].T (+ bias [N]) (+ residual [rows, N]) for the few rows of a decode
// step, w in fp32 or bf16 (widened exactly; sums in fp32). Each thread streams its share of the weight rows
// front to back. Weights (fp32 or bf16) go four rows at a time for one or two x rows and two at a time for three
// or four (dots): A streams side by side keep more of the memory bus busy than one, and each x chunk is loaded
// once for all A.
at::Tensor gemv(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias,
                const std::optional<at::Tensor>& residual) {
  TORCH_CHECK(x.is_contiguous() && x.scalar_type() == at::kFloat && x.dim() == 2, "gemv: x must be contiguous fp32 "
              "[rows, K]");
  const bool half = w.scalar_type() == at::kBFloat16, blocked = w.dim() == 3;
  TORCH_CHECK(w.is_contiguous() && (w.scalar_type() == at::kFloat || half) && w.size(1) == x.size(1) &&
                  (w.dim() == 2 || (!half && blocked && w.size(2) == BLOCK)),
              "gemv: w must be contiguous fp32 or bf16 [N, K], or fp32 [N / 64, K, 64] (oneDNN's packed layout)");
  TORCH_CHECK(!blocked || x.size(0) <= 4, "gemv: a blocked weight takes up to 4 rows");
  const int64_t rows = x.size(0), k = x.size(1), n = blocked ? w.size(0) * BLOCK : w.size(0);
  TORCH_CHECK(!bias.has_value() || (bias->is_contiguous() && bias->numel() == n), "gemv: bias must be [N]");
  TORCH_CHECK(!residual.has_value() || (residual->is_contiguous() && residual->numel() == rows * n),
              "gemv: residual must be contiguous [rows, N]");
  at::Tensor y = at::empty({rows, n}, x.options());
  const float* xp = x.data_ptr<float>();
  const char* wp = static_cast<const char*>(w.data_ptr());
  const int64_t row_bytes = k * w.element_size();
  const float* bp = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  const float* rp = residual.has_value() ? residual->data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  auto finish = [&](int64_t r, int64_t j, float s) {
    if (bp != nullptr) s += bp[j];
    if (rp != nullptr) s += rp[r * n + j];
    yp[r * n + j] = s;
  };
#if defined(__AVX2__) && defined(__FMA__)
  const float* wf = reinterpret_cast<const float*>(wp);
  if (blocked) {
    if (rows == 1) blocked_gemv<1>(wf, xp, k, w.size(0), finish);
    if (rows == 2) blocked_gemv<2>(wf, xp, k, w.size(0), finish);
    if (rows == 3) blocked_gemv<3>(wf, xp, k, w.size(0), finish);
    if (rows == 4) blocked_gemv<4>(wf, xp, k, w.size(0), finish);
    return y;
  }
  if (rows <= 4) {
    auto tiled = [&](const auto* w) {
      if (rows == 1) tiled_gemv<4, 1>(w, xp, k, n, finish);
      if (rows == 2) tiled_gemv<4, 2>(w, xp, k, n, finish);
      if (rows == 3) tiled_gemv<2, 3>(w, xp, k, n, finish);
      if (rows == 4) tiled_gemv<2, 4>(w, xp, k, n, finish);
    };
    if (half) tiled(reinterpret_cast<const uint16_t*>(wp));
    else tiled(wf);
    return y;
  }
#endif
  if (blocked) {  // the order of blocked_gemv, one output at a time
    const float* wf = reinterpret_cast<const float*>(wp);
    at::parallel_for(0, n, BLOCK, [&](int64_t begin, int64_t end) {
      for (int64_t j = begin; j < end; ++j)
        for (int64_t r = 0; r < rows; ++r) {
          float s = 0.f;
          for (int64_t i = 0; i < k; ++i) s = std::fma(wf[((j / BLOCK) * k + i) * BLOCK + j % BLOCK], xp[r * k + i], s);
          finish(r, j, s);
        }
    });
    return y;
  }
  at::parallel_for(0, n, 64, [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j) {
      const char* wr = wp + j * row_bytes;
      __builtin_prefetch(wr + 8 * row_bytes);  // a prefetch past the end never faults
      __builtin_prefetch(wr + 8 * row_bytes + 64);
      for (int64_t r = 0; r < rows; ++r) {
        finish(r, j, half ? row_dot_bf16(reinterpret_cast<const uint16_t*>(wr), xp + r * k, k)
                          : row_dot(reinterpret_cast<const float*>(wr), xp + r * k, k));
      }
    }
  });
  return y;
}

// x [rows, K] in 16 bits per group of 32 columns: xq = round(x * 32767 / max |x|), xscale = max |x| / 32767
// of the group (round to nearest even, as torch.round), and the exact group sums of x for the zero terms.
// Rounding moves an element by at most 2^-16 of its group's largest, against 2^-9 of itself for bf16.
struct Q16Rows {
  std::vector<int16_t> q;      // [rows, K]
  std::vector<float> scale;    // [rows, K/32]
  std::vector<float> sum;      // [rows, K/32]
  Q16Rows(const float* x, int64_t rows, int64_t k) : q(rows * k), scale(rows * k / 32), sum(rows * k / 32) {
    for (int64_t g = 0; g < rows * k / 32; ++g) {
      const float* xg = x + g * 32;
      float mx = 0.f, s = 0.f;
      for (int i = 0; i < 32; ++i) {
        mx = std::max(mx, std::fabs(xg[i]));
        s += xg[i];
      }
      const float inv = mx > 0.f ? 32767.f / mx : 0.f;
      for (int i = 0; i < 32; ++i) q[g * 32 + i] = static_cast<int16_t>(std::nearbyint(xg[i] * inv));
      scale[g] = mx / 32767.f;
      sum[g] = s;
    }
  }
};

#if defined(__AVX2__) && defined(__FMA__)
// One group's 32 codes (16 bytes: see q4_row) as 16-bit integers, columns 0..15 and 16..31.
struct Codes16 {
  __m256i lo, hi;
};

inline Codes16 unpack4(const uint8_t* p) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)), low4 = _mm_set1_epi8(0x0F);
  return {_mm256_cvtepu8_epi16(_mm_and_si128(b, low4)),
          _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(b, 4), low4))};
}

// The group's q . xq (xg: its 32 16-bit x values) in eight fp32 partial sums; exact (|sum| < 2^24).
inline __m256 dot16(const Codes16& q, const int16_t* xg) {
  const __m256i* x = reinterpret_cast<const __m256i*>(xg);
  return _mm256_cvtepi32_ps(_mm256_add_epi32(_mm256_madd_epi16(q.lo, _mm256_loadu_si256(x)),
                                             _mm256_madd_epi16(q.hi, _mm256_loadu_si256(x + 1))));
}
#endif

// How far ahead gemv_q4 prefetches its codes (and its scales and zeros, half that): one row is too little.
constexpr int64_t PREFETCH_BYTES = 4096;

// out[t] = sum over groups g of scale_g * xscale[t, g] * (q . xq[t]) for one 4-bit weight row (codes cr [K/2]:
// byte 16g + i holds column 32g + i in its low nibble and column 32g + 16 + i in its high one; sz: the row's
// bf16 scales [K/32]) and the T Q16 rows from r0. The integer dots are exact (vpmaddwd: 2 * 15 * 32767 fits
// int32); the nibbles are unpacked once per group for all T rows.
template <int T>
inline void q4_row(const uint8_t* cr, const uint16_t* sz, const Q16Rows& x, int64_t r0, int64_t k, float* out) {
  const int64_t groups = k / 32;
  const int16_t* xq[T];
  const float* xs[T];
  for (int t = 0; t < T; ++t) {
    xq[t] = x.q.data() + (r0 + t) * k;
    xs[t] = x.scale.data() + (r0 + t) * groups;
  }
#if defined(__AVX2__) && defined(__FMA__)
  __m256 acc[T][2];  // even and odd groups: two chains of FMAs per row
  for (int t = 0; t < T; ++t) acc[t][0] = acc[t][1] = _mm256_setzero_ps();
  alignas(32) float mult[T][8];  // scale * xscale of the block's groups
  for (int64_t g0 = 0; g0 < groups; g0 += 8) {
    const int64_t block = std::min<int64_t>(8, groups - g0);
    if (block == 8) {
      const __m256 s = _mm256_castsi256_ps(_mm256_slli_epi32(
          _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sz + g0))), 16));
      for (int t = 0; t < T; ++t) _mm256_store_ps(mult[t], _mm256_mul_ps(s, _mm256_loadu_ps(xs[t] + g0)));
    } else {
      for (int t = 0; t < T; ++t) {
        for (int64_t i = 0; i < block; ++i) mult[t][i] = bf16_to_float(sz[g0 + i]) * xs[t][g0 + i];
      }
    }
    for (int64_t i = 0; i < block; ++i) {
      const int64_t g = g0 + i;
      const Codes16 q = unpack4(cr + g * 16);
      for (int t = 0; t < T; ++t) {
        acc[t][i & 1] = _mm256_fmadd_ps(_mm256_broadcast_ss(&mult[t][i]), dot16(q, xq[t] + g * 32), acc[t][i & 1]);
      }
    }
  }
  for (int t = 0; t < T; ++t) out[t] = hsum(_mm256_add_ps(acc[t][0], acc[t][1]));
#else
  for (int t = 0; t < T; ++t) out[t] = 0.f;
  for (int64_t g = 0; g < groups; ++g) {
    for (int t = 0; t < T; ++t) {
      int32_t d = 0;
      for (int i = 0; i < 16; ++i) {
        d += (cr[g * 16 + i] & 0x0F) * xq[t][g * 32 + i] + (cr[g * 16 + i] >> 4) * xq[t][g * 32 + 16 + i];
      }
      out[t] += bf16_to_float(sz[g]) * xs[t][g] * static_cast<float>(d);
    }
  }
#endif
}

constexpr int64_t Q8_GROUP = 32;  // columns per scale of an 8-bit weight (gemv_q8)

// The 8-lane sum of hsum, in its order, for the scalar build: ((a0 + a4) + (a1 + a5)) + ((a2 + a6) + (a3 + a7)).
inline float lanes_sum(const float* a) { return ((a[0] + a[4]) + (a[1] + a[5])) + ((a[2] + a[6]) + (a[3] + a[7])); }

#if defined(__AVX2__) && defined(__FMA__)
// Eight int8 codes widened to fp32 exactly.
inline __m256 load8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

// s[a * R + b] = sum over groups g of scale[a, g] * (codes row a . x row b over g's 32 columns), for A code rows
// (stride k) side by side and R x rows. Each (a, b) has its own chains: per group one 8-lane FMA chain over its
// four chunks, scaled into one 8-lane sum, then hsum: the same order for any A and R.
template <int A, int R>
inline void dots_q8(const int8_t* q, const float* scale, const float* x, int64_t k, float* s) {
  const int64_t groups = k / Q8_GROUP;
  __m256 acc[A][R];
#pragma GCC unroll 8
  for (int a = 0; a < A; ++a)
#pragma GCC unroll 8
    for (int b = 0; b < R; ++b) acc[a][b] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m256 part[A][R];
#pragma GCC unroll 8
    for (int a = 0; a < A; ++a)
#pragma GCC unroll 8
      for (int b = 0; b < R; ++b) part[a][b] = _mm256_setzero_ps();
#pragma GCC unroll 4
    for (int64_t i = g * Q8_GROUP; i < (g + 1) * Q8_GROUP; i += 8) {
      __m256 wv[A];
#pragma GCC unroll 8
      for (int a = 0; a < A; ++a) wv[a] = load8(q + a * k + i);
#pragma GCC unroll 8
      for (int b = 0; b < R; ++b) {
        const __m256 xv = _mm256_loadu_ps(x + b * k + i);
#pragma GCC unroll 8
        for (int a = 0; a < A; ++a) part[a][b] = _mm256_fmadd_ps(wv[a], xv, part[a][b]);
      }
    }
#pragma GCC unroll 8
    for (int a = 0; a < A; ++a) {
      const __m256 sv = _mm256_set1_ps(scale[a * groups + g]);
#pragma GCC unroll 8
      for (int b = 0; b < R; ++b) acc[a][b] = _mm256_fmadd_ps(part[a][b], sv, acc[a][b]);
    }
  }
#pragma GCC unroll 8
  for (int a = 0; a < A; ++a)
#pragma GCC unroll 8
    for (int b = 0; b < R; ++b) s[a * R + b] = hsum(acc[a][b]);
}
#endif

// x [rows, K] (rows <= 4) @ W.T for an 8-bit weight W[j, 32g + i] = codes[j, 32g + i] * scale[j, g] (codes [N, K]
// int8, scale [N, K/32] fp32): fp32 sums in the order of dots_q8, which the scalar build follows lane by lane.
at::Tensor gemv_q8(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale) {
  TORCH_CHECK(x.is_contiguous() && x.scalar_type() == at::kFloat && x.dim() == 2 && x.size(0) >= 1 &&
                  x.size(0) <= 4, "gemv_q8: x must be contiguous fp32 [rows, K] with 1 to 4 rows");
  TORCH_CHECK(codes.is_contiguous() && codes.scalar_type() == at::kChar && codes.dim() == 2 &&
                  codes.size(1) == x.size(1) && x.size(1) % Q8_GROUP == 0,
              "gemv_q8: codes must be contiguous int8 [N, K] with K = x's columns, a multiple of 32");
  const int64_t rows = x.size(0), k = x.size(1), n = codes.size(0), groups = k / Q8_GROUP;
  TORCH_CHECK(scale.is_contiguous() && scale.scalar_type() == at::kFloat && scale.dim() == 2 &&
                  scale.size(0) == n && scale.size(1) == groups, "gemv_q8: scale must be contiguous fp32 [N, K/32]");
  at::Tensor y = at::empty({rows, n}, x.options());
  const float *xp = x.data_ptr<float>(), *sp = scale.data_ptr<float>();
  const int8_t* qp = codes.data_ptr<int8_t>();
  float* yp = y.data_ptr<float>();
#if defined(__AVX2__) && defined(__FMA__)
  auto tiled = [&](auto a_rows, auto r_rows) {
    constexpr int A = decltype(a_rows)::value, R = decltype(r_rows)::value;
    at::parallel_for(0, (n + A - 1) / A, 64 / A, [&](int64_t begin, int64_t end) {
      float s[A * R];
      for (int64_t j = A * begin; j < std::min(A * end, n); j += A) {
        const char* ahead = reinterpret_cast<const char*>(qp + j * k) + ROWS_AHEAD_BYTES;
        for (int64_t b = 0; b < A * k; b += 64) __builtin_prefetch(ahead + b);
        if (j + A <= n) {
          dots_q8<A, R>(qp + j * k, sp + j * groups, xp, k, s);
          for (int a = 0; a < A; ++a)
            for (int r = 0; r < R; ++r) yp[r * n + j + a] = s[a * R + r];
          continue;
        }
        for (int64_t a = j; a < n; ++a) {  // the last N % A one by one, in the same order
          dots_q8<1, R>(qp + a * k, sp + a * groups, xp, k, s);
          for (int r = 0; r < R; ++r) yp[r * n + a] = s[r];
        }
      }
    });
  };
  using C1 = std::integral_constant<int, 1>;
  using C2 = std::integral_constant<int, 2>;
  using C4 = std::integral_constant<int, 4>;
  if (rows == 1) tiled(C4{}, C1{});
  if (rows == 2) tiled(C2{}, C2{});
  if (rows == 3) tiled(C1{}, std::integral_constant<int, 3>{});
  if (rows == 4) tiled(C1{}, C4{});
  return y;
#endif
  at::parallel_for(0, n, 64, [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j)
      for (int64_t r = 0; r < rows; ++r) {
        float acc[8] = {};
        for (int64_t g = 0; g < groups; ++g) {
          float part[8] = {};
          for (int64_t i = g * Q8_GROUP; i < (g + 1) * Q8_GROUP; ++i)
            part[i % 8] = std::fma(static_cast<float>(qp[j * k + i]), xp[r * k + i], part[i % 8]);
          for (int l = 0; l < 8; ++l) acc[l] = std::fma(part[l], sp[j * groups + g], acc[l]);
        }
        yp[r * n + j] = lanes_sum(acc);
      }
  });
  return y;
}

// y [rows, N] = x [rows, K] @ W.T (+ bias) (+ residual) for 4-bit weights W [N, K] in groups of 32 columns,
// W[j, 32g + i] = (q - 8) * scale[j, g] + zero[j, g] with q in 0..15, held as codes [N, K/2] (see q4_row) and
// scale_zero [N, 2, K/32] bf16, and x in 16 bits per group (Q16Rows). Per group that is scale * xscale *
// (q . xq) + (zero - 8 * scale) * sum(x), the sum exact. Rows go four at a time through q4_row.
at::Tensor gemv_q4(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale_zero,
                   const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& residual) {
  TORCH_CHECK(x.is_contiguous() && x.scalar_type() == at::kFloat && x.dim() == 2 && x.size(1) % 32 == 0,
              "gemv_q4: x must be contiguous fp32 [rows, K] with K a multiple of 32");
  const int64_t rows = x.size(0), k = x.size(1), groups = k / 32;
  TORCH_CHECK(codes.is_contiguous() && codes.scalar_type() == at::kByte && codes.dim() == 2 &&
              codes.size(1) * 2 == k, "gemv_q4: codes must be contiguous uint8 [N, K/2]");
  const int64_t n = codes.size(0);
  TORCH_CHECK(scale_zero.is_contiguous() && scale_zero.scalar_type() == at::kBFloat16 &&
              scale_zero.numel() == n * groups * 2, "gemv_q4: scale_zero must be contiguous bf16 [N, 2, K/32]");
  TORCH_CHECK(!bias.has_value() || (bias->is_contiguous() && bias->numel() == n), "gemv_q4: bias must be [N]");
  TORCH_CHECK(!residual.has_value() || (residual->is_contiguous() && residual->numel() == rows * n),
              "gemv_q4: residual must be contiguous [rows, N]");
  at::Tensor y = at::empty({rows, n}, x.options());
  const Q16Rows xq(x.data_ptr<float>(), rows, k);
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const uint16_t* sp = reinterpret_cast<const uint16_t*>(scale_zero.data_ptr());
  const float* bp = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  const float* rp = residual.has_value() ? residual->data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j) {
      const uint8_t* cr = cp + j * (k / 2);
      const uint16_t* sz = sp + j * groups * 2;
      for (int64_t at = 0; at < k / 2; at += 64) __builtin_prefetch(cr + PREFETCH_BYTES + at);
      for (int64_t at = 0; at < groups * 2; at += 32) __builtin_prefetch(sz + PREFETCH_BYTES / 2 + at);
      for (int64_t r0 = 0; r0 < rows; r0 += 4) {
        const int64_t tile = std::min<int64_t>(4, rows - r0);
        float out[4];
        switch (tile) {
          case 1: q4_row<1>(cr, sz, xq, r0, k, out); break;
          case 2: q4_row<2>(cr, sz, xq, r0, k, out); break;
          case 3: q4_row<3>(cr, sz, xq, r0, k, out); break;
          default: q4_row<4>(cr, sz, xq, r0, k, out); break;
        }
        for (int64_t t = 0; t < tile; ++t) {
          const float* sums = xq.sum.data() + (r0 + t) * groups;  // offsets z - 8 * scale
          float v = out[t] + row_dot_bf16(sz + groups, sums, groups) - 8.f * row_dot_bf16(sz, sums, groups);
          if (bp != nullptr) v += bp[j];
          if (rp != nullptr) v += rp[(r0 + t) * n + j];
          yp[(r0 + t) * n + j] = v;
        }
      }
    }
  });
  return y;
}

// y = x / sqrt(mean(x^2) + eps) * w over the last dimension of x [rows, n], rows split over the threads
// (each row by one thread, so the same bits at any thread count). `half`: y in bf16, each value rounded to nearest
// even (for a bf16 product, which would round it so).
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps, bool half = false) {
  TORCH_CHECK(x.is_contiguous() && x.scalar_type() == at::kFloat && x.dim() == 2,
              "rms_norm: x must be contiguous fp32 [rows, n]");
  const int64_t rows = x.size(0), n = x.size(1);
  TORCH_CHECK(w.numel() == n && w.is_contiguous() && w.scalar_type() == at::kFloat, "rms_norm: w must be fp32 [n]");
  at::Tensor y = at::empty({rows, n}, x.options().dtype(half ? at::kBFloat16 : at::kFloat));
  const float* wp = w.data_ptr<float>();
  auto norm = [&](auto* out) {
    at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const float* xp = x.data_ptr<float>() + r * n;
        const float ss = dot(xp, xp, n);
        const float scale = 1.f / std::sqrt(ss / static_cast<float>(n) + static_cast<float>(eps));
        for (int64_t i = 0; i < n; ++i) kvtool_cpu::narrow(xp[i] * scale * wp[i], out + r * n + i);
      }
    });
  };
  if (half) {
    norm(reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>()));
  } else {
    norm(y.data_ptr<float>());
  }
  return y;
}

// silu(gate) * up for gu [rows, 2I] holding gate then up, through ATen's silu (vectorized, and the reference
// forward's own, so the same bits): a scalar loop of exps took 13 ms of a 64-row step across the 30 layers.
// Many rows (a prefill) go in blocks split over the threads, each multiplied by up while it is in cache.
// A bf16 gu (a bf16 gate_up product) gives a bf16 result: each block widened exactly, computed in fp32 as the fp32
// path does and rounded to nearest even as written, so the bits of the fp32 path's result rounded afterwards,
// without the full-size fp32 copies in and out.
at::Tensor silu_mul(const at::Tensor& gu) {
  const bool half = gu.scalar_type() == at::kBFloat16;
  TORCH_CHECK(gu.is_contiguous() && (half || gu.scalar_type() == at::kFloat) && gu.dim() == 2 &&
                  gu.size(1) % 2 == 0,
              "silu_mul: gu must be contiguous fp32 or bf16 [rows, 2I]");
  const int64_t rows = gu.size(0), inter = gu.size(1) / 2;
  at::Tensor out = at::empty({rows, inter}, gu.options());
  // a block of ~16K values; fewer rows than one block run as one block, whose silu ATen may split itself
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(inter, 1));
  // The ATen ops below run on the pool's threads, which do not inherit the caller's InferenceMode: without
  // it, writing into a block of an inference tensor (out, made under torch.inference_mode) is refused.
  const bool inference = c10::InferenceMode::is_enabled();
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    c10::InferenceMode guard(inference);
    std::vector<float> gate(half ? std::min(grain, end - begin) * inter : 0);  // a bf16 block widened, per thread
    for (int64_t r = begin; r < end; r += grain) {  // each thread's share, a block at a time
      const int64_t n = std::min(grain, end - r);
      at::Tensor block = out.narrow(0, r, n);
      const at::Tensor part = gu.narrow(0, r, n);
      if (half) {  // widened into a block of fp32, ATen's silu there, * up and rounded in one pass
        const uint16_t* src = reinterpret_cast<const uint16_t*>(gu.data_ptr<at::BFloat16>()) + r * 2 * inter;
        uint16_t* dst = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()) + r * inter;
        for (int64_t i = 0; i < n; ++i)
          for (int64_t j = 0; j < inter; ++j) gate[i * inter + j] = bf16_to_float(src[i * 2 * inter + j]);
        at::Tensor g = at::from_blob(gate.data(), {n, inter}, at::TensorOptions().dtype(at::kFloat));
        at::silu_(g);
        for (int64_t i = 0; i < n; ++i)
          for (int64_t j = 0; j < inter; ++j)
            kvtool_cpu::narrow(gate[i * inter + j] * bf16_to_float(src[i * 2 * inter + inter + j]),
                               dst + i * inter + j);
      } else {
        at::silu_out(block, part.narrow(1, 0, inter));
        block.mul_(part.narrow(1, inter, inter));
      }
    }
  });
  return out;
}

// exp(s[t] - mx) into s[t] for t < n, returning their sum: eight at a time with exp8 (cpu_simd.h), the tail with
// std::exp.
inline float exp_sum(float* s, int64_t n, float mx) {
  int64_t t = 0;
  float total = 0.f;
#if defined(__AVX2__) && defined(__FMA__)
  const __m256 m = _mm256_set1_ps(mx);
  __m256 acc = _mm256_setzero_ps();
  for (; t + 8 <= n; t += 8) {
    const __m256 y = kvtool_cpu::exp8(_mm256_sub_ps(_mm256_loadu_ps(s + t), m));
    _mm256_storeu_ps(s + t, y);
    acc = _mm256_add_ps(acc, y);
  }
  total = hsum(acc);
#endif
  for (; t < n; ++t) {
    s[t] = std::exp(s[t] - mx);
    total += s[t];
  }
  return total;
}

// A run of keys and values of one kv head that lies in one piece of memory (a block's, or the buffers'): rows
// k[t * d], v[t * d] (fp32 or bf16) for t < n, which are keys off .. off + n - 1 of the chunk an attend item scores.
template <class E>
struct Run {
  const E* k;
  const E* v;
  int64_t off, n;
};

// o [d] += sum over the runs' rows t of w[off + t] * v[t * d : t * d + d]: 8 * NV columns from c0 held in
// registers across every row of every run (rows in order: the sums are those of one run over all of them).
template <int NV, class E>
inline void weighted_rows(float* o, const float* w, const Run<E>* runs, int64_t count, int64_t d, int64_t c0) {
#if defined(__AVX2__) && defined(__FMA__)
  __m256 acc[NV];
  for (int k = 0; k < NV; ++k) acc[k] = _mm256_loadu_ps(o + c0 + 8 * k);
  for (int64_t r = 0; r < count; ++r) {
    const float* wr = w + runs[r].off;
    const E* v = runs[r].v + c0;
    for (int64_t t = 0; t < runs[r].n; ++t) {
      const __m256 wt = _mm256_broadcast_ss(wr + t);
      const E* vt = v + t * d;
      for (int k = 0; k < NV; ++k) acc[k] = _mm256_fmadd_ps(wt, load8(vt + 8 * k), acc[k]);
    }
  }
  for (int k = 0; k < NV; ++k) _mm256_storeu_ps(o + c0 + 8 * k, acc[k]);
#else
  for (int64_t r = 0; r < count; ++r) {
    for (int64_t t = 0; t < runs[r].n; ++t) {
      for (int64_t i = c0; i < c0 + 8 * NV; ++i) o[i] += w[runs[r].off + t] * widen(runs[r].v[t * d + i]);
    }
  }
#endif
}

// o [d] += sum over the runs' rows of w[off + t] * v[t]: the columns in blocks of 64, 32, 16 and 8, the rest one
// by one.
template <class E>
inline void weighted_sum(float* o, const float* w, const Run<E>* runs, int64_t count, int64_t d) {
  int64_t c0 = 0;
  for (; c0 + 64 <= d; c0 += 64) weighted_rows<8>(o, w, runs, count, d, c0);
  if (c0 + 32 <= d) weighted_rows<4>(o, w, runs, count, d, c0), c0 += 32;
  if (c0 + 16 <= d) weighted_rows<2>(o, w, runs, count, d, c0), c0 += 16;
  if (c0 + 8 <= d) weighted_rows<1>(o, w, runs, count, d, c0), c0 += 8;
  for (int64_t r = 0; r < count; ++r) {
    for (int64_t t = 0; t < runs[r].n; ++t) {
      for (int64_t i = c0; i < d; ++i) o[i] += w[runs[r].off + t] * widen(runs[r].v[t * d + i]);
    }
  }
}

// In place on one head x [d]: optional RMSNorm with weight nw (Qwen3's q_norm / k_norm), then RoPE in the
// rotate_half convention with the position's cos/sin rows [d].
void norm_rotate(float* x, int64_t d, const float* nw, float eps, const float* cos, const float* sin) {
  if (nw != nullptr) {
    const float ss = dot(x, x, d);
    const float scale = 1.f / std::sqrt(ss / static_cast<float>(d) + eps);
    for (int64_t i = 0; i < d; ++i) x[i] = x[i] * scale * nw[i];
  }
  const int64_t half = d / 2;
  float tmp[1024];
  std::memcpy(tmp, x, d * sizeof(float));
  for (int64_t i = 0; i < half; ++i) x[i] = tmp[i] * cos[i] - tmp[i + half] * sin[i];
  for (int64_t i = half; i < d; ++i) x[i] = tmp[i] * cos[i] + tmp[i - half] * sin[i];
}

// One decode token for each of n sequences through one layer's attention. qkv [n, (hq + 2 hkv) d] is the
// fused projection's output; row r belongs to the sequence whose layer buffers are keys[r]/values[r]
// [1, hkv, capacity, d] and goes to slot slots[r] at the RoPE angles of cos[r]/sin[r] [d]. q and k are
// normed (when q_norm/k_norm are given) and rotated, k and v written to the slot, and q attends to slots
// 0..slot: softmax(q.k / sqrt(d)) v. Returns the attention output [n, hq d], heads in order.
// With prefix_count (one entry per row), row r's keys start with prefix_count[r] shared blocks, the next ones
// of `prefix` ([2, L, hkv, B, d] each: keys then values of L layers, this call's being `layer`), read in
// place; its buffers then hold the keys after them, so it attends to prefix_count[r] * B + slot + 1 keys.
// The buffers and blocks are fp32 or bf16 alike (E: float, or uint16_t for bf16): k and v are computed in fp32 and
// rounded as written, keys and values widened as read, every sum in fp32.
template <class E>
at::Tensor attend_as(const at::Tensor& qkv, at::TensorList keys, at::TensorList values, at::IntArrayRef slots,
                     const at::Tensor& cos, const at::Tensor& sin, const std::optional<at::Tensor>& q_norm,
                     const std::optional<at::Tensor>& k_norm, double eps, int64_t hq, int64_t hkv,
                     at::TensorList prefix, at::IntArrayRef prefix_count, int64_t layer) {
  const int64_t rows = qkv.dim() == 2 ? qkv.size(0) : 0;
  TORCH_CHECK(qkv.is_contiguous() && qkv.scalar_type() == at::kFloat && rows > 0,
              "attend: qkv must be contiguous fp32 [n, (hq + 2 hkv) d]");
  TORCH_CHECK(static_cast<int64_t>(keys.size()) == rows && static_cast<int64_t>(values.size()) == rows &&
                  static_cast<int64_t>(slots.size()) == rows,
              "attend: keys, values and slots need one entry per row of qkv");
  TORCH_CHECK(hkv > 0 && hq % hkv == 0, "attend: hq must be a multiple of hkv");
  const int64_t d = qkv.size(1) / (hq + 2 * hkv);
  TORCH_CHECK(qkv.size(1) == (hq + 2 * hkv) * d, "attend: qkv has the wrong size");
  TORCH_CHECK(d <= 1024 && d % 2 == 0, "attend: head_dim must be even and at most 1024");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.numel() == rows * d && sin.numel() == rows * d,
              "attend: cos/sin must be contiguous [n, head_dim]");
  for (int64_t r = 0; r < rows; ++r) {
    const at::Tensor& k = keys[r];
    TORCH_CHECK(k.is_contiguous() && values[r].is_contiguous() && k.dim() == 4 && k.sizes() == values[r].sizes() &&
                    k.scalar_type() == kvtool_cpu::kv_kind<E> && values[r].scalar_type() == kvtool_cpu::kv_kind<E>,
                "attend: keys and values must be contiguous [1, hkv, capacity, d], all of one dtype");
    TORCH_CHECK(k.size(1) == hkv && k.size(3) == d, "attend: head counts or head_dim do not match the buffers");
    TORCH_CHECK(slots[r] >= 0 && slots[r] < k.size(2), "attend: slot is outside the buffers");
  }
  TORCH_CHECK(prefix_count.empty() || static_cast<int64_t>(prefix_count.size()) == rows,
              "attend: prefix_count needs one entry per row of qkv, or none");
  std::vector<int64_t> first_block(rows + 1, 0), shared(rows, 0);  // row r: its first block, its shared tokens
  for (int64_t r = 0; r < rows; ++r) {
    first_block[r + 1] = first_block[r] + (prefix_count.empty() ? 0 : prefix_count[r]);
  }
  TORCH_CHECK(first_block[rows] == static_cast<int64_t>(prefix.size()), "attend: prefix_count does not add up to "
              "the blocks given");
  int64_t bs = 1, nl = 0;
  const std::vector<E*> block = kvtool_cpu::block_pointers<E>(prefix, layer, hkv, d, bs, nl, "attend");
  for (int64_t r = 0; r < rows; ++r) shared[r] = (first_block[r + 1] - first_block[r]) * bs;
  const float* qn = q_norm.has_value() ? q_norm->data_ptr<float>() : nullptr;
  const float* kn = k_norm.has_value() ? k_norm->data_ptr<float>() : nullptr;
  const int64_t width = (hq + 2 * hkv) * d, group = hq / hkv;
  // The runs of keys t0 .. t0 + n - 1 of row r's kv head g, into out: a shared block's, then the buffers'
  auto runs = [&](int64_t r, int64_t g, int64_t t0, int64_t n, std::vector<Run<E>>& out) {
    out.clear();
    int64_t t = t0;
    for (; t < t0 + n && t < shared[r]; t += bs - t % bs) {
      const E* b = block[first_block[r] + t / bs];
      const int64_t in = t % bs;
      out.push_back({b + ((layer * hkv + g) * bs + in) * d, b + (((nl + layer) * hkv + g) * bs + in) * d, t - t0,
                     std::min(bs - in, t0 + n - t)});
    }
    if (t < t0 + n) {
      const int64_t pos = g * keys[r].size(2) + t - shared[r];
      out.push_back({static_cast<const E*>(keys[r].data_ptr()) + pos * d,
                     static_cast<const E*>(values[r].data_ptr()) + pos * d, t - t0, t0 + n - t});
    }
  };

  std::vector<float> q(rows * hq * d);
  for (int64_t r = 0; r < rows; ++r) {
    const float* in = qkv.data_ptr<float>() + r * width;
    const float* cp = cos.data_ptr<float>() + r * d;
    const float* sp = sin.data_ptr<float>() + r * d;
    const int64_t cap = keys[r].size(2), slot = slots[r];
    std::memcpy(q.data() + r * hq * d, in, hq * d * sizeof(float));
    for (int64_t h = 0; h < hq; ++h) norm_rotate(q.data() + (r * hq + h) * d, d, qn, static_cast<float>(eps), cp, sp);
    for (int64_t g = 0; g < hkv; ++g) {
      float k[1024];
      std::memcpy(k, in + (hq + g) * d, d * sizeof(float));
      norm_rotate(k, d, kn, static_cast<float>(eps), cp, sp);
      kvtool_cpu::narrow_row(k, static_cast<E*>(keys[r].data_ptr()) + (g * cap + slot) * d, d);
      kvtool_cpu::narrow_row(in + (hq + hkv + g) * d, static_cast<E*>(values[r].data_ptr()) + (g * cap + slot) * d, d);
    }
  }

  // Flash-decoding: each row's keys are split into chunks of CHUNK slots; an item, one (row, kv head, chunk),
  // scores the kv head's whole group of q heads against its keys (each key read once for the group) and
  // keeps the chunk's max score m, sum of exp(score - m) l and unnormalised output o; items merge per head.
  constexpr int64_t CHUNK = 256;
  struct Item { int64_t row, g, t0, n; };
  std::vector<Item> items;
  std::vector<int64_t> first(rows + 1);  // items of row r: first[r] .. first[r + 1] - 1, kv head by kv head
  int64_t keys_total = 0;
  for (int64_t r = 0; r < rows; ++r) {
    first[r] = static_cast<int64_t>(items.size());
    const int64_t len = shared[r] + slots[r] + 1;
    keys_total += len * hkv;
    for (int64_t g = 0; g < hkv; ++g) {
      for (int64_t t0 = 0; t0 < len; t0 += CHUNK) items.push_back({r, g, t0, std::min(len - t0, CHUNK)});
    }
  }
  first[rows] = static_cast<int64_t>(items.size());
  const int64_t count = first[rows];
  const float scale = 1.f / std::sqrt(static_cast<float>(d));
  std::vector<float> part_o(count * group * d), part_m(count * group), part_l(count * group);
  // Items run in parallel once there are enough keys to pay for waking the other threads.
  const int64_t grain = keys_total >= 512 ? 1 : count;
  at::parallel_for(0, count, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> score(group * CHUNK);
    std::vector<Run<E>> pieces;
    for (int64_t it = begin; it < end; ++it) {
      const Item& item = items[it];
      const int64_t n = item.n;
      const float* qg = q.data() + (item.row * hq + item.g * group) * d;
      runs(item.row, item.g, item.t0, n, pieces);
      for (size_t p = 0; p < pieces.size(); ++p) {
        if (p + 1 < pieces.size()) {  // the next run's keys and values, while this one is read
          for (int64_t i = 0; i < std::min(pieces[p + 1].n, bs) * d; i += 64 / sizeof(E)) {
            __builtin_prefetch(pieces[p + 1].k + i);
            __builtin_prefetch(pieces[p + 1].v + i);
          }
        }
        const Run<E>& run = pieces[p];
        int64_t t = 0;
#if defined(__AVX2__) && defined(__FMA__)
        for (; d % 8 == 0 && t + 8 <= run.n; t += 8) {
          for (int64_t j = 0; j < group; ++j) {
            float* sj = score.data() + j * CHUNK + run.off + t;
            dot8(qg + j * d, run.k + t * d, d, sj);
            for (int u = 0; u < 8; ++u) sj[u] *= scale;
          }
        }
#endif
        for (; t < run.n; ++t) {
          for (int64_t j = 0; j < group; ++j) {
            score[j * CHUNK + run.off + t] = dot_as(qg + j * d, run.k + t * d, d) * scale;
          }
        }
      }
      float* o = part_o.data() + it * group * d;
      std::fill(o, o + group * d, 0.f);
      for (int64_t j = 0; j < group; ++j) {
        float* sj = score.data() + j * CHUNK;
        float mx = -INFINITY;
        for (int64_t t = 0; t < n; ++t) mx = sj[t] > mx ? sj[t] : mx;
        part_m[it * group + j] = mx;
        part_l[it * group + j] = exp_sum(sj, n, mx);
      }
      for (int64_t j = 0; j < group; ++j) {
        weighted_sum(o + j * d, score.data() + j * CHUNK, pieces.data(), static_cast<int64_t>(pieces.size()), d);
      }
    }
  });

  at::Tensor out = at::empty({rows, hq * d}, qkv.options());
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t chunks = (first[r + 1] - first[r]) / hkv;
    for (int64_t g = 0; g < hkv; ++g) {
      for (int64_t j = 0; j < group; ++j) {
        const int64_t base = first[r] + g * chunks;
        float mx = -INFINITY, total = 0.f;
        for (int64_t c = 0; c < chunks; ++c) mx = std::max(mx, part_m[(base + c) * group + j]);
        float* oh = out.data_ptr<float>() + (r * hq + g * group + j) * d;
        std::fill(oh, oh + d, 0.f);
        for (int64_t c = 0; c < chunks; ++c) {
          const int64_t at = (base + c) * group + j;
          const float w = std::exp(part_m[at] - mx);
          total += w * part_l[at];
          const float* oc = part_o.data() + at * d;
          for (int64_t i = 0; i < d; ++i) oh[i] += w * oc[i];
        }
        for (int64_t i = 0; i < d; ++i) oh[i] /= total;
      }
    }
  }
  return out;
}

at::Tensor attend(const at::Tensor& qkv, at::TensorList keys, at::TensorList values, at::IntArrayRef slots,
                  const at::Tensor& cos, const at::Tensor& sin, const std::optional<at::Tensor>& q_norm,
                  const std::optional<at::Tensor>& k_norm, double eps, int64_t hq, int64_t hkv,
                  at::TensorList prefix, at::IntArrayRef prefix_count, int64_t layer) {
  TORCH_CHECK(!keys.empty(), "attend: keys need one entry per row of qkv");
  return kvtool_cpu::with_kv_type(keys[0].scalar_type(), "attend", [&](auto kind) {
    return attend_as<decltype(kind)>(qkv, keys, values, slots, cos, sin, q_norm, k_norm, eps, hq, hkv, prefix,
                                     prefix_count, layer);
  });
}

// All decoder layers of one decode step in one call (kvtool.models.cpu_step.DecodeStep), each as the
// eight ops above: RMSNorm, the qkv product (+ bias), attend, the o product + residual, RMSNorm, gate_up,
// silu * up, down + residual. Per layer: norms holds the input and post-attention RMSNorm weights; mats
// the qkv, o, gate_up and down weights, each one fp32 or bf16 tensor, or with q4 its codes and
// scale_zero; qkv_bias one entry and qk_norms two (q, k), None where the model has none; keys and
// values one buffer per row; prefix and prefix_count the rows' shared blocks as for attend, the same for
// every layer. Returns the hidden states after the last layer.
at::Tensor layers(const at::Tensor& x0, at::TensorList norms, at::TensorList mats,
                  const c10::List<std::optional<at::Tensor>>& qkv_bias,
                  const c10::List<std::optional<at::Tensor>>& qk_norms, at::TensorList keys, at::TensorList values,
                  at::IntArrayRef slots, const at::Tensor& cos, const at::Tensor& sin, double eps, double qk_eps,
                  int64_t hq, int64_t hkv, bool q4, at::TensorList prefix, at::IntArrayRef prefix_count) {
  TORCH_CHECK(x0.dim() == 2, "layers: x must be [rows, hidden]");
  const int64_t count = static_cast<int64_t>(norms.size()) / 2, rows = x0.size(0), per = q4 ? 8 : 4;
  TORCH_CHECK(static_cast<int64_t>(norms.size()) == 2 * count && static_cast<int64_t>(mats.size()) == per * count &&
                  static_cast<int64_t>(qkv_bias.size()) == count &&
                  static_cast<int64_t>(qk_norms.size()) == 2 * count &&
                  static_cast<int64_t>(keys.size()) == rows * count &&
                  static_cast<int64_t>(values.size()) == rows * count,
              "layers: per layer, norms needs 2 entries, mats ", per, ", qkv_bias 1, qk_norms 2, keys and values "
              "one per row");
  auto product = [&](int64_t layer, int64_t which, const at::Tensor& in, const std::optional<at::Tensor>& bias,
                     const std::optional<at::Tensor>& residual) {
    if (q4) return gemv_q4(in, mats[per * layer + 2 * which], mats[per * layer + 2 * which + 1], bias, residual);
    return gemv(in, mats[per * layer + which], bias, residual);
  };
  at::Tensor x = x0;
  for (int64_t layer = 0; layer < count; ++layer) {
    const at::Tensor qkv = product(layer, 0, rms_norm(x, norms[2 * layer], eps), qkv_bias.get(layer), std::nullopt);
    const at::Tensor out = attend(qkv, keys.slice(layer * rows, rows), values.slice(layer * rows, rows), slots, cos,
                                  sin, qk_norms.get(2 * layer), qk_norms.get(2 * layer + 1), qk_eps, hq, hkv, prefix,
                                  prefix_count, layer);
    x = product(layer, 1, out, std::nullopt, x);
    const at::Tensor gate_up = product(layer, 2, rms_norm(x, norms[2 * layer + 1], eps), std::nullopt, std::nullopt);
    x = product(layer, 3, silu_mul(gate_up), std::nullopt, x);
  }
  return x;
}

}  // namespace

TORCH_LIBRARY(kvtool_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor w, float eps, bool half=False) -> Tensor");
  m.def("silu_mul(Tensor gu) -> Tensor");
  m.def("gemv(Tensor x, Tensor w, Tensor? bias, Tensor? residual) -> Tensor");
  m.def("gemv_q4(Tensor x, Tensor codes, Tensor scale_zero, Tensor? bias, Tensor? residual) -> Tensor");
  m.def("gemv_q8(Tensor x, Tensor codes, Tensor scale) -> Tensor");
  m.def("attend(Tensor qkv, Tensor(a!)[] keys, Tensor(b!)[] values, int[] slots, Tensor cos, Tensor sin, "
        "Tensor? q_norm, Tensor? k_norm, float eps, int hq, int hkv, Tensor[] prefix, int[] prefix_count, "
        "int layer) -> Tensor");
  m.def("layers(Tensor x, Tensor[] norms, Tensor[] mats, Tensor?[] qkv_bias, Tensor?[] qk_norms, Tensor(a!)[] keys, "
        "Tensor(b!)[] values, int[] slots, Tensor cos, Tensor sin, float eps, float qk_eps, int hq, int hkv, "
        "bool q4, Tensor[] prefix, int[] prefix_count) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvtool_cpu, CPU, m) {
  m.impl("rms_norm", rms_norm);
  m.impl("silu_mul", silu_mul);
  m.impl("gemv", gemv);
  m.impl("gemv_q4", gemv_q4);
  m.impl("gemv_q8", gemv_q8);
  m.impl("attend", attend);
  m.impl("layers", layers);
}
