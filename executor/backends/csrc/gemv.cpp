// CPU kernel of cann_cpu::gemv (schema and use: executor/backends/eager_linear.py).
//
// y = x W^T + b for one to four rows of x on a weight W (N, K) as stored (rows contiguous), in
// bf16 or fp32, accumulating in fp32.
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
// The vector code is compiled for AVX-512 per function (target attribute); gemv_supported(dtype)
// says whether this CPU can run it, and the Python side never calls the kernel where it cannot.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdint>
#include <vector>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define CANN_GEMV 1
#endif

namespace {

constexpr int kMaxRows = 4;       // rows of x per call: 4 x 4 accumulators + 4 weights + 1 x <= 32 zmm
constexpr int64_t kGrain = 256;  // outputs per parallel chunk, at least

#ifdef CANN_GEMV
#define CANN_BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
#define CANN_F32_TARGET __attribute__((target("avx512f")))

// Output n of MB rows, bf16: the weight row read front to back (consecutive rows are consecutive
// memory, so a thread's share of the weight is one sequential stream), 4 x 32 k values per step
// into 4 independent accumulators per row of x, the tail 32 at a time, masked.
template <int MB>
CANN_BF16_TARGET inline void bf16_row(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t K, float bias,
                                      uint16_t* y, int64_t ldy) {
  __m512 acc[MB][4];
  for (int m = 0; m < MB; ++m)
    for (int u = 0; u < 4; ++u) acc[m][u] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 128 <= K; k += 128) {
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
  for (int m = 0; m < MB; ++m) {
    const __m512 sum = _mm512_add_ps(_mm512_add_ps(acc[m][0], acc[m][1]), _mm512_add_ps(acc[m][2], acc[m][3]));
    y[m * ldy] = c10::BFloat16(_mm512_reduce_add_ps(sum) + bias).x;  // round to nearest even, as aten does
  }
}

// The same in fp32: 4 x 16 k values per step, FMA.
template <int MB>
CANN_F32_TARGET inline void f32_row(const float* x, int64_t ldx, const float* w, int64_t K, float bias, float* y,
                                    int64_t ldy) {
  __m512 acc[MB][4];
  for (int m = 0; m < MB; ++m)
    for (int u = 0; u < 4; ++u) acc[m][u] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 64 <= K; k += 64) {
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

template <typename T>
using RowFn = void (*)(const T*, int64_t, const T*, int64_t, float, T*, int64_t);
constexpr RowFn<uint16_t> kBf16[kMaxRows] = {bf16_row<1>, bf16_row<2>, bf16_row<3>, bf16_row<4>};
constexpr RowFn<float> kF32[kMaxRows] = {f32_row<1>, f32_row<2>, f32_row<3>, f32_row<4>};

template <typename T>
void run(RowFn<T> fn, const T* x, int64_t M, const T* w, int64_t ldw, int64_t N, int64_t K, const float* bias, T* y) {
  at::parallel_for(0, N, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) fn(x, K, w + n * ldw, K, bias ? bias[n] : 0.0f, y + n, N);
  });
}
#endif

bool gemv_supported(at::ScalarType dtype) {
#ifdef CANN_GEMV
  if (dtype == at::kBFloat16) return __builtin_cpu_supports("avx512bf16");
  if (dtype == at::kFloat) return __builtin_cpu_supports("avx512f");
#endif
  return false;
}

at::Tensor gemv(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  const at::ScalarType dtype = weight.scalar_type();
  TORCH_CHECK(dtype == at::kBFloat16 || dtype == at::kFloat, "gemv: the weight must be bf16 or fp32");
  TORCH_CHECK(x.scalar_type() == dtype, "gemv: x is ", x.scalar_type(), ", the weight ", dtype);
  TORCH_CHECK(gemv_supported(dtype), "gemv: this CPU has no ", dtype == at::kBFloat16 ? "AVX512-BF16" : "AVX-512");
  TORCH_CHECK(weight.dim() == 2 && weight.stride(1) == 1, "gemv: the weight must be (N, K) with contiguous rows");
  const int64_t N = weight.size(0), K = weight.size(1);
  TORCH_CHECK(x.size(-1) == K, "gemv: x has ", x.size(-1), " columns, the weight ", K);
  const at::Tensor x2 = x.reshape({-1, K}).contiguous();
  const int64_t M = x2.size(0);
  TORCH_CHECK(M >= 1 && M <= kMaxRows, "gemv: takes 1 to ", kMaxRows, " rows, got ", M);
  at::Tensor fbias;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == N, "gemv: bias has ", bias->numel(), " values, the weight ", N, " rows");
    fbias = bias->to(at::kFloat).contiguous();
  }
  std::vector<int64_t> shape = x.sizes().vec();
  shape.back() = N;
  at::Tensor y = at::empty(shape, x.options().memory_format(at::MemoryFormat::Contiguous));
#ifdef CANN_GEMV
  const float* bp = fbias.defined() ? fbias.data_ptr<float>() : nullptr;
  if (dtype == at::kBFloat16) {
    run<uint16_t>(kBf16[M - 1], reinterpret_cast<const uint16_t*>(x2.data_ptr()), M,
                  reinterpret_cast<const uint16_t*>(weight.data_ptr()), weight.stride(0), N, K, bp,
                  reinterpret_cast<uint16_t*>(y.data_ptr()));
  } else {
    run<float>(kF32[M - 1], x2.data_ptr<float>(), M, weight.data_ptr<float>(), weight.stride(0), N, K, bp,
               y.data_ptr<float>());
  }
#endif
  return y;
}

}  // namespace

TORCH_LIBRARY_IMPL(cann_cpu, CPU, m) { m.impl("gemv", gemv); }
TORCH_LIBRARY_IMPL(cann_cpu, CompositeExplicitAutograd, m) { m.impl("gemv_supported", gemv_supported); }
