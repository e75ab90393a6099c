// What every linear-shaped CPU kernel (gemv, rows_linear, amx_linear) does around its loops: the
// optional bias checked and converted to fp32 once (the loops add it in fp32), and y allocated in
// x's shape with N columns, contiguous.
#pragma once

#include <ATen/ATen.h>

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

}  // namespace cann
