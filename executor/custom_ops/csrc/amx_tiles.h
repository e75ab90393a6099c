// AMX's packed-weight loop, shared by the kernel (executor/backends/csrc/amx_linear.cpp, which says
// why it is shaped so) and the probe that measures it alone (benchmarks/csrc/overlap_probe.cpp): one
// block of 64 output columns, packed (K/2, 64, 2), times up to 16 rows of x. No ATen here, so the
// probe builds without PyTorch and times exactly the kernel's instructions.
//
// CANN_AMX is defined where this compiler can emit AMX (GCC 11+, clang 12+, x86-64 Linux), and the code
// only there; it is compiled for AMX per function (target attribute), so including this needs no flags.
#pragma once

#include <cstdint>

namespace cann::amx {
constexpr int64_t kCols = 64;      // output columns per packed block: four B tiles of 16
constexpr int64_t kChunk = 32;     // k values per tile product (16 pairs)
constexpr int64_t kTileRows = 16;  // rows of x per A tile
}  // namespace cann::amx

#if defined(__x86_64__) && defined(__linux__) && \
    ((defined(__clang__) && __clang_major__ >= 12) || (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 11))
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstring>
#define CANN_AMX 1
#define CANN_AMX_TARGET __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512bf16")))

namespace cann::amx {

// The layout ldtilecfg reads: palette 1, then per tile register its bytes per row and its rows.
struct TileConfig {
  uint8_t palette;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Linux hands out AMX's tile state only to a process that asked for it (ARCH_REQ_XCOMP_PERM, 0x1023,
// for XFEATURE_XTILEDATA, 18); without it the first tile instruction faults.
inline bool permitted() {
  static const bool granted = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return granted;
}

// tmm0-3: the sums, `rows` x 16 fp32 each (the block's four 16-column groups); tmm4: `rows` rows of
// x, 32 bf16 each; tmm5-7: B tiles, 16 k pairs x 16 columns x 2.
CANN_AMX_TARGET inline void configure(int rows) {
  TileConfig cfg;
  std::memset(&cfg, 0, sizeof cfg);
  cfg.palette = 1;
  for (int t = 0; t < 5; ++t) {
    cfg.rows[t] = static_cast<uint8_t>(rows);
    cfg.colsb[t] = 64;
  }
  for (int t = 5; t < 8; ++t) {
    cfg.rows[t] = kTileRows;
    cfg.colsb[t] = 64;
  }
  // GCC's _tile_loadconfig is an asm statement that does not say it reads memory: without this
  // barrier GCC 12 dropped the stores above as dead, and ldtilecfg faulted on a zeroed config.
  asm volatile("" : : "r"(&cfg) : "memory");
  _tile_loadconfig(&cfg);
}

CANN_AMX_TARGET inline void release() { _tile_release(); }

// Whether a block's later tiles of rows (reading it from L2) ask for the next block into L2 as they go,
// each chunk its share of the lines, so the first tile of the next block finds it there. It depends on
// the CPU, so it is asked only where it was measured faster: on the Intel AMX kind that reports family
// 6 model 207 the loop's pass over a 768 MiB weight (K = 1024) at 32 / 64 rows took 0.88x / 0.83x
// the time (medians of 9 rounds, arms in turns; a scratch overlap_probe) and the ge_graph bf16
// batch-64 step 0.87x (9 rounds in turns, one process; the same tokens). There a core's AMX
// products ran at ~0.4 or ~1.0 TFLOP/s, switching every few seconds, so at 64 rows the later tiles'
// products outlast the block's stream, and the ask overlaps the two; at the fast level it still took
// 0.88x at 64 rows (level at 32). On the kind that reports model 167 (products ~1.6 TFLOP/s from L2)
// the same ask read 0.88-0.92x the rate without it (BENCHMARKS.md, "seventy-third" and "eightieth
// pass"). The lines are shared out rounded down, so no ask runs past the next block; the first tile's
// 4 KB look-ahead covers the few left.
inline bool later_tiles_ask() {
  static const bool ask = [] {
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    if (!__builtin_cpu_is("intel") || !__get_cpuid(1, &eax, &ebx, &ecx, &edx)) return false;
    const unsigned family = (eax >> 8) & 0xf, model = ((eax >> 4) & 0xf) | (((eax >> 16) & 0xf) << 4);
    return family == 6 && model == 207;
  }();
  return ask;
}

// Lines of the next block each chunk of a later tile asks for, with `n_tiles` tiles of rows (0: no
// ask). A block is 64 lines a chunk in either layout (packed: 32 k values x 64 columns of bf16; as
// stored: the chunk's line of each of 64 weight rows), shared out over the tiles but the first: tile
// t (from 1) walks its own (t - 1)-th part of the next block, next_lines a chunk.
inline int next_lines(int64_t n_tiles) {
  return n_tiles > 1 && later_tiles_ask() ? static_cast<int>(kCols / (n_tiles - 1)) : 0;
}

// Where tile t of rows starts asking in the next packed block (`next`: null where no block follows),
// `lines` a chunk over K values: null for the first tile, or where nothing is asked.
inline const char* next_share(const uint16_t* next, int64_t t, int64_t K, int lines) {
  if (!next || !lines || t == 0) return nullptr;
  return reinterpret_cast<const char*>(next) + (t - 1) * (K / kChunk) * lines * 64;
}

// The configured rows of x (row stride ldx elements, K a multiple of 32) times one packed block w
// (K/2 pairs x 64 columns x 2), into c (rows x 64 fp32, row stride 64). `ahead` (bytes, 0: none):
// each chunk asks for the weight that far ahead into L1. `next` (null: none): each chunk asks for
// `lines` lines from there on into L2 (later_tiles_ask, above, says where and why).
CANN_AMX_TARGET inline void block(const uint16_t* x, int64_t ldx, int64_t K, const uint16_t* w, float* c, int ahead,
                                  const char* next = nullptr, int lines = 0) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t k0 = 0; k0 < K; k0 += kChunk) {
    const uint16_t* wk = w + k0 * kCols;  // pair k0 / 2, 128 values per pair
    if (ahead) {
      const char* pf = reinterpret_cast<const char*>(wk) + ahead;
      for (int line = 0; line < 64; ++line) _mm_prefetch(pf + line * 64, _MM_HINT_T0);
    }
    if (next) {
      for (int line = 0; line < lines; ++line) _mm_prefetch(next + line * 64, _MM_HINT_T1);
      next += lines * 64;
    }
    _tile_loadd(4, x + k0, ldx * 2);
    _tile_loadd(5, wk, 256);
    _tile_dpbf16ps(0, 4, 5);
    _tile_loadd(6, wk + 32, 256);
    _tile_dpbf16ps(1, 4, 6);
    _tile_loadd(7, wk + 64, 256);
    _tile_dpbf16ps(2, 4, 7);
    _tile_loadd(5, wk + 96, 256);
    _tile_dpbf16ps(3, 4, 5);
  }
  _tile_stored(0, c, 256);
  _tile_stored(1, c + 16, 256);
  _tile_stored(2, c + 32, 256);
  _tile_stored(3, c + 48, 256);
}

}  // namespace cann::amx
#endif
