// Horizontal sums of 16-lane float vectors, shared by the kernels that reduce several
// dot products at once (the low-bit GEMVs' 4 weight rows, the decode attention's 4 keys).
#pragma once
#if defined(__AVX512F__)
#include <immintrin.h>

// Four 16-lane sums at once: [sum(a), sum(b), sum(c), sum(d)] (AVX512F only).
inline __m128 sum4(__m512 a, __m512 b, __m512 c, __m512 d) {
  auto h = [](__m512 v) {
    return _mm256_add_ps(_mm512_castps512_ps256(v),
                         _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
  };
  const __m256 abcd = _mm256_hadd_ps(_mm256_hadd_ps(h(a), h(b)), _mm256_hadd_ps(h(c), h(d)));
  return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}
#endif
