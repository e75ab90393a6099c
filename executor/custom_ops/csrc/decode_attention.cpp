// CPU kernel of cann::decode_attention (schema and fake: executor/custom_ops/decode_attention.py).
//
// Contract of executor.ops.attention: q (B, Hq, S, D); k_cache, v_cache the full static KV cache
// (B, Hkv, T, D); mask (B, 1, S, T) bool, True = masked out; returns (B, Hq, S, D) in q's dtype.
//
// Why a kernel: the masked reference scores all T cache slots, so a decode step at position p
// costs what max_len says. Here each (batch, kv head, query row) finds its last unmasked slot L
// in its mask row and reads slots [0, L] only (masked slots inside that range are skipped), so
// the cost follows the KV bytes that are valid. The Hq / Hkv query heads that share a kv head
// are done together, so each K and V row is read once. Softmax and accumulation run in fp32
// (inputs fp32, bf16 or fp16). A row with no unmasked slot gives NaN, as the reference does.

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

template <typename scalar_t>
void attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& mask, double scale,
            at::Tensor& out) {
  const int64_t B = q.size(0), Hq = q.size(1), S = q.size(2), D = q.size(3);
  const int64_t Hkv = k.size(1), G = Hq / Hkv;
  const int64_t T = k.size(2);
  const scalar_t* qp = q.data_ptr<scalar_t>();  // contiguous (B, Hq, S, D)
  const scalar_t* kp = k.data_ptr<scalar_t>();  // last dim contiguous; other strides as given
  const scalar_t* vp = v.data_ptr<scalar_t>();
  const bool* mp = mask.data_ptr<bool>();  // (B, 1, S, T), possibly broadcast (stride 0)
  scalar_t* op = out.data_ptr<scalar_t>();  // contiguous (B, Hq, S, D)
  const int64_t ks0 = k.stride(0), ks1 = k.stride(1), ks2 = k.stride(2);
  const int64_t vs0 = v.stride(0), vs1 = v.stride(1), vs2 = v.stride(2);
  const int64_t ms0 = mask.stride(0), ms2 = mask.stride(2), ms3 = mask.stride(3);
  const float fscale = static_cast<float>(scale);

  // one work item = (b, kv head h, query row s); grain 1: items are few and each is long
  at::parallel_for(0, B * Hkv * S, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(G * D), acc(G * D), scores, rowmax(G), rowsum(G);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t s = item % S, h = (item / S) % Hkv, b = item / (S * Hkv);
      const bool* m = mp + b * ms0 + s * ms2;
      int64_t last = T - 1;
      while (last >= 0 && m[last * ms3]) --last;  // the slots after the last valid one are never read
      scalar_t* o0 = op + ((b * Hq + h * G) * S + s) * D;
      if (last < 0) {
        for (int64_t g = 0; g < G; ++g)
          std::fill(o0 + g * S * D, o0 + g * S * D + D, static_cast<scalar_t>(std::numeric_limits<float>::quiet_NaN()));
        continue;
      }
      const int64_t n = last + 1;
      for (int64_t g = 0; g < G; ++g) {  // the scaled query rows of this kv head's group, in fp32
        const scalar_t* qr = qp + ((b * Hq + h * G + g) * S + s) * D;
        for (int64_t d = 0; d < D; ++d) qf[g * D + d] = static_cast<float>(qr[d]) * fscale;
      }
      scores.assign(G * n, -std::numeric_limits<float>::infinity());
      for (int64_t t = 0; t < n; ++t) {
        if (m[t * ms3]) continue;
        const scalar_t* kr = kp + b * ks0 + h * ks1 + t * ks2;
        for (int64_t g = 0; g < G; ++g) {
          const float* qg = qf.data() + g * D;
          float dot = 0.f;
#pragma omp simd reduction(+ : dot)
          for (int64_t d = 0; d < D; ++d) dot += qg[d] * static_cast<float>(kr[d]);
          scores[g * n + t] = dot;
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        float* sg = scores.data() + g * n;
        const float mx = *std::max_element(sg, sg + n);
        float sum = 0.f;
        for (int64_t t = 0; t < n; ++t) {
          sg[t] = std::exp(sg[t] - mx);  // masked: exp(-inf) = 0
          sum += sg[t];
        }
        rowsum[g] = sum;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = 0; t < n; ++t) {
        if (m[t * ms3]) continue;
        const scalar_t* vr = vp + b * vs0 + h * vs1 + t * vs2;
        for (int64_t g = 0; g < G; ++g) {
          const float p = scores[g * n + t];
          float* ag = acc.data() + g * D;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) ag[d] += p * static_cast<float>(vr[d]);
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        scalar_t* og = o0 + g * S * D;
        const float inv = 1.f / rowsum[g];
        for (int64_t d = 0; d < D; ++d) og[d] = static_cast<scalar_t>(acc[g * D + d] * inv);
      }
    }
  });
}

at::Tensor decode_attention_cpu(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                const at::Tensor& mask, double scale) {
  TORCH_CHECK(q.dim() == 4 && k_cache.dim() == 4 && v_cache.dim() == 4 && mask.dim() == 4,
              "cann::decode_attention: q, k_cache, v_cache, mask must be 4-D (B, H, S|T, D) / (B, 1, S, T)");
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes(), "cann::decode_attention: k_cache and v_cache shapes differ");
  TORCH_CHECK(q.size(0) == k_cache.size(0) && q.size(3) == k_cache.size(3),
              "cann::decode_attention: q and the cache disagree on batch or head dim");
  TORCH_CHECK(k_cache.size(1) > 0 && q.size(1) % k_cache.size(1) == 0,
              "cann::decode_attention: query heads must be a multiple of kv heads");
  TORCH_CHECK(mask.scalar_type() == at::kBool, "cann::decode_attention: mask must be bool (True = masked out)");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == v_cache.scalar_type(),
              "cann::decode_attention: q, k_cache, v_cache must share a dtype");
  const at::Tensor qc = q.contiguous();
  const at::Tensor kc = k_cache.stride(3) == 1 ? k_cache : k_cache.contiguous();
  const at::Tensor vc = v_cache.stride(3) == 1 ? v_cache : v_cache.contiguous();
  const at::Tensor m = mask.expand({q.size(0), 1, q.size(2), k_cache.size(2)});
  at::Tensor out = at::empty(q.sizes(), q.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "cann::decode_attention",
                                  [&] { attend<scalar_t>(qc, kc, vc, m, scale, out); });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(cann, CPU, m) { m.impl("decode_attention", &decode_attention_cpu); }
