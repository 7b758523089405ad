/* Peak AVX512-VNNI throughput of one core: 12 independent vpdpbusd chains on zmm and on
 * ymm registers, and a dependent scalar add chain as a clock estimate (one add a cycle).
 * Twice the zmm figure (2 cores) is the int8 MAC peak a prefill's MFU is stated against
 * (docs/results.md). The low-bit kernels also apply each group's scales: per 32 weights
 * (8 dots) and activation row a cvt, a mul and two FMAs (lowbit_gemv.cpp, rec_span). The
 * second part times that inner loop on L1-resident records (48 groups x 8 rows, as a
 * 512-row prefill runs them), as written and with less scale work:
 *   exact     cvt, mul, 2 FMA a group (per-32 activation scales: what the engine computes)
 *   cvt+fma   one float op pair a group (not the same sums: the ceiling if the bias and
 *             the activation scale were free)
 *   per-256   e * sc in integers, the float ops once per 8 groups (activation scales per
 *             256, as llama.cpp's Q8_K: coarser numbers)
 *   int only  an integer add a group (no scales at all: the loop's dot ceiling)
 *
 * The chains are named variables tied to registers by an empty asm (accumulators in an
 * array were kept in memory, a load and a store around every dot: half the real rate).
 *
 *     gcc -O3 -march=native benchmarks/vnni_peak.c -o /tmp/vnni_peak && /tmp/vnni_peak
 */
#include <immintrin.h>
#include <stdio.h>
#include <stdint.h>
#include <stdlib.h>
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

/* One block of 16 weight rows (lanes) and NG groups of 32 against XR activation rows,
 * the engine's record layout (8 byte vectors, then the rows' a and b): `mode` as above. */
enum { NG = 48, XR = 8, G = 32 };
typedef struct { uint8_t w[8][64]; float a[16], b[16]; } __attribute__((aligned(64))) Rec;

static inline __m512i bcast4(const int8_t* p) { return _mm512_broadcastd_epi32(_mm_loadu_si32(p)); }

__attribute__((noinline)) static void span(const Rec* rec, const int8_t* xq, const float* dx,
                                           const float* xs, __m512* out, int mode) {
  __m512 sum[XR];
  __m512i isum[XR];
  for (int i = 0; i < XR; i++) { sum[i] = _mm512_setzero_ps(); isum[i] = _mm512_setzero_si512(); }
  for (int g = 0; g < NG; g++) {
    const Rec* r = &rec[g];
    __m512i w[8];
    for (int v = 0; v < 8; v++) w[v] = _mm512_load_si512(r->w[v]);
    const __m512 a = _mm512_load_ps(r->a), b = _mm512_load_ps(r->b);
    const __m512i sc = _mm512_load_si512(r->a);
#pragma GCC unroll 8
    for (int i = 0; i < XR; i++) {
      const int8_t* x = xq + (g * XR + i) * G;
      const float d = dx[g * XR + i], s = xs[g * XR + i];
      __m512i e = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[0], bcast4(x));
      for (int t = 1; t < 8; t++) e = _mm512_dpbusd_epi32(e, w[t], bcast4(x + 4 * t));
      if (mode == 0) {
        sum[i] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(e), _mm512_set1_ps(d)), a, sum[i]);
        sum[i] = _mm512_fmadd_ps(b, _mm512_set1_ps(s), sum[i]);
      } else if (mode == 1) {
        sum[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(e), _mm512_set1_ps(d), sum[i]);
      } else if (mode == 2) {
        isum[i] = _mm512_add_epi32(isum[i], _mm512_mullo_epi32(e, sc));
        if ((g & 7) == 7) {
          sum[i] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(isum[i]), _mm512_set1_ps(d)), a, sum[i]);
          sum[i] = _mm512_fmadd_ps(b, _mm512_set1_ps(s), sum[i]);
          isum[i] = _mm512_setzero_si512();
        }
      } else {
        isum[i] = _mm512_add_epi32(isum[i], e);
      }
    }
  }
  for (int i = 0; i < XR; i++)
    out[i] = _mm512_add_ps(sum[i], _mm512_cvtepi32_ps(isum[i]));
}

static void scale_ceilings(double peak) {
  Rec* rec = aligned_alloc(64, sizeof(Rec) * NG);
  int8_t* xq = aligned_alloc(64, NG * XR * G);
  static float dx[NG * XR], xs[NG * XR];
  for (size_t i = 0; i < sizeof(Rec) * NG; i++) ((uint8_t*)rec)[i] = i % 13;
  for (int i = 0; i < NG * XR * G; i++) xq[i] = i % 7 - 3;
  for (int i = 0; i < NG * XR; i++) { dx[i] = 1e-3f; xs[i] = 1e-2f; }
  static const char* names[] = {"exact", "cvt+fma", "per-256", "int only"};
  __m512 out[XR];
  float check = 0;
  const long reps = 200000;
  for (int mode = 0; mode < 4; mode++) {
    double t = now();
    for (long k = 0; k < reps; k++) { span(rec, xq, dx, xs, out, mode); check += out[0][0]; }
    const double gmac = (double)reps * NG * XR * 16 * G / (now() - t) / 1e9;
    printf("scale work %-8s: %5.0f G MAC/s = %.2f of the zmm peak\n", names[mode], gmac, gmac / peak);
  }
  printf("(checksum %g)\n", check);
  free(rec);
  free(xq);
}

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
  scale_ceilings(zmm * 64);
  printf("vpdpbusd ymm: %.2f per ns = %.0f G MAC/s (32 a dot)\n", ymm, ymm * 32);
  printf("clock ~%.2f GHz (dependent adds); checksum %ld\n", ghz, s);
  return 0;
}
