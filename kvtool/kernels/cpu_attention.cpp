// Causal attention of a prefill chunk on the CPU (torch.ops.kvtool_cpu.prefill_attention), built into the library
// of cpu_decode.cpp by kvtool/kernels/cpu_decode.py; kvtool.models.cpu_prefill calls it and says why.
//
// A work item is one KV head and a block of the chunk's positions; its query rows are those positions' whole group
// of query heads (position-major), so each key is read once for the group. The item goes over its keys in tiles:
// scores S^T [keys, rows] = K Q^T (the queries transposed once per item, the keys read in place from the shared
// blocks or the buffers), the online softmax down each column (eight rows per vector: no horizontal sums), then
// O += P V. Keys past a row's own position get no weight. Each item runs on one thread in a fixed order, so the
// result does not depend on the thread count, nor on the vector width (eight floats with AVX2, sixteen with
// AVX-512): every lane does the same steps in the same order. The keys and values are fp32 or bf16 (an engine's
// kv_dtype), bf16 widened to fp32 as read.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "cpu_simd.h"

namespace {

// The few vector operations the tiles need, W floats at a time: V8 (AVX2 where the build has it, else plain loops)
// and, where the build has AVX-512, V16. KR keys per pass of the score kernel, NV vectors of dims per pass of the
// value kernel (as many accumulators as the registers hold). Every lane does the same steps in the same order at
// either width, so both give the same bits.

// The operations both widths spell alike, but for the intrinsics' prefix P and WIDEN, the load of W bf16 values
// widened to fp32 (cpu_simd.h).
#define KVTOOL_VEC_OPS(P, WIDEN)                                               \
  static t load(const float* p) { return P##_loadu_ps(p); }                    \
  static t load(const uint16_t* p) { return WIDEN(p); }                        \
  static void store(float* p, t a) { P##_storeu_ps(p, a); }                    \
  static t splat(float a) { return P##_set1_ps(a); }                           \
  static t fma(t a, t b, t c) { return P##_fmadd_ps(a, b, c); }                \
  static t vmax(t a, t b) { return P##_max_ps(a, b); }                         \
  static t vsub(t a, t b) { return P##_sub_ps(a, b); }                         \
  static t vadd(t a, t b) { return P##_add_ps(a, b); }
#if defined(__AVX2__) && defined(__FMA__)
struct V8 {
  using t = __m256;
  static constexpr int W = 8, KR = 6, NV = 2;
  KVTOOL_VEC_OPS(_mm256, kvtool_cpu::load8)
  // b where a > -inf, else 0
  static t keep_finite(t a, t b) { return _mm256_and_ps(b, _mm256_cmp_ps(a, splat(-INFINITY), _CMP_GT_OQ)); }
  static t vexp(t x) { return kvtool_cpu::exp8(x); }  // for x <= 0 (cpu_simd.h)
};
#else
struct V8 {
  struct t { float v[8]; };
  static constexpr int W = 8, KR = 6, NV = 2;
#define KVTOOL_EACH(expr) t r; for (int i = 0; i < 8; ++i) r.v[i] = (expr); return r
  template <class E>
  static t load(const E* p) { KVTOOL_EACH(kvtool_cpu::widen(p[i])); }
  static void store(float* p, t a) { for (int i = 0; i < 8; ++i) p[i] = a.v[i]; }
  static t splat(float a) { KVTOOL_EACH(a); }
  static t fma(t a, t b, t c) { KVTOOL_EACH(a.v[i] * b.v[i] + c.v[i]); }
  static t vmax(t a, t b) { KVTOOL_EACH(std::max(a.v[i], b.v[i])); }
  static t vsub(t a, t b) { KVTOOL_EACH(a.v[i] - b.v[i]); }
  static t vadd(t a, t b) { KVTOOL_EACH(a.v[i] + b.v[i]); }
  static t keep_finite(t a, t b) { KVTOOL_EACH(a.v[i] > -INFINITY ? b.v[i] : 0.f); }
  static t vexp(t x) { KVTOOL_EACH(std::exp(x.v[i])); }
#undef KVTOOL_EACH
};
#endif
#if defined(__AVX512F__)
struct V16 {
  using t = __m512;
  static constexpr int W = 16, KR = 12, NV = 4;
  KVTOOL_VEC_OPS(_mm512, kvtool_cpu::load16)
  static t keep_finite(t a, t b) { return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(a, splat(-INFINITY), _CMP_GT_OQ), b); }
  static t vexp(t x) { return kvtool_cpu::exp16(x); }
};
#endif
#undef KVTOOL_VEC_OPS

constexpr int64_t TILE = 64;  // keys per tile
constexpr int ROWS = 6;  // query rows per pass of the value kernel

// s [R, 2W] (row stride ld) = the R keys k[0..R) (each d values, fp32 or bf16) against 2W transposed queries
// qt [d, ld].
template <class V, int R, class E>
inline void scores(const E* const* k, const float* qt, int64_t ld, int64_t d, float* s) {
  typename V::t acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = V::splat(0.f);
  for (int64_t i = 0; i < d; ++i) {
    const typename V::t q0 = V::load(qt + i * ld), q1 = V::load(qt + i * ld + V::W);
    for (int r = 0; r < R; ++r) {
      const typename V::t kr = V::splat(kvtool_cpu::widen(k[r][i]));
      acc[r][0] = V::fma(kr, q0, acc[r][0]);
      acc[r][1] = V::fma(kr, q1, acc[r][1]);
    }
  }
  for (int r = 0; r < R; ++r) V::store(s + r * ld, acc[r][0]), V::store(s + r * ld + V::W, acc[r][1]);
}

// o [R, W NV dims from c] (row stride d) += sum over the n keys of p [key, row] (row stride ld) * v[key][c..].
template <class V, int R, int NV, class E>
inline void weigh(const float* p, int64_t ld, const E* const* v, int64_t n, int64_t c, int64_t d, float* o) {
  typename V::t acc[R][NV];
  for (int r = 0; r < R; ++r) for (int j = 0; j < NV; ++j) acc[r][j] = V::load(o + r * d + c + V::W * j);
  for (int64_t t = 0; t < n; ++t) {
    typename V::t vt[NV];
    for (int j = 0; j < NV; ++j) vt[j] = V::load(v[t] + c + V::W * j);
    for (int r = 0; r < R; ++r) {
      const typename V::t w = V::splat(p[t * ld + r]);
      for (int j = 0; j < NV; ++j) acc[r][j] = V::fma(w, vt[j], acc[r][j]);
    }
  }
  for (int r = 0; r < R; ++r) for (int j = 0; j < NV; ++j) V::store(o + r * d + c + V::W * j, acc[r][j]);
}

template <class V, int R, class E>
void scores_n(int rest, const E* const* k, const float* qt, int64_t ld, int64_t d, float* s) {
  if constexpr (R > 0) {
    if (rest == R) return scores<V, R, E>(k, qt, ld, d, s);
    scores_n<V, R - 1, E>(rest, k, qt, ld, d, s);
  }
}

template <class V, int R, int NV, class E>
void weigh_n(int rest, const float* p, int64_t ld, const E* const* v, int64_t n, int64_t c, int64_t d, float* o) {
  if constexpr (R > 0) {
    if (rest == R) return weigh<V, R, NV, E>(p, ld, v, n, c, d, o);
    weigh_n<V, R - 1, NV, E>(rest, p, ld, v, n, c, d, o);
  }
}

// The work items begin .. end - 1 of prefill_attention at W = V::W floats a vector; row(kv, g, pos) is the key
// (kv 0) or value (kv 1) of KV head g at position pos, a pointer to E (float, or uint16_t for bf16).
template <class V, class E, class Row>
void attend_items(int64_t begin, int64_t end, const Row& row, const float* qp, float* op, int64_t T, int64_t hq,
                  int64_t d, int64_t group, int64_t per, int64_t blocks_of_t, int64_t slot) {
  constexpr int64_t COLS = 2 * V::W;  // query rows per pass of the score kernel; rows are padded to it
  const int64_t pad = (per * group + COLS - 1) / COLS * COLS;
  const float scale = 1.f / std::sqrt(static_cast<float>(d));
  std::vector<float> qt(d * pad), s(TILE * pad), o(pad * d), m(pad), l(pad), alpha(pad);
  std::vector<const E*> kr(TILE), vr(TILE);
  for (int64_t it = begin; it < end; ++it) {
    // items of one KV head alternate between early and late blocks, so a thread's share of items is even
    const int64_t g = it / blocks_of_t, k = it % blocks_of_t;
    const int64_t blk = k % 2 ? blocks_of_t - 1 - k / 2 : k / 2;
    const int64_t p0 = blk * per, np = std::min(per, T - p0), rows = np * group;
    std::fill(qt.begin(), qt.end(), 0.f);
    for (int64_t r = 0; r < rows; ++r) {
      const float* src = qp + ((p0 + r / group) * hq + g * group + r % group) * d;
      for (int64_t i = 0; i < d; ++i) qt[i * pad + r] = src[i] * scale;
    }
    std::fill(o.begin(), o.end(), 0.f);
    std::fill(m.begin(), m.end(), -INFINITY);
    std::fill(l.begin(), l.end(), 0.f);
    const int64_t last = slot + p0 + np;  // keys 0 .. last - 1 reach some row
    for (int64_t c0 = 0; c0 < last; c0 += TILE) {
      const int64_t nk = std::min(TILE, last - c0);
      for (int64_t t = 0; t < nk; ++t) kr[t] = row(0, g, c0 + t), vr[t] = row(1, g, c0 + t);
      for (int64_t t = 0; t < nk; t += V::KR) {
        const int rest = static_cast<int>(std::min<int64_t>(V::KR, nk - t));
        for (int64_t r = 0; r < pad; r += COLS) scores_n<V, V::KR>(rest, kr.data() + t, qt.data() + r, pad, d,
                                                                   s.data() + t * pad + r);
      }
      if (c0 + nk > slot + p0 + 1) {  // keys past some row's position: no weight for them
        for (int64_t r = 0; r < rows; ++r) {
          const int64_t own = slot + p0 + r / group + 1 - c0;  // keys of the tile that row r sees
          for (int64_t t = std::max<int64_t>(0, own); t < nk; ++t) s[t * pad + r] = -INFINITY;
        }
      }
      for (int64_t r = 0; r < pad; r += V::W) {  // online softmax down the columns, W rows at a time
        typename V::t mx = V::load(m.data() + r);
        for (int64_t t = 0; t < nk; ++t) mx = V::vmax(mx, V::load(s.data() + t * pad + r));
        typename V::t sum = V::splat(0.f);
        for (int64_t t = 0; t < nk; ++t) {
          const typename V::t x = V::load(s.data() + t * pad + r);
          const typename V::t p = V::keep_finite(x, V::vexp(V::vsub(x, mx)));
          V::store(s.data() + t * pad + r, p);
          sum = V::vadd(sum, p);
        }
        const typename V::t a = V::keep_finite(V::load(m.data() + r), V::vexp(V::vsub(V::load(m.data() + r), mx)));
        V::store(alpha.data() + r, a);
        V::store(l.data() + r, V::fma(V::load(l.data() + r), a, sum));
        V::store(m.data() + r, mx);
      }
      for (int64_t r = 0; r < rows; ++r) {
        if (alpha[r] != 1.f) {
          for (int64_t i = 0; i < d; ++i) o[r * d + i] *= alpha[r];
        }
      }
      for (int64_t r = 0; r < rows; r += ROWS) {
        const int rest = static_cast<int>(std::min<int64_t>(ROWS, rows - r));
        int64_t c = 0;
        for (; c + V::NV * V::W <= d; c += V::NV * V::W)
          weigh_n<V, ROWS, V::NV>(rest, s.data() + r, pad, vr.data(), nk, c, d, o.data() + r * d);
        for (; c < d; c += V::W) weigh_n<V, ROWS, 1>(rest, s.data() + r, pad, vr.data(), nk, c, d, o.data() + r * d);
      }
    }
    for (int64_t r = 0; r < rows; ++r) {
      float* dst = op + ((p0 + r / group) * hq + g * group + r % group) * d;
      const float inv = 1.f / l[r];
      for (int64_t i = 0; i < d; ++i) dst[i] = o[r * d + i] * inv;
    }
  }
}

// Attention out [T, hq, d] of a chunk's T queries q [T, hq, d] at positions slot .. slot + T - 1. Keys and values
// 0 .. base - 1 are in the blocks [2, L, hkv, B, d] (this layer's part; n B == base), base onwards in the
// buffers keys/values [1, hkv, capacity, d] from their slot 0; the chunk's own are already written to either. width: 0
// for the widest vectors the build has (sixteen floats with AVX-512 where d is a multiple of 16), 8 for eight. The
// blocks and buffers are fp32 or bf16 alike (E: float, or uint16_t for bf16, widened as read; sums in fp32).
template <class E>
at::Tensor prefill_attention_as(const at::Tensor& q, at::TensorList blocks, int64_t layer, const at::Tensor& keys,
                                const at::Tensor& values, int64_t base, int64_t slot, int64_t width) {
  TORCH_CHECK(q.is_contiguous() && q.scalar_type() == at::kFloat && q.dim() == 3 && q.size(0) > 0,
              "prefill_attention: q must be contiguous fp32 [T, hq, d]");
  TORCH_CHECK(keys.is_contiguous() && values.is_contiguous() && keys.dim() == 4 && keys.sizes() == values.sizes() &&
                  keys.scalar_type() == values.scalar_type(),
              "prefill_attention: keys and values must be contiguous [1, hkv, capacity, d] of one dtype");
  TORCH_CHECK(width == 0 || width == 8, "prefill_attention: width must be 0 (the widest) or 8, got ", width);
  const int64_t T = q.size(0), hq = q.size(1), d = q.size(2), hkv = keys.size(1), cap = keys.size(2);
  TORCH_CHECK(keys.size(3) == d && d % 8 == 0 && hkv > 0 && hq % hkv == 0,
              "prefill_attention: head_dim must match the buffers' and be a multiple of 8, hq a multiple of hkv");
  int64_t bs = 1, nl = 0;
  const std::vector<E*> block = kvtool_cpu::block_pointers<E>(blocks, layer, hkv, d, bs, nl, "prefill_attention");
  const int64_t n = static_cast<int64_t>(block.size());
  TORCH_CHECK(base == n * (n ? bs : 0) && slot >= 0 && slot + T - base <= cap,
              "prefill_attention: positions ", slot, "..", slot + T - 1, " do not fit ", n, " blocks (", base,
              " tokens) and buffers of ", cap);
  const E* own[2] = {static_cast<const E*>(keys.data_ptr()), static_cast<const E*>(values.data_ptr())};
  // where the key (kv 0) or value (kv 1) of KV head g at position pos is, for every pos a query sees: looked up,
  // not divided out per key (a division per key and tile took ~5% of a 2,048-token prefill's attention)
  const int64_t total = slot + T;
  std::vector<const E*> at(2 * hkv * total);
  for (int64_t kv = 0; kv < 2; ++kv) {
    for (int64_t g = 0; g < hkv; ++g) {
      const E** dst = at.data() + (kv * hkv + g) * total;
      for (int64_t pos = 0; pos < std::min(base, total); ++pos) {
        dst[pos] = block[pos / bs] + (((kv * nl + layer) * hkv + g) * bs + pos % bs) * d;
      }
      for (int64_t pos = base; pos < total; ++pos) dst[pos] = own[kv] + (g * cap + pos - base) * d;
    }
  }
  auto row = [&](int kv, int64_t g, int64_t pos) -> const E* { return at[(kv * hkv + g) * total + pos]; };
  const int64_t group = hq / hkv, per = std::max<int64_t>(1, 96 / group);  // positions per item: ~96 query rows
  const int64_t blocks_of_t = (T + per - 1) / per, items = hkv * blocks_of_t;
  at::Tensor out = at::empty({T, hq, d}, q.options());
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
#if defined(__AVX512F__)
    if (width == 0 && d % 16 == 0)
      return attend_items<V16, E>(begin, end, row, qp, op, T, hq, d, group, per, blocks_of_t, slot);
#endif
    attend_items<V8, E>(begin, end, row, qp, op, T, hq, d, group, per, blocks_of_t, slot);
  });
  return out;
}

at::Tensor prefill_attention(const at::Tensor& q, at::TensorList blocks, int64_t layer, const at::Tensor& keys,
                             const at::Tensor& values, int64_t base, int64_t slot, int64_t width) {
  return kvtool_cpu::with_kv_type(keys.scalar_type(), "prefill_attention", [&](auto kind) {
    return prefill_attention_as<decltype(kind)>(q, blocks, layer, keys, values, base, slot, width);
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvtool_cpu, m) {
  m.def("prefill_attention(Tensor q, Tensor[] blocks, int layer, Tensor keys, Tensor values, int base, int slot, "
        "int width=0) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvtool_cpu, CPU, m) { m.impl("prefill_attention", prefill_attention); }
