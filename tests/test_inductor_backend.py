"""The graph passes graph mode runs before Inductor (executor.backends.graph_passes and
executor.backends.packed_linear): single-row GEMVs become generated reductions, batched ones
oneDNN (or kernel) calls on weights packed once, the decode attention's small products
reductions, and values several kernels read are stored once. A graph compiled for CUDA gets the
GEMV rewrite (every single-row linear) and the stored values only.

The tiny test models never reach the size where the GEMM rewrites apply, so this checks them
directly: which nodes they take, and that compiled code computes the same thing, with and
without a SuperKernel scope around it.
"""

import contextlib
import re

import pytest
import torch
from torch._inductor.utils import run_and_get_code

import tests.cpuinfo as cpuinfo
from executor.backends import eager_linear, packed_linear
from executor.backends.graph_passes import (
    INDUCTOR_DECOMPOSE_MAX_DIM,
    REDUCED_PRECISION_MAX_SLOTS,
    _attention_matmuls_to_reductions,
    _gemv_to_reduction,
    _store_shared_opaque_inputs,
    _store_shared_trig,
    before_inductor,
)
from executor.backends.inductor import DYNAMIC_THREADS_NUMEL, compile_inductor
from executor.custom_ops._build import cpu_has_avx512
from executor.ops import reference
from executor.scope import superkernel_scope

DTYPES = [torch.float32, torch.bfloat16]


def _trace(fn, *args) -> torch.fx.GraphModule:
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch.compile(fn, backend=capture, fullgraph=True, dynamic=False)(*args)
    return graphs[0]


def test_only_single_row_linears_above_inductors_own_limit_are_rewritten():
    big = torch.nn.Linear(64, INDUCTOR_DECOMPOSE_MAX_DIM + 64)
    small = torch.nn.Linear(64, 32, bias=False)
    gm = _trace(lambda x, y: (big(x), small(x), big(y)), torch.randn(1, 1, 64), torch.randn(2, 64))
    assert _gemv_to_reduction(gm) == 1  # big(x) only: small is Inductor's, y has two rows
    linears = [n for n in gm.graph.nodes if n.target is torch._C._nn.linear]
    assert len(linears) == 2
    # The row is stored before the reduction reads it, so Inductor cannot recompute whatever made
    # it (a norm) once per weight row inside the reduction.
    force = torch.ops.prims.inductor_force_stride_order.default
    assert [n.target for n in gm.graph.nodes].count(force) == 1


def _zen4() -> bool:
    """An AMD Zen 4 CPU by Linux's word (family 19h with AVX512-BF16), not the code under test's."""
    info = cpuinfo.first_processor()
    return (info.get("vendor_id"), info.get("cpu family")) == (
        "AuthenticAMD",
        "25",
    ) and "avx512_bf16" in cpuinfo.flags()


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("launch_unit", [False, True])
def test_a_gemv_inductor_decomposes_is_rewritten_only_where_it_does_not(launch_unit, dtype):
    # 2048 x 512: within Inductor's decomposition limits, above the size left to sgemv elsewhere
    mid = torch.nn.Linear(512, packed_linear.MIN_WEIGHT_NUMEL // 512, bias=False).to(dtype)
    assert max(mid.weight.shape) <= INDUCTOR_DECOMPOSE_MAX_DIM
    gm = _trace(lambda x: mid(x), torch.randn(1, 1, 512).to(dtype))
    # where the GEMV kernel takes large fp32 rows (an AVX2 host) it takes this one in a launch unit
    # too; a bf16 one it takes in a launch unit wherever it runs (its C++ wrapper calls it) but on
    # AMD Zen 4, where the reductions were faster there too;
    # where aten's single row is MKL's fast sgemv (fp32 on an Intel CPU with AMX) it stays aten's:
    # a linear outside launch units, an opaque blas_linear call in one (Inductor would decompose it)
    kernel = eager_linear.gemv_in_graphs(dtype, launch_unit)
    aten = eager_linear.aten_takes_single_rows(dtype)
    if dtype == torch.bfloat16 and launch_unit:
        assert kernel == (eager_linear.gemv_runs(dtype) and not _zen4())
    blas = aten and launch_unit and eager_linear.blas_linear_runs()  # the op is built with the GEMV kernel
    kept = (aten and not blas) or (not aten and launch_unit and not kernel)
    assert _gemv_to_reduction(gm, decomposes_small=launch_unit) == (0 if kept else 1)
    targets = [n.target for n in gm.graph.nodes]
    assert targets.count(torch.ops.cann_cpu.gemv.default) == int(kernel and not aten)
    assert targets.count(torch.ops.cann_cpu.blas_linear.default) == int(blas)
    assert targets.count(torch._C._nn.linear) == int(kept)


def test_a_launch_units_blas_linear_is_one_extern_call_with_atens_result():
    """fp32 on an Intel CPU with AMX: a single-row linear within Inductor's decomposition limits runs
    in a launch unit as MKL's sgemv through `cann_cpu::blas_linear`, not as Inductor's generated loops
    (the generated code calls the op), and gives aten's linear's result exactly; elsewhere it is
    Inductor's, to its tolerance."""
    torch.manual_seed(0)
    mid = torch.nn.Linear(512, packed_linear.MIN_WEIGHT_NUMEL // 512, bias=False)
    x = torch.randn(1, 1, 512)

    def step(x, _positions):
        with superkernel_scope(True, "mid", ""):
            return torch.relu(mid(x * 2.0))

    with torch.no_grad():
        compiled = compile_inductor(step, True, "cpu")
        got, codes = run_and_get_code(compiled, x, None)
        want = torch.relu(torch.nn.functional.linear(x * 2.0, mid.weight))
    blas = eager_linear.aten_takes_single_rows(torch.float32) and eager_linear.blas_linear_runs()
    assert any("blas_linear" in code for code in codes) == blas
    if blas:
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert compiled.compiler.stats.scopes["mid"].segments == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_on_cuda_every_single_row_linear_becomes_a_reduction(dtype):
    """On CUDA cuBLAS takes every linear Inductor leaves alone, so small single-row ones are
    rewritten too, and never into the CPU GEMV kernel (whatever the host CPU): batched rows stay
    cuBLAS's. The graph is traced on CPU; the rewrite looks only at shapes and the device name."""
    big = torch.nn.Linear(64, INDUCTOR_DECOMPOSE_MAX_DIM + 64).to(dtype)
    small = torch.nn.Linear(64, 32, bias=False).to(dtype)
    x, y = torch.randn(1, 1, 64).to(dtype), torch.randn(2, 64).to(dtype)
    graphs = []
    fn = lambda x, y: (big(x), small(x), big(y))  # noqa: E731
    torch.compile(fn, backend=lambda gm, inputs: graphs.append((gm, inputs)) or gm.forward, fullgraph=True)(x, y)
    gm, inputs = graphs[0]
    before_inductor(gm, "cuda")  # what a graph compiled for CUDA gets
    targets = [n.target for n in gm.graph.nodes]
    assert targets.count(torch._C._nn.linear) == 1  # big(y): two rows; big(x) and small(x) are reductions
    assert torch.ops.cann_cpu.gemv.default not in targets
    assert targets.count(torch.ops.prims.inductor_force_stride_order.default) == 2  # each row stored first
    for g, w in zip(gm(*inputs), fn(x, y)):
        torch.testing.assert_close(g.float(), w.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("superkernel", [False, True])
def test_large_gemv_compiles_to_the_same_result(superkernel):
    torch.manual_seed(0)
    lin = torch.nn.Linear(256, 3 * INDUCTOR_DECOMPOSE_MAX_DIM)
    norm = torch.nn.RMSNorm(256, eps=1e-6)

    def step(x, _positions):
        with superkernel_scope(superkernel, "big", ""):
            return torch.relu(lin(norm(x + 1.0))).sum(-1)

    x = torch.randn(1, 1, 256)
    with torch.no_grad():
        compiled = compile_inductor(step, superkernel, "cpu")
        got = compiled(x, None)
        want = step(x, None)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-3)
    if superkernel:
        scope = compiled.compiler.stats.scopes["big"]
        assert scope.segments == 1 and scope.launches == 1


@pytest.mark.parametrize("superkernel", [False, True])
@pytest.mark.parametrize("large", [False, True])
def test_a_large_models_step_runs_at_a_new_thread_count_as_it_is(superkernel, large):
    """A step holding a weight of DYNAMIC_THREADS_NUMEL elements (a large model's) has kernels that
    read the thread count, and Dynamo does not guard it on the count: at a new count the same
    compiled step runs (the thread governor's tries cost nothing). A small model's step is traced
    again. The rest of Dynamo's global state is still checked, by the step itself."""
    torch.manual_seed(0)
    wide = torch.nn.Linear(256, DYNAMIC_THREADS_NUMEL // 256 if large else 256)
    narrow = torch.nn.Linear(256, 256)

    def step(x, _positions):
        with superkernel_scope(superkernel, "wide", ""):
            h = torch.relu(wide(x))
        return narrow(h[..., :256] + 1.0)  # a segment of its own with SuperKernel, small weights only

    x = torch.randn(1, 1, 256)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        with torch.no_grad():
            compiled = compile_inductor(step, superkernel, "cpu")
            want = compiled(x, None)
            assert compiled.compiler.stats.dynamic_threads == large and compiled.compiles != large
            torch.set_num_threads(1)
            got = compiled(x, None)
        assert compiled.graphs == 1 + (not large)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got, step(x, None), rtol=1e-4, atol=1e-4)
        if large:
            with pytest.raises(RuntimeError, match=r"another torch global state .*\(grad_mode changed\)"):
                compiled(x, None)  # grad mode on: Dynamo would have traced it again
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("superkernel", [False, True])
def test_a_large_gemv_calls_the_kernel_where_it_streams_faster(superkernel, dtype):
    """On a CPU without AVX512-BF16 or AMX (an AVX2 host) a large single-row bf16 linear becomes a
    `cann_cpu::gemv` call, not a reduction: Inductor's widened bf16 reduction ran below the read
    bandwidth there; so does an fp32 one on a CPU without AVX-512 (the kernel's step was faster).
    An fp32 one stays aten's linear (MKL's sgemv) where that is the fast one (an Intel CPU with
    AMX). Elsewhere it stays a reduction over the input row stored first (a bf16 row stored, widened
    to fp32 and stored again, not converted per weight row; the result rounded back to bf16). Each
    compiles to the same result, and the kernel call joins a SuperKernel scope's launch unit."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(256, 3 * INDUCTOR_DECOMPOSE_MAX_DIM).to(dtype)
    x = torch.randn(1, 1, 256).to(dtype)
    gm = _trace(lambda x: lin(x), x)
    aten = eager_linear.aten_takes_single_rows(dtype)
    assert aten == (dtype == torch.float32 and torch.cpu._is_amx_tile_supported())
    assert _gemv_to_reduction(gm) == int(not aten)
    kernel = eager_linear.gemv_in_graphs(dtype) and not aten
    if dtype == torch.float32:  # the kernel's AVX2 loop where there is no AVX-512
        assert kernel == (eager_linear.gemv_runs(dtype) and not cpu_has_avx512(dtype))
    widen = dtype == torch.bfloat16
    targets = [n.target for n in gm.graph.nodes]
    assert targets.count(torch.ops.cann_cpu.gemv.default) == int(kernel)
    assert targets.count(torch._C._nn.linear) == int(aten)
    assert targets.count(torch.ops.prims.inductor_force_stride_order.default) == (1 + widen) * int(not (kernel or aten))
    converts = [n.args[1] for n in gm.graph.nodes if n.target is torch.ops.prims.convert_element_type.default]
    assert converts == ([] if kernel or not widen else [torch.float32, torch.bfloat16])

    def step(x, _positions):
        with superkernel_scope(superkernel, "big", ""):
            return torch.relu(lin(x * 2.0))

    with torch.no_grad():
        compiled = compile_inductor(step, superkernel, "cpu")
        got, want = (
            compiled(x, None).float(),
            torch.relu(torch.nn.functional.linear(x.float() * 2.0, lin.weight.float(), lin.bias.float())),
        )
    tol = 2e-2 if widen else 1e-4
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    if superkernel:
        assert compiled.compiler.stats.scopes["big"].segments == 1


def test_batched_linears_above_the_size_limit_become_packed_calls():
    big = torch.nn.Linear(512, packed_linear.MIN_WEIGHT_NUMEL // 512)
    small = torch.nn.Linear(512, 32)
    gm = _trace(lambda x, y: (big(x), small(x), big(y)), torch.randn(4, 1, 512), torch.randn(1, 1, 512))
    assert packed_linear.pack_batched_linears(gm) == 1  # big(x) only: small is below the limit, y is one row
    targets = [n.target for n in gm.graph.nodes]
    assert targets.count(packed_linear.graph_op(torch.float32)) == 1  # packed_call where the kernel library is built
    assert targets.count(torch._C._nn.linear) == 2


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("superkernel", [False, True])
def test_batched_linears_compile_to_the_same_result_packing_each_weight_once(superkernel, dtype):
    if not packed_linear.supported(dtype) and not packed_linear.kernel_runs(dtype):
        pytest.skip(f"neither oneDNN (natively) nor the kernel runs {dtype} on this CPU")
    torch.manual_seed(0)
    up = torch.nn.Linear(256, packed_linear.MIN_WEIGHT_NUMEL // 256).to(dtype)  # with a bias
    down = torch.nn.Linear(up.out_features, 256, bias=False).to(dtype)

    def step(x, _positions):
        with superkernel_scope(superkernel, "ffn", ""):
            return down(torch.relu(up(x * 2.0)))

    x = torch.randn(3, 1, 256, dtype=dtype)
    tol = {"rtol": 1e-4, "atol": 1e-4} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    with torch.no_grad():
        compiled = compile_inductor(step, superkernel, "cpu")
        torch.testing.assert_close(compiled(x, None), step(x, None), **tol)
        first = {w: packed_linear._packed.kept(w) for w in (up.weight, down.weight)}
        if packed_linear.kernel_fits(up.weight, 3):  # the kernel's layout (not on a CPU with AMX: oneDNN's)
            assert all(p.shape == packed_linear.pack_rows(w).shape for w, p in first.items())
        via_table = packed_linear.graph_op(dtype) is torch.ops.cann_cpu.packed_call.default
        served = torch.ops.cann_cpu.packed_call_stats()[0] if via_table else 0
        compiled(x, None)
        assert all(packed_linear._packed.kept(w) is p for w, p in first.items())  # packed once, reused
        if via_table:  # both calls served without Python
            assert torch.ops.cann_cpu.packed_call_stats()[0] == served + 2
        up.weight.mul_(-1.0)  # changed in place: packed again, never stale
        torch.testing.assert_close(compiled(x, None), step(x, None), **tol)
        assert packed_linear._packed.kept(up.weight) is not first[up.weight]
    if superkernel:
        assert compiled.compiler.stats.scopes["ffn"].segments == 1  # the op joined the scope's launch unit


@torch.library.custom_op("recipes_test::masked_row_sum", mutates_args=())
def masked_row_sum(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Stands for an extern kernel such as cann::decode_attention: Inductor calls it, never inlines it."""
    return x.masked_fill(mask, 0.0).sum(-1)


@masked_row_sum.register_fake
def _(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[:-1])


def test_a_value_several_custom_ops_read_is_stored_once():
    def step(x, p):
        mask = torch.arange(x.shape[-1]) > p  # one mask for every layer, like the decode step's
        return masked_row_sum(x, mask) + masked_row_sum(x * 2.0, mask)

    args = (torch.randn(3, 4096), torch.tensor(1000))
    gm = _trace(step, *args)
    assert _store_shared_opaque_inputs(gm) == 1
    force = [n for n in gm.graph.nodes if n.target is torch.ops.prims.inductor_force_stride_order.default]
    assert len(force) == 1 and len(force[0].users) == 2  # both calls read the stored copy
    with torch.no_grad():
        compiled = compile_inductor(step, False, "cpu")
        torch.testing.assert_close(compiled(*args), step(*args))
    # (That Inductor alone recomputed it per call is checked on a whole model, where it did:
    # tests/test_decode_attention_models.py.)


def _rope_step(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Four 'layers' that all rotate by one RoPE cos/sin pair, computed once like the model's."""
    freqs = positions.float().unsqueeze(-1) / (10000.0 ** (torch.arange(0, 64, 2).float() / 64))
    emb = torch.cat((freqs, freqs), -1).unsqueeze(1)
    cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
    h = x
    for _ in range(4):
        h = (h * cos + h.flip(-1) * sin) @ torch.eye(64, dtype=x.dtype)
    return h


@pytest.mark.parametrize("store_once", [False, True], ids=["inductor_alone", "stored_once"])
def test_rope_cos_and_sin_are_computed_once_per_step_not_once_per_layer(monkeypatch, store_once):
    """Inductor counts cos and sin as cheap and recomputes them in every kernel that reads them
    (each layer's rotation); the backend stores the shared values once."""
    from torch._inductor.utils import run_and_get_code

    import executor.backends.graph_passes as passes

    args = (torch.randn(8, 2, 1, 64), torch.arange(8).view(8, 1) * 3)
    assert _store_shared_trig(_trace(_rope_step, *args)) == 2  # the cast of cos, the cast of sin
    if not store_once:
        monkeypatch.setattr(passes, "_store_shared_trig", lambda gm: 0)
    with torch.no_grad():
        compiled = compile_inductor(_rope_step, False, "cpu")
        out, code = run_and_get_code(lambda: compiled(*args))
        torch.testing.assert_close(out, _rope_step(*args))
    # Inductor names a kernel after its ops and reuses one kernel for identical layers: count calls.
    calls = [name for src in code for name in re.findall(r"^\s+(cpp_fused\w*)\(", src, re.MULTILINE)]
    cos_calls = sum("_cos" in name for name in calls)
    assert cos_calls == (1 if store_once else 4), calls


def _attention_args(rows: int, slots: int, dtype: torch.dtype, seed: int = 0) -> tuple:
    """q (2, 4, rows, 16) against a (2, 2, slots, 16) KV cache whose last 3 slots are masked out."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 4, rows, 16, generator=g).to(dtype)
    k, v = (torch.randn(2, 2, slots, 16, generator=g).to(dtype) for _ in range(2))
    mask = torch.zeros(2, 1, rows, slots, dtype=torch.bool)
    mask[..., slots - 3 :] = True
    return q, k, v, mask


@pytest.mark.parametrize(
    "rows,slots,dtype,rewritten",
    [
        (1, 40, torch.float32, 2),  # decode: q @ k^T and probs @ v
        (1, 40, torch.bfloat16, 2),
        (1, REDUCED_PRECISION_MAX_SLOTS + 1, torch.float32, 2),
        (1, REDUCED_PRECISION_MAX_SLOTS + 1, torch.bfloat16, 0),  # oneDNN's bmm was faster there
        (9, 40, torch.float32, 0),  # prefill goes to SDPA: no matmul to rewrite
    ],
)
def test_decode_attention_products_become_reductions(rows, slots, dtype, rewritten):
    """The decode attention's two batched products become generated reductions (each was an
    extern bmm call over B x Hkv tiny products), except in bf16 over many cache slots; the rows
    each product reads are stored first, so the roped query is not recomputed per slot."""
    args = _attention_args(rows, slots, dtype)
    gm = _trace(lambda q, k, v, m: reference.attention(q, k, v, m, 0.25), *args)
    assert _attention_matmuls_to_reductions(gm) == rewritten
    assert sum(n.target is torch.matmul for n in gm.graph.nodes) == (2 - rewritten if rows == 1 else 0)
    force = torch.ops.prims.inductor_force_stride_order.default
    assert sum(n.target is force for n in gm.graph.nodes) == rewritten


@pytest.mark.parametrize("superkernel", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_attention_compiles_to_the_same_result_without_bmm(superkernel, dtype):
    from torch._inductor.utils import run_and_get_code

    q, k, v, mask = _attention_args(1, 40, dtype, seed=1)

    def step(q, _positions):
        with superkernel_scope(superkernel, "attn", ""):
            return reference.attention(q * 1.5, k, v, mask, 0.25)  # q made in the graph, like RoPE's

    want = reference.attention(q.double() * 1.5, k.double(), v.double(), mask, 0.25)
    with torch.no_grad():
        compiled = compile_inductor(step, superkernel, "cpu")
        got, code = run_and_get_code(lambda: compiled(q, None))
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    torch.testing.assert_close(got.double(), want, **tol)
    assert not any("bmm" in src for src in code)


def _layers_step(x, w):
    """Four small "layers" of norm, product and activation: every intermediate a buffer of its own."""
    h = x
    for _ in range(4):
        h = torch.nn.functional.silu(reference.rms_norm(h, torch.ones(64), 1e-6) @ w) + h
    return h


@pytest.mark.parametrize(
    "superkernel,max_nodes,max_stack,expect",
    [
        (False, None, None, "allocated"),
        (True, None, None, "stack"),
        (True, None, 10, "pool"),
        (True, 10, None, "allocated"),
    ],
    ids=["ge_graph", "superkernel", "superkernel_past_the_stack_limit", "superkernel_large_unit"],
)
def test_a_small_launch_units_intermediates_sit_on_the_stack_or_in_one_pool(
    monkeypatch, superkernel, max_nodes, max_stack, expect
):
    """A SuperKernel launch unit's fused kernels write every intermediate of the scope, all alive at
    once, so none can be reused; allocated one by one, they were ~15% of the SK decoder step at
    bench-overhead. A small unit keeps them in arrays on its C++ wrapper's stack where they fit
    (Inductor's limit: MAX_STACK_ALLOCATION_SIZE elements in all), else in one pooled allocation.
    A Python-wrapper graph keeps Inductor's own allocations (pooled, its views cost more than they
    saved), and so does a unit over POOL_MAX_NODES (the planner recursed past Python's limit on the
    0.6B shape's). The wrapper class is Inductor's own again after the unit's compile."""
    from torch._inductor.codegen import common
    from torch._inductor.codegen import cpp_wrapper_cpu_array_ref as array_ref
    from torch._inductor.utils import run_and_get_code

    import executor.backends.inductor as inductor

    if max_nodes is not None:
        monkeypatch.setattr(inductor, "POOL_MAX_NODES", max_nodes)
    if max_stack is not None:
        monkeypatch.setattr(array_ref, "MAX_STACK_ALLOCATION_SIZE", max_stack)
    # compiled afresh: the caches' keys hold Inductor's options, not the stack limit patched above
    monkeypatch.setattr(torch._inductor.config, "fx_graph_cache", False)
    monkeypatch.setattr(torch._functorch.config, "enable_autograd_cache", False)
    args = (torch.randn(1, 1, 64), torch.randn(64, 64) * 0.1)

    def step(x, w):
        with superkernel_scope(superkernel, "layers", ""):
            return _layers_step(x, w)

    common.init_backend_registration()
    wrapper = common.device_codegens["cpu"].cpp_wrapper_codegen
    with torch.no_grad():
        compiled = compile_inductor(step, superkernel, "cpu")
        out, code = run_and_get_code(lambda: compiled(*args))
    torch.testing.assert_close(out, _layers_step(*args))
    assert common.device_codegens["cpu"].cpp_wrapper_codegen is wrapper
    stacked = sum(len(re.findall(r"\bfloat buf\d+_storage\[", src)) for src in code)
    views = sum(src.count("_alloc_from_pool(") for src in code)
    empties = sum(src.count("aoti_torch_empty_strided(") for src in code)
    found = {"stack": stacked >= 8 and views == 0, "pool": views >= 8 and stacked == 0}
    if expect == "allocated":
        assert stacked == views == 0 and (empties >= 8 or not superkernel), (stacked, views, empties)
    else:
        assert found[expect] and empties <= 3, (stacked, views, empties)  # the pool itself and the unit's output


_LOOP = r"for\(int64_t x0=static_cast<int64_t>\(0L\); x0<static_cast<int64_t>\((\d+)L\)"


@pytest.mark.parametrize("superkernel", [False, True])
@pytest.mark.parametrize("rule", ["ours", "inductor_alone"])
def test_a_large_models_small_loops_run_serially_and_its_large_ones_read_the_thread_count(
    monkeypatch, superkernel, rule
):
    """Kernels that read the thread count (a large model's step) keep Inductor's small-loop rule:
    a loop of 1024 values runs on the calling thread, no parallel region to fork and join for it,
    while a loop of 1M values is shared out. Left to Inductor, reading the count opens a region
    for every loop (the control, so that a later Inductor without that habit shows up here)."""
    from torch._inductor.utils import run_and_get_code

    import executor.backends.inductor as inductor

    if rule == "inductor_alone":

        def alone(on: bool = True):
            from torch._inductor import config

            return config.patch({"cpp.dynamic_threads": True}) if on else contextlib.nullcontext()

        monkeypatch.setattr(inductor, "thread_count_kernels", alone)
    torch.manual_seed(0)
    table = torch.nn.Embedding(DYNAMIC_THREADS_NUMEL // 1024, 1024)

    def step(x, _positions):
        with superkernel_scope(superkernel, "all", ""):
            small = torch.nn.functional.silu(x) * x  # 1024 values
            large = table.weight * 3.0 + 1.0  # 1M values
        return small, large

    x = torch.randn(1, 1, 1024)
    with torch.no_grad():
        compiled = compile_inductor(step, superkernel, "cpu")
        (small, large), code = run_and_get_code(lambda: compiled(x, None))
    assert compiled.compiler.stats.dynamic_threads
    torch.testing.assert_close(small, torch.nn.functional.silu(x) * x)
    torch.testing.assert_close(large, table.weight * 3.0 + 1.0)
    src = "\n".join(code)
    loops = {int(n) for n in re.findall(_LOOP, src)}
    shared = {int(n) for n in re.findall(r"#pragma omp for\s+" + _LOOP, src)}
    assert 1024 in loops and DYNAMIC_THREADS_NUMEL in shared, (loops, shared)
    assert (1024 in shared) == (rule == "inductor_alone"), shared
    assert "num_threads(" not in src  # the count is read when the kernels run
