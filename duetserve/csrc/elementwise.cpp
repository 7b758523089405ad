// Small fused row ops for decode steps, where torch's per-op dispatch costs more than the
// arithmetic: rms_norm (one pass, float32) and silu(gate) * up.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>

// x [T, d] float32, w [d] float32 -> x * rsqrt(mean(x^2) + eps) * w
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && w.scalar_type() == torch::kFloat32,
              "rms_norm: float32 only");
  x = x.contiguous();
  const int64_t d = x.size(-1), rows = x.numel() / d;
  auto y = torch::empty_like(x);
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, rows, 64, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      const float* xr = xp + r * d;
      float ss = 0.f;
#pragma omp simd reduction(+ : ss)
      for (int64_t i = 0; i < d; ++i) ss += xr[i] * xr[i];
      const float inv = 1.f / std::sqrt(ss / d + static_cast<float>(eps));
      float* yr = yp + r * d;
#pragma omp simd
      for (int64_t i = 0; i < d; ++i) yr[i] = xr[i] * inv * wp[i];
    }
  });
  return y;
}

// gate_up [T, 2I] (float32 or bfloat16: gate | up) -> silu(gate) * up [T, I] float32
torch::Tensor silu_mul(torch::Tensor gate_up) {
  auto g = gate_up.to(torch::kFloat32).contiguous();
  const int64_t two_i = g.size(-1), inter = two_i / 2, rows = g.numel() / two_i;
  auto y = torch::empty({rows, inter}, g.options());
  const float* gp = g.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, rows, 16, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      const float* a = gp + r * two_i;
      const float* u = a + inter;
      float* o = yp + r * inter;
#pragma omp simd
      for (int64_t i = 0; i < inter; ++i) o[i] = a[i] / (1.f + std::exp(-a[i])) * u[i];
    }
  });
  return y;
}
