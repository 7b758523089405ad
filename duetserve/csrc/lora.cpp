// LoRA updates of a step's rows, grouped by adapter (models/lora.py LoRABatch): for each
// group g (its rows rows[off[g] .. off[g + 1])), y[row] += B_g (A_g x[row]), where
//   A_g  [P r, in]      the shrink matrices of the P targeted parts of the linear, stacked;
//   Bt_g [C / 16, r, 16] the expand matrices transposed ([r, C]: part p's columns, padded
//                        to a multiple of 16, for its output rows spans_g[p] = (start, end)
//                        of y, in part order), stored as tiles of 16 columns: a tile's r
//                        rows are 16 r contiguous values, so the expand reads one stream;
// float32, bfloat16 or int8 weights, float32 math; int8 weights carry a float32 scale per
// row of A (a_scale_g [P r]) and per column of Bt (bt_scale_g [C]), applied once per dot
// and once per 16 columns. Shrink: one dot per (group, rank row, row); expand: per tile, a
// broadcast FMA per rank row, four tiles at a time (no horizontal sums). Rows of different
// groups and chunks of different columns are disjoint: work items run in parallel without
// locks. The scaling is folded into B when the adapter loads; adapters come as NativeLoRA
// (ops.h), made once per adapter (models/lora.py native_form).
#include "ops.h"
#include <ATen/Parallel.h>
#include <algorithm>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

template <typename W>
inline float wval(const W* p, int64_t i) { return static_cast<float>(p[i]); }

#if defined(__AVX512F__)
inline __m512 load16w(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 load16w(const at::BFloat16* p, __mmask16 m) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(
      _mm256_maskz_loadu_epi16(m, reinterpret_cast<const __m256i*>(p))), 16));
}
inline __m512 load16w(const int8_t* p, __mmask16 m) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(m, p)));
}
// Asks for the `bytes` after p (the weights are cold: read once a step from DRAM, in
// streams too short for the hardware prefetchers to reach full speed)
inline void prefetch(const void* p, int64_t bytes) {
  for (int64_t b = 0; b < bytes; b += 64)
    _mm_prefetch(reinterpret_cast<const char*>(p) + b, _MM_HINT_T0);
}
inline __mmask16 tail(int64_t left) {
  return left >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1);
}
#endif

template <typename W>
float dot(const W* a, const float* x, int64_t n) {
#if defined(__AVX512F__)
  __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(),
                   _mm512_setzero_ps()};       // four chains: not bound by the FMA latency
  int64_t k = 0;
  for (; k + 64 <= n; k += 64) {
    prefetch(a + k + 512, 64 * sizeof(W));
    for (int c = 0; c < 4; ++c)
      acc[c] = _mm512_fmadd_ps(load16w(a + k + 16 * c, 0xFFFF),
                               _mm512_loadu_ps(x + k + 16 * c), acc[c]);
  }
  for (; k < n; k += 16) {
    const __mmask16 m = tail(n - k);
    acc[0] = _mm512_fmadd_ps(load16w(a + k, m), _mm512_maskz_loadu_ps(m, x + k), acc[0]);
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(acc[0], acc[1]),
                                            _mm512_add_ps(acc[2], acc[3])));
#else
  float s = 0.f;
  for (int64_t k = 0; k < n; ++k) s += wval(a, k) * x[k];
  return s;
#endif
}

// y[row, c0 .. c1) += sum_j u[j] Bt[j, b0 + (c - c0)] for j < r (Bt tiled, b0 a multiple
// of 16). `scale` (int8 weights only, else null): Bt's column scales [C]
template <typename W>
void expand(const W* bt, int64_t r, const float* u, float* yrow, int64_t c0, int64_t c1,
            int64_t b0, const float* scale) {
#if defined(__AVX512F__)
  int64_t c = c0;
  // four tiles at a time: four independent FMA chains (one chain of r FMAs is bound by
  // the FMA latency, about 4x slower)
  for (; c + 64 <= c1; c += 64) {
    const W* tile = bt + (b0 + c - c0) * r;
    prefetch(tile + 4 * 64 * r, 64 * r * sizeof(W));   // four iterations ahead
    __m512 acc[4];
    for (int k = 0; k < 4; ++k)
      acc[k] = scale ? _mm512_setzero_ps() : _mm512_loadu_ps(yrow + c + 16 * k);
    for (int64_t j = 0; j < r; ++j) {
      const __m512 uj = _mm512_set1_ps(u[j]);
      for (int k = 0; k < 4; ++k)
        acc[k] = _mm512_fmadd_ps(uj, load16w(tile + 16 * (k * r + j), 0xFFFF), acc[k]);
    }
    for (int k = 0; k < 4; ++k) {
      if (scale)
        acc[k] = _mm512_fmadd_ps(acc[k], _mm512_loadu_ps(scale + b0 + (c - c0) + 16 * k),
                                 _mm512_loadu_ps(yrow + c + 16 * k));
      _mm512_storeu_ps(yrow + c + 16 * k, acc[k]);
    }
  }
  for (; c < c1; c += 16) {
    const __mmask16 m = tail(c1 - c);
    const W* tile = bt + (b0 + c - c0) * r;       // tile (b0 + c - c0) / 16: 16 r values
    __m512 acc = scale ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(m, yrow + c);
    for (int64_t j = 0; j < r; ++j)
      acc = _mm512_fmadd_ps(_mm512_set1_ps(u[j]), load16w(tile + 16 * j, 0xFFFF), acc);
    if (scale)
      acc = _mm512_fmadd_ps(acc, _mm512_maskz_loadu_ps(m, scale + b0 + (c - c0)),
                            _mm512_maskz_loadu_ps(m, yrow + c));
    _mm512_mask_storeu_ps(yrow + c, m, acc);
  }
#else
  for (int64_t c = c0; c < c1; ++c) {
    float s = 0.f;
    const int64_t col = b0 + c - c0;
    for (int64_t j = 0; j < r; ++j) s += u[j] * wval(bt, (col / 16 * r + j) * 16 + col % 16);
    yrow[c] += scale ? s * scale[b0 + (c - c0)] : s;
  }
#endif
}

// The update of one linear for the used groups: group g's weights ws[g], its rows
// rows[off[g] .. off[g + 1]) of x and y.
template <typename W>
void apply(const torch::Tensor& x, torch::Tensor& y, const std::vector<const LoRALinear*>& ws,
           const int64_t* rows, const std::vector<int64_t>& off) {
  const int64_t G = static_cast<int64_t>(ws.size()), in = x.size(1), out = y.size(1);
  const bool scaled = ws[0]->a_scale.defined();      // int8 weights
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  // shrink: u_g [n_g, P r], one work item per (group, rank row)
  std::vector<std::vector<float>> u(G);
  std::vector<int64_t> first(G + 1, 0);
  for (int64_t g = 0; g < G; ++g) {
    u[g].assign((off[g + 1] - off[g]) * ws[g]->a.size(0), 0.f);
    first[g + 1] = first[g] + ws[g]->a.size(0);
  }
  at::parallel_for(0, first[G], 1, [&](int64_t b, int64_t e) {
    for (int64_t item = b; item < e; ++item) {
      const int64_t g = std::upper_bound(first.begin(), first.end(), item) - first.begin() - 1;
      const int64_t j = item - first[g], R = ws[g]->a.size(0);
      const W* a = reinterpret_cast<const W*>(ws[g]->a.data_ptr()) + j * in;
      const float s = scaled ? ws[g]->a_scale.data_ptr<float>()[j] : 1.f;
      for (int64_t i = 0; i < off[g + 1] - off[g]; ++i)
        u[g][i * R + j] = s * dot(a, xp + rows[off[g] + i] * in, in);
    }
  });
  // expand: one work item per (group, part, chunk of 2048 output columns)
  struct Item { int64_t g, p, c0, c1, b0; };
  std::vector<Item> items;
  for (int64_t g = 0; g < G; ++g) {
    const int64_t* sp = ws[g]->spans.data_ptr<int64_t>();
    int64_t b0 = 0;
    for (int64_t p = 0; p < ws[g]->spans.size(0); ++p) {
      for (int64_t c = sp[2 * p]; c < sp[2 * p + 1]; c += 2048)
        items.push_back({g, p, c, std::min(c + 2048, sp[2 * p + 1]), b0 + c - sp[2 * p]});
      b0 += (sp[2 * p + 1] - sp[2 * p] + 15) / 16 * 16;
    }
  }
  at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t b, int64_t e) {
    for (int64_t k = b; k < e; ++k) {
      const Item& it = items[k];
      const LoRALinear& w = *ws[it.g];
      const int64_t r = w.bt.size(1), R = w.a.size(0);
      const W* bp = reinterpret_cast<const W*>(w.bt.data_ptr());
      const float* bs = scaled ? w.bt_scale.data_ptr<float>() : nullptr;
      for (int64_t i = 0; i < off[it.g + 1] - off[it.g]; ++i)
        expand(bp, r, u[it.g].data() + i * R + it.p * r, yp + rows[off[it.g] + i] * out,
               it.c0, it.c1, it.b0, bs);
    }
  });
}

}  // namespace

void NativeLoRA::set(int64_t layer, int64_t linear, torch::Tensor a, torch::Tensor bt,
                     torch::Tensor spans, c10::optional<torch::Tensor> a_scale,
                     c10::optional<torch::Tensor> bt_scale) {
  TORCH_CHECK(0 <= layer && layer < static_cast<int64_t>(layers.size()) && 0 <= linear &&
              linear < 4, "layer or linear out of range");
  const auto dt = a.scalar_type();
  TORCH_CHECK((dt == torch::kFloat32 || dt == torch::kBFloat16 || dt == torch::kInt8) &&
              bt.scalar_type() == dt, "LoRA weights: float32, bfloat16 or int8, A and Bt alike");
  TORCH_CHECK(a.is_contiguous() && bt.is_contiguous() && a.dim() == 2 && bt.dim() == 3 &&
              bt.size(2) == 16 && spans.scalar_type() == torch::kInt64 &&
              spans.is_contiguous() && spans.dim() == 2 && spans.size(1) == 2 &&
              a.size(0) == bt.size(1) * spans.size(0),
              "A [P r, in], Bt [C / 16, r, 16], spans int64 [P, 2]");
  const int64_t* sp = spans.data_ptr<int64_t>();
  int64_t total = 0;
  for (int64_t p = 0; p < spans.size(0); ++p) {
    TORCH_CHECK(0 <= sp[2 * p] && sp[2 * p] <= sp[2 * p + 1], "spans: (first, end) rows");
    total += (sp[2 * p + 1] - sp[2 * p] + 15) / 16 * 16;
  }
  TORCH_CHECK(total == bt.size(0) * 16,
              "Bt's columns are the spans' sizes, each padded to a multiple of 16");
  TORCH_CHECK((dt == torch::kInt8) == a_scale.has_value() &&
              a_scale.has_value() == bt_scale.has_value(),
              "int8 weights (and only they) take an A and a Bt scale");
  LoRALinear& w = layers[layer][linear];
  if (a_scale) {
    TORCH_CHECK(a_scale->scalar_type() == torch::kFloat32 && a_scale->is_contiguous() &&
                bt_scale->scalar_type() == torch::kFloat32 && bt_scale->is_contiguous() &&
                a_scale->numel() == a.size(0) && bt_scale->numel() == bt.size(0) * 16,
                "a_scale float32 [P r], bt_scale float32 [C]");
    w.a_scale = *a_scale;
    w.bt_scale = *bt_scale;
  }
  w.a = a;
  w.bt = bt;
  w.spans = spans;
  w.fan_in = a.size(1);
  w.out_end = 0;
  for (int64_t p = 0; p < spans.size(0); ++p) w.out_end = std::max(w.out_end, sp[2 * p + 1]);
}

void lora_apply(const torch::Tensor& x, torch::Tensor& y,
                const std::vector<const NativeLoRA*>& adapters, int64_t layer, int64_t linear,
                const torch::Tensor& rows, const torch::Tensor& offsets) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && y.scalar_type() == torch::kFloat32 &&
              x.is_contiguous() && y.is_contiguous() && x.dim() == 2 && y.dim() == 2 &&
              x.size(0) == y.size(0), "x [T, in], y [T, out]: contiguous float32");
  TORCH_CHECK(rows.scalar_type() == torch::kInt64 && offsets.scalar_type() == torch::kInt64 &&
              rows.is_contiguous() && offsets.is_contiguous() &&
              offsets.numel() == static_cast<int64_t>(adapters.size()) + 1,
              "rows, offsets: int64, offsets [G + 1]");
  TORCH_CHECK(0 <= linear && linear < 4, "linear out of range");
  const int64_t* rp = rows.data_ptr<int64_t>();
  const int64_t* op = offsets.data_ptr<int64_t>();
  std::vector<const LoRALinear*> ws;
  std::vector<int64_t> used_rows, off{0};     // the used groups' rows, in order
  for (size_t g = 0; g < adapters.size(); ++g) {
    TORCH_CHECK(layer >= 0 && layer < static_cast<int64_t>(adapters[g]->layers.size()),
                "layer out of range");
    const LoRALinear& w = adapters[g]->layers[layer][linear];
    if (!w.a.defined()) continue;              // this adapter leaves the linear alone
    TORCH_CHECK(w.fan_in == x.size(1) && w.out_end <= y.size(1),
                "LoRA weights do not fit x or y");
    TORCH_CHECK(ws.empty() || w.a.scalar_type() == ws[0]->a.scalar_type(),
                "the adapters of a step share one dtype");
    for (int64_t i = op[g]; i < op[g + 1]; ++i) {
      TORCH_CHECK(0 <= rp[i] && rp[i] < x.size(0), "row index outside x");
      used_rows.push_back(rp[i]);
    }
    ws.push_back(&w);
    off.push_back(static_cast<int64_t>(used_rows.size()));
  }
  if (ws.empty()) return;
  const auto dt = ws[0]->a.scalar_type();
  if (dt == torch::kFloat32) apply<float>(x, y, ws, used_rows.data(), off);
  else if (dt == torch::kBFloat16) apply<at::BFloat16>(x, y, ws, used_rows.data(), off);
  else apply<int8_t>(x, y, ws, used_rows.data(), off);
}
