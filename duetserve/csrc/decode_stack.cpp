// The decoder stack of a decode-only step in one call from Python.
//
// At batch 1 the kernels of a layer take tens of microseconds each, and Python's per-module
// and per-op dispatch costs about as much again (~130 us a layer on the 2-core machine, a
// third of a SmolLM2 decode step). DecodeStack holds each layer's weights once and runs,
// per layer, the same kernels the Python modules call for such a step, in the same order:
//   h = rms_norm(x); qkv = linear(h) (+ bias); q = rope_kv_write(qkv) (writes the cache);
//   o = paged_decode_attention(q); x += linear(o);
//   h = rms_norm(x); x += linear(silu(gate) * up of linear(h)),
// then the model's final norm, each residual add fused with the norm that follows it
// (add_rms_norm: the same float32 operations), so the result equals the module path's bit
// for bit for low-bit linears (a test checks it). A linear is q4, q4k or q6 (packed, N), q8 (q, scale) or dense float32 (weight), each with an
// optional bias; dense ones run f32_gemv up to the row count the loader measured it faster
// than oneDNN's GEMM (models/kernels.py: calibrate_dense_gemv_rows; the module path uses the
// same bound and the stack runs no bigger dense steps).
#include <cstring>
#include <vector>

#include "ops.h"

namespace {

// Steps of up to this many rows run silu_mul (models/layers.py's SILU_MUL_ROWS: the
// modules use the same bound, so both paths compute the same activations).
constexpr int64_t kSiluMulRows = 16;

// One linear: kind 4 (q4, q4k or q6: lowbit_gemv tells them apart) -> a = packed, n =
// output rows; kind 8 -> (a, b) = (packed, scale32); kind 7 (two packed parts stacked
// along N) -> a, c = the parts' packed weights, ns = their output rows; kind 0 -> dense a.
struct Linear {
  int kind = 0;
  int64_t n = 0;
  int64_t gemv_rows = 0;      // dense: f32_gemv up to this many rows, at::linear above
  torch::Tensor a, b, c, bias;   // bias undefined when absent
  std::vector<int64_t> ns;

  torch::Tensor operator()(const torch::Tensor& x) const {
    torch::Tensor y;
    if (kind == 4) y = lowbit_gemv(x, a, n);
    else if (kind == 8) y = q8_gemv(x, a, b);
    else if (kind == 7) y = stacked_gemv(x, {a, c}, ns);
    else if (x.size(0) <= gemv_rows) y = f32_gemv(x, a);
    else return bias.defined() ? at::linear(x, a, bias) : at::linear(x, a);
    return bias.defined() ? y.add_(bias) : y;
  }
};

Linear make_linear(const std::vector<torch::Tensor>& t, size_t i, int64_t gemv_rows) {
  // four slots per linear: a, b, c, bias; empty (numel 0) slots are absent
  Linear l;
  l.gemv_rows = gemv_rows;
  l.a = t.at(i);
  if (l.a.scalar_type() == torch::kUInt8) {   // packed q4 / q4k / q6 (lowbit_gemv checks)
    l.kind = 4;
    const torch::Tensor n = t.at(i + 1);   // int64: the output rows (of each part)
    if (t.at(i + 2).numel() > 0) {
      TORCH_CHECK(n.numel() == 2 && t.at(i + 2).scalar_type() == torch::kUInt8,
                  "stacked weight: two packed parts and their two row counts");
      l.kind = 7;
      l.c = t.at(i + 2);
      l.ns = {n[0].item<int64_t>(), n[1].item<int64_t>()};
    } else {
      l.n = n.item<int64_t>();
    }
  } else if (l.a.scalar_type() == torch::kInt8) {
    l.kind = 8;
    l.b = t.at(i + 1);
  } else {
    TORCH_CHECK(l.a.scalar_type() == torch::kFloat32, "dense weights: float32 only");
  }
  if (t.at(i + 3).numel() > 0) l.bias = t.at(i + 3);
  return l;
}

struct Layer {
  torch::Tensor in_norm, post_norm;
  Linear qkv, o, gate_up, down;
};

}  // namespace

class DecodeStack {
 public:
  // layers[i] = [input_norm, post_attention_norm, qkv(4 slots), o(4), gate_up(4), down(4)];
  // final_norm: the model's norm after the last layer (same eps); dense_gemv_rows: dense
  // linears run f32_gemv up to this many rows.
  DecodeStack(const std::vector<std::vector<torch::Tensor>>& layers, torch::Tensor final_norm,
              int64_t H, int64_t KVH, double eps, double scale, int64_t dense_gemv_rows)
      : final_norm_(final_norm), H_(H), KVH_(KVH), eps_(eps), scale_(scale) {
    for (const auto& t : layers) {
      TORCH_CHECK(t.size() == 18, "a layer is 2 norms + 4 linears of 4 slots");
      Layer l;
      l.in_norm = t[0];
      l.post_norm = t[1];
      l.qkv = make_linear(t, 2, dense_gemv_rows);
      l.o = make_linear(t, 6, dense_gemv_rows);
      l.gate_up = make_linear(t, 10, dense_gemv_rows);
      l.down = make_linear(t, 14, dense_gemv_rows);
      layers_.push_back(std::move(l));
    }
  }

  // The step from its token ids: ids, positions [T] int64; embed [V, d] float32 (the
  // embedding table; or, with ids empty, the step's own T embedding rows in order);
  // cos_table, sin_table [P, D] float32 (the rotary tables, rows by position). Gathers the embeddings and the step's rotary rows itself (plain row
  // copies: after a step's weight stream has evicted the caches, torch's embedding and
  // index ops cost ~50 us each), then runs the layers. Returns the final hidden states
  // [T, d] (after the final norm), or an empty tensor, with nothing run, when a position
  // is past the tables (the caller grows them and calls again). Mutates k_caches[i],
  // v_caches[i] (the step's K/V at slot_mapping).
  torch::Tensor forward(torch::Tensor ids, torch::Tensor positions, torch::Tensor embed,
                        torch::Tensor cos_table, torch::Tensor sin_table,
                        torch::Tensor slot_mapping, torch::Tensor block_tables,
                        torch::Tensor context_lens, const std::vector<torch::Tensor>& k_caches,
                        const std::vector<torch::Tensor>& v_caches) const {
    TORCH_CHECK(k_caches.size() == layers_.size() && v_caches.size() == layers_.size(),
                "one K and one V cache per layer");
    TORCH_CHECK(embed.scalar_type() == torch::kFloat32 && embed.dim() == 2 &&
                embed.is_contiguous(), "embed: contiguous float32 [V, d]");
    const bool rows_given = ids.numel() == 0;   // embed holds the step's rows
    TORCH_CHECK(ids.scalar_type() == torch::kInt64 && positions.scalar_type() == torch::kInt64 &&
                ids.dim() == 1 && positions.dim() == 1 &&
                positions.size(0) == (rows_given ? embed.size(0) : ids.size(0)),
                "ids: int64 [T] (or empty), positions: int64 [T]");
    TORCH_CHECK(cos_table.scalar_type() == torch::kFloat32 && cos_table.is_contiguous() &&
                sin_table.is_contiguous() && sin_table.sizes() == cos_table.sizes() &&
                cos_table.dim() == 2, "rotary tables: contiguous float32 [P, D], alike");
    ids = ids.contiguous();
    positions = positions.contiguous();
    const int64_t T = positions.size(0), V = embed.size(0), d = embed.size(1);
    const int64_t P = cos_table.size(0), D = cos_table.size(1);
    const int64_t* ip = ids.data_ptr<int64_t>();
    const int64_t* pp = positions.data_ptr<int64_t>();
    for (int64_t t = 0; t < T; ++t) {
      TORCH_CHECK(rows_given || (0 <= ip[t] && ip[t] < V), "token id ", ip[t],
                  " is outside the vocabulary of ", V);
      TORCH_CHECK(pp[t] >= 0, "negative position");
      if (pp[t] >= P) return torch::empty({0}, embed.options());
    }
    auto x = torch::empty({T, d}, embed.options());   // the residual stream (added to in place)
    auto cos = torch::empty({T, 1, D}, embed.options()), sin = torch::empty_like(cos);
    for (int64_t t = 0; t < T; ++t) {
      const int64_t row = rows_given ? t : ip[t];
      std::memcpy(x.data_ptr<float>() + t * d, embed.data_ptr<float>() + row * d, d * 4);
      std::memcpy(cos.data_ptr<float>() + t * D, cos_table.data_ptr<float>() + pp[t] * D, D * 4);
      std::memcpy(sin.data_ptr<float>() + t * D, sin_table.data_ptr<float>() + pp[t] * D, D * 4);
    }
    return layers(x, cos, sin, slot_mapping, block_tables, context_lens, k_caches, v_caches);
  }

 private:
  // The layers and the final norm over x [T, d] (mutated: the residual stream).
  torch::Tensor layers(torch::Tensor x, const torch::Tensor& cos, const torch::Tensor& sin,
                       const torch::Tensor& slot_mapping, const torch::Tensor& block_tables,
                       const torch::Tensor& context_lens,
                       const std::vector<torch::Tensor>& k_caches,
                       const std::vector<torch::Tensor>& v_caches) const {
    const int64_t T = x.size(0);
    torch::Tensor delta;   // the last layer's MLP output, added with the next layer's norm
    for (size_t i = 0; i < layers_.size(); ++i) {
      const Layer& l = layers_[i];
      torch::Tensor h = delta.defined() ? add_rms_norm(x, delta, l.in_norm, eps_)
                                        : rms_norm(x, l.in_norm, eps_);
      torch::Tensor qkv = l.qkv(h).contiguous();
      torch::Tensor q = rope_kv_write(qkv, cos, sin, k_caches[i], v_caches[i], slot_mapping,
                                      H_, KVH_);
      torch::Tensor att = paged_decode_attention(q, k_caches[i], v_caches[i], block_tables,
                                                 context_lens, scale_);
      torch::Tensor gu = l.gate_up(add_rms_norm(x, l.o(att.reshape({T, -1})), l.post_norm,
                                                eps_));
      torch::Tensor act;
      if (T <= kSiluMulRows && gu.is_contiguous()) {
        act = silu_mul(gu);     // rows independent of T: a verify row equals a decode
      } else {
        auto parts = gu.chunk(2, -1);
        act = at::silu(parts[0]) * parts[1];
      }
      delta = l.down(act);
    }
    return delta.defined() ? add_rms_norm(x, delta, final_norm_, eps_)
                           : rms_norm(x, final_norm_, eps_);
  }

  std::vector<Layer> layers_;
  torch::Tensor final_norm_;
  int64_t H_, KVH_;
  double eps_, scale_;
};

void bind_decode_stack(pybind11::module& m) {
  pybind11::class_<DecodeStack>(m, "DecodeStack")
      .def(pybind11::init<const std::vector<std::vector<torch::Tensor>>&, torch::Tensor,
                          int64_t, int64_t, double, double, int64_t>())
      .def("forward", &DecodeStack::forward,
           pybind11::call_guard<pybind11::gil_scoped_release>());   // see bindings.cpp
}
