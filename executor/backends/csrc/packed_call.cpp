// CPU kernel of cann_cpu::packed_call: a batched decode GEMM on its weight's packed copy, found
// without Python (schema and use: executor/backends/packed_linear.py). Built into the rows_linear
// library.
//
// Why: cann_cpu::packed_linear, the op a compiled decode graph used to call for each batched
// projection, is a Python function: it picks the loop and finds the packed copy in a memo. A
// SuperKernel launch unit is one C++ function, yet it called back into Python 113 times a
// Qwen3-0.6B step for that. With the lookup in C++ the SK decoder step took 0.975x the time at
// batch 16 and 0.94x at batch 4 in bf16, 0.95x at batch 16 in fp32 (one process, alternating, 9-15
// rounds); batch 64 (then on oneDNN) and ge_graph, whose Python wrapper calls the op either way,
// read level (BENCHMARKS.md, "forty-second pass").
//
// How: packed_linear (Python) stays the one place that decides and packs, and owns the packed
// copies (executor.memo: dropped with the weight, remade after an in-place change). Each time it
// runs it tells this table what it chose for (weight, rows) (`packed_remember`). A call whose
// weight, version and row count match an entry goes straight to that loop; anything else (first
// call, a changed weight, another row count, a weight gone) goes to packed_linear, which
// remembers again. The table holds weak references only: it keeps no packed copy alive, and a
// dead weight's entry can never match a new tensor (a weak reference keeps the old TensorImpl's
// memory, so no new tensor gets its address).

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <atomic>
#include <mutex>
#include <unordered_map>

namespace {

using WeakImpl = c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>;

// What packed_linear chose for a weight (the `kind` it passes to packed_remember).
enum Kind : int64_t { kRows = 0, kAmx = 1, kOnednn = 2 };

struct Entry {
  WeakImpl weight;  // the key's tensor, weakly: while it is kept, no new tensor can get its address
  int64_t version;  // the weight's version counter when packed
  int64_t rows;     // rows of x the choice was made for
  Kind kind;
  WeakImpl packed;  // packed_linear's memo owns it
};

std::mutex mutex;
std::unordered_map<const c10::TensorImpl*, Entry> table;
std::atomic<int64_t> hits{0}, misses{0};

using LinearFn = at::Tensor(const at::Tensor&, const at::Tensor&, const c10::optional<at::Tensor>&);

const c10::OperatorHandle& op(const char* name) {
  // each name looked up once: a handle lives as long as its op's registration
  static std::mutex found_mutex;
  static std::unordered_map<std::string, c10::OperatorHandle> found;
  std::lock_guard<std::mutex> lock(found_mutex);
  auto it = found.find(name);
  if (it == found.end()) it = found.emplace(name, c10::Dispatcher::singleton().findSchemaOrThrow(name, "")).first;
  return it->second;
}

int64_t rows_of(const at::Tensor& x) { return x.size(-1) ? x.numel() / x.size(-1) : 0; }

// The packed copy and loop for this call, or an undefined tensor (then packed_linear runs it).
at::Tensor lookup(const at::Tensor& weight, int64_t rows, Kind& kind) {
  if (weight.is_inference()) return at::Tensor();  // no version counter: packed_linear packs per call
  std::lock_guard<std::mutex> lock(mutex);
  auto it = table.find(weight.unsafeGetTensorImpl());
  if (it == table.end()) return at::Tensor();
  const Entry& e = it->second;
  // (an entry's weight is this one: a dead weight's entry keeps its address from any new tensor)
  if (e.rows != rows || e.version != weight.unsafeGetTensorImpl()->version_counter().current_version())
    return at::Tensor();
  auto packed = e.packed.lock();
  if (!packed) return at::Tensor();
  kind = e.kind;
  return at::Tensor(std::move(packed));
}

at::Tensor packed_call(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  Kind kind = kRows;
  const at::Tensor packed = lookup(weight, rows_of(x), kind);
  if (!packed.defined()) {
    ++misses;
    static const auto python = op("cann_cpu::packed_linear").typed<LinearFn>();
    return python.call(x, weight, bias);
  }
  ++hits;
  // The loops take the bias as given (they convert a bf16 one to fp32 themselves, N values).
  if (kind == kRows) {
    static const auto rows = op("cann_cpu::rows_linear").typed<LinearFn>();
    return rows.call(x, packed, bias);
  }
  if (kind == kAmx) {
    static const auto amx = op("cann_cpu::amx_linear").typed<LinearFn>();
    return amx.call(x, packed, bias);
  }
  // oneDNN on its packed weight, as packed_linear calls it: _linear_pointwise(x, w, b, "none", [], "")
  torch::jit::Stack stack{x, packed, bias, c10::IValue("none"), c10::IValue(c10::List<c10::optional<at::Scalar>>()),
                          c10::IValue(std::string())};
  static const c10::OperatorHandle& onednn = op("mkldnn::_linear_pointwise");
  onednn.callBoxed(stack);
  return stack.back().toTensor();
}

// packed_linear's choice for (weight, rows): `packed` in loop `kind` while the weight keeps this version.
void packed_remember(const at::Tensor& weight, const at::Tensor& packed, int64_t rows, int64_t kind) {
  TORCH_CHECK(kind == kRows || kind == kAmx || kind == kOnednn, "packed_remember: unknown kind ", kind);
  TORCH_CHECK(!weight.is_inference(), "packed_remember: an inference tensor has no version counter");
  std::lock_guard<std::mutex> lock(mutex);
  if (table.count(weight.unsafeGetTensorImpl()) == 0) {  // a new weight: first drop the dead ones' entries
    for (auto it = table.begin(); it != table.end();) it = it->second.weight.expired() ? table.erase(it) : std::next(it);
  }
  table.insert_or_assign(weight.unsafeGetTensorImpl(),
                         Entry{WeakImpl(weight.getIntrusivePtr()),
                               static_cast<int64_t>(weight.unsafeGetTensorImpl()->version_counter().current_version()),
                               rows, static_cast<Kind>(kind), WeakImpl(packed.getIntrusivePtr())});
}

// (calls served from the table, calls sent to packed_linear, entries): for tests and benchmarks.
std::tuple<int64_t, int64_t, int64_t> packed_call_stats() {
  std::lock_guard<std::mutex> lock(mutex);
  return {hits.load(), misses.load(), static_cast<int64_t>(table.size())};
}

}  // namespace

TORCH_LIBRARY_IMPL(cann_cpu, CPU, m) { m.impl("packed_call", packed_call); }
// oneDNN's packed copy is an MkldnnCPU tensor: remembering it must not dispatch on the CPU key alone
TORCH_LIBRARY_IMPL(cann_cpu, CompositeExplicitAutograd, m) {
  m.impl("packed_remember", packed_remember);
  m.impl("packed_call_stats", packed_call_stats);
}
