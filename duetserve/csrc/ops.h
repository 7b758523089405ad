// The native kernels' entry points (defined in the .cpp files beside this one), for the
// bindings and for code that calls kernels from C++ (decode_stack.cpp).
#pragma once
#include <torch/extension.h>
#include <array>
#include <vector>

torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache,
                                     torch::Tensor v_cache, torch::Tensor block_tables,
                                     torch::Tensor context_lens, double scale,
                                     int64_t window);
torch::Tensor prefill_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v,
                                double scale, int64_t window);
torch::Tensor prefill_attention_bf16(torch::Tensor q, torch::Tensor k, torch::Tensor v,
                                     double scale);
bool bf16_attention_available();
torch::Tensor q4_gemv(torch::Tensor x, torch::Tensor packed, int64_t N);
torch::Tensor q4k_gemv(torch::Tensor x, torch::Tensor packed, int64_t N);
torch::Tensor q4k_dequant_bf16(torch::Tensor packed, int64_t K, int64_t a, int64_t b);
torch::Tensor q4k_dequant_f32(torch::Tensor packed, int64_t K, int64_t a, int64_t b);
torch::Tensor q6_gemv(torch::Tensor x, torch::Tensor packed, int64_t N);
torch::Tensor q8g_gemv(torch::Tensor x, torch::Tensor packed, int64_t N);
torch::Tensor q8g_dequant_bf16(torch::Tensor packed, int64_t K, int64_t a, int64_t b);
torch::Tensor q8g_dequant_f32(torch::Tensor packed, int64_t K, int64_t a, int64_t b);
// Any packed form (q4, q4k, q6 or q8g), told apart by its block size.
torch::Tensor lowbit_gemv(torch::Tensor x, torch::Tensor packed, int64_t N);
torch::Tensor q6_dequant_bf16(torch::Tensor packed, int64_t K, int64_t a, int64_t b);
torch::Tensor q6_dequant_f32(torch::Tensor packed, int64_t K, int64_t a, int64_t b);
torch::Tensor stacked_gemv(torch::Tensor x, std::vector<torch::Tensor> packed,
                           std::vector<int64_t> n);
torch::Tensor q8_gemv(torch::Tensor x, torch::Tensor packed, torch::Tensor scale);
torch::Tensor q4_dequant_bf16(torch::Tensor packed, int64_t K, int64_t a, int64_t b);
torch::Tensor q4_dequant_f32(torch::Tensor packed, int64_t K, int64_t a, int64_t b);
bool amx_available();
torch::Tensor amx_gemm(torch::Tensor x, std::vector<torch::Tensor> packed, std::vector<int64_t> n);
torch::Tensor f32_gemv(torch::Tensor x, torch::Tensor w);
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps);
torch::Tensor add_rms_norm(torch::Tensor x, torch::Tensor delta, torch::Tensor w, double eps);
torch::Tensor silu_mul(torch::Tensor gate_up);
torch::Tensor gelu_tanh_mul(torch::Tensor gate_up);
torch::Tensor argmax_rows(torch::Tensor x);
torch::Tensor rope_kv_write(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin,
                            torch::Tensor k_cache, torch::Tensor v_cache,
                            torch::Tensor slot_mapping, int64_t H, int64_t KVH);
// One LoRA adapter's weights in the form csrc/lora.cpp reads, per layer and fused linear
// (0 qkv, 1 o, 2 gate_up, 3 down; a = undefined where the adapter leaves it alone); set
// once when the adapter loads (models/lora.py), read by lora_apply.
struct LoRALinear {
  torch::Tensor a, bt, spans, a_scale, bt_scale;   // scales: int8 weights only
  int64_t fan_in = 0, out_end = 0;                 // x's width, the last output row + 1
};
struct NativeLoRA {
  explicit NativeLoRA(int64_t num_layers) : layers(num_layers) {}
  void set(int64_t layer, int64_t linear, torch::Tensor a, torch::Tensor bt,
           torch::Tensor spans, c10::optional<torch::Tensor> a_scale,
           c10::optional<torch::Tensor> bt_scale);
  std::vector<std::array<LoRALinear, 4>> layers;
};
// y[rows of group g] += B_g (A_g x[rows]) for each adapter g that adapts `linear` of
// `layer`; rows[offsets[g] .. offsets[g + 1]) are group g's rows. Mutates y.
void lora_apply(const torch::Tensor& x, torch::Tensor& y,
                const std::vector<const NativeLoRA*>& adapters, int64_t layer, int64_t linear,
                const torch::Tensor& rows, const torch::Tensor& offsets);
