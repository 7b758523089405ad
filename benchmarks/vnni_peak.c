/* Peak AVX512-VNNI throughput of one core: 16 independent vpdpbusd chains on zmm and on
 * ymm registers, and a dependent scalar add chain as a clock estimate (one add a cycle).
 * A low-bit GEMV over many activation rows is bound by these dots (docs/benchmarks.md,
 * 2026-11-25: what a verify row costs).
 *
 *     gcc -O2 -march=native benchmarks/vnni_peak.c -o /tmp/vnni_peak && /tmp/vnni_peak
 */
#include <immintrin.h>
#include <stdio.h>
#include <time.h>

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

int main(void) {
  const long n = 200000000;
  __m512i a[16], w = _mm512_set1_epi8(3), x = _mm512_set1_epi8(5);
  for (int i = 0; i < 16; i++) a[i] = _mm512_setzero_si512();
  double t = now();
  for (long k = 0; k < n; k++) {
    for (int i = 0; i < 16; i++) a[i] = _mm512_dpbusd_epi32(a[i], w, x);
    __asm__ volatile("" : "+v"(w));   /* keep the loop from being folded */
  }
  const double zmm = n * 16 / (now() - t) / 1e9;
  __m512i s = a[0];
  for (int i = 1; i < 16; i++) s = _mm512_add_epi32(s, a[i]);

  __m256i b[16], w2 = _mm256_set1_epi8(3), x2 = _mm256_set1_epi8(5);
  for (int i = 0; i < 16; i++) b[i] = _mm256_setzero_si256();
  t = now();
  for (long k = 0; k < n; k++) {
    for (int i = 0; i < 16; i++) b[i] = _mm256_dpbusd_epi32(b[i], w2, x2);
    __asm__ volatile("" : "+v"(w2));
  }
  const double ymm = n * 16 / (now() - t) / 1e9;
  __m256i s2 = b[0];
  for (int i = 1; i < 16; i++) s2 = _mm256_add_epi32(s2, b[i]);

  long v = 0;
  t = now();
  for (long k = 0; k < 1000000000; k++) __asm__ volatile("add $1, %0" : "+r"(v));
  const double ghz = 1.0 / (now() - t);

  printf("vpdpbusd zmm: %.2f per ns = %.0f G MAC/s (64 a dot)\n", zmm, zmm * 64);
  printf("vpdpbusd ymm: %.2f per ns = %.0f G MAC/s (32 a dot)\n", ymm, ymm * 32);
  printf("clock ~%.2f GHz (dependent adds); checksums %d %d\n", ghz,
         _mm512_reduce_add_epi32(s), _mm256_extract_epi32(s2, 0));
  return 0;
}
