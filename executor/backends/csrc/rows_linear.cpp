// CPU kernel of cann_cpu::rows_linear (schema, packing and use: executor/backends/packed_linear.py).
//
// y = x W^T + b for a few rows of x (a batched decode step: M = batch) on a weight W (N, K) packed
// once for the vector unit, in bf16 or fp32. Two loops, chosen by the packed layout:
// - AVX-512, 64-column blocks:
//   - bf16: (N/64, K/2, 64, 2), for each block of 64 output columns the K/2 pairs of consecutive k
//     values, 64 columns each: the operand layout of AVX512-BF16's vdpbf16ps, which multiplies 16
//     column pairs by one broadcast pair of x and adds both products into fp32;
//   - fp32: (N/64, K, 64), for each block of 64 output columns its K rows of 64: one FMA per 16
//     columns and broadcast x value.
// - AVX2 + FMA, 16-column blocks, (N/16, K, 16) in either dtype (bf16 widened in registers): for a
//   CPU without AVX-512, or without AVX512-BF16 in bf16 (further down).
// A weight as stored, (N, K), is packed a block at a time as the loop goes: by the AVX-512 bf16 loop
// where it runs (run_plain_bf16), by the AVX2 loop otherwise (run_avx2_plain).
//
// Why a kernel: at M = 1-64 a decode GEMM streams the whole weight once per step. oneDNN on a
// weight packed for the row count read the Qwen3-0.6B projections at 0.73-0.78x of a plain fp32
// sum's rate at M = 4 in bf16 (0.57-0.77x in fp32) on the 2-core reference machine; this loop reads
// them at 0.97-1.0x, and at M = 16 and 64 (compute-bound) reaches 327-416 bf16 GFLOP/s against
// oneDNN's 291-343 (BENCHMARKS.md, "eighth" and "ninth pass"; the Python side caps the rows where
// the whole decode step measured faster). A tile is up to 6 rows x 64 columns: 24 fp32
// accumulators, 4 weight registers and one broadcast, no horizontal reduction; each weight block
// is read from memory once and from cache by the further tiles of rows, while they prefetch the
// next block (run_tiles). Blocking K as well (to keep a block in L1 across row tiles) measured
// slower: 0.6-0.9x at M = 16-64 with chunks of 16-256 k steps (BENCHMARKS.md, "tenth pass"). On
// the Intel AMX kind in fp32 (chunks of 64 and 256 steps, the sums carried through y) it read
// level: 0.75 / 0.70 of a sum's rate against 0.67 at 16 rows, 0.34 / 0.34 against 0.34 at 64, where
// the 6-row tile alone ran 153 GFLOP/s a core from L1 and 143 from L2 ("seventy-third pass").
//
// The vector code is compiled for AVX-512 or AVX2 per function (target attribute), so the library
// builds with the project's usual flags on any x86-64 host; rows_supported(dtype, cols) says
// whether this CPU can run a loop, and the Python side never calls the kernel where it cannot.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "linear_io.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define CANN_ROWS 1
#endif

namespace {

constexpr int64_t kCols = 64;  // output columns per block: 4 zmm of 16 fp32
constexpr int kRows = 6;        // rows per tile: 6 x 4 accumulators + 4 weights + 1 broadcast <= 32 zmm
constexpr int64_t kOwnAhead = 32;  // k steps a single fp32 tile asks for its own block ahead (8 KB; run_tiles)

#ifdef CANN_ROWS
#define CANN_BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
#define CANN_F32_TARGET __attribute__((target("avx512f")))

// Touch `lines` cache lines from `pf` on into L2: the caller's share of the next block (run_tiles).
inline void prefetch_lines(const char* pf, int lines) {
  for (int i = 0; i < lines; ++i) _mm_prefetch(pf + i * 64, _MM_HINT_T1);
}

// One bf16 tile: MB rows of x (row stride ldx) times one packed 64-column block (K2 pairs); each
// pair step also prefetches `pfl` lines from `pf` on. It asks for nothing of its own block ahead
// (the fp32 tile's `ahead`), which was slower on Zen 4 (run_tiles).
template <int MB>
CANN_BF16_TARGET inline void bf16_tile(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t K2,
                                       const float* bias, uint16_t* y, int64_t ldy, const char* pf, int pfl,
                                       int64_t /*ahead*/) {
  __m512 acc[MB][4];
  for (int m = 0; m < MB; ++m)
    for (int c = 0; c < 4; ++c) acc[m][c] = bias ? _mm512_loadu_ps(bias + c * 16) : _mm512_setzero_ps();
  const int32_t* xr[MB];  // each row as k pairs: one 32-bit lane holds x[2k], x[2k + 1]
  for (int m = 0; m < MB; ++m) xr[m] = reinterpret_cast<const int32_t*>(x + m * ldx);
  for (int64_t kp = 0; kp < K2; ++kp) {
    const uint16_t* wk = w + kp * 2 * kCols;
    prefetch_lines(pf + kp * pfl * 64, pfl);
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(wk);
    const __m512bh w1 = (__m512bh)_mm512_loadu_si512(wk + 32);
    const __m512bh w2 = (__m512bh)_mm512_loadu_si512(wk + 64);
    const __m512bh w3 = (__m512bh)_mm512_loadu_si512(wk + 96);
    for (int m = 0; m < MB; ++m) {
      const __m512bh b = (__m512bh)_mm512_set1_epi32(xr[m][kp]);
      acc[m][0] = _mm512_dpbf16_ps(acc[m][0], w0, b);
      acc[m][1] = _mm512_dpbf16_ps(acc[m][1], w1, b);
      acc[m][2] = _mm512_dpbf16_ps(acc[m][2], w2, b);
      acc[m][3] = _mm512_dpbf16_ps(acc[m][3], w3, b);
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int c = 0; c < 4; ++c)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + m * ldy + c * 16), (__m256i)_mm512_cvtneps_pbh(acc[m][c]));
}

// One fp32 tile: MB rows of x (row stride ldx) times one packed 64-column block (K rows of 64);
// each k step also prefetches `pfl` lines from `pf` on (into L2) and, with `ahead` > 0, its own
// block's 4 lines `ahead` steps on (into L1), never past the block's end.
template <int MB>
CANN_F32_TARGET inline void f32_tile(const float* x, int64_t ldx, const float* w, int64_t K, const float* bias,
                                     float* y, int64_t ldy, const char* pf, int pfl, int64_t ahead) {
  __m512 acc[MB][4];
  for (int m = 0; m < MB; ++m)
    for (int c = 0; c < 4; ++c) acc[m][c] = bias ? _mm512_loadu_ps(bias + c * 16) : _mm512_setzero_ps();
  const int64_t ahead_end = ahead > 0 ? K - ahead : 0;
  for (int64_t k = 0; k < K; ++k) {
    const float* wk = w + k * kCols;
    prefetch_lines(pf + k * pfl * 64, pfl);
    if (k < ahead_end) {
      const char* own = reinterpret_cast<const char*>(wk + ahead * kCols);
      for (int i = 0; i < 4; ++i) _mm_prefetch(own + i * 64, _MM_HINT_T0);
    }
    const __m512 w0 = _mm512_loadu_ps(wk);
    const __m512 w1 = _mm512_loadu_ps(wk + 16);
    const __m512 w2 = _mm512_loadu_ps(wk + 32);
    const __m512 w3 = _mm512_loadu_ps(wk + 48);
    for (int m = 0; m < MB; ++m) {
      const __m512 b = _mm512_set1_ps(x[m * ldx + k]);
      acc[m][0] = _mm512_fmadd_ps(w0, b, acc[m][0]);
      acc[m][1] = _mm512_fmadd_ps(w1, b, acc[m][1]);
      acc[m][2] = _mm512_fmadd_ps(w2, b, acc[m][2]);
      acc[m][3] = _mm512_fmadd_ps(w3, b, acc[m][3]);
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int c = 0; c < 4; ++c) _mm512_storeu_ps(y + m * ldy + c * 16, acc[m][c]);
}

template <typename T>
using TileFn = void (*)(const T*, int64_t, const T*, int64_t, const float*, T*, int64_t, const char*, int, int64_t);
constexpr TileFn<uint16_t> kBf16Tiles[kRows + 1] = {
    nullptr, bf16_tile<1>, bf16_tile<2>, bf16_tile<3>, bf16_tile<4>, bf16_tile<5>, bf16_tile<6>};
constexpr TileFn<float> kF32Tiles[kRows + 1] = {
    nullptr, f32_tile<1>, f32_tile<2>, f32_tile<3>, f32_tile<4>, f32_tile<5>, f32_tile<6>};

// k steps a single fp32 tile asks for its own block ahead: kOwnAhead on an Intel CPU, none elsewhere
// (run_tiles, below, says why). Asked once, before the first parallel region.
int64_t own_ahead() {
  static const int64_t ahead = __builtin_cpu_is("intel") ? kOwnAhead : 0;
  return ahead;
}

// Whether the larger tiles of rows run last (run_tiles): on an AMD CPU; asked once.
bool larger_last() {
  static const bool last = __builtin_cpu_is("amd");
  return last;
}

// Every tile of rows (M > 0) on one packed block `wb` (kstep steps), into y's block `yb` (row
// stride N). With `prefetch`, the tiles share out the 4 lines a step of the region at `pf` (the next
// block), as run_tiles (below) says.
template <typename T>
inline void block_tiles(const TileFn<T>* tiles, const T* x, int64_t M, int64_t K, const T* wb, int64_t kstep,
                        const float* bias, T* yb, int64_t N, const char* pf, bool prefetch, int64_t ahead) {
  const int64_t n_tiles = (M + kRows - 1) / kRows, base = M / n_tiles, extra = M % n_tiles;  // `extra`: a row more
  const bool last = larger_last();
  for (int64_t t = 0, m0 = 0; t < n_tiles; ++t) {
    const int64_t mb = base + (last ? t >= n_tiles - extra : t < extra);
    // tile t's share of the next block: as the larger-first split gives position t its rows
    const int64_t s0 = t * base + std::min(t, extra), s1 = s0 + base + (t < extra);
    const int pfl = prefetch ? static_cast<int>((4 * s1) / M - (4 * s0) / M) : 0;
    tiles[mb](x + m0 * K, K, wb, kstep, bias, yb + m0 * N, N, pf, pfl, ahead);
    pf += pfl * kstep * 64;
    m0 += mb;
  }
}

// Every 64-column block (in parallel, leftovers_for) times every tile of rows. `kstep` is the packed
// weight's k extent per block (K/2 pairs in bf16, K in fp32), 256 bytes (4 cache lines) per step.
//
// With more than kRows rows a block is run by several tiles, of balanced sizes (16 rows: 6 + 5 + 5,
// not 6 + 6 + 4; on AMD the larger last, below). The first tile reads the block from memory, the
// others from L2; alone, that left the memory bus idle while the later tiles computed. So every
// tile also prefetches a share of the next block into L2, in proportion to its rows: the stream is
// spread over the whole block's compute. On the 0.6B-shape projections (cold, one pass over all of
// them, 7 rounds) that ran M = 16 1.12-1.16x faster in fp32 and 1.15x in bf16, M = 32 1.05x / 1.17x
// and M = 64 0.98x / 1.10x than no prefetch (BENCHMARKS.md, "tenth pass"). The shares add up to the
// next block's 4 lines per step exactly (16 rows: 1 + 1 + 2), as in the AVX2 loop (avx2_block). Each tile's share
// rounded up instead (2 + 2 + 2 at 16 rows, 1 per tile at 64: 1.5 and 2.75 blocks ahead) ran the
// fp32 pass at 16 rows in 0.86-0.88x of that one's time and at 32 in 0.96x on the Intel AMX kind
// (in-process A/B, 9 alternating rounds, every round faster; BENCHMARKS.md, "fifty-eighth pass").
// The likely reason: a down_proj block (768 KB) computing plus one and a half in flight nearly fill
// that kind's 2 MB L2, so prefetched lines evict ones still to be read.
// Even so, the shares do not overlap the stream with the arithmetic there: in benchmarks/overlap_bench.py's
// probe of this loop the fp32 pass at 16-64 rows sits on the serial bound (stream time plus compute
// time), 1.15-1.33x faster than with no prefetch (BENCHMARKS.md, "seventy-sixth pass").
// On AMD Zen 4 the exact shares ran level with the rounded-up ones, in both dtypes at 16-64 rows
// (one build, the scheme switched at run time, 15-41 rounds in random order; "sixty-fourth pass").
// With one tile (2-6 rows) nothing streams the next block, and in fp32 on an Intel CPU the tile asks
// for its own block's lines 32 steps (8 KB) ahead into L1 instead, as the AVX2 loop does: on the
// Intel AMX kind the pass at 2-6 rows took 0.77-0.91x the time (in-process A/B, 9 alternating rounds,
// every round faster) and the fp32 batch-4 step 0.80x (ge_graph) / 0.83x (SK decoder; "fifty-eighth
// pass"). With several tiles, which read the block from L2, the same ran 8-64 rows level or up to
// 1.1x slower. On AMD Zen 4 the look-ahead cost instead: without it the pass at 2 / 4 / 6 rows took
// 0.91 / 0.88 / 0.90x the time (11 rounds, 10-11 of 11 faster; 4 KB ahead was no better), so an
// AMD CPU (Zen 5 unmeasured) asks for none (own_ahead). bf16's loop runs only on AMD (the AMX kind
// has its own) and asks for none either: 8 KB ahead made its pass at 4 rows 1.05x slower on Zen 4.
// On an AMD CPU the larger tiles run last (16 rows: 5 + 5 + 6), and each keeps the share of the next
// block that its position has in the larger-first split (1 + 1 + 2 lines a step): the block's first
// pass, the one that meets lines still arriving, is made by a smaller tile, and the largest share
// goes to a longer tile, at a lower rate. On Zen 4 (the 0.6B-shape projections, cold, one build
// switched at run time, 9-15 rounds in random order, a control arm) that ran 16 rows at 0.92-0.96x
// the time in bf16 and 0.91-0.95x in fp32, 14 rows at 0.96-0.97x in bf16 (level in fp32), 7, 13,
// 17, 22, 32 and 64 rows level, with the same outputs. Larger last with the shares of its own split
// (1 + 3 lines at 7 rows) ran 7 rows 1.15x slower, and each tile's exact share spread evenly over
// its steps read 0.93-1.06x by row count (BENCHMARKS.md, "sixty-seventh pass"). Intel CPUs keep the
// larger-first order (unmeasured there).
template <typename T>
void run_tiles(const TileFn<T>* tiles, const T* x, int64_t M, int64_t K, const T* w, int64_t NB, int64_t kstep,
               const float* bias, T* y) {
  if (M == 0) return;
  const int64_t N = NB * kCols, block = K * kCols, n_tiles = (M + kRows - 1) / kRows;
  const int64_t ahead = n_tiles == 1 && std::is_same_v<T, float> ? own_ahead() : 0;
  cann::leftovers_for(NB, [&](int64_t nb, bool next) {
    // next: block nb + 1 exists and is this thread's
    block_tiles(tiles, x, M, K, w + nb * block, kstep, bias ? bias + nb * kCols : nullptr, y + nb * kCols, N,
                reinterpret_cast<const char*>(w + (nb + 1) * block), n_tiles > 1 && next, ahead);
  });
}

// --- The AVX-512 bf16 loop on a weight as stored: bf16 products of many rows in the eager path ---
// Past dot_linear's 64 rows the eager bf16 path on an AVX512-BF16 CPU without AMX called aten's
// linear, which reorders the weight for oneDNN on every call: over the 0.6B projections it ran 360 /
// 373 GFLOP/s at 128 / 512 rows where this loop on the packed copy ran 396 / 421 (Zen 4). The eager
// path keeps no packed copy, so here each thread packs one 64-column block at a time into its own
// buffer, in pack_rows's layout, and runs every tile of rows on it; the next block's weight rows
// (one region where they are contiguous) are prefetched into L2 while a block computes, as
// run_tiles does for the packed weight. Packing a block is a 16 x 16 transpose of 32-bit k pairs per
// 16 rows and 16 pairs: over the 0.6B layers the loop took 1.078x / 1.029x the packed call's time at
// 128 / 512 rows (Zen 4; BENCHMARKS.md, "sixty-ninth pass"), more with fewer rows (where dot_linear
// stays ahead). Results are the packed call's, bit for bit.

// 16 x 16 transpose of 32-bit values: r[i] holds row i on entry, column i on return.
CANN_BF16_TARGET inline void transpose16(__m512i r[16]) {
  __m512i t[16];
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i) {  // rows 2i, 2i+1 interleaved by value
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i) {  // then by pairs: each 128-bit lane holds a 4 x 4 block, transposed
    r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
#pragma GCC unroll 4
  for (int j = 0; j < 4; ++j) {  // the 4 x 4 blocks moved between lanes, in two rounds
    t[j] = _mm512_shuffle_i32x4(r[j], r[4 + j], 0x88);
    t[4 + j] = _mm512_shuffle_i32x4(r[j], r[4 + j], 0xdd);
    t[8 + j] = _mm512_shuffle_i32x4(r[8 + j], r[12 + j], 0x88);
    t[12 + j] = _mm512_shuffle_i32x4(r[8 + j], r[12 + j], 0xdd);
  }
#pragma GCC unroll 8
  for (int j = 0; j < 8; ++j) {
    r[j] = _mm512_shuffle_i32x4(t[j], t[8 + j], 0x88);
    r[8 + j] = _mm512_shuffle_i32x4(t[j], t[8 + j], 0xdd);
  }
}

// Pack 64 bf16 weight rows (`src`, rows `ldw` apart, K even) into one AVX-512 block, (K/2, 64, 2):
// per k pair the 64 columns' two values, one 32-bit lane each.
CANN_BF16_TARGET inline void pack_bf16_block64(const uint16_t* src, int64_t ldw, int64_t K, int32_t* dst) {
  const int64_t K2 = K / 2;
  int64_t kp = 0;
  for (; kp + 16 <= K2; kp += 16)
    for (int64_t r0 = 0; r0 < kCols; r0 += 16) {
      __m512i r[16];
#pragma GCC unroll 16
      for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512(src + (r0 + i) * ldw + 2 * kp);
      transpose16(r);
#pragma GCC unroll 16
      for (int i = 0; i < 16; ++i) _mm512_storeu_si512(dst + (kp + i) * kCols + r0, r[i]);
    }
  for (; kp < K2; ++kp)
    for (int64_t c = 0; c < kCols; ++c) std::memcpy(dst + kp * kCols + c, src + c * ldw + 2 * kp, 4);
}

// The bf16 tiles on a weight as stored, (N, K) with rows `ldw` apart, N a multiple of 64, K even.
// The tiles of a block prefetch the next block's rows as run_tiles's prefetch the next packed block.
void run_plain_bf16(const uint16_t* x, int64_t M, int64_t K, const uint16_t* w, int64_t ldw, int64_t NB,
                    const float* bias, uint16_t* y) {
  if (M == 0) return;
  const int64_t N = NB * kCols, K2 = K / 2;
  cann::leftovers_for(NB, [&](int64_t nb, bool next) {
    thread_local std::vector<int32_t> buf;  // the block packed (kept for the thread: K/2 x 64 pairs)
    if (static_cast<int64_t>(buf.size()) < K2 * kCols) buf.resize(K2 * kCols);
    pack_bf16_block64(w + nb * kCols * ldw, ldw, K, buf.data());
    // the next block's rows, where they are one region: as many lines a k pair as a packed block's
    block_tiles(kBf16Tiles, x, M, K, reinterpret_cast<const uint16_t*>(buf.data()), K2,
                bias ? bias + nb * kCols : nullptr, y + nb * kCols, N,
                reinterpret_cast<const char*>(w + (nb + 1) * kCols * ldw), next && ldw == K, int64_t{0});
  });
}

// --- AVX2 + FMA (16 ymm registers): 16-column blocks, fp32 or bf16 weights ---
// The same loop for CPUs without AVX-512 (or, in bf16, without AVX512-BF16): a tile is up to 6
// rows x 16 columns, 12 fp32 accumulators, 2 weight registers and one broadcast, the shape of the
// classic AVX2 GEMM micro-kernel. The weight is packed (N/16, K, 16) in its own dtype: one 64-byte
// line per k step in fp32, half a line in bf16, read in order. bf16 weights are widened to fp32 in
// registers (a bf16 value is the high half of an fp32 one) and x is converted to fp32 once per call,
// so bf16 reads half the bytes of fp32 with the same arithmetic: oneDNN has no native bf16 on such a
// CPU and emulates it slower than fp32 (BENCHMARKS.md, "seventeenth pass").
#define CANN_AVX2_TARGET __attribute__((target("avx2,fma")))

constexpr int64_t kAvx2Cols = 16;

// One k step of a packed 16-column block as two fp32 vectors, columns 0-7 and 8-15. A bf16 block
// stores each k step's columns interleaved (0, 8, 1, 9, ..., 7, 15; pack_rows), so one 32-byte
// load, a shift and a mask widen it: a bf16 value is the high half of an fp32 one. Widening eight
// values at a time with vpmovzxwd instead (columns in order) ran the bf16 pass at M = 4 at 0.59x a
// sum's rate, below the fp32 pass's bytes per second.
template <bool kBf16>
CANN_AVX2_TARGET inline void load_step(const void* w, int64_t k, __m256& w0, __m256& w1) {
  if constexpr (kBf16) {
    const auto* row = static_cast<const uint16_t*>(w) + k * kAvx2Cols;
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row));
    w0 = _mm256_castsi256_ps(_mm256_slli_epi32(raw, 16));
    w1 = _mm256_castsi256_ps(_mm256_and_si256(raw, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
  } else {
    w0 = _mm256_loadu_ps(static_cast<const float*>(w) + k * kAvx2Cols);
    w1 = _mm256_loadu_ps(static_cast<const float*>(w) + k * kAvx2Cols + 8);
  }
}

// How far ahead in its own block the fp32 AVX2 tile asks for the weight's next lines (into L1),
// when one tile takes all the rows (avx2_block). With a few rows each line of weight feeds only a
// few FMAs, and the out-of-order window alone held too few lines in flight: in one process,
// alternating, 7 rounds, this prefetch read the 0.6B projections 1.11-1.15x faster in fp32 at 4
// rows (three runs; 2048 bytes: 1.17x) and took the ge_graph batch-4 step to 0.93x of its time.
// A bf16 tile instead takes the next block's lines into L2, as tiles of larger products do: 1 KB
// is only ~32 of its k steps ahead, and the next block spread over the whole block read its
// projections 1.11-1.26x faster than the 1 KB and took the batch-4 step to 0.91-0.95x (fp32:
// 0.91-0.97x and 1.03x, so fp32 keeps this one). BENCHMARKS.md, "twentieth" and "twenty-first pass".
constexpr int64_t kAvx2Ahead = 1024;

// One k step of an AVX2 tile: the block's 16 columns at step k times the tile's MB values of x at
// k (x interleaved by k: interleave_rows), into the accumulators.
template <int MB, bool kBf16>
CANN_AVX2_TARGET __attribute__((always_inline)) inline void avx2_step(const float* xk, const void* w, int64_t k,
                                                                     __m256 (&acc)[MB][2]) {
  __m256 w0, w1;
  load_step<kBf16>(w, k, w0, w1);
#pragma GCC unroll 8
  for (int m = 0; m < MB; ++m) {
    const __m256 b = _mm256_broadcast_ss(xk + m);
    acc[m][0] = _mm256_fmadd_ps(w0, b, acc[m][0]);
    acc[m][1] = _mm256_fmadd_ps(w1, b, acc[m][1]);
  }
}

// One AVX2 tile: MB rows of fp32 x, interleaved by k (x[k * MB + m]), times one packed 16-column
// block (K steps), into fp32 y (row stride ldy). Besides the prefetch `ahead` bytes ahead in w (0:
// none), it prefetches `pf_lines` lines from `pf` on into L2, spread evenly over its K steps (the
// AVX-512 loop's scheme, not measured apart on this one).
// A k step is one weight load, two integer ops (bf16), MB broadcasts and 2 x MB FMAs; Zen 3 issues
// 6 ops a cycle, 2 of them FMAs. With x in rows (ldx apart) and the prefetch checks made every
// step, GCC added two or three address computations and ~6 scalar ops to each step, ~25 ops to 8
// FMAs at 4 rows: the front end, not the FMA units, set the pace. So x's values of a step lie side
// by side (one pointer, fixed offsets) and the bookkeeping runs once per four steps. Same greedy
// tokens, the ge_graph step's time (alternating rounds on one runner, AVX2 kind): fp32 0.88x at
// batch 4, 0.69x at 16, 0.66x at 64; bf16 0.88x at 4, 0.81x at 16; the eager bf16 step at 16 0.85x
// (BENCHMARKS.md, "forty-ninth pass"). The unrolling pragmas: without them GCC 12 kept the
// accumulators in registers but also stored all 12 to the stack on every k step (fp32 at M = 16:
// 56 GFLOP/s, 134 with them).
template <int MB, bool kBf16>
CANN_AVX2_TARGET inline void avx2_tile(const float* x, const void* w, int64_t K, const float* bias, float* y,
                                       int64_t ldy, const char* pf, int64_t pf_lines, int64_t ahead) {
  constexpr int64_t kStepBytes = kBf16 ? 32 : 64, kGroup = 4;
  __m256 acc[MB][2];
#pragma GCC unroll 8
  for (int m = 0; m < MB; ++m)
#pragma GCC unroll 2
    for (int c = 0; c < 2; ++c) acc[m][c] = bias ? _mm256_loadu_ps(bias + c * 8) : _mm256_setzero_ps();
  const char* wb = static_cast<const char*>(w);
  int64_t due = 0, k = 0;
  for (; k + kGroup <= K; k += kGroup) {
    if (ahead)  // one line per 64 bytes of the group's steps
#pragma GCC unroll 4
      for (int64_t b = 0; b < kGroup * kStepBytes; b += 64) _mm_prefetch(wb + k * kStepBytes + ahead + b, _MM_HINT_T0);
#pragma GCC unroll 4
    for (int64_t j = 0; j < kGroup; ++j) avx2_step<MB, kBf16>(x + (k + j) * MB, w, k + j, acc);
    for (due += kGroup * pf_lines; due >= K; due -= K, pf += 64) _mm_prefetch(pf, _MM_HINT_T1);
  }
  for (; k < K; ++k) {
    avx2_step<MB, kBf16>(x + k * MB, w, k, acc);
    for (due += pf_lines; due >= K; due -= K, pf += 64) _mm_prefetch(pf, _MM_HINT_T1);
  }
#pragma GCC unroll 8
  for (int m = 0; m < MB; ++m)
#pragma GCC unroll 2
    for (int c = 0; c < 2; ++c) _mm256_storeu_ps(y + m * ldy + c * 8, acc[m][c]);
}

using Avx2TileFn = void (*)(const float*, const void*, int64_t, const float*, float*, int64_t, const char*, int64_t,
                            int64_t);
constexpr Avx2TileFn kAvx2F32Tiles[kRows + 1] = {
    nullptr, avx2_tile<1, false>, avx2_tile<2, false>, avx2_tile<3, false>,
    avx2_tile<4, false>, avx2_tile<5, false>, avx2_tile<6, false>};
constexpr Avx2TileFn kAvx2Bf16Tiles[kRows + 1] = {
    nullptr, avx2_tile<1, true>, avx2_tile<2, true>, avx2_tile<3, true>,
    avx2_tile<4, true>, avx2_tile<5, true>, avx2_tile<6, true>};

// The rows of tile t when M rows run as n_tiles tiles of balanced sizes (16 rows: 6 + 5 + 5).
inline int64_t tile_rows(int64_t M, int64_t n_tiles, int64_t t) { return M / n_tiles + (t < M % n_tiles); }

// x (M, K) as the AVX2 tiles read it, in fp32: tile by tile (avx2_block's split), each tile's rows
// interleaved by k, dst[m0 * K + k * mb + m] = x[m0 + m][k], for k in [k0, k1); a bf16 x widened
// on the way (exact: a bf16 value is the high half of an fp32 one). M x K values, in cache: next to
// one pass over a weight of K x N (N >= 16 x M here) it is small.
template <typename T>
void interleave_rows(const T* src, int64_t M, int64_t K, int64_t k0, int64_t k1, float* dst) {
  const int64_t n_tiles = (M + kRows - 1) / kRows;
  for (int64_t m0 = 0, t = 0, mb = 0; m0 < M; m0 += mb, ++t) {
    mb = tile_rows(M, n_tiles, t);
    for (int64_t k = k0; k < k1; ++k)
      for (int64_t m = 0; m < mb; ++m) {
        if constexpr (sizeof(T) == 2) {
          const uint32_t bits = static_cast<uint32_t>(src[(m0 + m) * K + k]) << 16;
          std::memcpy(dst + m0 * K + k * mb + m, &bits, 4);
        } else {
          dst[m0 * K + k * mb + m] = src[(m0 + m) * K + k];
        }
      }
  }
}

// One row of a block's 16 fp32 sums rounded to bf16 as aten rounds them (c10::BFloat16: to
// nearest even; a NaN stays a quiet NaN, which the rounding add alone could carry into the sign).
// Written with intrinsics, not ATen's vector conversion: this file's vector code is compiled per
// function for AVX2, whatever width the rest of the file gets.
CANN_AVX2_TARGET inline void round16_to_bf16(const float* src, uint16_t* dst) {
  const __m256i bias = _mm256_set1_epi32(0x7FFF), one = _mm256_set1_epi32(1), nan = _mm256_set1_epi32(0x7FC0);
  __m256i h[2];
  for (int j = 0; j < 2; ++j) {
    const __m256 v = _mm256_loadu_ps(src + 8 * j);
    const __m256i b = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), one);
    const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(b, _mm256_add_epi32(bias, lsb)), 16);
    h[j] = _mm256_blendv_epi8(r, nan, _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
  }
  // packus packs within 128-bit lanes (h0 lo, h1 lo, h0 hi, h1 hi): put the quarters back in order
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(h[0], h[1]), 0xD8);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), packed);
}

// Where the AVX2 tiles of one block put their sums: fp32 y itself (`f`, row stride `ldf`), or, for
// a bf16 y (`h`, row stride `ldh`), a thread's fp32 scratch rows of 16 that avx2_block rounds into it
// once the block is done. Converting x and rounding y in the kernel, not with aten calls around it,
// took a small bf16 call from 11.5 to 7.8 us, what fp32 costs (the 0.6B step makes 113 calls).
struct Avx2Out {
  float* f;
  int64_t ldf;
  uint16_t* h = nullptr;
  int64_t ldh = 0;
};

// Every tile of rows of x (M, K) times one packed AVX2 block `blk` (K steps), into `out`'s 16
// columns. Each tile also prefetches its share of `lines` lines from `pf` on into L2
// (rows / M of them, the AVX-512 loop's scheme; run_tiles): the next block, while this one computes.
// A single tile (M <= 6) given `ahead` (> 0) prefetches that far ahead in its own block instead
// of taking the next block's lines (kAvx2Ahead says when). With more rows the in-block prefetch
// cost more than it gained: in every tile it made the bf16 batch-16 step 1.14-1.17x slower, in
// the first tile only the fp32 one 1.09x (in-process A/B).
inline void avx2_block(const Avx2TileFn* tiles, const float* x, int64_t M, int64_t K, const void* blk,
                       const float* bias, Avx2Out out, const char* pf, int64_t lines, int64_t ahead) {
  const int64_t n_tiles = (M + kRows - 1) / kRows;
  for (int64_t m0 = 0, t = 0, mb = 0, given = 0; m0 < M; m0 += mb, ++t) {
    mb = tile_rows(M, n_tiles, t);
    const int64_t share = n_tiles > 1 || !ahead ? (lines * (m0 + mb)) / M - given : 0;
    tiles[mb](x + m0 * K, blk, K, bias, out.f + m0 * out.ldf, out.ldf, pf, share, n_tiles == 1 ? ahead : 0);
    pf += share * 64;
    given += share;
  }
  if (out.h)
    for (int64_t m = 0; m < M; ++m) round16_to_bf16(out.f + m * out.ldf, out.h + m * out.ldh);
}

// run_tiles for the AVX2 layout: x and y in fp32, the weight's bytes per k step `step` (64 in
// fp32, 32 in bf16; only fp32 prefetches ahead in the block, kAvx2Ahead). The blocks are shared
// out as in the AVX-512 loop (leftovers_for). On an AVX2-only CPU (Zen 3) that ran the batch-16 step
// at 0.96x the fixed split's time in fp32 (ge_graph) and 0.88-0.93x in bf16 (ge_graph, SK decoder),
// level at batch 4 (9-13 alternating rounds on one runner; BENCHMARKS.md, "forty-seventh pass").
void run_avx2_tiles(const Avx2TileFn* tiles, const float* x, int64_t M, int64_t K, const char* w, int64_t NB,
                    int64_t step, const float* bias, float* y, uint16_t* yh) {
  const int64_t N = NB * kAvx2Cols, block = K * step;
  cann::leftovers_for(NB, [&](int64_t nb, bool next) {
    thread_local std::vector<float> scratch;  // a bf16 y's fp32 sums, one block at a time
    if (yh && static_cast<int64_t>(scratch.size()) < M * kAvx2Cols) scratch.resize(M * kAvx2Cols);
    // the next block's lines (a bf16 block of odd K: its last half line is left), none past the weight
    const int64_t lines = next ? block / 64 : 0;
    const Avx2Out out = yh ? Avx2Out{scratch.data(), kAvx2Cols, yh + nb * kAvx2Cols, N} : Avx2Out{y + nb * kAvx2Cols, N};
    avx2_block(tiles, x, M, K, w + nb * block, bias ? bias + nb * kAvx2Cols : nullptr, out, w + (nb + 1) * block,
               lines, step == 64 ? kAvx2Ahead : 0);
  });
}

// Pack 16 bf16 weight rows (`src`, rows `ldw` apart, K values each) into one AVX2 block: per k
// step the 16 columns as 0, 8, 1, 9, ..., 7, 15, i.e. 8 dwords, dword j = (row j, row 8 + j) at k.
// Eight k steps at a time: rows j and 8 + j interleaved into dwords (one unpack each), then an 8 x 8
// transpose of dwords. The scalar copy it replaces took most of a 16-row call's time.
CANN_AVX2_TARGET inline void pack_bf16_block(const uint16_t* src, int64_t ldw, int64_t K, uint16_t* dst) {
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    __m256i r[8];
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) {
      const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + j * ldw + k));
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + (j + 8) * ldw + k));
      r[j] = _mm256_set_m128i(_mm_unpackhi_epi16(a, b), _mm_unpacklo_epi16(a, b));  // dword i: step k + i
    }
    __m256i t[8], u[8];
#pragma GCC unroll 4
    for (int j = 0; j < 8; j += 2) {
      t[j] = _mm256_unpacklo_epi32(r[j], r[j + 1]);
      t[j + 1] = _mm256_unpackhi_epi32(r[j], r[j + 1]);
    }
#pragma GCC unroll 2
    for (int j = 0; j < 8; j += 4) {
      u[j] = _mm256_unpacklo_epi64(t[j], t[j + 2]);      // steps 0 | 4 of rows j..j+3
      u[j + 1] = _mm256_unpackhi_epi64(t[j], t[j + 2]);  // 1 | 5
      u[j + 2] = _mm256_unpacklo_epi64(t[j + 1], t[j + 3]);  // 2 | 6
      u[j + 3] = _mm256_unpackhi_epi64(t[j + 1], t[j + 3]);  // 3 | 7
    }
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + (k + i) * kAvx2Cols), _mm256_permute2x128_si256(u[i], u[i + 4], 0x20));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + (k + i + 4) * kAvx2Cols),
                          _mm256_permute2x128_si256(u[i], u[i + 4], 0x31));
    }
  }
  for (; k < K; ++k)
    for (int j = 0; j < 8; ++j) {
      dst[k * kAvx2Cols + 2 * j] = src[j * ldw + k];
      dst[k * kAvx2Cols + 2 * j + 1] = src[(j + 8) * ldw + k];
    }
}

// Pack 16 fp32 weight rows (`src`, rows `ldw` apart, K values each) into one AVX2 block: per k step
// the 16 columns in order. Eight k steps at a time, as two 8 x 8 transposes (rows 0-7, rows 8-15).
// The scalar copy it replaces made this loop 1.1-3.1x dot_linear's time on the 0.6B projections at
// 4-64 rows, so fp32 never came here (BENCHMARKS.md, "forty-ninth pass").
CANN_AVX2_TARGET inline void pack_f32_block(const float* src, int64_t ldw, int64_t K, float* dst) {
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
      __m256 r[8], t[8], u[8];
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j) r[j] = _mm256_loadu_ps(src + (8 * h + j) * ldw + k);
#pragma GCC unroll 4
      for (int j = 0; j < 8; j += 2) {
        t[j] = _mm256_unpacklo_ps(r[j], r[j + 1]);      // (j, j+1) at steps 0, 1 | 4, 5
        t[j + 1] = _mm256_unpackhi_ps(r[j], r[j + 1]);  // 2, 3 | 6, 7
      }
#pragma GCC unroll 2
      for (int j = 0; j < 8; j += 4) {
        u[j] = _mm256_shuffle_ps(t[j], t[j + 2], _MM_SHUFFLE(1, 0, 1, 0));          // rows j..j+3 at 0 | 4
        u[j + 1] = _mm256_shuffle_ps(t[j], t[j + 2], _MM_SHUFFLE(3, 2, 3, 2));      // 1 | 5
        u[j + 2] = _mm256_shuffle_ps(t[j + 1], t[j + 3], _MM_SHUFFLE(1, 0, 1, 0));  // 2 | 6
        u[j + 3] = _mm256_shuffle_ps(t[j + 1], t[j + 3], _MM_SHUFFLE(3, 2, 3, 2));  // 3 | 7
      }
#pragma GCC unroll 4
      for (int i = 0; i < 4; ++i) {
        _mm256_storeu_ps(dst + (k + i) * kAvx2Cols + 8 * h, _mm256_permute2f128_ps(u[i], u[i + 4], 0x20));
        _mm256_storeu_ps(dst + (k + i + 4) * kAvx2Cols + 8 * h, _mm256_permute2f128_ps(u[i], u[i + 4], 0x31));
      }
    }
  }
  for (; k < K; ++k)
    for (int c = 0; c < kAvx2Cols; ++c) dst[k * kAvx2Cols + c] = src[c * ldw + k];
}

// The AVX2 loop on a weight as stored, (N, K) with rows `ldw` elements apart: for a product of many
// rows in the eager path on a CPU without AVX-512 (bf16, where oneDNN emulates it, and fp32). Each
// thread packs one 16-column block at a time into its own buffer, in pack_rows's layout, and runs
// every tile of rows on it: the block's K x 16 values are copied once per M rows of compute. While a block
// computes, the next one's 16 weight rows are prefetched (one region where the rows are
// contiguous): without that, packing read 16 short streams from memory with the core waiting.
// The blocks are shared out as in the packed loops (leftovers_for): on the AVX2 kind (Zen 3) that ran
// the eager bf16 step at 0.91x the fixed split's time at batch 16 (11 of 11 rounds faster) and 0.93x at
// 64, a 256-token prefill at 0.91x (7 alternating rounds each; BENCHMARKS.md, "forty-eighth pass").
template <typename W>
void run_avx2_plain(const Avx2TileFn* tiles, const float* x, int64_t M, int64_t K, const W* w, int64_t ldw,
                    int64_t NB, const float* bias, float* y, uint16_t* yh) {
  const int64_t N = NB * kAvx2Cols, block = kAvx2Cols * K * static_cast<int64_t>(sizeof(W));
  cann::leftovers_for(NB, [&](int64_t nb, bool next) {
    thread_local std::vector<W> buf;          // the block packed (kept for the thread: K x 16 values)
    thread_local std::vector<float> scratch;  // a bf16 y's fp32 sums (M x 16)
    if (static_cast<int64_t>(buf.size()) < K * kAvx2Cols) buf.resize(K * kAvx2Cols);
    if (yh && static_cast<int64_t>(scratch.size()) < M * kAvx2Cols) scratch.resize(M * kAvx2Cols);
    if constexpr (sizeof(W) == 2) {
      pack_bf16_block(w + nb * kAvx2Cols * ldw, ldw, K, buf.data());
    } else {
      pack_f32_block(w + nb * kAvx2Cols * ldw, ldw, K, buf.data());
    }
    const int64_t lines = next && ldw == K ? block / 64 : 0;
    const Avx2Out out = yh ? Avx2Out{scratch.data(), kAvx2Cols, yh + nb * kAvx2Cols, N} : Avx2Out{y + nb * kAvx2Cols, N};
    avx2_block(tiles, x, M, K, buf.data(), bias ? bias + nb * kAvx2Cols : nullptr, out,
               reinterpret_cast<const char*>(w + (nb + 1) * kAvx2Cols * ldw), lines, 0);  // buf: just written
  });
}
#endif

// Whether this CPU runs the kernel for `dtype` on blocks of `cols` columns: 64 is the AVX-512 loop
// (AVX512-BF16 for bf16), 16 the AVX2 + FMA one (either dtype).
bool rows_supported(at::ScalarType dtype, int64_t cols) {
#ifdef CANN_ROWS
  if (dtype != at::kBFloat16 && dtype != at::kFloat) return false;
  if (cols == kAvx2Cols) return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  if (cols == kCols && dtype == at::kBFloat16) return __builtin_cpu_supports("avx512bf16");
  if (cols == kCols) return __builtin_cpu_supports("avx512f");
#endif
  return false;
}

at::Tensor rows_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias) {
  const at::ScalarType dtype = packed.scalar_type();
  TORCH_CHECK(dtype == at::kBFloat16 || dtype == at::kFloat, "rows_linear: the packed weight must be bf16 or fp32");
  TORCH_CHECK(x.scalar_type() == dtype, "rows_linear: x is ", x.scalar_type(), ", the packed weight ", dtype);
  const bool bf16 = dtype == at::kBFloat16;
  // The layout says which loop: (N/16, K, 16) the AVX2 one; (N/64, K/2, 64, 2) in bf16 or
  // (N/64, K, 64) in fp32 the AVX-512 one. A weight as stored, (N, K), runs the AVX-512 bf16 loop
  // where this CPU has AVX512-BF16 and 64-column blocks of k pairs fit it (run_plain_bf16), the AVX2
  // loop otherwise (run_avx2_plain).
  const bool stored512 = packed.dim() == 2 && bf16 && packed.size(0) % kCols == 0 && packed.size(1) % 2 == 0 &&
                         packed.stride(1) == 1 && rows_supported(dtype, kCols);
  const bool plain = packed.dim() == 2 && !stored512;
  const bool avx2 = plain || (packed.dim() == 3 && packed.size(2) == kAvx2Cols);
  const int64_t cols = avx2 ? kAvx2Cols : kCols;
  if (plain) {
    TORCH_CHECK(packed.stride(1) == 1 && packed.size(0) % kAvx2Cols == 0,
                "rows_linear: a weight as stored must be (N, K) with contiguous rows and N a multiple of 16");
  } else if (avx2) {
    TORCH_CHECK(packed.is_contiguous(), "rows_linear: the packed weight must be contiguous");
  } else if (bf16) {
    TORCH_CHECK(stored512 ||
                    (packed.dim() == 4 && packed.size(2) == kCols && packed.size(3) == 2 && packed.is_contiguous()),
                "rows_linear: a bf16 weight must be packed as (N/64, K/2, 64, 2) or (N/16, K, 16)");
  } else {
    TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kCols && packed.is_contiguous(),
                "rows_linear: an fp32 weight must be packed as (N/64, K, 64) or (N/16, K, 16)");
  }
  TORCH_CHECK(rows_supported(dtype, cols), "rows_linear: this CPU has no ",
              avx2 ? "AVX2 and FMA" : (bf16 ? "AVX512-BF16" : "AVX-512"), " for a weight packed in ", cols,
              "-column blocks");
  const int64_t NB = plain ? packed.size(0) / kAvx2Cols : stored512 ? packed.size(0) / kCols : packed.size(0);
  const int64_t K = plain || stored512 ? packed.size(1) : (bf16 && !avx2 ? 2 * packed.size(1) : packed.size(1));
  const int64_t N = NB * cols;
  TORCH_CHECK(x.size(-1) == K, "rows_linear: x has ", x.size(-1), " columns, the weight ", K);
  const at::Tensor x2 = x.reshape({-1, K}).contiguous();
  const int64_t M = x2.size(0);
  const at::Tensor fbias = cann::fp32_bias(bias, N, "rows_linear");
  at::Tensor y = cann::linear_output(x, N);
#ifdef CANN_ROWS
  const float* bp = fbias.defined() ? fbias.data_ptr<float>() : nullptr;
  if (stored512) {
    run_plain_bf16(reinterpret_cast<const uint16_t*>(x2.data_ptr()), M, K,
                   reinterpret_cast<const uint16_t*>(packed.data_ptr()), packed.stride(0), NB, bp,
                   reinterpret_cast<uint16_t*>(y.data_ptr()));
  } else if (avx2) {
    // x in fp32 and interleaved for the tiles once (M x K values, in cache; an fp32 row of one is
    // already that), the sums in fp32; a bf16 y gets each block's sums rounded as the block finishes (Avx2Out)
    std::vector<float> interleaved;
    const float* xf = bf16 ? nullptr : x2.data_ptr<float>();
    if (bf16 || M > 1) {
      interleaved.resize(M * K);
      const int64_t grain = std::max<int64_t>(1, (1 << 16) / M);
      at::parallel_for(0, K, grain, [&](int64_t k0, int64_t k1) {
        if (bf16)
          interleave_rows(reinterpret_cast<const uint16_t*>(x2.data_ptr()), M, K, k0, k1, interleaved.data());
        else
          interleave_rows(x2.data_ptr<float>(), M, K, k0, k1, interleaved.data());
      });
      xf = interleaved.data();
    }
    float* yf = bf16 ? nullptr : y.data_ptr<float>();
    auto* yh = bf16 ? reinterpret_cast<uint16_t*>(y.data_ptr()) : nullptr;
    const Avx2TileFn* tiles = bf16 ? kAvx2Bf16Tiles : kAvx2F32Tiles;
    if (plain && bf16) {
      run_avx2_plain<uint16_t>(tiles, xf, M, K, reinterpret_cast<const uint16_t*>(packed.data_ptr()), packed.stride(0),
                               NB, bp, yf, yh);
    } else if (plain) {
      run_avx2_plain<float>(tiles, xf, M, K, packed.data_ptr<float>(), packed.stride(0), NB, bp, yf, yh);
    } else {
      run_avx2_tiles(tiles, xf, M, K, static_cast<const char*>(packed.data_ptr()), NB,
                     kAvx2Cols * packed.element_size(), bp, yf, yh);
    }
  } else if (bf16) {
    run_tiles<uint16_t>(kBf16Tiles, reinterpret_cast<const uint16_t*>(x2.data_ptr()), M, K,
                        reinterpret_cast<const uint16_t*>(packed.data_ptr()), NB, K / 2, bp,
                        reinterpret_cast<uint16_t*>(y.data_ptr()));
  } else {
    run_tiles<float>(kF32Tiles, x2.data_ptr<float>(), M, K, packed.data_ptr<float>(), NB, K, bp, y.data_ptr<float>());
  }
#endif
  return y;
}

}  // namespace

TORCH_LIBRARY_IMPL(cann_cpu, CPU, m) { m.impl("rows_linear", rows_linear); }
TORCH_LIBRARY_IMPL(cann_cpu, CompositeExplicitAutograd, m) { m.impl("rows_supported", rows_supported); }
