// CPU kernel of cann_cpu::greedy_tokens (schema and use: executor/backends/greedy.py): the index of
// every row's largest logit, as torch.argmax(-1, keepdim=True) returns it (the first index among
// equal values; a NaN counts as the largest, the first NaN wins).
//
// Why: aten's argmax over the last dimension tracks an index per element and is not vectorised
// on CPU. Over the (B, 151936) logits of a Qwen3 step it took 65-130 us per fp32 row (bf16:
// 270-550), while a max alone took a tenth of that (BENCHMARKS.md, "fifteenth pass"). Here each
// row is read twice: once for its largest value (vector maximum, which keeps NaN), then from
// cache for the first index holding it.

#include "cpu_vec.h"  // first: ATen's vector width

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <tuple>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kBlock = 2 * Vec::size();  // two float vectors: one bf16 vector widened

inline std::tuple<Vec, Vec> load(const float* p) { return {Vec::loadu(p), Vec::loadu(p + Vec::size())}; }
inline std::tuple<Vec, Vec> load(const at::BFloat16* p) {
  return at::vec::convert_to_float<at::BFloat16>(at::vec::Vectorized<at::BFloat16>::loadu(p));
}

// Lanes of a block equal to `m`, as bits (lane 0 lowest). eq() gives 1.0 or 0.0 per lane, and
// zero_mask() the lanes that are 0.0, so the equal ones are its complement.
inline uint64_t equal_lanes(const Vec& a, const Vec& b, const Vec& m) {
  const uint64_t lo = ~static_cast<uint64_t>(a.eq(m).zero_mask()) & ((uint64_t{1} << Vec::size()) - 1);
  const uint64_t hi = ~static_cast<uint64_t>(b.eq(m).zero_mask()) & ((uint64_t{1} << Vec::size()) - 1);
  return lo | hi << Vec::size();
}

template <typename T>
int64_t first_max(const T* row, int64_t n) {
  const int64_t body = n - n % kBlock;
  float m = -std::numeric_limits<float>::infinity();
  if (body) {
    Vec ma(m), mb(m);
    for (int64_t i = 0; i < body; i += kBlock) {
      const auto [a, b] = load(row + i);
      ma = at::vec::maximum(ma, a);  // IEEE maximum: a NaN in either operand is kept
      mb = at::vec::maximum(mb, b);
    }
    m = at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return at::vec::maximum(x, y); }, at::vec::maximum(ma, mb));
  }
  for (int64_t i = body; i < n; ++i) {
    const float v = static_cast<float>(row[i]);
    if (!std::isnan(m) && (std::isnan(v) || v > m)) m = v;  // a NaN, once found, stays
  }
  if (std::isnan(m)) {  // rare (the runner stops on NaN logits first): a plain scan
    for (int64_t i = 0; i < n; ++i)
      if (std::isnan(static_cast<float>(row[i]))) return i;
  }
  const Vec mv(m);
  for (int64_t i = 0; i < body; i += kBlock) {
    const auto [a, b] = load(row + i);
    if (const uint64_t hit = equal_lanes(a, b, mv)) return i + __builtin_ctzll(hit);
  }
  for (int64_t i = body; i < n; ++i)
    if (static_cast<float>(row[i]) == m) return i;
  return n - 1;  // not reached: m is one of the row's values
}

at::Tensor greedy_tokens(const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.size(1) > 0, "greedy_tokens: logits must be (B, V) with V > 0, got ",
              logits.sizes());
  TORCH_CHECK(logits.scalar_type() == at::kFloat || logits.scalar_type() == at::kBFloat16,
              "greedy_tokens: logits must be float32 or bfloat16, got ", logits.scalar_type());
  TORCH_CHECK(logits.stride(1) == 1, "greedy_tokens: each row of logits must be contiguous");
  const int64_t B = logits.size(0), V = logits.size(1), ld = logits.stride(0);
  at::Tensor out = at::empty({B, 1}, logits.options().dtype(at::kLong));
  int64_t* o = out.data_ptr<int64_t>();
  auto rows = [&](const auto* x) {
    at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) o[r] = first_max(x + r * ld, V);
    });
  };
  if (logits.scalar_type() == at::kBFloat16)
    rows(logits.data_ptr<at::BFloat16>());
  else
    rows(logits.data_ptr<float>());
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(cann_cpu, CPU, m) { m.impl("greedy_tokens", greedy_tokens); }
