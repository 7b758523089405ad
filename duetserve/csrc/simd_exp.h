// exp for 16 float lanes, shared by the kernels that need it (silu_mul, paged attention).
#pragma once
#if defined(__AVX512F__)
#include <immintrin.h>

// e^x with the same instructions for every element: x = n ln2 + r with |r| <= ln2 / 2,
// e^r by its degree-7 Taylor polynomial (relative error < 2e-8, about 1 ulp after
// rounding), times 2^n by scalef. Inputs below -87.3 give ~0 (softmax after the max
// subtraction, silu's exp(-a) for large a), above 88.7 +inf.
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.7f)), _mm512_set1_ps(-87.3f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);     // ln2, high part
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);         // ln2, low part
  __m512 p = _mm512_set1_ps(1.f / 5040);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 720));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}
#endif
