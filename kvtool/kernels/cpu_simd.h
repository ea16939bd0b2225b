// Helpers the C++ ops share (cpu_decode.cpp, cpu_prefill.cpp, cpu_attention.cpp); kvtool/kernels/cpu_decode.py
// builds them into one library and hashes this header with the sources.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <cstring>
#include <vector>

namespace kvtool_cpu {

// bf16 values are held as their bits (uint16_t): bf16 weights, and a KV cache's keys and values where the engine
// keeps them in bf16. widen() is exact; narrow() rounds to nearest even, as torch's fp32 -> bf16 (a NaN stays
// one). The ops that read or write a KV cache are templates over its element type, float or uint16_t.
inline float bf16_to_float(uint16_t h) {
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
inline float widen(float v) { return v; }
inline float widen(uint16_t h) { return bf16_to_float(h); }
inline void narrow(float f, float* dst) { *dst = f; }
inline void narrow(float f, uint16_t* dst) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  *dst = (u & 0x7fffffffu) > 0x7f800000u ? uint16_t{0x7fc0} : static_cast<uint16_t>(rounded);
}
// dst[0 .. n) = src[0 .. n), rounded where T is bf16
template <class T>
inline void narrow_row(const float* src, T* dst, int64_t n) {
  if constexpr (sizeof(T) == sizeof(float)) {
    std::memcpy(dst, src, n * sizeof(float));
  } else {
    for (int64_t i = 0; i < n; ++i) narrow(src[i], dst + i);
  }
}

template <class T>
constexpr at::ScalarType kv_kind = sizeof(T) == sizeof(float) ? at::kFloat : at::kBFloat16;

// A KV op's body f(T{}) for its cache's element type `kind`: float for fp32, uint16_t (bits) for bf16.
template <class F>
auto with_kv_type(at::ScalarType kind, const char* what, F&& f) {
  TORCH_CHECK(kind == at::kFloat || kind == at::kBFloat16, what, ": the KV cache must be fp32 or bf16, got ", kind);
  return kind == at::kFloat ? f(float{}) : f(uint16_t{});
}

// The data of a sequence's blocks [2, L, hkv, B, d] (keys then values of L layers), checked to be contiguous and of
// element type T alike, with L > layer; bs and nl get B and L (1 and 0 without blocks). `what` names the op in
// errors.
template <class T>
std::vector<T*> block_pointers(at::TensorList blocks, int64_t layer, int64_t hkv, int64_t d, int64_t& bs, int64_t& nl,
                               const char* what) {
  std::vector<T*> out(blocks.size());
  const bool some = !blocks.empty() && blocks[0].dim() == 5;
  bs = some ? blocks[0].size(3) : 1, nl = some ? blocks[0].size(1) : 0;
  for (size_t i = 0; i < blocks.size(); ++i) {
    const at::Tensor& b = blocks[i];
    TORCH_CHECK(b.is_contiguous() && b.scalar_type() == kv_kind<T> && b.dim() == 5 && b.size(0) == 2 &&
                    b.size(1) == nl && b.size(2) == hkv && b.size(3) == bs && b.size(4) == d && 0 <= layer &&
                    layer < nl, what, ": blocks must be contiguous [2, L, hkv, B, d] alike, L > layer, of the "
                    "buffers' dtype (", kv_kind<T>, ")");
    out[i] = static_cast<T*>(b.data_ptr());
  }
  return out;
}

}  // namespace kvtool_cpu

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

namespace kvtool_cpu {

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) {  // eight bf16 widened to fp32 exactly
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
#if defined(__AVX512F__)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) {  // sixteen bf16 widened to fp32 exactly
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
#endif

// exp(x) of eight floats x <= 0 (exp8), or of sixteen where the build has AVX-512 (exp16): Cephes' expf (range
// reduction by ln 2, a degree-5 polynomial, ~1 ulp); arguments below -87.3 give ~1e-38, not 0. One definition at
// both widths (P: the intrinsics' prefix), so each lane takes the same steps and the widths give the same bits.
#define KVTOOL_EXP(NAME, V, VI, P, ROUND, CAST)                                                                    \
  inline V NAME(V x) {                                                                                             \
    x = P##_max_ps(x, P##_set1_ps(-87.33654f));                                                                    \
    const V fx = ROUND(P##_mul_ps(x, P##_set1_ps(1.44269504088896341f)),                                            \
                       _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);                                               \
    x = P##_fnmadd_ps(fx, P##_set1_ps(0.693359375f), x);                                                           \
    x = P##_fnmadd_ps(fx, P##_set1_ps(-2.12194440e-4f), x);                                                        \
    V y = P##_set1_ps(1.9875691500e-4f);                                                                           \
    y = P##_fmadd_ps(y, x, P##_set1_ps(1.3981999507e-3f));                                                         \
    y = P##_fmadd_ps(y, x, P##_set1_ps(8.3334519073e-3f));                                                         \
    y = P##_fmadd_ps(y, x, P##_set1_ps(4.1665795894e-2f));                                                         \
    y = P##_fmadd_ps(y, x, P##_set1_ps(1.6666665459e-1f));                                                         \
    y = P##_fmadd_ps(y, x, P##_set1_ps(5.0000001201e-1f));                                                         \
    y = P##_fmadd_ps(y, P##_mul_ps(x, x), P##_add_ps(x, P##_set1_ps(1.f)));                                        \
    const VI pow2 = P##_slli_epi32(P##_add_epi32(P##_cvtps_epi32(fx), P##_set1_epi32(127)), 23);                   \
    return P##_mul_ps(y, CAST(pow2));                                                                              \
  }
KVTOOL_EXP(exp8, __m256, __m256i, _mm256, _mm256_round_ps, _mm256_castsi256_ps)
#if defined(__AVX512F__)
KVTOOL_EXP(exp16, __m512, __m512i, _mm512, _mm512_roundscale_ps, _mm512_castsi512_ps)
#endif
#undef KVTOOL_EXP

}  // namespace kvtool_cpu
#endif
