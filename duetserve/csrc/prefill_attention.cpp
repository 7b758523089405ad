// Causal self-attention of one prompt chunk that has no cached prefix (a prefill's keys
// are its own tokens), float32, computing only the causal half.
//
// torch's CPU flash attention splits keys in blocks of 512, so a 512-token causal
// prompt computes the whole 512 x 512 score matrix and masks half of it (SmolLM2, 2
// threads: 4.5-5 ms a layer, 15-20% of a float32 prefill). Here:
//   task = (query head h, block of QB query rows); key blocks of KB = 64 up to the block's
//   last row only; per key block: S = scale * Q K^T (K transposed once per KV head, so
//   the inner loop is a broadcast of q[r][d] times 64 keys in 4 registers), online
//   softmax per row (running max m and sum l; earlier partial outputs rescaled by
//   exp(m_old - m_new)), O += P V (a broadcast of p[r][j] times V's row j).
// GQA: query head h reads KV head h / (H / KVH). Tasks are head-major, blocks of a head
// in the order early, late, early, ..., so contiguous shares of tasks cost about the same.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#include "simd_exp.h"

namespace {

constexpr int64_t QB = 32;   // query rows per task
constexpr int64_t KB = 64;   // keys per block (4 registers of 16)
constexpr int64_t R = 4;     // query rows per register tile

// Lanes of key register j (keys 16 j .. 16 j + 15 of a block) among the first n_keys.
inline __mmask16 lane_mask(int64_t n_keys, int j) {
  if (n_keys >= 16 * (j + 1)) return (__mmask16)0xFFFF;
  if (n_keys <= 16 * j) return (__mmask16)0;
  return (__mmask16)((1u << (n_keys - 16 * j)) - 1);
}

// One task: rows [q0, q0 + rows) of head h. Qh: row r's q at Qh + r * qs; Kt: [D][np]
// (this KV head, keys padded to np with zeros); Vh: key j's v at Vh + j * vs;
// out: row r at out + r * os. window > 0: row p sees keys p - window + 1 .. p only.
template <int NV>
void attend(const float* Qh, int64_t qs, int64_t q0, int64_t rows, const float* Kt,
            int64_t np, const float* Vh, int64_t vs, float* out, int64_t os, float scale,
            int64_t window) {
  constexpr int64_t D = 16 * NV;
  alignas(64) float S[QB][KB];
  alignas(64) float O[QB][D];
  float m[QB], l[QB];
  for (int64_t r = 0; r < rows; ++r) {
    m[r] = -INFINITY;
    l[r] = 0.f;
    for (int64_t d = 0; d < D; ++d) O[r][d] = 0.f;
  }
  const int64_t last = q0 + rows - 1;                 // the block's last query position
  const int64_t first_key = window > 0 ? std::max<int64_t>(0, q0 - window + 1) : 0;
  for (int64_t k0 = first_key / KB * KB; k0 <= last; k0 += KB) {
    // S = scale * Q K^T for keys [k0, k0 + KB)
    for (int64_t r0 = 0; r0 < rows; r0 += R) {
      const int64_t rr = std::min<int64_t>(R, rows - r0);
      __m512 acc[R][4];
      for (int64_t r = 0; r < R; ++r)
        for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_setzero_ps();
      for (int64_t d = 0; d < D; ++d) {
        const float* kt = Kt + d * np + k0;
        const __m512 k0v = _mm512_loadu_ps(kt), k1v = _mm512_loadu_ps(kt + 16),
                     k2v = _mm512_loadu_ps(kt + 32), k3v = _mm512_loadu_ps(kt + 48);
        for (int64_t r = 0; r < R; ++r) {
          const __m512 qv = _mm512_set1_ps(Qh[(r0 + std::min(r, rr - 1)) * qs + d]);
          acc[r][0] = _mm512_fmadd_ps(qv, k0v, acc[r][0]);
          acc[r][1] = _mm512_fmadd_ps(qv, k1v, acc[r][1]);
          acc[r][2] = _mm512_fmadd_ps(qv, k2v, acc[r][2]);
          acc[r][3] = _mm512_fmadd_ps(qv, k3v, acc[r][3]);
        }
      }
      const __m512 sc = _mm512_set1_ps(scale);
      for (int64_t r = 0; r < rr; ++r)
        for (int j = 0; j < 4; ++j) _mm512_store_ps(&S[r0 + r][16 * j], _mm512_mul_ps(acc[r][j], sc));
    }
    // online softmax, then O += P V over the keys each row may see
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t n_keys = std::min<int64_t>(KB, q0 + r - k0 + 1);   // causal: keys <= row
      // window: keys below q0 + r - window + 1 are out (none of this block: skip it)
      const int64_t lo = window > 0 ? std::max<int64_t>(0, q0 + r - window + 1 - k0) : 0;
      if (lo >= n_keys) continue;
      float* s = S[r];
      __m512 mx = _mm512_set1_ps(-INFINITY);
      for (int j = 0; j < 4; ++j)
        mx = _mm512_mask_max_ps(mx, lane_mask(n_keys, j) & ~lane_mask(lo, j), mx,
                                _mm512_load_ps(s + 16 * j));
      const float m_new = std::max(m[r], _mm512_reduce_max_ps(mx));
      const float alpha = std::exp(m[r] - m_new);     // 0 on the first block (m = -inf)
      const __m512 mv = _mm512_set1_ps(m_new);
      __m512 sum = _mm512_setzero_ps();
      for (int j = 0; j < 4; ++j) {
        const __m512 p = _mm512_maskz_mov_ps(lane_mask(n_keys, j) & ~lane_mask(lo, j),
                                             exp16(_mm512_sub_ps(_mm512_load_ps(s + 16 * j), mv)));
        _mm512_store_ps(s + 16 * j, p);
        sum = _mm512_add_ps(sum, p);
      }
      l[r] = l[r] * alpha + _mm512_reduce_add_ps(sum);
      m[r] = m_new;
      __m512 o[NV];
      const __m512 av = _mm512_set1_ps(alpha);
      for (int i = 0; i < NV; ++i) o[i] = _mm512_mul_ps(_mm512_load_ps(&O[r][16 * i]), av);
      for (int64_t j = lo; j < n_keys; ++j) {
        const __m512 p = _mm512_set1_ps(s[j]);
        const float* vr = Vh + (k0 + j) * vs;
        for (int i = 0; i < NV; ++i) o[i] = _mm512_fmadd_ps(p, _mm512_loadu_ps(vr + 16 * i), o[i]);
      }
      for (int i = 0; i < NV; ++i) _mm512_store_ps(&O[r][16 * i], o[i]);
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    const __m512 inv = _mm512_set1_ps(1.f / l[r]);
    for (int i = 0; i < NV; ++i)
      _mm512_storeu_ps(out + r * os + 16 * i, _mm512_mul_ps(_mm512_load_ps(&O[r][16 * i]), inv));
  }
}

// fn(h, g, q0, rows) for every task (query head h of KV head g, rows q0 .. q0 + rows - 1),
// in parallel. Within a head, blocks alternate early / late (0, nb-1, 1, nb-2, ...), so a
// contiguous share of tasks that cuts a head in two still gets an even mix of causal work.
template <typename F>
void for_query_blocks(int64_t n, int64_t H, int64_t G, const F& fn) {
  const int64_t nb = (n + QB - 1) / QB;
  at::parallel_for(0, H * nb, 1, [&](int64_t a, int64_t b) {
    for (int64_t task = a; task < b; ++task) {
      const int64_t h = task / nb, i = task % nb;
      const int64_t q0 = (i % 2 == 0 ? i / 2 : nb - 1 - i / 2) * QB;
      fn(h, h / G, q0, std::min(QB, n - q0));
    }
  });
}

template <int NV>
void run(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
         torch::Tensor& out, float scale, int64_t window) {
  constexpr int64_t D = 16 * NV;
  const int64_t n = q.size(0), H = q.size(1), KVH = k.size(1), G = H / KVH;
  const int64_t np = (n + KB - 1) / KB * KB;
  // K transposed per KV head: Kt[kvh][d][key], keys padded with zeros to np
  std::vector<float> kt(KVH * D * np, 0.f);
  const float* kp = k.data_ptr<float>();
  const int64_t ks = k.stride(0);
  at::parallel_for(0, KVH * D, 1, [&](int64_t a, int64_t b) {
    for (int64_t gd = a; gd < b; ++gd)
      for (int64_t t = 0; t < n; ++t) kt[gd * np + t] = kp[t * ks + gd];
  });
  const float* qp = q.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  float* op = out.data_ptr<float>();
  for_query_blocks(n, H, G, [&](int64_t h, int64_t g, int64_t q0, int64_t rows) {
    attend<NV>(qp + q0 * q.stride(0) + h * D, q.stride(0), q0, rows, kt.data() + g * D * np,
               np, vp + g * D, v.stride(0), op + (q0 * H + h) * D, H * D, scale, window);
  });
}

}  // namespace
#endif

// q [n, H, D], k / v [n, KVH, D] float32 (rows may be strided, each head's D contiguous)
// -> [n, H, D]: causal attention of the chunk over itself (window > 0: each row over its
// last `window` positions only). Returns an empty tensor where this build or shape is not
// covered (no AVX-512, D not 64, 128 or 256): the caller falls back.
torch::Tensor prefill_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v,
                                double scale, int64_t window) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "q, k, v: [n, heads, D]");
  TORCH_CHECK(q.size(0) == k.size(0) && k.sizes() == v.sizes() && q.size(2) == k.size(2) &&
              q.size(1) % k.size(1) == 0, "shape mismatch");
#if defined(__AVX512F__)
  const int64_t D = q.size(2);
  const bool dense_heads = q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1 &&
                           q.stride(1) == D && k.stride(1) == D && v.stride(1) == D;
  if (q.scalar_type() == torch::kFloat32 && k.scalar_type() == torch::kFloat32 &&
      v.scalar_type() == torch::kFloat32 && dense_heads && (D == 64 || D == 128 || D == 256)) {
    auto out = torch::empty({q.size(0), q.size(1), D}, q.options());
    const float sc = static_cast<float>(scale);
    if (D == 64) run<4>(q, k, v, out, sc, window);
    else if (D == 128) run<8>(q, k, v, out, sc, window);
    else run<16>(q, k, v, out, sc, window);
    return out;
  }
#endif
  return torch::empty({0}, q.options());
}

// The same causal flash attention with bfloat16 dot products (AVX512-BF16 vdpbf16ps: two
// products a lane, twice float32 FMA's rate), for a chunk that may follow cached context:
// k / v hold the whole context [L, KVH, D] (L >= n), query row r sits at position
// L - n + r and sees keys 0 .. L - n + r. Q, K, V and the softmax weights P are rounded to
// bfloat16 (a bfloat16 cache's values are exact); scores, the online softmax and the
// output accumulate in float32. Layouts the instruction wants, built once per call:
//   Kp [KVH][D/2][np] pairs (k[t][2i], k[t][2i+1]): S's 16 lanes are 16 keys;
//   Vp [KVH][np/2][D] pairs (v[2j][d], v[2j+1][d]): O's 16 lanes are 16 dimensions,
//   each lane taking two keys' products at once.
// Key blocks start at multiples of KB from position 0, so a row's sums are taken in the
// same order whichever chunk it is in. Float32 keys are rounded after subtracting the
// context's first key (position 0's, the same for every chunk of a prompt): the scores
// of a row all shift by q.k[0], which the softmax cancels, while the rounding error
// shrinks with the keys' magnitude. Qwen2.5's keys carry a few large channels that
// rotary barely turns; rounded as they are, they set most of the error (1.5B, 512-token
// prompt, 28 layers: relative error of the output 5.4e-3 mean / 3.9e-2 worst layer from
// rounding the keys, 3.0e-3 / 6.3e-3 after the subtraction). A bfloat16 cache's keys are
// exact as they are and taken unchanged.
#if defined(__AVX512BF16__)
namespace {

inline __m512bh as_bh(__m512i v) { return reinterpret_cast<__m512bh&>(v); }

// D values as D / 2 pairs of bfloat16 (round to nearest even; bf16 input copied).
inline void bf16_pairs(const float* s, int64_t D, uint32_t* d) {
  for (int64_t i = 0; i < D; i += 32) {
    const __m512bh b = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(s + i + 16), _mm512_loadu_ps(s + i));
    _mm512_storeu_si512(d + i / 2, reinterpret_cast<const __m512i&>(b));
  }
}
inline void bf16_pairs(const at::BFloat16* s, int64_t D, uint32_t* d) {
  std::memcpy(d, s, D * sizeof(at::BFloat16));
}

// One step of the R x 64 tiles both products use: acc[r][j] += the 16 pairs at
// b + 16 j times row r's pair a[r * astride] (rows past rr - 1 repeat the last).
inline void dp_step(__m512 (&acc)[R][4], const uint32_t* b, const uint32_t* a,
                    int64_t astride, int64_t rr) {
  const __m512bh b0 = as_bh(_mm512_loadu_si512(b)), b1 = as_bh(_mm512_loadu_si512(b + 16)),
                 b2 = as_bh(_mm512_loadu_si512(b + 32)), b3 = as_bh(_mm512_loadu_si512(b + 48));
  for (int64_t r = 0; r < R; ++r) {
    const __m512bh x = as_bh(_mm512_set1_epi32(static_cast<int>(a[std::min(r, rr - 1) * astride])));
    acc[r][0] = _mm512_dpbf16_ps(acc[r][0], b0, x);
    acc[r][1] = _mm512_dpbf16_ps(acc[r][1], b1, x);
    acc[r][2] = _mm512_dpbf16_ps(acc[r][2], b2, x);
    acc[r][3] = _mm512_dpbf16_ps(acc[r][3], b3, x);
  }
}

template <int NV>
void attend_bf16(const float* Qh, int64_t qs, int64_t q0, int64_t rows, int64_t off,
                 const uint32_t* Kp, const uint32_t* Vp, int64_t np, float* out, int64_t os,
                 float scale) {
  constexpr int64_t D = 16 * NV, D2 = D / 2;
  alignas(64) uint32_t Qb[QB][D2];
  alignas(64) float S[QB][KB];
  alignas(64) uint32_t P[QB][KB / 2];
  alignas(64) float O[QB][D];
  float m[QB], l[QB], alpha[QB];
  for (int64_t r = 0; r < rows; ++r) {
    bf16_pairs(Qh + r * qs, D, Qb[r]);
    m[r] = -INFINITY;
    l[r] = 0.f;
    for (int64_t d = 0; d < D; ++d) O[r][d] = 0.f;
  }
  const int64_t last = off + q0 + rows - 1;           // the block's last query position
  for (int64_t k0 = 0; k0 <= last; k0 += KB) {
    // S = scale * Q K^T for keys [k0, k0 + KB)
    for (int64_t r0 = 0; r0 < rows; r0 += R) {
      const int64_t rr = std::min<int64_t>(R, rows - r0);
      __m512 acc[R][4];
      for (int64_t r = 0; r < R; ++r)
        for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_setzero_ps();
      for (int64_t d2 = 0; d2 < D2; ++d2)
        dp_step(acc, Kp + d2 * np + k0, &Qb[r0][d2], D2, rr);
      const __m512 sc = _mm512_set1_ps(scale);
      for (int64_t r = 0; r < rr; ++r)
        for (int j = 0; j < 4; ++j) _mm512_store_ps(&S[r0 + r][16 * j], _mm512_mul_ps(acc[r][j], sc));
    }
    // online softmax of each row over the keys it may see; P its weights as bf16 pairs
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t n_keys = std::min<int64_t>(KB, off + q0 + r - k0 + 1);   // causal
      if (n_keys <= 0) {                                 // none of this block's keys
        alpha[r] = 1.f;
        std::memset(P[r], 0, sizeof(P[r]));
        continue;
      }
      float* s = S[r];
      __m512 mx = _mm512_set1_ps(-INFINITY);
      for (int j = 0; j < 4; ++j)
        mx = _mm512_mask_max_ps(mx, lane_mask(n_keys, j), mx, _mm512_load_ps(s + 16 * j));
      const float m_new = std::max(m[r], _mm512_reduce_max_ps(mx));
      alpha[r] = std::exp(m[r] - m_new);                 // 0 on the first block (m = -inf)
      const __m512 mv = _mm512_set1_ps(m_new);
      __m512 p[4], sum = _mm512_setzero_ps();
      for (int j = 0; j < 4; ++j) {
        p[j] = _mm512_maskz_mov_ps(lane_mask(n_keys, j),
                                   exp16(_mm512_sub_ps(_mm512_load_ps(s + 16 * j), mv)));
        sum = _mm512_add_ps(sum, p[j]);
      }
      l[r] = l[r] * alpha[r] + _mm512_reduce_add_ps(sum);
      m[r] = m_new;
      const __m512bh lo = _mm512_cvtne2ps_pbh(p[1], p[0]), hi = _mm512_cvtne2ps_pbh(p[3], p[2]);
      _mm512_store_si512(P[r], reinterpret_cast<const __m512i&>(lo));
      _mm512_store_si512(P[r] + 16, reinterpret_cast<const __m512i&>(hi));
    }
    // O = alpha O + P V, in tiles of R rows x 4 vectors (V's pairs loaded once per tile)
    for (int64_t r0 = 0; r0 < rows; r0 += R) {
      const int64_t rr = std::min<int64_t>(R, rows - r0);
      const int64_t nk = std::min<int64_t>(KB, off + q0 + r0 + rr - 1 - k0 + 1);
      if (nk <= 0) continue;                              // no row of the tile sees a key
      const int64_t npairs = (nk + 1) / 2;
      const uint32_t* vb = Vp + k0 / 2 * D;
      for (int64_t c0 = 0; c0 < NV; c0 += 4) {
        __m512 o[R][4];
        for (int64_t r = 0; r < R; ++r) {
          const int64_t rc = r0 + std::min(r, rr - 1);
          const __m512 av = _mm512_set1_ps(alpha[rc]);
          for (int i = 0; i < 4; ++i) o[r][i] = _mm512_mul_ps(_mm512_load_ps(&O[rc][16 * (c0 + i)]), av);
        }
        for (int64_t jp = 0; jp < npairs; ++jp)
          dp_step(o, vb + jp * D + 16 * c0, &P[r0][jp], KB / 2, rr);
        for (int64_t r = 0; r < rr; ++r)
          for (int i = 0; i < 4; ++i) _mm512_store_ps(&O[r0 + r][16 * (c0 + i)], o[r][i]);
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    const __m512 inv = _mm512_set1_ps(1.f / l[r]);
    for (int i = 0; i < NV; ++i)
      _mm512_storeu_ps(out + r * os + 16 * i, _mm512_mul_ps(_mm512_load_ps(&O[r][16 * i]), inv));
  }
}

template <int NV, typename T>
void run_bf16(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
              torch::Tensor& out, float scale) {
  constexpr int64_t D = 16 * NV, D2 = D / 2;
  const int64_t n = q.size(0), H = q.size(1), L = k.size(0), KVH = k.size(1), G = H / KVH;
  const int64_t np = (L + KB - 1) / KB * KB, off = L - n;
  std::vector<uint32_t> kp(KVH * D2 * np, 0u), vp(KVH * np / 2 * D, 0u);
  const T* kd = k.data_ptr<T>();
  const T* vd = v.data_ptr<T>();
  const int64_t ks0 = k.stride(0), ks1 = k.stride(1), vs0 = v.stride(0), vs1 = v.stride(1);
  const int64_t nblk = np / KB;
  at::parallel_for(0, KVH * nblk, 1, [&](int64_t a, int64_t b) {
    alignas(64) uint32_t row[D2], r2[D2];
    alignas(64) float centred[D];
    for (int64_t item = a; item < b; ++item) {
      const int64_t g = item / nblk, t0 = item % nblk * KB, t1 = std::min(L, t0 + KB);
      uint32_t* kg = kp.data() + g * D2 * np;
      uint32_t* vg = vp.data() + g * np / 2 * D;
      for (int64_t t = t0; t < t1; ++t) {                // Kp: transpose of the pairs
        if constexpr (std::is_same_v<T, float>) {
          const float* kt = kd + t * ks0 + g * ks1;
          const float* k0 = kd + g * ks1;                // position 0's key
          for (int64_t d = 0; d < D; ++d) centred[d] = kt[d] - k0[d];
          bf16_pairs(centred, D, row);
        } else {
          bf16_pairs(kd + t * ks0 + g * ks1, D, row);
        }
        for (int64_t i = 0; i < D2; ++i) kg[i * np + t] = row[i];
      }
      for (int64_t t = t0; t < t1; t += 2) {             // Vp: rows 2j, 2j + 1 interleaved
        bf16_pairs(vd + t * vs0 + g * vs1, D, row);
        if (t + 1 < t1) bf16_pairs(vd + (t + 1) * vs0 + g * vs1, D, r2);
        else std::memset(r2, 0, sizeof(r2));
        const uint16_t* a16 = reinterpret_cast<const uint16_t*>(row);
        const uint16_t* b16 = reinterpret_cast<const uint16_t*>(r2);
        uint32_t* dst = vg + t / 2 * D;
        for (int64_t d = 0; d < D; ++d) dst[d] = a16[d] | (static_cast<uint32_t>(b16[d]) << 16);
      }
    }
  });
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  for_query_blocks(n, H, G, [&](int64_t h, int64_t g, int64_t q0, int64_t rows) {
    attend_bf16<NV>(qp + q0 * q.stride(0) + h * D, q.stride(0), q0, rows, off,
                    kp.data() + g * D2 * np, vp.data() + g * np / 2 * D, np,
                    op + (q0 * H + h) * D, H * D, scale);
  });
}

}  // namespace
#endif

bool bf16_attention_available() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

// q [n, H, D] float32, k / v [L, KVH, D] float32 or bfloat16 (L >= n; rows and heads may
// be strided, each head's D contiguous) -> [n, H, D] float32: causal attention of the
// chunk's rows (positions L - n ..) over the context, in bfloat16 dot products. Empty
// where this build or shape is not covered (no AVX512-BF16, D not 64, 128 or 256).
torch::Tensor prefill_attention_bf16(torch::Tensor q, torch::Tensor k, torch::Tensor v,
                                     double scale) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "q, k, v: [n, heads, D]");
  TORCH_CHECK(k.sizes() == v.sizes() && q.size(2) == k.size(2) && k.size(0) >= q.size(0) &&
              q.size(1) % k.size(1) == 0 && k.scalar_type() == v.scalar_type(),
              "shape mismatch");
#if defined(__AVX512BF16__)
  const int64_t D = q.size(2);
  const bool dense = q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1 && q.stride(1) == D;
  const bool kv_ok = k.scalar_type() == torch::kFloat32 || k.scalar_type() == torch::kBFloat16;
  if (q.scalar_type() == torch::kFloat32 && kv_ok && dense && (D == 64 || D == 128 || D == 256)) {
    auto out = torch::empty({q.size(0), q.size(1), D}, q.options());
    const float sc = static_cast<float>(scale);
    const bool f32 = k.scalar_type() == torch::kFloat32;
    if (D == 64) f32 ? run_bf16<4, float>(q, k, v, out, sc) : run_bf16<4, at::BFloat16>(q, k, v, out, sc);
    else if (D == 128) f32 ? run_bf16<8, float>(q, k, v, out, sc) : run_bf16<8, at::BFloat16>(q, k, v, out, sc);
    else f32 ? run_bf16<16, float>(q, k, v, out, sc) : run_bf16<16, at::BFloat16>(q, k, v, out, sc);
    return out;
  }
#endif
  return torch::empty({0}, q.options());
}
