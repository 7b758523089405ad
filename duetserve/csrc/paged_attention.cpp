// Decode attention that reads the paged KV cache in place (no gather of whole contexts).
//
// One query token per sequence. For each (sequence, KV head) the G = H / KVH query heads
// that share the KV head are processed together, so each K and V row is read once:
//   pass 1: s[g][t] = scale * <q[g], K[t]> over the context, t found through the block
//           table (slot = block_table[t / bs] * bs + t % bs);
//   softmax over t (max-subtracted, in float32);
//   pass 2: out[g] = sum_t p[g][t] * V[t].
// The cache is [KVH, num_blocks, block_size, D] per tensor (heads first), float32 or
// bfloat16; math is float32. Work items (sequence, KV head) run in parallel.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <vector>

template <typename T>
static inline float to_f(T x) { return static_cast<float>(x); }
template <>
inline float to_f<at::BFloat16>(at::BFloat16 x) { return static_cast<float>(x); }

#if defined(__AVX512F__)
#include <immintrin.h>
#include "simd_exp.h"   // exp16 (the scalar std::exp was this kernel's largest cost)
#include "simd_sum.h"   // sum4

// 16 cache elements as float32 lanes (bfloat16: the high half of a float32).
static inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
static inline __m512 load16(const at::BFloat16* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(
      _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}

// Prefetch one cache row (`bytes` long) into L2. (Into L1, _MM_HINT_T0, measured no
// faster than no prefetch at all; into L2 or L3, 1.4-1.6x faster: 64 sequences of ~300
// tokens, SmolLM2's heads, float32 cache, AMD EPYC Zen 4, 2 threads.)
static inline void prefetch_row(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t o = 0; o < bytes; o += 64) _mm_prefetch(c + o, _MM_HINT_T1);
}

// D a multiple of 16 and <= 256, G <= 8. The context is walked block by block: each block
// of the cache is bs contiguous rows (one 4 KiB page for 16 float32 rows of 64, where the
// hardware prefetcher stops), so while a block's rows are used the same rows of the next
// block in the table are prefetched. Scores of 4 keys are summed horizontally at once.
template <typename KV>
static bool decode_avx512(const float* q, const KV* kc, const KV* vc, const int64_t* tables,
                          const int64_t* lens, float* out, int64_t B, int64_t H, int64_t KVH,
                          int64_t D, int64_t num_blocks, int64_t bs, int64_t max_blocks,
                          float scale, int64_t window) {
  constexpr int64_t MAXV = 16;                  // D / 16 <= 16
  const int64_t G = H / KVH, nv = D / 16;
  if (D % 16 || nv > MAXV || G > 8) return false;
  const int64_t head_stride = num_blocks * bs * D;
  const int64_t row_bytes = D * static_cast<int64_t>(sizeof(KV));
  at::parallel_for(0, B * KVH, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / KVH, kh = item % KVH;
      const int64_t L = lens[b];
      const int64_t T0 = window > 0 && L > window ? L - window : 0;   // first key read
      const int64_t* table = tables + b * max_blocks;
      const float* qb = q + (b * H + kh * G) * D;
      const KV* kbase = kc + kh * head_stride;
      const KV* vbase = vc + kh * head_stride;
      scores.resize(G * L);
      // pass 1: scores (of keys T0..L-1; the blocks before T0's may be released)
      for (int64_t t0 = T0 / bs * bs; t0 < L; t0 += bs) {
        const int64_t n = std::min(bs, L - t0);
        const KV* kb = kbase + table[t0 / bs] * bs * D;
        const KV* knext = t0 + bs < L ? kbase + table[t0 / bs + 1] * bs * D : nullptr;
        int64_t j = std::max<int64_t>(0, T0 - t0);
        for (; j + 4 <= n; j += 4) {
          if (knext)
            for (int64_t r = 0; r < 4; ++r) prefetch_row(knext + (j + r) * D, row_bytes);
          const KV* k0 = kb + j * D;
          for (int64_t g = 0; g < G; ++g) {
            const float* qg = qb + g * D;
            __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
            for (int64_t i = 0; i < nv; ++i) {
              const __m512 qv = _mm512_loadu_ps(qg + 16 * i);
              a0 = _mm512_fmadd_ps(load16(k0 + 16 * i), qv, a0);
              a1 = _mm512_fmadd_ps(load16(k0 + D + 16 * i), qv, a1);
              a2 = _mm512_fmadd_ps(load16(k0 + 2 * D + 16 * i), qv, a2);
              a3 = _mm512_fmadd_ps(load16(k0 + 3 * D + 16 * i), qv, a3);
            }
            _mm_storeu_ps(scores.data() + g * L + t0 + j,
                          _mm_mul_ps(sum4(a0, a1, a2, a3), _mm_set1_ps(scale)));
          }
        }
        for (; j < n; ++j) {
          const KV* krow = kb + j * D;
          for (int64_t g = 0; g < G; ++g) {
            __m512 acc = _mm512_setzero_ps();
            for (int64_t i = 0; i < nv; ++i)
              acc = _mm512_fmadd_ps(load16(krow + 16 * i), _mm512_loadu_ps(qb + g * D + 16 * i), acc);
            scores[g * L + t0 + j] = _mm512_reduce_add_ps(acc) * scale;
          }
        }
      }
      // softmax over each head's scores
      for (int64_t g = 0; g < G; ++g) {
        float* sg = scores.data() + g * L;
        float m = -INFINITY;
        for (int64_t t = T0; t < L; ++t) m = sg[t] > m ? sg[t] : m;
        const __m512 mv = _mm512_set1_ps(m);
        __m512 sumv = _mm512_setzero_ps();
        int64_t t = T0;
        for (; t + 16 <= L; t += 16) {
          const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(sg + t), mv));
          _mm512_storeu_ps(sg + t, e);
          sumv = _mm512_add_ps(sumv, e);
        }
        float sum = _mm512_reduce_add_ps(sumv);
        for (; t < L; ++t) { sg[t] = std::exp(sg[t] - m); sum += sg[t]; }
        const float inv = 1.f / sum;
        for (t = T0; t < L; ++t) sg[t] *= inv;
      }
      // pass 2: weighted sum of values
      __m512 acc[8][MAXV];
      for (int64_t g = 0; g < G; ++g)
        for (int64_t i = 0; i < nv; ++i) acc[g][i] = _mm512_setzero_ps();
      for (int64_t t0 = T0 / bs * bs; t0 < L; t0 += bs) {
        const int64_t n = std::min(bs, L - t0);
        const KV* vb = vbase + table[t0 / bs] * bs * D;
        const KV* vnext = t0 + bs < L ? vbase + table[t0 / bs + 1] * bs * D : nullptr;
        for (int64_t j = std::max<int64_t>(0, T0 - t0); j < n; ++j) {
          if (vnext) prefetch_row(vnext + j * D, row_bytes);
          const KV* vrow = vb + j * D;
          for (int64_t i = 0; i < nv; ++i) {
            const __m512 v = load16(vrow + 16 * i);
            for (int64_t g = 0; g < G; ++g)
              acc[g][i] = _mm512_fmadd_ps(_mm512_set1_ps(scores[g * L + t0 + j]), v, acc[g][i]);
          }
        }
      }
      float* ob = out + (b * H + kh * G) * D;
      for (int64_t g = 0; g < G; ++g)
        for (int64_t i = 0; i < nv; ++i) _mm512_storeu_ps(ob + g * D + 16 * i, acc[g][i]);
    }
  });
  return true;
}
#endif

template <typename KV>
static void decode_impl(const float* q, const KV* kc, const KV* vc, const int64_t* tables,
                        const int64_t* lens, float* out, int64_t B, int64_t H, int64_t KVH,
                        int64_t D, int64_t num_blocks, int64_t bs, int64_t max_blocks,
                        float scale, int64_t window) {
  const int64_t G = H / KVH;
  const int64_t head_stride = num_blocks * bs * D;   // elements per KV head
  at::parallel_for(0, B * KVH, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<float> acc(G * D);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / KVH, kh = item % KVH;
      const int64_t L = lens[b];
      const int64_t T0 = window > 0 && L > window ? L - window : 0;   // first key read
      const int64_t* table = tables + b * max_blocks;
      const float* qb = q + (b * H + kh * G) * D;     // G query heads, contiguous
      const KV* kh_base = kc + kh * head_stride;
      const KV* vh_base = vc + kh * head_stride;
      scores.assign(G * L, 0.f);
      for (int64_t t = T0; t < L; ++t) {
        const KV* krow = kh_base + (table[t / bs] * bs + t % bs) * D;
        for (int64_t g = 0; g < G; ++g) {
          const float* qg = qb + g * D;
          float s = 0.f;
#pragma omp simd reduction(+ : s)
          for (int64_t d = 0; d < D; ++d) s += qg[d] * to_f(krow[d]);
          scores[g * L + t] = s * scale;
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
        const KV* vrow = vh_base + (table[t / bs] * bs + t % bs) * D;
        for (int64_t g = 0; g < G; ++g) {
          const float p = scores[g * L + t];
          float* ag = acc.data() + g * D;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) ag[d] += p * to_f(vrow[d]);
        }
      }
      float* ob = out + (b * H + kh * G) * D;
      std::copy(acc.begin(), acc.end(), ob);
    }
  });
}

// q: [B, H, D] float32 contiguous; k_cache, v_cache: [KVH, num_blocks, bs, D];
// block_tables: [B, max_blocks] int64; context_lens: [B] int64; window > 0: only the last
// `window` positions of each context are read (a sliding-window layer), 0: all of them.
// Returns [B, H, D] float32.
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache,
                                     torch::Tensor v_cache, torch::Tensor block_tables,
                                     torch::Tensor context_lens, double scale, int64_t window) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == torch::kFloat32 && q.is_contiguous(),
              "q must be a contiguous float32 [B, H, D] tensor");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "caches must be contiguous [KVH, num_blocks, block_size, D]");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "K and V dtypes differ");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt64 && block_tables.is_contiguous(),
              "block_tables must be contiguous int64");
  TORCH_CHECK(context_lens.scalar_type() == torch::kInt64, "context_lens must be int64");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t KVH = k_cache.size(0), nb = k_cache.size(1), bs = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == D && H % KVH == 0, "head sizes do not match");
  TORCH_CHECK(block_tables.size(0) == B && context_lens.size(0) == B, "batch sizes differ");
  auto out = torch::empty_like(q);
  auto lens = context_lens.contiguous();
  if (k_cache.scalar_type() == torch::kFloat32) {
#if defined(__AVX512F__)
    if (decode_avx512<float>(q.data_ptr<float>(), k_cache.data_ptr<float>(),
                          v_cache.data_ptr<float>(), block_tables.data_ptr<int64_t>(),
                          lens.data_ptr<int64_t>(), out.data_ptr<float>(), B, H, KVH, D, nb, bs,
                          block_tables.size(1), static_cast<float>(scale), window))
      return out;
#endif
    decode_impl<float>(q.data_ptr<float>(), k_cache.data_ptr<float>(),
                       v_cache.data_ptr<float>(), block_tables.data_ptr<int64_t>(),
                       lens.data_ptr<int64_t>(), out.data_ptr<float>(), B, H, KVH, D, nb, bs,
                       block_tables.size(1), static_cast<float>(scale), window);
  } else if (k_cache.scalar_type() == torch::kBFloat16) {
#if defined(__AVX512F__)
    if (decode_avx512<at::BFloat16>(q.data_ptr<float>(), k_cache.data_ptr<at::BFloat16>(),
                                    v_cache.data_ptr<at::BFloat16>(),
                                    block_tables.data_ptr<int64_t>(), lens.data_ptr<int64_t>(),
                                    out.data_ptr<float>(), B, H, KVH, D, nb, bs,
                                    block_tables.size(1), static_cast<float>(scale), window))
      return out;
#endif
    decode_impl<at::BFloat16>(q.data_ptr<float>(), k_cache.data_ptr<at::BFloat16>(),
                              v_cache.data_ptr<at::BFloat16>(),
                              block_tables.data_ptr<int64_t>(), lens.data_ptr<int64_t>(),
                              out.data_ptr<float>(), B, H, KVH, D, nb, bs,
                              block_tables.size(1), static_cast<float>(scale), window);
  } else {
    TORCH_CHECK(false, "KV cache dtype must be float32 or bfloat16");
  }
  return out;
}
