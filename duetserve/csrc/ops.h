// The native kernels' entry points (defined in the .cpp files beside this one), for the
// bindings and for code that calls kernels from C++ (decode_stack.cpp).
#pragma once
#include <torch/extension.h>

torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache,
                                     torch::Tensor v_cache, torch::Tensor block_tables,
                                     torch::Tensor context_lens, double scale,
                                     int64_t window);
torch::Tensor prefill_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v,
                                double scale, int64_t window);
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
void lora_apply(torch::Tensor x, torch::Tensor y, std::vector<torch::Tensor> as,
                std::vector<torch::Tensor> bts, std::vector<torch::Tensor> spans,
                torch::Tensor rows, torch::Tensor offsets);
