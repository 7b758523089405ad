// The decoder stack of a decode-only step in one call from Python, for every model family.
//
// At batch 1 the kernels of a layer take tens of microseconds each, and Python's per-module
// and per-op dispatch costs about as much again (~130 us a layer on the 2-core machine, a
// third of a SmolLM2 decode step). DecodeStack holds each layer's weights once and runs,
// per layer, the same kernels the Python modules (models/decoder.py) call for such a step,
// in the same order:
//   h = rms_norm(x); qkv = linear(h) (+ bias); [q, k heads rms_norm'd: qk_norm];
//   q = rope_kv_write(qkv) (the layer kind's rotary rows; writes its KV group's cache);
//   o = paged_decode_attention(q) (over the layer's window); o = linear(o);
//   pre:      h = add_rms_norm(x, o);                    f = ffn(h)
//   sandwich: h = add_rms_norm(x, rms_norm(o)); f = rms_norm(ffn(h))     (Gemma)
//   ffn: down(act(gate | up of linear(h))), act silu or gelu_tanh, or a mixture of experts
//   (router GEMV, softmax, top k, experts grouped by row as models/moe.py does),
// with the step's LoRA updates (csrc/lora.cpp, where rows use adapters) added after the
// qkv, o, gate|up and down linears as the modules add them, then the model's final norm,
// each residual add fused with the norm that follows it (add_rms_norm: the same float32
// operations), so the result equals the module path's bit for bit for low-bit linears (a
// test checks it). A linear is q4, q4k or q6 (packed, N), q8
// (q, scale), two packed parts stacked, or dense float32 (weight), each with an optional
// bias; dense ones run f32_gemv up to the row count the loader measured it faster than
// oneDNN's GEMM (models/kernels.py: calibrate_dense_gemv_rows; the module path uses the same
// bound and the stack runs no bigger dense steps).
#include <cstring>
#include <vector>

#include "ops.h"

namespace {

// Steps of up to a layer's `fused_rows` rows run the fused activation kernels and the
// router's GEMV (the modules' act_rows / router_rows, models/layers.py's SILU_MUL_ROWS
// unless deterministic mode lifted it: both paths compute the same activations).

}  // namespace

// One linear layer's weights in the form its decode kernel reads; built from Python by
// the named constructors below (models/decode_stack.py).
struct NativeLinear {
  enum Kind { kDense, kLowbit, kQ8, kStacked };
  Kind kind = kDense;
  int64_t n = 0;              // output rows (lowbit)
  int64_t gemv_rows = 0;      // dense: f32_gemv up to this many rows, at::linear above
  torch::Tensor a, b, c, bias;   // bias undefined when absent
  std::vector<int64_t> ns;

  torch::Tensor operator()(const torch::Tensor& x) const {
    torch::Tensor y;
    if (kind == kLowbit) y = lowbit_gemv(x, a, n);
    else if (kind == kQ8) y = q8_gemv(x, a, b);
    else if (kind == kStacked) y = stacked_gemv(x, {a, c}, ns);
    else if (x.size(0) <= gemv_rows) y = f32_gemv(x, a);
    else return bias.defined() ? at::linear(x, a, bias) : at::linear(x, a);
    return bias.defined() ? y.add_(bias) : y;
  }
};

// One decoder layer. Norm weights absent (undefined) where the family has none; experts
// empty for a dense FFN.
struct NativeLayer {
  torch::Tensor in_norm, post_attn_norm, pre_ffn_norm, post_ffn_norm, q_norm, k_norm;
  NativeLinear qkv, o, gate_up, down;
  bool sandwich = false;
  bool gelu = false;          // the gated activation: gelu_tanh, else silu
  int64_t window = 0;         // sliding window (0: full attention)
  int64_t group = 0;          // its KV group: which slot mapping / block tables it reads
  int64_t rope = 0;           // its rotary tables: 0 full layers', 1 sliding layers'
  // mixture of experts
  torch::Tensor router;       // [E, d] float32
  std::vector<NativeLinear> expert_gate_up, expert_down;
  int64_t top_k = 0;
  bool norm_topk = true;
  int64_t fused_rows = 16;
};

namespace {

torch::Tensor gated_act(const torch::Tensor& gu, bool gelu, int64_t fused_rows) {
  if (gu.size(0) <= fused_rows && gu.is_contiguous())
    return gelu ? gelu_tanh_mul(gu) : silu_mul(gu);   // rows independent of T
  auto parts = gu.chunk(2, -1);
  return (gelu ? at::gelu(parts[0], "tanh") : at::silu(parts[0])) * parts[1];
}

// models/moe.py's MoEFFN.forward, op for op.
torch::Tensor moe(const NativeLayer& l, const torch::Tensor& x) {
  const int64_t T = x.size(0), E = l.router.size(0);
  torch::Tensor logits = T <= l.fused_rows ? f32_gemv(x, l.router) : at::linear(x, l.router);
  auto [weights, ids] = at::topk(at::softmax(logits, -1), l.top_k, -1);
  if (l.norm_topk) weights = weights / weights.sum(-1, true);
  auto out = torch::zeros(x.sizes(), x.options());
  auto flat = ids.reshape({-1});
  auto order = at::argsort(flat, /*stable=*/true);
  auto counts = at::bincount(flat, {}, E);
  auto rows = at::floor_divide(order, l.top_k);
  auto w = weights.reshape({-1}).index_select(0, order);
  const int64_t* cp = counts.data_ptr<int64_t>();
  int64_t at_ = 0;
  for (int64_t e = 0; e < E; ++e) {
    const int64_t n = cp[e];
    if (n == 0) continue;
    auto r = rows.slice(0, at_, at_ + n);
    auto y = l.expert_down[e](
        gated_act(l.expert_gate_up[e](x.index_select(0, r)), l.gelu, l.fused_rows));
    out.index_add_(0, r, y * w.slice(0, at_, at_ + n).unsqueeze(1));
    at_ += n;
  }
  return out;
}

}  // namespace

class DecodeStack {
 public:
  DecodeStack(std::vector<NativeLayer> layers, torch::Tensor final_norm, int64_t H,
              int64_t KVH, double eps, double scale, double embed_scale)
      : layers_(std::move(layers)), final_norm_(final_norm), H_(H), KVH_(KVH), eps_(eps),
        scale_(scale), embed_scale_(embed_scale) {}

  // The step from its token ids: ids, positions [T] int64; embed [V, d] float32 (the
  // embedding table; or, with ids empty, the step's own T embedding rows in order);
  // cos_tables, sin_tables: [P, D] float32 per rotary (full layers', then sliding
  // layers' where they differ), rows by position; per KV group its slot mapping and
  // block tables; context_lens shared. Gathers the embeddings (times the family's scale)
  // and the step's rotary rows itself (plain row copies: after a step's weight stream has
  // evicted the caches, torch's embedding and index ops cost ~50 us each), then runs the
  // layers. Returns the final hidden states [T, d] (after the final norm), or an empty
  // tensor, with nothing run, when a position is past the tables (the caller grows them
  // and calls again). Mutates k_caches[i], v_caches[i] (the step's K/V at its slots).
  torch::Tensor forward(torch::Tensor ids, torch::Tensor positions, torch::Tensor embed,
                        const std::vector<torch::Tensor>& cos_tables,
                        const std::vector<torch::Tensor>& sin_tables,
                        const std::vector<torch::Tensor>& slot_mappings,
                        const std::vector<torch::Tensor>& block_tables,
                        torch::Tensor context_lens, const std::vector<torch::Tensor>& k_caches,
                        const std::vector<torch::Tensor>& v_caches,
                        const std::vector<NativeLoRA*>& lora, torch::Tensor lora_rows,
                        torch::Tensor lora_offsets) const {
    TORCH_CHECK(k_caches.size() == layers_.size() && v_caches.size() == layers_.size(),
                "one K and one V cache per layer");
    TORCH_CHECK(slot_mappings.size() == block_tables.size() && !slot_mappings.empty(),
                "one slot mapping and one block table per KV group");
    TORCH_CHECK(embed.scalar_type() == torch::kFloat32 && embed.dim() == 2 &&
                embed.is_contiguous(), "embed: contiguous float32 [V, d]");
    const bool rows_given = ids.numel() == 0;   // embed holds the step's rows
    TORCH_CHECK(ids.scalar_type() == torch::kInt64 && positions.scalar_type() == torch::kInt64 &&
                ids.dim() == 1 && positions.dim() == 1 &&
                positions.size(0) == (rows_given ? embed.size(0) : ids.size(0)),
                "ids: int64 [T] (or empty), positions: int64 [T]");
    TORCH_CHECK(!cos_tables.empty() && cos_tables.size() == sin_tables.size(),
                "one cos and one sin table per rotary");
    ids = ids.contiguous();
    positions = positions.contiguous();
    const int64_t T = positions.size(0), V = embed.size(0), d = embed.size(1);
    const int64_t* ip = ids.data_ptr<int64_t>();
    const int64_t* pp = positions.data_ptr<int64_t>();
    for (int64_t t = 0; t < T; ++t) {
      TORCH_CHECK(rows_given || (0 <= ip[t] && ip[t] < V), "token id ", ip[t],
                  " is outside the vocabulary of ", V);
      TORCH_CHECK(pp[t] >= 0, "negative position");
      for (const auto& table : cos_tables)
        if (pp[t] >= table.size(0)) return torch::empty({0}, embed.options());
    }
    auto x = torch::empty({T, d}, embed.options());   // the residual stream (added to in place)
    for (int64_t t = 0; t < T; ++t) {
      const int64_t row = rows_given ? t : ip[t];
      std::memcpy(x.data_ptr<float>() + t * d, embed.data_ptr<float>() + row * d, d * 4);
    }
    if (embed_scale_ != 1.0) x.mul_(embed_scale_);
    std::vector<torch::Tensor> cos, sin;
    for (size_t r = 0; r < cos_tables.size(); ++r) {
      cos.push_back(rows_of(cos_tables[r], pp, T));
      sin.push_back(rows_of(sin_tables[r], pp, T));
    }
    const Adapters adapters{{lora.begin(), lora.end()}, lora_rows, lora_offsets};
    return run(x, cos, sin, slot_mappings, block_tables, context_lens, k_caches, v_caches,
               adapters);
  }

 private:
  // Rotary rows [T, 1, D] of `table` [P, D] (contiguous float32) at positions pp.
  static torch::Tensor rows_of(const torch::Tensor& table, const int64_t* pp, int64_t T) {
    TORCH_CHECK(table.scalar_type() == torch::kFloat32 && table.is_contiguous() &&
                table.dim() == 2, "rotary tables: contiguous float32 [P, D]");
    const int64_t D = table.size(1);
    auto out = torch::empty({T, 1, D}, table.options());
    for (int64_t t = 0; t < T; ++t)
      std::memcpy(out.data_ptr<float>() + t * D, table.data_ptr<float>() + pp[t] * D, D * 4);
    return out;
  }

  // RMSNorm over each head of q and k in qkv [T, (H + 2 KVH) D] (models/decoder.py's
  // SelfAttention._norm_qk: the same rms_norm calls and the same concatenation).
  torch::Tensor norm_qk(const NativeLayer& l, const torch::Tensor& qkv) const {
    const int64_t T = qkv.size(0), D = l.q_norm.size(0), qs = H_ * D, ks = KVH_ * D;
    auto q = rms_norm(qkv.slice(1, 0, qs).reshape({-1, D}), l.q_norm, eps_).view({T, qs});
    auto k = rms_norm(qkv.slice(1, qs, qs + ks).reshape({-1, D}), l.k_norm, eps_)
                 .view({T, ks});
    return at::cat({q, k, qkv.slice(1, qs + ks)}, 1);
  }

  // The LoRA adapters of the step's rows (none: no update), as lora_apply takes them.
  struct Adapters {
    std::vector<const NativeLoRA*> groups;
    torch::Tensor rows, offsets;
    void apply(const torch::Tensor& x, torch::Tensor& y, int64_t layer, int64_t linear) const {
      if (!groups.empty()) lora_apply(x, y, groups, layer, linear, rows, offsets);
    }
  };

  // The layers and the final norm over x [T, d] (mutated: the residual stream).
  torch::Tensor run(torch::Tensor x, const std::vector<torch::Tensor>& cos,
                    const std::vector<torch::Tensor>& sin,
                    const std::vector<torch::Tensor>& slot_mappings,
                    const std::vector<torch::Tensor>& block_tables,
                    const torch::Tensor& context_lens,
                    const std::vector<torch::Tensor>& k_caches,
                    const std::vector<torch::Tensor>& v_caches,
                    const Adapters& lora) const {
    const int64_t T = x.size(0);
    torch::Tensor delta;   // the last layer's FFN output, added with the next layer's norm
    for (size_t i = 0; i < layers_.size(); ++i) {
      const NativeLayer& l = layers_[i];
      torch::Tensor h = delta.defined() ? add_rms_norm(x, delta, l.in_norm, eps_)
                                        : rms_norm(x, l.in_norm, eps_);
      torch::Tensor qkv = l.qkv(h).contiguous();
      lora.apply(h, qkv, i, 0);
      if (l.q_norm.defined()) qkv = norm_qk(l, qkv);
      torch::Tensor q = rope_kv_write(qkv, cos[l.rope], sin[l.rope], k_caches[i], v_caches[i],
                                      slot_mappings[l.group], H_, KVH_);
      torch::Tensor att = paged_decode_attention(q, k_caches[i], v_caches[i],
                                                 block_tables[l.group], context_lens, scale_,
                                                 l.window);
      torch::Tensor att2 = att.reshape({T, -1}).contiguous();
      torch::Tensor o = l.o(att2).contiguous();
      lora.apply(att2, o, i, 1);
      if (l.sandwich) {
        h = add_rms_norm(x, rms_norm(o, l.post_attn_norm, eps_), l.pre_ffn_norm, eps_);
      } else {
        h = add_rms_norm(x, o, l.post_attn_norm, eps_);
      }
      torch::Tensor f;
      if (l.expert_down.empty()) {
        torch::Tensor gu = l.gate_up(h).contiguous();
        lora.apply(h, gu, i, 2);
        torch::Tensor act = gated_act(gu, l.gelu, l.fused_rows).contiguous();
        f = l.down(act).contiguous();
        lora.apply(act, f, i, 3);
      } else {
        f = moe(l, h);
      }
      delta = l.sandwich ? rms_norm(f, l.post_ffn_norm, eps_) : f;
    }
    return delta.defined() ? add_rms_norm(x, delta, final_norm_, eps_)
                           : rms_norm(x, final_norm_, eps_);
  }

  std::vector<NativeLayer> layers_;
  torch::Tensor final_norm_;
  int64_t H_, KVH_;
  double eps_, scale_, embed_scale_;
};

namespace {

NativeLinear with_bias(NativeLinear l, const c10::optional<torch::Tensor>& bias) {
  if (bias.has_value() && bias->numel() > 0) l.bias = *bias;
  return l;
}

}  // namespace

void bind_decode_stack(pybind11::module& m) {
  namespace py = pybind11;
  py::class_<NativeLinear>(m, "NativeLinear")
      .def_static("lowbit", [](torch::Tensor packed, int64_t n,
                               c10::optional<torch::Tensor> bias) {
        TORCH_CHECK(packed.scalar_type() == torch::kUInt8, "lowbit: packed uint8 weights");
        NativeLinear l;
        l.kind = NativeLinear::kLowbit;
        l.a = packed;
        l.n = n;
        return with_bias(l, bias);
      }, py::arg("packed"), py::arg("n"), py::arg("bias") = py::none())
      .def_static("q8", [](torch::Tensor q, torch::Tensor scale,
                           c10::optional<torch::Tensor> bias) {
        TORCH_CHECK(q.scalar_type() == torch::kInt8, "q8: int8 weights");
        NativeLinear l;
        l.kind = NativeLinear::kQ8;
        l.a = q;
        l.b = scale;
        return with_bias(l, bias);
      }, py::arg("q"), py::arg("scale"), py::arg("bias") = py::none())
      .def_static("stacked", [](torch::Tensor a, int64_t na, torch::Tensor c, int64_t nc,
                                c10::optional<torch::Tensor> bias) {
        TORCH_CHECK(a.scalar_type() == torch::kUInt8 && c.scalar_type() == torch::kUInt8,
                    "stacked: two packed parts");
        NativeLinear l;
        l.kind = NativeLinear::kStacked;
        l.a = a;
        l.c = c;
        l.ns = {na, nc};
        return with_bias(l, bias);
      }, py::arg("a"), py::arg("na"), py::arg("c"), py::arg("nc"), py::arg("bias") = py::none())
      .def_static("dense", [](torch::Tensor w, int64_t gemv_rows,
                              c10::optional<torch::Tensor> bias) {
        TORCH_CHECK(w.scalar_type() == torch::kFloat32, "dense weights: float32 only");
        NativeLinear l;
        l.a = w;
        l.gemv_rows = gemv_rows;
        return with_bias(l, bias);
      }, py::arg("w"), py::arg("gemv_rows"), py::arg("bias") = py::none());
  py::class_<NativeLayer>(m, "NativeLayer")
      .def(py::init<>())
      .def_readwrite("in_norm", &NativeLayer::in_norm)
      .def_readwrite("post_attn_norm", &NativeLayer::post_attn_norm)
      .def_readwrite("pre_ffn_norm", &NativeLayer::pre_ffn_norm)
      .def_readwrite("post_ffn_norm", &NativeLayer::post_ffn_norm)
      .def_readwrite("q_norm", &NativeLayer::q_norm)
      .def_readwrite("k_norm", &NativeLayer::k_norm)
      .def_readwrite("qkv", &NativeLayer::qkv)
      .def_readwrite("o", &NativeLayer::o)
      .def_readwrite("gate_up", &NativeLayer::gate_up)
      .def_readwrite("down", &NativeLayer::down)
      .def_readwrite("sandwich", &NativeLayer::sandwich)
      .def_readwrite("gelu", &NativeLayer::gelu)
      .def_readwrite("window", &NativeLayer::window)
      .def_readwrite("group", &NativeLayer::group)
      .def_readwrite("rope", &NativeLayer::rope)
      .def_readwrite("router", &NativeLayer::router)
      .def_readwrite("expert_gate_up", &NativeLayer::expert_gate_up)
      .def_readwrite("expert_down", &NativeLayer::expert_down)
      .def_readwrite("top_k", &NativeLayer::top_k)
      .def_readwrite("norm_topk", &NativeLayer::norm_topk)
      .def_readwrite("fused_rows", &NativeLayer::fused_rows);
  py::class_<DecodeStack>(m, "DecodeStack")
      .def(py::init<std::vector<NativeLayer>, torch::Tensor, int64_t, int64_t, double, double,
                    double>())
      .def("forward", &DecodeStack::forward, py::arg("ids"), py::arg("positions"),
           py::arg("embed"), py::arg("cos_tables"), py::arg("sin_tables"),
           py::arg("slot_mappings"), py::arg("block_tables"), py::arg("context_lens"),
           py::arg("k_caches"), py::arg("v_caches"),
           py::arg("lora"), py::arg("lora_rows"), py::arg("lora_offsets"),
           py::call_guard<py::gil_scoped_release>());   // see bindings.cpp
}
