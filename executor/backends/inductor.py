"""Portable graph mode and SuperKernel on CPU/CUDA, built on torch.compile (Inductor).

ge_graph: the whole decode step is captured once (`fullgraph=True, dynamic=False`) and
compiled by Inductor; every graph compiled is counted so recompiles show up in metrics. On CPU
large decode GEMVs become generated reductions (executor.backends.graph_passes), with or
without scopes.

SuperKernel: the scope markers (executor.scope) arrive in the FX graph. We split the graph at
them and compile each scope segment as ONE launch unit: on CPU with Inductor's C++ wrapper
(all the segment's kernels are called from one C++ function: no Python between them) and its
small GEMVs fused into the generated code; on CUDA captured by us as one CUDA graph. Code
outside scopes keeps Inductor's default Python wrapper, which dispatches every kernel from
Python: that per-kernel overhead is what SuperKernel removes on Ascend.

A node that cannot join a scope (data-dependent output shape, e.g. nonzero/masked_select)
cuts the scope into segments around it, as GE does with unfusable ops. Option
`strict-scope-check=abort` turns that into an error naming the op and scope; `bypass` runs
the whole scope unfused with a warning.

Collectives (several devices: functional collectives in the graph, executor.parallel): on CPU
an all-reduce is part of its scope's launch unit (the C++ wrapper calls it like any kernel;
counted per scope as `collectives`); any other collective (all_gather, reduce_scatter,
all_to_all, broadcast) cuts the scope, with the reason recorded, because the C++ wrapper cannot
call it. The parallel layers keep in-scope communication to all-reduces for that reason. On
CUDA a collective is captured into the scope's CUDA graph with the rest (NCCL supports capture).
"""

from __future__ import annotations

import contextlib
import inspect
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols
from torch.fx.passes.split_module import split_module

from executor import custom_ops
from executor.backends.base import (
    Backend,
    CompiledStep,
    DecodeSpec,
    Step,
    StepReport,
    cache_key,
    cache_root,
    keyed_cache_dir,
)
from executor.backends.direct_call import DirectCall
from executor.backends.graph_passes import before_inductor
from executor.backends.packed_linear import MIN_WEIGHT_NUMEL
from executor.backends.scratch_dir import ScratchDir
from executor.backends.unit_memory import POOL_MAX_NODES, SMALL_UNIT, unit_wrapper
from executor.errors import RecipeError
from executor.scope import SCOPE_ENTER, SCOPE_EXIT, parse_options

_MARKERS = (SCOPE_ENTER, SCOPE_EXIT, torch.ops.sk.scope_enter, torch.ops.sk.scope_exit)


# How a scope becomes one launch unit on CPU: Inductor's C++ wrapper calls every kernel of the
# segment from one C++ function (no Python between kernels), and the scope's small decode
# GEMMs (M = 1) are decomposed into loops fused with their neighbours instead of one extern BLAS
# call each (~10 us of call overhead apiece at these sizes). Outside scopes Inductor keeps its
# Python wrapper and its BLAS calls for small GEMMs. Measured effect: BENCHMARKS.md.
CPU_LAUNCH_UNIT = {"cpp_wrapper": True, "post_grad_fusion_options": {"decompose_mm_pass": {}}}


# A large model's CPU kernels read the thread count when they run (`omp_get_max_threads`) instead
# of having it compiled in, and Dynamo does not guard the step on the count. Why: the thread
# governor (executor/threads.py) moves a decode step to fewer threads when a neighbour takes the
# cores. With the count compiled in and guarded, each new count was a full compile again, 97-150 s
# at the 0.6B shape on the AVX2 kind, which the governor rightly would not pay in a short call:
# under a late neighbour SK decoder then stayed on 2 threads at 19.8x its idle step. Kernels that
# read the count made it a retrace whose kernels came from Inductor's cache (9.5-10.7 s there) and
# left the idle step as fast (0.90x ge_graph, 1.02x SK decoder, 7 alternating rounds); without the
# guard a new count costs nothing. Dynamo's guard on the count is its global state guard (grad
# mode, autocast, default dtype, ...), so the step checks the rest of that state itself
# (InductorStep). Only where the step holds a weight of DYNAMIC_THREADS_NUMEL elements or more: at
# the overhead-bound bench size (sub-ms steps) reading the count made the idle ge_graph step 1.33x
# slower, a parallel region in every kernel ("thirty-seventh pass"). With thread_count_kernels' serial
# small loops its one-thread (TINY_MACS) steps were still 1.05x (ge_graph) and 1.11x (SK decoder)
# slower, its 2-thread batch 8-16 ones 0.97x and 1.005x (BENCHMARKS.md, "sixty-first pass"): kept.
CPU_KERNELS = {"cpp.dynamic_threads": True, "cpp.min_chunk_size": 2048}
DYNAMIC_THREADS_NUMEL = MIN_WEIGHT_NUMEL  # packed_linear's large weight: every 0.6B projection, no bench-overhead one


@contextlib.contextmanager
def thread_count_kernels(on: bool = True) -> Iterator[None]:
    """Inductor's CPU codegen under CPU_KERNELS (nothing where `on` is False), with its static
    rule for small loops kept: a loop nest with under `cpp.min_chunk_size` iterations for each
    of two threads runs serially.

    Why: reading the count at run time, Inductor opens a parallel region in every kernel, even
    one whose loops it keeps serial for a known count, and a fork and join of the two threads
    costs ~1.8 us on the AVX2 kind (Zen 3) against well under a microsecond for a 1024-element
    norm. The 0.6B batch-1 bf16 step ran 171 such regions besides its 113 GEMVs': each norm two
    (its mean as a parallel reduction, then the scaling), the SwiGLU product one. A serial loop
    nest does not depend on the thread count, so the governor's count still holds for the
    others. 2048 iterations a thread, not Inductor's default 512: the batch-1 step's norms and
    SwiGLU product (1024-3072 values) stay serial, its attention over the cache (heads x cached
    positions x head_dim) does not. There the step's Inductor regions went from 171 to 29, perf
    had the main thread 0.52-0.63 ms a step in libgomp against 0.88-1.19, and the step took
    0.98-1.00x the time. With 4096 a thread the batch-4 step's norms (4 x 1024) went serial
    too and it took 1.022x the time, slower in 6 of 6 rounds; with 2048, 0.995x (BENCHMARKS.md, "sixtieth pass")."""
    if not on:
        yield
        return
    from torch._inductor import config as inductor_config
    from torch._inductor.codegen import cpp

    original = cpp.CppKernel.decide_parallel_depth

    def decide_parallel_depth(kernel, max_parallel_depth, threads):
        if kernel.size_hint() < 2 * inductor_config.cpp.min_chunk_size:  # whatever the count compiled at
            return cpp.ParallelDepth(parallel_depth=0, start_depth=max_parallel_depth.start_depth)
        return original(kernel, max_parallel_depth, threads)

    cpp.CppKernel.decide_parallel_depth = decide_parallel_depth
    try:
        with inductor_config.patch(CPU_KERNELS):
            yield
    finally:
        cpp.CppKernel.decide_parallel_depth = original


def _reads_thread_count(inputs) -> bool:
    """A CPU graph with these example inputs gets CPU_KERNELS (a weight of DYNAMIC_THREADS_NUMEL)."""
    return any(isinstance(t, torch.Tensor) and t.numel() >= DYNAMIC_THREADS_NUMEL for t in inputs)


class ScopeCheckError(RecipeError):
    """strict-scope-check=abort found an op that cannot join its scope."""


class GraphBreakError(RecipeError):
    """The decode step cannot be captured as one graph (GE mode needs fullgraph)."""


@dataclass
class ScopeStats:
    label: str
    options: str
    ops: int = 0
    segments: int = 0
    unfused: bool = False
    cut_reasons: list[str] = field(default_factory=list)
    launches: int = 0  # segment launches executed (proof that the fused path really ran)
    collectives: int = 0  # collectives inside the scope's launch units (several devices)

    def as_dict(self) -> dict:
        return {
            "label": self.label,
            "options": self.options,
            "ops": self.ops,
            "segments": self.segments,
            "unfused": self.unfused,
            "cut_reasons": self.cut_reasons,
            "launches": self.launches,
            "collectives": self.collectives,
        }


@dataclass
class CompileStats:
    graphs: int = 0
    scopes: dict[str, ScopeStats] = field(default_factory=dict)
    dynamic_threads: bool = False  # some CPU graph's kernels read the thread count (CPU_KERNELS)


# Collectives Inductor's C++ wrapper can call (it has C shims for these only); any other one
# fails to compile in a CPU launch unit ("arg type Any is not yet supported by custom_op_wrapper").
CPU_UNIT_COLLECTIVES = ("all_reduce", "all_reduce_", "wait_tensor")


def _collective(node: torch.fx.Node) -> str | None:
    """The functional collective a node calls (all_reduce, all_gather_into_tensor, ...), or None."""
    target = str(node.target) if node.op == "call_function" else ""
    return target.split(".")[1] if target.startswith("_c10d_functional.") else None


def _data_dependent(node: torch.fx.Node) -> bool:
    value = node.meta.get("example_value")
    return value is not None and bool(free_unbacked_symbols(value))


def _blocker(node: torch.fx.Node, device: str = "cpu") -> str | None:
    """Why `node` cannot run inside a single launch unit, or None."""
    if _data_dependent(node):
        return "its output shape is data-dependent"
    name = _collective(node)
    if device != "cpu" or name is None:
        return None
    if name == "wait_tensor":  # waits stay with the collective they wait for
        producer = node.args[0] if node.args and isinstance(node.args[0], torch.fx.Node) else None
        return _blocker(producer, device) if producer is not None else None
    if name not in CPU_UNIT_COLLECTIVES:
        return f"collective {name}: a CPU launch unit (Inductor's C++ wrapper) can call all_reduce only"
    return None


def _is_tensor(node: torch.fx.Node) -> bool:
    return isinstance(node.meta.get("example_value"), torch.Tensor)


def _op_name(node: torch.fx.Node) -> str:
    target = node.target
    return getattr(target, "__name__", str(target))


def _fake_inputs(args: tuple) -> list:
    """Fake copies of a segment's real inputs, under a fake mode with a shape environment.

    Why: the segments are compiled at their first call, outside dynamo's tracing context, and
    Inductor's FX graph cache (what makes a second run's compile take seconds, with
    enable_cache_compile) is bypassed for inputs without a shape environment ("No shape env")."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    mode = FakeTensorMode(shape_env=ShapeEnv(), allow_non_fake_inputs=True)
    return [mode.from_tensor(a, static_shapes=True) if isinstance(a, torch.Tensor) else a for a in args]


class _Segment:
    """One partition of the split graph, compiled on first call with the real inputs;
    `reads_threads`: its CPU kernels read the thread count (CPU_KERNELS), as the whole step's do.

    A plain callable, not an nn.Module: the split module calls it as an attribute. Without nn.Module's
    call machinery (hooks, forward dispatch), which no segment uses, the SK decoder step at
    bench-overhead took 0.925-0.966x the time (2 x 21 alternating rounds)."""

    def __init__(
        self,
        gm: torch.fx.GraphModule,
        fused: bool,
        device: str,
        stats: ScopeStats | None,
        reads_threads: bool = False,
        interpreted: bool = False,
    ):
        self.gm, self.fused, self.device, self.stats = gm, fused, device, stats
        self.reads_threads = reads_threads
        # A segment holding a data-dependent op runs as the plain FX graph: Inductor cannot
        # compile it from concrete example inputs, and it is outside any launch unit anyway.
        self.fn: Callable | None = gm if interpreted else None

    def __call__(self, *args):
        if self.fn is None:
            from torch._inductor import config as inductor_config
            from torch._inductor.compile_fx import compile_fx

            # CPU launch unit = the C++ wrapper; CUDA launch unit = one CUDA graph (captured by us:
            # Inductor's own cudagraphs silently skip graphs that mutate inputs, like the KV cache).
            patch = CPU_LAUNCH_UNIT if self.fused else {}
            small = self.fused and self.device == "cpu" and len(self.gm.graph.nodes) <= POOL_MAX_NODES
            if small:  # intermediates on the stack or from a pool (executor.backends.unit_memory)
                patch = patch | SMALL_UNIT
            before_inductor(self.gm, self.device, launch_unit=self.fused)
            with (
                thread_count_kernels(self.reads_threads),
                inductor_config.patch(patch),
                unit_wrapper() if small else contextlib.nullcontext(),
            ):
                self.fn = compile_fx(self.gm, _fake_inputs(args))
            if self.fused and self.device == "cuda":
                self.fn = _CudaGraphUnit(self.fn, args)
        if self.stats is not None and self.fused:
            self.stats.launches += 1
        return self.fn(*args)


class _CudaGraphUnit:
    """Replays a compiled segment as one CUDA graph. Inputs that keep their address between
    steps (weights, the static KV cache, mutated in place) are captured as they are; others
    are copied into the captured buffers before each replay. Not run on a GPU in CI."""

    def __init__(self, fn: Callable, args: tuple):
        self.static = list(args)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn(*self.static)  # warm-up outside capture (allocator, lazy init)
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.out = fn(*self.static)

    def __call__(self, *args):
        # Most inputs are the very tensors captured (weights, the KV cache: ~290 of the 0.6B shape's
        # decoder scope), so the identity test settles them before the pointer comparison.
        for buf, arg in zip(self.static, args):
            if arg is not buf and isinstance(arg, torch.Tensor) and arg.data_ptr() != buf.data_ptr():
                buf.copy_(arg)
        self.graph.replay()
        if isinstance(self.out, torch.Tensor):
            return self.out.clone()
        return type(self.out)(o.clone() if isinstance(o, torch.Tensor) else o for o in self.out)


class GraphCompiler:
    """Dynamo backend object: counts graphs and, with SuperKernel, splits at scope markers."""

    def __init__(self, superkernel: bool, device: str):
        self.superkernel, self.device = superkernel, device
        self.stats = CompileStats()

    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
        self.stats.graphs += 1
        # Decided for the whole step, before Dynamo builds its guards (guard_filter reads it), so
        # that every segment reads the count: one compiled in would keep its threads.
        dynamic = self.device == "cpu" and _reads_thread_count(example_inputs)
        self.stats.dynamic_threads |= dynamic
        if not self.superkernel:
            from torch._inductor.compile_fx import compile_fx

            before_inductor(gm, self.device)
            with thread_count_kernels(dynamic):
                return compile_fx(gm, example_inputs)
        return self._split(gm, dynamic)

    def guard_filter(self, entries) -> list[bool]:
        """Dynamo's guards to keep: none on nn modules (parameters are not guarded: torchair's
        frozen_parameter, their addresses are fixed for the run; ~50 us of guard checks per step),
        and not its global state guard where the kernels read the thread count (CPU_KERNELS), as
        that guard holds the count. Called after this compiler has compiled the graph."""
        keep = torch.compiler.skip_guard_on_all_nn_modules_unsafe(entries)
        if not self.stats.dynamic_threads:
            return keep
        return [k and e.guard_type != "GLOBAL_STATE" for k, e in zip(keep, entries)]

    def _split(self, gm: torch.fx.GraphModule, reads_threads: bool = False):
        partition: dict[torch.fx.Node, int] = {}
        interpreted: set[int] = set()
        fused: dict[int, ScopeStats | None] = {}
        current, scope = 0, None
        fused[0] = None

        def start(stats: ScopeStats | None):
            nonlocal current
            current += 1
            fused[current] = stats

        for node in list(gm.graph.nodes):
            if node.op == "call_function" and node.target in _MARKERS:
                if node.target in (SCOPE_ENTER, torch.ops.sk.scope_enter):
                    label, options = node.args
                    scope = self.stats.scopes.setdefault(label, ScopeStats(label, options))
                    bypass = parse_options(options).get("strict-scope-check") == "bypass"
                    scope.unfused = scope.unfused or (bypass and self._scope_blocked(node))
                    start(None if scope.unfused else scope)
                else:
                    scope = None
                    start(None)
                gm.graph.erase_node(node)
                continue
            if node.op in ("placeholder", "output"):
                continue
            reason = _blocker(node, self.device)
            if scope is not None:
                scope.ops += 1
                if not reason and not scope.unfused and _collective(node) not in (None, "wait_tensor"):
                    scope.collectives += 1
                if reason and not scope.unfused:
                    mode = parse_options(scope.options).get("strict-scope-check")
                    if mode == "abort":
                        raise ScopeCheckError(
                            f"scope {scope.label!r}: op {_op_name(node)} cannot join a "
                            f"SuperKernel ({reason}); strict-scope-check=abort"
                        )
                    if fused[current] is not None:  # consecutive blockers share one unfused cut
                        scope.cut_reasons.append(f"cut at {_op_name(node)}: {reason}")
                        start(None)
                    partition[node] = current
                    if _data_dependent(node):
                        interpreted.add(current)
                    continue
                if fused[current] is None and not scope.unfused and not _is_tensor(node):
                    partition[node] = current  # shape checks on the cut op's output stay with it
                    continue
                if fused[current] is None and not scope.unfused:
                    start(scope)  # back inside the scope after the cut
            if _data_dependent(node):
                interpreted.add(current)
            partition[node] = current
        gm.recompile()
        used = set(partition.values())
        for s in self.stats.scopes.values():
            s.segments = sum(1 for p in used if fused.get(p) is s)
        split = split_module(gm, None, lambda n: partition[n], keep_original_order=True)
        for name, sub in list(split.named_children()):
            index = int(name.rsplit("_", 1)[1])
            stats = fused.get(index)
            segment = _Segment(sub, stats is not None, self.device, stats, reads_threads, index in interpreted)
            delattr(split, name)  # no longer a child module: a plain attribute the split's code calls
            setattr(split, name, segment)
        # Its generated forward, not the module: Dynamo wraps what a backend returns to keep it from
        # being traced, and a module's wrapper adds nn.Module's and GraphModule's call machinery
        # to every step (0.92x the SK decoder step at bench-overhead without it, 2 x 21 alternating rounds).
        return split.forward

    def _scope_blocked(self, enter: torch.fx.Node) -> bool:
        """bypass: look ahead to the scope's exit; if any op blocks, the whole scope runs unfused."""
        node = enter.next
        while node.op != "output" and node.target not in (SCOPE_EXIT, torch.ops.sk.scope_exit):
            reason = _blocker(node, self.device)
            if reason:
                warnings.warn(
                    f"SuperKernel scope {enter.args[0]!r} runs unfused: op {_op_name(node)} "
                    f"cannot join it ({reason}); strict-scope-check=bypass",
                    stacklevel=2,
                )
                return True
            node = node.next
        return False


class InductorStep(CompiledStep):
    """The compiled step: dynamo's errors become ours, and what the scopes did is reported. After the
    first call, calls run past torch.compile's per-call wrapper where Dynamo's guards pass (DirectCall)."""

    def __init__(
        self,
        fn: Callable,
        compiler: GraphCompiler,
        name: str,
        cache_dir: str | None,
        cache_enabled: bool,
        cache_key: dict | None = None,
        direct: DirectCall | None = None,
    ):
        super().__init__(fn, name, count_graphs=lambda: compiler.stats.graphs)
        self.direct = direct  # later calls past torch.compile's wrapper, Dynamo's guards kept
        self.compiler, self.cache_dir, self.cache_enabled, self.cache_key = (
            compiler,
            cache_dir,
            cache_enabled,
            cache_key,
        )
        self.scratch: ScratchDir | None = None  # the run's own compile directory, kept while the step lives
        self.cache_lookups: dict | None = None
        self.traced_under: torch._C._dynamo.guards.GlobalStateGuard | None = None  # torch's global state then

    @property
    def compiles(self) -> bool:
        """Once compiled with kernels that read the thread count, a new count runs the same step."""
        return not (self.calls and self.compiler.stats.dynamic_threads)

    def _call(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if self.calls:
            if self.compiler.stats.dynamic_threads:
                self._check_global_state()
            if self.direct is not None:
                out = self.direct(input_ids, positions)
                if out is not None:
                    return out
            out = self._run(input_ids, positions)
        else:
            self.traced_under = torch._C._dynamo.guards.GlobalStateGuard()
            before = _fx_graph_cache_counts()
            out = self._run(input_ids, positions)
            after = _fx_graph_cache_counts()
            self.cache_lookups = {k: after[k] - before[k] for k in after}
        if self.direct is not None:
            self.direct.refresh()
        return out

    def _check_global_state(self) -> None:
        """Dynamo's global state guard, less the thread count (GraphCompiler.guard_filter drops
        the guard where the kernels read the count): the step was traced for that state, and
        running it under another (grad mode, autocast, default dtype, ...) would be wrong
        silently. ~0.05 us."""
        if self.traced_under.check():
            return
        changed = sorted(set(self.traced_under.reason().split()) - {"num_threads"})
        if changed:
            raise RuntimeError(
                f"the compiled decode step is called under another torch global state than it was traced under "
                f"({', '.join(changed)} changed); call it as the runner does"
            )

    def _run(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        try:
            return self.fn(input_ids, positions)
        except torch._dynamo.exc.BackendCompilerFailed as exc:
            if isinstance(exc.inner_exception, ScopeCheckError):
                raise exc.inner_exception from None
            raise
        except torch._dynamo.exc.Unsupported as exc:
            first = str(exc).strip().splitlines()[0]
            raise GraphBreakError(
                f"the decode step has a graph break ({first}); exe_mode ge_graph compiles "
                "it as one graph (fullgraph=True), so remove the break or use eager"
            ) from None

    def _first_call_done(self) -> None:
        if self.graphs == 0:  # dynamo gave up (e.g. recompile limit): never run eager silently
            raise RuntimeError("the decode step was not compiled (torch._dynamo skipped it); see TORCH_LOGS=recompiles")

    def report(self) -> StepReport:
        scopes = self.compiler.stats.scopes.values()
        return StepReport(
            self.name,
            self.compile_s,
            self.graphs,
            self.recompiles,
            cache_dir=self.cache_dir,
            cache_enabled=self.cache_enabled,
            cache_key=self.cache_key,
            cache_lookups=self.cache_lookups,
            direct_calls=self.direct.calls if self.direct is not None else 0,
            scopes=[s.as_dict() for s in scopes],
            superkernel_ran=any(s.launches > 0 for s in scopes),
        )


def _fx_graph_cache_counts() -> dict[str, int]:
    """Inductor's FX graph cache lookups so far in this process, and AOTAutograd's, whose cache
    sits in front of it (torch._dynamo's counters).

    Why: whether a run's compile came from enable_cache_compile's cache is a fact to record,
    not something to infer from compile_s, which a busy neighbour changes as much as a cache. A
    graph AOTAutograd bypasses is traced and lowered again on every run, cache or not."""
    from torch._dynamo.utils import counters

    fx, aot = counters["inductor"], counters["aot_autograd"]
    return {
        "hits": fx["fxgraph_cache_hit"],
        "misses": fx["fxgraph_cache_miss"],
        "aot_hits": aot["autograd_cache_hit"],
        "aot_misses": aot["autograd_cache_miss"],
        "aot_bypasses": aot["autograd_cache_bypass"],
    }


def _isolated_recompiles() -> dict:
    """`isolate_recompiles=True` where torch.compile has it (2.13, the pinned version). Older
    torch (2.11, the CUDA machines' image) lacks it: there all runners share one code object's
    recompile budget, so that budget is raised instead."""
    if "isolate_recompiles" in inspect.signature(torch.compile).parameters:
        return {"isolate_recompiles": True}
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 4096)
    return {}


def compile_inductor(
    step: Callable,
    superkernel: bool,
    device: str,
    cache_dir: str | None = None,
    cache_enabled: bool = False,
    cache_key: dict | None = None,
) -> InductorStep:
    """torch.compile the whole step with our graph compiler (Inductor; SK = one launch unit per scope).

    The scope markers must be the active scope implementation while the step is traced
    (executor.context does that for a run)."""
    # Every runner compiles the same code object (ModelRunner._decode_step): isolate each
    # compile's cache entries so runners in one process (tests, benchmarks) never share or
    # exhaust a recompile budget. Which guards are kept: GraphCompiler.guard_filter.
    torch._dynamo.config.accumulated_recompile_limit = max(torch._dynamo.config.accumulated_recompile_limit, 4096)
    compiler = GraphCompiler(superkernel, device)
    compiled = torch.compile(
        step,
        backend=compiler,
        fullgraph=True,
        dynamic=False,
        options={"guard_filter_fn": compiler.guard_filter},
        **_isolated_recompiles(),
    )
    name = "inductor+superkernel" if superkernel else "inductor"
    return InductorStep(compiled, compiler, name, cache_dir, cache_enabled, cache_key, DirectCall(step, compiler))


class InductorBackend(Backend):
    """Portable graph mode on CPU/CUDA (exe_mode ge_graph): reference ops, marker-op scopes.

    With enable_cache_compile the Inductor cache lives in a directory of `cache_root` keyed on
    everything that changes the graph (base.cache_key), else in a fresh directory per run (a
    ScratchDir, removed with the run), so that a "cold" compile really is cold."""

    def __init__(self, spec: DecodeSpec, device: str):
        mc = spec.model_config
        self.superkernel, self.device = mc.superkernel_enabled, device
        self.name = "inductor+superkernel" if self.superkernel else "inductor"
        self.cache_enabled = mc.enable_cache_compile
        self.op_table = custom_ops.layer("reference", mc.custom_ops, custom_ops.installer(device))
        self.cache_key = cache_key(spec, self.name, self.op_table, {"torch": torch.__version__})
        self.scratch = None if self.cache_enabled else ScratchDir("sk_compile_")
        self.cache_dir = self.scratch.path if self.scratch else str(keyed_cache_dir(cache_root(mc), self.cache_key))

    def environment(self) -> dict[str, str]:
        return {"TORCHINDUCTOR_CACHE_DIR": self.cache_dir}

    def compile(self, step: Step) -> InductorStep:
        compiled = compile_inductor(
            step, self.superkernel, self.device, self.cache_dir, self.cache_enabled, self.cache_key
        )
        compiled.scratch = self.scratch  # its kernels were built there
        return compiled
