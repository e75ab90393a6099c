"""Ascend backend: torch_npu fused ops, torchair GE graph mode, npugraph_ex, SuperKernel scopes.

Why one isolated module: `torch_npu` cannot even be imported without the CANN libraries and no
NPU exists in CI or on developer machines. So this is the ONLY code that touches torch_npu or
torchair, imported lazily (inside functions, via importlib) once executor.platform found an NPU
(npu_probe.py, beside it, answers platform detection's one question: is an NPU usable?).
It is a thin adapter calling exactly the documented APIs (shared/reference/ascend-apis.md),
mapping their return tuples onto executor.ops.reference's contracts and nothing more, so that
tests/test_npu_adapter.py can pin every argument with recording doubles.
"""

from __future__ import annotations

import importlib
import json
import shutil
from collections.abc import Callable
from contextlib import AbstractContextManager

import torch
from torch._dynamo.utils import counters

from executor import custom_ops, ops
from executor.backends.base import (
    Backend,
    CompiledStep,
    DecodeSpec,
    EagerBackend,
    Step,
    StepReport,
    UnsupportedError,
    cache_key,
    cache_root,
    keyed_cache_dir,
)
from executor.custom_ops import CustomOp
from executor.platform import cann_version
from executor.scope import ScopeFactory, ScopePlan, parse_options

INT32_MAX = 2**31 - 1  # FIA pre_tokens/next_tokens "no band limit"; causality comes from the mask


def fused_infer_attention(tnpu, q, k, v, mask, scale, **extra):
    """torch_npu's FusedInferAttentionScore with the op-table contract: q (B, Hq, S, D), k/v
    (B, Hkv, T, D), layout BNSD; mask (B, 1, S, T) bool, True = masked out, which is already the
    NPU polarity (sparse_mode 0 = use the mask as given). The op takes contiguous inputs only (a
    prefill query arrives transposed; a no-op in decode). `extra`: e.g. actual_seq_lengths_kv
    (cann::decode_attention). The second output (lse) is only defined with softmax_lse_flag=True:
    never read."""
    out, _lse = tnpu.npu_fused_infer_attention_score(
        q.contiguous(),
        k.contiguous(),
        v.contiguous(),
        atten_mask=mask,
        num_heads=q.shape[1],
        num_key_value_heads=k.shape[1],
        input_layout="BNSD",
        scale=scale,
        sparse_mode=0,
        pre_tokens=INT32_MAX,
        next_tokens=INT32_MAX,
        **extra,
    )
    return out


# npu_fused_infer_attention_score takes float16, bfloat16 or int8 queries only (no float32;
# tests/data/ascend_facts/fused_ops.yaml). int8 is a quantised path this op table does not use.
NPU_DTYPES = ("bfloat16", "float16")


def _torch_npu():
    return importlib.import_module("torch_npu")


def _torchair():
    _torch_npu()  # torchair ships inside torch_npu and is importable only once torch_npu is
    return importlib.import_module("torchair")


# --------------------------------------------------------------------------- fused ops
def check_dtype(dtype: str) -> None:
    """Refuse a dtype the NPU op table cannot run, before anything is built (no torch_npu import).

    Why not cast: a silent float32 -> bfloat16 cast around attention would change the numbers
    the user asked for; GE would only fail deep inside the compiled graph."""
    if dtype not in NPU_DTYPES:
        raise UnsupportedError(
            f"model_config.dtype: {dtype} cannot run on an Ascend NPU (npu_fused_infer_attention_score takes "
            f"float16 or bfloat16 queries only); set it to auto (bfloat16 on NPU), bfloat16 or float16"
        )


def register_ops() -> None:
    """Register the torch_npu op table "npu" (signatures = executor.ops); the run's execution
    context makes it active."""
    tnpu = _torch_npu()

    def rms_norm(x, weight, eps):
        return tnpu.npu_rms_norm(x, weight, epsilon=eps)[0]  # (y, rstd)

    def add_rms_norm(x, residual, weight, eps):
        y, _rstd, x_sum = tnpu.npu_add_rms_norm(x, residual, weight, epsilon=eps)
        return y, x_sum

    def swiglu(x):
        return tnpu.npu_swiglu(x, dim=-1)  # first half is the gate, as in the reference

    def rotary_mul(x, cos, sin):
        return tnpu.npu_rotary_mul(x, cos, sin, rotary_mode="half")

    def attention(q, k, v, mask, scale):
        return fused_infer_attention(tnpu, q, k, v, mask, scale)

    def moe_gating_top_k_softmax(logits, k):
        # The op returns its weights in the input's dtype; the contract (executor.ops.reference) is
        # float32 weights from a float32 softmax, as HF computes them. So float32 logits go in:
        # bf16 logits would give bf16-rounded weights, unlike the reference.
        y, expert_idx, _row_idx = tnpu.npu_moe_gating_top_k_softmax(logits.float(), finished=None, k=k)
        return y, expert_idx.to(torch.int64)  # op: int32 ids

    def moe_init_routing(x, expert_idx, num_experts):
        """The op names (token i, slot j) by row id j*N + i and returns expanded_row_idx[row id] =
        destination row; the reference's order[dst] is i*k + j: invert, then renumber. counts (E,)
        come from the sorted expert ids by comparison (a static shape, unlike bincount)."""
        n, k = expert_idx.shape
        row_idx = torch.arange(n * k, dtype=torch.int32, device=x.device).view(k, n).t().contiguous()
        expanded_x, expanded_row_idx, expanded_expert_idx = tnpu.npu_moe_init_routing(
            x, row_idx, expert_idx.to(torch.int32), active_num=n
        )
        dst = expanded_row_idx.to(torch.int64)
        src = torch.empty_like(dst).scatter_(0, dst, torch.arange(n * k, device=x.device))  # dst -> row id
        order = (src % n) * k + src // n
        experts = torch.arange(num_experts, device=x.device, dtype=expanded_expert_idx.dtype)
        counts = (expanded_expert_idx.view(-1, 1) == experts).sum(0)  # (E,) int64
        return expanded_x, order, counts

    def grouped_matmul(x, weights, counts):
        # group_type 0: groups split the rows (M) of x; group_list_type 1: counts, not cumsum;
        # split_item 3: one weight tensor (E, K, N) in, one output tensor out.
        return tnpu.npu_grouped_matmul(
            [x], [weights], group_list=counts, group_type=0, group_list_type=1, split_item=3
        )[0]

    def kv_update(cache, new, positions):
        # GE converts aten.scatter_ (ScatterElements over the whole cache, mapped back onto the
        # input by torchair); aten.index_put, the reference's in-place write, has no converter.
        # Upstream writes with torch_npu.scatter_update_ (in place): tests/data/ascend_facts/FINDINGS.md 4.
        b, h, s, d = new.shape
        return cache.scatter_(2, positions.view(b, 1, s, 1).expand(b, h, s, d), new)

    ops.register(
        "npu",
        {
            "kv_update": kv_update,
            "rms_norm": rms_norm,
            "add_rms_norm": add_rms_norm,
            "swiglu": swiglu,
            "rotary_mul": rotary_mul,
            "attention": attention,
            "grouped_matmul": grouped_matmul,
            "moe_gating_top_k_softmax": moe_gating_top_k_softmax,
            "moe_init_routing": moe_init_routing,
        },
        base="reference",  # linear: F.linear, which torchair converts to MatMul
    )


def custom_op_installer(mode: str) -> Callable[[CustomOp], None]:
    """How executor.custom_ops.layer installs a custom op for an NPU run in `mode`: import its NPU
    module (`CustomOp.npu`, a module of executor/backends/, the only place torch_npu/torchair may be
    imported) and let it register its PrivateUse1 kernel and torchair GE converter (once per
    process). A mode the module does not list in its MODES is refused, naming the op."""

    def install(op: CustomOp) -> None:
        why = custom_ops.unsupported(op, "npu", mode)  # the pre-flight asked the same (executor/preflight.py)
        if why:
            raise UnsupportedError(why)
        importlib.import_module(op.npu).register(_torch_npu(), _torchair())

    return install


# --------------------------------------------------------------------------- scopes
class _ScopeLog:
    """The scopes dynamo saw while tracing the decode step (proof that SK reached the graph).
    `note` is marked assume_constant_result: dynamo runs it in Python at trace time and bakes its
    None into the graph, so counting adds no guard, no recompile and no graph break."""

    def __init__(self):
        self.entries: dict[tuple[str, str], int] = {}

        def note(label: str, options: str) -> None:
            self.entries[(label, options)] = self.entries.get((label, options), 0) + 1

        self.note = torch.compiler.assume_constant_result(note)


class _NpuGraphScope:
    """npugraph_ex scope: begin/end ops paired by name (a plain class so dynamo traces it)."""

    def __init__(self, npu, label: str):
        self.npu, self.label = npu, label

    def __enter__(self):
        self.npu.super_kernel_scope_begin(self.label)
        return self

    def __exit__(self, *exc):
        self.npu.super_kernel_scope_end(self.label)
        return False


def scope_factory(mode: str, log: _ScopeLog | None = None) -> Callable[[str, str], AbstractContextManager]:
    """What `superkernel_scope(True, label, options)` opens on Ascend (installed by executor.scope.scope_impl)."""
    log = log if log is not None else _ScopeLog()
    if mode == "ge_graph":
        open_scope = _torchair().scope.super_kernel
    elif mode == "npugraph_ex":
        _torch_npu()  # installs torch.npu
        npu = torch.npu
        open_scope = lambda label, options: _NpuGraphScope(npu, label)  # noqa: E731 options: _npugraph_sk_options
    else:
        raise ValueError(f"scope_factory: mode {mode!r} is not an Ascend graph mode; allowed: ge_graph, npugraph_ex")

    def factory(label: str, options: str) -> AbstractContextManager:
        log.note(label, options)
        return open_scope(label, options)

    return factory


# --------------------------------------------------------------------------- compiling
def ge_compiler_config():
    """The torchair CompilerConfig exe_mode ge_graph compiles with. Public so that the GE check
    (tools/ge_check.py) converts with exactly these settings, adding only its graph dump."""
    cfg = importlib.import_module("torchair.configs.compiler_config").CompilerConfig()
    cfg.experimental_config.frozen_parameter = True  # parameter addresses fixed across steps
    cfg.experimental_config.tiling_schedule_optimize = True  # static shapes: tiling scheduled on device
    cfg.experimental_config.topology_sorting_strategy = "StableRDFS"
    return cfg


def _op_types(value: str) -> list[str]:
    return [part.strip() for part in value.split(",") if part.strip()]


# Our scope-option grammar (executor.scope.OPTIONS) -> npugraph_ex's super_kernel_optimize_options
# keys and value types (tests/data/ascend_facts/npugraph_ex.yaml; it checks types with isinstance).
# The other options (feed-sync-all, strict-scope-check, debug-aic/aiv-num) have no npugraph_ex
# equivalent.
NPUGRAPH_SK_OPTIONS: dict[str, tuple[str, Callable[[str], object]]] = {
    "stream-fusion": ("stream_fusion", int),
    "dcci-before-kernel-start": ("dcci_before_kernel_start", _op_types),
    "dcci-after-kernel-end": ("dcci_after_kernel_end", _op_types),
    "dcci-disable-on-kernel": ("dcci_disable_on_kernel", _op_types),
}


def npugraph_sk_options(plan: ScopePlan) -> dict:
    """The plan's scope options as npugraph_ex `super_kernel_optimize_options`.

    npugraph_ex takes these once per compile, not per scope, so all scopes must agree; an option
    it cannot express is an error rather than a dropped setting."""
    found: dict[str, dict] = {}
    for spec in plan.scopes:
        parsed = parse_options(spec.options)
        other = sorted(set(parsed) - set(NPUGRAPH_SK_OPTIONS))
        if other:
            raise UnsupportedError(
                f"superkernel options {', '.join(other)} (scope {spec.label}) have no npugraph_ex equivalent; "
                f"npugraph_ex takes {', '.join(NPUGRAPH_SK_OPTIONS)} (the others need exe_mode ge_graph)"
            )
        found[spec.label] = {
            key: convert(parsed[name]) for name, (key, convert) in NPUGRAPH_SK_OPTIONS.items() if name in parsed
        }
    distinct = {json.dumps(v, sort_keys=True) for v in found.values()}
    if len(distinct) > 1:
        raise UnsupportedError(
            "npugraph_ex applies one set of SuperKernel options to all scopes; the plan's scopes disagree "
            f"({'; '.join(f'{label}: {options}' for label, options in found.items())})"
        )
    return json.loads(distinct.pop()) if distinct else {}


def _versions() -> dict[str, str | None]:
    """Versions that change what torchair/GE produce (part of the compile cache key)."""
    return {"torch": torch.__version__, "torch_npu": getattr(_torch_npu(), "__version__", None), "cann": cann_version()}


class _NpuGraphBackend(Backend):
    """What both Ascend graph modes share: the fused-op table, a log of the scopes traced, the
    compile cache keyed on everything that changes the graph (base.cache_key)."""

    op_table = "npu"
    mode = base_name = ""

    def __init__(self, spec: DecodeSpec):
        check_dtype(spec.dtype)
        register_ops()  # the op table is part of the cache key
        mc = spec.model_config
        self.op_table = custom_ops.layer("npu", mc.custom_ops, custom_op_installer(self.mode))
        self.spec, self.mc, self.superkernel, self.log = spec, mc, mc.superkernel_enabled, _ScopeLog()
        self.name = f"{self.base_name}+superkernel" if self.superkernel else self.base_name
        self.options = self.compile_options()  # checked now, before any weight is loaded
        self.cache_key = cache_key(spec, self.name, self.op_table, _versions(), self.options)
        self.cache_dir = keyed_cache_dir(cache_root(mc), self.cache_key) if mc.enable_cache_compile else None

    def compile_options(self) -> dict:
        """What the backend hands its compiler besides the graph (plain data; part of the cache key)."""
        return {}

    def scope_factory(self) -> ScopeFactory | None:
        return scope_factory(self.mode, self.log) if self.superkernel else None


class NpuStep(CompiledStep):
    """The compiled step. Graphs are counted with dynamo's own counter, so the backends stay
    exactly the documented objects (and a cache hit, which traces nothing, shows 0)."""

    def __init__(self, fn: Callable, backend: _NpuGraphBackend):
        super().__init__(fn, backend.name, count_graphs=lambda: counters["stats"]["unique_graphs"])
        self.backend = backend

    def _call(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        b = self.backend
        if b.cache_dir is not None and input_ids.shape[0] != b.spec.batch_size:
            # a cached graph is reused without shape guards: another batch must not reach it
            raise UnsupportedError(
                f"the compile cache {b.cache_dir} holds the decode graph for batch {b.spec.batch_size}; "
                f"this call has batch {input_ids.shape[0]}"
            )
        try:
            return self.fn(input_ids, positions)
        except BaseException:
            if self.calls == 0 and b.cache_dir is not None:  # torchair saves its cache even when this call failed
                shutil.rmtree(b.cache_dir, ignore_errors=True)
            raise

    def report(self) -> StepReport:
        b = self.backend
        traced = self.graphs > 0
        entries = b.log.entries.items()
        return StepReport(
            self.name,
            self.compile_s,
            self.graphs,
            self.recompiles,
            cache_dir=str(b.cache_dir) if b.cache_dir else None,
            cache_enabled=b.mc.enable_cache_compile,
            cache_key=b.cache_key,
            scopes=[{"label": label, "options": options, "traced": n} for (label, options), n in entries],
            # None = not observable: the graph came from the compile cache, nothing was traced
            superkernel_ran=bool(b.log.entries) if traced or b.cache_dir is None else None,
        )


class _StepModule(torch.nn.Module):
    """Both compile caches (torchair's and npugraph_ex's cache_compile) take bound nn.Module
    methods only: on a hit they find the graph's parameters by name on that module. The runner's
    `_decode_step` belongs to ModelRunner (not a Module), so we bind it to a Module that registers
    the owner's modules (the model) under their attribute names, making the names resolvable."""

    def __init__(self, step: Callable):
        super().__init__()
        for name, value in getattr(getattr(step, "__self__", None), "__dict__", {}).items():
            if isinstance(value, torch.nn.Module):
                self.add_module(name, value)
        self._step = step

    def decode(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self._step(input_ids, positions)


def _module_method(step: Callable) -> Callable:
    return step if isinstance(getattr(step, "__self__", None), torch.nn.Module) else _StepModule(step).decode


class TorchairGEBackend(_NpuGraphBackend):
    """exe_mode ge_graph: whole decode step, static shapes; SK = torchair.scope.super_kernel.

    `compiler_config`: None = ge_compiler_config(); the GE check passes that same config with a
    graph dump added."""

    mode, base_name = "ge_graph", "torchair_ge"

    def __init__(self, spec: DecodeSpec, compiler_config=None):
        super().__init__(spec)
        self.compiler_config = compiler_config

    def compile(self, step: Step) -> NpuStep:
        torchair = _torchair()
        cfg = self.compiler_config if self.compiler_config is not None else ge_compiler_config()
        if self.cache_dir is not None:
            # No fullgraph argument: cache_compile always compiles fullgraph and ignores extra keywords.
            fn = torchair.inference.cache_compile(
                _module_method(step), config=cfg, cache_dir=str(self.cache_dir), dynamic=False, ge_cache=True
            )
        else:
            backend = torchair.get_npu_backend(compiler_config=cfg)
            fn = torch.compile(step, backend=backend, dynamic=False, fullgraph=True)
        return NpuStep(fn, self)


class NpuGraphExBackend(_NpuGraphBackend):
    """exe_mode npugraph_ex: aclgraph capture; SK is a post-capture pass over begin/end scopes.

    static_kernel_compile follows model_config.enable_static_kernel whether or not SuperKernel is
    on: the SK pass runs after capture either way (as upstream recipes set them)."""

    mode = base_name = "npugraph_ex"

    def compile_options(self) -> dict:
        options: dict = {"frozen_parameter": True, "static_kernel_compile": self.mc.enable_static_kernel}
        if self.superkernel:
            options["super_kernel_optimize"] = True
            options["super_kernel_optimize_options"] = npugraph_sk_options(self.spec.plan)
        return options

    def compile(self, step: Step) -> NpuStep:
        _torch_npu()  # registers the "npugraph_ex" dynamo backend and torch.npu.npugraph_ex
        if self.cache_dir is not None:
            fn = torch.npu.npugraph_ex.inference.cache_compile(
                _module_method(step), cache_dir=str(self.cache_dir), dynamic=False, options=self.options
            )
        else:
            fn = torch.compile(step, backend="npugraph_ex", fullgraph=True, dynamic=False, options=self.options)
        return NpuStep(fn, self)


def select_backend(spec: DecodeSpec) -> Backend:
    """The Ascend backend for the run's exe_mode; the fused-op table is registered first."""
    check_dtype(spec.dtype)
    register_ops()
    mode = spec.model_config.exe_mode
    if mode == "ge_graph":
        return TorchairGEBackend(spec)
    if mode == "npugraph_ex":
        return NpuGraphExBackend(spec)
    return EagerBackend(custom_ops.layer("npu", spec.model_config.custom_ops, custom_op_installer("eager")))


# --------------------------------------------------------------------------- several devices
def init_distributed(local_rank: int) -> str:
    """Bind this rank to its NPU and name the torch.distributed backend: HCCL (torch_npu registers
    it). Functional collectives in the decode graph become GE HcomAllReduce / HcomAllGather ops
    (torchair's converters); inside a `super_kernel` scope GE fuses AllReduce, ReduceScatter,
    AllGather and AlltoAll into the SuperKernel, and cuts the scope around anything it cannot fuse."""
    _torch_npu().npu.set_device(local_rank)
    return "hccl"


def device_count() -> int:
    """NPUs visible to this process (ASCEND_RT_VISIBLE_DEVICES applies)."""
    return int(_torch_npu().npu.device_count())
