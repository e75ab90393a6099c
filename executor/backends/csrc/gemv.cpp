// CPU kernels of cann_cpu::gemv and cann_cpu::dot_linear (schemas and use:
// executor/backends/eager_linear.py).
//
// y = x W^T + b on a weight W (N, K) as stored (rows contiguous), in bf16 or fp32, accumulating in
// fp32: gemv for one to four rows of x, dot_linear for up to 64 (further down), each with an AVX-512
// loop and an AVX2 one.
//
// Why: the eager decode step and the prefill's last-token logits multiply a row or a few by
// every weight, a stream over the weights. aten's linear streamed the Qwen3-0.6B bf16 weights at
// 15-19 GB/s there on the 2-core reference machine, against a read bandwidth of ~33-35 GB/s
// (BENCHMARKS.md, "twelfth pass"). The compiled modes lower these products to generated reductions
// (executor/backends/graph_passes.py) or pack the weights (packed_linear.py); the eager path keeps
// the weights as stored, so this loop reads them in place, one weight row after the other (a
// thread's share is one sequential stream), each 32 bf16 (or 16 fp32) values times the same
// values of every x row (vdpbf16ps / FMA) into four accumulators, one horizontal sum per output.
// Four rows at a time, interleaved 64 bytes each, read the lm_head at 1.3x an fp32 sum's time
// on one thread at 14.7 GB/s: 4 streams 2 KB apart defeated the prefetcher.
//
// A CPU without AVX-512 (or, in bf16, without AVX512-BF16) runs an AVX2 + FMA loop instead, with
// bf16 widened in registers (avx2_row): there aten's bf16 linear is emulated by oneDNN and streamed
// the 0.6B shape's weights at 16-17 GB/s for one row and 4.5-5 GB/s for four, where this loop read
// 32-33 and 16-19 (BENCHMARKS.md, "nineteenth pass").
//
// The vector code is compiled for AVX-512 or AVX2 per function (target attribute);
// gemv_supported(dtype) says whether this CPU can run one of the loops, and the Python side never
// calls the kernel where it cannot.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "linear_io.h"
#include "x86_sums.h"

#include <algorithm>
#include <cstdint>
#include <vector>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define CANN_GEMV 1
#endif

namespace {

constexpr int kMaxRows = 4;       // rows of x per call: 4 x 4 accumulators + 4 weights + 1 x <= 32 zmm
constexpr int64_t kGrain = 256;  // outputs per parallel chunk, at least
constexpr int64_t kShareBlock = 32;  // outputs a thread takes at a time (leftovers_for)

#ifdef CANN_GEMV
#define CANN_BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
#define CANN_F32_TARGET __attribute__((target("avx512f,avx512vl")))  // VL: the tiles' 128-bit masked ops

// How far ahead in a thread's stream the row loops below ask for the weight's lines into L2, where
// they do (kAhead: kBf16 / kF32 below say which). On AMD Zen 4, one build with the look-ahead
// switched at run time (the 0.6B projections, 7-11 rounds in random order, against a control arm
// that read 0.98-1.03): one row took 0.85-0.91x the time in bf16 (five runs) and 0.87-0.91x in
// fp32 (two), two fp32 rows 0.91-0.94x; two bf16 rows took 1.04-1.35x (2 KB ahead 0.96-1.05x),
// three 1.10x. 2-3 KB ahead gained about as much or less, 8-16 KB less, and into L1 (T0) cost
// 1.29x. The eager batch-1 step, in-process: 0.907x the time in bf16, 0.852x in fp32, 12 of 12
// rounds faster (BENCHMARKS.md, "sixty-fifth pass"). On the Intel Xeon with AMX, which had run
// without it: one bf16 row read the 0.6B projections at 0.78 of a sum's rate with it, 0.63
// without, and the bf16 batch-1 step took 0.835x the time in eager, 0.811x in ge_graph (which
// calls this loop there) and 0.784x in SK decoder, 8 of 8 rounds each (one build switched at run
// time; "seventy-second pass"). Unmeasured where fp32 rows run here on an Intel CPU without AMX
// (Ice Lake's eager 1-2 rows). A prefetch never faults, so the last rows' lines past the
// weight's end are only wasted requests.
constexpr int64_t kRowAhead = 4096;

// One weight row's 256 bytes from `p` on (4 lines), kRowAhead ahead, into L2.
inline void ahead_l2(const void* p) {
  const char* a = static_cast<const char*>(p) + kRowAhead;
  for (int i = 0; i < 4; ++i) _mm_prefetch(a + 64 * i, _MM_HINT_T1);
}

// One bf16 output from a row's 4 accumulators: their sum in one fixed order plus the bias, rounded to
// nearest even as aten does. bf16_row and bf16_pair both end here, so that an output does not
// depend on which of them ran it (tests/test_eager_linear.py compares them bit for bit).
CANN_BF16_TARGET inline uint16_t bf16_sum(const __m512 acc[4], float bias) {
  const __m512 sum = _mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3]));
  return c10::BFloat16(_mm512_reduce_add_ps(sum) + bias).x;
}

// Output n of MB rows, bf16: the weight row read front to back (consecutive rows are consecutive
// memory, so a thread's share of the weight is one sequential stream), 4 x 32 k values per step
// into 4 independent accumulators per row of x, the tail 32 at a time, masked. kAhead: each step
// also asks for the stream's lines kRowAhead bytes on.
template <int MB, bool kAhead = false>
CANN_BF16_TARGET inline void bf16_row(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t K, float bias,
                                      uint16_t* y, int64_t ldy) {
  __m512 acc[MB][4];
  for (int m = 0; m < MB; ++m)
    for (int u = 0; u < 4; ++u) acc[m][u] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 128 <= K; k += 128) {
    if constexpr (kAhead) ahead_l2(w + k);
    __m512bh wr[4];
    for (int u = 0; u < 4; ++u) wr[u] = (__m512bh)_mm512_loadu_si512(w + k + 32 * u);
    for (int m = 0; m < MB; ++m)
      for (int u = 0; u < 4; ++u)
        acc[m][u] = _mm512_dpbf16_ps(acc[m][u], wr[u], (__m512bh)_mm512_loadu_si512(x + m * ldx + k + 32 * u));
  }
  for (; k < K; k += 32) {
    const __mmask32 mask = K - k >= 32 ? 0xFFFFFFFFu : static_cast<__mmask32>((1ull << (K - k)) - 1);
    const __m512bh wr = (__m512bh)_mm512_maskz_loadu_epi16(mask, w + k);
    for (int m = 0; m < MB; ++m)
      acc[m][0] = _mm512_dpbf16_ps(acc[m][0], wr, (__m512bh)_mm512_maskz_loadu_epi16(mask, x + m * ldx + k));
  }
  for (int m = 0; m < MB; ++m) y[m * ldy] = bf16_sum(acc[m], bias);
}

// The same in fp32: 4 x 16 k values per step, FMA.
template <int MB, bool kAhead = false>
CANN_F32_TARGET inline void f32_row(const float* x, int64_t ldx, const float* w, int64_t K, float bias, float* y,
                                    int64_t ldy) {
  __m512 acc[MB][4];
  for (int m = 0; m < MB; ++m)
    for (int u = 0; u < 4; ++u) acc[m][u] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 64 <= K; k += 64) {
    if constexpr (kAhead) ahead_l2(w + k);
    __m512 wr[4];
    for (int u = 0; u < 4; ++u) wr[u] = _mm512_loadu_ps(w + k + 16 * u);
    for (int m = 0; m < MB; ++m)
      for (int u = 0; u < 4; ++u)
        acc[m][u] = _mm512_fmadd_ps(wr[u], _mm512_loadu_ps(x + m * ldx + k + 16 * u), acc[m][u]);
  }
  for (; k < K; k += 16) {
    const __mmask16 mask = K - k >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (K - k)) - 1);
    const __m512 wr = _mm512_maskz_loadu_ps(mask, w + k);
    for (int m = 0; m < MB; ++m)
      acc[m][0] = _mm512_fmadd_ps(wr, _mm512_maskz_loadu_ps(mask, x + m * ldx + k), acc[m][0]);
  }
  for (int m = 0; m < MB; ++m) {
    const __m512 sum = _mm512_add_ps(_mm512_add_ps(acc[m][0], acc[m][1]), _mm512_add_ps(acc[m][2], acc[m][3]));
    y[m * ldy] = _mm512_reduce_add_ps(sum) + bias;
  }
}

// --- One bf16 row of x, two weight rows at a time: two streams a thread (run_pairs) ---
// Rows n and n + kPairGap run together, each read front to back and asked for kRowAhead ahead, with
// x's values loaded once for both. On the Intel AMX kind one bf16 row read the 0.6B projections at
// 0.86-0.89 of a sum's rate where one stream a thread read 0.63 (11 alternating rounds, one build
// switched at run time; 1.36-1.42x per round for gaps of 16-64 rows), and the bf16 batch-1 step
// took 0.756x the time in eager, 0.755x in ge_graph and 0.707x in SK decoder, faster in 8 of 8
// rounds each, tokens the same (BENCHMARKS.md, "seventy-third pass"). One stream a thread read
// 0.60-0.78 of the sum's rate there from run to run, its look-ahead worth 0.15 one day and
// nothing the next; likely two streams keep twice the lines in flight (not profiled). This runs
// on an Intel CPU with AVX512-BF16 (pairs_run; without it bf16 takes the AVX2 loop); AMD CPUs keep
// one stream a thread (unmeasured there), and so does fp32: on the AMX kind no single fp32 row
// reaches this kernel (eager sends it to MKL, the graphs to Inductor's reductions); on Ice Lake,
// where eager's do, the pairing is unmeasured.
constexpr int64_t kPairGap = 64;

CANN_BF16_TARGET inline void bf16_pair(const uint16_t* x, const uint16_t* wa, const uint16_t* wb, int64_t K,
                                       float ba, float bb, uint16_t* ya, uint16_t* yb) {
  __m512 a[4], b[4];
  for (int u = 0; u < 4; ++u) a[u] = b[u] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 128 <= K; k += 128) {
    ahead_l2(wa + k);
    ahead_l2(wb + k);
    for (int u = 0; u < 4; ++u) {
      const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + k + 32 * u);
      a[u] = _mm512_dpbf16_ps(a[u], (__m512bh)_mm512_loadu_si512(wa + k + 32 * u), xv);
      b[u] = _mm512_dpbf16_ps(b[u], (__m512bh)_mm512_loadu_si512(wb + k + 32 * u), xv);
    }
  }
  for (; k < K; k += 32) {
    const __mmask32 mask = K - k >= 32 ? 0xFFFFFFFFu : static_cast<__mmask32>((1ull << (K - k)) - 1);
    const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(mask, x + k);
    a[0] = _mm512_dpbf16_ps(a[0], (__m512bh)_mm512_maskz_loadu_epi16(mask, wa + k), xv);
    b[0] = _mm512_dpbf16_ps(b[0], (__m512bh)_mm512_maskz_loadu_epi16(mask, wb + k), xv);
  }
  *ya = bf16_sum(a, ba);
  *yb = bf16_sum(b, bb);
}

// --- Up to 64 rows (cann_cpu::dot_linear; the eager path gives it 3-64): AVX-512 tiles ---
// The row loops above read the weight once per call because every row of x stays in registers;
// past four rows they no longer fit (and at three or four rows, four weight rows at a time read
// faster). A tile here is kTileW weight rows times up to kTileX rows of x: per 32 k values (bf16;
// 16 in fp32) it loads the kTileW weight rows' values and each x row's, and adds kTileW x kTileX
// dot-product vectors (24 accumulators + 4 weights + 1 x <= 32 zmm). That is the packed loop's
// ratio of loads to products (rows_linear: 4 weight vectors + 6 broadcasts per 24), on the weight
// as stored, at the cost of one horizontal sum per output (sums_of_4: ~3.5 instructions an output,
// against 32 products per output at K = 1024). A block of kTileW weight rows is read from memory
// by its first tile of rows and from cache by the others, which prefetch the next block
// (contiguous when the rows are) into L2 meanwhile, as run_tiles does for the packed loop.
constexpr int kTileW = 4;
constexpr int kTileX = 6;
constexpr int kDotMaxRows = 64;

// Touch `lines` cache lines from `pf` on into L2: the caller's share of the next block.
inline void prefetch_l2(const char* pf, int lines) {
  for (int i = 0; i < lines; ++i) _mm_prefetch(pf + i * 64, _MM_HINT_T1);
}

// One bf16 tile: S rows of x (row stride ldx) times R weight rows (row stride ldw), K values each,
// into y[s, 0..R) (row stride ldy), bias added in fp32 and each output rounded once. Every 32-value
// step also prefetches `pfl` lines from `pf` on.
template <int R, int S>
CANN_BF16_TARGET inline void bf16_dots(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t ldw, int64_t K,
                                       const float* bias, uint16_t* y, int64_t ldy, const char* pf, int pfl) {
  __m512 acc[S][R];
#pragma GCC unroll 8
  for (int s = 0; s < S; ++s)
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) acc[s][r] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k < K; k += 32) {
    const __mmask32 mask = K - k >= 32 ? 0xFFFFFFFFu : static_cast<__mmask32>((1ull << (K - k)) - 1);
    prefetch_l2(pf, pfl);
    pf += pfl * 64;
    __m512bh wr[R];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) wr[r] = (__m512bh)_mm512_maskz_loadu_epi16(mask, w + r * ldw + k);
#pragma GCC unroll 8
    for (int s = 0; s < S; ++s) {
      const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(mask, x + s * ldx + k);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) acc[s][r] = _mm512_dpbf16_ps(acc[s][r], wr[r], xv);
    }
  }
  const __mmask8 out = static_cast<__mmask8>((1u << R) - 1);
  const __m128 b = bias ? _mm_maskz_loadu_ps(out, bias) : _mm_setzero_ps();
#pragma GCC unroll 8
  for (int s = 0; s < S; ++s)
    _mm_mask_storeu_epi16(y + s * ldy, out, (__m128i)_mm_cvtneps_pbh(_mm_add_ps(cann::sums_of_4<R>(acc[s]), b)));
}

// The same in fp32: 16 k values per step, FMA.
template <int R, int S>
CANN_F32_TARGET inline void f32_dots(const float* x, int64_t ldx, const float* w, int64_t ldw, int64_t K,
                                     const float* bias, float* y, int64_t ldy, const char* pf, int pfl) {
  __m512 acc[S][R];
#pragma GCC unroll 8
  for (int s = 0; s < S; ++s)
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) acc[s][r] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 16) {
    const __mmask16 mask = K - k >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (K - k)) - 1);
    prefetch_l2(pf, pfl);
    pf += pfl * 64;
    __m512 wr[R];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) wr[r] = _mm512_maskz_loadu_ps(mask, w + r * ldw + k);
#pragma GCC unroll 8
    for (int s = 0; s < S; ++s) {
      const __m512 xv = _mm512_maskz_loadu_ps(mask, x + s * ldx + k);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) acc[s][r] = _mm512_fmadd_ps(wr[r], xv, acc[s][r]);
    }
  }
  const __mmask8 out = static_cast<__mmask8>((1u << R) - 1);
  const __m128 b = bias ? _mm_maskz_loadu_ps(out, bias) : _mm_setzero_ps();
#pragma GCC unroll 8
  for (int s = 0; s < S; ++s) _mm_mask_storeu_ps(y + s * ldy, out, _mm_add_ps(cann::sums_of_4<R>(acc[s]), b));
}

template <typename T>
using DotFn = void (*)(const T*, int64_t, const T*, int64_t, int64_t, const float*, T*, int64_t, const char*, int);

// The tile functions by [R - 1][S - 1].
#define CANN_DOT_ROW(fn, R) {fn<R, 1>, fn<R, 2>, fn<R, 3>, fn<R, 4>, fn<R, 5>, fn<R, 6>}
constexpr DotFn<uint16_t> kBf16Dots[kTileW][kTileX] = {CANN_DOT_ROW(bf16_dots, 1), CANN_DOT_ROW(bf16_dots, 2),
                                                       CANN_DOT_ROW(bf16_dots, 3), CANN_DOT_ROW(bf16_dots, 4)};
constexpr DotFn<float> kF32Dots[kTileW][kTileX] = {CANN_DOT_ROW(f32_dots, 1), CANN_DOT_ROW(f32_dots, 2),
                                                   CANN_DOT_ROW(f32_dots, 3), CANN_DOT_ROW(f32_dots, 4)};
#undef CANN_DOT_ROW

// Every block of kTileW weight rows (in parallel) times every tile of rows of x (balanced: 16 rows
// run as 6 + 5 + 5). `kvals` is the k values per step (64 bytes of a weight row). Each tile prefetches a
// share of the next block in proportion to its rows, the block's 4 lines per step spread over all
// of its tiles; only where the weight's rows are contiguous (the next block is one region).
template <typename T>
void run_dots(const DotFn<T> (*table)[kTileX], const T* x, int64_t M, int64_t K, const T* w, int64_t ldw,
              int64_t N, const float* bias, T* y, int64_t ldy, int64_t kvals) {
  const int64_t NB = (N + kTileW - 1) / kTileW, n_tiles = (M + kTileX - 1) / kTileX;
  const int64_t steps = (K + kvals - 1) / kvals;
  const bool contiguous = ldw == K;
  at::parallel_for(0, NB, 8, [&](int64_t begin, int64_t end) {
    for (int64_t nb = begin; nb < end; ++nb) {
      const int64_t n0 = nb * kTileW, R = std::min<int64_t>(kTileW, N - n0);
      const T* blk = w + n0 * ldw;
      const char* pf = reinterpret_cast<const char*>(blk + kTileW * ldw);
      const bool prefetch = contiguous && nb + 1 < end && N - n0 >= 2 * kTileW;
      for (int64_t m0 = 0, t = 0, mb = 0; m0 < M; m0 += mb, ++t) {
        mb = M / n_tiles + (t < M % n_tiles);
        int pfl = prefetch ? static_cast<int>((kTileW * mb + M - 1) / M) : 0;
        // lines rounded up may run past the next block: never past the weight's end
        if (pfl && reinterpret_cast<const char*>(w + N * ldw) - pf < pfl * steps * 64) pfl = 0;
        table[R - 1][mb - 1](x + m0 * K, K, blk, ldw, K, bias ? bias + n0 : nullptr, y + m0 * ldy + n0, ldy, pf, pfl);
        pf += pfl * steps * 64;
      }
    }
  });
}

// With more rows the roles swap (run_cols): x is packed once per call as the vector operand, 16
// rows of x per zmm (bf16: per k pair, each row's two values in one 32-bit lane, vdpbf16ps's
// layout; fp32: per k, the rows' values), and each weight value (pair) is broadcast to the C x
// vectors. A tile is R weight rows (R x C = 24 accumulators), read once, front to back, with no
// horizontal sums; its sums go through a scratch into y's columns. Rows of x past M are zero lanes,
// so it pays only where few are: C = 2-4 vectors at most 1/8 empty (cols_for). On the 0.6B
// projections in bf16 it ran 32 rows 1.07x and 48-64 rows 1.13-1.16x faster than the tiles above,
// 17-24 rows 0.63-0.85x, 40 and 56 level (BENCHMARKS.md, "twenty-seventh pass").
template <int R, int C>
CANN_BF16_TARGET inline void bf16_cols(const int32_t* xp, const uint16_t* w, int64_t ldw, int64_t K, float* out,
                                       const char* pf, int pfl) {
  constexpr int64_t Mp = 16 * C;
  __m512 acc[R][C];
#pragma GCC unroll 12
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  const int32_t* wr[R];
  for (int r = 0; r < R; ++r) wr[r] = reinterpret_cast<const int32_t*>(w + r * ldw);
  for (int64_t kp = 0; kp < K / 2; ++kp) {
    if ((kp & 15) == 0) {  // 16 pairs: one line of each weight row
      prefetch_l2(pf, pfl);
      pf += pfl * 64;
    }
    __m512bh xv[C];
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) xv[c] = (__m512bh)_mm512_loadu_si512(xp + kp * Mp + 16 * c);
#pragma GCC unroll 12
    for (int r = 0; r < R; ++r) {
      const __m512bh b = (__m512bh)_mm512_set1_epi32(wr[r][kp]);
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], xv[c], b);
    }
  }
#pragma GCC unroll 12
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(out + r * Mp + 16 * c, acc[r][c]);
}

template <int R, int C>
CANN_F32_TARGET inline void f32_cols(const int32_t* xp, const float* w, int64_t ldw, int64_t K, float* out,
                                     const char* pf, int pfl) {
  constexpr int64_t Mp = 16 * C;
  __m512 acc[R][C];
#pragma GCC unroll 12
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  const float* xf = reinterpret_cast<const float*>(xp);
  for (int64_t k = 0; k < K; ++k) {
    if ((k & 15) == 0) {  // 16 values: one line of each weight row
      prefetch_l2(pf, pfl);
      pf += pfl * 64;
    }
    __m512 xv[C];
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) xv[c] = _mm512_loadu_ps(xf + k * Mp + 16 * c);
#pragma GCC unroll 12
    for (int r = 0; r < R; ++r) {
      const __m512 b = _mm512_set1_ps(w[r * ldw + k]);
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_fmadd_ps(xv[c], b, acc[r][c]);
    }
  }
#pragma GCC unroll 12
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(out + r * Mp + 16 * c, acc[r][c]);
}

// How many x vectors run_cols takes for M rows: 2-4 with at most 1/8 of their lanes empty, else
// 0 (the tiles run the call). bf16 also needs K even (whole pairs).
inline int cols_for(int64_t M, int64_t K, bool bf16) {
  const int64_t C = (M + 15) / 16;
  return C >= 2 && C <= 4 && M >= 14 * C && (!bf16 || K % 2 == 0) ? static_cast<int>(C) : 0;
}

// Weight rows [0, N) of y (row stride ldy) for M rows of x, R = 24 / C rows a tile, in parallel;
// the caller runs the last N % R rows on the tiles. x is packed once: (lanes per row, 16 C) 32-bit
// lanes, rows past M zero (one thread; 128-768 KB at the 0.6B shape's K and 64 rows, ~1% of a
// batch-64 step, not measured apart). Each tile prefetches the next block (the weight's rows
// contiguous), its lines spread over the tile's steps.
template <typename T, int C>
void run_cols(const T* x, int64_t M, int64_t K, const T* w, int64_t ldw, int64_t N, const float* bias, T* y,
              int64_t ldy) {
  constexpr int R = 24 / C;
  constexpr int64_t Mp = 16 * C;
  constexpr bool bf16 = sizeof(T) == 2;
  const int64_t lanes = bf16 ? K / 2 : K;  // 32-bit lanes per row of x
  std::vector<int32_t> xp(lanes * Mp, 0);
  for (int64_t m = 0; m < M; ++m) {
    const auto* row = reinterpret_cast<const int32_t*>(x + m * K);
    for (int64_t l = 0; l < lanes; ++l) xp[l * Mp + m] = row[l];
  }
  const int64_t steps = (lanes + 15) / 16, lines = (R * K * static_cast<int64_t>(sizeof(T)) + 63) / 64;
  const char* stop = reinterpret_cast<const char*>(w + N * ldw);
  at::parallel_for(0, N / R, 4, [&](int64_t begin, int64_t end) {
    std::vector<float> out(R * Mp);
    for (int64_t nb = begin; nb < end; ++nb) {
      const int64_t n0 = nb * R;
      const T* blk = w + n0 * ldw;
      const char* pf = reinterpret_cast<const char*>(blk + R * ldw);
      int pfl = ldw == K && nb + 1 < end ? static_cast<int>((lines + steps - 1) / steps) : 0;
      if (stop - pf < pfl * steps * 64) pfl = 0;  // never past the weight's end
      if constexpr (bf16) {
        bf16_cols<R, C>(xp.data(), blk, ldw, K, out.data(), pf, pfl);
      } else {
        f32_cols<R, C>(xp.data(), blk, ldw, K, out.data(), pf, pfl);
      }
      for (int64_t m = 0; m < M; ++m)
        for (int r = 0; r < R; ++r) {
          const float v = out[r * Mp + m] + (bias ? bias[n0 + r] : 0.0f);
          if constexpr (bf16) {
            y[m * ldy + n0 + r] = c10::BFloat16(v).x;  // round to nearest even, as aten does
          } else {
            y[m * ldy + n0 + r] = v;
          }
        }
    }
  });
}

// dot_linear's loop for either dtype: run_cols where cols_for says so, the tiles for the rest.
template <typename T>
void run_dot_linear(const DotFn<T> (*tiles)[kTileX], const T* x, int64_t M, int64_t K, const T* w, int64_t ldw,
                    int64_t N, const float* bias, T* y) {
  constexpr bool bf16 = sizeof(T) == 2;
  int64_t done = 0;
  switch (cols_for(M, K, bf16)) {
    case 2:
      done = N / 12 * 12;
      run_cols<T, 2>(x, M, K, w, ldw, done, bias, y, N);
      break;
    case 3:
      done = N / 8 * 8;
      run_cols<T, 3>(x, M, K, w, ldw, done, bias, y, N);
      break;
    case 4:
      done = N / 6 * 6;
      run_cols<T, 4>(x, M, K, w, ldw, done, bias, y, N);
      break;
    default:
      break;
  }
  if (done < N)
    run_dots<T>(tiles, x, M, K, w + done * ldw, ldw, N - done, bias ? bias + done : nullptr, y + done, N,
                bf16 ? 32 : 16);
}

template <typename T>
using RowFn = void (*)(const T*, int64_t, const T*, int64_t, float, T*, int64_t);
// With the look-ahead where it was measured faster (kRowAhead): one bf16 row, one or two fp32 rows.
// 3-4 rows go to dot_linear on the eager path of the CPUs these loops run on, and were left as they are.
constexpr RowFn<uint16_t> kBf16[kMaxRows] = {bf16_row<1, true>, bf16_row<2>, bf16_row<3>, bf16_row<4>};
constexpr RowFn<float> kF32[kMaxRows] = {f32_row<1, true>, f32_row<2, true>, f32_row<3>, f32_row<4>};

// --- AVX2 + FMA (16 ymm registers), for a CPU without AVX-512 (or, in bf16, without AVX512-BF16) ---
// x is fp32 here in either dtype (converted once per call, in cache). A bf16 weight row is read 16
// values (32 bytes) at a time and widened in registers: a bf16 value is the high half of an fp32
// one, so a shift gives the values at even k and a mask the values at odd k. x is stored to match
// (split_x): per 16 k values, the 8 at even k, then the 8 at odd k. The k values past the last
// whole 16 are summed in scalar code.
#define CANN_AVX2_TARGET __attribute__((target("avx2,fma")))

CANN_AVX2_TARGET inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline float widen(uint16_t v) { return c10::BFloat16(v, c10::BFloat16::from_bits()); }

// 16 weight values from `k` on as two fp32 vectors: the values at even and at odd k (bf16), or
// k..k+7 and k+8..k+15 (fp32).
template <bool kBf16>
CANN_AVX2_TARGET inline void load16(const void* wv, int64_t k, __m256& w0, __m256& w1) {
  if constexpr (kBf16) {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(wv) + k));
    w0 = _mm256_castsi256_ps(_mm256_slli_epi32(raw, 16));
    w1 = _mm256_castsi256_ps(_mm256_and_si256(raw, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
  } else {
    w0 = _mm256_loadu_ps(static_cast<const float*>(wv) + k);
    w1 = _mm256_loadu_ps(static_cast<const float*>(wv) + k + 8);
  }
}

// Half h of load16's pair: one vector, so that a loop can hold fewer weights in registers (a bf16
// weight's 32 bytes are read again for the second half, from L1). kShifts: the odd-k half by two
// shifts instead of a mask, which needs no register for the mask (see avx2_dots).
template <bool kBf16, bool kShifts = false>
CANN_AVX2_TARGET inline __m256 load8(const void* wv, int64_t k, int h) {
  if constexpr (kBf16) {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(wv) + k));
    if (h == 0) return _mm256_castsi256_ps(_mm256_slli_epi32(raw, 16));
    if constexpr (kShifts) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_srli_epi32(raw, 16), 16));
    return _mm256_castsi256_ps(_mm256_and_si256(raw, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
  } else {
    return _mm256_loadu_ps(static_cast<const float*>(wv) + k + 8 * h);
  }
}

// How far ahead in the weight row the bf16 AVX2 loop asks for its next line (into L1). In one
// process against the loop without it (the 0.6B projections, 7 alternating rounds, two runs) it read
// 1.05-1.11x faster at 1 row and 1.08-1.13x at 4; 4 KB ahead was slower at 1 row (0.84-0.90x). fp32
// keeps the loop without it: 0.89-0.93x at 1 row (BENCHMARKS.md, "twentieth pass").
constexpr int64_t kAvx2Ahead = 1024;

// One output of MB rows, AVX2. kBf16: the weight is bf16, x split as above; else both are fp32.
// Two accumulators per row and 16 k values (two 8-wide halves), two 16-value steps per iteration
// with one or two rows (8 accumulators), one with three or four.
template <int MB, bool kBf16>
CANN_AVX2_TARGET inline void avx2_row(const float* x, int64_t ldx, const void* wv, int64_t K, float bias, void* yv,
                                      int64_t ldy) {
  constexpr int U = MB <= 2 ? 2 : 1;
  __m256 acc[MB][2 * U];
#pragma GCC unroll 4
  for (int m = 0; m < MB; ++m)
#pragma GCC unroll 4
    for (int u = 0; u < 2 * U; ++u) acc[m][u] = _mm256_setzero_ps();
  const int64_t K16 = K / 16 * 16;
  int64_t k = 0;
  for (; k + 16 * U <= K16; k += 16 * U) {
    if constexpr (kBf16) _mm_prefetch(static_cast<const char*>(wv) + 2 * k + kAvx2Ahead, _MM_HINT_T0);
#pragma GCC unroll 2
    for (int u = 0; u < U; ++u) {
      __m256 w0, w1;
      load16<kBf16>(wv, k + 16 * u, w0, w1);
#pragma GCC unroll 4
      for (int m = 0; m < MB; ++m) {
        acc[m][2 * u] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + m * ldx + k + 16 * u), acc[m][2 * u]);
        acc[m][2 * u + 1] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + m * ldx + k + 16 * u + 8), acc[m][2 * u + 1]);
      }
    }
  }
  for (; k < K16; k += 16) {  // one 16-value step left over (U = 2)
    __m256 w0, w1;
    load16<kBf16>(wv, k, w0, w1);
#pragma GCC unroll 4
    for (int m = 0; m < MB; ++m) {
      acc[m][0] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + m * ldx + k), acc[m][0]);
      acc[m][1] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + m * ldx + k + 8), acc[m][1]);
    }
  }
#pragma GCC unroll 4
  for (int m = 0; m < MB; ++m) {
    __m256 sum = acc[m][0];
#pragma GCC unroll 4
    for (int u = 1; u < 2 * U; ++u) sum = _mm256_add_ps(sum, acc[m][u]);
    float s = hsum8(sum) + bias;
    for (int64_t t = K16; t < K; ++t) {
      const float w = kBf16 ? widen(static_cast<const uint16_t*>(wv)[t]) : static_cast<const float*>(wv)[t];
      s += w * x[m * ldx + t];
    }
    if constexpr (kBf16) {
      static_cast<c10::BFloat16*>(yv)[m * ldy] = c10::BFloat16(s);  // round to nearest even, as aten does
    } else {
      static_cast<float*>(yv)[m * ldy] = s;
    }
  }
}

using Avx2RowFn = void (*)(const float*, int64_t, const void*, int64_t, float, void*, int64_t);
constexpr Avx2RowFn kAvx2Bf16[kMaxRows] = {avx2_row<1, true>, avx2_row<2, true>, avx2_row<3, true>,
                                           avx2_row<4, true>};
constexpr Avx2RowFn kAvx2F32[kMaxRows] = {avx2_row<1, false>, avx2_row<2, false>, avx2_row<3, false>,
                                          avx2_row<4, false>};

// x (M, K) in fp32 as the bf16 loop reads it: per whole 16 k values, the 8 at even k then the 8 at
// odd k; the rest in order. One loop into one new tensor: the chain of aten views and copies it
// replaces cost ~16 us a call, a third of a 2 MB projection's time from cache.
at::Tensor split_x(const at::Tensor& x) {
  const int64_t M = x.size(0), K = x.size(1), K16 = K / 16 * 16;
  at::Tensor xf = at::empty({M, K}, x.options().dtype(at::kFloat));
  const auto* src = reinterpret_cast<const uint16_t*>(x.data_ptr());
  float* dst = xf.data_ptr<float>();
  for (int64_t m = 0; m < M; ++m, src += K, dst += K) {
    for (int64_t k = 0; k < K16; k += 16)
      for (int j = 0; j < 8; ++j) {
        dst[k + j] = widen(src[k + 2 * j]);
        dst[k + 8 + j] = widen(src[k + 2 * j + 1]);
      }
    for (int64_t k = K16; k < K; ++k) dst[k] = widen(src[k]);
  }
  return xf;
}

// --- dot_linear on AVX2: tiles of kAvx2TileW weight rows x up to kAvx2TileX rows of x ---
// The AVX-512 tiles' design in 16 ymm registers: per 16 k values a tile loads each weight row's
// values one 8-wide half at a time (load16's halves: k..k+7 and k+8..k+15 in fp32, even and odd k
// in bf16, with x split to match) and FMAs them into 3 x 4 = 12 accumulators (+ 3 weights + 1 x).
// A block of 3 weight rows (36 KB at K = 3072) is read from memory by its first tile of rows and
// from L2 by the others. One horizontal sum per output; the k values past the last whole 16 are
// summed in scalar code.
constexpr int kAvx2TileW = 3;
constexpr int kAvx2TileX = 4;

template <int R, int S, bool kBf16>
CANN_AVX2_TARGET inline void avx2_dots(const float* x, int64_t ldx, const void* wv, int64_t ldw, int64_t K,
                                       const float* bias, void* yv, int64_t ldy, const char* pf, int pfl) {
  const size_t wsize = kBf16 ? 2 : 4;
  const char* w = static_cast<const char*>(wv);
  __m256 acc[S][R];
#pragma GCC unroll 4
  for (int s = 0; s < S; ++s)
#pragma GCC unroll 3
    for (int r = 0; r < R; ++r) acc[s][r] = _mm256_setzero_ps();
  // A full tile (3 x 4) fills all 16 ymm registers; bf16's mask was a 17th, and GCC kept one
  // accumulator on the stack, a store and a reload in its chain twice per 16 k values. Two shifts
  // need no register: the 0.6B projections in 0.79x the time at 4 rows, 0.87x at 7 (4 + 3); the
  // smaller tiles keep the mask, one op less (1.04-1.08x slower with the shifts at 5 and 6 rows;
  // BENCHMARKS.md, "fifty-first pass").
  constexpr bool kShifts = R * S + R + 1 >= 16;
  const int64_t K16 = K / 16 * 16;
  for (int64_t k = 0; k < K16; k += 16) {
    prefetch_l2(pf, pfl);
    pf += pfl * 64;
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {  // one half at a time: 12 accumulators + 3 weights + 1 x = 16 ymm
      __m256 wr[R];
#pragma GCC unroll 3
      for (int r = 0; r < R; ++r) wr[r] = load8<kBf16, kShifts>(w + r * ldw * wsize, k, h);
#pragma GCC unroll 4
      for (int s = 0; s < S; ++s) {
        const __m256 xv = _mm256_loadu_ps(x + s * ldx + k + 8 * h);
#pragma GCC unroll 3
        for (int r = 0; r < R; ++r) acc[s][r] = _mm256_fmadd_ps(wr[r], xv, acc[s][r]);
      }
    }
  }
#pragma GCC unroll 4
  for (int s = 0; s < S; ++s)
#pragma GCC unroll 3
    for (int r = 0; r < R; ++r) {
      const char* row = w + r * ldw * wsize;
      float v = hsum8(acc[s][r]) + (bias ? bias[r] : 0.0f);
      for (int64_t t = K16; t < K; ++t) {
        const float wt = kBf16 ? widen(reinterpret_cast<const uint16_t*>(row)[t]) : reinterpret_cast<const float*>(row)[t];
        v += wt * x[s * ldx + t];
      }
      if constexpr (kBf16) {
        static_cast<c10::BFloat16*>(yv)[s * ldy + r] = c10::BFloat16(v);  // round to nearest even, as aten does
      } else {
        static_cast<float*>(yv)[s * ldy + r] = v;
      }
    }
}

using Avx2DotFn = void (*)(const float*, int64_t, const void*, int64_t, int64_t, const float*, void*, int64_t,
                           const char*, int);

// The tile functions by [R - 1][S - 1].
#define CANN_AVX2_DOT_ROW(R, B) {avx2_dots<R, 1, B>, avx2_dots<R, 2, B>, avx2_dots<R, 3, B>, avx2_dots<R, 4, B>}
constexpr Avx2DotFn kAvx2Bf16Dots[kAvx2TileW][kAvx2TileX] = {
    CANN_AVX2_DOT_ROW(1, true), CANN_AVX2_DOT_ROW(2, true), CANN_AVX2_DOT_ROW(3, true)};
constexpr Avx2DotFn kAvx2F32Dots[kAvx2TileW][kAvx2TileX] = {
    CANN_AVX2_DOT_ROW(1, false), CANN_AVX2_DOT_ROW(2, false), CANN_AVX2_DOT_ROW(3, false)};
#undef CANN_AVX2_DOT_ROW

// Every block of kAvx2TileW weight rows (in parallel) times every tile of rows of x (balanced: 10
// rows run as 4 + 3 + 3). x is fp32 (split in bf16), (M, K); y is (M, N) in the weight's dtype.
// Each tile prefetches a share of the next block into L2 in proportion to its rows (the block's
// lines a step given out once: with many tiles the last ones prefetch nothing), where the weight's
// rows are contiguous.
void run_avx2_dots(const Avx2DotFn (*table)[kAvx2TileX], const float* x, int64_t M, int64_t K, const char* w,
                   int64_t ldw, size_t wsize, int64_t N, const float* bias, char* y) {
  const int64_t NB = (N + kAvx2TileW - 1) / kAvx2TileW, n_tiles = (M + kAvx2TileX - 1) / kAvx2TileX;
  const int64_t steps = K / 16, step_lines = (kAvx2TileW * 16 * static_cast<int64_t>(wsize) + 63) / 64;
  const bool contiguous = ldw == K;
  const char* stop = w + N * ldw * wsize;
  at::parallel_for(0, NB, 8, [&](int64_t begin, int64_t end) {
    for (int64_t nb = begin; nb < end; ++nb) {
      const int64_t n0 = nb * kAvx2TileW, R = std::min<int64_t>(kAvx2TileW, N - n0);
      const char* blk = w + n0 * ldw * wsize;
      const char* pf = blk + kAvx2TileW * ldw * wsize;
      const bool prefetch = contiguous && nb + 1 < end && N - n0 >= 2 * kAvx2TileW;
      int64_t unassigned = prefetch ? step_lines : 0;  // lines a step of the next block, not yet any tile's
      for (int64_t m0 = 0, t = 0, mb = 0; m0 < M; m0 += mb, ++t) {
        mb = M / n_tiles + (t < M % n_tiles);
        int pfl = static_cast<int>(std::min(unassigned, (step_lines * mb + M - 1) / M));
        unassigned -= pfl;
        if (pfl && stop - pf < pfl * steps * 64) pfl = 0;  // never past the weight's end
        table[R - 1][mb - 1](x + m0 * K, K, blk, ldw, K, bias ? bias + n0 : nullptr, y + (m0 * N + n0) * wsize, N,
                             pf, pfl);
        pf += pfl * steps * 64;
      }
    }
  });
}

// Every output n of the weight (N, K), rows `ldw` bytes apart, in parallel: fn(x, K, row n, K,
// bias, y + n, N). T is x's type, W the weight's, Y y's. The outputs go out in blocks of
// kShareBlock, a thread's share in order (one stream) and then another's last blocks
// (cann::leftovers_for), on at most one thread per kGrain outputs. Against the fixed split, on the
// AVX2 kind (Zen 3), alternating rounds on one runner: the batch-1 ge_graph step 0.953x the time
// in bf16 (11 rounds, 8 faster), SK decoder 0.966x, fp32 ge_graph 0.988x (9 rounds; BENCHMARKS.md,
// "forty-eighth pass"; the AVX-512 kind not measured). perf had the main thread 52.7 ms a step in
// this kernel there, the other 48.3.
template <typename T, typename W, typename Y, typename Fn>
void run(Fn fn, const T* x, int64_t M, const W* w, int64_t ldw, int64_t N, int64_t K, const float* bias, Y* y) {
  const char* base = reinterpret_cast<const char*>(w);
  const int64_t NB = (N + kShareBlock - 1) / kShareBlock;
  cann::leftovers_for(NB, [&](int64_t nb, bool) {
    for (int64_t n = nb * kShareBlock, end = std::min(N, n + kShareBlock); n < end; ++n)
      fn(x, K, reinterpret_cast<const W*>(base + n * ldw), K, bias ? bias[n] : 0.0f, y + n, N);
  }, (N + kGrain - 1) / kGrain);
}

// run's loop for one row of x on pair: blocks of 2 kPairGap outputs, each as kPairGap pairs (n, n +
// kPairGap), shared out as run shares its blocks; the outputs past the last whole block go one at
// a time to row (one stream).
template <typename T, typename PairFn, typename RowFn>
void run_pairs(PairFn pair, RowFn row, const T* x, const T* w, int64_t ldw, int64_t N, int64_t K, const float* bias,
               T* y) {
  constexpr int64_t block = 2 * kPairGap;
  const int64_t whole = N / block;
  cann::leftovers_for(whole + (N % block != 0), [&](int64_t nb, bool) {
    const int64_t n0 = nb * block;
    if (nb == whole) {
      for (int64_t n = n0; n < N; ++n) row(x, K, w + n * ldw, K, bias ? bias[n] : 0.0f, y + n, N);
      return;
    }
    for (int64_t n = n0, m = n0 + kPairGap; n < n0 + kPairGap; ++n, ++m)
      pair(x, w + n * ldw, w + m * ldw, K, bias ? bias[n] : 0.0f, bias ? bias[m] : 0.0f, y + n, y + m);
  }, (N + kGrain - 1) / kGrain);
}

// Whether one row of x runs two weight rows at a time (run_pairs): on an Intel CPU; asked once.
bool pairs_run() {
  static const bool intel = __builtin_cpu_is("intel");
  return intel;
}
#endif

#ifdef CANN_GEMV
// Which loop runs `dtype` on this CPU: the AVX-512 one where it can, else the AVX2 one.
bool avx512_for(at::ScalarType dtype) {
  return dtype == at::kBFloat16 ? __builtin_cpu_supports("avx512bf16") : __builtin_cpu_supports("avx512f");
}
#endif

bool gemv_supported(at::ScalarType dtype) {
#ifdef CANN_GEMV
  if (dtype != at::kBFloat16 && dtype != at::kFloat) return false;
  return avx512_for(dtype) || (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"));
#endif
  return false;
}

// What gemv and dot_linear check and prepare alike: a bf16 or fp32 weight (N, K) as stored, rows
// contiguous, x of its dtype as (M, K) contiguous rows with 1 <= M <= max_rows, the bias in fp32
// and y allocated. `supported` is whether this CPU runs the op's loop for the dtype, `missing`
// what it lacks otherwise; `op` names the kernel in every message.
struct StoredCall {
  at::ScalarType dtype;
  at::Tensor x2, fbias, y;
  int64_t M, N, K;
};

StoredCall stored_call(const char* op, const at::Tensor& x, const at::Tensor& weight,
                       const c10::optional<at::Tensor>& bias, bool supported, const char* missing, int64_t max_rows) {
  const at::ScalarType dtype = weight.scalar_type();
  TORCH_CHECK(dtype == at::kBFloat16 || dtype == at::kFloat, op, ": the weight must be bf16 or fp32");
  TORCH_CHECK(x.scalar_type() == dtype, op, ": x is ", x.scalar_type(), ", the weight ", dtype);
  TORCH_CHECK(supported, op, ": this CPU has ", missing);
  TORCH_CHECK(weight.dim() == 2 && weight.stride(1) == 1, op, ": the weight must be (N, K) with contiguous rows");
  const int64_t N = weight.size(0), K = weight.size(1);
  TORCH_CHECK(x.size(-1) == K, op, ": x has ", x.size(-1), " columns, the weight ", K);
  at::Tensor x2 = x.reshape({-1, K}).contiguous();
  const int64_t M = x2.size(0);
  TORCH_CHECK(M >= 1 && M <= max_rows, op, ": takes 1 to ", max_rows, " rows, got ", M);
  return {dtype, x2, cann::fp32_bias(bias, N, op), cann::linear_output(x, N), M, N, K};
}

at::Tensor gemv(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  const at::ScalarType wtype = weight.scalar_type();
  const auto [dtype, x2, fbias, y, M, N, K] =
      stored_call("gemv", x, weight, bias, gemv_supported(wtype), "neither AVX-512 nor AVX2 and FMA", kMaxRows);
#ifdef CANN_GEMV
  const float* bp = fbias.defined() ? fbias.data_ptr<float>() : nullptr;
  if (!avx512_for(dtype)) {
    const bool bf16 = dtype == at::kBFloat16;  // the bf16 loop rounds each output to bf16 itself
    const at::Tensor xf = bf16 ? split_x(x2) : x2;
    const int64_t ldw = weight.stride(0) * weight.element_size();
    if (bf16) {
      run<float, void>(kAvx2Bf16[M - 1], xf.data_ptr<float>(), M, weight.data_ptr(), ldw, N, K, bp,
                       reinterpret_cast<c10::BFloat16*>(y.data_ptr()));
    } else {
      run<float, void>(kAvx2F32[M - 1], xf.data_ptr<float>(), M, weight.data_ptr(), ldw, N, K, bp, y.data_ptr<float>());
    }
  } else if (dtype == at::kBFloat16 && M == 1 && pairs_run()) {
    run_pairs<uint16_t>(bf16_pair, kBf16[0], reinterpret_cast<const uint16_t*>(x2.data_ptr()),
                        reinterpret_cast<const uint16_t*>(weight.data_ptr()), weight.stride(0), N, K, bp,
                        reinterpret_cast<uint16_t*>(y.data_ptr()));
  } else if (dtype == at::kBFloat16) {
    run<uint16_t, uint16_t>(kBf16[M - 1], reinterpret_cast<const uint16_t*>(x2.data_ptr()), M,
                            reinterpret_cast<const uint16_t*>(weight.data_ptr()), weight.stride(0) * 2, N, K, bp,
                            reinterpret_cast<uint16_t*>(y.data_ptr()));
  } else {
    run<float, float>(kF32[M - 1], x2.data_ptr<float>(), M, weight.data_ptr<float>(), weight.stride(0) * 4, N, K,
                      bp, y.data_ptr<float>());
  }
#endif
  return y;
}

bool dot_linear_supported(at::ScalarType dtype) {
  return gemv_supported(dtype);  // the same two loops: AVX-512 where it can, else AVX2 and FMA
}

at::Tensor dot_linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  const at::ScalarType wtype = weight.scalar_type();
  const auto [dtype, x2, fbias, y, M, N, K] = stored_call("dot_linear", x, weight, bias, dot_linear_supported(wtype),
                                                         "neither AVX-512 nor AVX2 and FMA", kDotMaxRows);
#ifdef CANN_GEMV
  const float* bp = fbias.defined() ? fbias.data_ptr<float>() : nullptr;
  if (!avx512_for(dtype)) {
    const bool bf16 = dtype == at::kBFloat16;
    const at::Tensor xf = bf16 ? split_x(x2) : x2;
    run_avx2_dots(bf16 ? kAvx2Bf16Dots : kAvx2F32Dots, xf.data_ptr<float>(), M, K,
                  static_cast<const char*>(weight.data_ptr()), weight.stride(0), weight.element_size(), N, bp,
                  static_cast<char*>(y.data_ptr()));
  } else if (dtype == at::kBFloat16) {
    run_dot_linear<uint16_t>(kBf16Dots, reinterpret_cast<const uint16_t*>(x2.data_ptr()), M, K,
                             reinterpret_cast<const uint16_t*>(weight.data_ptr()), weight.stride(0), N, bp,
                             reinterpret_cast<uint16_t*>(y.data_ptr()));
  } else {
    run_dot_linear<float>(kF32Dots, x2.data_ptr<float>(), M, K, weight.data_ptr<float>(), weight.stride(0), N, bp,
                          y.data_ptr<float>());
  }
#endif
  return y;
}

// aten's linear as one opaque call (executor/backends/graph_passes.py, blas_linear): in a SuperKernel
// launch unit Inductor decomposes every single-row product of K, N <= 2048 into generated loops,
// and a call of this op is not a product it sees.
at::Tensor blas_linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  return at::linear(x, weight, bias);
}

}  // namespace

TORCH_LIBRARY_IMPL(cann_cpu, CPU, m) {
  m.impl("gemv", gemv);
  m.impl("dot_linear", dot_linear);
  m.impl("blas_linear", blas_linear);
}
TORCH_LIBRARY_IMPL(cann_cpu, CompositeExplicitAutograd, m) {
  m.impl("gemv_supported", gemv_supported);
  m.impl("dot_linear_supported", dot_linear_supported);
}
