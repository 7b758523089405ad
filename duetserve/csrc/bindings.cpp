// Python bindings of duetserve's native kernels (see duetserve/models/native.py).
#include <torch/extension.h>

torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache,
                                     torch::Tensor v_cache, torch::Tensor block_tables,
                                     torch::Tensor context_lens, double scale);
torch::Tensor int4_gemv(torch::Tensor x, torch::Tensor packed, torch::Tensor sz);
torch::Tensor int8_gemv(torch::Tensor x, torch::Tensor w, torch::Tensor scale);
torch::Tensor int4_dequant_bf16(torch::Tensor packed, torch::Tensor sz, int64_t a, int64_t b);
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps);
torch::Tensor silu_mul(torch::Tensor gate_up);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention,
        "decode attention over a paged KV cache, read in place");
  m.def("int4_gemv", &int4_gemv, "x[M,K] f32 @ torch-int4-packed W^T -> [M,N] f32 (few rows)");
  m.def("int8_gemv", &int8_gemv, "x[M,K] f32 @ int8 W^T * row scale -> [M,N] f32 (few rows)");
  m.def("int4_dequant_bf16", &int4_dequant_bf16, "rows [a, b) of a packed int4 weight, bf16");
  m.def("rms_norm", &rms_norm, "x * rsqrt(mean(x^2) + eps) * w, float32, one pass");
  m.def("silu_mul", &silu_mul, "silu(gate) * up of [T, 2I] -> [T, I] float32");
}
