// Python bindings of duetserve's native kernels (see duetserve/models/native.py).
#include "ops.h"

void bind_decode_stack(pybind11::module& m);

// Every kernel runs without the GIL (arguments are converted before it is released and the
// result after it is taken back; no kernel touches a Python object): a decode step is one
// 10-20 ms call, during which the server's event loop must go on streaming and answering.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  bind_decode_stack(m);
  const auto nogil = pybind11::call_guard<pybind11::gil_scoped_release>();
  namespace py = pybind11;
  m.def("paged_decode_attention", &paged_decode_attention, nogil,
        "decode attention over a paged KV cache, read in place (window > 0: the last "
        "window positions of each context only)",
        py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("block_tables"),
        py::arg("context_lens"), py::arg("scale"), py::arg("window") = 0);
  m.def("prefill_attention", &prefill_attention, nogil,
        "causal attention of a prompt chunk over itself, [n, H, D] float32 (empty: not "
        "covered; window > 0: sliding window)",
        py::arg("q"), py::arg("k"), py::arg("v"), py::arg("scale"), py::arg("window") = 0);
  m.def("prefill_attention_bf16", &prefill_attention_bf16, nogil,
        "causal attention of a chunk's rows (the last n of the context's L positions) over "
        "k / v [L, KVH, D], bfloat16 dot products, [n, H, D] float32 (empty: not covered)",
        py::arg("q"), py::arg("k"), py::arg("v"), py::arg("scale"));
  m.def("bf16_attention_available", &bf16_attention_available,
        "built with AVX512-BF16 (prefill_attention_bf16 runs)");
  m.def("q4_gemv", &q4_gemv, nogil, "x[M,K] f32 (int8 per 32) @ packed q4 W^T -> [M,N] f32 (few rows)");
  m.def("q4k_gemv", &q4k_gemv, nogil, "x[M,K] f32 (int8 per 32) @ packed q4k (Q4_K) W^T -> [M,N] f32 (few rows)");
  m.def("q4k_dequant_bf16", &q4k_dequant_bf16, nogil, "rows [a, b) of a packed q4k weight (K columns) as bf16");
  m.def("q4k_dequant_f32", &q4k_dequant_f32, nogil, "rows [a, b) of a packed q4k weight (K columns) as float32");
  m.def("stacked_gemv", &stacked_gemv, nogil, "x[M,K] f32 @ [packed q4 / q4k / q6 / q8g parts stacked along N]^T -> [M, sum N] f32 (few rows)");
  m.def("q6_gemv", &q6_gemv, nogil, "x[M,K] f32 (int8 per 32) @ packed q6 (Q6_K) W^T -> [M,N] f32 (few rows)");
  m.def("q6_dequant_bf16", &q6_dequant_bf16, nogil, "rows [a, b) of a packed q6 weight (K columns) as bf16");
  m.def("q6_dequant_f32", &q6_dequant_f32, nogil, "rows [a, b) of a packed q6 weight (K columns) as float32");
  m.def("q8g_gemv", &q8g_gemv, nogil, "x[M,K] f32 (int8 per 32) @ packed q8g (Q8_0 / Q5_x) W^T -> [M,N] f32 (few rows)");
  m.def("q8g_dequant_bf16", &q8g_dequant_bf16, nogil, "rows [a, b) of a packed q8g weight (K columns) as bf16");
  m.def("q8g_dequant_f32", &q8g_dequant_f32, nogil, "rows [a, b) of a packed q8g weight (K columns) as float32");
  m.def("q8_gemv", &q8_gemv, nogil, "x[M,K] f32 (int8 per 32) @ packed int8 W^T * row scale -> [M,N] f32");
  m.def("q4_dequant_bf16", &q4_dequant_bf16, nogil, "rows [a, b) of a packed q4 weight (K columns) as bf16");
  m.def("q4_dequant_f32", &q4_dequant_f32, nogil, "rows [a, b) of a packed q4 weight (K columns) as float32");
  m.def("amx_available", &amx_available,
        "built with AMX (bf16 tiles) and the kernel granted the tile state");
  m.def("amx_gemm", &amx_gemm, nogil,
        "x[M,K] @ [packed q4 / q4k / q6 / q8g parts stacked along N]^T on AMX bf16 tiles -> [M, sum N] f32 (many rows)");
  m.def("f32_gemv", &f32_gemv, nogil, "x[M,K] f32 @ W[N,K] f32 ^T -> [M,N] f32 (few rows)");
  m.def("rms_norm", &rms_norm, nogil, "x * rsqrt(mean(x^2) + eps) * w, float32, one pass");
  m.def("add_rms_norm", &add_rms_norm, nogil, "x += delta (in place), then rms_norm(x, w)");
  m.def("silu_mul", &silu_mul, nogil, "silu(gate) * up of [T, 2I] -> [T, I] float32");
  m.def("gelu_tanh_mul", &gelu_tanh_mul, nogil,
        "gelu_tanh(gate) * up of [T, 2I] -> [T, I] float32");
  m.def("argmax_rows", &argmax_rows, nogil, "first index of each row's maximum, [M, V] float32 -> [M] int64");
  pybind11::class_<NativeLoRA>(m, "NativeLoRA")
      .def(pybind11::init<int64_t>(), pybind11::arg("num_layers"))
      .def("set", &NativeLoRA::set, pybind11::arg("layer"), pybind11::arg("linear"),
           pybind11::arg("a"), pybind11::arg("bt"), pybind11::arg("spans"),
           pybind11::arg("a_scale") = pybind11::none(),
           pybind11::arg("bt_scale") = pybind11::none(),
           "one fused linear's weights (0 qkv, 1 o, 2 gate_up, 3 down): A [P r, in], Bt in "
           "tiles [C / 16, r, 16], spans [P, 2]; int8 A and Bt with float32 row / column "
           "scales");
  m.def("lora_apply",
        [](torch::Tensor x, torch::Tensor y, std::vector<NativeLoRA*> adapters, int64_t layer,
           int64_t linear, torch::Tensor rows, torch::Tensor offsets) {
          lora_apply(x, y, {adapters.begin(), adapters.end()}, layer, linear, rows, offsets);
        }, nogil,
        "y[rows of group g] += B_g (A_g x[rows]) for each NativeLoRA g adapting the layer's "
        "linear (rows[offsets[g] .. offsets[g + 1]): its rows); mutates y");
  m.def("rope_kv_write", &rope_kv_write, nogil,
        "rotary on q/k of a qkv row block, k/v written into the paged cache; returns q");
}
