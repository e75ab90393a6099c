// CPU kernel of cann::decode_attention (schema and fake: executor/custom_ops/decode_attention.py).
//
// Contract of executor.ops.attention: q (B, Hq, S, D); k_cache, v_cache the full static KV cache
// (B, Hkv, T, D); mask (B, 1, S, T) bool, True = masked out; returns (B, Hq, S, D) in q's dtype.
//
// Why a kernel: the masked reference scores all T cache slots, so a decode step at position p
// costs what max_len says. Here each (batch, query row) finds its last unmasked slot L in its
// mask row (once, for all heads) and reads slots [0, L] only (masked slots inside that range are
// skipped), so the cost follows the KV bytes that are valid. The Hq / Hkv query heads that share
// a kv head are done together, so each K and V row is read and widened to fp32 once. Softmax and
// accumulation run in fp32 (inputs fp32, bf16 or fp16). A row with no unmasked slot gives NaN,
// as the reference does.
//
// The loops run on ATen's vector types (cpu_vec.h: AVX-512 or AVX2 where compiled for, plain C++
// elsewhere). Slots go in blocks of 32: a block's K rows, then its V rows, are widened to fp32
// once (fp32 rows are read in place), each query row's dot products read them from L1, and the
// output rows accumulate in registers over the block. Against the first version (per-slot
// widening, the output accumulated in memory) one Qwen3-0.6B-shaped layer took 0.62-0.84x the time
// at batch 1-64 and up to 2k valid slots, bf16 and fp32 (BENCHMARKS.md, "fourteenth pass").
//
// On a CPU with AVX512-BF16 the bf16 scores come from its dot product (vdpbf16ps) on the K rows as
// stored (k_scores_bf16); the V rows are still widened in registers. Every loop but dots_bf16 (which
// read level either way) reads a row's vectors one after another, in address order, and nothing is
// prefetched by hand (the note above fp32_rows says why).

#include "cpu_vec.h"  // first: ATen's vector width

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

#include "x86_sums.h"
#define CANN_ATTN_BF16 1
#define CANN_ATTN_BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))
#endif

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kL = Vec::size();

// Row `src` (n values of T) widened to fp32 into `dst`.
template <typename T>
inline void widen(const T* src, int64_t n, float* dst) {
  if constexpr (std::is_same_v<T, float>) {
    std::memcpy(dst, src, n * sizeof(float));
  } else {
    at::vec::convert(src, dst, n);
  }
}

// Last unmasked slot of a mask row (T bools, stride ms3), or -1. Eight slots per step where the
// row is contiguous: at 16k slots and a 2k position the tail is mostly masked.
int64_t last_valid(const bool* m, int64_t T, int64_t ms3) {
  int64_t t = T;
  if (ms3 == 1) {
    constexpr uint64_t kAll = 0x0101010101010101ull;
    while (t >= 8) {
      uint64_t word;
      std::memcpy(&word, m + t - 8, 8);
      if (word != kAll) break;
      t -= 8;
    }
  }
  while (t > 0 && m[(t - 1) * ms3]) --t;
  return t - 1;
}

// sum(a[0:n] * b[0:n]) in fp32, n a multiple of kL
inline float dot(const float* a, const float* b, int64_t n) {
  Vec acc(0.0f);
  for (int64_t d = 0; d < n; d += kL) acc = at::vec::fmadd(Vec::loadu(a + d), Vec::loadu(b + d), acc);
  return at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, acc);
}

// out[t] = sum(q[0:n] * rows[t * stride : + n]) for t < nb, n a multiple of kL. kDots slots at a
// time on independent accumulators: one dot alone is a chain of n / kL dependent FMAs (16 on AVX2
// at head_dim 128), and chained it ran at the FMA latency, not its throughput. On an AVX2 host one
// Qwen3-0.6B-shaped call (batch 1-16, 40-505 valid slots, cache warm) took 0.82-0.86x (fp32) and
// 0.69-0.75x (bf16) the time of one dot at a time, results bit-identical (BENCHMARKS.md,
// "twenty-second pass").
//
// Each row is read a vector after another, so the loads go in address order (as k_scores_bf16's),
// with q in registers where it fits (512-bit vectors, head_dim up to 128) and read from L1
// otherwise. Against reading the kDots rows a column at a time (q loaded once per column), on
// Zen 4 an fp32 call from memory took 0.89-0.95x the time with q held (8192 slots), and the AVX2
// build on the same CPU 0.78-0.85x with q read from L1 (2048 slots; the AVX2 kind itself, Zen 3,
// unmeasured); results bit-identical (BENCHMARKS.md, "sixty-sixth pass").
//
// With `ahead` (fp32 rows read in place, on an Intel CPU: kv_ahead), each group of kDots rows also
// asks for the K and V rows from two slots on, as many as the group (1 KB past it in each at
// head_dim 128), into L1.
constexpr int kDots = 8;
constexpr int64_t kQHeld = kL == 16 ? 8 : 0;  // vectors of q that dots keeps in registers

// The cache lines of `bytes` from `p` on, asked for into L1.
inline void ask_l1(const void* p, int64_t bytes) {
  for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(static_cast<const char*>(p) + b, 0, 3);
}

// The V rows that a look-ahead over K rows asks for as well: rows `vstride` apart, none at or past
// `rows_left` (counted from the first K row passed). Past them, k_scores_bf16 asks for the first rows
// of the thread's next work item (`next_rows` valid ones of K and V, rows `next_ks` / `next_vs` apart)
// where `next_k` is set: an item's rows end in a gap of the cache (its max_len), so a stream that
// starts cold at every item costs most at a few dozen valid slots (k_scores_bf16's note).
template <typename T>
struct VAhead {
  const T* v;
  int64_t vstride, rows_left;
  const T* next_k = nullptr;
  const T* next_v = nullptr;
  int64_t next_ks = 0, next_vs = 0, next_rows = 0;
};

template <bool kHeld>
inline int64_t dots_rows(const float* q, const float* rows, int64_t stride, int64_t nb, int64_t n, float* out,
                         const VAhead<float>* ahead) {
  Vec qv[kHeld ? kQHeld : 1];
  if constexpr (kHeld)
    for (int64_t d = 0; d < n; d += kL) qv[d / kL] = Vec::loadu(q + d);
  int64_t t = 0;
  for (; t + kDots <= nb; t += kDots) {
    if (ahead != nullptr)
      for (int64_t r = t + 2; r < std::min<int64_t>(t + 2 + kDots, ahead->rows_left); ++r) {
        ask_l1(rows + r * stride, n * 4);
        ask_l1(ahead->v + r * ahead->vstride, n * 4);
      }
    Vec acc[kDots];
#pragma GCC unroll 8
    for (int i = 0; i < kDots; ++i) {
      acc[i] = Vec(0.0f);
      for (int64_t d = 0; d < n; d += kL) {
        const Vec qd = kHeld ? qv[d / kL] : Vec::loadu(q + d);
        acc[i] = at::vec::fmadd(qd, Vec::loadu(rows + (t + i) * stride + d), acc[i]);
      }
    }
#pragma GCC unroll 8
    for (int i = 0; i < kDots; ++i)
      out[t + i] = at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, acc[i]);
  }
  return t;
}

inline void dots(const float* q, const float* rows, int64_t stride, int64_t nb, int64_t n, float* out,
                 const VAhead<float>* ahead = nullptr) {
  int64_t t = n <= kQHeld * kL ? dots_rows<true>(q, rows, stride, nb, n, out, ahead)
                               : dots_rows<false>(q, rows, stride, nb, n, out, ahead);
  for (; t < nb; ++t) out[t] = dot(q, rows + t * stride, n);
}

using IVec = at::vec::Vectorized<int32_t>;

// bf16 read without ATen's conversion (shuffles on AVX2): a 32-bit lane holds two bf16 values, the
// even one becomes fp32 by a shift left of 16 and the odd one by clearing the low half (as
// rows_linear's AVX2 loop does).
inline Vec bf16_even(const IVec& x) { return at::vec::cast<float>(x << IVec(16)); }
inline Vec bf16_odd(const IVec& x) { return at::vec::cast<float>(x & IVec(static_cast<int32_t>(0xFFFF0000u))); }

// `dots` on bf16 rows read in place (bf16_even / bf16_odd). `qe` and `qo` are q's even and odd
// values. n a multiple of 2 * kL. On the AVX2 host a 0.6B-shaped bf16 call took 0.77-0.89x the time
// of widening the block first (with ATen's conversion, or with it inside the dots: 1.03-1.13x
// slower still); BENCHMARKS.md, "twenty-second pass".
inline void dots_bf16(const float* qe, const float* qo, const at::BFloat16* rows, int64_t stride, int64_t nb,
                      int64_t n, float* out) {
  auto row_dots = [&](int64_t t, auto count) {
    constexpr int kN = decltype(count)::value;
    Vec acc[kN];
#pragma GCC unroll 8
    for (int i = 0; i < kN; ++i) acc[i] = Vec(0.0f);
    for (int64_t d = 0; d < n; d += 2 * kL) {
      const Vec e = Vec::loadu(qe + d / 2), o = Vec::loadu(qo + d / 2);
#pragma GCC unroll 8
      for (int i = 0; i < kN; ++i) {
        const IVec x = IVec::loadu(rows + (t + i) * stride + d);
        acc[i] = at::vec::fmadd(o, bf16_odd(x), at::vec::fmadd(e, bf16_even(x), acc[i]));
      }
    }
#pragma GCC unroll 8
    for (int i = 0; i < kN; ++i)
      out[t + i] = at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, acc[i]);
  };
  int64_t t = 0;
  for (; t + kDots <= nb; t += kDots) row_dots(t, std::integral_constant<int, kDots>{});
  for (; t < nb; ++t) row_dots(t, std::integral_constant<int, 1>{});
}

// `accumulate` on bf16 rows read in place (bf16_even / bf16_odd): ae / ao (NV vectors each) +=
// p[t] times the even / odd values of rows[t], over the unmasked t < nb (a masked slot's row may
// hold anything, NaN included, and 0 x NaN is NaN: those slots are skipped, not weighted by 0).
// On top of dots_bf16 a 0.6B-shaped bf16 call took 0.76-0.84x the time of the widened block.
template <int NV>
inline void accumulate_bf16(const float* p, const at::BFloat16* rows, int64_t stride, const bool* m, int64_t ms,
                            int64_t nb, float* ae, float* ao) {
  Vec e[NV], o[NV];
  for (int j = 0; j < NV; ++j) e[j] = Vec::loadu(ae + j * kL), o[j] = Vec::loadu(ao + j * kL);
  for (int64_t t = 0; t < nb; ++t) {
    if (m[t * ms]) continue;
    const Vec pt(p[t]);
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j) {
      const IVec x = IVec::loadu(rows + t * stride + j * 2 * kL);
      e[j] = at::vec::fmadd(pt, bf16_even(x), e[j]);
      o[j] = at::vec::fmadd(pt, bf16_odd(x), o[j]);
    }
  }
  for (int j = 0; j < NV; ++j) e[j].store(ae + j * kL), o[j].store(ao + j * kL);
}

// softmax over row[0:n] in place, returns the sum of the exps (masked entries are -inf: exp 0).
// The max goes a vector at a time: written as a scalar std::max loop the compiler kept it scalar
// (a float max reduction is not reassociated without -ffast-math), and at 8k valid slots that loop
// was a quarter of a bf16 call on Zen 4. A NaN score gives NaN either way (here through the max,
// before through its exp). Against it (one build switched at run time, 7 rounds in random order):
// 0.80x a bf16 and 0.91x an fp32 call's time at 8192 slots, outputs bit-identical (BENCHMARKS.md,
// "sixty-sixth pass").
float exp_row(float* row, int64_t n) {
  Vec vmax(-std::numeric_limits<float>::infinity());
  int64_t t = 0;
  for (; t + kL <= n; t += kL) vmax = at::vec::maximum(vmax, Vec::loadu(row + t));
  float mx = at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return at::vec::maximum(x, y); }, vmax);
  for (; t < n; ++t) mx = std::max(mx, row[t]);
  const Vec vmx(mx);
  Vec vsum(0.0f);
  for (t = 0; t + kL <= n; t += kL) {
    const Vec e = (Vec::loadu(row + t) - vmx).exp();
    e.store(row + t);
    vsum = vsum + e;
  }
  float sum = at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, vsum);
  for (; t < n; ++t) {
    row[t] = std::exp(row[t] - mx);
    sum += row[t];
  }
  return sum;
}

constexpr int64_t kBlock = 32;  // cache slots widened to fp32 at a time (32 x 128 fp32 = 16 KiB)

// The bf16 scores on AVX512-BF16 (native_bf16_scores): out[g * ldo + t] = scale * (q_g . k_t) for the
// G query rows (bf16, `ldq` apart, as given: unscaled, so exact) and K rows t < nb (`stride` apart),
// D a multiple of 32, at most kNativeMaxD. Each head's q stays in registers; four K rows at a time
// go through one vdpbf16ps per 32 values into four accumulators, summed together (sums_of_4). The
// products and their sums are fp32, as the masked reference's (oneDNN's) are; the scale is applied
// to the fp32 sum. Against the shift-and-FMA loop (dots_bf16), on Zen 4 (28 layers' caches of the
// 0.6B shape, one build switched at run time, 7 rounds in random order, three runs, control
// 0.95-1.04) a call took 0.78-0.94x the time at 24-8192 valid slots and batch 1-16, with the same
// largest error against fp64 (BENCHMARKS.md, "sixty-fifth pass"). Rows past nb are never read: a
// short last group repeats its first row and drops those sums.
// Each row's vectors are read one after another, so the loads go in address order. The first
// version read the group a column at a time (the first 64 bytes of the four rows, then the next),
// and from memory that order kept the hardware prefetcher behind: against it (Zen 4, 28 layers'
// caches, one build switched at run time, 7 rounds in random order) a call took 0.73x the time at
// 8192 slots with the 0.6B shape's heads, 0.82x at 2048, and 0.82-0.89x with Qwen3-8B's heads (four
// to a kv head) at batch 1-4; level at batch 16 and 33 slots. Eight or sixteen rows at a time in
// the column order took 1.10-1.34x the time (BENCHMARKS.md, "sixty-sixth pass").
//
// With `ahead` (on an Intel CPU: kv_ahead) the first head's pass also asks for the next group's four
// K rows and the four V rows of the same slots, into L1: the V rows, read only after every score of
// the item, then stream alongside the K rows instead of after them. See the note above fp32_rows for
// what it measured. Past the item's last rows it goes on into the next item's first four (VAhead):
// over 28 layers' caches placed as a runner's (2 MiB pages, max_len slots, the valid ones first),
// from memory, a call took 0.91x the time at batch 16 and 32 of 96 slots (two and four heads to a kv
// head, 13 of 15 rounds faster), 0.93x at batch 64 and 41 of 64, 0.98x with no gap (32 of 32),
// level at 151 of 256 and 301 of 512; the decode steps read level (0.98-1.00x at batch 4 and 16,
// 9 rounds; BENCHMARKS.md, "seventy-eighth pass").
//
// With `pairs` (an Intel CPU) the heads go two at a time, each K row loaded once for both: one call of
// the 0.6B shape (two heads to a kv head) from L2, with the V pass in pairs too (v_pair_bf16) and the
// sums put back in order by vector (interleave_halves), took 0.86-0.93x the time at batch 1-64 and
// 32-2048 valid slots, outputs bit-identical (the Intel AMX kind, one build switched at run time, 30
// rounds in turns, 25-30 of 30 faster); over 28 layers' caches from memory the VM's noise (rounds
// 0.78-3.4x apart) hid it: 0.96x and 0.99x (BENCHMARKS.md, "seventy-eighth pass"). Unmeasured on AMD.
constexpr int64_t kNativeMaxD = 256;

#ifdef CANN_ATTN_BF16
// NH (1 or 2) heads' scores against the K rows: the heads from `q` on (`ldq` apart), their rows of
// `out` from there on (`ldo` apart). See k_scores_bf16.
template <int NH>
CANN_ATTN_BF16_TARGET inline void k_scores_heads(const uint16_t* q, int64_t ldq, const uint16_t* k, int64_t stride,
                                                 int64_t nb, int64_t D, __m128 vscale, float* out, int64_t ldo,
                                                 const VAhead<at::BFloat16>* ahead) {
  const int64_t C = D / 32;
  __m512bh qv[NH][kNativeMaxD / 32];
  for (int h = 0; h < NH; ++h)
    for (int64_t c = 0; c < C; ++c) qv[h][c] = (__m512bh)_mm512_loadu_si512(q + h * ldq + 32 * c);
  for (int64_t t = 0; t < nb; t += 4) {
    const int64_t left = std::min<int64_t>(4, nb - t);
    if (ahead != nullptr)
      for (int64_t r = t + 4; r < t + 8; ++r) {
        if (r < ahead->rows_left) {
          ask_l1(k + r * stride, D * 2);
          ask_l1(ahead->v + r * ahead->vstride, D * 2);
        } else if (ahead->next_k != nullptr && r - ahead->rows_left < ahead->next_rows) {
          ask_l1(ahead->next_k + (r - ahead->rows_left) * ahead->next_ks, D * 2);
          ask_l1(ahead->next_v + (r - ahead->rows_left) * ahead->next_vs, D * 2);
        }
      }
    const uint16_t* rows[4];
    for (int64_t i = 0; i < 4; ++i) rows[i] = k + (t + (i < left ? i : 0)) * stride;
    __m512 acc[NH][4];
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) {  // a row at a time: the loads go in address order (see above)
      const __m512bh x = (__m512bh)_mm512_loadu_si512(rows[i]);
#pragma GCC unroll 2
      for (int h = 0; h < NH; ++h) acc[h][i] = _mm512_dpbf16_ps(_mm512_setzero_ps(), x, qv[h][0]);
      for (int64_t c = 1; c < C; ++c) {
        const __m512bh y = (__m512bh)_mm512_loadu_si512(rows[i] + 32 * c);
#pragma GCC unroll 2
        for (int h = 0; h < NH; ++h) acc[h][i] = _mm512_dpbf16_ps(acc[h][i], y, qv[h][c]);
      }
    }
    const __mmask8 keep = static_cast<__mmask8>((1u << left) - 1);
#pragma GCC unroll 2
    for (int h = 0; h < NH; ++h)
      _mm_mask_storeu_ps(out + h * ldo + t, keep, _mm_mul_ps(cann::sums_of_4(acc[h]), vscale));
  }
}

CANN_ATTN_BF16_TARGET void k_scores_bf16(const uint16_t* q, int64_t ldq, int64_t G, const uint16_t* k,
                                         int64_t stride, int64_t nb, int64_t D, float scale, float* out,
                                         int64_t ldo, const VAhead<at::BFloat16>* ahead, bool pairs) {
  const __m128 vscale = _mm_set1_ps(scale);
  int64_t g = 0;
  for (; pairs && g + 2 <= G; g += 2)
    k_scores_heads<2>(q + g * ldq, ldq, k, stride, nb, D, vscale, out + g * ldo, ldo, g == 0 ? ahead : nullptr);
  for (; g < G; ++g)
    k_scores_heads<1>(q + g * ldq, ldq, k, stride, nb, D, vscale, out + g * ldo, ldo, g == 0 ? ahead : nullptr);
}

// The bf16 V pass for a pair of query heads (where k_scores_bf16 runs, G >= 4 or on Intel 2, D <= 128): acc_g
// (a row of `lda` floats per head, the even values' sums in [0, D/2), the odd values' in [D/2, D), as
// accumulate_bf16 keeps them) += p_g[t] * v_t over the unmasked t < nb, g = 0, 1. All C = D / 32 of a
// V row's vectors and both heads' sums stay in registers (4C accumulators), so each V row is loaded
// and split once per pair of heads instead of once per head. On Zen 4 (one build switched at run
// time, 7 rounds in random order), with the scores above: Qwen3-8B-shaped heads (four to a kv head)
// took 0.92-0.96x the time of the scores change alone at 2048-8192 slots, and seven heads (Qwen2.5-7B;
// three pairs and the last head alone) 0.93-0.96x. With two heads to a kv head (the 0.6B shape) it
// read 0.99-1.04x, so G = 2 keeps the loop per head there (BENCHMARKS.md, "sixty-fifth pass"); an
// Intel CPU takes pairs from G = 2 (k_scores_bf16's note).
template <int C>
CANN_ATTN_BF16_TARGET void v_pair_bf16(const float* p, int64_t ldp, const uint16_t* v, int64_t stride,
                                       const bool* m, int64_t ms, int64_t nb, int64_t D, float* acc, int64_t lda) {
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  __m512 e[2][C], o[2][C];
  for (int g = 0; g < 2; ++g)
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) {
      e[g][c] = _mm512_loadu_ps(acc + g * lda + 16 * c);
      o[g][c] = _mm512_loadu_ps(acc + g * lda + D / 2 + 16 * c);
    }
  for (int64_t t = 0; t < nb; ++t) {
    if (m[t * ms]) continue;  // a masked slot's row may hold anything, NaN included
    const __m512 p0 = _mm512_set1_ps(p[t]), p1 = _mm512_set1_ps(p[ldp + t]);
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) {
      const __m512i x = _mm512_loadu_si512(v + t * stride + 32 * c);
      const __m512 even = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
      const __m512 odd = _mm512_castsi512_ps(_mm512_and_si512(x, high));
      e[0][c] = _mm512_fmadd_ps(p0, even, e[0][c]);
      o[0][c] = _mm512_fmadd_ps(p0, odd, o[0][c]);
      e[1][c] = _mm512_fmadd_ps(p1, even, e[1][c]);
      o[1][c] = _mm512_fmadd_ps(p1, odd, o[1][c]);
    }
  }
  for (int g = 0; g < 2; ++g)
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) {
      _mm512_storeu_ps(acc + g * lda + 16 * c, e[g][c]);
      _mm512_storeu_ps(acc + g * lda + D / 2 + 16 * c, o[g][c]);
    }
}

// The sums in accumulate_bf16's order (the even values' in [0, D/2), the odd values' in [D/2, D))
// back in the values' order, into dst; D a multiple of 32. Two permutes per 32 values, where the
// scalar loop (kept for the AVX2 and plain builds) moves one value at a time.
CANN_ATTN_BF16_TARGET void interleave_halves(const float* src, int64_t D, float* dst) {
  const __m512i lo = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
  const __m512i hi = _mm512_add_epi32(lo, _mm512_set1_epi32(8));
  for (int64_t j = 0; j < D / 2; j += 16) {
    const __m512 even = _mm512_loadu_ps(src + j), odd = _mm512_loadu_ps(src + D / 2 + j);
    _mm512_storeu_ps(dst + 2 * j, _mm512_permutex2var_ps(even, lo, odd));
    _mm512_storeu_ps(dst + 2 * j + 16, _mm512_permutex2var_ps(even, hi, odd));
  }
}

using VPairFn = void (*)(const float*, int64_t, const uint16_t*, int64_t, const bool*, int64_t, int64_t, int64_t,
                         float*, int64_t);
constexpr VPairFn kVPairs[4] = {v_pair_bf16<1>, v_pair_bf16<2>, v_pair_bf16<3>, v_pair_bf16<4>};
#endif

// Whether this CPU runs k_scores_bf16 (asked once).
bool native_bf16_scores() {
#ifdef CANN_ATTN_BF16
  static const bool native = __builtin_cpu_supports("avx512bf16");
  return native;
#else
  return false;
#endif
}

// Whether the score passes ask for the rows ahead (k_scores_bf16, dots on fp32 rows in place): an
// Intel CPU (asked once). Only for an item whose V rows come to at most kAheadMaxV bytes (1024 slots
// of bf16 at head_dim 128): the V rows asked for during the score pass must still be in L2 when
// the V pass reads them.
constexpr int64_t kAheadMaxV = 256 * 1024;
bool intel_cpu() {
#ifdef CANN_ATTN_BF16
  static const bool intel = __builtin_cpu_is("intel");
  return intel;
#else
  return false;
#endif
}
bool kv_ahead() { return intel_cpu(); }

// No software prefetch on AMD, nor for rows widened first (fp16, bf16 without AVX512-BF16): the
// loops read their rows in address order and the hardware prefetcher follows. Two look-aheads that
// had paid against loops reading the rows a column at a time cost time once the rows were read in
// order (Zen 4, 28 layers' caches, one build switched at run time):
// - the next work item's first 16 KB of K and V rows, asked for before an item starts (forty-sixth
//   pass: 0.70x at batch 16 and 33 slots in bf16): without it 0.66x the time in bf16 at batch 16 and
//   64 and 33 slots, 0.91-0.94x in fp32, 0.96-1.03x at 512-2048 slots;
// - the next block of rows inside an item (on in fp32 on AMD since the sixty-fifth pass): with it,
//   1.02-1.17x the time in fp32 and 1.20-1.39x in bf16 at 512-8192 slots (BENCHMARKS.md,
//   "sixty-sixth pass").
// On the Intel AMX kind the op read its K and V rows at only 0.43-0.68 of a plain sum's rate in bf16
// (28 layers' caches, batch 1-16, 33-2048 slots), and its loops alone ran about as fast on a cache
// that fit in L2: the stream and the arithmetic took turns. There the look-ahead (one build switched
// at run time, 9-11 alternating rounds, outputs bit-identical) took, of the op's time:
// - bf16 (the next four K and V rows): 0.83-0.87x at 33 slots and batch 4-64, 0.88-0.92x at
//   256-512 slots, 0.81x / 0.96x at 1024 slots and batch 1 / 16; and the SK decoder's bf16 step
//   0.96x at batch 64 (every round faster), level at batch 16. Eight rows ahead gained less
//   (0.88-0.90x), 16 or 32 less still (0.89-0.99x); K alone 0.94-0.97x; also asking for the next
//   work item's rows, up front or spread over the V pass, nothing more (1.00-1.04x this one's time);
// - fp32 (from two slots on): 0.84-0.89x at 33-512 slots and batch 4-64 (one and three slots on
//   read the same, four and eight 1.01-1.05x slower than two);
// - with an item's V rows past 256 KB it cost: bf16 1.00-1.06x at 2048 slots (0.92x at batch 1),
//   1.15-1.16x at 4096-8192; fp32 1.01-1.04x at 2048, 1.23x at 8192. So kAheadMaxV.
// BENCHMARKS.md, "seventy-fifth pass". AMD keeps none (unmeasured with this look-ahead; the ones
// above cost there).

// Rows t = 0..nb-1 of `src` (row stride `stride`) as fp32 rows: returns where they are and their
// stride. fp32 rows are read in place where they fill whole vectors and no slot of the block is
// masked; otherwise they are widened into `dst` (row stride Dv), a masked slot's row as zeros (a
// slot never written may hold anything, and its weight is 0).
template <typename T>
std::pair<const float*, int64_t> fp32_rows(const T* src, int64_t stride, const bool* m, int64_t ms, int64_t nb,
                                           int64_t D, int64_t Dv, float* dst) {
  bool any_masked = false;
  for (int64_t t = 0; t < nb; ++t) any_masked |= m[t * ms];
  if constexpr (std::is_same_v<T, float>) {
    if (!any_masked && D == Dv) return {src, stride};
  }
  for (int64_t t = 0; t < nb; ++t) {
    if (m[t * ms])
      std::fill(dst + t * Dv, dst + t * Dv + D, 0.0f);
    else
      widen(src + t * stride, D, dst + t * Dv);
  }
  return {dst, Dv};
}

// acc[0 : NV vectors] += sum over t < nb of p[t] * rows[t * stride : ...], the sums kept in registers
template <int NV>
inline void accumulate(const float* p, const float* rows, int64_t stride, int64_t nb, float* acc) {
  Vec a[NV];
  for (int j = 0; j < NV; ++j) a[j] = Vec::loadu(acc + j * kL);
  for (int64_t t = 0; t < nb; ++t) {
    const Vec pt(p[t]);
    for (int j = 0; j < NV; ++j) a[j] = at::vec::fmadd(pt, Vec::loadu(rows + t * stride + j * kL), a[j]);
  }
  for (int j = 0; j < NV; ++j) a[j].store(acc + j * kL);
}

template <typename scalar_t>
void attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& mask, double scale,
            at::Tensor& out) {
  const int64_t B = q.size(0), Hq = q.size(1), S = q.size(2), D = q.size(3);
  const int64_t Hkv = k.size(1), G = Hq / Hkv;
  const int64_t T = k.size(2);
  const int64_t Dv = (D + kL - 1) / kL * kL;  // fp32 rows padded to whole vectors (zeros past D)
  const scalar_t* qp = q.data_ptr<scalar_t>();  // contiguous (B, Hq, S, D)
  const scalar_t* kp = k.data_ptr<scalar_t>();  // last dim contiguous; other strides as given
  const scalar_t* vp = v.data_ptr<scalar_t>();
  const bool* mp = mask.data_ptr<bool>();  // (B, 1, S, T), possibly broadcast (stride 0)
  scalar_t* op = out.data_ptr<scalar_t>();  // contiguous (B, Hq, S, D)
  const int64_t ks0 = k.stride(0), ks1 = k.stride(1), ks2 = k.stride(2);
  const int64_t vs0 = v.stride(0), vs1 = v.stride(1), vs2 = v.stride(2);
  const int64_t ms0 = mask.stride(0), ms2 = mask.stride(2), ms3 = mask.stride(3);
  const float fscale = static_cast<float>(scale);

  std::vector<int64_t> last(B * S);  // per (b, s): the same for every head
  for (int64_t b = 0; b < B; ++b)
    for (int64_t s = 0; s < S; ++s) last[b * S + s] = last_valid(mp + b * ms0 + s * ms2, T, ms3);

  // one work item = (b, kv head h, query row s); grain 1: items are few and each is long
  at::parallel_for(0, B * Hkv * S, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(G * Dv, 0.0f), acc(G * Dv), rows(kBlock * Dv, 0.0f), inv(G), scores, qsplit(G * Dv);
    constexpr bool kBf16 = std::is_same_v<scalar_t, at::BFloat16>;
    const bool split = kBf16 && D % (2 * kL) == 0;  // K read in place by dots_bf16
    const bool native = kBf16 && D % 32 == 0 && D <= kNativeMaxD && native_bf16_scores();
    // heads two at a time (k_scores_bf16's note): both passes from two heads to a kv head on an Intel
    // CPU, elsewhere the V pass only, from four (v_pair_bf16 takes D <= 128)
    const bool pair_scores = native && intel_cpu();
    [[maybe_unused]] const bool pairs = native && G >= (pair_scores ? 2 : 4) && D <= 128;
    // the look-ahead of k_scores_bf16 or of dots on fp32 rows read in place (kv_ahead), for items
    // whose V rows come to at most kAheadMaxV bytes
    const bool ahead = (native || std::is_same_v<scalar_t, float>) && kv_ahead();
    for (int64_t item = begin; item < end; ++item) {
      const int64_t s = item % S, h = (item / S) % Hkv, b = item / (S * Hkv);
      const bool* m = mp + b * ms0 + s * ms2;
      const int64_t n = last[b * S + s] + 1;
      scalar_t* o0 = op + ((b * Hq + h * G) * S + s) * D;
      if (n == 0) {
        for (int64_t g = 0; g < G; ++g)
          std::fill(o0 + g * S * D, o0 + g * S * D + D, static_cast<scalar_t>(std::numeric_limits<float>::quiet_NaN()));
        continue;
      }
      for (int64_t g = 0; g < G && !native; ++g) {  // the scaled query rows of this kv head's group, in fp32
        float* qg = qf.data() + g * Dv;  // (k_scores_bf16 reads the bf16 rows as given)
        widen(qp + ((b * Hq + h * G + g) * S + s) * D, D, qg);
        for (int64_t d = 0; d < D; ++d) qg[d] *= fscale;
        if (split)
          for (int64_t j = 0; j < D / 2; ++j) qsplit[g * Dv + j] = qg[2 * j], qsplit[g * Dv + D / 2 + j] = qg[2 * j + 1];
      }
      scores.resize(G * n);
      const scalar_t* kr = kp + b * ks0 + h * ks1;
      const scalar_t* vr = vp + b * vs0 + h * vs1;
      const bool look = ahead && n * D * static_cast<int64_t>(sizeof(scalar_t)) <= kAheadMaxV;
      for (int64_t t0 = 0; t0 < n; t0 += kBlock) {  // scores of a block of slots, all G rows
        const int64_t nb = std::min(kBlock, n - t0);
        VAhead<scalar_t> v_ahead{vr + t0 * vs2, vs2, n - t0};
        if (look && native && t0 + kBlock >= n && item + 1 < end) {  // last block: on into the next item
          const int64_t s1 = (item + 1) % S, h1 = ((item + 1) / S) % Hkv, b1 = (item + 1) / (S * Hkv);
          v_ahead.next_k = kp + b1 * ks0 + h1 * ks1;
          v_ahead.next_v = vp + b1 * vs0 + h1 * vs1;
          v_ahead.next_ks = ks2, v_ahead.next_vs = vs2, v_ahead.next_rows = last[b1 * S + s1] + 1;
        }
        if constexpr (kBf16) {
#ifdef CANN_ATTN_BF16
          if (native) {  // a masked slot's row may hold anything here: its score is set to -inf below
            k_scores_bf16(reinterpret_cast<const uint16_t*>(qp + ((b * Hq + h * G) * S + s) * D), S * D, G,
                          reinterpret_cast<const uint16_t*>(kr + t0 * ks2), ks2, nb, D, fscale, scores.data() + t0, n,
                          look ? &v_ahead : nullptr, pair_scores);
          } else
#endif
          if (split) {  // a masked slot's row may hold anything here: its score is set to -inf below
            for (int64_t g = 0; g < G; ++g)
              dots_bf16(qsplit.data() + g * Dv, qsplit.data() + g * Dv + D / 2, kr + t0 * ks2, ks2, nb, D,
                        scores.data() + g * n + t0);
          }
        }
        if (!split) {
          const auto [kb, kstride] = fp32_rows(kr + t0 * ks2, ks2, m + t0 * ms3, ms3, nb, D, Dv, rows.data());
          const VAhead<float>* ahead_f32 = nullptr;  // fp32 rows read in place: the first head's pass looks ahead
          if constexpr (std::is_same_v<scalar_t, float>)
            if (look && kb == kr + t0 * ks2) ahead_f32 = &v_ahead;
          for (int64_t g = 0; g < G; ++g)
            dots(qf.data() + g * Dv, kb, kstride, nb, Dv, scores.data() + g * n + t0, g == 0 ? ahead_f32 : nullptr);
        }
        bool any_masked = false;  // rare before a row's last valid slot: one look a slot, then G only if so
                                  // (0.92-0.99x a bf16 call's time at 2048-8192 slots, "sixty-sixth pass")
        for (int64_t t = 0; t < nb; ++t) any_masked |= m[(t0 + t) * ms3];
        for (int64_t g = 0; g < G && any_masked; ++g)
          for (int64_t t = 0; t < nb; ++t)
            if (m[(t0 + t) * ms3]) scores[g * n + t0 + t] = -std::numeric_limits<float>::infinity();
      }
      for (int64_t g = 0; g < G; ++g) inv[g] = 1.0f / exp_row(scores.data() + g * n, n);
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t t0 = 0; t0 < n; t0 += kBlock) {  // acc += p V over a block of slots, in registers
        const int64_t nb = std::min(kBlock, n - t0);
        if constexpr (kBf16) {
          int64_t g_first = 0;  // heads before it are done (in pairs)
#ifdef CANN_ATTN_BF16
          if (pairs) {
            for (; g_first + 2 <= G; g_first += 2)
              kVPairs[D / 32 - 1](scores.data() + g_first * n + t0, n,
                                  reinterpret_cast<const uint16_t*>(vr + t0 * vs2), vs2, m + t0 * ms3, ms3, nb, D,
                                  acc.data() + g_first * Dv, Dv);
            if (g_first == G) continue;  // an odd G leaves its last head to the loop below
          }
#endif
          if (split) {  // acc per group: the even values' sums, then the odd values'
            for (int64_t g = g_first; g < G; ++g) {
              const float* pg = scores.data() + g * n + t0;
              float* ae = acc.data() + g * Dv;
              for (int64_t d = 0; d < D; d += D - d >= 8 * kL ? 8 * kL : 2 * kL) {
                const at::BFloat16* vd = vr + t0 * vs2 + d;
                if (D - d >= 8 * kL)
                  accumulate_bf16<4>(pg, vd, vs2, m + t0 * ms3, ms3, nb, ae + d / 2, ae + D / 2 + d / 2);
                else
                  accumulate_bf16<1>(pg, vd, vs2, m + t0 * ms3, ms3, nb, ae + d / 2, ae + D / 2 + d / 2);
              }
            }
            continue;
          }
        }
        const auto [vb, vstride] = fp32_rows(vr + t0 * vs2, vs2, m + t0 * ms3, ms3, nb, D, Dv, rows.data());
        // Eight vectors of a row at a time (a whole row at head_dim 128 on AVX-512, half of one on
        // AVX2), so the rows are read in longer runs in address order: against four vectors at a
        // time, 0.90-0.92x an fp32 call's time at 8192 slots on Zen 4, 0.85-0.86x with dots' row
        // order; the AVX2 build there 0.95x, 0.72-0.78x with dots' (BENCHMARKS.md, "sixty-sixth pass").
        for (int64_t g = 0; g < G; ++g) {
          const float* pg = scores.data() + g * n + t0;
          for (int64_t d = 0, w = 0; d < Dv; d += w * kL) {
            w = Dv - d >= 8 * kL ? 8 : Dv - d >= 4 * kL ? 4 : 1;
            float* ad = acc.data() + g * Dv + d;
            if (w == 8)
              accumulate<8>(pg, vb + d, vstride, nb, ad);
            else if (w == 4)
              accumulate<4>(pg, vb + d, vstride, nb, ad);
            else
              accumulate<1>(pg, vb + d, vstride, nb, ad);
          }
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        float* ag = acc.data() + g * Dv;
        const float* sums = ag;
        if (split) {  // back to the values' order
          sums = rows.data();
#ifdef CANN_ATTN_BF16
          if (native)
            interleave_halves(ag, D, rows.data());
          else
#endif
            for (int64_t j = 0; j < D / 2; ++j) rows[2 * j] = ag[j], rows[2 * j + 1] = ag[D / 2 + j];
        }
        const Vec vinv(inv[g]);
        for (int64_t d = 0; d < Dv; d += kL) (Vec::loadu(sums + d) * vinv).store(ag + d);
        scalar_t* og = o0 + g * S * D;
        if constexpr (std::is_same_v<scalar_t, float>) {
          std::memcpy(og, ag, D * sizeof(float));
        } else {
          at::vec::convert(ag, og, D);
        }
      }
    }
  });
}

at::Tensor decode_attention_cpu(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                const at::Tensor& mask, double scale) {
  TORCH_CHECK(q.dim() == 4 && k_cache.dim() == 4 && v_cache.dim() == 4 && mask.dim() == 4,
              "cann::decode_attention: q, k_cache, v_cache, mask must be 4-D (B, H, S|T, D) / (B, 1, S, T)");
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes(), "cann::decode_attention: k_cache and v_cache shapes differ");
  TORCH_CHECK(q.size(0) == k_cache.size(0) && q.size(3) == k_cache.size(3),
              "cann::decode_attention: q and the cache disagree on batch or head dim");
  TORCH_CHECK(k_cache.size(1) > 0 && q.size(1) % k_cache.size(1) == 0,
              "cann::decode_attention: query heads must be a multiple of kv heads");
  TORCH_CHECK(mask.scalar_type() == at::kBool, "cann::decode_attention: mask must be bool (True = masked out)");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == v_cache.scalar_type(),
              "cann::decode_attention: q, k_cache, v_cache must share a dtype");
  const at::Tensor qc = q.contiguous();
  const at::Tensor kc = k_cache.stride(3) == 1 ? k_cache : k_cache.contiguous();
  const at::Tensor vc = v_cache.stride(3) == 1 ? v_cache : v_cache.contiguous();
  const at::Tensor m = mask.expand({q.size(0), 1, q.size(2), k_cache.size(2)});
  at::Tensor out = at::empty(q.sizes(), q.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "cann::decode_attention",
                                  [&] { attend<scalar_t>(qc, kc, vc, m, scale, out); });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(cann, CPU, m) { m.impl("decode_attention", &decode_attention_cpu); }
