// CPU kernels of cann_cpu::rms_norm, add_rms_norm, swiglu, rotary_mul and kv_update (schemas and
// use: executor/backends/eager_pointwise.py).
//
// Each computes its executor.ops reference function (executor/ops/reference.py) in one pass over
// its rows, rounding where the reference rounds: every intermediate the reference holds as a
// bf16 tensor is rounded to bf16 here too (to nearest even, as PyTorch does), and the exp is the
// one PyTorch's silu uses. On random inputs every result was bit-equal to the reference's in both
// dtypes; a norm can differ by one rounding where its sum is ordered differently.
//
// Why: the reference writes each op as 4-8 aten calls, each a pass over memory with its own
// dispatch, dtype casts and temporaries. At the Qwen3-0.6B shape with a 128-token prompt one
// layer's norms, RoPEs and SwiGLU took 0.61-0.81x the reference's time, and the bf16 prefill
// 0.94x (BENCHMARKS.md, "thirteenth pass"). The compiled decode step does not come here:
// Inductor fuses the reference there.
//
// Rows are handled in blocks of two float vectors, so rows of any length work (a partial block
// at the end of a row).
//
// A call a kernel does not take (another dtype, rows that are not contiguous, shapes it does not
// run) returns None (kv_update: false), having written nothing, and eager_pointwise runs the
// reference for it; values that are wrong for the reference too (a KV slot outside the cache) are
// errors. Why here and not in Python: the eager decode step makes ~9 of these calls a layer, and
// the same checks as Python attribute reads before each call cost 2.3-4.9 us a call, against
// 0.25-0.7 us for the Python left (eager_pointwise.may_take): 1-3 ms of the 0.6B bf16 eager step
// on the Intel AMX kind (BENCHMARKS.md, "seventy-seventh pass").

// ATen's vector types at the width this file is compiled for (cpu_vec.h, in
// executor/custom_ops/csrc/). Their exps are the ones PyTorch's own CPU kernels call (SLEEF from
// libtorch_cpu, or the fast one).
#include "cpu_vec.h"  // first: ATen's vector width

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <cstdint>
#include <numeric>
#include <tuple>
#include <type_traits>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kGrainElems = 16384;  // elements per parallel chunk, at least (a thread wakes for no less)

// Values of a row in blocks of two float vectors: load, store (a partial block at a row's end)
// and round to the tensor's dtype, to nearest even as PyTorch rounds (nothing to do for fp32).
template <typename T>
struct Io;

template <>
struct Io<float> {
  static constexpr int64_t kBlock = 2 * Vec::size();
  static void load(const float* p, int64_t n, Vec& a, Vec& b) {
    if (n == kBlock) {
      a = Vec::loadu(p);
      b = Vec::loadu(p + Vec::size());
    } else {
      a = Vec::loadu(p, std::min<int64_t>(n, Vec::size()));
      b = n > Vec::size() ? Vec::loadu(p + Vec::size(), n - Vec::size()) : Vec(0.0f);
    }
  }
  static void store(float* p, int64_t n, const Vec& a, const Vec& b) {
    if (n == kBlock) {
      a.store(p);
      b.store(p + Vec::size());
    } else {
      a.store(p, std::min<int64_t>(n, Vec::size()));
      if (n > Vec::size()) b.store(p + Vec::size(), n - Vec::size());
    }
  }
  static void round(Vec&, Vec&) {}
};

template <>
struct Io<at::BFloat16> {
  using B = at::vec::Vectorized<at::BFloat16>;
  static constexpr int64_t kBlock = B::size();
  static_assert(B::size() == 2 * Vec::size(), "a bf16 vector holds two float vectors");
  static void load(const at::BFloat16* p, int64_t n, Vec& a, Vec& b) {
    std::tie(a, b) = at::vec::convert_to_float<at::BFloat16>(n == kBlock ? B::loadu(p) : B::loadu(p, n));
  }
  static void store(at::BFloat16* p, int64_t n, const Vec& a, const Vec& b) {
    const B v = at::vec::convert_from_float<at::BFloat16>(a, b);
    n == kBlock ? v.store(p) : v.store(p, n);
  }
  static void round(Vec& a, Vec& b) {
    a = round(a);
    b = round(b);
  }
  // Within fp32, as the conversion rounds: add 0x7FFF plus the lowest bit that stays, clear the
  // 16 bits that go; a NaN stays NaN.
  static Vec round(const Vec& v) {
    using I = at::vec::Vectorized<int32_t>;
    const I bits = at::vec::cast<int32_t>(v);
    const I rounded = (bits + I(0x7FFF) + ((bits >> I(16)) & I(1))) & I(static_cast<int32_t>(0xFFFF0000u));
    return Vec::blendv(v, at::vec::cast<float>(rounded), v == v);
  }
};

// The rows of `x` (..., D) as pointers: leading dims in any layout, each row contiguous.
template <typename T>
std::vector<T*> row_pointers(const at::Tensor& x) {
  const int64_t dims = x.dim() - 1;
  const std::vector<int64_t> size(x.sizes().begin(), x.sizes().end() - 1), stride(x.strides().begin(), x.strides().end() - 1);
  std::vector<T*> out(x.numel() / x.size(-1));
  std::vector<int64_t> index(dims, 0);
  T* row = static_cast<T*>(x.data_ptr());
  for (T*& p : out) {  // the next row: the last leading dim steps, a finished dim rewinds and carries
    p = row;
    for (int64_t d = dims - 1; d >= 0; --d) {
      row += stride[d];
      if (++index[d] < size[d]) break;
      row -= stride[d] * size[d];
      index[d] = 0;
    }
  }
  return out;
}

int64_t grain_rows(int64_t width) { return std::max<int64_t>(1, kGrainElems / std::max<int64_t>(width, 1)); }

// Two float vectors: one block of a row.
struct Pair {
  Vec a, b;
  Pair operator+(const Pair& o) const { return {a + o.a, b + o.b}; }
  Pair operator*(const Pair& o) const { return {a * o.a, b * o.b}; }
  Pair operator-() const { return {a.neg(), b.neg()}; }
};

template <typename T>
Pair load(const T* p, int64_t n) {
  Pair v;
  Io<T>::load(p, n, v.a, v.b);
  return v;
}

template <typename T>
void store(T* p, int64_t n, const Pair& v) {
  Io<T>::store(p, n, v.a, v.b);
}

template <typename T>
Pair round(Pair v) {  // the value a tensor of dtype T would hold
  Io<T>::round(v.a, v.b);
  return v;
}

template <typename Fn>
void by_dtype(const at::Tensor& x, Fn&& fn) {
  if (x.scalar_type() == at::kBFloat16)
    fn(at::BFloat16{});
  else
    fn(float{});
}

// y = w * round(x rsqrt(mean(x^2) + eps)); with `residual`, x is first round(x + residual),
// which is also written to `sum_out`. The row is kept as fp32 between its two passes.
template <typename T>
void norm_rows(const at::Tensor& x, const at::Tensor* residual, const at::Tensor& weight, double eps, at::Tensor& y,
               at::Tensor* sum_out) {
  constexpr int64_t kB = Io<T>::kBlock;
  const int64_t D = x.size(-1);
  const auto xs = row_pointers<T>(x);
  const auto rs = residual ? row_pointers<T>(*residual) : std::vector<T*>();
  const T* w = static_cast<const T*>(weight.data_ptr());
  T* out = static_cast<T*>(y.data_ptr());
  T* sums = sum_out ? static_cast<T*>(sum_out->data_ptr()) : nullptr;
  at::parallel_for(0, static_cast<int64_t>(xs.size()), grain_rows(D), [&](int64_t begin, int64_t end) {
    std::vector<Pair> row((D + kB - 1) / kB);
    for (int64_t r = begin; r < end; ++r) {
      Pair acc{Vec(0.0f), Vec(0.0f)};
      for (int64_t i = 0, j = 0; i < D; i += kB, ++j) {
        const int64_t n = std::min(kB, D - i);
        Pair v = load(xs[r] + i, n);
        if (residual) {
          v = round<T>(v + load(rs[r] + i, n));
          store(sums + r * D + i, n, v);
        }
        row[j] = v;
        acc.a = at::vec::fmadd(v.a, v.a, acc.a);
        acc.b = at::vec::fmadd(v.b, v.b, acc.b);
      }
      const float ss = at::vec::vec_reduce_all<float>([](Vec p, Vec q) { return p + q; }, acc.a + acc.b);
      const Vec inv(1.0f / std::sqrt(ss / static_cast<float>(D) + static_cast<float>(eps)));
      for (int64_t i = 0, j = 0; i < D; i += kB, ++j) {
        const int64_t n = std::min(kB, D - i);
        store(out + r * D + i, n, load(w + i, n) * round<T>(row[j] * Pair{inv, inv}));
      }
    }
  });
}

// The kernels take `x`: bf16 or fp32, not empty, its rows contiguous.
bool rows_taken(const at::Tensor& x) {
  const auto dtype = x.scalar_type();
  return (dtype == at::kFloat || dtype == at::kBFloat16) && x.dim() >= 1 && x.stride(-1) == 1 && x.numel() > 0;
}

// `t` has x's dtype, rows contiguous, and `shape` (its own or the one it broadcasts to).
bool like(const at::Tensor& t, const at::Tensor& x, at::IntArrayRef shape) {
  return t.scalar_type() == x.scalar_type() && t.sizes() == shape && t.stride(-1) == 1;
}

bool norm_taken(const at::Tensor& x, const at::Tensor& weight) {
  return rows_taken(x) && weight.dim() == 1 && weight.size(0) == x.size(-1) && weight.is_contiguous() &&
         weight.scalar_type() == x.scalar_type();
}

c10::optional<at::Tensor> rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  if (!norm_taken(x, weight)) return c10::nullopt;
  at::Tensor y = at::empty(x.sizes(), x.options());
  by_dtype(x, [&](auto zero) { norm_rows<decltype(zero)>(x, nullptr, weight, eps, y, nullptr); });
  return y;
}

// (y, x + residual), or nothing where not taken (a list, as the schema cannot make a tuple optional).
std::vector<at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight,
                                     double eps) {
  if (!norm_taken(x, weight) || !like(residual, x, x.sizes())) return {};
  at::Tensor y = at::empty(x.sizes(), x.options());
  at::Tensor sum = at::empty(x.sizes(), x.options());
  by_dtype(x, [&](auto zero) { norm_rows<decltype(zero)>(x, &residual, weight, eps, y, &sum); });
  return {y, sum};
}

// The exp PyTorch's silu kernel uses for dtype T (measured equal on 393K values): the fast one
// (ULP 20) for bf16, whose result is rounded to 8 bits anyway, SLEEF's (ULP 1) for fp32.
template <typename T>
Vec exp_of(const Vec& x) {
  if constexpr (std::is_same_v<T, float>)
    return x.exp();
  else
    return x.exp_u20();
}

// out = round(round(silu(a)) * b) for x = [a | b] along the last dim; silu(a) = a / (1 + exp(-a)).
template <typename T>
void swiglu_rows(const at::Tensor& x, at::Tensor& y) {
  constexpr int64_t kB = Io<T>::kBlock;
  const int64_t half = y.size(-1);
  const auto xs = row_pointers<T>(x);
  T* out = static_cast<T*>(y.data_ptr());
  const Vec one(1.0f);
  at::parallel_for(0, static_cast<int64_t>(xs.size()), grain_rows(half), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      for (int64_t i = 0; i < half; i += kB) {
        const int64_t n = std::min(kB, half - i);
        const Pair g = load(xs[r] + i, n);
        const Pair silu{g.a / (one + exp_of<T>(g.a.neg())), g.b / (one + exp_of<T>(g.b.neg()))};
        store(out + r * half + i, n, round<T>(silu) * load(xs[r] + half + i, n));
      }
    }
  });
}

c10::optional<at::Tensor> swiglu(const at::Tensor& x) {
  if (!rows_taken(x) || x.size(-1) % 2 != 0) return c10::nullopt;
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() /= 2;
  at::Tensor y = at::empty(shape, x.options());
  by_dtype(x, [&](auto zero) { swiglu_rows<decltype(zero)>(x, y); });
  return y;
}

// out = round(round(x cos) + round(rotate_half(x) sin)), rotate_half(x) = [-x2 | x1].
template <typename T>
void rotary_rows(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& y) {
  constexpr int64_t kB = Io<T>::kBlock;
  const int64_t D = x.size(-1), half = D / 2;
  const auto xs = row_pointers<T>(x);
  const auto cs = row_pointers<T>(cos);
  const auto ss = row_pointers<T>(sin);
  const auto ys = row_pointers<T>(y);
  at::parallel_for(0, static_cast<int64_t>(xs.size()), grain_rows(D), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T *xr = xs[r], *c = cs[r], *s = ss[r];
      T* yr = ys[r];
      for (int64_t i = 0; i < half; i += kB) {
        const int64_t n = std::min(kB, half - i), h = i + half;
        const Pair lo = load(xr + i, n), hi = load(xr + h, n);
        store(yr + i, n, round<T>(round<T>(lo * load(c + i, n)) + round<T>(-hi * load(s + i, n))));
        store(yr + h, n, round<T>(round<T>(hi * load(c + h, n)) + round<T>(lo * load(s + h, n))));
      }
    }
  });
}

// `t` broadcasts to `shape` (numpy's rule: from the last dim, each size equal or 1).
bool broadcasts(const at::Tensor& t, at::IntArrayRef shape) {
  const int64_t n = static_cast<int64_t>(shape.size());
  if (t.dim() > n) return false;
  for (int64_t i = 1; i <= t.dim(); ++i)
    if (t.size(-i) != 1 && t.size(-i) != shape[n - i]) return false;
  return true;
}

// cos and sin broadcast to x's shape (the model's are (B, 1, S, D) for every head).
c10::optional<at::Tensor> rotary_mul(const at::Tensor& x, const at::Tensor& cos_in, const at::Tensor& sin_in) {
  if (!rows_taken(x) || x.size(-1) % 2 != 0 || !broadcasts(cos_in, x.sizes()) || !broadcasts(sin_in, x.sizes()))
    return c10::nullopt;
  const at::Tensor cos = cos_in.expand(x.sizes()), sin = sin_in.expand(x.sizes());
  if (!like(cos, x, x.sizes()) || !like(sin, x, x.sizes())) return c10::nullopt;  // e.g. a broadcast last dim
  // y keeps x's layout (as the reference's elementwise result does) and the rows are walked in
  // memory order: the model passes q and k as (B, H, S, D) views of (B, S, H, D) memory, whose
  // consecutive logical rows are H x D apart (4 KB for 16 bf16 heads of 128, a new page per
  // 256-byte row). Walked in logical order with a contiguous y, a 2048-token bf16 call took 2.7 ms
  // in the prefill of the AMX host (15.3 alone, against 1.36 on a contiguous copy); this way 1.3
  // (BENCHMARKS.md, "twenty-fifth pass").
  at::Tensor y = at::empty_like(x, at::MemoryFormat::Preserve);
  std::vector<int64_t> order(x.dim() - 1);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return x.stride(a) > x.stride(b); });
  order.push_back(x.dim() - 1);
  const at::Tensor xm = x.permute(order), cm = cos.permute(order), sm = sin.permute(order);
  at::Tensor ym = y.permute(order);
  by_dtype(x, [&](auto zero) { rotary_rows<decltype(zero)>(xm, cm, sm, ym); });
  return y;
}

// The reference's kv_update as row copies: cache (B, Hkv, T, D) gets src (B, Hkv, S, D) at slots
// positions (B, S), in place (true: written); any strides with contiguous rows (a prefill writes
// into a view of the full cache). The reference is an index_put_ with two aranges for its indices,
// ~6 op calls per K or V per layer; a slot outside the cache is an error, as index_put_'s.
bool kv_update(at::Tensor cache, const at::Tensor& src, const at::Tensor& positions) {
  if (cache.dim() != 4 || src.dim() != 4 || positions.dim() != 2 || positions.scalar_type() != at::kLong ||
      !rows_taken(cache) || !rows_taken(src) || src.scalar_type() != cache.scalar_type())
    return false;
  const int64_t B = src.size(0), H = src.size(1), S = src.size(2), D = src.size(3), T = cache.size(2);
  TORCH_CHECK(cache.size(0) == B && cache.size(1) == H && cache.size(3) == D && positions.size(0) == B &&
                  positions.size(1) == S,
              "kv_update: shapes do not match: cache ", cache.sizes(), ", new ", src.sizes(), ", positions ",
              positions.sizes());
  const at::Tensor pos = positions.contiguous();
  const int64_t* p = pos.data_ptr<int64_t>();
  for (int64_t i = 0; i < B * S; ++i) TORCH_CHECK(p[i] >= 0 && p[i] < T, "kv_update: slot ", p[i], " outside 0..", T - 1);
  const int64_t row = D * cache.element_size();
  char* dst = static_cast<char*>(cache.data_ptr());
  const char* from = static_cast<const char*>(src.data_ptr());
  const int64_t e = cache.element_size();
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t s = 0; s < S; ++s)
        std::memcpy(dst + (b * cache.stride(0) + h * cache.stride(1) + p[b * S + s] * cache.stride(2)) * e,
                    from + (b * src.stride(0) + h * src.stride(1) + s * src.stride(2)) * e, row);
  return true;
}

}  // namespace

TORCH_LIBRARY_IMPL(cann_cpu, CPU, m) {
  m.impl("rms_norm", rms_norm);
  m.impl("add_rms_norm", add_rms_norm);
  m.impl("swiglu", swiglu);
  m.impl("rotary_mul", rotary_mul);
  m.impl("kv_update", kv_update);
}
