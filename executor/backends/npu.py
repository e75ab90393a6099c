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
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path

import torch
from torch._dynamo.utils import counters

from executor import ops
from executor.backends.base import Backend, CompiledStep, EagerBackend, Step, StepReport, UnsupportedError, cache_root
from executor.config import ModelConfig
from executor.scope import ScopeFactory, parse_options

INT32_MAX = 2**31 - 1  # FIA pre_tokens/next_tokens "no band limit"; causality comes from the mask


def _torch_npu():
    return importlib.import_module("torch_npu")


def _torchair():
    _torch_npu()  # torchair ships inside torch_npu and is importable only once torch_npu is
    return importlib.import_module("torchair")


# --------------------------------------------------------------------------- fused ops
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
        # q (B, Hq, S, D), k/v (B, Hkv, T, D): layout BNSD; mask (B, 1, S, T) bool, True = masked
        # out, which is already the NPU polarity. sparse_mode 0 = use the mask as given.
        out, _lse = tnpu.npu_fused_infer_attention_score(
            q,
            k,
            v,
            atten_mask=mask,
            num_heads=q.shape[1],
            num_key_value_heads=k.shape[1],
            input_layout="BNSD",
            scale=scale,
            sparse_mode=0,
            pre_tokens=INT32_MAX,
            next_tokens=INT32_MAX,
        )
        return out

    def moe_gating_top_k_softmax(logits, k):
        y, expert_idx, _row_idx = tnpu.npu_moe_gating_top_k_softmax(logits, finished=None, k=k)
        return y.to(torch.float32), expert_idx.to(torch.int64)  # reference contract; op: x.dtype, int32

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

    ops.register(
        "npu",
        {
            "rms_norm": rms_norm,
            "add_rms_norm": add_rms_norm,
            "swiglu": swiglu,
            "rotary_mul": rotary_mul,
            "attention": attention,
            "grouped_matmul": grouped_matmul,
            "moe_gating_top_k_softmax": moe_gating_top_k_softmax,
            "moe_init_routing": moe_init_routing,
        },
    )


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
class NpuStep(CompiledStep):
    """The compiled step. Graphs are counted with dynamo's own counter, so the backends stay
    exactly the documented objects (and a torchair cache hit, which traces nothing, shows 0)."""

    def __init__(self, fn: Callable, name: str, mc: ModelConfig, log: _ScopeLog, cache_dir: Path | None):
        super().__init__(fn, name, count_graphs=lambda: counters["stats"]["unique_graphs"])
        self.mc, self.log, self.cache_dir = mc, log, cache_dir

    def report(self) -> StepReport:
        traced = self.graphs > 0
        entries = self.log.entries.items()
        return StepReport(
            self.name,
            self.compile_s,
            self.graphs,
            self.recompiles,
            str(self.cache_dir) if self.cache_dir else None,
            self.mc.enable_cache_compile,
            [{"label": label, "options": options, "traced": n} for (label, options), n in entries],
            # None = not observable: the graph came from torchair's cache, nothing was traced
            superkernel_ran=bool(self.log.entries) if traced or not self.mc.enable_cache_compile else None,
        )


class _StepModule(torch.nn.Module):
    """torchair.inference.cache_compile caches bound nn.Module methods only: on a cache hit it
    finds the graph's parameters by name on that module. The runner's `_decode_step` belongs to
    ModelRunner (not a Module), so we bind it to a Module that registers the owner's modules
    (the model) under their attribute names, making the names resolvable."""

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


class _NpuGraphBackend(Backend):
    """What both Ascend graph modes share: the fused-op table, and a log of the scopes traced."""

    op_table = "npu"
    mode = ""

    def __init__(self, mc: ModelConfig):
        self.mc, self.superkernel, self.log = mc, mc.superkernel_enabled, _ScopeLog()

    def scope_factory(self) -> ScopeFactory | None:
        return scope_factory(self.mode, self.log) if self.superkernel else None


class TorchairGEBackend(_NpuGraphBackend):
    """exe_mode ge_graph: whole decode step, static shapes; SK = torchair.scope.super_kernel."""

    mode = "ge_graph"

    def __init__(self, mc: ModelConfig):
        super().__init__(mc)
        self.name = "torchair_ge+superkernel" if self.superkernel else "torchair_ge"

    def compile(self, step: Step) -> NpuStep:
        return compile_torchair_ge(step, self.mc, self.log)


class NpuGraphExBackend(_NpuGraphBackend):
    """exe_mode npugraph_ex: aclgraph capture; SK is a post-capture pass over begin/end scopes."""

    mode = "npugraph_ex"

    def __init__(self, mc: ModelConfig):
        super().__init__(mc)
        self.name = "npugraph_ex+superkernel" if self.superkernel else "npugraph_ex"
        if mc.enable_cache_compile:
            raise UnsupportedError(
                "enable_cache_compile needs exe_mode ge_graph (torchair.inference.cache_compile); "
                "npugraph_ex has no documented compile cache"
            )

    def compile(self, step: Step) -> NpuStep:
        return compile_npugraph_ex(step, self.mc, self.log)


def select_backend(mc: ModelConfig) -> Backend:
    """The Ascend backend for `mc.exe_mode`; registers the fused-op table first."""
    register_ops()
    if mc.exe_mode == "ge_graph":
        return TorchairGEBackend(mc)
    if mc.exe_mode == "npugraph_ex":
        return NpuGraphExBackend(mc)
    return EagerBackend("npu")


def compile_torchair_ge(step: Callable, model_config: ModelConfig, log: _ScopeLog) -> NpuStep:
    """torchair GE graph mode. Scopes open whatever the active scope implementation is
    (TorchairGEBackend.scope_factory, installed by the run's execution context)."""
    torchair = _torchair()
    cfg = importlib.import_module("torchair.configs.compiler_config").CompilerConfig()
    cfg.experimental_config.frozen_parameter = True  # parameter addresses fixed across steps
    cfg.experimental_config.tiling_schedule_optimize = True  # static shapes: tiling scheduled on device
    cfg.experimental_config.topology_sorting_strategy = "StableRDFS"
    superkernel = model_config.superkernel_enabled
    cache_dir = None
    if model_config.enable_cache_compile:
        cache_dir = cache_root(model_config) / "torchair"
        fn = torchair.inference.cache_compile(
            _module_method(step), config=cfg, cache_dir=str(cache_dir), dynamic=False, fullgraph=True, ge_cache=True
        )
    else:
        backend = torchair.get_npu_backend(compiler_config=cfg)
        fn = torch.compile(step, backend=backend, dynamic=False, fullgraph=True)
    name = "torchair_ge+superkernel" if superkernel else "torchair_ge"
    return NpuStep(fn, name, model_config, log, cache_dir)


def _npugraph_sk_options(mc: ModelConfig) -> dict:
    """npugraph_ex takes SK options once per compile, not per scope: only stream-fusion has a
    documented equivalent; any other scope option would be dropped, so it is an error."""
    sk = mc.superkernel
    fusion = set()
    for text in [c.options or sk.options for c in sk.custom] if sk.plan == "custom" else [sk.options]:
        parsed = parse_options(text)
        other = sorted(set(parsed) - {"stream-fusion"})
        if other:
            raise UnsupportedError(
                f"superkernel options {', '.join(other)} exist only in exe_mode ge_graph "
                "(torchair.scope.super_kernel); npugraph_ex supports stream-fusion only"
            )
        fusion.add(int(parsed.get("stream-fusion", "0")))
    if len(fusion) > 1:
        raise UnsupportedError("npugraph_ex applies one stream-fusion value to all scopes; the plan's scopes disagree")
    return {"stream_fusion": fusion.pop()}


def compile_npugraph_ex(step: Callable, model_config: ModelConfig, log: _ScopeLog) -> NpuStep:
    """aclgraph capture via the npugraph_ex backend; SK is a post-capture pass over begin/end scopes."""
    _torch_npu()  # registers the "npugraph_ex" dynamo backend
    superkernel = model_config.superkernel_enabled
    options: dict = {"frozen_parameter": True, "static_kernel_compile": True}  # SK needs static kernels
    if superkernel:
        options["super_kernel_optimize"] = True
        options["super_kernel_optimize_options"] = _npugraph_sk_options(model_config)
    fn = torch.compile(step, backend="npugraph_ex", fullgraph=True, dynamic=False, options=options)
    return NpuStep(fn, "npugraph_ex+superkernel" if superkernel else "npugraph_ex", model_config, log, None)


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
