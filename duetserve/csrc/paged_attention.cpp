// Decode attention that reads the paged KV cache in place (no gather of whole contexts).
//
// One query token per sequence. For each (sequence, KV head) the G = H / KVH query heads
// that share the KV head are processed together, so each K and V row is read once:
//   pass 1: s[g][t] = scale * <q[g], K[t]> over the context, t found through the block
//           table (slot = block_table[t / bs] * bs + t % bs);
//   softmax over t (max-subtracted, in float32);
//   pass 2: out[g] = sum_t p[g][t] * V[t].
// The cache is [KVH, num_blocks, block_size, W] per tensor (heads first), rows of D
// float32 or bfloat16 values (W = D) or quantized rows (int8 / int4 with float16 scales,
// kv_rows.h): those are dequantized in registers, int8's row scale applied once to the
// row's score and to its softmax weight; math is float32, except int8 keys' scores: the
// queries meeting them are on their int8 grid (kv_rows.h's int8_query) and, with
// AVX512-VNNI, multiply the keys in integers (q8_scores). Pass 2 accumulates in register
// tiles (pv_block); the softmax is normalised once on the output. Work items (sequence,
// KV head) run in parallel.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include "kv_rows.h"

// How many blocks ahead of the one in use the key and value passes prefetch. One block
// ahead was too close for int8 keys (a block of 16 int8 rows is scored in less time than
// DRAM takes to deliver the next): 3 / 2 made the int8 kernel 1.27x faster, 6 / 4 no
// faster again (benchmarks/decode_attention.py, 1.5B shapes, 8,192 tokens, Zen 5).
constexpr int64_t kKeyAhead = 3, kValueAhead = 2;

#if defined(__AVX512F__)
#include <immintrin.h>
#include "simd_exp.h"   // exp16 (the scalar std::exp was this kernel's largest cost)
#include "simd_sum.h"   // sum4

// Values 16 i .. 16 i + 15 of a row as float32 lanes (bfloat16: the high half of a
// float32; int8: before the row's scale; int4: with its group's scale).
static inline __m512 load16(const float* r, int64_t i, int64_t) {
  return _mm512_loadu_ps(r + 16 * i);
}
static inline __m512 load16(const at::BFloat16* r, int64_t i, int64_t) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(
      _mm256_loadu_si256(reinterpret_cast<const __m256i*>(r + 16 * i))), 16));
}
static inline __m512 load16(const int8_t* r, int64_t i, int64_t) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(r + 16 * i))));
}
static inline __m512 load16(const uint8_t* r, int64_t i, int64_t D) {
  const int64_t g = i / 2;
  __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(r + 16 * g));
  if (i & 1) b = _mm_srli_epi16(b, 4);
  b = _mm_and_si128(b, _mm_set1_epi8(15));
  const __m512 n = _mm512_sub_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(b)),
                                 _mm512_set1_ps(8.f));
  return _mm512_mul_ps(n, _mm512_set1_ps(half_at(r + D / 2 + 2 * g)));
}

// Prefetch one cache row (`bytes` long) into L2. (Into L1, _MM_HINT_T0, measured no
// faster than no prefetch at all; into L2 or L3, 1.4-1.6x faster: 64 sequences of ~300
// tokens, SmolLM2's heads, float32 cache, AMD EPYC Zen 4, 2 threads.)
static inline void prefetch_row(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t o = 0; o < bytes; o += 64) _mm_prefetch(c + o, _MM_HINT_T1);
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
// Four 16-lane int32 sums at once: [sum(a), sum(b), sum(c), sum(d)].
static inline __m128i sum4i(__m512i a, __m512i b, __m512i c, __m512i d) {
  auto h = [](__m512i v) {
    return _mm256_add_epi32(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64(v, 1));
  };
  const __m256i abcd = _mm256_hadd_epi32(_mm256_hadd_epi32(h(a), h(b)),
                                         _mm256_hadd_epi32(h(c), h(d)));
  return _mm_add_epi32(_mm256_castsi256_si128(abcd), _mm256_extracti128_si256(abcd, 1));
}

// Pass 1 over int8 keys in integers: s[g][t] = scale * step_g * kscale_t * <n_g, K[t]>,
// n_g the query head rounded to int8 (kv_rows.h's int8_query: the callers' queries are
// already on that grid, so this rounding returns their n). vpdpbusd multiplies u8 by s8:
// key bytes are flipped to k + 128 (xor 0x80) and 128 * sum(n_g) subtracted. D a
// multiple of 64 and <= 256; G <= 8. The row bytes of 4 keys are loaded once for all G
// heads; the same block-ahead prefetch as the float pass.
static void q8_scores(const float* qb, const int8_t* kbase, const int64_t* table,
                      int64_t T0, int64_t L, int64_t G, int64_t D, int64_t bs, int64_t W,
                      float scale, float* scores) {
  const int64_t nz = D / 64;
  alignas(64) int8_t qn[8][256];
  float step[8];
  int32_t bias[8];
  __m512i qv[8][4];
  for (int64_t g = 0; g < G; ++g) {
    const float* qg = qb + g * D;
    step[g] = query_step(qg, D);
    int32_t sum = 0;
    for (int64_t i = 0; i < D; ++i) {
      const int n = static_cast<int>(
          std::min(127.f, std::max(-127.f, std::nearbyint(qg[i] / step[g]))));
      qn[g][i] = static_cast<int8_t>(n);
      sum += n;
    }
    bias[g] = 128 * sum;
    for (int64_t i = 0; i < nz; ++i) qv[g][i] = _mm512_load_si512(qn[g] + 64 * i);
  }
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  const int64_t row_bytes = W;
  for (int64_t t0 = T0 / bs * bs; t0 < L; t0 += bs) {
    const int64_t n = std::min(bs, L - t0);
    const int8_t* kb = kbase + table[t0 / bs] * bs * W;
    const int8_t* knext = t0 + kKeyAhead * bs < L ? kbase + table[t0 / bs + kKeyAhead] * bs * W : nullptr;
    int64_t j = std::max<int64_t>(0, T0 - t0);
    for (; j + 4 <= n; j += 4) {
      if (knext)
        for (int64_t r = 0; r < 4; ++r) prefetch_row(knext + (j + r) * W, row_bytes);
      const int8_t* k0 = kb + j * W;
      __m512i kv[4][4];
      for (int64_t r = 0; r < 4; ++r)
        for (int64_t i = 0; i < nz; ++i)
          kv[r][i] = _mm512_xor_si512(_mm512_loadu_si512(k0 + r * W + 64 * i), flip);
      const __m128 rs = _mm_mul_ps(
          _mm_setr_ps(RowsQ8::scale(k0, D), RowsQ8::scale(k0 + W, D),
                      RowsQ8::scale(k0 + 2 * W, D), RowsQ8::scale(k0 + 3 * W, D)),
          _mm_set1_ps(scale));
      for (int64_t g = 0; g < G; ++g) {
        __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
        for (int64_t i = 0; i < nz; ++i) {
          a0 = _mm512_dpbusd_epi32(a0, kv[0][i], qv[g][i]);
          a1 = _mm512_dpbusd_epi32(a1, kv[1][i], qv[g][i]);
          a2 = _mm512_dpbusd_epi32(a2, kv[2][i], qv[g][i]);
          a3 = _mm512_dpbusd_epi32(a3, kv[3][i], qv[g][i]);
        }
        const __m128i dot = _mm_sub_epi32(sum4i(a0, a1, a2, a3), _mm_set1_epi32(bias[g]));
        _mm_storeu_ps(scores + g * L + t0 + j,
                      _mm_mul_ps(_mm_mul_ps(_mm_cvtepi32_ps(dot), _mm_set1_ps(step[g])), rs));
      }
    }
    for (; j < n; ++j) {
      const int8_t* krow = kb + j * W;
      const float rs = RowsQ8::scale(krow, D) * scale;
      for (int64_t g = 0; g < G; ++g) {
        __m512i a = _mm512_setzero_si512();
        for (int64_t i = 0; i < nz; ++i)
          a = _mm512_dpbusd_epi32(
              a, _mm512_xor_si512(_mm512_loadu_si512(krow + 64 * i), flip), qv[g][i]);
        scores[g * L + t0 + j] =
            static_cast<float>(_mm512_reduce_add_epi32(a) - bias[g]) * step[g] * rs;
      }
    }
  }
}
#define DUET_Q8_SCORES 1
// Pass 2 over int8 values in integers. The context is taken in spans of kSpanBlocks
// blocks; in each, a head's weights (softmax numerators times the rows' scales) are put
// on a u8 grid with a step of the span's largest / 255, and four rows' 64-byte chunks are
// interleaved in registers (unpack 8 then 16 bits) so that each int32 lane holds one
// dimension of 4 consecutive rows, which vpdpbusd multiplies by the 4 rows' weights. Lane
// 4 L + i of interleaved vector k is dimension 16 L + 4 k + i of its 64: the float
// accumulators `acc` [G, D] keep that order until q8_values puts them back.
constexpr int64_t kSpanBlocks = 4;
constexpr int64_t kTileHeads = 3;   // 12 accumulators (6: 24, spilled)

template <int NG>
static inline void pv_q8_tile(const int8_t* const* grp, int64_t ngrp, int64_t W, int64_t c,
                              const uint8_t* wq, int64_t wstride, const float* step,
                              int64_t g0, float* acc, int64_t D, const int8_t* const* pf) {
  __m512i a[NG][4];
  for (int g = 0; g < NG; ++g)
    for (int k = 0; k < 4; ++k) a[g][k] = _mm512_setzero_si512();
  for (int64_t m = 0; m < ngrp; ++m) {
    if (pf && pf[m])
      for (int64_t r = 0; r < 4; ++r) prefetch_row(pf[m] + r * W, W);
    const int8_t* r = grp[m] + 64 * c;
    const __m512i r0 = _mm512_loadu_si512(r), r1 = _mm512_loadu_si512(r + W);
    const __m512i r2 = _mm512_loadu_si512(r + 2 * W), r3 = _mm512_loadu_si512(r + 3 * W);
    const __m512i alo = _mm512_unpacklo_epi8(r0, r1), ahi = _mm512_unpackhi_epi8(r0, r1);
    const __m512i blo = _mm512_unpacklo_epi8(r2, r3), bhi = _mm512_unpackhi_epi8(r2, r3);
    const __m512i x[4] = {_mm512_unpacklo_epi16(alo, blo), _mm512_unpackhi_epi16(alo, blo),
                          _mm512_unpacklo_epi16(ahi, bhi), _mm512_unpackhi_epi16(ahi, bhi)};
    for (int g = 0; g < NG; ++g) {
      int32_t w4;
      std::memcpy(&w4, wq + (g0 + g) * wstride + 4 * m, 4);
      const __m512i w = _mm512_set1_epi32(w4);
      for (int k = 0; k < 4; ++k) a[g][k] = _mm512_dpbusd_epi32(a[g][k], w, x[k]);
    }
  }
  for (int g = 0; g < NG; ++g) {
    const __m512 sv = _mm512_set1_ps(step[g0 + g]);
    for (int k = 0; k < 4; ++k) {
      float* f = acc + (g0 + g) * D + 64 * c + 16 * k;
      _mm512_storeu_ps(f, _mm512_fmadd_ps(_mm512_cvtepi32_ps(a[g][k]), sv, _mm512_loadu_ps(f)));
    }
  }
}

// acc [G, D] = sum over keys T0..L-1 of e[g][t] * V[t] (e: the unnormalised softmax in
// scores [G, L]). D a multiple of 64, bs of 4, G <= 8.
static void q8_values(const float* scores, const int8_t* vbase, const int64_t* table,
                      int64_t T0, int64_t L, int64_t G, int64_t D, int64_t bs, int64_t W,
                      float* acc) {
  const int64_t S = kSpanBlocks * bs, ngmax = S / 4;
  std::vector<float> wf(G * S), rs(S);
  std::vector<uint8_t> wq(G * S + 64);
  std::vector<const int8_t*> grp(ngmax), nxt(ngmax);
  float step[8];
  std::fill(acc, acc + G * D, 0.f);
  auto groups = [&](int64_t s0, std::vector<const int8_t*>& out) {   // a span's row groups
    for (int64_t m = 0; m < ngmax; ++m) {
      const int64_t t = s0 + 4 * m;
      out[m] = t < L ? vbase + (table[t / bs] * bs + t % bs) * W : nullptr;
    }
  };
  groups(T0 / bs * bs, grp);
  for (int64_t s0 = T0 / bs * bs; s0 < L; s0 += S) {
    const int64_t lo = std::max<int64_t>(T0 - s0, 0), hi = std::min(S, L - s0);
    const int64_t ngrp = (hi + 3) / 4;
    groups(s0 + S, nxt);
    for (int64_t t = lo; t < hi; ++t) rs[t] = RowsQ8::scale(grp[t / 4] + (t % 4) * W, D);
    for (int64_t g = 0; g < G; ++g) {
      float* w = wf.data() + g * S;
      const float* e = scores + g * L + s0;
      __m512 mx = _mm512_setzero_ps();
      for (int64_t t = 0; t < S; t += 16) {
        const int64_t a = std::clamp<int64_t>(lo - t, 0, 16), z = std::clamp<int64_t>(hi - t, 0, 16);
        const __mmask16 valid = static_cast<__mmask16>(((1u << z) - 1) & ~((1u << a) - 1));
        const __m512 x = _mm512_maskz_mul_ps(valid, _mm512_maskz_loadu_ps(valid, e + t),
                                             _mm512_maskz_loadu_ps(valid, rs.data() + t));
        _mm512_storeu_ps(w + t, x);
        mx = _mm512_max_ps(mx, x);
      }
      const float m = _mm512_reduce_max_ps(mx);
      step[g] = m / 255.f;
      const __m512 inv = _mm512_set1_ps(m > 0.f ? 255.f / m : 0.f);
      for (int64_t t = 0; t < S; t += 16)
        _mm_storeu_si128(reinterpret_cast<__m128i*>(wq.data() + g * S + t),
                         _mm512_cvtusepi32_epi8(_mm512_cvtps_epi32(
                             _mm512_mul_ps(_mm512_loadu_ps(w + t), inv))));
    }
    const int8_t* const* pf = s0 + S < L ? nxt.data() : nullptr;
    for (int64_t c = 0; c < D / 64; ++c, pf = nullptr)
      for (int64_t g0 = 0; g0 < G; g0 += kTileHeads) {
        const int8_t* const* p = g0 == 0 ? pf : nullptr;
        switch (std::min<int64_t>(kTileHeads, G - g0)) {
          case 1: pv_q8_tile<1>(grp.data(), ngrp, W, c, wq.data(), S, step, g0, acc, D, p); break;
          case 2: pv_q8_tile<2>(grp.data(), ngrp, W, c, wq.data(), S, step, g0, acc, D, p); break;
          case 3: pv_q8_tile<3>(grp.data(), ngrp, W, c, wq.data(), S, step, g0, acc, D, p); break;
          case 4: pv_q8_tile<4>(grp.data(), ngrp, W, c, wq.data(), S, step, g0, acc, D, p); break;
          case 5: pv_q8_tile<5>(grp.data(), ngrp, W, c, wq.data(), S, step, g0, acc, D, p); break;
          default: pv_q8_tile<6>(grp.data(), ngrp, W, c, wq.data(), S, step, g0, acc, D, p); break;
        }
      }
    std::swap(grp, nxt);
  }
  // back to dimension order: lane 4 L + i of vector k of chunk c is 64 c + 16 L + 4 k + i
  float tmp[256];
  for (int64_t g = 0; g < G; ++g) {
    float* a = acc + g * D;
    for (int64_t c = 0; c < D / 64; ++c)
      for (int64_t k = 0; k < 4; ++k)
        for (int64_t l = 0; l < 16; ++l)
          tmp[64 * c + 16 * (l / 4) + 4 * k + l % 4] = a[64 * c + 16 * k + l];
    std::copy(tmp, tmp + D, a);
  }
}
#endif

// acc[g][16 c .. 16 (c + NV)) += sum_j w[g][j] V[j] over rows j0..n-1 of a block, for
// heads g0 .. g0 + NG - 1: NG x NV accumulators held in registers (at most 24 of the 32),
// each row's NV vectors converted once for the NG heads.
template <int NG, int NV, typename KV>
static inline void pv_tile(const KV* vb, int64_t W, int64_t D, int64_t j0, int64_t n,
                           const float* w, int64_t wstride, int64_t g0, int64_t c,
                           float* acc, const KV* pf) {
  __m512 a[NG][NV];
  for (int g = 0; g < NG; ++g)
    for (int v = 0; v < NV; ++v) a[g][v] = _mm512_loadu_ps(acc + (g0 + g) * D + 16 * (c + v));
  for (int64_t j = j0; j < n; ++j) {
    const KV* vrow = vb + j * W;
    if (pf) prefetch_row(pf + j * W, W * static_cast<int64_t>(sizeof(KV)));
    __m512 x[NV];
    for (int v = 0; v < NV; ++v) x[v] = load16(vrow, c + v, D);
    for (int g = 0; g < NG; ++g) {
      const __m512 p = _mm512_set1_ps(w[(g0 + g) * wstride + j]);
      for (int v = 0; v < NV; ++v) a[g][v] = _mm512_fmadd_ps(p, x[v], a[g][v]);
    }
  }
  for (int g = 0; g < NG; ++g)
    for (int v = 0; v < NV; ++v) _mm512_storeu_ps(acc + (g0 + g) * D + 16 * (c + v), a[g][v]);
}

// One block's rows into acc [G, D]: tiles of NV vectors by up to 24 / NV heads; the
// first tile prefetches the rows of the next block (pf, or none), one per row it reads.
template <int NV, typename KV>
static void pv_block(const KV* vb, int64_t W, int64_t D, int64_t j0, int64_t n,
                     const float* w, int64_t wstride, int64_t G, float* acc, const KV* pf) {
  constexpr int64_t kMaxHeads = std::min(8, 24 / NV);
  for (int64_t c = 0; c < D / 16; c += NV)
    for (int64_t g0 = 0; g0 < G; g0 += kMaxHeads, pf = nullptr) {
      switch (std::min(kMaxHeads, G - g0)) {
        case 1: pv_tile<1, NV>(vb, W, D, j0, n, w, wstride, g0, c, acc, pf); break;
        case 2: pv_tile<2, NV>(vb, W, D, j0, n, w, wstride, g0, c, acc, pf); break;
        case 3: pv_tile<3, NV>(vb, W, D, j0, n, w, wstride, g0, c, acc, pf); break;
        case 4: pv_tile<4, NV>(vb, W, D, j0, n, w, wstride, g0, c, acc, pf); break;
        case 5: pv_tile<5, NV>(vb, W, D, j0, n, w, wstride, g0, c, acc, pf); break;
        case 6: pv_tile<6, NV>(vb, W, D, j0, n, w, wstride, g0, c, acc, pf); break;
        case 7: pv_tile<7, NV>(vb, W, D, j0, n, w, wstride, g0, c, acc, pf); break;
        default: pv_tile<8, NV>(vb, W, D, j0, n, w, wstride, g0, c, acc, pf); break;
      }
    }
}

// D a multiple of 16 and <= 256, G <= 8. The context is walked block by block: each block
// of the cache is bs contiguous rows (one 4 KiB page for 16 float32 rows of 64, where the
// hardware prefetcher stops), so while a block's rows are used the same rows of the next
// block in the table are prefetched. Scores of 4 keys are summed horizontally at once.
template <typename Rows>
static bool decode_avx512(const float* q, const typename Rows::E* kc,
                          const typename Rows::E* vc, const int64_t* tables,
                          const int64_t* lens, float* out, int64_t B, int64_t H, int64_t KVH,
                          int64_t D, int64_t num_blocks, int64_t bs, int64_t max_blocks,
                          float scale, int64_t window) {
  constexpr int64_t MAXV = 16;                  // D / 16 <= 16
  const int64_t G = H / KVH, nv = D / 16;
  if (D % 16 || nv > MAXV || G > 8) return false;
  using KV = typename Rows::E;
  const int64_t W = Rows::width(D);             // a row's elements
  const int64_t head_stride = num_blocks * bs * W;
  const int64_t row_bytes = W * static_cast<int64_t>(sizeof(KV));
  at::parallel_for(0, B * KVH, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, weights(G * bs), rowscale(bs), qgrid;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / KVH, kh = item % KVH;
      const int64_t L = lens[b];
      const int64_t T0 = window > 0 && L > window ? L - window : 0;   // first key read
      const int64_t* table = tables + b * max_blocks;
      const float* qb = q + (b * H + kh * G) * D;         // G query heads, contiguous
      const KV* kbase = kc + kh * head_stride;
      const KV* vbase = vc + kh * head_stride;
      scores.resize(G * L);
      // pass 1: scores (of keys T0..L-1; the blocks before T0's may be released)
      bool scored = false;
      if constexpr (Rows::kRotatedKeys) {      // int8 keys meet queries on their grid
#if defined(DUET_Q8_SCORES)
        if (D % 64 == 0) {
          q8_scores(qb, kbase, table, T0, L, G, D, bs, W, scale, scores.data());
          scored = true;
        }
#endif
        if (!scored) {
          qgrid.assign(qb, qb + G * D);
          for (int64_t g = 0; g < G; ++g) to_query_grid(qgrid.data() + g * D, D);
          qb = qgrid.data();
        }
      }
      for (int64_t t0 = T0 / bs * bs; !scored && t0 < L; t0 += bs) {
        const int64_t n = std::min(bs, L - t0);
        const KV* kb = kbase + table[t0 / bs] * bs * W;
        const KV* knext =
            t0 + kKeyAhead * bs < L ? kbase + table[t0 / bs + kKeyAhead] * bs * W : nullptr;
        int64_t j = std::max<int64_t>(0, T0 - t0);
        for (; j + 4 <= n; j += 4) {
          if (knext)
            for (int64_t r = 0; r < 4; ++r) prefetch_row(knext + (j + r) * W, row_bytes);
          const KV* k0 = kb + j * W;
          const __m128 rs = _mm_mul_ps(
              _mm_setr_ps(Rows::scale(k0, D), Rows::scale(k0 + W, D),
                          Rows::scale(k0 + 2 * W, D), Rows::scale(k0 + 3 * W, D)),
              _mm_set1_ps(scale));
          for (int64_t g = 0; g < G; ++g) {
            const float* qg = qb + g * D;
            __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
            for (int64_t i = 0; i < nv; ++i) {
              const __m512 qv = _mm512_loadu_ps(qg + 16 * i);
              a0 = _mm512_fmadd_ps(load16(k0, i, D), qv, a0);
              a1 = _mm512_fmadd_ps(load16(k0 + W, i, D), qv, a1);
              a2 = _mm512_fmadd_ps(load16(k0 + 2 * W, i, D), qv, a2);
              a3 = _mm512_fmadd_ps(load16(k0 + 3 * W, i, D), qv, a3);
            }
            _mm_storeu_ps(scores.data() + g * L + t0 + j, _mm_mul_ps(sum4(a0, a1, a2, a3), rs));
          }
        }
        for (; j < n; ++j) {
          const KV* krow = kb + j * W;
          const float rs = Rows::scale(krow, D) * scale;
          for (int64_t g = 0; g < G; ++g) {
            __m512 acc = _mm512_setzero_ps();
            for (int64_t i = 0; i < nv; ++i)
              acc = _mm512_fmadd_ps(load16(krow, i, D), _mm512_loadu_ps(qb + g * D + 16 * i), acc);
            scores[g * L + t0 + j] = _mm512_reduce_add_ps(acc) * rs;
          }
        }
      }
      // softmax over each head's scores, left unnormalised: the output is divided by
      // the sum at the end
      float inv[8];
      for (int64_t g = 0; g < G; ++g) {
        float* sg = scores.data() + g * L;
        __m512 mv = _mm512_set1_ps(-INFINITY);
        int64_t t = T0;
        for (; t + 16 <= L; t += 16) mv = _mm512_max_ps(mv, _mm512_loadu_ps(sg + t));
        float m = _mm512_reduce_max_ps(mv);
        for (; t < L; ++t) m = sg[t] > m ? sg[t] : m;
        mv = _mm512_set1_ps(m);
        __m512 sumv = _mm512_setzero_ps();
        for (t = T0; t + 16 <= L; t += 16) {
          const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(sg + t), mv));
          _mm512_storeu_ps(sg + t, e);
          sumv = _mm512_add_ps(sumv, e);
        }
        float sum = _mm512_reduce_add_ps(sumv);
        for (; t < L; ++t) { sg[t] = std::exp(sg[t] - m); sum += sg[t]; }
        inv[g] = 1.f / sum;
      }
      // pass 2: weighted sum of values, block by block, in register tiles of accumulators
      // (pv_block); int8's row scales multiply a copy of the block's weights first
      float* ob = out + (b * H + kh * G) * D;      // the accumulators, G x D
      bool summed = false;
#if defined(DUET_Q8_SCORES)
      if constexpr (std::is_same_v<Rows, RowsQ8>)
        if (D % 64 == 0 && bs % 4 == 0) {
          q8_values(scores.data(), vbase, table, T0, L, G, D, bs, W, ob);
          summed = true;
        }
#endif
      if (!summed) std::fill(ob, ob + G * D, 0.f);
      for (int64_t t0 = T0 / bs * bs; !summed && t0 < L; t0 += bs) {
        const int64_t n = std::min(bs, L - t0), j0 = std::max<int64_t>(0, T0 - t0);
        const KV* vb = vbase + table[t0 / bs] * bs * W;
        const KV* vnext = t0 + kValueAhead * bs < L ? vbase + table[t0 / bs + kValueAhead] * bs * W : nullptr;
        const float* w = scores.data() + t0;
        int64_t wstride = L;
        if constexpr (std::is_same_v<Rows, RowsQ8>) {
          for (int64_t j = j0; j < n; ++j) rowscale[j] = Rows::scale(vb + j * W, D);
          for (int64_t g = 0; g < G; ++g)
            for (int64_t j = j0; j < n; ++j)
              weights[g * bs + j] = scores[g * L + t0 + j] * rowscale[j];
          w = weights.data();
          wstride = bs;
        }
        if (nv % 4 == 0) pv_block<4>(vb, W, D, j0, n, w, wstride, G, ob, vnext);
        else if (nv % 2 == 0) pv_block<2>(vb, W, D, j0, n, w, wstride, G, ob, vnext);
        else pv_block<1>(vb, W, D, j0, n, w, wstride, G, ob, vnext);
      }
      for (int64_t g = 0; g < G; ++g) {
        const __m512 iv = _mm512_set1_ps(inv[g]);
        for (int64_t i = 0; i < nv; ++i)
          _mm512_storeu_ps(ob + g * D + 16 * i,
                           _mm512_mul_ps(_mm512_loadu_ps(ob + g * D + 16 * i), iv));
      }
    }
  });
  return true;
}
#endif

template <typename Rows>
static void decode_impl(const float* q, const typename Rows::E* kc,
                        const typename Rows::E* vc, const int64_t* tables,
                        const int64_t* lens, float* out, int64_t B, int64_t H, int64_t KVH,
                        int64_t D, int64_t num_blocks, int64_t bs, int64_t max_blocks,
                        float scale, int64_t window) {
  using KV = typename Rows::E;
  const int64_t G = H / KVH, W = Rows::width(D);
  const int64_t head_stride = num_blocks * bs * W;   // elements per KV head
  at::parallel_for(0, B * KVH, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, qgrid;
    std::vector<float> acc(G * D);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / KVH, kh = item % KVH;
      const int64_t L = lens[b];
      const int64_t T0 = window > 0 && L > window ? L - window : 0;   // first key read
      const int64_t* table = tables + b * max_blocks;
      const float* qb = q + (b * H + kh * G) * D;     // G query heads, contiguous
      if constexpr (Rows::kRotatedKeys) {             // int8 keys meet queries on their grid
        qgrid.assign(qb, qb + G * D);
        for (int64_t g = 0; g < G; ++g) to_query_grid(qgrid.data() + g * D, D);
        qb = qgrid.data();
      }
      const KV* kh_base = kc + kh * head_stride;
      const KV* vh_base = vc + kh * head_stride;
      scores.assign(G * L, 0.f);
      for (int64_t t = T0; t < L; ++t) {
        const KV* krow = kh_base + (table[t / bs] * bs + t % bs) * W;
        const float rs = Rows::scale(krow, D) * scale;
        for (int64_t g = 0; g < G; ++g) {
          const float* qg = qb + g * D;
          float s = 0.f;
#pragma omp simd reduction(+ : s)
          for (int64_t d = 0; d < D; ++d) s += qg[d] * Rows::value(krow, d, D);
          scores[g * L + t] = s * rs;
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        float* sg = scores.data() + g * L;
        float m = -INFINITY;
        for (int64_t t = T0; t < L; ++t) m = sg[t] > m ? sg[t] : m;
        float sum = 0.f;
        for (int64_t t = T0; t < L; ++t) { sg[t] = std::exp(sg[t] - m); sum += sg[t]; }
        const float inv = 1.f / sum;
        for (int64_t t = T0; t < L; ++t) sg[t] *= inv;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = T0; t < L; ++t) {
        const KV* vrow = vh_base + (table[t / bs] * bs + t % bs) * W;
        const float rs = Rows::scale(vrow, D);
        for (int64_t g = 0; g < G; ++g) {
          const float p = scores[g * L + t] * rs;
          float* ag = acc.data() + g * D;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) ag[d] += p * Rows::value(vrow, d, D);
        }
      }
      float* ob = out + (b * H + kh * G) * D;
      std::copy(acc.begin(), acc.end(), ob);
    }
  });
}

template <typename Rows>
static void decode_rows(const torch::Tensor& q, const torch::Tensor& k_cache,
                        const torch::Tensor& v_cache, const torch::Tensor& tables,
                        const torch::Tensor& lens, torch::Tensor& out, double scale,
                        int64_t window) {
  using E = typename Rows::E;
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t KVH = k_cache.size(0), nb = k_cache.size(1), bs = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == Rows::width(D), "cache rows do not match head size ", D);
  const E* kc = reinterpret_cast<const E*>(k_cache.data_ptr());
  const E* vc = reinterpret_cast<const E*>(v_cache.data_ptr());
#if defined(__AVX512F__)
  if (decode_avx512<Rows>(q.data_ptr<float>(), kc, vc, tables.data_ptr<int64_t>(),
                          lens.data_ptr<int64_t>(), out.data_ptr<float>(), B, H, KVH, D, nb,
                          bs, tables.size(1), static_cast<float>(scale), window))
    return;
#endif
  decode_impl<Rows>(q.data_ptr<float>(), kc, vc, tables.data_ptr<int64_t>(),
                    lens.data_ptr<int64_t>(), out.data_ptr<float>(), B, H, KVH, D, nb, bs,
                    tables.size(1), static_cast<float>(scale), window);
}

// q: [B, H, D] float32 contiguous; k_cache, v_cache: [KVH, num_blocks, bs, W] (W = D, or
// a quantized row's width: kv_rows.h; int8 -> RowsQ8, uint8 -> RowsQ4);
// block_tables: [B, max_blocks] int64; context_lens: [B] int64; window > 0: only the last
// `window` positions of each context are read (a sliding-window layer), 0: all of them.
// Returns [B, H, D] float32.
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache,
                                     torch::Tensor v_cache, torch::Tensor block_tables,
                                     torch::Tensor context_lens, double scale, int64_t window) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == torch::kFloat32 && q.is_contiguous(),
              "q must be a contiguous float32 [B, H, D] tensor");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "caches must be contiguous [KVH, num_blocks, block_size, W]");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "K and V dtypes differ");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt64 && block_tables.is_contiguous(),
              "block_tables must be contiguous int64");
  TORCH_CHECK(context_lens.scalar_type() == torch::kInt64, "context_lens must be int64");
  const int64_t B = q.size(0), H = q.size(1);
  TORCH_CHECK(H % k_cache.size(0) == 0, "head counts do not match");
  TORCH_CHECK(block_tables.size(0) == B && context_lens.size(0) == B, "batch sizes differ");
  auto out = torch::empty_like(q);
  auto lens = context_lens.contiguous();
  switch (k_cache.scalar_type()) {
    case torch::kFloat32:
      decode_rows<RowsF32>(q, k_cache, v_cache, block_tables, lens, out, scale, window); break;
    case torch::kBFloat16:
      decode_rows<RowsBF16>(q, k_cache, v_cache, block_tables, lens, out, scale, window); break;
    case torch::kInt8:
      decode_rows<RowsQ8>(q, k_cache, v_cache, block_tables, lens, out, scale, window); break;
    case torch::kUInt8:
      decode_rows<RowsQ4>(q, k_cache, v_cache, block_tables, lens, out, scale, window); break;
    default:
      TORCH_CHECK(false, "KV cache dtype must be float32, bfloat16, int8 or uint8 (int4)");
  }
  return out;
}
