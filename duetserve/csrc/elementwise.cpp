// Small fused row ops for decode steps, where torch's per-op dispatch costs more than the
// arithmetic: rms_norm (one pass, float32; with the residual add before it) and
// silu(gate) * up; and a row argmax.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <atomic>
#include <cmath>
#include <type_traits>
#include <vector>
#include "simd_exp.h"   // exp16 (AVX-512 builds)
#include "kv_rows.h"

namespace {
// Rows [b, e) of y = x * rsqrt(mean(x^2) + eps) * w (d columns); with `delta`, first
// x += delta row by row (x is then read back from where it was written).
void rms_rows(float* xp, const float* delta, const float* wp, float* yp, int64_t d, float eps,
              int64_t b, int64_t e) {
  for (int64_t r = b; r < e; ++r) {
    float* xr = xp + r * d;
    if (delta != nullptr) {
      const float* dr = delta + r * d;
#pragma omp simd
      for (int64_t i = 0; i < d; ++i) xr[i] += dr[i];
    }
    float ss = 0.f;
#pragma omp simd reduction(+ : ss)
    for (int64_t i = 0; i < d; ++i) ss += xr[i] * xr[i];
    const float inv = 1.f / std::sqrt(ss / d + eps);
    float* yr = yp + r * d;
#pragma omp simd
    for (int64_t i = 0; i < d; ++i) yr[i] = xr[i] * inv * wp[i];
  }
}
}  // namespace

// x [T, d] float32, w [d] float32 -> x * rsqrt(mean(x^2) + eps) * w
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && w.scalar_type() == torch::kFloat32,
              "rms_norm: float32 only");
  x = x.contiguous();
  const int64_t d = x.size(-1), rows = x.numel() / d;
  auto y = torch::empty_like(x);
  at::parallel_for(0, rows, 64, [&](int64_t b, int64_t e) {
    rms_rows(x.data_ptr<float>(), nullptr, w.data_ptr<float>(), y.data_ptr<float>(), d,
             static_cast<float>(eps), b, e);
  });
  return y;
}

// The residual add and the norm after it in one pass: x += delta, then rms_norm(x, w).
// x [T, d] float32 contiguous (mutated: it holds the sum), delta [T, d] float32. The sum
// and the norm are the same float32 operations as torch's add and rms_norm above, so
// the result equals x = x + delta; rms_norm(x) bit for bit.
torch::Tensor add_rms_norm(torch::Tensor x, torch::Tensor delta, torch::Tensor w, double eps) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && delta.scalar_type() == torch::kFloat32 &&
              w.scalar_type() == torch::kFloat32 && x.is_contiguous() &&
              x.sizes() == delta.sizes(), "add_rms_norm: contiguous float32 x, delta alike");
  delta = delta.contiguous();
  const int64_t d = x.size(-1), rows = x.numel() / d;
  auto y = torch::empty_like(x);
  at::parallel_for(0, rows, 64, [&](int64_t b, int64_t e) {
    rms_rows(x.data_ptr<float>(), delta.data_ptr<float>(), w.data_ptr<float>(),
             y.data_ptr<float>(), d, static_cast<float>(eps), b, e);
  });
  return y;
}


// gate_up [T, 2I] (float32 or bfloat16: gate | up) -> silu(gate) * up [T, I] float32.
// Every element takes the same instructions (16-lane vectors, the row's last one
// masked), so a row's result depends neither on the number of rows nor on the thread
// split: a verify row of a speculative step equals a decode of that position.
torch::Tensor silu_mul(torch::Tensor gate_up) {
  auto g = gate_up.to(torch::kFloat32).contiguous();
  const int64_t two_i = g.size(-1), inter = two_i / 2, rows = g.numel() / two_i;
  auto y = torch::empty({rows, inter}, g.options());
  const float* gp = g.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, rows, 1, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      const float* a = gp + r * two_i;
      const float* u = a + inter;
      float* o = yp + r * inter;
#if defined(__AVX512F__)
      for (int64_t i = 0; i < inter; i += 16) {
        const __mmask16 m = i + 16 <= inter ? (__mmask16)0xFFFF
                                            : (__mmask16)((1u << (inter - i)) - 1);
        const __m512 av = _mm512_maskz_loadu_ps(m, a + i);
        const __m512 den = _mm512_add_ps(_mm512_set1_ps(1.f),
                                         exp16(_mm512_sub_ps(_mm512_setzero_ps(), av)));
        _mm512_mask_storeu_ps(o + i, m, _mm512_mul_ps(_mm512_div_ps(av, den),
                                                      _mm512_maskz_loadu_ps(m, u + i)));
      }
#else
      for (int64_t i = 0; i < inter; ++i) o[i] = a[i] / (1.f + std::exp(-a[i])) * u[i];
#endif
    }
  });
  return y;
}

// gate_up [T, 2I] (float32 or bfloat16) -> gelu_tanh(gate) * up [T, I] float32, with
// gelu_tanh(a) = a / 2 (1 + tanh(c (a + 0.044715 a^3))), c = sqrt(2 / pi), and
// tanh(z) = 1 - 2 / (e^(2z) + 1) (exp16 saturates: tanh -> +-1). Same instructions for
// every element, as silu_mul.
torch::Tensor gelu_tanh_mul(torch::Tensor gate_up) {
  auto g = gate_up.to(torch::kFloat32).contiguous();
  const int64_t two_i = g.size(-1), inter = two_i / 2, rows = g.numel() / two_i;
  auto y = torch::empty({rows, inter}, g.options());
  const float* gp = g.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  constexpr float kC = 0.7978845608028654f;
  at::parallel_for(0, rows, 1, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      const float* a = gp + r * two_i;
      const float* u = a + inter;
      float* o = yp + r * inter;
#if defined(__AVX512F__)
      for (int64_t i = 0; i < inter; i += 16) {
        const __mmask16 m = i + 16 <= inter ? (__mmask16)0xFFFF
                                            : (__mmask16)((1u << (inter - i)) - 1);
        const __m512 av = _mm512_maskz_loadu_ps(m, a + i);
        const __m512 a3 = _mm512_mul_ps(_mm512_mul_ps(av, av), av);
        const __m512 z = _mm512_mul_ps(_mm512_set1_ps(kC),
                                       _mm512_fmadd_ps(a3, _mm512_set1_ps(0.044715f), av));
        const __m512 e2 = exp16(_mm512_add_ps(z, z));
        const __m512 th = _mm512_sub_ps(_mm512_set1_ps(1.f),
                                        _mm512_div_ps(_mm512_set1_ps(2.f),
                                                      _mm512_add_ps(e2, _mm512_set1_ps(1.f))));
        const __m512 gl = _mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(0.5f), av),
                                        _mm512_add_ps(_mm512_set1_ps(1.f), th));
        _mm512_mask_storeu_ps(o + i, m, _mm512_mul_ps(gl, _mm512_maskz_loadu_ps(m, u + i)));
      }
#else
      for (int64_t i = 0; i < inter; ++i) {
        const float x = a[i];
        o[i] = 0.5f * x * (1.f + std::tanh(kC * (x + 0.044715f * x * x * x))) * u[i];
      }
#endif
    }
  });
  return y;
}

// Decode steps: rotary on Q and K, and the K/V cache write, in one call (torch needs about
// ten ops per layer for this: slices, mul, roll, addcmul, two transposed index_copy_s).
//   qkv [T, (H + 2 KVH) D] float32, rows [q heads | k heads | v heads];
//   cos, sin [T, 1, D] float32 (sin signed as models/layers.py builds it, so that
//   rot(x)[i] = x[i] cos[i] + x[(i + D/2) % D] sin[i]);
//   k_cache, v_cache [KVH, num_blocks, block_size, D] float32 or bfloat16, written at
//   slot_mapping[t]. Returns the rotated q [T, H, D] float32. Mutates k_cache, v_cache.
// Each K row rotated into float32, then written in the cache's row format (kv_rows.h:
// float32, bfloat16, int8 or int4; rows W elements wide); V rows written as they are; for
// int8, K and the returned q also get kv_rows.h's Walsh-Hadamard rotation (q then rounded
// to its int8 grid: int8_query).
template <typename Rows>
static void rope_kv_rows(const float* qkv, const float* cs, const float* sn,
                          typename Rows::E* kc, typename Rows::E* vc, const int64_t* slots,
                          float* q, int64_t T, int64_t H, int64_t KVH, int64_t D,
                          int64_t head_stride) {
  const int64_t width = (H + 2 * KVH) * D, half = D / 2, W = Rows::width(D);
  at::parallel_for(0, T, 16, [&](int64_t b, int64_t e) {
    std::vector<float> tmp(D);
    for (int64_t t = b; t < e; ++t) {
      const float* row = qkv + t * width;
      const float* c = cs + t * D;
      const float* s = sn + t * D;
      for (int64_t h = 0; h < H + KVH; ++h) {
        const float* x = row + h * D;
        float* o = h < H ? q + (t * H + h) * D : tmp.data();
        for (int64_t i = 0; i < half; ++i) o[i] = x[i] * c[i] + x[i + half] * s[i];
        for (int64_t i = half; i < D; ++i) o[i] = x[i] * c[i] + x[i - half] * s[i];
        if (Rows::kRotatedKeys) {
          if (h < H) int8_query(o, D);
          else fwht(o, D);
        }
        if (h >= H) Rows::write(o, kc + (h - H) * head_stride + slots[t] * W, D);
      }
      for (int64_t h = 0; h < KVH; ++h)
        Rows::write(row + (H + KVH + h) * D, vc + h * head_stride + slots[t] * W, D);
    }
  });
}

torch::Tensor rope_kv_write(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin,
                            torch::Tensor k_cache, torch::Tensor v_cache,
                            torch::Tensor slot_mapping, int64_t H, int64_t KVH) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.scalar_type() == torch::kFloat32 && qkv.is_contiguous(),
              "qkv must be contiguous float32 [T, (H + 2 KVH) D]");
  TORCH_CHECK(cos.scalar_type() == torch::kFloat32 && sin.scalar_type() == torch::kFloat32 &&
              cos.is_contiguous() && sin.is_contiguous(), "cos/sin: contiguous float32");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() &&
              k_cache.scalar_type() == v_cache.scalar_type(), "caches: contiguous, same dtype");
  TORCH_CHECK(slot_mapping.scalar_type() == torch::kInt64 && slot_mapping.is_contiguous(),
              "slot_mapping: contiguous int64");
  const int64_t T = qkv.size(0), D = qkv.size(1) / (H + 2 * KVH);
  const auto kind = k_cache.scalar_type();
  const int64_t W = kind == torch::kInt8 ? RowsQ8::width(D)
                    : kind == torch::kUInt8 ? RowsQ4::width(D) : D;
  TORCH_CHECK(qkv.size(1) == (H + 2 * KVH) * D && k_cache.size(0) == KVH && D % 2 == 0 &&
              k_cache.size(3) == W, "head sizes do not match");
  TORCH_CHECK(cos.numel() == T * D && sin.numel() == T * D && slot_mapping.numel() == T,
              "one cos/sin row and one slot per token");
  const int64_t head_stride = k_cache.size(1) * k_cache.size(2) * W;
  auto q = torch::empty({T, H, D}, qkv.options());
  const float* x = qkv.data_ptr<float>();
  const float* c = cos.data_ptr<float>();
  const float* s = sin.data_ptr<float>();
  const int64_t* sl = slot_mapping.data_ptr<int64_t>();
  float* qp = q.data_ptr<float>();
  if (kind == torch::kFloat32) {
    rope_kv_rows<RowsF32>(x, c, s, k_cache.data_ptr<float>(), v_cache.data_ptr<float>(), sl,
                          qp, T, H, KVH, D, head_stride);
  } else if (kind == torch::kBFloat16) {
    rope_kv_rows<RowsBF16>(x, c, s, k_cache.data_ptr<at::BFloat16>(),
                           v_cache.data_ptr<at::BFloat16>(), sl, qp, T, H, KVH, D,
                           head_stride);
  } else if (kind == torch::kInt8) {
    rope_kv_rows<RowsQ8>(x, c, s, k_cache.data_ptr<int8_t>(), v_cache.data_ptr<int8_t>(), sl,
                          qp, T, H, KVH, D, head_stride);
  } else if (kind == torch::kUInt8) {
    TORCH_CHECK(D % 32 == 0, "int4 KV needs a head size divisible by 32");
    rope_kv_rows<RowsQ4>(x, c, s, k_cache.data_ptr<uint8_t>(), v_cache.data_ptr<uint8_t>(),
                          sl, qp, T, H, KVH, D, head_stride);
  } else {
    TORCH_CHECK(false, "KV cache dtype must be float32, bfloat16, int8 or uint8 (int4)");
  }
  return q;
}


// x [M, V] float32 -> int64 [M]: the first index of each row's maximum, as torch.argmax
// returns it (-0.0 and 0.0 tie; a NaN counts as the maximum there, so when any row has
// one the whole call falls back to torch). torch's CPU argmax walks a row with scalar
// compares: 127 us over 151,936 logits on the 2-core EPYC, where the max alone takes
// 15 us; a greedy decode step takes one per sequence. Two passes: the max, then the
// first position equal to it.
torch::Tensor argmax_rows(torch::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.size(1) > 0,
              "argmax_rows: float32 [M, V] with V > 0");
  x = x.contiguous();
  const int64_t M = x.size(0), V = x.size(1);
  auto out = torch::empty({M}, x.options().dtype(torch::kInt64));
  int64_t* op = out.data_ptr<int64_t>();
  const float* xp = x.data_ptr<float>();
  std::atomic<bool> saw_nan{false};
  at::parallel_for(0, M, 4, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      const float* row = xp + r * V;
      bool nan = false;
      float m = -INFINITY;
      int64_t i = 0, idx = -1;
#if defined(__AVX512F__)
      __m512 mx = _mm512_set1_ps(-INFINITY);
      __mmask16 unordered = 0;
      for (; i + 16 <= V; i += 16) {
        const __m512 v = _mm512_loadu_ps(row + i);
        unordered |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        mx = _mm512_max_ps(mx, v);
      }
      m = _mm512_reduce_max_ps(mx);
      nan = unordered != 0;
#endif
      for (; i < V; ++i) {
        nan = nan || std::isnan(row[i]);
        m = row[i] > m ? row[i] : m;
      }
      if (nan) {
        saw_nan = true;
        continue;
      }
      i = 0;
#if defined(__AVX512F__)
      const __m512 mv = _mm512_set1_ps(m);
      for (; i + 16 <= V && idx < 0; i += 16) {
        const __mmask16 k = _mm512_cmp_ps_mask(_mm512_loadu_ps(row + i), mv, _CMP_EQ_OQ);
        if (k) idx = i + __builtin_ctz(static_cast<unsigned>(k));
      }
#endif
      for (; i < V && idx < 0; ++i)
        if (row[i] == m) idx = i;
      op[r] = idx;
    }
  });
  if (saw_nan) return x.argmax(-1);
  return out;
}
