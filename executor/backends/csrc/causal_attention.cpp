// CPU kernel of cann_cpu::causal_attention (schema and use: executor/backends/eager_attention.py).
//
// out = softmax(q k^T * scale + causal mask) v for a bf16 or fp32 prefill from slot 0 (query i sees
// keys 0..i), with grouped-query heads: q (B, Hq, S, D), k and v (B, Hkv, S, D), Hq a multiple of
// Hkv. Returns (B, Hq, S, D) laid out as (B, S, Hq, D), the layout o_proj reads next. Three loops
// share the blocking (run_item): bf16 on AVX512-BF16, fp32 on AVX2 + FMA, and fp32 on AVX-512F
// (`wide`: 64-column blocks, as bf16's) further down.
//
// Why a kernel: PyTorch's CPU flash attention ran a 2048-token Qwen3-0.6B layer (16 query heads,
// 8 KV heads, D = 128) in 127-146 ms in bf16 on the 2-core reference machine, ~120 GFLOP/s, where
// the same machine's bf16 GEMMs run ~420: the causal attention was 40% of the prefill (BENCHMARKS.md,
// "twelfth pass"). This is a flash attention of the same shape as rows_linear.cpp's tiles:
// - K and V of each KV head are packed once per call into the loop's operand layout (bf16: the
//   pairs of AVX512-BF16's vdpbf16ps, 64 output columns; fp32: 16 columns per k step), K as blocks
//   of keys for the scores, V as blocks of output columns for the output;
// - a work item is one KV head's block of query positions, for all G query heads that share it
//   (G x BQ rows), so every packed K/V block loaded feeds G times the rows;
// - per block of keys: the fp32 scores (tiles of 6 rows x the loop's columns), the online softmax
//   in fp32 with a vectorised exp (rows rescaled by exp(old max - new max)), the probabilities in
//   the loop's dtype (rounded to bf16, as a bf16 GEMM's operand is), the output accumulated in fp32;
// - blocks of keys wholly above the diagonal are never computed; in the diagonal block the
//   masked keys get probability 0.
// Scores and probabilities stay in fp32 up to the rounding of p for the second product, as in
// PyTorch's kernel.
//
// The vector code is compiled for AVX-512 or AVX2 per function (target attribute), so the library
// builds with the usual flags on any x86-64 host; causal_attention_supported(dtype) says whether
// this CPU can run a dtype's loop, and the Python side never calls the kernel where it cannot.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define CANN_ATTN 1
#endif

namespace {

constexpr int kRows = 6;           // rows per tile (both loops: 6 x 4 zmm or 6 x 2 ymm accumulators)
constexpr int64_t kKeys = 256;     // keys per block of the online softmax (a multiple of both loops' columns)
constexpr int64_t kTileRows = 64;  // rows (G heads x query positions) per work item, about

// A tile of either product: out[m][0..cols) = (alpha ? out[m][0..cols) * alpha[m] : 0) + a_m . B
// for MB rows of a (row stride lda) against one packed block B over K reduction steps (a step is a
// pair of values in bf16, one in fp32); out fp32, row stride ldo.
// - scores: a = q (K = D / step), B = one block of packed keys, no alpha;
// - output: a = the probabilities (K = keys / step), B = one block of packed columns of V, alpha =
//   the rows' rescaling by the online softmax.
template <typename T>
using TileFn = void (*)(const T*, int64_t, const T*, int64_t, float*, int64_t, const float*);

#ifdef CANN_ATTN
// --- AVX-512: what the bf16 loop and the wide fp32 loop share (64-column blocks) ---
#define CANN_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq")))

// exp(x) for x <= 0 (a score minus its row's max): 2^(x log2 e) split as 2^n 2^f, |f| <= 1/2, with
// 2^f from its degree-6 Taylor polynomial (relative error ~1e-7, below fp32's rounding of the
// scores it is applied to); below -87 the result is flushed towards 0 by the clamp.
CANN_AVX512 inline __m512 exp_ps(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_mul_ps(_mm512_sub_ps(t, n), _mm512_set1_ps(0.693147180559945309f));  // f ln 2
  __m512 p = _mm512_set1_ps(1.0f / 720);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// A 64-column tile's MB x 4 accumulators at its start: zero, or its rows of `out` times alpha (TileFn).
template <int MB>
CANN_AVX512 inline void start_tile(__m512 (&acc)[MB][4], const float* out, int64_t ldo, const float* alpha) {
#pragma GCC unroll 8
  for (int m = 0; m < MB; ++m) {
    const __m512 s = _mm512_set1_ps(alpha ? alpha[m] : 0.0f);
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c)
      acc[m][c] = alpha ? _mm512_mul_ps(_mm512_loadu_ps(out + m * ldo + c * 16), s) : _mm512_setzero_ps();
  }
}

template <int MB>
CANN_AVX512 inline void store_tile(const __m512 (&acc)[MB][4], float* out, int64_t ldo) {
#pragma GCC unroll 8
  for (int m = 0; m < MB; ++m)
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) _mm512_storeu_ps(out + m * ldo + c * 16, acc[m][c]);
}

// The first half of the online softmax of one row over one block of keys (s: fp32 scores, `valid`
// of them, scaled by `scale`): the row's running max moves to the block's; returns the factor the
// row's output and sum are rescaled by, exp(old max - new max).
CANN_AVX512 inline float new_row_max(const float* s, int64_t valid, float scale, float& row_max) {
  const __m512 vscale = _mm512_set1_ps(scale);
  __m512 vmax = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t j = 0; j < valid; j += 16) {
    const __mmask16 k = valid - j >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (valid - j)) - 1);
    vmax = _mm512_mask_max_ps(vmax, k, vmax, _mm512_mul_ps(_mm512_maskz_loadu_ps(k, s + j), vscale));
  }
  const float new_max = std::max(row_max, _mm512_reduce_max_ps(vmax));
  const float alpha = row_max == -std::numeric_limits<float>::infinity() ? 0.0f : std::exp(row_max - new_max);
  row_max = new_max;
  return alpha;
}

// The probabilities of scores s[j, j + 16): exp(s scale - row_max), 0 from `valid` on.
CANN_AVX512 inline __m512 probs16(const float* s, int64_t j, int64_t valid, float scale, float row_max) {
  const int64_t left = valid - j;
  const __mmask16 k = left >= 16 ? 0xFFFF : left <= 0 ? 0 : static_cast<__mmask16>((1u << left) - 1);
  return _mm512_maskz_mov_ps(k, exp_ps(_mm512_fmsub_ps(_mm512_loadu_ps(s + j), _mm512_set1_ps(scale),
                                                       _mm512_set1_ps(row_max))));
}

// --- bf16, AVX512-BF16 ---
#define CANN_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))

// The bf16 tile (TileFn): 64 columns, K2 pairs of the reduction.
template <int MB>
CANN_TARGET inline void dot_tile(const uint16_t* a, int64_t lda, const uint16_t* blk, int64_t K2, float* out,
                                 int64_t ldo, const float* alpha) {
  __m512 acc[MB][4];
  start_tile<MB>(acc, out, ldo, alpha);
  for (int64_t kp = 0; kp < K2; ++kp) {
    const uint16_t* w = blk + kp * 2 * 64;
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(w);
    const __m512bh w1 = (__m512bh)_mm512_loadu_si512(w + 32);
    const __m512bh w2 = (__m512bh)_mm512_loadu_si512(w + 64);
    const __m512bh w3 = (__m512bh)_mm512_loadu_si512(w + 96);
    for (int m = 0; m < MB; ++m) {
      const __m512bh b = (__m512bh)_mm512_set1_epi32(reinterpret_cast<const int32_t*>(a + m * lda)[kp]);
      acc[m][0] = _mm512_dpbf16_ps(acc[m][0], w0, b);
      acc[m][1] = _mm512_dpbf16_ps(acc[m][1], w1, b);
      acc[m][2] = _mm512_dpbf16_ps(acc[m][2], w2, b);
      acc[m][3] = _mm512_dpbf16_ps(acc[m][3], w3, b);
    }
  }
  store_tile<MB>(acc, out, ldo);
}


// The online softmax of one row over one block of keys: s (fp32, `valid` keys of `width` used),
// scaled by `scale`; updates the row's running max and sum, writes the bf16 probabilities to p
// (0 past `valid`, up to `width`) and returns the factor the row's output is rescaled by.
CANN_TARGET inline float softmax_row_bf16(const float* s, int64_t valid, int64_t width, float scale, float& row_max,
                                          float& row_sum, uint16_t* p) {
  const float alpha = new_row_max(s, valid, scale, row_max);
  __m512 vsum = _mm512_setzero_ps();
  for (int64_t j = 0; j < width; j += 16) {
    const __m512 e = probs16(s, j, valid, scale, row_max);
    vsum = _mm512_add_ps(vsum, e);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + j), (__m256i)_mm512_cvtneps_pbh(e));
  }
  row_sum = row_sum * alpha + _mm512_reduce_add_ps(vsum);
  return alpha;
}

// Pack one KV head: K (S, D) -> (T/64, D/2, 64, 2) and V (S, D) -> (D/64, T/2, 64, 2), T = S rounded
// up to 64 keys, the padding zero. Strides in elements (rows of K and V are contiguous).
void pack_kv_bf16(const uint16_t* k, int64_t ks, const uint16_t* v, int64_t vs, int64_t S, int64_t D, int64_t T,
                  uint16_t* kp, uint16_t* vp) {
  constexpr int64_t kCols = 64;
  std::fill(kp, kp + T * D, 0);
  std::fill(vp, vp + T * D, 0);
  for (int64_t j = 0; j < S; ++j) {
    const uint16_t* kr = k + j * ks;
    uint16_t* kb = kp + (j / kCols) * kCols * D + (j % kCols) * 2;
    for (int64_t d = 0; d < D; d += 2) {
      kb[(d / 2) * 2 * kCols] = kr[d];
      kb[(d / 2) * 2 * kCols + 1] = kr[d + 1];
    }
    const uint16_t* vr = v + j * vs;
    for (int64_t d = 0; d < D; ++d) vp[(d / kCols) * T * kCols + (j / 2) * 2 * kCols + (d % kCols) * 2 + j % 2] = vr[d];
  }
}

// One row of the output: the fp32 sums times 1 / the row's softmax sum, rounded to bf16.
CANN_TARGET void store_row_bf16(const float* o, float inv, int64_t D, uint16_t* out) {
  const __m512 vinv = _mm512_set1_ps(inv);
  for (int64_t d = 0; d < D; d += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + d),
                        (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(o + d), vinv)));
}

struct Bf16Loop {
  using T = uint16_t;
  static constexpr int64_t kCols = 64, kStep = 2;  // columns per block, reduction values per step
  static constexpr TileFn<T> kTiles[kRows + 1] = {nullptr,     dot_tile<1>, dot_tile<2>, dot_tile<3>,
                                                  dot_tile<4>, dot_tile<5>, dot_tile<6>};
  static bool runs() { return __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512dq"); }
  static float softmax_row(const float* s, int64_t valid, int64_t width, float scale, float& mx, float& sum, T* p) {
    return softmax_row_bf16(s, valid, width, scale, mx, sum, p);
  }
  static void store_row(const float* o, float inv, int64_t D, T* out) { store_row_bf16(o, inv, D, out); }
  static void pack_kv(const T* k, int64_t ks, const T* v, int64_t vs, int64_t S, int64_t D, int64_t T_, T* kp, T* vp) {
    pack_kv_bf16(k, ks, v, vs, S, D, T_, kp, vp);
  }
};
#undef CANN_TARGET

// --- fp32, AVX2 + FMA (16 ymm registers): 16-column blocks ---
// For fp32 on a CPU without AMX: on an AVX2-only one PyTorch's flash attention ran the fp32 2048-token
// 0.6B layer at ~127 GFLOP/s against ~180 for the rows kernel's GEMMs (BENCHMARKS.md, "sixty-second
// pass"); on Zen 4 (AVX-512) this loop ran the layer in 0.54-0.79x SDPA's time ("sixty-ninth pass"). A tile
// is up to 6 rows x 16 columns, 12 fp32 accumulators, 2 operand registers and one broadcast, as in
// rows_linear.cpp's AVX2 loop; K is packed (T/16, D, 16), V (D/16, T, 16).
#define CANN_AVX2 __attribute__((target("avx2,fma")))

// exp(x) for x <= 0 as exp_ps above, 2^n built in the exponent bits (the clamp keeps n >= -126).
CANN_AVX2 inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  const __m256 t = _mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f));
  const __m256 n = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_mul_ps(_mm256_sub_ps(t, n), _mm256_set1_ps(0.693147180559945309f));
  __m256 p = _mm256_set1_ps(1.0f / 720);
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f / 120));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f / 24));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f / 6));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

CANN_AVX2 inline float reduce8(__m256 v, bool max) {
  __m128 h = max ? _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1))
                 : _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  h = max ? _mm_max_ps(h, _mm_movehl_ps(h, h)) : _mm_add_ps(h, _mm_movehl_ps(h, h));
  h = max ? _mm_max_ss(h, _mm_movehdup_ps(h)) : _mm_add_ss(h, _mm_movehdup_ps(h));
  return _mm_cvtss_f32(h);
}

// The fp32 tile (TileFn): 16 columns, K steps. The unroll pragmas keep the accumulators in
// registers (without them GCC 12 stored them to the stack on every step: rows_linear.cpp).
template <int MB>
CANN_AVX2 inline void dot_tile_f32(const float* a, int64_t lda, const float* blk, int64_t K, float* out, int64_t ldo,
                                   const float* alpha) {
  __m256 acc[MB][2];
#pragma GCC unroll 8
  for (int m = 0; m < MB; ++m) {
    const __m256 s = _mm256_set1_ps(alpha ? alpha[m] : 0.0f);
#pragma GCC unroll 2
    for (int c = 0; c < 2; ++c)
      acc[m][c] = alpha ? _mm256_mul_ps(_mm256_loadu_ps(out + m * ldo + c * 8), s) : _mm256_setzero_ps();
  }
#pragma GCC unroll 4
  for (int64_t k = 0; k < K; ++k) {
    const __m256 w0 = _mm256_loadu_ps(blk + k * 16), w1 = _mm256_loadu_ps(blk + k * 16 + 8);
#pragma GCC unroll 8
    for (int m = 0; m < MB; ++m) {
      const __m256 b = _mm256_broadcast_ss(a + m * lda + k);
      acc[m][0] = _mm256_fmadd_ps(w0, b, acc[m][0]);
      acc[m][1] = _mm256_fmadd_ps(w1, b, acc[m][1]);
    }
  }
#pragma GCC unroll 8
  for (int m = 0; m < MB; ++m)
#pragma GCC unroll 2
    for (int c = 0; c < 2; ++c) _mm256_storeu_ps(out + m * ldo + c * 8, acc[m][c]);
}

// softmax_row_bf16's online softmax with fp32 probabilities; lanes past `valid` by compare masks.
CANN_AVX2 inline float softmax_row_f32(const float* s, int64_t valid, int64_t width, float scale, float& row_max,
                                       float& row_sum, float* p) {
  const __m256 vscale = _mm256_set1_ps(scale), ninf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  __m256 vmax = ninf;
  for (int64_t j = 0; j < valid; j += 8) {
    __m256 v = _mm256_mul_ps(_mm256_loadu_ps(s + j), vscale);
    if (valid - j < 8)
      v = _mm256_blendv_ps(ninf, v, _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(valid - j), lane)));
    vmax = _mm256_max_ps(vmax, v);
  }
  const float new_max = std::max(row_max, reduce8(vmax, true));
  const float alpha = row_max == -std::numeric_limits<float>::infinity() ? 0.0f : std::exp(row_max - new_max);
  const __m256 vnew = _mm256_set1_ps(new_max);
  __m256 vsum = _mm256_setzero_ps();
  for (int64_t j = 0; j < width; j += 8) {
    const int64_t left = valid - j;
    __m256 e = exp8(_mm256_fmsub_ps(_mm256_loadu_ps(s + j), vscale, vnew));
    if (left < 8)  // left <= 0: every lane masked
      e = _mm256_and_ps(e, _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(std::max<int64_t>(left, 0)), lane)));
    vsum = _mm256_add_ps(vsum, e);
    _mm256_storeu_ps(p + j, e);
  }
  row_sum = row_sum * alpha + reduce8(vsum, false);
  row_max = new_max;
  return alpha;
}
#undef CANN_AVX2

// Pack one fp32 KV head for C-column blocks: K (S, D) -> (T/C, D, C), V (S, D) -> (D/C, T, C), the
// padding keys zero.
template <int64_t C>
void pack_kv_f32(const float* k, int64_t ks, const float* v, int64_t vs, int64_t S, int64_t D, int64_t T,
                 float* kp, float* vp) {
  std::fill(kp, kp + T * D, 0.0f);
  std::fill(vp, vp + T * D, 0.0f);
  for (int64_t j = 0; j < S; ++j) {
    float* kb = kp + (j / C) * C * D + j % C;
    for (int64_t d = 0; d < D; ++d) kb[d * C] = k[j * ks + d];
    for (int64_t d = 0; d < D; ++d) vp[(d / C) * T * C + j * C + d % C] = v[j * vs + d];
  }
}

struct F32Loop {
  using T = float;
  static constexpr int64_t kCols = 16, kStep = 1;
  static constexpr TileFn<T> kTiles[kRows + 1] = {nullptr,         dot_tile_f32<1>, dot_tile_f32<2>, dot_tile_f32<3>,
                                                  dot_tile_f32<4>, dot_tile_f32<5>, dot_tile_f32<6>};
  static bool runs() { return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"); }
  static float softmax_row(const float* s, int64_t valid, int64_t width, float scale, float& mx, float& sum, T* p) {
    return softmax_row_f32(s, valid, width, scale, mx, sum, p);
  }
  static void store_row(const float* o, float inv, int64_t D, T* out) {
    for (int64_t d = 0; d < D; ++d) out[d] = o[d] * inv;
  }
  static void pack_kv(const T* k, int64_t ks, const T* v, int64_t vs, int64_t S, int64_t D, int64_t T_, T* kp, T* vp) {
    pack_kv_f32<kCols>(k, ks, v, vs, S, D, T_, kp, vp);
  }
};

// --- fp32, AVX-512F: 64-column blocks (`wide`; taken on a CPU with AMX) ---
// The AVX2 loop above reached ~150 GFLOP/s on the Intel AMX kind at 2048 tokens, about three
// quarters of what 8-wide FMAs can do there, and SDPA ran 80-180. A tile here is up to 6 rows x 64
// columns, as the bf16 loop's: 24 accumulators, 4 operand registers and one broadcast.
template <int MB>
CANN_AVX512 inline void dot_tile_f32x64(const float* a, int64_t lda, const float* blk, int64_t K, float* out,
                                        int64_t ldo, const float* alpha) {
  __m512 acc[MB][4];
  start_tile<MB>(acc, out, ldo, alpha);
#pragma GCC unroll 2
  for (int64_t k = 0; k < K; ++k) {
    const __m512 w0 = _mm512_loadu_ps(blk + k * 64), w1 = _mm512_loadu_ps(blk + k * 64 + 16);
    const __m512 w2 = _mm512_loadu_ps(blk + k * 64 + 32), w3 = _mm512_loadu_ps(blk + k * 64 + 48);
#pragma GCC unroll 8
    for (int m = 0; m < MB; ++m) {
      const __m512 b = _mm512_set1_ps(a[m * lda + k]);
      acc[m][0] = _mm512_fmadd_ps(w0, b, acc[m][0]);
      acc[m][1] = _mm512_fmadd_ps(w1, b, acc[m][1]);
      acc[m][2] = _mm512_fmadd_ps(w2, b, acc[m][2]);
      acc[m][3] = _mm512_fmadd_ps(w3, b, acc[m][3]);
    }
  }
  store_tile<MB>(acc, out, ldo);
}

// softmax_row_bf16's online softmax with fp32 probabilities.
CANN_AVX512 inline float softmax_row_f32x64(const float* s, int64_t valid, int64_t width, float scale,
                                            float& row_max, float& row_sum, float* p) {
  const float alpha = new_row_max(s, valid, scale, row_max);
  __m512 vsum = _mm512_setzero_ps();
  for (int64_t j = 0; j < width; j += 16) {
    const __m512 e = probs16(s, j, valid, scale, row_max);
    vsum = _mm512_add_ps(vsum, e);
    _mm512_storeu_ps(p + j, e);
  }
  row_sum = row_sum * alpha + _mm512_reduce_add_ps(vsum);
  return alpha;
}

struct F32WideLoop : F32Loop {  // F32Loop's row store
  static constexpr int64_t kCols = 64;
  static constexpr TileFn<T> kTiles[kRows + 1] = {
      nullptr, dot_tile_f32x64<1>, dot_tile_f32x64<2>, dot_tile_f32x64<3>, dot_tile_f32x64<4>, dot_tile_f32x64<5>,
      dot_tile_f32x64<6>};
  static bool runs() { return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq"); }
  static float softmax_row(const float* s, int64_t valid, int64_t width, float scale, float& mx, float& sum, T* p) {
    return softmax_row_f32x64(s, valid, width, scale, mx, sum, p);
  }
  static void pack_kv(const T* k, int64_t ks, const T* v, int64_t vs, int64_t S, int64_t D, int64_t T_, T* kp, T* vp) {
    pack_kv_f32<kCols>(k, ks, v, vs, S, D, T_, kp, vp);
  }
};
#undef CANN_AVX512

// One work item: query positions [q0, q1) of the G heads that share one KV head.
template <typename T>
struct Item {
  const T* q;     // head 0 of the group, position 0
  int64_t qs, qh;  // strides: position, head
  const T *kp, *vp;
  T* out;  // (S, Hq, D) rows: head 0 of the group, position 0
  int64_t os, oh;
};

// A thread's buffers for its items, kept from one item to the next. Allocated and zeroed for every
// item, malloc, memset and memmove took 4.3% of the perf samples of a 2048-token fp32 call on the
// wide loop; kept, 3.0% (BENCHMARKS.md, "seventy-eighth pass").
template <typename E>
struct Scratch {
  std::vector<E> q, p;  // the item's query rows; its probabilities
  std::vector<float> scores, out, row_max, row_sum, alpha;
};

// The flash loop of one item, either dtype's loop L (its tiles, softmax and packing).
template <typename L>
void run_item(const Item<typename L::T>& it, int64_t G, int64_t q0, int64_t q1, int64_t D, int64_t T, float scale,
              Scratch<typename L::T>& scratch) {
  using E = typename L::T;
  constexpr int64_t C = L::kCols;
  const int64_t bq = q1 - q0, R = G * bq;
  auto& [qbuf, pbuf, sbuf, obuf, row_max, row_sum, alpha] = scratch;
  qbuf.resize(R * D), pbuf.resize(R * kKeys), sbuf.resize(R * kKeys), alpha.resize(R);
  obuf.assign(R * D, 0.0f);
  row_max.assign(R, -std::numeric_limits<float>::infinity());
  row_sum.assign(R, 0.0f);
  for (int64_t g = 0; g < G; ++g)  // rows g * bq + i: head g, position q0 + i
    for (int64_t i = 0; i < bq; ++i)
      std::copy(it.q + g * it.qh + (q0 + i) * it.qs, it.q + g * it.qh + (q0 + i) * it.qs + D, &qbuf[(g * bq + i) * D]);
  const int64_t end = std::min(T, (q1 + C - 1) / C * C);  // keys past the last position: none
  for (int64_t n0 = 0; n0 < end; n0 += kKeys) {
    const int64_t nk = std::min(kKeys, end - n0);
    for (int64_t nb = 0; nb < nk; nb += C)
      for (int64_t r = 0; r < R; r += kRows) {
        const int mb = static_cast<int>(std::min<int64_t>(kRows, R - r));
        L::kTiles[mb](&qbuf[r * D], D, it.kp + (n0 + nb) * D, D / L::kStep, &sbuf[r * kKeys + nb], kKeys, nullptr);
      }
    for (int64_t r = 0; r < R; ++r) {
      const int64_t valid = std::min(nk, q0 + r % bq + 1 - n0);
      if (valid <= 0) {  // the whole block is after this query: nothing changes
        alpha[r] = 1.0f;
        std::fill(&pbuf[r * kKeys], &pbuf[r * kKeys] + nk, E(0));
        continue;
      }
      alpha[r] = L::softmax_row(&sbuf[r * kKeys], valid, nk, scale, row_max[r], row_sum[r], &pbuf[r * kKeys]);
    }
    for (int64_t db = 0; db < D; db += C)
      for (int64_t r = 0; r < R; r += kRows) {
        const int mb = static_cast<int>(std::min<int64_t>(kRows, R - r));
        L::kTiles[mb](&pbuf[r * kKeys], kKeys, it.vp + db * T + n0 * C, nk / L::kStep, &obuf[r * D + db], D, &alpha[r]);
      }
  }
  for (int64_t r = 0; r < R; ++r)
    L::store_row(&obuf[r * D], 1.0f / row_sum[r], D, it.out + (r / bq) * it.oh + (q0 + r % bq) * it.os);
}

// Every KV head packed, then every item: query blocks of bq positions; item w takes block w of one
// KV head when w is even and the mirrored block counted from the end when odd, so a run of
// consecutive items (one thread's share) mixes early (cheap) and late (costly) positions.
template <typename L>
void run_all(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale, at::Tensor& out) {
  using E = typename L::T;
  const int64_t B = q.size(0), Hq = q.size(1), S = q.size(2), D = q.size(3), Hkv = k.size(1);
  const int64_t G = Hq / Hkv, T = (S + L::kCols - 1) / L::kCols * L::kCols;
  at::Tensor kp = at::empty({B, Hkv, T * D}, q.options()), vp = at::empty({B, Hkv, T * D}, q.options());
  auto in = [](const at::Tensor& t) { return reinterpret_cast<const E*>(t.data_ptr()); };
  auto mut = [](at::Tensor& t) { return reinterpret_cast<E*>(t.data_ptr()); };
  at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / Hkv, h = bh % Hkv;
      L::pack_kv(in(k) + b * k.stride(0) + h * k.stride(1), k.stride(2), in(v) + b * v.stride(0) + h * v.stride(1),
                 v.stride(2), S, D, T, mut(kp) + bh * T * D, mut(vp) + bh * T * D);
    }
  });
  const int64_t bq = std::max<int64_t>(8, kTileRows / G), nq = (S + bq - 1) / bq;
  at::parallel_for(0, B * Hkv * nq, 1, [&](int64_t begin, int64_t end) {
    Scratch<E> scratch;
    for (int64_t w = begin; w < end; ++w) {
      const int64_t bh = w / nq, j = w % nq, b = bh / Hkv, h = bh % Hkv;
      const int64_t blk = j % 2 == 0 ? j / 2 : nq - 1 - j / 2;
      const Item<E> it{in(q) + b * q.stride(0) + h * G * q.stride(1), q.stride(2), q.stride(1),
                       in(kp) + bh * T * D, in(vp) + bh * T * D, mut(out) + b * S * Hq * D + h * G * D, Hq * D, D};
      run_item<L>(it, G, blk * bq, std::min(S, (blk + 1) * bq), D, T, static_cast<float>(scale), scratch);
    }
  });
}
#endif

bool causal_attention_supported(at::ScalarType dtype) {
#ifdef CANN_ATTN
  return dtype == at::kBFloat16 ? Bf16Loop::runs() : dtype == at::kFloat && F32Loop::runs();
#else
  return false;
#endif
}

at::Tensor causal_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale, bool wide) {
  const auto dtype = q.scalar_type();
  TORCH_CHECK(dtype == at::kBFloat16 || dtype == at::kFloat, "causal_attention: q must be bf16 or fp32");
  TORCH_CHECK(k.scalar_type() == dtype && v.scalar_type() == dtype, "causal_attention: q, k and v must share a dtype");
  TORCH_CHECK(causal_attention_supported(dtype), "causal_attention: this CPU cannot run the ", dtype,
              " loop (bf16: AVX512-BF16, fp32: AVX2 and FMA)");
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "causal_attention: q, k, v must be (B, H, S, D)");
  const int64_t B = q.size(0), Hq = q.size(1), S = q.size(2), D = q.size(3), Hkv = k.size(1);
  TORCH_CHECK(k.sizes() == v.sizes() && k.size(0) == B && k.size(2) == S && k.size(3) == D,
              "causal_attention: k and v must be (B, Hkv, S, D) with q's B, S and D");
  TORCH_CHECK(Hkv > 0 && Hq % Hkv == 0, "causal_attention: ", Hq, " query heads are not a multiple of ", Hkv);
  TORCH_CHECK(q.stride(3) == 1 && k.stride(3) == 1 && v.stride(3) == 1, "causal_attention: rows must be contiguous");
  at::Tensor out = at::empty({B, S, Hq, D}, q.options());
#ifdef CANN_ATTN
  TORCH_CHECK(!wide || (dtype == at::kFloat && F32WideLoop::runs()),
              "causal_attention: wide is the fp32 loop on AVX-512F (this call: ", dtype, ", AVX-512F ",
              F32WideLoop::runs() ? "present" : "absent", ")");
  const int64_t cols = dtype == at::kBFloat16 ? Bf16Loop::kCols : wide ? F32WideLoop::kCols : F32Loop::kCols;
  TORCH_CHECK(D % cols == 0, "causal_attention: head_dim ", D, " is not a multiple of ", cols);
  if (dtype == at::kBFloat16)
    run_all<Bf16Loop>(q, k, v, scale, out);
  else if (wide)
    run_all<F32WideLoop>(q, k, v, scale, out);
  else
    run_all<F32Loop>(q, k, v, scale, out);
#else
  TORCH_CHECK(!wide, "causal_attention: wide needs an x86-64 build");
#endif
  return out.permute({0, 2, 1, 3});
}

}  // namespace

TORCH_LIBRARY_IMPL(cann_cpu, CPU, m) { m.impl("causal_attention", causal_attention); }
TORCH_LIBRARY_IMPL(cann_cpu, CompositeExplicitAutograd, m) {
  m.impl("causal_attention_supported", causal_attention_supported);
}
