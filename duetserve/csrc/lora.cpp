// LoRA updates of a step's rows, grouped by adapter (models/lora.py LoRABatch): for each
// group g (its rows rows[off[g] .. off[g + 1])), y[row] += B_g (A_g x[row]), where
//   A_g  [P r, in]      the shrink matrices of the P targeted parts of the linear, stacked;
//   Bt_g [r, sum sizes]  the expand matrices transposed, part p's columns for its output
//                        rows spans_g[p] = (start, end) of y, in part order;
// float32 or bfloat16 weights, float32 math. Shrink: one dot per (group, rank row, row);
// expand: per output chunk of 16 columns, a broadcast FMA per rank column (no horizontal
// sums). Rows of different groups and chunks of different columns are disjoint: work items
// run in parallel without locks. The scaling is folded into B when the adapter loads.
#include <torch/extension.h>
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
  for (; k + 64 <= n; k += 64)
    for (int c = 0; c < 4; ++c)
      acc[c] = _mm512_fmadd_ps(load16w(a + k + 16 * c, 0xFFFF),
                               _mm512_loadu_ps(x + k + 16 * c), acc[c]);
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

// y[row, c0 .. c1) += sum_j u[j] Bt[j, b0 + (c - c0)] for j < r (Bt rows `ld` apart)
template <typename W>
void expand(const W* bt, int64_t ld, int64_t r, const float* u, float* yrow, int64_t c0,
            int64_t c1, int64_t b0) {
#if defined(__AVX512F__)
  for (int64_t c = c0; c < c1; c += 16) {
    const __mmask16 m = tail(c1 - c);
    __m512 acc = _mm512_maskz_loadu_ps(m, yrow + c);
    for (int64_t j = 0; j < r; ++j)
      acc = _mm512_fmadd_ps(_mm512_set1_ps(u[j]), load16w(bt + j * ld + b0 + (c - c0), m), acc);
    _mm512_mask_storeu_ps(yrow + c, m, acc);
  }
#else
  for (int64_t c = c0; c < c1; ++c) {
    float s = yrow[c];
    for (int64_t j = 0; j < r; ++j) s += u[j] * wval(bt, j * ld + b0 + (c - c0));
    yrow[c] = s;
  }
#endif
}

template <typename W>
void apply(const torch::Tensor& x, torch::Tensor& y, const std::vector<torch::Tensor>& as,
           const std::vector<torch::Tensor>& bts, const std::vector<torch::Tensor>& spans,
           const int64_t* rows, const int64_t* off) {
  const int64_t G = static_cast<int64_t>(as.size()), in = x.size(1), out = y.size(1);
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  // shrink: u_g [n_g, P r], one work item per (group, rank row)
  std::vector<std::vector<float>> u(G);
  std::vector<int64_t> first(G + 1, 0);
  for (int64_t g = 0; g < G; ++g) {
    u[g].assign((off[g + 1] - off[g]) * as[g].size(0), 0.f);
    first[g + 1] = first[g] + as[g].size(0);
  }
  at::parallel_for(0, first[G], 1, [&](int64_t b, int64_t e) {
    for (int64_t item = b; item < e; ++item) {
      const int64_t g = std::upper_bound(first.begin(), first.end(), item) - first.begin() - 1;
      const int64_t j = item - first[g], R = as[g].size(0);
      const W* a = reinterpret_cast<const W*>(as[g].data_ptr()) + j * in;
      for (int64_t i = 0; i < off[g + 1] - off[g]; ++i)
        u[g][i * R + j] = dot(a, xp + rows[off[g] + i] * in, in);
    }
  });
  // expand: one work item per (group, part, chunk of 2048 output columns: long runs of each Bt row for the prefetchers)
  struct Item { int64_t g, p, c0, c1, b0; };
  std::vector<Item> items;
  for (int64_t g = 0; g < G; ++g) {
    const int64_t* sp = spans[g].data_ptr<int64_t>();
    int64_t b0 = 0;
    for (int64_t p = 0; p < spans[g].size(0); ++p) {
      for (int64_t c = sp[2 * p]; c < sp[2 * p + 1]; c += 2048)
        items.push_back({g, p, c, std::min(c + 2048, sp[2 * p + 1]), b0 + c - sp[2 * p]});
      b0 += sp[2 * p + 1] - sp[2 * p];
    }
  }
  at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t b, int64_t e) {
    for (int64_t k = b; k < e; ++k) {
      const Item& it = items[k];
      const torch::Tensor& bt = bts[it.g];
      const int64_t r = bt.size(0), R = as[it.g].size(0);
      const W* bp = reinterpret_cast<const W*>(bt.data_ptr());
      for (int64_t i = 0; i < off[it.g + 1] - off[it.g]; ++i)
        expand(bp, bt.size(1), r, u[it.g].data() + i * R + it.p * r,
               yp + rows[off[it.g] + i] * out, it.c0, it.c1, it.b0);
    }
  });
}

}  // namespace

void lora_apply(torch::Tensor x, torch::Tensor y, std::vector<torch::Tensor> as,
                std::vector<torch::Tensor> bts, std::vector<torch::Tensor> spans,
                torch::Tensor rows, torch::Tensor offsets) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && y.scalar_type() == torch::kFloat32 &&
              x.is_contiguous() && y.is_contiguous() && x.dim() == 2 && y.dim() == 2 &&
              x.size(0) == y.size(0), "x [T, in], y [T, out]: contiguous float32");
  TORCH_CHECK(as.size() == bts.size() && as.size() == spans.size() &&
              offsets.numel() == static_cast<int64_t>(as.size()) + 1,
              "one A, Bt and span list per group, offsets [G + 1]");
  TORCH_CHECK(rows.scalar_type() == torch::kInt64 && offsets.scalar_type() == torch::kInt64 &&
              rows.is_contiguous() && offsets.is_contiguous(), "rows, offsets: int64");
  if (as.empty()) return;
  const auto dt = as[0].scalar_type();
  for (size_t g = 0; g < as.size(); ++g) {
    TORCH_CHECK(as[g].scalar_type() == dt && bts[g].scalar_type() == dt &&
                as[g].is_contiguous() && bts[g].is_contiguous() &&
                as[g].size(1) == x.size(1) && as[g].size(0) == bts[g].size(0) * spans[g].size(0)
                && spans[g].scalar_type() == torch::kInt64 && spans[g].is_contiguous(),
                "group ", g, ": A [P r, in], Bt [r, sum sizes], spans int64 [P, 2]");
    const int64_t* sp = spans[g].data_ptr<int64_t>();
    int64_t total = 0;
    for (int64_t p = 0; p < spans[g].size(0); ++p) {
      TORCH_CHECK(0 <= sp[2 * p] && sp[2 * p] <= sp[2 * p + 1] && sp[2 * p + 1] <= y.size(1),
                  "span outside y");
      total += sp[2 * p + 1] - sp[2 * p];
    }
    TORCH_CHECK(total == bts[g].size(1), "Bt's columns are the spans' sizes");
  }
  const int64_t* rp = rows.data_ptr<int64_t>();
  const int64_t* op = offsets.data_ptr<int64_t>();
  for (int64_t i = 0; i < rows.numel(); ++i)
    TORCH_CHECK(0 <= rp[i] && rp[i] < x.size(0), "row index outside x");
  if (dt == torch::kFloat32) apply<float>(x, y, as, bts, spans, rp, op);
  else if (dt == torch::kBFloat16) apply<at::BFloat16>(x, y, as, bts, spans, rp, op);
  else TORCH_CHECK(false, "LoRA weights: float32 or bfloat16");
}
