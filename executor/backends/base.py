"""The contract every decode backend implements, and the eager one.

A backend turns the runner's decode step, `(B, 1) token ids, (B, 1) positions -> (B, V) logits`,
into a `CompiledStep` and says what it needs installed while that step is traced and run: its
op table, its scope implementation and its environment (executor.context installs them). The
step reports what really ran in one shape on every backend (`StepReport`): compile time,
graphs, recompiles, the compile cache, and per SuperKernel scope what the backend knows of it
(portable backend: ops, segments, launches; Ascend: how often dynamo traced it). So the
runner, the metrics and the tools never look inside a particular backend.

The compile cache directory is keyed here, once for every backend (`cache_key`, `keyed_cache_dir`):
torchair's `inference.cache_compile` keys its cache on the module's class and str(), the
CompilerConfig and the determinism level only, and on a hit reuses the saved graph without
dynamo's guards. Anything else that changes the graph must therefore change the directory.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from executor import ops
from executor.arch import ModelArch
from executor.config import ModelConfig
from executor.errors import RecipeError
from executor.parallel.layout import ONE_DEVICE, Layout
from executor.scope import NO_PLAN, ScopeFactory, ScopePlan

DEFAULT_CACHE = Path.home() / ".cache" / "cann-recipes-infer" / "compile"

Step = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def cache_root(mc: ModelConfig) -> Path:
    """Where compiled artifacts are kept when `enable_cache_compile` is on."""
    return Path(mc.cache_dir).expanduser() if mc.cache_dir else DEFAULT_CACHE


class UnsupportedError(RecipeError):
    """Requested but impossible on this platform or backend; one line saying why."""


@dataclass(frozen=True)
class DecodeSpec:
    """What a backend compiles: the run's model config and everything that shapes the decode graph.

    One object so that no backend picks its own subset for the cache key. Built by the runner
    (ModelRunner.decode_spec) before any weight is loaded."""

    model_config: ModelConfig
    arch: ModelArch
    dtype: str  # resolved (executor.compile.resolve_dtype), never "auto"
    batch_size: int  # static: the graph is compiled for exactly this many rows
    max_len: int  # static KV-cache slots: input length + max_new_tokens
    plan: ScopePlan = NO_PLAN  # NO_PLAN when SuperKernel is off
    device: str = ""  # platform.device_name: NPU converters and GE kernels differ per SoC
    layout: Layout = ONE_DEVICE  # several devices: this rank's graph holds its slices and collectives
    rank: int = 0


def cache_key(
    spec: DecodeSpec, backend: str, op_table: str, versions: dict[str, str | None], options: dict | None = None
) -> dict:
    """Everything that changes the compiled decode graph, as plain data (metrics.json `compile.cache_key`).

    `options`: what the backend hands its compiler beyond the graph (e.g. npugraph_ex options)."""
    arch = asdict(spec.arch)
    arch.pop("source")  # where config.json was read from does not change the graph
    key = {
        "backend": backend,
        "device": spec.device,
        "arch": arch,
        "dtype": spec.dtype,
        "batch_size": spec.batch_size,
        "max_len": spec.max_len,
        "exe_mode": spec.model_config.exe_mode,
        "plan": spec.plan.name,
        "scopes": [{"region": s.region, "label": s.label, "options": s.options} for s in spec.plan.scopes],
        "op_table": ops.implementations(op_table),
        "backend_options": options or {},
        "versions": versions,
    }
    if spec.layout.world > 1:  # each rank compiles (and caches) its own graph; world size 1 keys as before
        key["parallel"] = spec.layout.describe() | {"rank": spec.rank}
    return json.loads(json.dumps(key, default=str))  # plain JSON data: what metrics.json and cache_key.json hold


def keyed_cache_dir(root: Path, key: dict) -> Path:
    """`<root>/<backend>-<digest of the key>`: same key, same directory; any change, another one.

    The key is written beside the compiled artifacts (cache_key.json) so a user can see what a
    directory was compiled for."""
    text = json.dumps(key, sort_keys=True, separators=(",", ":"), default=str)
    directory = root / f"{key['backend']}-{hashlib.sha256(text.encode()).hexdigest()[:16]}"
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "cache_key.json").write_text(json.dumps(key, indent=2, sort_keys=True, default=str) + "\n")
    return directory


@dataclass
class StepReport:
    """What compiling and running the decode step did (metrics.json `compile` and `superkernel`)."""

    backend: str
    compile_s: float = 0.0  # wall time of the first call, which traces and compiles
    graphs: int = 0  # graphs compiled, first call included
    recompiles: int = 0  # graphs compiled after the first call (each one was timed as a step)
    cache_dir: str | None = None
    cache_enabled: bool = False
    cache_key: dict | None = None  # what the cache directory is keyed on (see cache_key)
    cache_lookups: dict | None = None  # {"hits", "misses", "aot_hits", "aot_misses", "aot_bypasses"}: first call
    direct_calls: int | None = None  # calls past torch.compile's wrapper (portable graph mode); None: not that backend
    scopes: list[dict] = field(default_factory=list)  # one dict per scope label, backend-specific detail
    superkernel_ran: bool | None = False  # None: not observable (e.g. the graph came from a cache)

    def compile_info(self) -> dict:
        """The `compile` section of metrics.json."""
        info = asdict(self)
        for key in ("backend", "scopes", "superkernel_ran"):
            info.pop(key)
        info["compile_s"] = round(self.compile_s, 3)
        return info


class CompiledStep:
    """A decode step ready to call, timing its first call and counting the graphs compiled.

    `count_graphs` reads the backend's own graph counter (None: nothing is compiled, eager).
    Backends subclass this to translate their errors (`_call`) and to add scope detail
    (`report`)."""

    def __init__(self, fn: Step, name: str, count_graphs: Callable[[], int] | None = None):
        self.fn, self.name, self._count = fn, name, count_graphs or (lambda: 0)
        self._compiles = count_graphs is not None
        self.calls = self.graphs = self.recompiles = 0
        self.compile_s = 0.0

    @property
    def compiles(self) -> bool:
        """The step compiles again at a new thread count (the thread governor asks): a compiled step
        Dynamo guards on the count; not eager."""
        return self._compiles

    def _call(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.fn(input_ids, positions)

    def _first_call_done(self) -> None:
        """Hook after the first call (which compiled); backends check what it produced."""

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        before = self._count()
        t0 = time.perf_counter()
        out = self._call(input_ids, positions)
        new = max(0, self._count() - before)
        self.graphs += new
        if self.calls == 0 and self._compiles:
            self.compile_s = time.perf_counter() - t0
            self._first_call_done()
        else:
            self.recompiles += new
        self.calls += 1
        return out

    def report(self) -> StepReport:
        return StepReport(self.name, self.compile_s, self.graphs, self.recompiles)


class Backend:
    """Chosen once per run by executor.compile.select_backend; `compile` is called once."""

    name = "eager"
    op_table = "reference"  # executor.ops table the model runs with

    def scope_factory(self) -> ScopeFactory | None:
        """What `superkernel_scope` opens while this backend's step is traced (None: marker ops)."""
        return None

    def environment(self) -> dict[str, str]:
        """Environment variables the backend reads while it compiles (set for the run, then restored)."""
        return {}

    def compile(self, step: Step) -> CompiledStep:
        return CompiledStep(step, self.name)


class EagerBackend(Backend):
    """exe_mode eager: the step runs as plain PyTorch with the given op table; `wrap`, when given,
    wraps the step (on CPU: executor.backends.eager_kernels.eager_step, this project's CPU kernels)."""

    def __init__(self, op_table: str = "reference", wrap: Callable[[Step], Step] | None = None):
        self.op_table = op_table
        self.wrap = wrap

    def compile(self, step: Step) -> CompiledStep:
        return CompiledStep(self.wrap(step) if self.wrap else step, self.name)
