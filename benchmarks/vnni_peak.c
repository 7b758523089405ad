/* Peak AVX512-VNNI throughput of one core: 12 independent vpdpbusd chains on zmm and on
 * ymm registers, and a dependent scalar add chain as a clock estimate (one add a cycle).
 * Twice the zmm figure (2 cores) is the int8 MAC peak a prefill's MFU is stated against
 * (docs/results.md); the low-bit kernels also spend a cvt and two or three float ops per
 * 8 dots (each group's scales), so they cannot reach it.
 *
 * The chains are named variables tied to registers by an empty asm (accumulators in an
 * array were kept in memory, a load and a store around every dot: half the real rate).
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

#define CHAINS(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11)
#define PIN(T, a)                                                                       \
  __asm__ volatile("" : "+v"(a##0), "+v"(a##1), "+v"(a##2), "+v"(a##3), "+v"(a##4),    \
                   "+v"(a##5), "+v"(a##6), "+v"(a##7), "+v"(a##8), "+v"(a##9),         \
                   "+v"(a##10), "+v"(a##11))

int main(void) {
  const long n = 100000000;
#define DECL(i) __m512i a##i = _mm512_set1_epi32(i); __m256i b##i = _mm256_set1_epi32(i);
  CHAINS(DECL)
  const __m512i w = _mm512_set1_epi8(3), x = _mm512_set1_epi8(5);
  const __m256i w2 = _mm256_set1_epi8(3), x2 = _mm256_set1_epi8(5);
  double t = now();
  for (long k = 0; k < n; k++) {
#define DOT(i) a##i = _mm512_dpbusd_epi32(a##i, w, x);
    CHAINS(DOT)
    PIN(__m512i, a);
  }
  const double zmm = n * 12 / (now() - t) / 1e9;
  t = now();
  for (long k = 0; k < n; k++) {
#define DOT2(i) b##i = _mm256_dpbusd_epi32(b##i, w2, x2);
    CHAINS(DOT2)
    PIN(__m256i, b);
  }
  const double ymm = n * 12 / (now() - t) / 1e9;
  long s = 0;
#define SUM(i) s += _mm512_reduce_add_epi32(a##i) + _mm256_extract_epi32(b##i, 0);
  CHAINS(SUM)

  long v = 0;
  t = now();
  for (long k = 0; k < 1000000000; k++) __asm__ volatile("add $1, %0" : "+r"(v));
  const double ghz = 1.0 / (now() - t);

  printf("vpdpbusd zmm: %.2f per ns = %.0f G MAC/s (64 a dot)\n", zmm, zmm * 64);
  printf("vpdpbusd ymm: %.2f per ns = %.0f G MAC/s (32 a dot)\n", ymm, ymm * 32);
  printf("clock ~%.2f GHz (dependent adds); checksum %ld\n", ghz, s);
  return 0;
}
