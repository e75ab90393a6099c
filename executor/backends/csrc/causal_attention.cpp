// CPU kernel of cann_cpu::causal_attention (schema and use: executor/backends/eager_attention.py).
//
// out = softmax(q k^T * scale + causal mask) v for a bf16 prefill from slot 0 (query i sees keys
// 0..i), with grouped-query heads: q (B, Hq, S, D), k and v (B, Hkv, S, D), Hq a multiple of Hkv.
// Returns (B, Hq, S, D) laid out as (B, S, Hq, D), the layout o_proj reads next.
//
// Why a kernel: PyTorch's CPU flash attention ran a 2048-token Qwen3-0.6B layer (16 query heads,
// 8 KV heads, D = 128) in 127-146 ms in bf16 on the 2-core reference machine, ~120 GFLOP/s, where
// the same machine's bf16 GEMMs run ~420: the causal attention was 40% of the prefill (BENCHMARKS.md,
// "twelfth pass"). This is a flash attention of the same shape as rows_linear.cpp's tiles:
// - K and V of each KV head are packed once per call into AVX512-BF16's vdpbf16ps operand layout
//   (pairs of consecutive reduction values, 64 output columns): K as (S/64, D/2, 64, 2) for the
//   scores, V as (D/64, S/2, 64, 2) for the output;
// - a work item is one KV head's block of query positions, for all G query heads that share it
//   (G x BQ rows), so every packed K/V block loaded feeds G times the rows;
// - per block of keys: the fp32 scores (tiles of 6 rows x 64 keys), the online softmax in fp32
//   with a vectorised exp (rows rescaled by exp(old max - new max)), the probabilities rounded
//   to bf16 (as a bf16 GEMM's operand is), and the output accumulated in fp32;
// - blocks of keys wholly above the diagonal are never computed; in the diagonal block the
//   masked keys get probability 0.
// Scores and probabilities stay in fp32 up to the rounding of p for the second product, as in
// PyTorch's kernel.
//
// The vector code is compiled for AVX-512 per function (target attribute);
// causal_attention_supported() says whether this CPU can run it, and the Python side never calls
// the kernel where it cannot.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define CANN_ATTN 1
#endif

namespace {

constexpr int64_t kCols = 64;  // keys per score tile, output columns per output tile: 4 zmm of 16 fp32
constexpr int kRows = 6;        // rows per tile: 6 x 4 accumulators + 4 operands + 1 broadcast <= 32 zmm
constexpr int64_t kKeys = 256;  // keys per block of the online softmax (a multiple of kCols)
constexpr int64_t kTileRows = 64;  // rows (G heads x query positions) per work item, about

#ifdef CANN_ATTN
#define CANN_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))

// exp(x) for x <= 0 (a score minus its row's max): 2^(x log2 e) split as 2^n 2^f, |f| <= 1/2, with
// 2^f from its degree-6 Taylor polynomial (relative error ~1e-7, below fp32's rounding of the
// scores it is applied to); below -87 the result is flushed towards 0 by the clamp.
CANN_TARGET inline __m512 exp_ps(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_mul_ps(_mm512_sub_ps(t, n), _mm512_set1_ps(0.693147180559945309f));  // f ln 2
  __m512 p = _mm512_set1_ps(1.0f / 720);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// One tile of either product: out[m][0..64) = (alpha ? out[m][0..64) * alpha[m] : 0) + a_m . B for
// MB rows of bf16 a (row stride lda) against one packed 64-column block B over K2 pairs of the
// reduction; out fp32, row stride ldo.
// - scores: a = q (K2 = D/2), B = 64 packed keys, no alpha;
// - output: a = the bf16 probabilities (K2 = keys/2), B = 64 packed columns of V, alpha = the
//   rows' rescaling by the online softmax.
template <int MB>
CANN_TARGET inline void dot_tile(const uint16_t* a, int64_t lda, const uint16_t* blk, int64_t K2, float* out,
                                 int64_t ldo, const float* alpha) {
  __m512 acc[MB][4];
  for (int m = 0; m < MB; ++m) {
    const __m512 s = _mm512_set1_ps(alpha ? alpha[m] : 0.0f);
    for (int c = 0; c < 4; ++c)
      acc[m][c] = alpha ? _mm512_mul_ps(_mm512_loadu_ps(out + m * ldo + c * 16), s) : _mm512_setzero_ps();
  }
  for (int64_t kp = 0; kp < K2; ++kp) {
    const uint16_t* w = blk + kp * 2 * kCols;
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(w);
    const __m512bh w1 = (__m512bh)_mm512_loadu_si512(w + 32);
    const __m512bh w2 = (__m512bh)_mm512_loadu_si512(w + 64);
    const __m512bh w3 = (__m512bh)_mm512_loadu_si512(w + 96);
    for (int m = 0; m < MB; ++m) {
      const __m512bh b = (__m512bh)_mm512_set1_epi32(reinterpret_cast<const int32_t*>(a + m * lda)[kp]);
      acc[m][0] = _mm512_dpbf16_ps(acc[m][0], w0, b);
      acc[m][1] = _mm512_dpbf16_ps(acc[m][1], w1, b);
      acc[m][2] = _mm512_dpbf16_ps(acc[m][2], w2, b);
      acc[m][3] = _mm512_dpbf16_ps(acc[m][3], w3, b);
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int c = 0; c < 4; ++c) _mm512_storeu_ps(out + m * ldo + c * 16, acc[m][c]);
}

using TileFn = void (*)(const uint16_t*, int64_t, const uint16_t*, int64_t, float*, int64_t, const float*);
constexpr TileFn kTile[kRows + 1] = {nullptr,     dot_tile<1>, dot_tile<2>, dot_tile<3>,
                                     dot_tile<4>, dot_tile<5>, dot_tile<6>};

// The online softmax of one row over one block of keys: s (fp32, `valid` keys of `width` used),
// scaled by `scale`; updates the row's running max and sum, writes the bf16 probabilities to p
// (0 past `valid`, up to `width`) and returns the factor the row's output is rescaled by.
CANN_TARGET inline float softmax_row(const float* s, int64_t valid, int64_t width, float scale, float& row_max,
                                     float& row_sum, uint16_t* p) {
  const __m512 vscale = _mm512_set1_ps(scale);
  __m512 vmax = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t j = 0; j < valid; j += 16) {
    const __mmask16 k = valid - j >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (valid - j)) - 1);
    vmax = _mm512_mask_max_ps(vmax, k, vmax, _mm512_mul_ps(_mm512_maskz_loadu_ps(k, s + j), vscale));
  }
  const float new_max = std::max(row_max, _mm512_reduce_max_ps(vmax));
  const float alpha = row_max == -std::numeric_limits<float>::infinity() ? 0.0f : std::exp(row_max - new_max);
  const __m512 vnew = _mm512_set1_ps(new_max);
  __m512 vsum = _mm512_setzero_ps();
  for (int64_t j = 0; j < width; j += 16) {
    const int64_t left = valid - j;
    const __mmask16 k = left >= 16 ? 0xFFFF : left <= 0 ? 0 : static_cast<__mmask16>((1u << left) - 1);
    const __m512 e = _mm512_maskz_mov_ps(k, exp_ps(_mm512_fmsub_ps(_mm512_loadu_ps(s + j), vscale, vnew)));
    vsum = _mm512_add_ps(vsum, e);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + j), (__m256i)_mm512_cvtneps_pbh(e));
  }
  row_sum = row_sum * alpha + _mm512_reduce_add_ps(vsum);
  row_max = new_max;
  return alpha;
}

// Pack one KV head: K (S, D) -> (T/64, D/2, 64, 2) and V (S, D) -> (D/64, T/2, 64, 2), T = S rounded
// up to 64 keys, the padding zero. Strides in elements (rows of K and V are contiguous).
void pack_kv(const uint16_t* k, int64_t ks, const uint16_t* v, int64_t vs, int64_t S, int64_t D, int64_t T,
             uint16_t* kp, uint16_t* vp) {
  std::fill(kp, kp + T * D, 0);
  std::fill(vp, vp + T * D, 0);
  for (int64_t j = 0; j < S; ++j) {
    const uint16_t* kr = k + j * ks;
    uint16_t* kb = kp + (j / kCols) * kCols * D + (j % kCols) * 2;
    for (int64_t d = 0; d < D; d += 2) {
      kb[(d / 2) * 2 * kCols] = kr[d];
      kb[(d / 2) * 2 * kCols + 1] = kr[d + 1];
    }
    const uint16_t* vr = v + j * vs;
    for (int64_t d = 0; d < D; ++d) vp[(d / kCols) * T * kCols + (j / 2) * 2 * kCols + (d % kCols) * 2 + j % 2] = vr[d];
  }
}

// One work item: query positions [q0, q1) of the G heads that share one KV head.
struct Item {
  const uint16_t* q;  // head 0 of the group, position 0
  int64_t qs, qh;     // strides: position, head
  const uint16_t *kp, *vp;
  uint16_t* out;      // (S, Hq, D) rows: head 0 of the group, position 0
  int64_t os, oh;
};

CANN_TARGET void run_item(const Item& it, int64_t G, int64_t q0, int64_t q1, int64_t D, int64_t T, float scale) {
  const int64_t bq = q1 - q0, R = G * bq;
  std::vector<uint16_t> qbuf(R * D), pbuf(R * kKeys);
  std::vector<float> sbuf(R * kKeys), obuf(R * D, 0.0f), row_max(R, -std::numeric_limits<float>::infinity()),
      row_sum(R, 0.0f), alpha(R);
  for (int64_t g = 0; g < G; ++g)  // rows g * bq + i: head g, position q0 + i
    for (int64_t i = 0; i < bq; ++i)
      std::copy(it.q + g * it.qh + (q0 + i) * it.qs, it.q + g * it.qh + (q0 + i) * it.qs + D, &qbuf[(g * bq + i) * D]);
  const int64_t end = std::min(T, (q1 + kCols - 1) / kCols * kCols);  // keys past the last position: none
  for (int64_t n0 = 0; n0 < end; n0 += kKeys) {
    const int64_t nk = std::min(kKeys, end - n0);
    for (int64_t nb = 0; nb < nk; nb += kCols)
      for (int64_t r = 0; r < R; r += kRows) {
        const int mb = static_cast<int>(std::min<int64_t>(kRows, R - r));
        kTile[mb](&qbuf[r * D], D, it.kp + (n0 + nb) * D, D / 2, &sbuf[r * kKeys + nb], kKeys, nullptr);
      }
    for (int64_t r = 0; r < R; ++r) {
      const int64_t valid = std::min(nk, q0 + r % bq + 1 - n0);
      if (valid <= 0) {  // the whole block is after this query: nothing changes
        alpha[r] = 1.0f;
        std::fill(&pbuf[r * kKeys], &pbuf[r * kKeys] + nk, 0);
        continue;
      }
      alpha[r] = softmax_row(&sbuf[r * kKeys], valid, nk, scale, row_max[r], row_sum[r], &pbuf[r * kKeys]);
    }
    for (int64_t db = 0; db < D; db += kCols)
      for (int64_t r = 0; r < R; r += kRows) {
        const int mb = static_cast<int>(std::min<int64_t>(kRows, R - r));
        kTile[mb](&pbuf[r * kKeys], kKeys, it.vp + db * T + n0 * kCols, nk / 2, &obuf[r * D + db], D, &alpha[r]);
      }
  }
  for (int64_t r = 0; r < R; ++r) {
    const int64_t g = r / bq, i = r % bq;
    uint16_t* o = it.out + g * it.oh + (q0 + i) * it.os;
    const __m512 inv = _mm512_set1_ps(1.0f / row_sum[r]);
    for (int64_t d = 0; d < D; d += 16)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + d),
                          (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(&obuf[r * D + d]), inv)));
  }
}
#endif

bool causal_attention_supported() {
#ifdef CANN_ATTN
  return __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512dq");
#else
  return false;
#endif
}

at::Tensor causal_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale) {
  TORCH_CHECK(causal_attention_supported(), "causal_attention: this CPU has no AVX512-BF16");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k.scalar_type() == at::kBFloat16 && v.scalar_type() == at::kBFloat16,
              "causal_attention: q, k and v must be bf16");
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "causal_attention: q, k, v must be (B, H, S, D)");
  const int64_t B = q.size(0), Hq = q.size(1), S = q.size(2), D = q.size(3), Hkv = k.size(1);
  TORCH_CHECK(k.sizes() == v.sizes() && k.size(0) == B && k.size(2) == S && k.size(3) == D,
              "causal_attention: k and v must be (B, Hkv, S, D) with q's B, S and D");
  TORCH_CHECK(Hkv > 0 && Hq % Hkv == 0, "causal_attention: ", Hq, " query heads are not a multiple of ", Hkv);
  TORCH_CHECK(D % kCols == 0, "causal_attention: head_dim ", D, " is not a multiple of ", kCols);
  TORCH_CHECK(q.stride(3) == 1 && k.stride(3) == 1 && v.stride(3) == 1, "causal_attention: rows must be contiguous");
  at::Tensor out = at::empty({B, S, Hq, D}, q.options());
#ifdef CANN_ATTN
  const int64_t G = Hq / Hkv, T = (S + kCols - 1) / kCols * kCols;
  at::Tensor kp = at::empty({B, Hkv, T * D}, q.options()), vp = at::empty({B, Hkv, T * D}, q.options());
  auto u16 = [](const at::Tensor& t) { return reinterpret_cast<const uint16_t*>(t.data_ptr()); };
  auto w16 = [](at::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr()); };
  at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / Hkv, h = bh % Hkv;
      pack_kv(u16(k) + b * k.stride(0) + h * k.stride(1), k.stride(2), u16(v) + b * v.stride(0) + h * v.stride(1),
              v.stride(2), S, D, T, w16(kp) + bh * T * D, w16(vp) + bh * T * D);
    }
  });
  // Query blocks of bq positions; item w takes block w of one KV head when w is even and the
  // mirrored block counted from the end when odd, so a run of consecutive items (one thread's
  // share) mixes early (cheap) and late (costly) positions.
  const int64_t bq = std::max<int64_t>(8, kTileRows / G), nq = (S + bq - 1) / bq;
  at::parallel_for(0, B * Hkv * nq, 1, [&](int64_t begin, int64_t end) {
    for (int64_t w = begin; w < end; ++w) {
      const int64_t bh = w / nq, j = w % nq, b = bh / Hkv, h = bh % Hkv;
      const int64_t blk = j % 2 == 0 ? j / 2 : nq - 1 - j / 2;
      const Item it{u16(q) + b * q.stride(0) + h * G * q.stride(1), q.stride(2), q.stride(1),
                    u16(kp) + bh * T * D, u16(vp) + bh * T * D,
                    w16(out) + b * S * Hq * D + h * G * D, Hq * D, D};
      run_item(it, G, blk * bq, std::min(S, (blk + 1) * bq), D, T, static_cast<float>(scale));
    }
  });
#endif
  return out.permute({0, 2, 1, 3});
}

}  // namespace

TORCH_LIBRARY_IMPL(cann_cpu, CPU, m) { m.impl("causal_attention", causal_attention); }
TORCH_LIBRARY_IMPL(cann_cpu, CompositeExplicitAutograd, m) {
  m.impl("causal_attention_supported", causal_attention_supported);
}
