// Vector helpers the C++ ops share (cpu_decode.cpp, cpu_attention.cpp); kvtool/kernels/cpu_decode.py builds them
// into one library and hashes this header with the sources.
#pragma once

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

namespace kvtool_cpu {

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
