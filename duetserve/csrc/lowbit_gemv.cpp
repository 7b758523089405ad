// Low-bit weight x int8 activation products for decode steps (few rows), and the
// dequantization the many-row path needs.
//
// Activations are quantized per call, per row and group of 32 (like GGUF's Q8_0):
//   dx = max|x_g| / 127, xq = round(x / dx) in -127..127, so x ~= dx * xq.
// Products then run in integers with AVX512-VNNI's vpdpbusd (u8 x s8 -> s32, 64 per
// instruction), and each group's int32 sum is scaled once. This is what makes decode
// bandwidth-bound rather than instruction-bound: widening nibbles to float32 and using
// FMAs costs ~4x more instructions per weight byte.
//
// q4 weights ("Q4_1 layout", groups of 32 along K, w = d * q + m), packed for streaming:
//   units of 320 bytes (packed [tiles, ceil(N/16), tu, 320] uint8: see Tiles), one per block
//   of 16 weight rows and group: 4 vectors of 64 bytes, then d [16 rows] and m [16] as
//   float16 (32 bytes each). Vector v, dword r, byte j: element 8v + j of row r in the low
//   nibble, 8v + 4 + j in the high one. So each int32 lane of a vpdpbusd is one weight row
//   and its activation operand is 4 elements broadcast from memory (GROUPED order), which
//   costs a load and no shuffle: with 4 rows a block (lanes 4r + g, the same 16 activation
//   bytes broadcast to each 128-bit lane) the 128-bit broadcasts cost a vector op each and
//   steps of 2-8 activation rows ran ~1.45x slower on Zen 4 (docs/performance.md). Rows
//   past N are zero. One block is one sequential stream.
//   Per group: sum_k w_k x_k = d * dx * sum_k q_k xq_k + m * (dx * sum_k xq_k).
// q4k weights (GGUF Q4_K, kept exactly): w = d * sc * q - dmin * mn, q in 0..15, the
//   file's 6-bit sc and mn per group of 32 and float16 d, dmin per 256: units of 2304
//   bytes (packed [tiles, ceil(N/16), tu, 2304] uint8: the file's 16 x 144 bytes,
//   reordered). Per block of 16 rows and 256 weights of each: the 8 groups' nibbles as
//   q4's units (256 bytes each), then the codes: 4 x 16 little-endian 24-bit words (192
//   bytes), word 16 g + r (row r, g in 0..3) = sc0 | sc1 << 6 | mn0 << 12 | mn1 << 18
//   (sc_h, mn_h: the codes of group 4h + g), then d [16 rows] and dmin [16] as float16.
//   Each group is q4's unit with d * sc and -dmin * mn (exact in float32) as its d and m.
// q6 weights (GGUF Q6_K, kept exactly): w = d * sc * (q - 32), q in 0..63, an int8 scale
//   sc per 16 weights along K and a float16 d per row and 256 (stored once per 128 here):
//   units of 1696 bytes (packed [tiles, ceil(N/16), tu, 1696] uint8), per block of 16 rows
//   and 128 columns: per group of 32 (416 bytes) the rows' low 4 bits in q4's order (256
//   bytes), their top two bits (128 bytes: vector u, dword r, byte j, bits 2k..2k+1: element
//   16u + 4k + j of row r), sc as int8 [half][row] (32 bytes; half 0 = elements 0-15), then
//   d [16 rows] as float16 (32 bytes). So the dots see each weight as one byte, lane r one
//   row, as q4's do, with bytes 4t..4t+3 of a lane = elements 4t..4t+3.
//   Per half-group: sum_k w_k x_k = d sc dx (sum_k q_k xq_k - 32 sum_k xq_k).
// q8g weights (GGUF Q8_0, Q5_0 and Q5_1 kept exactly): groups of 32 along K, w = d * u + m
//   with u in 0..255 (Q8_0: u = q + 128, m = -128 d; Q5_0: u = q, m = -16 d; Q5_1: the
//   file's d and m), units of 576 bytes (packed [tiles, ceil(N/16), tu, 576] uint8), one
//   per block of 16 rows and group: 8 vectors of 64 bytes (vector v, dword r, byte j:
//   element 4v + j of row r), then d [16 rows] and m [16] as float16. q4's sums with a
//   byte a weight: sum_k w_k x_k = d * dx * sum_k u_k xq_k + m * (dx * sum_k xq_k).
// q8 weights, one float32 scale per row: w = s_n * q, packed like q4 for streaming:
//   packed [ceil(N/4), ceil(K/64), 256] int8: per block of 4 rows, 64 columns of each row
//   in turn; rows and columns past N and K are zero.
//   u8 x s8 needs an unsigned side: |q| times x with q's sign moved onto x.
//
// x: [M, K] float32 (M small); returns [M, N] float32. Row blocks of W are split across the
// threads (block_items). Without AVX512-VNNI a plain loop computes the same sums.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <atomic>
#include <cmath>
#include <cstring>
#include <memory>
#include <type_traits>
#include <vector>
#if defined(__AVX512F__)
#include <immintrin.h>
#include "simd_sum.h"
#endif
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define DUET_VNNI 1
#endif
#include <sys/mman.h>
#include <cstdlib>
#include <mutex>
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define DUET_AMX 1     // bf16 tile products for many-row steps (amx_gemm)
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {

constexpr int64_t G = 32;       // group size along K
constexpr int64_t CH = 4;       // groups per chunk of 128 columns (quantizer, q6)
constexpr int64_t ROWS = 16;                    // q4, q4k, q6: weight rows per block
constexpr int64_t Q4_BLOCK = ROWS * 16 + 2 * 32;      // q4: bytes per block of 16 rows x 1 group
constexpr int64_t Q8G_BLOCK = 8 * 64 + 2 * 32;  // q8g: bytes per block of 16 rows x 1 group
constexpr int64_t Q8_BLOCK = 4 * 64;            // q8: bytes per block of 4 rows x 64 columns
constexpr int64_t Q4K_CODES = 8 * 256, Q4K_D = Q4K_CODES + 4 * 48;
constexpr int64_t Q4K_BLOCK = Q4K_D + 64;       // q4k: bytes per block of 16 rows x 256 columns
constexpr int64_t Q6_TOP = 256, Q6_SC = Q6_TOP + 128, Q6_GROUP = Q6_SC + 32, Q6_D = 4 * Q6_GROUP;
constexpr int64_t Q6_BLOCK = Q6_D + 32;         // q6: bytes per block of 16 rows x 128 columns
// q4/q8 blocks prefetch two units ahead in their one stream, q4k (4.6 KB) and q6 (3.4 KB)
// two. Against four units, the 1.5B's GEMVs in model order, two builds
// interleaved: the same while this VM's memory reads ~32 GB/s, ~2% faster at ~45+.

// A weight packed in blocks of 16 rows (q4, q4k, q6) with K in tiles (models/quant.py:
// _BlockWeight): packed [tiles, row blocks, tu, block]; tile t holds units [t tu,
// (t + 1) tu) of every row block, block after block, so a thread's rows of one tile are one sequential stream
// and the activations one tile reads (<= 2048 columns) stay in L1 between row blocks.
// Units past `units` (the last tile's padding) are never read.
struct Tiles {
  const uint8_t* p;
  int64_t tile_stride, tu, units, block;
  int64_t ntiles() const { return (units + tu - 1) / tu; }
  // units [t tu, end(t)) of row block nb, in order from here
  const uint8_t* span(int64_t nb, int64_t t) const { return p + t * tile_stride + nb * tu * block; }
  int64_t end(int64_t t) const { return std::min(units, (t + 1) * tu); }
  const uint8_t* at(int64_t nb, int64_t u) const { return span(nb, u / tu) + (u % tu) * block; }
};

inline float half_to_float(uint16_t h) {
  return c10::detail::fp16_ieee_to_fp32_value(h);
}

// Per-call activation quantization.
//   xq: in the order below; padded groups are zero.
//   dx[g] = scale of group g (0 for padding); xs[g] = dx[g] * sum(xq of g).
// Activation orders: PLAIN (element order; q8), GROUPED (q4, q4k, q6, q8g: the rows in
// blocks of XROWS, each block PLAIN's groups with the block's rows inside: group g of row m
// at QuantizedX::first(m) + g * stride(m), and dx, xs, l and h the same, so a pass finds
// its rows' values at fixed offsets from one pointer). Blocks, not all M rows inside each
// group: with 512 rows a pass's groups sat 16 KiB apart, all in the same few L1 sets.
enum Order { PLAIN = 0, GROUPED = 1 };

// Group g of x (32 floats): its int8 values in element order, and returns their sum; *d
// = the group's scale (the plain loop; quantize_chunk computes the same values four groups
// at a time with AVX-512: cvtps rounds to nearest even, as nearbyint does by default).
inline int32_t quantize_group(const float* xg, int8_t* q, float* d) {
  float amax = 0.f;
  for (int64_t k = 0; k < G; ++k) amax = std::max(amax, std::fabs(xg[k]));
  *d = amax / 127.f;
  const float inv = *d > 0.f ? 1.f / *d : 0.f;
  int32_t sum = 0;
  for (int64_t k = 0; k < G; ++k) {
    const int v = static_cast<int>(std::nearbyint(xg[k] * inv));
    q[k] = static_cast<int8_t>(v);
    sum += v;
  }
  return sum;
}

// A buffer left uninitialised: quantize_x writes every element the kernels read.
template <typename T>
struct Buf {
  std::unique_ptr<T[]> p;
  void resize(int64_t n) { p.reset(new T[n]); }
  T* data() { return p.get(); }
  const T* data() const { return p.get(); }
  T& operator[](int64_t i) { return p[i]; }
  const T& operator[](int64_t i) const { return p[i]; }
};

constexpr int64_t XROWS = 8;   // GROUPED: rows of a row block (the widest pass)

struct QuantizedX {
  Buf<int8_t> q;
  Buf<float> d, s;
  Buf<float> l, h;  // q6: 32 * dx * sum of xq over elements 0-15 / 16-31 per group
  int64_t gp;  // padded groups per row
  int64_t m;   // rows
  // GROUPED: group g of row m at first(m) + g * stride(m) (in groups; scalars the same)
  int64_t stride(int64_t r) const { return std::min(XROWS, m - r / XROWS * XROWS); }
  int64_t first(int64_t r) const { return r / XROWS * XROWS * gp + r % XROWS; }
};

#if defined(__AVX512F__) && defined(__AVX512BW__)
// Four groups of a row at once (chunk c: groups 4c .. 4c + 3; of their 128 floats at xg
// the first `valid` are x, the rest read as zero, so padding groups come out zero): their
// int8 values into out[0, 128) in element order, and per group its scale d[i] and the sums of
// its elements 0-15 (lo[i]) and 16-31 (hi[i]). The same float operations as
// quantize_group, group by group (max and integer sums are exact in any order), so the
// values are the same; the four groups' reductions and the layout run as shuffles.
inline void quantize_chunk(const float* xg, int64_t valid, int8_t* out,
                           float* d, int32_t* lo, int32_t* hi) {
  __m512 v[8];
  for (int k = 0; k < 8; ++k) {
    const int64_t left = valid - 16 * k;
    const __mmask16 m = left >= 16 ? __mmask16(0xFFFF)
                        : left <= 0 ? __mmask16(0) : __mmask16((1u << left) - 1);
    v[k] = _mm512_maskz_loadu_ps(m, xg + 16 * k);
  }
  __m512 a[4];
  for (int i = 0; i < 4; ++i)
    a[i] = _mm512_max_ps(_mm512_abs_ps(v[2 * i]), _mm512_abs_ps(v[2 * i + 1]));
  // per 128-bit lane: [max a0, max a1, max a2, max a3] over the lane, then over the lanes
  const __m512 t01 = _mm512_max_ps(_mm512_unpacklo_ps(a[0], a[1]), _mm512_unpackhi_ps(a[0], a[1]));
  const __m512 t23 = _mm512_max_ps(_mm512_unpacklo_ps(a[2], a[3]), _mm512_unpackhi_ps(a[2], a[3]));
  __m512 amax = _mm512_max_ps(
      _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t01), _mm512_castps_pd(t23))),
      _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t01), _mm512_castps_pd(t23))));
  amax = _mm512_max_ps(amax, _mm512_shuffle_f32x4(amax, amax, _MM_SHUFFLE(1, 0, 3, 2)));
  amax = _mm512_max_ps(amax, _mm512_shuffle_f32x4(amax, amax, _MM_SHUFFLE(2, 3, 0, 1)));
  const __m512 dv = _mm512_div_ps(amax, _mm512_set1_ps(127.f));
  const __m512 inv = _mm512_maskz_div_ps(
      _mm512_cmp_ps_mask(dv, _mm512_setzero_ps(), _CMP_GT_OQ), _mm512_set1_ps(1.f), dv);
  __m512i q[8];
  __m128i b[8];
  for (int k = 0; k < 8; ++k) {
    q[k] = _mm512_cvtps_epi32(_mm512_mul_ps(
        v[k], _mm512_permutexvar_ps(_mm512_set1_epi32(k / 2), inv)));
    b[k] = _mm512_cvtepi32_epi8(q[k]);
  }
  // the eight vectors' sums: lanes 0-3 = q0..q3, lanes 8-11 = q4..q7
  auto pair = [](__m512i x, __m512i y) {
    return _mm512_add_epi32(_mm512_unpacklo_epi32(x, y), _mm512_unpackhi_epi32(x, y));
  };
  auto quad = [](__m512i x, __m512i y) {
    return _mm512_add_epi32(_mm512_unpacklo_epi64(x, y), _mm512_unpackhi_epi64(x, y));
  };
  const __m512i r0 = quad(pair(q[0], q[1]), pair(q[2], q[3]));
  const __m512i r1 = quad(pair(q[4], q[5]), pair(q[6], q[7]));
  __m512i sums = _mm512_add_epi32(_mm512_shuffle_i32x4(r0, r1, _MM_SHUFFLE(2, 0, 2, 0)),
                                  _mm512_shuffle_i32x4(r0, r1, _MM_SHUFFLE(3, 1, 3, 1)));
  sums = _mm512_add_epi32(sums, _mm512_shuffle_i32x4(sums, sums, _MM_SHUFFLE(2, 3, 0, 1)));
  alignas(64) int32_t sv[16];
  alignas(64) float dd[16];
  _mm512_store_si512(sv, sums);
  _mm512_store_ps(dd, dv);
  for (int i = 0; i < 4; ++i) {
    d[i] = dd[i];
    lo[i] = sv[(i / 2) * 8 + (i % 2) * 2];
    hi[i] = sv[(i / 2) * 8 + (i % 2) * 2 + 1];
  }
  auto store = [&](int at, __m128i x) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + at), x);
  };
  for (int k = 0; k < 8; ++k) store(16 * k, b[k]);
}
#endif

// One row of x (K columns) into gp groups (K / G real ones, then zero padding), each in
// element order, group g's values at xq + g * step * G and its scalars at dx[g * step]
// (step 1: the row's groups in turn; M: GROUPED, the rows inside); l and h (when not
// null) get 32 dx times the sum of each group's elements 0-15 and 16-31 (q6's halves).
void quantize_row(const float* x, int64_t K, int64_t gp, int64_t step, int8_t* xq,
                  float* dx, float* xs, float* l, float* h) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
  alignas(64) int8_t chunk[CH * G];
  for (int64_t c = 0; c * CH < gp; ++c) {
    const int64_t n = std::min<int64_t>(CH, gp - c * CH);   // < CH: the last groups
    float d[4];
    int32_t lo[4], hi[4];
    const bool direct = n == CH && step == 1;
    quantize_chunk(x + c * CH * G, K - c * CH * G, direct ? xq + c * CH * G : chunk, d, lo, hi);
    for (int64_t i = 0; i < n; ++i) {
      const int64_t g = c * CH + i, at = g * step;
      if (!direct) std::memcpy(xq + at * G, chunk + i * G, G);
      dx[at] = d[i];
      xs[at] = d[i] * static_cast<float>(lo[i] + hi[i]);
      if (l != nullptr) {
        l[at] = 32.f * d[i] * static_cast<float>(lo[i]);
        h[at] = 32.f * d[i] * static_cast<float>(hi[i]);
      }
    }
  }
#else
  const int64_t ngroups = K / G;
  for (int64_t g = 0; g < gp; ++g) {
    const int64_t at = g * step;
    int8_t* q = xq + at * G;
    float d = 0.f;
    std::memset(q, 0, G);
    const int32_t sum = g < ngroups ? quantize_group(x + g * G, q, &d) : 0;
    dx[at] = d;
    xs[at] = d * static_cast<float>(sum);
    if (l != nullptr) {
      int32_t lo = 0, hi = 0;
      for (int j = 0; j < 16; ++j) { lo += q[j]; hi += q[16 + j]; }
      l[at] = 32.f * d * static_cast<float>(lo);
      h[at] = 32.f * d * static_cast<float>(hi);
    }
  }
#endif
}

constexpr int64_t QUANT_GRAIN = 1 << 16;   // values a thread quantizes at least

// x [M, K] quantized in `order`, its rows' groups padded to a multiple of pad_to.
QuantizedX quantize_x(const float* x, int64_t M, int64_t K, int order, int64_t pad_to) {
  const int64_t ng = K / G, gp = (ng + pad_to - 1) / pad_to * pad_to;
  const bool grouped = order == GROUPED;   // also the halves' sums (q6)
  QuantizedX out;
  out.gp = gp;
  out.m = M;
  out.q.resize(M * gp * G);
  out.d.resize(M * gp);
  out.s.resize(M * gp);
  if (grouped) {
    out.l.resize(M * gp);
    out.h.resize(M * gp);
  }
  // PLAIN: row m's groups from m * gp on; GROUPED: QuantizedX::first / stride
  // rows split across threads once there is enough to split (a 512-row prompt step of the
  // 1.5B's down projection quantizes 4.6 M values); each row's values are its own
  at::parallel_for(0, M, std::max<int64_t>(1, QUANT_GRAIN / std::max<int64_t>(K, 1)),
                   [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      const int64_t at = grouped ? out.first(m) : m * gp;
      quantize_row(x + m * K, K, gp, grouped ? out.stride(m) : 1, out.q.data() + at * G,
                   out.d.data() + at, out.s.data() + at,
                   grouped ? out.l.data() + at : nullptr,
                   grouped ? out.h.data() + at : nullptr);
    }
  });
  return out;
}

// How a form's many-row steps run (unpacked_rows; NO_UNPACK: by passes of its rows function).
enum Unpack { NO_UNPACK = 0, UNPACK_Q4 = 1, UNPACK_Q4K = 2, UNPACK_Q6 = 3 };

#if defined(DUET_VNNI)
// Calls f(std::integral_constant<int, mm>) for mm in 1..4, and 5..8 where EIGHT (the
// forms whose passes take 8 rows: Form::pass_rows below).
template <bool EIGHT = false, typename F>
inline void dispatch(int64_t mm, F&& f) {
  switch (mm) {
    case 1: f(std::integral_constant<int, 1>{}); return;
    case 2: f(std::integral_constant<int, 2>{}); return;
    case 3: f(std::integral_constant<int, 3>{}); return;
    case 4: f(std::integral_constant<int, 4>{}); return;
  }
  if constexpr (EIGHT) {
    switch (mm) {
      case 5: f(std::integral_constant<int, 5>{}); return;
      case 6: f(std::integral_constant<int, 6>{}); return;
      case 7: f(std::integral_constant<int, 7>{}); return;
      case 8: f(std::integral_constant<int, 8>{}); return;
    }
  }
  TORCH_CHECK(false, "passes of 1 to ", EIGHT ? 8 : 4, " rows here, got ", mm);
}

// 4 activation bytes broadcast straight from memory (a load, no vector op).
inline __m512i bcast4(const int8_t* p) { return _mm512_broadcastd_epi32(_mm_loadu_si32(p)); }

// Two chains of 4 dots, wa[v] against the 4 activation bytes at xa + v step and wb[v] at
// xb + v step (two accumulators keep the chains short): *a and *b.
inline void dot_pairs(const __m512i* wa, const __m512i* wb, const int8_t* xa,
                      const int8_t* xb, int step, __m512i* a, __m512i* b) {
  __m512i s = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wa[0], bcast4(xa));
  __m512i t = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wb[0], bcast4(xb));
  for (int v = 1; v < 4; ++v) {
    s = _mm512_dpbusd_epi32(s, wa[v], bcast4(xa + v * step));
    t = _mm512_dpbusd_epi32(t, wb[v], bcast4(xb + v * step));
  }
  *a = s;
  *b = t;
}

// One group of 16 weight rows (its nibble vectors at `nib`, d and m of the rows in dv, mv)
// against activation rows 0 .. MM - 1 of a pass (GROUPED: the group's int8 values at
// xg + i G, dx at dg[i], xs at sg[i]), added into sum (lane r: weight row r).
template <int MM>
inline void q4_group(const uint8_t* nib, __m512 dv, __m512 mv, const int8_t* xg,
                     const float* dg, const float* sg, __m512* sum) {
  // the high nibbles stay in place: their dots come out 16 times too large, and one
  // exact shift per activation row (not one per weight vector) takes the 16 out
  const __m512i low4 = _mm512_set1_epi8(0x0F), high4 = _mm512_set1_epi8(static_cast<char>(0xF0));
  __m512i lo[4], hi[4];
  for (int v = 0; v < 4; ++v) {
    const __m512i w = _mm512_loadu_si512(nib + v * 64);
    lo[v] = _mm512_and_si512(w, low4);
    hi[v] = _mm512_and_si512(w, high4);
  }
#pragma GCC unroll 8
  for (int i = 0; i < MM; ++i) {
    const int8_t* xq = xg + i * G;
    __m512i a, b;   // elements 8v + j (low nibbles), 8v + 4 + j (high)
    dot_pairs(lo, hi, xq, xq + 4, 8, &a, &b);
    const __m512i e = _mm512_add_epi32(a, _mm512_srai_epi32(b, 4));
    sum[i] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(e), _mm512_set1_ps(dg[i])),
                             dv, sum[i]);
    sum[i] = _mm512_fmadd_ps(mv, _mm512_set1_ps(sg[i]), sum[i]);
  }
}

// Row block nb's units of tile t (one group each) of a q4 weight against activation rows
// m0 .. m0 + MM - 1, added into acc (lane r: weight row 16 nb + r).
template <int MM>
void q4_span(const Tiles& W, const QuantizedX& X, int64_t nb, int64_t t, int64_t m0,
             __m512* acc) {
  const int64_t M = X.stride(m0), x0 = X.first(m0);   // GROUPED
  const uint8_t* first = W.span(nb, t);
  const int64_t u0 = t * W.tu, u1 = W.end(t);
  __m512 sum[MM];   // in registers for the span (the rows' loop unrolled)
#pragma GCC unroll 8
  for (int i = 0; i < MM; ++i) sum[i] = acc[i];
  for (int64_t g = u0; g < u1; ++g) {
    const uint8_t* blk = first + (g - u0) * Q4_BLOCK;
    for (int l = 0; l < Q4_BLOCK / 64; ++l)   // two units ahead (runs into the next block)
      _mm_prefetch(reinterpret_cast<const char*>(blk + 2 * Q4_BLOCK + l * 64), _MM_HINT_T0);
    const __m512 dv = _mm512_cvtph_ps(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 256)));
    const __m512 mv = _mm512_cvtph_ps(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 288)));
    q4_group<MM>(blk, dv, mv, X.q.data() + (x0 + g * M) * G, X.d.data() + x0 + g * M,
                 X.s.data() + x0 + g * M, sum);
  }
#pragma GCC unroll 8
  for (int i = 0; i < MM; ++i) acc[i] = sum[i];
}

// The same for a q8g weight: a group's 8 byte vectors, one dot chain each half.
template <int MM>
void q8g_span(const Tiles& W, const QuantizedX& X, int64_t nb, int64_t t, int64_t m0,
              __m512* acc) {
  const int64_t M = X.stride(m0), x0 = X.first(m0);   // GROUPED
  const uint8_t* first = W.span(nb, t);
  const int64_t u0 = t * W.tu, u1 = W.end(t);
  __m512 sum[MM];
#pragma GCC unroll 8
  for (int i = 0; i < MM; ++i) sum[i] = acc[i];
  for (int64_t g = u0; g < u1; ++g) {
    const uint8_t* blk = first + (g - u0) * Q8G_BLOCK;
    for (int l = 0; l < Q8G_BLOCK / 64; ++l)   // two units ahead (runs into the next block)
      _mm_prefetch(reinterpret_cast<const char*>(blk + 2 * Q8G_BLOCK + l * 64), _MM_HINT_T0);
    const __m512 dv = _mm512_cvtph_ps(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 512)));
    const __m512 mv = _mm512_cvtph_ps(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 544)));
    __m512i w[8];
    for (int v = 0; v < 8; ++v) w[v] = _mm512_loadu_si512(blk + v * 64);
    const int8_t* xg = X.q.data() + (x0 + g * M) * G;
    const float* dg = X.d.data() + x0 + g * M;
    const float* sg = X.s.data() + x0 + g * M;
#pragma GCC unroll 8
    for (int i = 0; i < MM; ++i) {
      const int8_t* xq = xg + i * G;
      __m512i a, b;   // elements 0-15, 16-31
      dot_pairs(w, w + 4, xq, xq + 16, 4, &a, &b);
      const __m512i e = _mm512_add_epi32(a, b);
      sum[i] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(e), _mm512_set1_ps(dg[i])),
                               dv, sum[i]);
      sum[i] = _mm512_fmadd_ps(mv, _mm512_set1_ps(sg[i]), sum[i]);
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < MM; ++i) acc[i] = sum[i];
}

// Lane r of acc[i] into y[m0 + i, 16 nb + r] (rows below N).
template <int MM>
inline void store_rows16(const __m512* acc, float* y, int64_t N, int64_t nb, int64_t m0) {
  const int64_t left = N - nb * ROWS;
  const __mmask16 keep = left >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1);
  for (int i = 0; i < MM; ++i) _mm512_mask_storeu_ps(y + (m0 + i) * N + nb * ROWS, keep, acc[i]);
}

// 16 little-endian 24-bit words at p (48 bytes), each widened to an int32 lane: the 48
// bytes moved 12 to a 128-bit lane (dwords 3L .. 3L + 2 to lane L), then 3 bytes to a dword.
inline __m512i widen24(const uint8_t* p) {
  const __m512i raw = _mm512_maskz_loadu_epi8(0xFFFFFFFFFFFFull, p);
  const __m512i lanes = _mm512_permutexvar_epi32(
      _mm512_setr_epi32(0, 1, 2, 0, 3, 4, 5, 0, 6, 7, 8, 0, 9, 10, 11, 0), raw);
  const __m128i z = _mm_setr_epi8(0, 1, 2, -1, 3, 4, 5, -1, 6, 7, 8, -1, 9, 10, 11, -1);
  return _mm512_shuffle_epi8(lanes, _mm512_broadcast_i32x4(z));
}

// Group gl (0..7) of a q4k unit at blk: its rows' d * sc and -dmin * mn (ds = d, dm =
// -dmin of the rows) from the unit's 6-bit codes.
inline void q4k_group_dm(const uint8_t* blk, int gl, __m512 ds, __m512 dm, __m512* dv,
                         __m512* mv) {
  const __m512i six = _mm512_set1_epi32(63);
  const int h = gl / 4;
  const __m512i codes = widen24(blk + Q4K_CODES + 48 * (gl % 4));
  const __m512i sc = _mm512_and_si512(_mm512_srli_epi32(codes, 6 * h), six);
  const __m512i mn = _mm512_and_si512(_mm512_srli_epi32(codes, 12 + 6 * h), six);
  *dv = _mm512_mul_ps(ds, _mm512_cvtepi32_ps(sc));
  *mv = _mm512_mul_ps(dm, _mm512_cvtepi32_ps(mn));
}

// The same for a q4k weight: 8 groups a unit, their d and m computed from the codes.
template <int MM>
void q4k_span(const Tiles& W, const QuantizedX& X, int64_t nb, int64_t t, int64_t m0,
              __m512* acc) {
  const int64_t M = X.stride(m0), x0 = X.first(m0);   // GROUPED
  const uint8_t* first = W.span(nb, t);
  const int64_t u0 = t * W.tu, u1 = W.end(t);
  __m512 sum[MM];
#pragma GCC unroll 8
  for (int i = 0; i < MM; ++i) sum[i] = acc[i];
  for (int64_t s = u0; s < u1; ++s) {
    const uint8_t* blk = first + (s - u0) * Q4K_BLOCK;
    const __m512 ds = _mm512_cvtph_ps(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + Q4K_D)));
    const __m512 dm = _mm512_sub_ps(_mm512_setzero_ps(), _mm512_cvtph_ps(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + Q4K_D + 32))));
    for (int gl = 0; gl < 8; ++gl) {
      const uint8_t* nib = blk + gl * 256;
      for (int l = 0; l < 4; ++l)   // two units ahead, a group's nibbles at a time
        _mm_prefetch(reinterpret_cast<const char*>(nib + 2 * Q4K_BLOCK + l * 64), _MM_HINT_T0);
      if (gl == 7)                  // and the codes and scales
        for (int l = 0; l < 4; ++l)
          _mm_prefetch(reinterpret_cast<const char*>(blk + 2 * Q4K_BLOCK + Q4K_CODES + l * 64),
                       _MM_HINT_T0);
      const int64_t g = 8 * s + gl;
      __m512 dv, mv;
      q4k_group_dm(blk, gl, ds, dm, &dv, &mv);
      q4_group<MM>(nib, dv, mv, X.q.data() + (x0 + g * M) * G,
                   X.d.data() + x0 + g * M, X.s.data() + x0 + g * M, sum);
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < MM; ++i) acc[i] = sum[i];
}

// A q6 group's 8 byte vectors w[t] (elements 4t..4t+3 of each row, one byte each): the
// low bits from nibble vector t / 2 (its low nibbles for even t), the top two from vector
// t / 4, bits 2 (t % 4) moved to 4-5.
inline void q6_bytes(const uint8_t* grp, __m512i* w) {
  const __m512i low4 = _mm512_set1_epi8(0x0F), six = _mm512_set1_epi8(0x3F);
  for (int u = 0; u < 2; ++u) {
    const __m512i top = _mm512_loadu_si512(grp + Q6_TOP + u * 64);
    const __m512i tk[4] = {_mm512_slli_epi16(top, 4), _mm512_slli_epi16(top, 2), top,
                           _mm512_srli_epi16(top, 2)};
    for (int k = 0; k < 4; ++k) {
      const int tt = 4 * u + k;
      const __m512i n = _mm512_loadu_si512(grp + (tt / 2) * 64);
      const __m512i low = tt % 2 ? _mm512_srli_epi16(n, 4) : n;
      // (low & 0x0F) | (tk & ~0x0F), then & 0x3F
      w[tt] = _mm512_and_si512(_mm512_ternarylogic_epi32(low4, low, tk[k], 0xCA), six);
    }
  }
}

// The same for a q6 weight: per group the 8 byte vectors (the low 4 bits and the top two
// joined), and the dots of elements 0-15 and 16-31 apart, each half with its own scale.
template <int MM>
void q6_span(const Tiles& W, const QuantizedX& X, int64_t nb, int64_t t, int64_t m0,
             __m512* acc) {
  const int64_t M = X.stride(m0), x0 = X.first(m0);   // GROUPED
  const uint8_t* first = W.span(nb, t);
  const int64_t u0 = t * W.tu, u1 = W.end(t);
  __m512 sum[MM];
#pragma GCC unroll 8
  for (int i = 0; i < MM; ++i) sum[i] = acc[i];
  for (int64_t c = u0; c < u1; ++c) {
    const uint8_t* blk = first + (c - u0) * Q6_BLOCK;
    const __m512 dv = _mm512_cvtph_ps(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + Q6_D)));
    for (int gi = 0; gi < CH; ++gi) {
      const uint8_t* grp = blk + gi * Q6_GROUP;
      // two units ahead, a group's lines at a time (a whole unit's 27 at once stalled
      // the DRAM stream at one activation row: the LM head 5.7-5.9 -> 6.2-7.0 ms)
      for (int l = gi * 7; l < (gi == CH - 1 ? (Q6_BLOCK + 63) / 64 : gi * 7 + 7); ++l)
        _mm_prefetch(reinterpret_cast<const char*>(blk + 2 * Q6_BLOCK + l * 64), _MM_HINT_T0);
      const __m512 slo = _mm512_mul_ps(dv, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(grp + Q6_SC)))));
      const __m512 shi = _mm512_mul_ps(dv, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(grp + Q6_SC + 16)))));
      __m512i w[8];
      q6_bytes(grp, w);
      const int64_t g = c * CH + gi;
      const int8_t* xg = X.q.data() + (x0 + g * M) * G;
      const float* dg = X.d.data() + x0 + g * M;
      const float* lg = X.l.data() + x0 + g * M;
      const float* hg = X.h.data() + x0 + g * M;
#pragma GCC unroll 8
      for (int i = 0; i < MM; ++i) {
        const int8_t* xq = xg + i * G;
        __m512i a, b;   // elements 0-15, 16-31
        dot_pairs(w, w + 4, xq, xq + 16, 4, &a, &b);
        const __m512 dx = _mm512_set1_ps(dg[i]);
        sum[i] = _mm512_fmadd_ps(_mm512_fmsub_ps(_mm512_cvtepi32_ps(a), dx,
                                                 _mm512_set1_ps(lg[i])), slo, sum[i]);
        sum[i] = _mm512_fmadd_ps(_mm512_fmsub_ps(_mm512_cvtepi32_ps(b), dx,
                                                 _mm512_set1_ps(hg[i])), shi, sum[i]);
      }
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < MM; ++i) acc[i] = sum[i];
}

// Row blocks [b0, b1) of W: span(nb, t, acc) adds tile t of block nb into acc, store(nb,
// acc) writes the block's outputs. With one tile, block after block; with more, tile
// after tile, each block's MM accumulators kept in memory in between (they add up in the
// same order either way).
template <int MM, typename Span, typename Store>
void over_tiles(const Tiles& W, int64_t b0, int64_t b1, Span span, Store store) {
  const int64_t nt = W.ntiles();
  if (nt == 1) {
    for (int64_t nb = b0; nb < b1; ++nb) {
      __m512 acc[MM];
      for (int i = 0; i < MM; ++i) acc[i] = _mm512_setzero_ps();
      span(nb, int64_t(0), acc);
      store(nb, acc);
    }
    return;
  }
  std::vector<__m512> buf((b1 - b0) * MM, _mm512_setzero_ps());
  for (int64_t t = 0; t < nt; ++t)
    for (int64_t nb = b0; nb < b1; ++nb) {
      __m512 acc[MM];
      for (int i = 0; i < MM; ++i) acc[i] = buf[(nb - b0) * MM + i];
      span(nb, t, acc);
      for (int i = 0; i < MM; ++i) buf[(nb - b0) * MM + i] = acc[i];
    }
  for (int64_t nb = b0; nb < b1; ++nb) store(nb, &buf[(nb - b0) * MM]);
}

// Many-row steps (a prompt's chunk): each weight group of 16 rows unpacked once per tile
// into a record of 8 byte vectors (vector t, dword r: elements 4t .. 4t + 3 of row r, one
// byte each) and two float vectors, then every pass of activation rows runs over the
// records: no nibble masks, shifts or scale decoding per pass, and one chain of 8 dots a
// row. The forms' sums come out as their spans compute them (the same integers, the same
// float operations in the same order), so a row's output does not depend on the path.
//   DM forms (q4, q4k): a = d (d * sc), b = m (-dmin * mn): sum += (e dx) a + b xs.
//   q6: a, b = the halves' d * sc: sum += (e_lo dx - l) a + (e_hi dx - h) b.
struct alignas(64) Rec {
  uint8_t w[8][64];
  float a[16], b[16];
};

// A q4 group's nibble vectors at `nib` as bytes: record vector 2v = the low nibbles of
// vector v (elements 8v + j), 2v + 1 = the high ones (8v + 4 + j).
inline void unpack_nibbles(const uint8_t* nib, Rec& r) {
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  for (int v = 0; v < 4; ++v) {
    const __m512i w = _mm512_loadu_si512(nib + v * 64);
    _mm512_store_si512(r.w[2 * v], _mm512_and_si512(w, low4));
    _mm512_store_si512(r.w[2 * v + 1], _mm512_and_si512(_mm512_srli_epi16(w, 4), low4));
  }
}

// Block nb of W (all its units) into records out[0 .. K / G) in `kind`'s form.
void unpack_block(int kind, const Tiles& W, int64_t nb, Rec* out) {
  if (kind == UNPACK_Q4) {
    for (int64_t g = 0; g < W.units; ++g) {
      const uint8_t* blk = W.at(nb, g);
      unpack_nibbles(blk, out[g]);
      _mm512_store_ps(out[g].a, _mm512_cvtph_ps(_mm256_loadu_si256(
          reinterpret_cast<const __m256i*>(blk + 256))));
      _mm512_store_ps(out[g].b, _mm512_cvtph_ps(_mm256_loadu_si256(
          reinterpret_cast<const __m256i*>(blk + 288))));
    }
    return;
  }
  if (kind == UNPACK_Q4K) {
    for (int64_t s = 0; s < W.units; ++s) {
      const uint8_t* blk = W.at(nb, s);
      const __m512 ds = _mm512_cvtph_ps(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + Q4K_D)));
      const __m512 dm = _mm512_sub_ps(_mm512_setzero_ps(), _mm512_cvtph_ps(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + Q4K_D + 32))));
      for (int gl = 0; gl < 8; ++gl) {
        Rec& r = out[8 * s + gl];
        unpack_nibbles(blk + gl * 256, r);
        __m512 dv, mv;
        q4k_group_dm(blk, gl, ds, dm, &dv, &mv);
        _mm512_store_ps(r.a, dv);
        _mm512_store_ps(r.b, mv);
      }
    }
    return;
  }
  for (int64_t c = 0; c < W.units; ++c) {   // q6
    const uint8_t* blk = W.at(nb, c);
    const __m512 dv = _mm512_cvtph_ps(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + Q6_D)));
    for (int gi = 0; gi < CH; ++gi) {
      const uint8_t* grp = blk + gi * Q6_GROUP;
      Rec& r = out[c * CH + gi];
      _mm512_store_ps(r.a, _mm512_mul_ps(dv, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(grp + Q6_SC))))));
      _mm512_store_ps(r.b, _mm512_mul_ps(dv, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(grp + Q6_SC + 16))))));
      __m512i w[8];
      q6_bytes(grp, w);
      for (int t = 0; t < 8; ++t) _mm512_store_si512(r.w[t], w[t]);
    }
  }
}

// Records rec[0 .. ng) (one block's groups in order) against activation rows m0 .. m0 +
// MM - 1: the block's outputs in sum.
template <int MM, bool HALVES>
void rec_span(const Rec* rec, int64_t ng, const QuantizedX& X, int64_t m0, __m512* sum) {
  const int64_t M = X.stride(m0), x0 = X.first(m0);   // GROUPED
#pragma GCC unroll 8
  for (int i = 0; i < MM; ++i) sum[i] = _mm512_setzero_ps();
  for (int64_t g = 0; g < ng; ++g) {
    const Rec& r = rec[g];
    __m512i w[8];
    for (int v = 0; v < 8; ++v) w[v] = _mm512_load_si512(r.w[v]);
    const __m512 a = _mm512_load_ps(r.a), b = _mm512_load_ps(r.b);
    const int8_t* xg = X.q.data() + (x0 + g * M) * G;
    const float* dg = X.d.data() + x0 + g * M;
#pragma GCC unroll 8
    for (int i = 0; i < MM; ++i) {
      const int8_t* xq = xg + i * G;
      if constexpr (!HALVES) {
        __m512i e = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[0], bcast4(xq));
        for (int t = 1; t < 8; ++t) e = _mm512_dpbusd_epi32(e, w[t], bcast4(xq + 4 * t));
        sum[i] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(e), _mm512_set1_ps(dg[i])),
                                 a, sum[i]);
        sum[i] = _mm512_fmadd_ps(b, _mm512_set1_ps(X.s[x0 + g * M + i]), sum[i]);
      } else {
        __m512i lo = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[0], bcast4(xq));
        __m512i hi = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[4], bcast4(xq + 16));
        for (int t = 1; t < 4; ++t) {
          lo = _mm512_dpbusd_epi32(lo, w[t], bcast4(xq + 4 * t));
          hi = _mm512_dpbusd_epi32(hi, w[4 + t], bcast4(xq + 16 + 4 * t));
        }
        const __m512 dx = _mm512_set1_ps(dg[i]);
        sum[i] = _mm512_fmadd_ps(_mm512_fmsub_ps(_mm512_cvtepi32_ps(lo), dx,
                                                 _mm512_set1_ps(X.l[x0 + g * M + i])), a, sum[i]);
        sum[i] = _mm512_fmadd_ps(_mm512_fmsub_ps(_mm512_cvtepi32_ps(hi), dx,
                                                 _mm512_set1_ps(X.h[x0 + g * M + i])), b, sum[i]);
      }
    }
  }
}

// Blocks [t0, t1) of W (unpacked into thread-local records) against all M rows of X, in
// passes of up to 8 rows: y's rows [0, M) at those blocks' columns.
void unpacked_rows(int kind, const Tiles& W, const QuantizedX& X, float* y, int64_t N,
                   int64_t t0, int64_t t1, int64_t M) {
  thread_local std::vector<Rec> recs;
  const int64_t ng = W.units * (kind == UNPACK_Q4K ? 8 : kind == UNPACK_Q6 ? CH : 1);
  if (int64_t(recs.size()) < (t1 - t0) * ng) recs.resize((t1 - t0) * ng);
  for (int64_t nb = t0; nb < t1; ++nb) unpack_block(kind, W, nb, recs.data() + (nb - t0) * ng);
  for (int64_t m0 = 0; m0 < M;) {
    const int64_t mm = std::min(XROWS, M - m0);
    dispatch<true>(mm, [&](auto MM) {
      for (int64_t nb = t0; nb < t1; ++nb) {
        __m512 acc[MM.value];
        const Rec* rec = recs.data() + (nb - t0) * ng;
        if (kind == UNPACK_Q6) rec_span<MM.value, true>(rec, ng, X, m0, acc);
        else rec_span<MM.value, false>(rec, ng, X, m0, acc);
        store_rows16<MM.value>(acc, y, N, nb, m0);
      }
    });
    m0 += mm;
  }
}

// Weight rows 4 nb .. 4 nb + 3 (one packed block) against activation rows m0 .. m0 + MM - 1.
template <int MM>
void q8_block(const int8_t* pk, const float* ws, const QuantizedX& X, float* y, int64_t npairs,
              int64_t N, int64_t nb, int64_t m0) {
  const int64_t gp = X.gp;
  const int8_t* base = pk + nb * npairs * Q8_BLOCK;
  // dx of groups 2p, 2p+1 as one vector: lanes 0-7 and 8-15 (vpdpbusd sums 4 bytes a lane)
  const __m512i pidx = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
  __m512 acc[4][MM];
  for (int r = 0; r < 4; ++r) for (int i = 0; i < MM; ++i) acc[r][i] = _mm512_setzero_ps();
  for (int64_t p = 0; p < npairs; ++p) {
    const int8_t* blk = base + p * Q8_BLOCK;
    for (int l = 0; l < Q8_BLOCK / 64; ++l)
      _mm_prefetch(reinterpret_cast<const char*>(blk + 2 * Q8_BLOCK + l * 64), _MM_HINT_T0);
    __m512 s[MM];
    for (int i = 0; i < MM; ++i)
      s[i] = _mm512_permutexvar_ps(pidx, _mm512_castps128_ps512(_mm_castsi128_ps(
          _mm_loadl_epi64(reinterpret_cast<const __m128i*>(X.d.data() + (m0 + i) * gp + 2 * p)))));
    for (int r = 0; r < 4; ++r) {
      const __m512i w = _mm512_loadu_si512(blk + r * 64);
      const __m512i aw = _mm512_abs_epi8(w);
      const __mmask64 neg = _mm512_movepi8_mask(w);
      for (int i = 0; i < MM; ++i) {
        const __m512i xv = _mm512_loadu_si512(X.q.data() + (m0 + i) * gp * G + p * 64);
        const __m512i sx = _mm512_mask_sub_epi8(xv, neg, _mm512_setzero_si512(), xv);
        const __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), aw, sx);
        acc[r][i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), s[i], acc[r][i]);
      }
    }
  }
  for (int i = 0; i < MM; ++i) {
    alignas(16) float o[4];
    _mm_store_ps(o, sum4(acc[0][i], acc[1][i], acc[2][i], acc[3][i]));
    for (int r = 0; r < 4 && nb * 4 + r < N; ++r)
      y[(m0 + i) * N + nb * 4 + r] = o[r] * ws[nb * 4 + r];
  }
}

// Weight rows one after another, each dotted with the activation rows (4 accumulators over
// 64 columns a step; a row of up to a few KiB stays in L1 for the next activation row), so
// a thread reads its weight rows as one sequential stream (the hardware prefetcher's best
// case: 1.2-1.5x a 4-rows-at-once block at one row on Zen 4), and every activation row
// sums in the same order whatever the row count (batched = unbatched, bit for bit).
inline float f32_dot(const float* w, const float* x, int64_t K) {
  __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  int64_t k = 0;
  for (; k + 64 <= K; k += 64) {
    a0 = _mm512_fmadd_ps(_mm512_loadu_ps(w + k), _mm512_loadu_ps(x + k), a0);
    a1 = _mm512_fmadd_ps(_mm512_loadu_ps(w + k + 16), _mm512_loadu_ps(x + k + 16), a1);
    a2 = _mm512_fmadd_ps(_mm512_loadu_ps(w + k + 32), _mm512_loadu_ps(x + k + 32), a2);
    a3 = _mm512_fmadd_ps(_mm512_loadu_ps(w + k + 48), _mm512_loadu_ps(x + k + 48), a3);
  }
  for (; k < K; k += 16) {
    const __mmask16 km = k + 16 <= K ? (__mmask16)0xFFFF : (__mmask16)((1u << (K - k)) - 1);
    a0 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(km, w + k), _mm512_maskz_loadu_ps(km, x + k), a0);
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
}
#endif

void f32_rows(const float* w, const float* x, float* y, int64_t K, int64_t N, int64_t n0,
              int64_t n1, int64_t m0, int64_t mm) {
#if defined(DUET_VNNI)
  for (int64_t n = n0; n < n1; ++n)
    for (int64_t i = m0; i < m0 + mm; ++i) y[i * N + n] = f32_dot(w + n * K, x + i * K, K);
#else
  for (int64_t n = n0; n < n1; ++n)
    for (int64_t i = 0; i < mm; ++i) {
      float total = 0.f;
      for (int64_t k = 0; k < K; ++k) total += w[n * K + k] * x[(m0 + i) * K + k];
      y[(m0 + i) * N + n] = total;
    }
#endif
}

// Without VNNI, plain loops: y[m, n] for the weight rows of blocks [b0, b1) (of ROWS rows)
// and activation rows m0 .. m0 + mm - 1; add(nb, r, m, total) adds row r of block nb's products with
// activation row m into total.
template <typename Add>
void plain_rows(float* y, int64_t N, int64_t b0, int64_t b1, int64_t m0, int64_t mm, Add add) {
  for (int64_t n = b0 * ROWS; n < std::min(N, b1 * ROWS); ++n)
    for (int64_t m = m0; m < m0 + mm; ++m) {
      float total = 0.f;
      add(n / ROWS, static_cast<int>(n % ROWS), m, total);
      y[m * N + n] = total;
    }
}

// Element k of row r in a q4 unit (one group of 16 rows, its nibble vectors at `blk`).
inline int q4_unit_nib(const uint8_t* blk, int r, int k) {
  const uint8_t b = blk[(k / 8) * 64 + r * 4 + k % 4];
  return (k % 8) < 4 ? (b & 15) : (b >> 4);
}

// Element k of row r in a q8g unit (one group of 16 rows, its byte vectors at `blk`).
inline int q8g_unit_u(const uint8_t* blk, int r, int k) {
  return blk[(k / 4) * 64 + r * 4 + k % 4];
}

// The forms whose unit is one group of 16 rows with w = d * q + m (q4, q8g): the VNNI
// span, element k of row r in a unit (the plain loop) and where d [16] starts (m [16]
// follows).
struct Q4Unit {
  static constexpr int64_t D_AT = 256;
  static int q(const uint8_t* blk, int r, int k) { return q4_unit_nib(blk, r, k); }
#if defined(DUET_VNNI)
  template <int MM>
  static void span(const Tiles& W, const QuantizedX& X, int64_t nb, int64_t t, int64_t m0,
                   __m512* acc) { q4_span<MM>(W, X, nb, t, m0, acc); }
#endif
};
struct Q8GUnit {
  static constexpr int64_t D_AT = 512;
  static int q(const uint8_t* blk, int r, int k) { return q8g_unit_u(blk, r, k); }
#if defined(DUET_VNNI)
  template <int MM>
  static void span(const Tiles& W, const QuantizedX& X, int64_t nb, int64_t t, int64_t m0,
                   __m512* acc) { q8g_span<MM>(W, X, nb, t, m0, acc); }
#endif
};

// y[m, n] for packed blocks [b0, b1) of such a weight, activation rows m0 .. m0 + mm - 1.
template <typename U>
void group_rows(const Tiles& W, const QuantizedX& X, float* y, int64_t N,
                int64_t b0, int64_t b1, int64_t m0, int64_t mm) {
#if defined(DUET_VNNI)
  dispatch<true>(mm, [&](auto MM) {
    over_tiles<MM.value>(W, b0, b1,
        [&](int64_t nb, int64_t t, __m512* acc) {
          U::template span<MM.value>(W, X, nb, t, m0, acc);
        },
        [&](int64_t nb, const __m512* acc) { store_rows16<MM.value>(acc, y, N, nb, m0); });
  });
#else
  plain_rows(y, N, b0, b1, m0, mm, [&](int64_t nb, int r, int64_t m, float& total) {
    for (int64_t g = 0; g < W.units; ++g) {
      const uint8_t* blk = W.at(nb, g);
      const int64_t xi = X.first(m) + g * X.stride(m);
      const int8_t* xq = X.q.data() + xi * G;
      int32_t dot = 0;
      for (int k = 0; k < G; ++k) dot += U::q(blk, r, k) * xq[k];
      const uint16_t* dm = reinterpret_cast<const uint16_t*>(blk + U::D_AT);
      total += half_to_float(dm[r]) * X.d[xi] * float(dot) +
               half_to_float(dm[ROWS + r]) * X.s[xi];
    }
  });
#endif
}

void q4_rows(const Tiles& W, const QuantizedX& X, float* y, int64_t N,
             int64_t b0, int64_t b1, int64_t m0, int64_t mm) {
  group_rows<Q4Unit>(W, X, y, N, b0, b1, m0, mm);
}

void q8g_rows(const Tiles& W, const QuantizedX& X, float* y, int64_t N,
              int64_t b0, int64_t b1, int64_t m0, int64_t mm) {
  group_rows<Q8GUnit>(W, X, y, N, b0, b1, m0, mm);
}

// Group g's d and m of row r of a q4k block (g in 0..7 over the block's 256 columns).
inline void q4k_dm(const uint8_t* blk, int r, int g, float* d, float* m) {
  const uint16_t* dd = reinterpret_cast<const uint16_t*>(blk + Q4K_D);
  const uint8_t* c = blk + Q4K_CODES + 48 * (g % 4) + 3 * r;
  const uint32_t word = uint32_t(c[0]) | uint32_t(c[1]) << 8 | uint32_t(c[2]) << 16;
  const int h = g / 4;
  *d = half_to_float(dd[r]) * float((word >> (6 * h)) & 63);
  *m = -(half_to_float(dd[ROWS + r]) * float((word >> (12 + 6 * h)) & 63));
}

void q4k_rows(const Tiles& W, const QuantizedX& X, float* y, int64_t N,
              int64_t b0, int64_t b1, int64_t m0, int64_t mm) {
#if defined(DUET_VNNI)
  dispatch<true>(mm, [&](auto MM) {
    over_tiles<MM.value>(W, b0, b1,
        [&](int64_t nb, int64_t t, __m512* acc) { q4k_span<MM.value>(W, X, nb, t, m0, acc); },
        [&](int64_t nb, const __m512* acc) { store_rows16<MM.value>(acc, y, N, nb, m0); });
  });
#else
  plain_rows(y, N, b0, b1, m0, mm, [&](int64_t nb, int r, int64_t m, float& total) {
    for (int64_t s = 0; s < W.units; ++s) {
      const uint8_t* blk = W.at(nb, s);
      for (int gl = 0; gl < 8; ++gl) {
        const int64_t g = 8 * s + gl;
        const int64_t xi = X.first(m) + g * X.stride(m);
        const int8_t* xq = X.q.data() + xi * G;
        int32_t dot = 0;
        for (int k = 0; k < G; ++k) dot += q4_unit_nib(blk + gl * 256, r, k) * xq[k];
        float dv, mv;
        q4k_dm(blk, r, gl, &dv, &mv);
        total += dv * X.d[xi] * float(dot) + mv * X.s[xi];
      }
    }
  });
#endif
}

// Element k (0..31) of row r in a q6 unit's group at `grp`: its 6-bit q (0..63), and its
// scale d * sc (d: the row's float16 d in the unit at `blk`).
inline int q6_q(const uint8_t* grp, int r, int k) {
  const int t = k / 4, top = grp[Q6_TOP + (t / 4) * 64 + r * 4 + k % 4];
  return q4_unit_nib(grp, r, k) | (((top >> (2 * (t % 4))) & 3) << 4);
}

inline float q6_scale(const uint8_t* blk, const uint8_t* grp, int r, int k) {
  const int8_t sc = static_cast<int8_t>(grp[Q6_SC + (k < 16 ? 0 : 16) + r]);
  return half_to_float(reinterpret_cast<const uint16_t*>(blk + Q6_D)[r]) * float(sc);
}

void q6_rows(const Tiles& W, const QuantizedX& X, float* y, int64_t N,
             int64_t b0, int64_t b1, int64_t m0, int64_t mm) {
#if defined(DUET_VNNI)
  dispatch<true>(mm, [&](auto MM) {
    over_tiles<MM.value>(W, b0, b1,
        [&](int64_t nb, int64_t t, __m512* acc) { q6_span<MM.value>(W, X, nb, t, m0, acc); },
        [&](int64_t nb, const __m512* acc) { store_rows16<MM.value>(acc, y, N, nb, m0); });
  });
#else
  plain_rows(y, N, b0, b1, m0, mm, [&](int64_t nb, int r, int64_t m, float& total) {
    for (int64_t c = 0; c < W.units; ++c) {
      const uint8_t* blk = W.at(nb, c);
      for (int gi = 0; gi < CH; ++gi) {
        const uint8_t* grp = blk + gi * Q6_GROUP;
        const int64_t g = c * CH + gi;
        const int64_t xi = X.first(m) + g * X.stride(m);
        const int8_t* xq = X.q.data() + xi * G;
        for (int half = 0; half < 2; ++half) {
          int32_t dot = 0, xsum = 0;
          for (int j = 0; j < 16; ++j) {
            dot += q6_q(grp, r, half * 16 + j) * xq[half * 16 + j];
            xsum += xq[half * 16 + j];
          }
          total += q6_scale(blk, grp, r, half * 16) * X.d[xi] * float(dot - 32 * xsum);
        }
      }
    }
  });
#endif
}

void q8_rows(const int8_t* pk, const float* ws, const QuantizedX& X, float* y, int64_t npairs,
             int64_t N, int64_t b0, int64_t b1, int64_t m0, int64_t mm) {
#if defined(DUET_VNNI)
  dispatch(mm, [&](auto MM) {
    for (int64_t nb = b0; nb < b1; ++nb) q8_block<MM.value>(pk, ws, X, y, npairs, N, nb, m0);
  });
#else
  const int64_t gp = X.gp;
  for (int64_t n = b0 * 4; n < std::min(N, b1 * 4); ++n) {
    const int8_t* base = pk + (n / 4) * npairs * Q8_BLOCK + (n % 4) * 64;
    for (int64_t i = 0; i < mm; ++i) {
      const int8_t* xq = X.q.data() + (m0 + i) * gp * G;
      float total = 0.f;
      for (int64_t g = 0; g < 2 * npairs; ++g) {
        const int8_t* wg = base + (g / 2) * Q8_BLOCK + (g % 2) * G;
        int32_t dot = 0;
        for (int64_t k = 0; k < G; ++k) dot += int32_t(wg[k]) * xq[g * G + k];
        total += X.d[(m0 + i) * gp + g] * float(dot);
      }
      y[(m0 + i) * N + n] = ws[n] * total;
    }
  }
#endif
}

// Outputs too big for the heap (the many-row products: amx_gemm, packed_gemv, stacked_gemv): glibc maps each allocation past its mmap threshold (32
// MiB at most; loader/huge_pages.py sets it) afresh, so a 512-row gate/up product of the
// 1.5B ([512, 17920] float32, 36 MiB) faulted in 9,000 pages a call (27.8 ms against 2 x
// 8.6 for two halves). Such outputs come from here: the last POOL_KEEP freed ones are kept
// and reused for the same size (consecutive layers' same products), in 2 MiB pages.
constexpr size_t POOL_MIN = size_t(32) << 20, POOL_KEEP = 2, POOL_ALIGN = size_t(2) << 20;
struct Pool {
  std::mutex mu;
  std::vector<std::pair<size_t, void*>> free;
};
// never destroyed: a tensor freed during interpreter shutdown still finds it
Pool& pool() {
  static Pool* p = new Pool;
  return *p;
}

void pool_give(void* p, size_t bytes) {
  Pool& pl = pool();
  std::lock_guard<std::mutex> lock(pl.mu);
  if (pl.free.size() < POOL_KEEP) pl.free.emplace_back(bytes, p);
  else std::free(p);
}

torch::Tensor pooled_empty(int64_t rows, int64_t cols, const torch::TensorOptions& opts) {
  const size_t bytes = size_t(rows) * cols * sizeof(float);
  if (bytes < POOL_MIN) return torch::empty({rows, cols}, opts.dtype(torch::kFloat32));
  void* p = nullptr;
  {
    Pool& pl = pool();
    std::lock_guard<std::mutex> lock(pl.mu);
    for (size_t i = 0; i < pl.free.size(); ++i)
      if (pl.free[i].first == bytes) {
        p = pl.free[i].second;
        pl.free.erase(pl.free.begin() + i);
        break;
      }
  }
  if (p == nullptr) {
    const size_t size = (bytes + POOL_ALIGN - 1) / POOL_ALIGN * POOL_ALIGN;
    p = std::aligned_alloc(POOL_ALIGN, size);
    TORCH_CHECK(p != nullptr, "out of memory for a ", bytes, "-byte output");
    madvise(p, size, MADV_HUGEPAGE);
  }
  return torch::from_blob(p, {rows, cols}, [bytes](void* q) { pool_give(q, bytes); },
                          opts.dtype(torch::kFloat32));
}

constexpr int64_t ROWS_PER_TASK = 16;

// Work items [0, n) taken by the threads in turn from a shared counter, each run as
// fn(i): a thread that runs slower (another process on its core, the server's own threads
// on a 2-core machine) takes fewer items instead of holding the step at the join, as a
// fixed half each did. An item's result does not depend on which thread computes it.
template <typename F>
void items_for(int64_t n, const F& fn) {
  const int64_t T = std::max<int64_t>(1, at::get_num_threads());
  if (n <= 1 || T == 1 || at::in_parallel_region()) {
    for (int64_t i = 0; i < n; ++i) fn(i);
    return;
  }
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min(T, n), 1, [&](int64_t, int64_t) {
    for (int64_t i = next.fetch_add(1); i < n; i = next.fetch_add(1)) fn(i);
  });
}

// Row blocks a work item of a weight with `blocks` row blocks: ITEMS_PER_THREAD items per
// thread (fine enough that a thread slowed to half its speed costs the step ~1/16 more
// rather than up to 2x), at least one block (on the 1.5B with 2 threads: one ~14 KiB block
// an item for the 16-block k and v parts, 6 blocks / 83 KiB and more for the rest).
constexpr int64_t ITEMS_PER_THREAD = 8;
inline int64_t item_blocks(int64_t blocks) {
  const int64_t T = std::max<int64_t>(1, at::get_num_threads());
  return std::max<int64_t>(1, (blocks + ITEMS_PER_THREAD * T - 1) / (ITEMS_PER_THREAD * T));
}

// The row blocks [0, blocks[p]) of every part p (one weight, or a stack of them) split
// across the threads, each range run as fn(p, b0, b1). Many-row steps (`shared`) cut them
// into items of item_blocks(blocks[p]) blocks taken from a shared counter (items_for).
// A decode-sized step reads each weight once, in microseconds on a small model: there each
// thread takes the same fixed share of every part, [b t / T, b (t + 1) / T), one sequential
// stream a part. Items cost such steps 20-30% (SmolLM2's batch-1 decode: every item
// restarts the hardware prefetcher on a new stream and fetches a counter line from the
// other core) and measured no gain beside a busy process, where they help prefill.
template <typename F>
void block_items(const std::vector<int64_t>& blocks, bool shared, const F& fn) {
  const size_t P = blocks.size();
  if (!shared) {   // inside a parallel region parallel_for runs the T shares inline
    const int64_t T = std::max<int64_t>(1, at::get_num_threads());
    at::parallel_for(0, T, 1, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t)
        for (size_t p = 0; p < P; ++p) {
          const int64_t b0 = blocks[p] * t / T, b1 = blocks[p] * (t + 1) / T;
          if (b0 < b1) fn(p, b0, b1);
        }
    });
    return;
  }
  std::vector<int64_t> per(P), first(P + 1, 0);
  for (size_t p = 0; p < P; ++p) {
    per[p] = item_blocks(blocks[p]);
    first[p + 1] = first[p] + (blocks[p] + per[p] - 1) / per[p];
  }
  items_for(first[P], [&](int64_t item) {
    size_t p = 0;
    while (item >= first[p + 1]) ++p;
    const int64_t b0 = (item - first[p]) * per[p];
    fn(p, b0, std::min(blocks[p], b0 + per[p]));
  });
}
// Activation rows run in passes of at most `most` rows (the kernels' register budget: 8 for
// q4, q4k, q6 and q8g, whose weight vectors then unpack once for up to 8 rows; 4 for q8 and
// f32), full passes while that many rows are left, then one pass of the rest (a step of 5-7
// rows is one pass, not 4 + 1..3 that read the weights twice). With more than one pass each
// thread walks its weight rows in tiles of about TILE_BYTES and runs every pass on a tile
// before the next, so passes after the first read the weights from L2 instead of DRAM (a
// fifth row used to cost another full read of the thread's half of the matrix). Every
// output is the same block computation whatever the passes: results do not change.
constexpr int64_t TILE_BYTES = 64 * 1024;
constexpr int64_t PASS_ROWS = 4, WIDE_PASS_ROWS = 8;

// Calls pass(t0, t1, m0, mm) for tiles [t0, t1) of [b0, b1) (units of `unit_bytes`) and
// passes of up to `most` rows, tile by tile.
template <typename F>
inline void tiled_passes(int64_t b0, int64_t b1, int64_t unit_bytes, int64_t M, F&& pass,
                         int64_t most = PASS_ROWS) {
  const int64_t tile = M <= most ? b1 - b0 : std::max<int64_t>(1, TILE_BYTES / unit_bytes);
  for (int64_t t0 = b0; t0 < b1; t0 += tile)
    for (int64_t m0 = 0; m0 < M;) {
      const int64_t mm = std::min(most, M - m0);
      pass(t0, std::min(b1, t0 + tile), m0, mm);
      m0 += mm;
    }
}

}  // namespace

// The Tiles view of a packed [tiles, row blocks, tu, block] weight of K columns (units of
// `cols`); the row blocks of a tile are contiguous, the tiles may be apart (a row prefix).
Tiles tiles_of(const torch::Tensor& packed, int64_t K, int64_t cols, int64_t block) {
  TORCH_CHECK(packed.scalar_type() == torch::kUInt8 && packed.dim() == 4 &&
              packed.size(3) == block && packed.stride(3) == 1 && packed.stride(2) == block &&
              packed.stride(1) == packed.size(2) * block,
              "packed: uint8 [tiles, row blocks, units a tile, ", block, "], tiles apart");
  const int64_t units = (K + cols - 1) / cols, tu = packed.size(2);
  TORCH_CHECK(K % G == 0 && tu > 0 && packed.size(0) == (units + tu - 1) / tu,
              "K = ", K, " does not match the packed weight's tiles");
  return Tiles{packed.data_ptr<uint8_t>(), packed.stride(0), tu, units, block};
}

namespace {

// A packed form: its column unit, block bytes, activation order, rows function and the
// most activation rows a pass takes.
using RowsFn = void (*)(const Tiles&, const QuantizedX&, float*, int64_t, int64_t, int64_t,
                        int64_t, int64_t);
struct Form {
  int64_t cols, block;
  int order;
  RowsFn rows;
  int64_t pass_rows;
  int unpack;   // how unpacked_rows takes its many-row steps (VNNI); NO_UNPACK: by passes
};

// Steps of more rows than this unpack a form's weight tiles into records (unpacked_rows);
// up to it they run tiled passes of the form's rows function. The unpacking pays off only
// over many rows: on a Zen 5 passes took 0.45-0.7x the records' time at 9-16 rows and
// 0.8-0.9x at 64 (the 1.5B's and SmolLM2's layers; the same sums either way), while on a
// Zen 4 records ran 1.3-1.4x the passes' speed at 512 rows (docs/results.md).
constexpr int64_t RECORD_ROWS = 64;

// Whether a step of M rows in form f runs as a many-row step: by records, and with its
// row blocks split as shared items (block_items).
inline bool many_rows(const Form& f, int64_t M) {
  return M > (f.unpack != NO_UNPACK ? RECORD_ROWS : f.pass_rows);
}
const Form Q4_FORM{G, Q4_BLOCK, GROUPED, q4_rows, WIDE_PASS_ROWS, UNPACK_Q4};
const Form Q4K_FORM{256, Q4K_BLOCK, GROUPED, q4k_rows, WIDE_PASS_ROWS, UNPACK_Q4K};
const Form Q6_FORM{CH * G, Q6_BLOCK, GROUPED, q6_rows, WIDE_PASS_ROWS, UNPACK_Q6};
const Form Q8G_FORM{G, Q8G_BLOCK, GROUPED, q8g_rows, WIDE_PASS_ROWS, NO_UNPACK};

// Blocks [b0, b1) of a weight in form f against all M rows of X: by tiles of records
// (unpacked_rows) when the form has them and the step is a many-row one (many_rows), else
// by tiled_passes over the form's rows function.
void form_rows(const Form& f, const Tiles& W, const QuantizedX& X, float* y, int64_t N,
               int64_t b0, int64_t b1, int64_t M) {
#if defined(DUET_VNNI)
  if (f.unpack != NO_UNPACK && many_rows(f, M)) {
    const int64_t tile = std::max<int64_t>(1, TILE_BYTES / (W.units * f.block));
    for (int64_t t0 = b0; t0 < b1; t0 += tile)
      unpacked_rows(f.unpack, W, X, y, N, t0, std::min(b1, t0 + tile), M);
    return;
  }
#endif
  tiled_passes(b0, b1, W.units * f.block, M, [&](int64_t t0, int64_t t1, int64_t m0,
                                                  int64_t mm) {
    f.rows(W, X, y, N, t0, t1, m0, mm);
  }, f.pass_rows);
}

// The form of a packed weight of K columns, told apart by its block size (320 q4, 576
// q4k, 424 q6); `want`, when given, is the only form accepted.
Form form_of(const torch::Tensor& packed, int64_t K, const Form* want = nullptr) {
  TORCH_CHECK(packed.dim() == 4, "packed: uint8 [tiles, row blocks, units a tile, block]");
  const int64_t b = packed.size(3);
  TORCH_CHECK(b == Q4_BLOCK || b == Q4K_BLOCK || b == Q6_BLOCK || b == Q8G_BLOCK,
              "packed blocks of ", Q4_BLOCK, " (q4), ", Q4K_BLOCK, " (q4k), ", Q6_BLOCK,
              " (q6) or ", Q8G_BLOCK, " (q8g) bytes, got ", b);
  TORCH_CHECK(want == nullptr || b == want->block, "expected packed blocks of ", want->block,
              " bytes, got ", b);
  if (b == Q4_BLOCK) return Q4_FORM;
  if (b == Q8G_BLOCK) return Q8G_FORM;
  if (b == Q4K_BLOCK) {     // whole Q4_K blocks of 256 (the loader packs no others)
    TORCH_CHECK(K % 256 == 0, "q4k: K must be a multiple of 256");
    return Q4K_FORM;
  }
  TORCH_CHECK(K % 128 == 0, "q6: K must be a multiple of 128");
  return Q6_FORM;
}

// x [M, K] float32 against a weight packed in blocks of 4 rows (tiles_of) in its form
// (`want` when given, else told by the block size; K padded up to the column units):
// activations quantized once, row blocks split across threads.
torch::Tensor packed_gemv(torch::Tensor x, const torch::Tensor& packed, int64_t N,
                          const Form* want) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, "x must be float32 [M, K]");
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1);
  const Form f = form_of(packed, K, want);
  const Tiles W = tiles_of(packed, K, f.cols, f.block);
  TORCH_CHECK(packed.size(1) == (N + ROWS - 1) / ROWS, "N = ", N,
              " does not match the packed weight");
  auto y = pooled_empty(M, N, x.options());
  const QuantizedX X = quantize_x(x.data_ptr<float>(), M, K, f.order, CH);
  float* yp = y.data_ptr<float>();
  block_items({packed.size(1)}, many_rows(f, M), [&](size_t, int64_t b0, int64_t b1) {
    form_rows(f, W, X, yp, N, b0, b1, M);
  });
  return y;
}

}  // namespace

torch::Tensor q4_gemv(torch::Tensor x, torch::Tensor packed, int64_t N) {
  return packed_gemv(x, packed, N, &Q4_FORM);
}

torch::Tensor q4k_gemv(torch::Tensor x, torch::Tensor packed, int64_t N) {
  return packed_gemv(x, packed, N, &Q4K_FORM);
}

torch::Tensor q6_gemv(torch::Tensor x, torch::Tensor packed, int64_t N) {
  return packed_gemv(x, packed, N, &Q6_FORM);
}

torch::Tensor q8g_gemv(torch::Tensor x, torch::Tensor packed, int64_t N) {
  return packed_gemv(x, packed, N, &Q8G_FORM);
}

torch::Tensor lowbit_gemv(torch::Tensor x, torch::Tensor packed, int64_t N) {
  return packed_gemv(x, packed, N, nullptr);
}

// x [M, K] against weights stacked along N, each part in its own packed form (a qkv whose
// q and k are Q4_K and v Q6_K): one parallel region for all parts, the activations
// quantized once per order they need. Returns [M, sum of n] float32: each part's rows as
// its own GEMV computes them.
torch::Tensor stacked_gemv(torch::Tensor x, std::vector<torch::Tensor> packed,
                           std::vector<int64_t> n) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, "x must be float32 [M, K]");
  TORCH_CHECK(!packed.empty() && packed.size() == n.size(), "one N per packed part");
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1);
  const size_t P = packed.size();
  std::vector<Form> forms;
  std::vector<Tiles> tiles;
  std::vector<torch::Tensor> ys;
  std::vector<int64_t> blocks(P);
  QuantizedX xq[2];
  bool quantized[2] = {false, false};
  for (size_t i = 0; i < P; ++i) {
    const Form f = form_of(packed[i], K);
    const Tiles W = tiles_of(packed[i], K, f.cols, f.block);
    TORCH_CHECK(packed[i].size(1) == (n[i] + ROWS - 1) / ROWS, "N = ", n[i],
                " does not match packed part ", i);
    if (!quantized[f.order]) {
      xq[f.order] = quantize_x(x.data_ptr<float>(), M, K, f.order, CH);
      quantized[f.order] = true;
    }
    forms.push_back(f);
    tiles.push_back(W);
    // one row: the parts' outputs are slices of one [1, sum n] tensor (no copy after)
    ys.push_back(M == 1 ? torch::Tensor() : pooled_empty(M, n[i], x.options()));
    blocks[i] = packed[i].size(1);
  }
  int64_t total_n = 0;
  for (int64_t ni : n) total_n += ni;
  torch::Tensor out = M == 1 ? torch::empty({1, total_n}, x.options()) : torch::Tensor();
  for (size_t i = 0, at = 0; M == 1 && i < P; at += n[i], ++i) ys[i] = out.narrow(1, at, n[i]);
  // Every part's row blocks as items (many rows): a part's kernel may be slower per byte
  // than another's (q6 than q4k), and the shared counter evens that out too.
  bool many = false;
  for (const Form& f : forms) many = many || many_rows(f, M);
  block_items(blocks, many, [&](size_t i, int64_t b0, int64_t b1) {
    form_rows(forms[i], tiles[i], xq[forms[i].order], ys[i].data_ptr<float>(), n[i], b0, b1, M);
  });
  return M == 1 ? out : torch::cat(ys, 1);
}

torch::Tensor q8_gemv(torch::Tensor x, torch::Tensor packed, torch::Tensor scale) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, "x must be float32 [M, K]");
  TORCH_CHECK(packed.scalar_type() == torch::kInt8 && packed.is_contiguous() &&
              packed.dim() == 3 && packed.size(2) == Q8_BLOCK,
              "packed: int8 [ceil(N/4), ceil(K/64), 256]");
  TORCH_CHECK(scale.scalar_type() == torch::kFloat32 && scale.is_contiguous(), "scale: float32");
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = scale.size(0), npairs = packed.size(1);
  TORCH_CHECK(K % G == 0 && npairs == (K + 63) / 64 && packed.size(0) == (N + 3) / 4,
              "shape mismatch (K must be a multiple of 32)");
  auto y = torch::empty({M, N}, x.options());
  const QuantizedX X = quantize_x(x.data_ptr<float>(), M, K, PLAIN, 2);
  const int8_t* pp = packed.data_ptr<int8_t>();
  const float* sp = scale.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, packed.size(0), ROWS_PER_TASK / 4, [&](int64_t b0, int64_t b1) {
    tiled_passes(b0, b1, npairs * Q8_BLOCK, M, [&](int64_t t0, int64_t t1, int64_t m0, int64_t mm) {
      q8_rows(pp, sp, X, yp, npairs, N, t0, t1, m0, mm);
    });
  });
  return y;
}

// x [M, K] float32 @ w [N, K] float32 ^T -> [M, N] float32, for few rows (decode steps of
// dense float32 models).
torch::Tensor f32_gemv(torch::Tensor x, torch::Tensor w) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, "x must be float32 [M, K]");
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kFloat32 && w.is_contiguous(),
              "w: contiguous float32 [N, K]");
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(w.size(1) == K, "shape mismatch");
  auto y = torch::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, N, ROWS_PER_TASK, [&](int64_t n0, int64_t n1) {
    tiled_passes(n0, n1, K * 4, M, [&](int64_t t0, int64_t t1, int64_t m0, int64_t mm) {
      f32_rows(wp, xp, yp, K, N, t0, t1, m0, mm);
    });
  });
  return y;
}

#if defined(__AVX512F__)
// Elements 16 h .. 16 h + 15 of a group's 32 values, from lo (lane 4v + j: element 8v + j)
// and hi (lane 4v + j: element 8v + 4 + j), the order of the packed nibbles.
inline __m512 group_half(__m512 lo, __m512 hi, int h) {
  const __m512i i0 = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i i1 = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  return _mm512_permutex2var_ps(lo, h == 0 ? i0 : i1, hi);
}

// The group in element order as float32 ...
inline void store_group(__m512 lo, __m512 hi, float* o) {
  _mm512_storeu_ps(o, group_half(lo, hi, 0));
  _mm512_storeu_ps(o + 16, group_half(lo, hi, 1));
}

// ... or as bf16 (round to nearest even, as at::BFloat16 rounds)
inline void store_group(__m512 lo, __m512 hi, at::BFloat16* o) {
#if defined(__AVX512BF16__) && defined(__AVX512VL__)
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(o),
                      (__m256i)_mm512_cvtneps_pbh(group_half(lo, hi, 0)));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + 16),
                      (__m256i)_mm512_cvtneps_pbh(group_half(lo, hi, 1)));
#else
  alignas(64) float f[32];
  store_group(lo, hi, f);
  for (int k = 0; k < 32; ++k) o[k] = at::BFloat16(f[k]);
#endif
}
#endif

// One row's group of a q4 / q4k unit (p: the row's dword in the group's first nibble
// vector; byte 64 v + j: elements 8v + j low, 8v + 4 + j high) -> d * q + m as T (float
// or at::BFloat16).
template <typename T>
inline void group_dequant(const uint8_t* p, float dv, float mv, T* o) {
#if defined(__AVX512F__)
  int32_t w[4];   // byte 4v + j: element 8v + j (low nibble), 8v + 4 + j (high)
  for (int v = 0; v < 4; ++v) std::memcpy(&w[v], p + v * 64, 4);
  const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w)));
  const __m512 dv16 = _mm512_set1_ps(dv), mv16 = _mm512_set1_ps(mv);
  const __m512 ql = _mm512_cvtepi32_ps(_mm512_and_si512(q, _mm512_set1_epi32(15)));
  const __m512 qh = _mm512_cvtepi32_ps(_mm512_srli_epi32(q, 4));
  if constexpr (std::is_same<T, float>::value) {   // q * d, then + m: the torch path's
    store_group(_mm512_add_ps(_mm512_mul_ps(ql, dv16), mv16),      // float32, bit for bit
                _mm512_add_ps(_mm512_mul_ps(qh, dv16), mv16), o);
  } else {                                         // rounded to bf16 anyway
    store_group(_mm512_fmadd_ps(ql, dv16, mv16), _mm512_fmadd_ps(qh, dv16, mv16), o);
  }
#else
  for (int k = 0; k < G; ++k) {
    const uint8_t b = p[(k / 8) * 64 + k % 4];
    o[k] = T(dv * float((k % 8) < 4 ? (b & 15) : (b >> 4)) + mv);
  }
#endif
}

namespace {

// Row dequantizers: row r of row block nb of a packed weight, column units [u0, u1), as T
// (float or at::BFloat16) at o (o[0]: the first column of unit u0). The many-row paths
// (packed_dequant; amx_gemm) call them a row and a span of units at a time.
#if defined(DUET_AMX)
// Tile row 4v + t of a q4-order group: its two elements' nibbles are at these bit shifts of
// the row's dword in vector v (bytes 0-1 (t = 0) or 2-3 (t = 1) low, the same high (2, 3)).
constexpr int NIB_SHIFT[4][2] = {{0, 8}, {16, 24}, {4, 12}, {20, 28}};

// One B tile row: f0, f1 (the pair's first and second element of 16 rows) as bf16 pairs,
// dword r = (f0[r], f1[r]), rounded to nearest even.
inline void store_bf16_pairs(at::BFloat16* dst, __m512 f0, __m512 f1) {
  // words 2i, 2i + 1: word i (f0) and 16 + i (f1) of cvtne2ps
  const __m512i pairs = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25,
                                         9, 24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2,
                                         17, 1, 16, 0);
  _mm512_storeu_si512(dst, _mm512_permutexvar_epi16(pairs, (__m512i)_mm512_cvtne2ps_pbh(f1, f0)));
}

// A q4-order group of 16 rows (nib: 4 vectors of 64 bytes; vector v, dword r, byte j:
// element 8v + j of row r low, 8v + 4 + j high) -> d * q + m as one AMX B tile (512 bf16:
// tile row p, dword r = row r's elements 2p, 2p + 1), rounded as group_dequant rounds.
// The lanes are already the rows: no transposition.
inline void q4_group_tile(const uint8_t* nib, __m512 d, __m512 m, at::BFloat16* tile) {
  const __m512i low4 = _mm512_set1_epi32(15);
  for (int v = 0; v < 4; ++v) {
    const __m512i q = _mm512_loadu_si512(nib + v * 64);
    for (int t = 0; t < 4; ++t) {
      __m512 f[2];
      for (int e = 0; e < 2; ++e)
        f[e] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(
            _mm512_srli_epi32(q, NIB_SHIFT[t][e]), low4)), d, m);
      store_bf16_pairs(tile + (4 * v + t) * 32, f[0], f[1]);
    }
  }
}

inline __m512 half16(const uint8_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
#endif

struct Q4Row {
  static constexpr int64_t cols = G, block = Q4_BLOCK;
#if defined(DUET_AMX)
  static constexpr bool direct = true;
  // row block nb, units [u0, u1) as B tiles (one a group) at out
  void tiles(const Tiles& W, int64_t nb, int64_t u0, int64_t u1, at::BFloat16* out) const {
    for (int64_t g = u0; g < u1; ++g) {
      const uint8_t* blk = W.at(nb, g);
      q4_group_tile(blk, half16(blk + 256), half16(blk + 288), out + (g - u0) * 512);
    }
  }
#endif
  template <typename T>
  void operator()(const Tiles& W, int64_t nb, int r, int64_t u0, int64_t u1, T* o) const {
    for (int64_t g = u0; g < u1; ++g) {
      const uint8_t* blk = W.at(nb, g);
      const float dv = half_to_float(reinterpret_cast<const uint16_t*>(blk + 256)[r]);
      const float mv = half_to_float(reinterpret_cast<const uint16_t*>(blk + 288)[r]);
      group_dequant(blk + r * 4, dv, mv, o + (g - u0) * G);
    }
  }
};

struct Q4KRow {
  static constexpr int64_t cols = 256, block = Q4K_BLOCK;
#if defined(DUET_AMX)
  static constexpr bool direct = true;
  void tiles(const Tiles& W, int64_t nb, int64_t u0, int64_t u1, at::BFloat16* out) const {
    for (int64_t s = u0; s < u1; ++s) {
      const uint8_t* blk = W.at(nb, s);
      const __m512 dd = half16(blk + Q4K_D), dmin = half16(blk + Q4K_D + 32);
      for (int g4 = 0; g4 < 4; ++g4) {
        alignas(64) int32_t words[16];      // row r's codes of groups g4 and 4 + g4
        const uint8_t* c = blk + Q4K_CODES + 48 * g4;
        for (int r = 0; r < ROWS; ++r)
          words[r] = c[3 * r] | c[3 * r + 1] << 8 | c[3 * r + 2] << 16;
        const __m512i w = _mm512_load_si512(words);
        for (int h = 0; h < 2; ++h) {     // as q4k_dm: d * sc, -(dmin * mn)
          const __m512i six = _mm512_set1_epi32(63);
          const __m512 sc = _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(w, 6 * h), six));
          const __m512 mn = _mm512_cvtepi32_ps(
              _mm512_and_si512(_mm512_srli_epi32(w, 12 + 6 * h), six));
          const int gl = 4 * h + g4;
          q4_group_tile(blk + gl * 256, _mm512_mul_ps(dd, sc),
                        _mm512_sub_ps(_mm512_setzero_ps(), _mm512_mul_ps(dmin, mn)),
                        out + ((s - u0) * 8 + gl) * 512);
        }
      }
    }
  }
#endif
  template <typename T>
  void operator()(const Tiles& W, int64_t nb, int r, int64_t u0, int64_t u1, T* o) const {
    for (int64_t s = u0; s < u1; ++s) {
      const uint8_t* blk = W.at(nb, s);
      for (int gl = 0; gl < 8; ++gl) {
        float dv, mv;
        q4k_dm(blk, r, gl, &dv, &mv);
        group_dequant(blk + gl * 256 + r * 4, dv, mv, o + ((s - u0) * 8 + gl) * G);
      }
    }
  }
};

struct Q6Row {
  static constexpr int64_t cols = CH * G, block = Q6_BLOCK;
#if defined(DUET_AMX)
  static constexpr bool direct = true;
  // As q4_group_tile, each element's 6-bit q = its nibble | its top two bits << 4 (bits
  // 8 j + 2 k of top vector v / 2, j = element % 4, k = element % 16 / 4), times d * sc
  // of its half (vectors 0-1: elements 0-15), as Q6Row's rows round.
  void tiles(const Tiles& W, int64_t nb, int64_t u0, int64_t u1, at::BFloat16* out) const {
    const __m512i low4 = _mm512_set1_epi32(15), three = _mm512_set1_epi32(3);
    const __m512i off = _mm512_set1_epi32(32);
    constexpr int j0[4] = {0, 2, 0, 2};
    for (int64_t c = u0; c < u1; ++c) {
      const uint8_t* blk = W.at(nb, c);
      const __m512 d = half16(blk + Q6_D);
      for (int gi = 0; gi < CH; ++gi) {
        const uint8_t* grp = blk + gi * Q6_GROUP;
        at::BFloat16* tile = out + ((c - u0) * CH + gi) * 512;
        for (int v = 0; v < 4; ++v) {
          const int h = v / 2;
          const __m512 sc = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
              _mm_loadu_si128(reinterpret_cast<const __m128i*>(grp + Q6_SC + 16 * h)))));
          const __m512i q = _mm512_loadu_si512(grp + v * 64);
          const __m512i top = _mm512_loadu_si512(grp + Q6_TOP + h * 64);
          for (int t = 0; t < 4; ++t) {
            const int k = 2 * (v % 2) + (t >= 2);
            __m512 f[2];
            for (int e = 0; e < 2; ++e) {
              const __m512i nib = _mm512_and_si512(_mm512_srli_epi32(q, NIB_SHIFT[t][e]), low4);
              const __m512i hi = _mm512_and_si512(
                  _mm512_srli_epi32(top, 8 * (j0[t] + e) + 2 * k), three);
              const __m512i q6 = _mm512_or_si512(nib, _mm512_slli_epi32(hi, 4));
              f[e] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(q6, off)), sc);
            }
            store_bf16_pairs(tile + (4 * v + t) * 32, f[0], f[1]);
          }
        }
      }
    }
  }
#endif
  template <typename T>
  void operator()(const Tiles& W, int64_t nb, int r, int64_t u0, int64_t u1, T* orow) const {
    for (int64_t c = u0; c < u1; ++c) {
      const uint8_t* blk = W.at(nb, c);
      for (int gi = 0; gi < CH; ++gi) {
        const uint8_t* grp = blk + gi * Q6_GROUP;
        T* o = orow + ((c - u0) * CH + gi) * G;
#if defined(__AVX512F__)
        int32_t nw[4], tw[4] = {0, 0, 0, 0};   // byte 4v + j: the row's nibbles / tops
        for (int v = 0; v < 4; ++v) std::memcpy(&nw[v], grp + v * 64 + r * 4, 4);
        for (int u = 0; u < 2; ++u) std::memcpy(&tw[u], grp + Q6_TOP + u * 64 + r * 4, 4);
        const __m512i nib = _mm512_cvtepu8_epi32(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(nw)));
        const __m512i tb = _mm512_cvtepu8_epi32(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(tw)));
        // lane 4v + j: the low nibble is element 8v + j (t = 2v), the high one 8v + 4 + j
        // (t = 2v + 1); their tops are in byte 4 (t / 4) + j = 4 (v / 2) + j, at bits
        // 2 (t % 4) = 4 (v % 2) and 4 (v % 2) + 2
        const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13,
                                               14, 15);
        const __m512i v = _mm512_srli_epi32(lane, 2);
        const __m512i at = _mm512_add_epi32(_mm512_slli_epi32(_mm512_srli_epi32(v, 1), 2),
                                            _mm512_and_si512(lane, _mm512_set1_epi32(3)));
        const __m512i tops = _mm512_permutexvar_epi32(at, tb);
        const __m512i sh = _mm512_slli_epi32(_mm512_and_si512(v, _mm512_set1_epi32(1)), 2);
        const __m512i three = _mm512_set1_epi32(3), off = _mm512_set1_epi32(32);
        const __m512i qlo = _mm512_or_si512(_mm512_and_si512(nib, _mm512_set1_epi32(15)),
            _mm512_slli_epi32(_mm512_and_si512(_mm512_srlv_epi32(tops, sh), three), 4));
        const __m512i qhi = _mm512_or_si512(_mm512_srli_epi32(nib, 4), _mm512_slli_epi32(
            _mm512_and_si512(_mm512_srlv_epi32(tops, _mm512_add_epi32(sh, _mm512_set1_epi32(2))),
                             three), 4));
        // lanes 0-7 (v < 2: elements 0-15) take half 0's scale, 8-15 half 1's
        const __m512 sc = _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(q6_scale(blk, grp, r, 0)),
                                               _mm512_set1_ps(q6_scale(blk, grp, r, 16)));
        const __m512 lo = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(qlo, off)), sc);
        const __m512 hi = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(qhi, off)), sc);
        store_group(lo, hi, o);
#else
        for (int k = 0; k < 32; ++k)
          o[k] = T(q6_scale(blk, grp, r, k) * float(q6_q(grp, r, k) - 32));
#endif
      }
    }
  }
};

struct Q8GRow {
  static constexpr int64_t cols = G, block = Q8G_BLOCK;
  static constexpr bool direct = false;     // rows dequantized, then transposed (amx_pack)
  template <typename T>
  void operator()(const Tiles& W, int64_t nb, int r, int64_t u0, int64_t u1, T* o) const {
    for (int64_t g = u0; g < u1; ++g) {
      const uint8_t* blk = W.at(nb, g);
      const float dv = half_to_float(reinterpret_cast<const uint16_t*>(blk + 512)[r]);
      const float mv = half_to_float(reinterpret_cast<const uint16_t*>(blk + 544)[r]);
      uint8_t u[G];   // the row's group in element order (vector v: elements 4v .. 4v + 3)
      for (int v = 0; v < 8; ++v) std::memcpy(u + 4 * v, blk + v * 64 + r * 4, 4);
      // u * d exact in float32 (8 + 11 bits), so with or without an FMA the sum rounds once
      for (int k = 0; k < G; ++k) o[(g - u0) * G + k] = T(float(u[k]) * dv + mv);
    }
  }
};

// Rows [a, b) of a weight packed in blocks of ROWS rows (tiles_of: [tiles, row blocks, tu,
// block], units of Row::cols columns) as dense T (float or at::BFloat16) [b - a, K], for
// the many-row path without a resident dense copy.
template <typename T, typename Row>
torch::Tensor packed_dequant(const torch::Tensor& packed, int64_t K, int64_t a, int64_t b) {
  if (Row::cols == 256) TORCH_CHECK(K % 256 == 0, "q4k: K must be a multiple of 256");
  if (Row::cols == CH * G) TORCH_CHECK(K % 128 == 0, "q6: K must be a multiple of 128");
  const Tiles W = tiles_of(packed, K, Row::cols, Row::block);
  TORCH_CHECK(0 <= a && a < b && b <= packed.size(1) * ROWS, "row range out of bounds");
  auto out = torch::empty({b - a, K}, packed.options().dtype(
      std::is_same<T, float>::value ? torch::kFloat32 : torch::kBFloat16));
  T* op = out.template data_ptr<T>();
  const Row row;
  at::parallel_for(a, b, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t n = r0; n < r1; ++n)
      row(W, n / ROWS, static_cast<int>(n % ROWS), 0, W.units, op + (n - a) * K);
  });
  return out;
}

#if defined(DUET_AMX)
// Many-row products on AMX (bf16 tiles): y [M, N] = x [M, K] W^T, W dequantized to bf16 a
// chunk at a time into AMX's B-tile layout in L2 (never to memory as a whole) while every
// row of x passes over it.
//
// Tiles: A = 16 rows of x x 32 columns (bf16, 1 KiB each: amx_tile_x, once per call), B =
// 32 columns x 16 weight rows in pairs (tile row p, dword j: W[n0 + j, k0 + 2p .. 2p + 1]),
// C = 16 x 16 float32 of y. A step of 32 rows x 32 weight rows runs four TDPBF16PS on two
// A and two B tiles (tmm4-5 A, tmm6-7 B, tmm0-3 C). A chunk is AMX_CHUNK weight rows x one
// K tile of the packed weight (<= TILE_COLS columns: Tiles), so its bf16 B tiles (<= 1
// MiB) stay in L2 while every 32-row block of x passes over them; C is kept in y across K
// tiles (loaded and stored once per tile). Sizes measured on a 2-core Xeon with AMX (2 MiB
// L2 a core), 512 rows of the 1.5B's gate/up (17920 x 1536): chunks of 256 rows ~1.0 T
// MAC/s, 128 ~0.87, 384 ~0.89; L1 passes of 256 columns against 128 / 512 / 1,024: 0.95
// against 0.83 / 0.81 / 0.67 (8960 x 1536).
constexpr int64_t AMX_CHUNK = 256;      // weight rows (outputs) a chunk: 16 row blocks
constexpr int64_t AMX_MB = 32;          // rows of x a step (two A tiles)
constexpr int64_t AMX_KB = 256;         // columns a pass keeps in L1 (amx_chunk)
constexpr int64_t AMX_PANEL = 3072 * 1024;   // bytes of x a pass over the chunks reads

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Every tile 16 rows x 64 bytes. Loaded at the start of each task: another library on the
// same thread (oneDNN) may have configured its own tiles since.
inline void amx_configure() {
  TileConfig c;
  for (int t = 0; t < 8; ++t) { c.colsb[t] = 64; c.rows[t] = 16; }
  _tile_loadconfig(&c);
}

// 16 rows of 16 dwords -> 16 columns of 16 dwords (r[i] becomes column i).
inline void transpose16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  __m512i u[16];   // 128-bit lane L of u[4 i + c]: column 4 L + c of rows 4 i .. 4 i + 3
  for (int i = 0; i < 4; ++i) {
    u[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int c = 0; c < 4; ++c) {
    const __m512i a = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x44);
    const __m512i b = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xEE);
    const __m512i e = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x44);
    const __m512i f = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xEE);
    r[c] = _mm512_shuffle_i32x4(a, e, 0x88);
    r[4 + c] = _mm512_shuffle_i32x4(a, e, 0xDD);
    r[8 + c] = _mm512_shuffle_i32x4(b, f, 0x88);
    r[12 + c] = _mm512_shuffle_i32x4(b, f, 0xDD);
  }
}

// Per-thread scratch: one row block's rows in bf16 (16 x TILE_COLS) and a chunk's B tiles.
struct AmxScratch {
  std::vector<at::BFloat16> rows, tiles;
};

// Row blocks [nb0, nb1) (of `nblocks`; blocks past it are zero), columns [u0, u1) units ->
// B tiles at `out`: tile (block i, step s) at out + (i * steps + s) * 512.
template <typename Row>
void amx_pack(const Tiles& W, int64_t nb0, int64_t nb1, int64_t nblocks, int64_t u0,
              int64_t u1, int64_t kc, AmxScratch& sc, at::BFloat16* out) {
  const Row row;
  const int64_t steps = kc / 32;
  for (int64_t nb = nb0; nb < nb1; ++nb) {
    at::BFloat16* tiles = out + (nb - nb0) * steps * 512;
    if (nb >= nblocks) {
      std::memset(static_cast<void*>(tiles), 0, steps * 512 * sizeof(at::BFloat16));
      continue;
    }
    if constexpr (Row::direct) {
      row.tiles(W, nb, u0, u1, tiles);
      continue;
    }
    at::BFloat16* rows = sc.rows.data();
    for (int r = 0; r < ROWS; ++r) row(W, nb, r, u0, u1, rows + r * kc);
    for (int64_t s = 0; s < steps; ++s) {
      __m512i v[16];
      for (int r = 0; r < ROWS; ++r)
        v[r] = _mm512_loadu_si512(rows + r * kc + s * 32);
      transpose16(v);     // v[p]: pair p (columns 2p, 2p + 1) of the 16 rows
      for (int p = 0; p < 16; ++p) _mm512_storeu_si512(tiles + s * 512 + p * 32, v[p]);
    }
  }
}

// One chunk: y[:, c0 .. c0 + 32 w) (+)= xb [Mp, K] (bf16) x the chunk's B tiles (w pairs of
// row blocks), K columns [k0, k0 + kc); `accumulate`: y holds the earlier K tiles' sums.
// Each operand tile is 1 KiB for 8,192 MACs, so a step's four loads must not all come from
// L2: per 32 rows of x and AMX_KB columns, the A tiles (16 KiB) and the rows' C (32 x 128
// floats, 16 KiB) stay in L1 while every pair of the chunk passes its B tiles over them.
inline void amx_chunk(const at::BFloat16* xa, int64_t Mp, int64_t K, int64_t k0, int64_t kc,
                      const at::BFloat16* tiles, int64_t pairs, float* y, int64_t ldy,
                      bool accumulate) {
  const int64_t steps = kc / 32;
  for (int64_t m0 = 0; m0 < Mp; m0 += AMX_MB) {
    const at::BFloat16* a0 = xa + (m0 / 16 * (K / 32) + k0 / 32) * 512;
    const at::BFloat16* a1 = a0 + K * 16;
    for (int64_t s0 = 0; s0 < steps; s0 += AMX_KB / 32) {
      const int64_t s1 = std::min(steps, s0 + AMX_KB / 32);
      for (int64_t j = 0; j < pairs; ++j) {
        float* c = y + m0 * ldy + j * 32;
        if (accumulate || s0 > 0) {
          _tile_loadd(0, c, ldy * 4);
          _tile_loadd(1, c + 16, ldy * 4);
          _tile_loadd(2, c + 16 * ldy, ldy * 4);
          _tile_loadd(3, c + 16 * ldy + 16, ldy * 4);
        } else {
          _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
        }
        const at::BFloat16* b0 = tiles + (2 * j) * steps * 512;
        const at::BFloat16* b1 = b0 + steps * 512;
        for (int64_t s = s0; s < s1; ++s) {
          _tile_loadd(4, a0 + s * 512, 64);
          _tile_loadd(5, a1 + s * 512, 64);
          _tile_loadd(6, b0 + s * 512, 64);
          _tile_loadd(7, b1 + s * 512, 64);
          _tile_dpbf16ps(0, 4, 6);
          _tile_dpbf16ps(1, 4, 7);
          _tile_dpbf16ps(2, 5, 6);
          _tile_dpbf16ps(3, 5, 7);
        }
        _tile_stored(0, c, ldy * 4);
        _tile_stored(1, c + 16, ldy * 4);
        _tile_stored(2, c + 16 * ldy, ldy * 4);
        _tile_stored(3, c + 16 * ldy + 16, ldy * 4);
      }
    }
  }
}

// Chunk `ci` of a part (AMX_CHUNK / ROWS row blocks from there, of its `nblocks`, padded
// to pairs) into its columns of y (ldy floats a row), rows [m0, m1) of x (xa:
// amx_tile_x), over every K tile.
template <typename Row>
void amx_part_chunk(const Tiles& W, int64_t nblocks, int64_t ci, const at::BFloat16* xa,
                    int64_t m0, int64_t m1, int64_t K, float* y, int64_t ldy, AmxScratch& sc) {
  const int64_t nb0 = ci * (AMX_CHUNK / ROWS);
  const int64_t nb1 = std::min(nb0 + AMX_CHUNK / ROWS, (nblocks + 1) / 2 * 2);
  for (int64_t t = 0; t < W.ntiles(); ++t) {
    const int64_t u0 = t * W.tu, u1 = W.end(t);
    const int64_t k0 = u0 * Row::cols, kc = std::min(K, u1 * Row::cols) - k0;
    amx_pack<Row>(W, nb0, nb1, nblocks, u0, u1, kc, sc, sc.tiles.data());
    amx_chunk(xa + m0 * K, m1 - m0, K, k0, kc, sc.tiles.data(), (nb1 - nb0) / 2,
              y + m0 * ldy + nb0 * ROWS, ldy, t > 0);
  }
}

// x [M, K] (float32 or bf16) as bf16 A tiles, rows padded with zeros to Mp: tile (row
// block i of 16, step s of 32 columns) is 1 KiB at ((i K / 32) + s) 512, its 16 rows of 64
// bytes in turn, so a tile load reads one contiguous KiB.
torch::Tensor amx_tile_x(const torch::Tensor& x_in, int64_t Mp) {
  const torch::Tensor x = x_in.scalar_type() == torch::kFloat32 ? x_in.contiguous()
                                                                : x_in.to(torch::kFloat32).contiguous();
  const int64_t M = x.size(0), K = x.size(1), steps = K / 32;
  auto xa = torch::empty({Mp * K}, x.options().dtype(torch::kBFloat16));
  const float* xp = x.data_ptr<float>();
  at::BFloat16* out = xa.data_ptr<at::BFloat16>();
  at::parallel_for(0, Mp / 16, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i)
      for (int64_t s = 0; s < steps; ++s) {
        at::BFloat16* t = out + (i * steps + s) * 512;
        for (int r = 0; r < 16; ++r) {
          const int64_t m = i * 16 + r;
          __m512i v = _mm512_setzero_si512();
          if (m < M) {
            const float* src = xp + m * K + s * 32;
            v = (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(src + 16), _mm512_loadu_ps(src));
          }
          _mm512_storeu_si512(t + r * 32, v);
        }
      }
  });
  return xa;
}

bool amx_permitted() {
  // Linux hands out AMX's tile state only on request (once per process).
  static const bool ok = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */,
                                 18 /* XFEATURE_XTILEDATA */) == 0;
  return ok;
}
#endif

}  // namespace

bool amx_available() {
#if defined(DUET_AMX)
  return amx_permitted();
#else
  return false;
#endif
}

// x [M, K] (float32 or bf16) against weights stacked along N, each part in its own packed
// form (q4, q4k, q6, q8g), on AMX bf16 tiles: [M, sum n] float32. Weights and x are
// rounded to bf16 (the dense bf16 path's numbers), sums kept in float32.
torch::Tensor amx_gemm(torch::Tensor x, std::vector<torch::Tensor> packed, std::vector<int64_t> n) {
#if defined(DUET_AMX)
  TORCH_CHECK(amx_permitted(), "AMX: the kernel refused the tile state (arch_prctl)");
  TORCH_CHECK(x.dim() == 2, "x must be [M, K]");
  TORCH_CHECK(!packed.empty() && packed.size() == n.size(), "one N per packed part");
  const int64_t M = x.size(0), K = x.size(1), Mp = (M + AMX_MB - 1) / AMX_MB * AMX_MB;
  TORCH_CHECK(K % 32 == 0, "K must be a multiple of 32");
  const torch::Tensor xa = amx_tile_x(x, Mp);
  const size_t P = packed.size();
  std::vector<int64_t> col(P + 1, 0), nblocks(P), chunks(P + 1, 0);
  std::vector<Tiles> tiles;
  std::vector<int> kind(P);
  int64_t kmax = 0;     // the most columns a K tile has
  for (size_t i = 0; i < P; ++i) {
    const int64_t b = packed[i].size(3);
    kind[i] = b == Q4_BLOCK ? 0 : b == Q4K_BLOCK ? 1 : b == Q6_BLOCK ? 2 : b == Q8G_BLOCK ? 3 : -1;
    TORCH_CHECK(kind[i] >= 0, "packed blocks of ", Q4_BLOCK, ", ", Q4K_BLOCK, ", ", Q6_BLOCK,
                " or ", Q8G_BLOCK, " bytes, got ", b);
    const int64_t cols = kind[i] == 1 ? 256 : kind[i] == 2 ? CH * G : G;
    TORCH_CHECK(K % cols == 0, "K = ", K, " is not a multiple of the form's ", cols, " columns");
    tiles.push_back(tiles_of(packed[i], K, cols, b));
    nblocks[i] = packed[i].size(1);
    TORCH_CHECK(nblocks[i] == (n[i] + ROWS - 1) / ROWS, "N = ", n[i], " does not match packed part ", i);
    col[i + 1] = col[i] + (n[i] + 31) / 32 * 32;     // each part's columns padded to a pair
    chunks[i + 1] = chunks[i] + (nblocks[i] + AMX_CHUNK / ROWS - 1) / (AMX_CHUNK / ROWS);
    kmax = std::max(kmax, std::min(K, tiles[i].tu * cols));
  }
  const int64_t ldy = col[P];
  // Rows of x a pass over the chunks takes: its bf16 K tile (<= AMX_PANEL bytes) stays in
  // L2 while the chunks pass, so each chunk's weights are dequantized once a pass.
  const int64_t mstep = std::max(AMX_MB, std::min(Mp, AMX_PANEL / (kmax * 2) / AMX_MB * AMX_MB));
  auto y = pooled_empty(Mp, ldy, x.options());
  float* yp = y.data_ptr<float>();
  const at::BFloat16* xp = xa.data_ptr<at::BFloat16>();
  at::parallel_for(0, chunks[P], 1, [&](int64_t c0, int64_t c1) {
    thread_local AmxScratch sc;
    if (int64_t(sc.rows.size()) < ROWS * kmax) sc.rows.resize(ROWS * kmax);
    if (int64_t(sc.tiles.size()) < AMX_CHUNK * kmax) sc.tiles.resize(AMX_CHUNK * kmax);
    amx_configure();
    for (int64_t m0 = 0; m0 < Mp; m0 += mstep) {
      const int64_t m1 = std::min(Mp, m0 + mstep);
      for (int64_t c = c0; c < c1; ++c) {
        size_t i = 0;
        while (c >= chunks[i + 1]) ++i;
        const int64_t ci = c - chunks[i];
        float* yi = yp + col[i];
        switch (kind[i]) {
          case 0: amx_part_chunk<Q4Row>(tiles[i], nblocks[i], ci, xp, m0, m1, K, yi, ldy, sc); break;
          case 1: amx_part_chunk<Q4KRow>(tiles[i], nblocks[i], ci, xp, m0, m1, K, yi, ldy, sc); break;
          case 2: amx_part_chunk<Q6Row>(tiles[i], nblocks[i], ci, xp, m0, m1, K, yi, ldy, sc); break;
          default: amx_part_chunk<Q8GRow>(tiles[i], nblocks[i], ci, xp, m0, m1, K, yi, ldy, sc);
        }
      }
    }
    _tile_release();
  });
  bool padded = Mp != M;
  for (size_t i = 0; i < P; ++i) padded = padded || col[i + 1] - col[i] != n[i];
  if (!padded) return y;
  std::vector<torch::Tensor> parts;
  for (size_t i = 0; i < P; ++i) parts.push_back(y.narrow(0, 0, M).narrow(1, col[i], n[i]));
  return torch::cat(parts, 1);
#else
  TORCH_CHECK(false, "amx_gemm: built without AMX (this CPU or compiler lacks amx_tile/amx_bf16)");
  return x;
#endif
}

torch::Tensor q4_dequant_bf16(torch::Tensor packed, int64_t K, int64_t a, int64_t b) {
  return packed_dequant<at::BFloat16, Q4Row>(packed, K, a, b);
}
torch::Tensor q4_dequant_f32(torch::Tensor packed, int64_t K, int64_t a, int64_t b) {
  return packed_dequant<float, Q4Row>(packed, K, a, b);
}
torch::Tensor q4k_dequant_bf16(torch::Tensor packed, int64_t K, int64_t a, int64_t b) {
  return packed_dequant<at::BFloat16, Q4KRow>(packed, K, a, b);
}
torch::Tensor q4k_dequant_f32(torch::Tensor packed, int64_t K, int64_t a, int64_t b) {
  return packed_dequant<float, Q4KRow>(packed, K, a, b);
}
torch::Tensor q6_dequant_bf16(torch::Tensor packed, int64_t K, int64_t a, int64_t b) {
  return packed_dequant<at::BFloat16, Q6Row>(packed, K, a, b);
}
torch::Tensor q6_dequant_f32(torch::Tensor packed, int64_t K, int64_t a, int64_t b) {
  return packed_dequant<float, Q6Row>(packed, K, a, b);
}
torch::Tensor q8g_dequant_bf16(torch::Tensor packed, int64_t K, int64_t a, int64_t b) {
  return packed_dequant<at::BFloat16, Q8GRow>(packed, K, a, b);
}
torch::Tensor q8g_dequant_f32(torch::Tensor packed, int64_t K, int64_t a, int64_t b) {
  return packed_dequant<float, Q8GRow>(packed, K, a, b);
}
