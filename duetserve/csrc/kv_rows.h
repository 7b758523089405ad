// Row formats of the paged KV cache: one (token, KV head) row of D values, as float32,
// bfloat16, or quantized with float16 scales after the values (models/kv_quant.py has the
// same formats in torch, and the writers there and here store the same bytes):
//   RowsQ8: D int8 | one scale              x = q * s
//   RowsQ4: per group of 32 values 16 bytes (byte j = n[j] | n[j+16] << 4, n = q + 8),
//           then D/32 scales                x = (n - 8) * s_group
// int8 keys are stored rotated: fwht below (unnormalised Walsh-Hadamard over blocks of the
// largest power of two dividing D); the queries meeting them get the same transform over
// the block size (rotate_query), so q.k is unchanged (models/kv_quant.py says why), and
// are rounded to an int8 grid (int8_query) for the decode kernel's integer products.
// width(D): a row's length in elements of E; scale(row): a factor of the whole row
// (RowsQ8's scale, 1 elsewhere: RowsQ4 applies its group scales in value()/load16()).
#pragma once
#include <torch/extension.h>
#include <algorithm>
#include <cmath>
#include <cstring>

constexpr float kMinKVScale = 1.0f / 16384.0f;   // models/kv_quant.py's MIN_SCALE

static inline float half_at(const void* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

static inline void put_half(void* p, c10::Half h) { std::memcpy(p, &h.x, 2); }

// x[0..D) in place: butterflies (a + b, a - b) over pairs h = 1, 2, 4, ... < B apart,
// B = D & -D (the same sums in the same order as kv_quant.rotate_keys: the same bits).
static inline void fwht(float* x, int64_t D) {
  const int64_t B = D & -D;
  for (int64_t h = 1; h < B; h <<= 1)
    for (int64_t i = 0; i < D; i += 2 * h)
      for (int64_t j = i; j < i + h; ++j) {
        const float a = x[j], b = x[j + h];
        x[j] = a + b;
        x[j + h] = a - b;
      }
}

static inline void rotate_query(float* q, int64_t D) {
  fwht(q, D);
  const float inv = 1.f / static_cast<float>(D & -D);     // a power of two: exact
  for (int64_t i = 0; i < D; ++i) q[i] *= inv;
}

// A query's int8 step: max |q| / 127 (1 for a zero query).
static inline float query_step(const float* q, int64_t D) {
  float am = 0.f;
  for (int64_t i = 0; i < D; ++i) am = std::max(am, std::fabs(q[i]));
  return am > 0.f ? am / 127.f : 1.f;
}

// q on its int8 grid: n * step, n = round(q / step) in [-127, 127] (kv_quant.query_grid).
static inline void to_query_grid(float* q, int64_t D) {
  const float s = query_step(q, D);
  for (int64_t i = 0; i < D; ++i)
    q[i] = std::min(127.f, std::max(-127.f, std::nearbyint(q[i] / s))) * s;
}

// Queries that meet int8 keys: rotated, then on their int8 grid (kv_quant.int8_queries):
// the decode kernel multiplies the grid's integers with the keys, every other path reads
// the same rounded values.
static inline void int8_query(float* q, int64_t D) {
  rotate_query(q, D);
  to_query_grid(q, D);
}

struct RowsF32 {
  using E = float;
  static constexpr bool kRotatedKeys = false;
  static int64_t width(int64_t D) { return D; }
  static float scale(const E*, int64_t) { return 1.f; }
  static float value(const E* r, int64_t d, int64_t) { return r[d]; }
  static void write(const float* x, E* o, int64_t D) { std::copy(x, x + D, o); }
};

struct RowsBF16 {
  using E = at::BFloat16;
  static constexpr bool kRotatedKeys = false;
  static int64_t width(int64_t D) { return D; }
  static float scale(const E*, int64_t) { return 1.f; }
  static float value(const E* r, int64_t d, int64_t) { return static_cast<float>(r[d]); }
  static void write(const float* x, E* o, int64_t D) {
    for (int64_t i = 0; i < D; ++i) o[i] = E(x[i]);
  }
};

struct RowsQ8 {
  using E = int8_t;
  static constexpr bool kRotatedKeys = true;
  static int64_t width(int64_t D) { return D + 2; }
  static float scale(const E* r, int64_t D) { return half_at(r + D); }
  static float value(const E* r, int64_t d, int64_t) { return static_cast<float>(r[d]); }
  static void write(const float* x, E* o, int64_t D) {
    float am = 0.f;
    for (int64_t i = 0; i < D; ++i) am = std::max(am, std::fabs(x[i]));
    const c10::Half h(std::max(am / 127.f, kMinKVScale));
    const float s = static_cast<float>(h);
    for (int64_t i = 0; i < D; ++i)
      o[i] = static_cast<E>(std::min(127.f, std::max(-127.f, std::nearbyint(x[i] / s))));
    put_half(o + D, h);
  }
};

struct RowsQ4 {
  using E = uint8_t;
  static constexpr bool kRotatedKeys = false;
  static int64_t width(int64_t D) { return D / 2 + 2 * (D / 32); }
  static float scale(const E*, int64_t) { return 1.f; }
  static float value(const E* r, int64_t d, int64_t D) {
    const int64_t g = d / 32, j = d % 32;
    const int b = r[g * 16 + (j & 15)];
    return static_cast<float>((j < 16 ? b & 15 : b >> 4) - 8) * half_at(r + D / 2 + 2 * g);
  }
  static void write(const float* x, E* o, int64_t D) {
    for (int64_t g = 0; g < D / 32; ++g) {
      const float* xg = x + g * 32;
      int64_t at = 0;
      for (int64_t i = 1; i < 32; ++i)
        if (std::fabs(xg[i]) > std::fabs(xg[at])) at = i;
      float s = xg[at] / -8.f;
      if (std::fabs(s) < kMinKVScale) s = kMinKVScale;
      const c10::Half h(s);
      const float sf = static_cast<float>(h);
      int n[32];
      for (int64_t i = 0; i < 32; ++i)
        n[i] = static_cast<int>(std::min(7.f, std::max(-8.f, std::nearbyint(xg[i] / sf)))) + 8;
      for (int64_t j = 0; j < 16; ++j) o[g * 16 + j] = static_cast<E>(n[j] | (n[j + 16] << 4));
      put_half(o + D / 2 + 2 * g, h);
    }
  }
};
