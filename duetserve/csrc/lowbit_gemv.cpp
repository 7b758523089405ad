// Low-bit GEMV-style kernels for decode steps (few rows), float32 activations.
//
// int4: torch's CPU int4 packing (aten::_convert_weight_to_int4pack_for_cpu), read as is:
//   packed [N/64, K, 32] uint8 -- for row block b and column k, byte j holds row
//   b*64 + j in its low nibble and row b*64 + 32 + j in its high nibble;
//   scales_and_zeros [K/32, N, 2] bfloat16, w = (q - 8) * scale + zero.
//   Per group of 32 columns: acc = sum_k q * x_k, then
//   y += scale * acc + (zero - 8 * scale) * sum_k x_k   (sum_k x_k computed once per call).
//   Each column's 32 bytes give 64 output rows at once: broadcast x_k, FMA into 4 x 16 lanes.
// int8: row-major int8 [N, K] with one scale per row: y = scale * sum_k q * x_k.
//
// x: [M, K] float32 (M small, e.g. <= 8); returns [M, N] float32. Row blocks (int4) or
// rows (int8) are split across threads with at::parallel_for.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cstring>
#include <vector>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t G = 32;     // int4 group size along K
constexpr int64_t BN = 64;    // int4 row block

inline float bf16_lo(uint32_t v) { uint32_t u = v << 16; float f; std::memcpy(&f, &u, 4); return f; }
inline float bf16_hi(uint32_t v) { uint32_t u = v & 0xFFFF0000u; float f; std::memcpy(&f, &u, 4); return f; }

// One row block of 64 outputs for all M rows of x.
void int4_block(const uint8_t* packed, const uint32_t* sz, const float* x, const float* xsum,
                float* y, int64_t M, int64_t K, int64_t N, int64_t b) {
  const int64_t ngroups = K / G;
  const uint8_t* base = packed + b * K * 32;
  for (int64_t m0 = 0; m0 < M; m0 += 4) {
    const int64_t mm = std::min<int64_t>(4, M - m0);
#if defined(__AVX512F__)
    __m512 out[4][4];
    for (int i = 0; i < 4; ++i) for (int r = 0; r < 4; ++r) out[i][r] = _mm512_setzero_ps();
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    for (int64_t g = 0; g < ngroups; ++g) {
      __m512 acc[4][4];
      for (int i = 0; i < 4; ++i) for (int r = 0; r < 4; ++r) acc[i][r] = _mm512_setzero_ps();
      const uint8_t* col = base + g * G * 32;
      for (int64_t kk = 0; kk < G; ++kk) {
        const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(col + kk * 32));
        const __m256i lo = _mm256_and_si256(bytes, low4);
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low4);
        const __m512 w0 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_castsi256_si128(lo)));
        const __m512 w1 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_extracti128_si256(lo, 1)));
        const __m512 w2 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_castsi256_si128(hi)));
        const __m512 w3 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_extracti128_si256(hi, 1)));
        const int64_t k = g * G + kk;
        for (int64_t i = 0; i < mm; ++i) {
          const __m512 xb = _mm512_set1_ps(x[(m0 + i) * K + k]);
          acc[i][0] = _mm512_fmadd_ps(w0, xb, acc[i][0]);
          acc[i][1] = _mm512_fmadd_ps(w1, xb, acc[i][1]);
          acc[i][2] = _mm512_fmadd_ps(w2, xb, acc[i][2]);
          acc[i][3] = _mm512_fmadd_ps(w3, xb, acc[i][3]);
        }
      }
      // scales/zeros of rows b*64 .. b*64+63 in group g: 64 (scale, zero) bf16 pairs
      const uint32_t* p = sz + g * N + b * BN;
      for (int r = 0; r < 4; ++r) {
        const __m512i v = _mm512_loadu_si512(p + r * 16);
        const __m512 s = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
        const __m512 z = _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(0xFFFF0000u)));
        const __m512 zoff = _mm512_fnmadd_ps(s, _mm512_set1_ps(8.f), z);   // z - 8 s
        for (int64_t i = 0; i < mm; ++i) {
          const __m512 xs = _mm512_set1_ps(xsum[(m0 + i) * ngroups + g]);
          out[i][r] = _mm512_fmadd_ps(s, acc[i][r], out[i][r]);
          out[i][r] = _mm512_fmadd_ps(zoff, xs, out[i][r]);
        }
      }
    }
    for (int64_t i = 0; i < mm; ++i)
      for (int r = 0; r < 4; ++r) _mm512_storeu_ps(y + (m0 + i) * N + b * BN + r * 16, out[i][r]);
#else
    float out[4][BN] = {};
    for (int64_t g = 0; g < ngroups; ++g) {
      float acc[4][BN] = {};
      for (int64_t kk = 0; kk < G; ++kk) {
        const uint8_t* bytes = base + (g * G + kk) * 32;
        for (int64_t i = 0; i < mm; ++i) {
          const float xv = x[(m0 + i) * K + g * G + kk];
          for (int j = 0; j < 32; ++j) {
            acc[i][j] += float(bytes[j] & 15) * xv;
            acc[i][32 + j] += float(bytes[j] >> 4) * xv;
          }
        }
      }
      const uint32_t* p = sz + g * N + b * BN;
      for (int j = 0; j < BN; ++j) {
        const float s = bf16_lo(p[j]), z = bf16_hi(p[j]);
        for (int64_t i = 0; i < mm; ++i)
          out[i][j] += s * acc[i][j] + (z - 8.f * s) * xsum[(m0 + i) * ngroups + g];
      }
    }
    for (int64_t i = 0; i < mm; ++i)
      std::memcpy(y + (m0 + i) * N + b * BN, out[i], BN * sizeof(float));
#endif
  }
}

}  // namespace

torch::Tensor int4_gemv(torch::Tensor x, torch::Tensor packed, torch::Tensor sz) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, "x must be float32 [M, K]");
  TORCH_CHECK(packed.scalar_type() == torch::kUInt8 && packed.is_contiguous(), "packed: uint8");
  TORCH_CHECK(sz.scalar_type() == torch::kBFloat16 && sz.is_contiguous(), "sz: bfloat16");
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = packed.size(0);
  TORCH_CHECK(packed.size(1) * 2 == K && N % BN == 0 && K % G == 0, "shape mismatch");
  TORCH_CHECK(sz.size(0) == K / G && sz.size(1) == N && sz.size(2) == 2, "sz shape mismatch");
  auto y = torch::empty({M, N}, x.options());
  const int64_t ngroups = K / G;
  std::vector<float> xsum(M * ngroups);
  const float* xp = x.data_ptr<float>();
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < ngroups; ++g) {
      float s = 0.f;
      for (int64_t k = 0; k < G; ++k) s += xp[m * K + g * G + k];
      xsum[m * ngroups + g] = s;
    }
  const uint8_t* pk = packed.data_ptr<uint8_t>();
  const uint32_t* szp = reinterpret_cast<const uint32_t*>(sz.data_ptr<at::BFloat16>());
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, N / BN, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) int4_block(pk, szp, xp, xsum.data(), yp, M, K, N, b);
  });
  return y;
}

torch::Tensor int8_gemv(torch::Tensor x, torch::Tensor w, torch::Tensor scale) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, "x must be float32 [M, K]");
  TORCH_CHECK(w.scalar_type() == torch::kInt8 && w.is_contiguous(), "w: int8 [N, K]");
  TORCH_CHECK(scale.scalar_type() == torch::kFloat32 && scale.is_contiguous(), "scale: float32");
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(w.size(1) == K && K % 16 == 0, "shape mismatch (K must be a multiple of 16)");
  auto y = torch::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const int8_t* wp = w.data_ptr<int8_t>();
  const float* sp = scale.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const int8_t* row = wp + n * K;
      for (int64_t m0 = 0; m0 < M; m0 += 4) {
        const int64_t mm = std::min<int64_t>(4, M - m0);
#if defined(__AVX512F__)
        __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(),
                         _mm512_setzero_ps()};
        for (int64_t k = 0; k < K; k += 16) {
          const __m512 wv = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
              _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + k))));
          for (int64_t i = 0; i < mm; ++i)
            acc[i] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(xp + (m0 + i) * K + k), acc[i]);
        }
        for (int64_t i = 0; i < mm; ++i) yp[(m0 + i) * N + n] = sp[n] * _mm512_reduce_add_ps(acc[i]);
#else
        for (int64_t i = 0; i < mm; ++i) {
          float s = 0.f;
          for (int64_t k = 0; k < K; ++k) s += float(row[k]) * xp[(m0 + i) * K + k];
          yp[(m0 + i) * N + n] = sp[n] * s;
        }
#endif
      }
    }
  });
  return y;
}

// Rows [a, b) (multiples of 64) of a torch-int4-packed weight as dense bfloat16 [b - a, K]:
// the many-row path without a resident dense copy dequantizes a slice, then runs a bf16 GEMM.
torch::Tensor int4_dequant_bf16(torch::Tensor packed, torch::Tensor sz, int64_t a, int64_t b) {
  TORCH_CHECK(packed.scalar_type() == torch::kUInt8 && packed.is_contiguous(), "packed: uint8");
  TORCH_CHECK(sz.scalar_type() == torch::kBFloat16 && sz.is_contiguous(), "sz: bfloat16");
  const int64_t N = packed.size(0), K = packed.size(1) * 2;
  TORCH_CHECK(a % BN == 0 && b % BN == 0 && 0 <= a && a < b && b <= N, "rows must be 64-aligned");
  auto out = torch::empty({b - a, K}, packed.options().dtype(torch::kBFloat16));
  const uint8_t* pk = packed.data_ptr<uint8_t>();
  const uint32_t* szp = reinterpret_cast<const uint32_t*>(sz.data_ptr<at::BFloat16>());
  at::BFloat16* op = out.data_ptr<at::BFloat16>();
  at::parallel_for(a / BN, b / BN, 1, [&](int64_t begin, int64_t end) {
    for (int64_t blk = begin; blk < end; ++blk) {
      const uint8_t* base = pk + blk * K * 32;
      for (int64_t r = 0; r < BN; ++r) {
        const int64_t row = blk * BN + r;
        const int shift = r < 32 ? 0 : 4;
        const int64_t lane = r % 32;
        at::BFloat16* orow = op + (row - a) * K;
        for (int64_t g = 0; g < K / G; ++g) {
          const uint32_t v = szp[g * N + row];
          const float s = bf16_lo(v), z = bf16_hi(v) - 8.f * s;
          for (int64_t kk = 0; kk < G; ++kk) {
            const int64_t k = g * G + kk;
            const float q = float((base[k * 32 + lane] >> shift) & 15);
            orow[k] = at::BFloat16(q * s + z);
          }
        }
      }
    }
  });
  return out;
}
