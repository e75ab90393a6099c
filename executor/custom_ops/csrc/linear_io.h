// What every linear-shaped CPU kernel (gemv, rows_linear, amx_linear) does around its loops: the
// optional bias checked and converted to fp32 once (the loops add it in fp32), y allocated in x's
// shape with N columns, contiguous, and the weight's blocks shared out between threads
// (leftovers_for).
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <climits>
#include <cstdint>
#include <vector>

namespace cann {

// The bias as fp32 (undefined when there is none); `op` names the kernel in the error.
inline at::Tensor fp32_bias(const c10::optional<at::Tensor>& bias, int64_t N, const char* op) {
  if (!bias.has_value() || !bias->defined()) return at::Tensor();
  TORCH_CHECK(bias->numel() == N, op, ": bias has ", bias->numel(), " values, the weight ", N, " rows");
  return bias->to(at::kFloat).contiguous();
}

// y for x (..., K) times a weight of N rows: (..., N), contiguous.
inline at::Tensor linear_output(const at::Tensor& x, int64_t N) {
  std::vector<int64_t> shape = x.sizes().vec();
  shape.back() = N;
  return at::empty(shape, x.options().memory_format(at::MemoryFormat::Contiguous));
}

// One thread's share of the blocks, [lo, hi) packed in one word: its owner takes from the front,
// a thread whose own share is done takes from the back.
struct alignas(64) Share {
  std::atomic<uint64_t> range{0};  // lo | hi << 32
};

inline int64_t take(Share& s, bool front) {
  uint64_t cur = s.range.load(std::memory_order_relaxed);
  for (;;) {
    const uint64_t lo = cur & 0xffffffffu, hi = cur >> 32;
    if (lo >= hi) return -1;
    const uint64_t next = front ? (lo + 1) | (hi << 32) : lo | ((hi - 1) << 32);
    if (s.range.compare_exchange_weak(cur, next, std::memory_order_relaxed)) return front ? lo : hi - 1;
  }
}

inline bool left(const Share& s) {
  const uint64_t cur = s.range.load(std::memory_order_relaxed);
  return (cur & 0xffffffffu) < (cur >> 32);
}

// body(i, next) for every block i in [0, n), in parallel on at most `max_shares` threads: each thread
// runs its contiguous share in order (the split at::parallel_for makes), then takes the last blocks
// left of the other shares. `next`: block i + 1 is still this thread's to run (what a tile's
// prefetch of the next block needs).
// Why not at::parallel_for's fixed split alone: the two cores' equal shares did not take equal
// time (perf, rows_linear with SK decoder at bf16 batch 16: 59.3 against 55.5 ms a step), and the
// one done first waited at the end of every product. With the leftovers taken, 9 alternating
// rounds on one runner put the step at 0.926x the time at bf16 batch 4 with SK decoder (every
// round faster, 0.698-0.976), 0.977x at bf16 batch 4 with ge_graph and at fp32 batch 4 with SK
// decoder, and 0.988-1.001x at batch 16 and 0.990-0.998x at 64, where the step is compute-bound
// (BENCHMARKS.md, "forty-fifth pass"). A CAS per block costs nothing next to the block's 64-256 KB of weights.
template <typename F>
void leftovers_for(int64_t n, const F& body, int64_t max_shares = INT64_MAX) {
  const int64_t T = std::min<int64_t>({at::get_num_threads(), n, max_shares});
  if (T < 2) {  // one thread, one block or one share: in order, on this thread
    for (int64_t i = 0; i < n; ++i) body(i, i + 1 < n);
    return;
  }
  if (n > INT32_MAX) {  // more blocks than a share's word holds: the fixed split, T chunks
    at::parallel_for(0, n, (n + T - 1) / T, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) body(i, i + 1 < end);
    });
    return;
  }
  std::vector<Share> shares(T);
  for (int64_t t = 0; t < T; ++t)
    shares[t].range.store(static_cast<uint64_t>(n * t / T) | static_cast<uint64_t>(n * (t + 1) / T) << 32);
  // one share a thread where the pool has T threads; run serially (inside another parallel
  // region), or with fewer threads, a thread takes several shares and the rest are taken from
  // the back: every block runs once whatever the pool does
  at::parallel_for(0, T, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      for (int64_t i; (i = take(shares[t], true)) >= 0;) body(i, left(shares[t]));
    for (bool took = true; took;) {
      took = false;
      for (int64_t j = 1; j <= T && !took; ++j) {
        const int64_t i = take(shares[(begin + j) % T], false);
        if (i >= 0) {
          body(i, false);
          took = true;
        }
      }
    }
  });
}

}  // namespace cann
