// CPU kernel of cann_cpu::amx_linear (schema, packing and use: executor/backends/packed_linear.py).
//
// y = x W^T + b in bf16 for a few rows of x (a batched decode step: M = batch) with Intel AMX tiles,
// on the weight packed as rows_linear's AVX-512 bf16 loop packs it: (N/64, K/2, 64, 2), for each
// block of 64 output columns the K/2 pairs of consecutive k values. That is the operand layout of
// AMX's tdpbf16ps as well: a B tile is 16 k pairs (rows) by 16 columns of 2 values (64 bytes), so
// one 64-column block is four B tiles side by side, loaded with a row stride of 256 bytes, and no
// other copy of the weight is kept.
//
// Why a kernel: at 2-64 rows a decode GEMM is a stream over the weight. On the AMX host measured
// (2 vCPUs of an Intel Xeon, BENCHMARKS.md "twenty-sixth pass") oneDNN's AMX products on their own
// packed weights read the Qwen3-0.6B projections at 0.53-0.69 of a plain fp32 sum's rate at 4-16
// rows and rows_linear's AVX-512 loop (tuned on AMD Zen 4) at 0.33-0.52; this loop reads them at
// 0.73-0.91 (two passes, one on a slower, noisier VM). An AMX tile product (16 x 16 x 32
// multiply-adds) is so fast next to the memory that the loop is a stream: per 32 k values it loads
// one A tile (up to 16 rows of x, from cache) and the block's four B tiles (4 KB of weight), and
// asks for the weight 4 KB ahead of the first tile of rows (into L1: without it the same pass read
// 0.82-0.83; the next block into L2 spread over the block, rows_linear's scheme, read 0.78-0.80).
// With more than 16 rows the block is run once per tile of rows, its later tiles reading it from
// L2. Two row tiles sharing each B tile (2 x 2 tiles over 32 columns, half the B loads) read
// 0.9x as fast at 32-64 rows, and level in a later pass (0.61 against 0.63 of a sum's rate at 32
// rows, 0.48 and 0.48 at 64). One core runs this loop's chunk (5 loads, 4 products) in 20-25 ns
// with everything in L1 (2.6-3.3 TFLOP/s; a 16-row tileloadd from L1 ~2.5 ns), in ~41 ns with the
// B tiles in L2 and ~153 ns from memory (one core's share of the read bandwidth). So at 64 rows a
// block's first tile of rows waits on memory while the later ones compute from L2 with memory idle.
// benchmarks/overlap_bench.py times this loop alone (cann::amx::block, amx_tiles.h): on the Intel
// AMX kind its passes at 1-64 rows sit below the serial bound (stream time plus compute time), the
// first tile streaming at ~0.77 of a plain sum's rate, and nothing overlaps the two (BENCHMARKS.md,
// "seventy-sixth pass").
// There, asking for the next block during the later tiles read slower (0.61 / 0.44 of a sum's rate at
// 32 / 64 rows; 0.85 against 0.95 TFLOP/s at 64 rows in a microbenchmark), as did one 16-column group
// at a time under every tile of rows (0.48 / 0.38) and K in slices kept in L1 (BENCHMARKS.md,
// "seventy-third" and "seventy-fourth pass"); on another Intel AMX kind, whose products run slower,
// that ask is faster, and the loop makes it there only (amx_tiles.h, later_tiles_ask).
//
// The weight as stored, (N, K), is taken as well (the eager decode step, which keeps no packed copy,
// and a short prompt's products: eager_linear.AMX_STORED_MAX_ROWS): then the weight is the A operand,
// 16 of its rows (64 bytes of k each, rows K apart) per tile, and x is the B operand, transposed into k
// pairs once per call, so the tiles compute y^T and the store transposes it back. It read 0.73-0.82 of
// a sum's rate at 4-16 rows (two passes), aten's linear (oneDNN, the weight reordered on every call)
// 0.41; asking for the 64 rows' next lines ahead cost more than it gained (0.63-0.65). The first tile
// of rows takes the block's 64 weight rows 16 at a time, each 16 over all of K (stored_rows), not all
// 64 side by side: 16 streams through memory at once instead of 64 (at K = 1024-3072 a 64-row block
// spans 32-96 4 KiB pages; likely more streams than a core's prefetcher follows, though that was not
// measured directly). The eager bf16 decode step took 0.91-0.92x the time at batch 4 (two runs), 0.94x
// at batch 8 and 0.95x at 16, logits bit-equal (7 alternating rounds in one process); the projections
// alone read 0.80 against 0.78 of a sum's rate at 2-8 rows in gemm_bench and 0.84-0.86 against
// 0.75-0.78 at 2-16 in a C++ probe over one 1.2 GB array. The later tiles of rows read the block from
// L2, where one x^T load for four products is what counts: run so too, the 48-192-token eager prefill
// was 1.03-1.07x slower; with them on stored_block it is level (0.96-1.03x at 32-192), so they keep it
// (BENCHMARKS.md, "seventy-seventh pass").
//
// AMX needs, besides the CPU feature, the kernel's permission per process (arch_prctl
// ARCH_REQ_XCOMP_PERM for the tile data, asked once; oneDNN asks the same) and a tile configuration
// per thread (ldtilecfg), released when the thread's share is done. The vector code is compiled for
// AMX per function (target attribute), so the library builds with the project's usual flags on any
// x86-64 host with GCC 11+ (or clang 12+); amx_supported() says whether this CPU and kernel run it.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "amx_tiles.h"  // CANN_AMX, and the packed-weight loop (cann::amx::block)
#include "linear_io.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

using cann::amx::kChunk;
using cann::amx::kCols;
using cann::amx::kTileRows;
constexpr int kAhead = 4096;  // bytes of weight asked for ahead of the first tile of rows: one chunk

#ifdef CANN_AMX
using cann::amx::release;

// `rows` rows of a block's fp32 sums (plus the block's fp32 bias) rounded to bf16 into y (row stride
// ldy): vcvtneps2bf16 rounds to nearest even as aten does.
CANN_AMX_TARGET void store_rows(const float* c, int rows, const float* bias, uint16_t* y, int64_t ldy) {
  for (int m = 0; m < rows; ++m)
    for (int j = 0; j < 4; ++j) {
      __m512 v = _mm512_loadu_ps(c + m * kCols + j * 16);
      if (bias) v = _mm512_add_ps(v, _mm512_loadu_ps(bias + j * 16));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + m * ldy + j * 16), (__m256i)_mm512_cvtneps_pbh(v));
    }
}

// A thread's tiles during one call: configured (by `configure`, for a tile height) again only when
// the height changes, which balanced tiles do at most once; released when the thread's share ends.
struct ThreadTiles {
  void (*configure)(int rows);
  int rows = 0;
  void fit(int64_t mb) {
    if (mb != rows) {
      rows = static_cast<int>(mb);
      configure(rows);
    }
  }
  ~ThreadTiles() {
    if (rows) release();
  }
};

// Every 64-column block (in parallel) times every tile of rows: M rows split into balanced tiles of
// at most 16 (20 rows: 10 + 10), so a thread configures its tiles at most twice per call.
void run_blocks(const uint16_t* x, int64_t M, int64_t K, const uint16_t* w, int64_t NB, const float* bias,
                uint16_t* y) {
  const int64_t N = NB * kCols, block = K * kCols, n_tiles = (M + kTileRows - 1) / kTileRows;
  const int lines = cann::amx::next_lines(n_tiles);
  at::parallel_for(0, NB, 1, [&](int64_t begin, int64_t end) {
    alignas(64) float c[kTileRows * kCols];
    ThreadTiles tiles{cann::amx::configure};
    for (int64_t nb = begin; nb < end; ++nb) {
      for (int64_t m0 = 0, t = 0, mb = 0; m0 < M; m0 += mb, ++t) {
        mb = M / n_tiles + (t < M % n_tiles);
        tiles.fit(mb);
        // the weight's last block asks for nothing ahead: its last chunk's 4 KB would run past the weight
        const bool ahead = t == 0 && (nb + 1 < NB);
        const char* next = cann::amx::next_share(nb + 1 < NB ? w + (nb + 1) * block : nullptr, t, K, lines);
        cann::amx::block(x + m0 * K, K, K, w + nb * block, c, ahead ? kAhead : 0, next, lines);
        store_rows(c, static_cast<int>(mb), bias ? bias + nb * kCols : nullptr, y + m0 * N + nb * kCols, N);
      }
    }
  });
}

// The stored layout's tiles: tmm0-3 the sums, 16 weight rows x `rows` fp32 each; tmm4: x^T, 16 k
// pairs x `rows` x 2; tmm5-7: 16 weight rows x 32 k values.
CANN_AMX_TARGET void configure_stored(int rows) {
  cann::amx::TileConfig cfg;
  std::memset(&cfg, 0, sizeof cfg);
  cfg.palette = 1;
  for (int t = 0; t < 5; ++t) {
    cfg.rows[t] = kTileRows;
    cfg.colsb[t] = static_cast<uint16_t>(rows * 4);
  }
  for (int t = 5; t < 8; ++t) {
    cfg.rows[t] = kTileRows;
    cfg.colsb[t] = 64;
  }
  asm volatile("" : : "r"(&cfg) : "memory");  // as in configure
  _tile_loadconfig(&cfg);
}

// The stored layout's four sums (tmm0-3) cleared, and stored into c (c[t][n][m] at t * 256 + n * 16 + m).
CANN_AMX_TARGET inline void zero_sums() {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
}

CANN_AMX_TARGET inline void store_sums(float* c) {
  _tile_stored(0, c, 64);
  _tile_stored(1, c + 256, 64);
  _tile_stored(2, c + 512, 64);
  _tile_stored(3, c + 768, 64);
}

// 64 weight rows as stored (ldw elements apart) times x^T (K/2 pairs of `rows` columns, xt) into
// c (four 16 x 16 fp32 tiles: c[t][n][m] at t * 256 + n * 16 + m). Each chunk asks for the line at
// its k of `next_rows` rows from `next` on into L2 (0: none). On the model-207 kind (amx_tiles.h,
// later_tiles_ask) the eager bf16 batch-64 step took 0.93x the time with the ask and the 128-token
// eager prefill 0.92x (7 rounds in turns, one process; the same tokens; "eightieth pass").
CANN_AMX_TARGET void stored_block(const uint16_t* w, int64_t ldw, int64_t K, const uint32_t* xt, int rows, float* c,
                                  const uint16_t* next = nullptr, int next_rows = 0) {
  zero_sums();
  const int64_t stride = ldw * 2;
  for (int64_t k0 = 0; k0 < K; k0 += kChunk) {
    for (int r = 0; r < next_rows; ++r) _mm_prefetch(reinterpret_cast<const char*>(next + r * ldw + k0), _MM_HINT_T1);
    _tile_loadd(4, xt + (k0 / 2) * rows, rows * 4);
    _tile_loadd(5, w + k0, stride);
    _tile_dpbf16ps(0, 5, 4);
    _tile_loadd(6, w + 16 * ldw + k0, stride);
    _tile_dpbf16ps(1, 6, 4);
    _tile_loadd(7, w + 32 * ldw + k0, stride);
    _tile_dpbf16ps(2, 7, 4);
    _tile_loadd(5, w + 48 * ldw + k0, stride);
    _tile_dpbf16ps(3, 5, 4);
  }
  store_sums(c);
}

// stored_block's sums in another order: its 16-row tiles of the weight one after another, each over
// all of K (so one x^T load per product). The first tile of rows streams the block from memory so.
#define CANN_STORED_ROWS(tile)                                        \
  for (int64_t k0 = 0; k0 < K; k0 += kChunk) {                       \
    _tile_loadd(4, xt + (k0 / 2) * rows, rows * 4);                  \
    _tile_loadd(5, w + (tile) * kTileRows * ldw + k0, stride);       \
    _tile_dpbf16ps(tile, 5, 4);                                      \
  }
CANN_AMX_TARGET void stored_rows(const uint16_t* w, int64_t ldw, int64_t K, const uint32_t* xt, int rows, float* c) {
  zero_sums();
  const int64_t stride = ldw * 2;
  CANN_STORED_ROWS(0)  // the tile register is an immediate of the instruction: one loop per tile
  CANN_STORED_ROWS(1)
  CANN_STORED_ROWS(2)
  CANN_STORED_ROWS(3)
  store_sums(c);
}
#undef CANN_STORED_ROWS

// The block's sums back in y's orientation: row m's 64 values are column m of the four tiles (one
// gather of 16 per tile), plus the bias, rounded to bf16.
CANN_AMX_TARGET void store_transposed(const float* c, int rows, const float* bias, uint16_t* y, int64_t ldy) {
  const __m512i column = _mm512_mullo_epi32(
      _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0), _mm512_set1_epi32(16));
  for (int m = 0; m < rows; ++m)
    for (int t = 0; t < 4; ++t) {
      __m512 v = _mm512_i32gather_ps(column, c + t * 256 + m, 4);
      if (bias) v = _mm512_add_ps(v, _mm512_loadu_ps(bias + t * 16));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + m * ldy + t * 16), (__m256i)_mm512_cvtneps_pbh(v));
    }
}

// x's `rows` rows (K2 k pairs each, as 32-bit words) into k-pair order: dst[kp * rows + m] = pair kp of
// row m. One masked gather per pair: at K = 3072 a scalar copy (either loop order) added 35-160 us to
// a 16-64-row call over the same call on the packed weight, the gather 9-30 (one timing each).
CANN_AMX_TARGET void transpose_pairs(const uint32_t* src, int rows, int64_t K2, uint32_t* dst) {
  const __mmask16 lanes = static_cast<__mmask16>((1u << rows) - 1);
  const __m512i row = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                         _mm512_set1_epi32(static_cast<int>(K2)));
  for (int64_t kp = 0; kp < K2; ++kp) {
    const __m512i v = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), lanes, row, src + kp, 4);
    _mm512_mask_storeu_epi32(dst + kp * rows, lanes, v);
  }
}

// run_blocks for the weight as stored: x^T in k pairs per tile of rows (tile t's pairs at m0 * K / 2:
// pair kp of row m at kp * mb + m), then every 64-row block of the weight (in parallel) times every
// tile of rows.
void run_stored(const uint16_t* x, int64_t M, int64_t K, const uint16_t* w, int64_t ldw, int64_t NB, const float* bias,
                uint16_t* y) {
  const int64_t N = NB * kCols, n_tiles = (M + kTileRows - 1) / kTileRows;
  std::vector<uint32_t> xt(M * K / 2);
  for (int64_t m0 = 0, t = 0, mb = 0; m0 < M; m0 += mb, ++t) {
    mb = M / n_tiles + (t < M % n_tiles);
    uint32_t* dst = xt.data() + m0 * K / 2;
    transpose_pairs(reinterpret_cast<const uint32_t*>(x + m0 * K), static_cast<int>(mb), K / 2, dst);
  }
  // as run_blocks: where the CPU gains by it, the later tiles ask for the next block (of weight rows)
  const int rows_asked = cann::amx::next_lines(n_tiles);
  at::parallel_for(0, NB, 1, [&](int64_t begin, int64_t end) {
    alignas(64) float c[4 * kTileRows * kTileRows];
    ThreadTiles tiles{configure_stored};
    for (int64_t nb = begin; nb < end; ++nb) {
      for (int64_t m0 = 0, t = 0, mb = 0; m0 < M; m0 += mb, ++t) {
        mb = M / n_tiles + (t < M % n_tiles);
        tiles.fit(mb);
        const uint16_t* block = w + nb * kCols * ldw;
        if (t == 0) {
          stored_rows(block, ldw, K, xt.data() + m0 * K / 2, static_cast<int>(mb), c);  // from memory
        } else {  // from L2, tile t asking for its share of the next block's rows, one line of each a chunk
          const int asked = nb + 1 < NB ? rows_asked : 0;
          stored_block(block, ldw, K, xt.data() + m0 * K / 2, static_cast<int>(mb), c,
                       block + (kCols + (t - 1) * asked) * ldw, asked);
        }
        store_transposed(c, static_cast<int>(mb), bias ? bias + nb * kCols : nullptr, y + m0 * N + nb * kCols, N);
      }
    }
  });
}
#endif

// This build has the AMX loop, the CPU has AMX-BF16 and the kernel lets this process use the tiles.
bool amx_supported() {
#ifdef CANN_AMX
  return __builtin_cpu_supports("amx-tile") && __builtin_cpu_supports("amx-bf16") && cann::amx::permitted();
#else
  return false;
#endif
}

at::Tensor amx_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(packed.scalar_type() == at::kBFloat16 && x.scalar_type() == at::kBFloat16,
              "amx_linear: x and the packed weight must be bf16");
  const bool stored = packed.dim() == 2;  // the weight as stored, (N, K)
  TORCH_CHECK(stored || (packed.dim() == 4 && packed.size(2) == kCols && packed.size(3) == 2 && packed.is_contiguous()),
              "amx_linear: the weight must be packed as (N/64, K/2, 64, 2), or as stored (N, K)");
  TORCH_CHECK(!stored || (packed.stride(1) == 1 && packed.size(0) % kCols == 0),
              "amx_linear: a weight as stored must be (N, K) with contiguous rows and N a multiple of 64");
  const int64_t NB = packed.size(0) / (stored ? kCols : 1), K = stored ? packed.size(1) : 2 * packed.size(1);
  const int64_t N = NB * kCols;
  TORCH_CHECK(K % kChunk == 0, "amx_linear: K (", K, ") must be a multiple of 32");
  TORCH_CHECK(x.size(-1) == K, "amx_linear: x has ", x.size(-1), " columns, the weight ", K);
  TORCH_CHECK(amx_supported(), "amx_linear: this CPU (or kernel, or build) does not run AMX-BF16");
  const at::Tensor x2 = x.reshape({-1, K}).contiguous();
  const at::Tensor fbias = cann::fp32_bias(bias, N, "amx_linear");
  at::Tensor y = cann::linear_output(x, N);
#ifdef CANN_AMX
  const auto* xp = reinterpret_cast<const uint16_t*>(x2.data_ptr());
  const auto* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr());
  const float* bp = fbias.defined() ? fbias.data_ptr<float>() : nullptr;
  auto* yp = reinterpret_cast<uint16_t*>(y.data_ptr());
  if (x2.size(0) > 0 && stored) {
    run_stored(xp, x2.size(0), K, wp, packed.stride(0), NB, bp, yp);
  } else if (x2.size(0) > 0) {
    run_blocks(xp, x2.size(0), K, wp, NB, bp, yp);
  }
#endif
  return y;
}

}  // namespace

TORCH_LIBRARY_IMPL(cann_cpu, CPU, m) { m.impl("amx_linear", amx_linear); }
TORCH_LIBRARY_IMPL(cann_cpu, CompositeExplicitAutograd, m) { m.impl("amx_supported", amx_supported); }
