// Whether a core can stream a weight from memory while it computes on data in its L2
// (benchmarks/overlap_bench.py builds and runs this; see its docstring for why).
//
// usage: overlap_probe fp32|amx ROWS MBYTES ROUNDS THREADS
// built: c++ -O3 -march=native -std=c++17 -pthread -I executor/custom_ops/csrc overlap_probe.cpp
//
// fp32: the loop is rows_linear's fp32 shape (written again here in GCC's vector types, so that it
// also builds for an AVX2 CPU): a weight packed in blocks of CB columns (K = 1024 rows of
// CB floats each), every block times every tile of at most 6 rows (4 vectors of accumulators a row),
// the block read from memory by its first tile and from L2 by the others. Compiled for this CPU
// (-march=native): CB is 64 with AVX-512, 32 with AVX2. Each round times, in turn, on THREADS
// threads (each on its own share of the blocks):
//   stream    a plain sum over the packed weight (its bytes per second);
//   compute   every tile of rows on one block per thread, over and over (from L2: GFLOP/s);
//   pass      every block times every tile, no software prefetch;
//   pass_pf   the same, every tile asking for its share of the next block's lines into L2 as it goes,
//             in proportion to its rows (rows_linear's run_tiles); a lone tile (up to 6 rows) asks
//             for its own block 32 steps ahead into L1 instead (as rows_linear's does on Intel);
//   alone6    a 6-row tile on the hot block (GFLOP/s), and
//   asking    the same tile asking for one line a k step of the thread's share of the cold weight
//             into L2: its GFLOP/s, and the GB/s of lines it asked for;
// and prints one line per round: "round R stream GBPS compute GFLOPS pass GBPS pass_pf GBPS
// alone6 GFLOPS asking_compute GFLOPS asking_stream GBPS".
// amx (a CPU with AMX-BF16, Linux): the loop is amx_linear's own (cann::amx::block, amx_tiles.h) on its
// packed bf16 weight (blocks of 64 columns, K = 1024 as 512 k pairs; tiles of up to 16 rows), and
// the rounds print stream, compute, pass and pass_pf, where pass_pf is the kernel's scheme: the
// first tile of rows asks for the weight 4 KB ahead into L1 (later tiles read the block from L2, and
// on the CPUs where the kernel has them ask for the next block into L2: cann::amx::next_lines).
// The weight sits on 2 MiB pages where Linux gives them (as the runner puts packed weights: 4 KiB
// pages read ~0.8x as fast here). The passes' outputs are checked against a plain loop on the first
// and last block (exit 3).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#ifdef __linux__
#include <sys/mman.h>
#endif

#include "amx_tiles.h"  // amx_linear's loop (executor/custom_ops/csrc); CANN_AMX where this compiler emits AMX

namespace {

#if defined(__AVX512F__)
constexpr int kW = 16;  // floats a vector
#else
constexpr int kW = 8;
#endif
typedef float vf __attribute__((vector_size(kW * 4)));
constexpr long kCB = 4 * kW;  // columns a block: four vectors
constexpr long kK = 1024;     // k rows a block
constexpr long kBlock = kK * kCB;
constexpr long kOwnAhead = 32;  // k steps a lone tile asks for its own block ahead (rows_linear on Intel)

double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

inline vf load(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// MB rows of x (row stride kK) times one block into y (row stride ldy); each k step also asks for
// `pfl` lines from `pf` on into L2; with `own`, it asks for its own block's lines kOwnAhead steps on
// into L1 instead.
template <int MB>
__attribute__((noinline)) void tile(const float* x, const float* w, float* y, long ldy, const char* pf, int pfl,
                                    bool own) {
  vf acc[MB][4] = {};
  for (long k = 0; k < kK; ++k) {
    for (int i = 0; i < pfl; ++i) __builtin_prefetch(pf + (k * pfl + i) * 64, 0, 2);
    if (own && k + kOwnAhead < kK) {
      const char* ahead = reinterpret_cast<const char*>(w + (k + kOwnAhead) * kCB);
      for (long i = 0; i < kCB * 4; i += 64) __builtin_prefetch(ahead + i, 0, 3);
    }
    const float* wk = w + k * kCB;
    const vf w0 = load(wk), w1 = load(wk + kW), w2 = load(wk + 2 * kW), w3 = load(wk + 3 * kW);
    for (int m = 0; m < MB; ++m) {
      const float b = x[m * kK + k];
      acc[m][0] += w0 * b;
      acc[m][1] += w1 * b;
      acc[m][2] += w2 * b;
      acc[m][3] += w3 * b;
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int c = 0; c < 4; ++c) std::memcpy(y + m * ldy + c * kW, &acc[m][c], sizeof(vf));
}

using TileFn = void (*)(const float*, const float*, float*, long, const char*, int, bool);
constexpr TileFn kTiles[7] = {nullptr, tile<1>, tile<2>, tile<3>, tile<4>, tile<5>, tile<6>};

// Every tile of M rows on block `w` into y's block (row stride ldy). With `next`, every tile also asks
// for its share of the next block's lines a step into L2, in proportion to its rows, the shares
// adding up to the block's lines a step (rows_linear's block_tiles, 16 rows: 1 + 1 + 2 of 4); a lone
// tile asks for its own block ahead instead (rows_linear's fp32 tile on an Intel CPU).
void block_tiles(const float* x, long M, const float* w, float* y, long ldy, const float* next) {
  const long n = (M + 5) / 6, base = M / n, extra = M % n, lines = kCB * 4 / 64;
  const char* pf = reinterpret_cast<const char*>(next);
  for (long t = 0, m0 = 0; t < n; ++t) {
    const long mb = base + (t < extra);
    const int pfl = next && n > 1 ? static_cast<int>((lines * (m0 + mb)) / M - (lines * m0) / M) : 0;
    kTiles[mb](x + m0 * kK, w, y + m0 * ldy, ldy, pf, pfl, next && n == 1);
    pf += pfl * kK * 64;
    m0 += mb;
  }
}

constexpr long kHuge = 2L << 20;

// A zeroed buffer of n values on 64-byte lines (the weight on 2 MiB huge pages), as the kernels' are:
// std::vector's 16-byte alignment split every 64-byte load and tile row across two lines, and ran the
// AMX loop at ~0.5x its speed and the fp32 one at ~0.85x.
template <typename T>
struct Buffer {
  T* p;
  explicit Buffer(long n, long align = 64) {
    const long bytes = (n * static_cast<long>(sizeof(T)) + align - 1) / align * align;
    p = static_cast<T*>(std::aligned_alloc(align, bytes));
    if (!p) {
      std::fprintf(stderr, "overlap_probe: out of memory (%ld bytes)\n", bytes);
      std::exit(2);
    }
#ifdef __linux__
    if (align == kHuge) madvise(p, bytes, MADV_HUGEPAGE);  // as executor/huge_pages.py asks for packed weights
#endif
    std::memset(p, 0, bytes);
  }
  ~Buffer() { std::free(p); }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  T* data() { return p; }
  T& operator[](long i) { return p[i]; }
};

template <typename F>
double on_threads(int threads, F f) {
  std::vector<std::thread> pool;
  const double t0 = now();
  for (int t = 0; t < threads; ++t) pool.emplace_back(f, t);
  for (auto& t : pool) t.join();
  return now() - t0;
}

// f(t, b0, b1) on each of `threads` threads, thread t on its share [b0, b1) of `blocks` blocks; seconds.
template <typename F>
double on_shares(int threads, long blocks, F f) {
  return on_threads(threads, [&](int t) { f(t, blocks * t / threads, blocks * (t + 1) / threads); });
}

// --- fp32: the rounds of the header's list, on a weight of `mbytes` MiB in kBlock-float blocks ---
int run_fp32(long M, long mbytes, int rounds, int threads) {
  const long NB = std::max(2L * threads, (mbytes << 20) / (kBlock * 4)), N = NB * kCB;
  Buffer<float> w(NB * kBlock, kHuge), x(M * kK), y(M * N), hot_y(threads * M * kCB);
  Buffer<float> x6(6 * kK), y6(threads * 6 * kCB);  // the 6-row tile's own rows (M may be fewer)
  for (long i = 0; i < 6 * kK; ++i) x6[i] = 0.25f;
  for (long i = 0; i < NB * kBlock; ++i) w[i] = static_cast<float>((i * 7919) % 1000) * 1e-3f - 0.5f;
  for (long i = 0; i < M * kK; ++i) x[i] = static_cast<float>((i * 104729) % 1000) * 1e-3f - 0.5f;
  const double bytes = NB * kBlock * 4.0;
  auto pass = [&](bool prefetch) {
    return on_shares(threads, NB, [&](int, long b0, long b1) {
      for (long nb = b0; nb < b1; ++nb)
        block_tiles(x.data(), M, w.data() + nb * kBlock, y.data() + nb * kCB, N,
                    prefetch && nb + 1 < b1 ? w.data() + (nb + 1) * kBlock : nullptr);
    });
  };
  std::vector<double> sums(threads);
  const long hot_reps = std::max(1L, 20000L / M);  // ~20 ms a thread
  for (int r = 0; r < rounds; ++r) {
    const double ts = on_shares(threads, NB, [&](int t, long b0, long b1) {
      vf acc = {};
      for (long i = b0 * kBlock; i < b1 * kBlock; i += kW) acc += load(w.data() + i);
      double s = 0;
      for (int i = 0; i < kW; ++i) s += acc[i];
      sums[t] = s;
    });
    const double tc = on_shares(threads, NB, [&](int t, long b0, long) {
      for (long rep = 0; rep < hot_reps; ++rep)
        block_tiles(x.data(), M, w.data() + b0 * kBlock, hot_y.data() + t * M * kCB, kCB, nullptr);
    });
    const double tp = pass(false), tpf = pass(true);
    // a 6-row tile on the hot block, asking for one line a k step of the thread's cold share
    long blocks_asked = 0;
    const double tq = on_shares(threads, NB, [&](int t, long b0, long b1) {
      const long lines = (b1 - b0) * kBlock * 4 / 64, reps = lines / kK;
      const char* cold = reinterpret_cast<const char*>(w.data() + b0 * kBlock);
      for (long rep = 0; rep < reps; ++rep)
        kTiles[6](x6.data(), w.data() + b0 * kBlock, y6.data() + t * 6 * kCB, kCB, cold + rep * kK * 64, 1, false);
      if (t == 0) blocks_asked = reps;
    });
    const double asked = blocks_asked * threads * kK * 64.0;
    const double t6 = on_shares(threads, NB, [&](int t, long b0, long) {  // the same tile asking nothing
      for (long rep = 0; rep < blocks_asked; ++rep)
        kTiles[6](x6.data(), w.data() + b0 * kBlock, y6.data() + t * 6 * kCB, kCB, nullptr, 0, false);
    });
    std::printf("round %d stream %.2f compute %.1f pass %.2f pass_pf %.2f alone6 %.1f asking_compute %.1f "
                "asking_stream %.2f\n", r, bytes / ts / 1e9, hot_reps * 2.0 * M * kCB * kK * threads / tc / 1e9, bytes / tp / 1e9,
                bytes / tpf / 1e9, blocks_asked * threads * 12.0 * kCB * kK / t6 / 1e9,
                blocks_asked * threads * 12.0 * kCB * kK / tq / 1e9, asked / tq / 1e9);
    std::fflush(stdout);
  }
  for (long nb : {0L, NB - 1})  // the last pass (with prefetch) against a plain loop
    for (long m = 0; m < M; ++m)
      for (long c = 0; c < kCB; ++c) {
        double ref = 0, mag = 0;
        for (long k = 0; k < kK; ++k) {
          ref += static_cast<double>(x[m * kK + k]) * w[nb * kBlock + k * kCB + c];
          mag += std::fabs(static_cast<double>(x[m * kK + k]) * w[nb * kBlock + k * kCB + c]);
        }
        if (std::fabs(y[m * N + nb * kCB + c] - ref) > 1e-5 * mag + 1e-6) {
          std::fprintf(stderr, "overlap_probe: wrong sum at block %ld row %ld column %ld\n", nb, m, c);
          return 3;
        }
      }
  double total = 0;
  for (double s : sums) total += s;
  std::printf("checksum %.3f\n", total);
  return 0;
}

#ifdef CANN_AMX
// --- amx: amx_linear's loop (cann::amx::block, amx_tiles.h) and its row tiles (amx_linear.cpp's
// run_blocks), on a bf16 weight packed as (NB, K/2, 64, 2) ---
constexpr long kAmxCols = cann::amx::kCols, kAmxBlock = kK * kAmxCols;  // bf16 values a block

// Every tile of M rows (balanced, at most 16) on block w into y's block (row stride ldy); with
// `ahead` (the caller says whether more weight follows), the kernel's asks: the first tile for the
// weight 4 KB ahead, and where the kernel makes it (cann::amx::next_lines) the later ones for the
// next block into L2.
void amx_tiles(const uint16_t* x, long M, const uint16_t* w, float* y, long ldy, bool ahead, int& configured) {
  alignas(64) float c[16 * kAmxCols];
  const long n = (M + 15) / 16;
  const int lines = ahead ? cann::amx::next_lines(n) : 0;
  for (long t = 0, m0 = 0, mb = 0; t < n; ++t, m0 += mb) {
    mb = M / n + (t < M % n);
    if (mb != configured) {
      cann::amx::configure(static_cast<int>(mb));
      configured = static_cast<int>(mb);
    }
    const char* next = cann::amx::next_share(w + kAmxBlock, t, kK, lines);  // with `ahead`, more weight follows
    cann::amx::block(x + m0 * kK, kK, kK, w, c, ahead && t == 0 ? 4096 : 0, next, lines);
    for (long m = 0; m < mb; ++m) std::memcpy(y + (m0 + m) * ldy, c + m * kAmxCols, kAmxCols * 4);
  }
}

float bf16_value(uint16_t v) {
  const uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

int run_amx(long M, long mbytes, int rounds, int threads) {
  if (!__builtin_cpu_supports("amx-tile") || !__builtin_cpu_supports("amx-bf16")) {
    std::fprintf(stderr, "overlap_probe: this CPU has no AMX-BF16\n");
    return 2;
  }
  if (!cann::amx::permitted()) {  // ARCH_REQ_XCOMP_PERM for the tile data
    std::fprintf(stderr, "overlap_probe: the kernel did not grant this process AMX's tile data\n");
    return 2;
  }
  const long NB = std::max(2L * threads, (mbytes << 20) / (kAmxBlock * 2)), N = NB * kAmxCols;
  Buffer<uint16_t> w(NB * kAmxBlock, kHuge), x(M * kK);
  Buffer<float> y(M * N), hot_y(threads * M * kAmxCols);
  for (long i = 0; i < NB * kAmxBlock; ++i) w[i] = static_cast<uint16_t>(0x3c00 + (i * 7919) % 256);  // ~0.008-0.016
  for (long i = 0; i < M * kK; ++i) x[i] = static_cast<uint16_t>(((i * 104729) % 2 ? 0xbf00 : 0x3f00) + i % 128);
  const double bytes = NB * kAmxBlock * 2.0;
  auto pass = [&](bool ahead) {
    return on_shares(threads, NB, [&](int, long b0, long b1) {
      int configured = 0;
      for (long nb = b0; nb < b1; ++nb)
        amx_tiles(x.data(), M, w.data() + nb * kAmxBlock, y.data() + nb * kAmxCols, N, ahead && nb + 1 < NB, configured);
      cann::amx::release();
    });
  };
  const long hot_reps = std::max(1L, 150000L / M);  // ~20 ms a thread
  for (int r = 0; r < rounds; ++r) {
    const double ts = on_shares(threads, NB, [&](int, long b0, long b1) {
      vf acc = {};
      const float* f = reinterpret_cast<const float*>(w.data());
      for (long i = b0 * kAmxBlock / 2; i < b1 * kAmxBlock / 2; i += kW) acc += load(f + i);
      volatile float sink = acc[0];
      (void)sink;
    });
    const double tc = on_shares(threads, NB, [&](int t, long b0, long) {
      int configured = 0;
      for (long rep = 0; rep < hot_reps; ++rep)
        amx_tiles(x.data(), M, w.data() + b0 * kAmxBlock, hot_y.data() + t * M * kAmxCols, kAmxCols, false, configured);
      cann::amx::release();
    });
    const double tp = pass(false), tpf = pass(true);
    std::printf("round %d stream %.2f compute %.1f pass %.2f pass_pf %.2f\n", r, bytes / ts / 1e9,
                hot_reps * 2.0 * M * kAmxCols * kK * threads / tc / 1e9, bytes / tp / 1e9, bytes / tpf / 1e9);
    std::fflush(stdout);
  }
  for (long nb : {0L, NB - 1})  // the last pass against a plain loop (bf16 products summed in fp32)
    for (long m = 0; m < M; ++m)
      for (long col = 0; col < kAmxCols; ++col) {
        double ref = 0, mag = 0;
        for (long k = 0; k < kK; ++k) {
          const double p = static_cast<double>(bf16_value(x[m * kK + k])) *
                           bf16_value(w[nb * kAmxBlock + (k / 2) * kAmxCols * 2 + col * 2 + k % 2]);
          ref += p;
          mag += std::fabs(p);
        }
        if (std::fabs(y[m * N + nb * kAmxCols + col] - ref) > 1e-4 * mag + 1e-6) {
          std::fprintf(stderr, "overlap_probe: wrong sum at block %ld row %ld column %ld\n", nb, m, col);
          return 3;
        }
      }
  return 0;
}
#endif

}  // namespace

int main(int argc, char** argv) {
  if (argc != 6) {
    std::fprintf(stderr, "usage: overlap_probe fp32|amx ROWS MBYTES ROUNDS THREADS\n");
    return 2;
  }
  const std::string loop = argv[1];
  const long M = std::atol(argv[2]), mbytes = std::atol(argv[3]);
  const int rounds = std::atoi(argv[4]), threads = std::atoi(argv[5]);
  if (M < 1 || mbytes < 1 || rounds < 1 || threads < 1) {
    std::fprintf(stderr, "overlap_probe: expected ROWS, MBYTES, ROUNDS and THREADS >= 1\n");
    return 2;
  }
  if (loop == "fp32") return run_fp32(M, mbytes, rounds, threads);
#ifdef CANN_AMX
  if (loop == "amx") return run_amx(M, mbytes, rounds, threads);
#endif
  std::fprintf(stderr, "overlap_probe: no %s loop in this build (fp32%s)\n", loop.c_str(),
#ifdef CANN_AMX
               ", amx"
#else
               ""
#endif
  );
  return 2;
}
