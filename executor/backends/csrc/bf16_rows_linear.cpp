// CPU kernel of cann_cpu::bf16_rows_linear (schema, packing and use: executor/backends/packed_linear.py).
//
// y = x W^T + b for a few rows of bf16 x (a batched decode step: M = batch) on a bf16 weight W
// (N, K) packed once as (N/64, K/2, 64, 2): for each block of 64 output columns, the K/2 pairs of
// consecutive k values, 64 columns each. That is the operand layout of AVX512-BF16's vdpbf16ps,
// which multiplies 16 column pairs by one broadcast pair of x and adds both products into fp32.
//
// Why a kernel: at M = 1-64 a decode GEMM streams the whole weight once per step. oneDNN on a
// weight packed for the row count read the Qwen3-0.6B projections at 0.73-0.78x of a plain fp32
// sum's rate at M = 4 on the 2-core reference machine; this loop reads them at 0.97-1.0x, and at
// M = 16 and 64 (compute-bound) reaches 327-416 GFLOP/s against oneDNN's 291-343 (BENCHMARKS.md,
// "eighth pass"; inside the batch-64 decode step it measured slower, so the Python side gives it
// at most 16 rows). A tile is up to 6 rows x 64 columns: 24 fp32 accumulators, 4 weight registers
// and one broadcast, no horizontal reduction; each weight block is read from memory once and
// from cache by the further tiles of rows. Blocking K as well (to keep a block in L1 across row
// tiles) measured no better.
//
// The vector code is compiled for avx512bf16 per function (target attribute), so the library
// builds with the project's usual flags on any x86-64 host; bf16_rows_supported() says whether
// this CPU can run it, and the Python side never calls the kernel where it cannot.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define CANN_BF16_ROWS 1
#endif

namespace {

constexpr int64_t kCols = 64;  // output columns per block: 4 zmm of 16 fp32
constexpr int kRows = 6;        // rows per tile: 6 x 4 accumulators + 4 weights + 1 broadcast <= 32 zmm

#ifdef CANN_BF16_ROWS
#define CANN_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))

// One tile: MB rows of x (row stride ldx, bf16) times one packed 64-column block (K2 pairs).
template <int MB>
CANN_TARGET inline void tile(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t K2, const float* bias,
                             uint16_t* y, int64_t ldy) {
  __m512 acc[MB][4];
  for (int m = 0; m < MB; ++m)
    for (int c = 0; c < 4; ++c) acc[m][c] = bias ? _mm512_loadu_ps(bias + c * 16) : _mm512_setzero_ps();
  const int32_t* xr[MB];  // each row as k pairs: one 32-bit lane holds x[2k], x[2k + 1]
  for (int m = 0; m < MB; ++m) xr[m] = reinterpret_cast<const int32_t*>(x + m * ldx);
  for (int64_t kp = 0; kp < K2; ++kp) {
    const uint16_t* wk = w + kp * 2 * kCols;
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

using TileFn = void (*)(const uint16_t*, int64_t, const uint16_t*, int64_t, const float*, uint16_t*, int64_t);
constexpr TileFn kTiles[kRows + 1] = {nullptr, tile<1>, tile<2>, tile<3>, tile<4>, tile<5>, tile<6>};
#endif

bool bf16_rows_supported() {
#ifdef CANN_BF16_ROWS
  return __builtin_cpu_supports("avx512bf16");
#else
  return false;
#endif
}

at::Tensor bf16_rows_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(bf16_rows_supported(), "bf16_rows_linear: this CPU has no AVX512-BF16");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && packed.scalar_type() == at::kBFloat16,
              "bf16_rows_linear: x and the packed weight must be bf16");
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == kCols && packed.size(3) == 2 && packed.is_contiguous(),
              "bf16_rows_linear: the weight must be packed as (N/64, K/2, 64, 2)");
  const int64_t NB = packed.size(0), K2 = packed.size(1), K = 2 * K2, N = NB * kCols;
  TORCH_CHECK(x.size(-1) == K, "bf16_rows_linear: x has ", x.size(-1), " columns, the weight ", K);
  const at::Tensor x2 = x.reshape({-1, K}).contiguous();
  const int64_t M = x2.size(0);
  at::Tensor fbias;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == N, "bf16_rows_linear: bias has ", bias->numel(), " values, the weight ", N, " rows");
    fbias = bias->to(at::kFloat).contiguous();
  }
  std::vector<int64_t> shape = x.sizes().vec();
  shape.back() = N;
  at::Tensor y = at::empty(shape, x.options().memory_format(at::MemoryFormat::Contiguous));
#ifdef CANN_BF16_ROWS
  const auto* xp = reinterpret_cast<const uint16_t*>(x2.data_ptr());
  const auto* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr());
  const float* bp = fbias.defined() ? fbias.data_ptr<float>() : nullptr;
  auto* yp = reinterpret_cast<uint16_t*>(y.data_ptr());
  at::parallel_for(0, NB, 1, [&](int64_t begin, int64_t end) {
    for (int64_t nb = begin; nb < end; ++nb) {
      const uint16_t* wb = wp + nb * K2 * 2 * kCols;
      const float* bb = bp ? bp + nb * kCols : nullptr;
      for (int64_t m0 = 0; m0 < M; m0 += kRows) {
        const int64_t mb = std::min<int64_t>(kRows, M - m0);
        kTiles[mb](xp + m0 * K, K, wb, K2, bb, yp + m0 * N + nb * kCols, N);
      }
    }
  });
#endif
  return y;
}

}  // namespace

TORCH_LIBRARY_IMPL(cann_cpu, CPU, m) { m.impl("bf16_rows_linear", bf16_rows_linear); }
TORCH_LIBRARY_IMPL(cann_cpu, CompositeExplicitAutograd, m) { m.impl("bf16_rows_supported", bf16_rows_supported); }
