"""Generic runner: tokenize -> prefill (eager, no scopes) -> compiled decode loop on a static KV
cache -> timings, cann-recipes-infer log lines and metrics.json.

A recipe's runner_<name>.py subclasses `ModelRunner` to say how to build its model; all the
measurement logic lives here once so every recipe is timed the same way. Generation is split
into named steps, as single-file decoders do, so that one piece can be replaced (a compiled
prefill, a multi-rank step) without touching the others:

    prepare(batch)      size the static KV cache, compile the decode step once
    prefill(prompts)    right-padded prompts -> first logits (eager, never inside a scope)
    decode_one(t, pos)  one compiled decode step -> logits
    generate(...)       the greedy loop over the three above

Everything that traces or runs the model happens inside the run's ExecutionContext (op table,
scope implementation, compile cache), entered here and restored afterwards.

Several devices (parallel_config.world_size > 1): every rank runs this same code under
torchrun. The model is built with the run's process groups (executor.parallel) and holds this
rank's part of the weights; each attention data parallel group prefills and decodes its share
of the batch rows, and generate() returns the whole batch on every rank. Rank 0 prints to the
console and writes metrics.json; the other ranks log to their own files.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import resource
import statistics
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

import torch

from executor import MALLOC_POLICY, huge_pages, logs, memory, numerics, ops, preflight, thp_mode
from executor.arch import ModelArch
from executor.backends import greedy
from executor.backends.base import Backend, CompiledStep, DecodeSpec
from executor.backends.eager_kernels import EagerKernels
from executor.compile import resolve_dtype, select_backend
from executor.config import ConfigError, RunConfig, to_dict
from executor.context import ExecutionContext
from executor.datasets import load_prompts
from executor.kv_cache import KVCache
from executor.loader import NoInit, init_random, load_weights
from executor.parallel import runtime
from executor.parallel.groups import Parallel
from executor.paths import results_dir
from executor.platform import Platform, cpu_runs_bf16, profiler_activities, software_versions, timer
from executor.scope import NO_PLAN, ScopeRunner
from executor.threads import ThreadGovernor
from executor.tokenizer import BUILTIN_TOKENIZER, Tokenizer, TokenizerError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class Generation:
    prompt_ids: list[list[int]]
    token_ids: list[list[int]]  # generated tokens per row
    prefill_ms: float
    decode_ms: list[float]  # one per decode step (the first token comes from prefill)
    first_logits: torch.Tensor  # (B, V) fp32 logits of the prefill's last real token
    last_logits: torch.Tensor  # (B, V) logits of the last decode step
    decode_threads: list[int] = field(default_factory=list)  # intra-op threads per decode step (executor/threads.py)
    compile_steps: list[int] = field(default_factory=list)  # decode steps that compiled for a new thread count
    prefill_threads: int = 0  # intra-op threads of the prefill (the count decode chose: executor/threads.py)

    def sample_ms(self) -> list[float]:
        """The decode steps' times without the steps that compiled (not samples of the step)."""
        skip = set(self.compile_steps)
        return [ms for i, ms in enumerate(self.decode_ms) if i not in skip]


@dataclass
class Prefill:
    logits: torch.Tensor  # (B, V) fp32 logits at each row's last prompt token
    lengths: torch.Tensor  # (B,) prompt lengths: the position of each row's next token
    ms: float


class ModelRunner:
    recipe = "base"
    model_types: tuple[str, ...] = ()

    def build_model(self, arch: ModelArch, parallel: Parallel) -> torch.nn.Module:
        """Overridden by each recipe: this rank's part of the model. Must depend on its arguments
        only: the pre-flight also calls it on an uninitialised runner, under the meta device and
        with a `Parallel` that has no process groups, for the regions and this rank's parameter
        count."""
        raise NotImplementedError

    def remap_weights(self, state: dict) -> dict:
        """Hook for recipe-specific checkpoint layouts (e.g. stacking MoE experts)."""
        return state

    def __init__(self, cfg: RunConfig, platform: Platform, out_dir: Path | None = None, stream: TextIO | None = None):
        self.cfg, self.platform, self.out_dir = cfg, platform, out_dir
        self.stream = stream or sys.stdout
        mc = cfg.model_config
        self.name = mc.model_name
        self.dtype_name = resolve_dtype(mc.dtype, platform)  # first: float32 on NPU stops before anything is read
        self.dtype = DTYPES[self.dtype_name]
        # config.json, recipe match, scope plan, memory estimate, compile cache: before anything is allocated
        pre = preflight.check(self, cfg, platform, self.dtype)
        self.model_path, self.arch, self.plan, self.memory = pre.model_path, pre.arch, pre.plan, pre.memory
        self.cfg, self.custom_ops_note = pre.cfg, pre.custom_ops_note  # custom_ops resolved for this run
        self.parallel = runtime.parallel_for(cfg.parallel_config, platform)  # process groups (world size 1: none)
        torch.manual_seed(mc.seed)
        with NoInit():  # every parameter is filled below
            self.model = self.build_model(self.arch, self.parallel).to(self.dtype)
        # The backend is chosen once the plan is known (the compile cache is keyed on it) and
        # before any weight is read, so an impossible request costs no loading time.
        self.use_backend(select_backend(self.decode_spec(), platform))
        if mc.with_ckpt:
            load_weights(self.model, self.model_path, self.dtype, self.remap_weights)
        else:
            init_random(self.model, mc.seed)
        # Only now: on Ascend "npu" names a device once the backend has imported torch_npu.
        self.device = torch.device(platform.kind)
        self.model.to(self.device).eval()
        self.placement = huge_pages.place(self.model)  # CPU weights on whole 2 MiB pages
        self.prefill_kernels = EagerKernels(self.model, self.device, self.dtype)  # CPU: linears, attention, pointwise
        self.tokenizer = Tokenizer.from_file(self._tokenizer_path())
        preflight.check_vocab(self.arch, self.tokenizer.vocab_size, str(self.tokenizer.path))
        self.decode_scopes = ScopeRunner(self.plan, active=True)
        self.prefill_scopes = ScopeRunner(NO_PLAN, active=False)  # prefill never runs in a scope
        self.cache: KVCache | None = None
        self.truncation: list[dict] = []  # per row: prompt tokens given and kept, set by encode_prompts
        self.now = timer(platform)
        self.threads = ThreadGovernor.for_run(platform.kind, self.parallel.world, self.log)

    @property
    def max_len(self) -> int:
        """Static KV-cache slots: the longest prompt kept plus every generated token."""
        return self.cfg.max_len

    def decode_spec(self) -> DecodeSpec:
        """What the decode step is compiled for: this run's static shapes, dtype, plan and device."""
        cfg, p = self.cfg, self.parallel
        batch = cfg.scheduler_config.batch_size // p.layout.attn_dp  # this rank's attention-DP share of the rows
        return DecodeSpec(
            cfg.model_config,
            self.arch,
            self.dtype_name,
            batch,
            self.max_len,
            self.plan,
            self.platform.device_name,
            p.layout,
            p.rank,
        )

    @classmethod
    def check_before_run(cls, cfg: RunConfig, platform: Platform, ranks_here: int | None = None) -> preflight.Preflight:
        """What __init__ checks before allocating, without building anything: the tools ask this
        for every side before the first run, the launcher before it starts the ranks
        (`ranks_here`: how many it starts on this machine)."""
        runner = cls.__new__(cls)  # build_model uses no state: only a meta-device model is built
        dtype = DTYPES[resolve_dtype(cfg.model_config.dtype, platform)]
        return preflight.check(runner, cfg, platform, dtype, ranks_here)

    def use_backend(self, backend: Backend) -> None:
        """Run the decode step with `backend` from now on (compiled on next use): the same model
        and weights under another exe_mode, e.g. for an eager reference in the same process."""
        self.backend, self.context = backend, ExecutionContext.for_backend(backend, self.parallel)
        self.step: CompiledStep | None = None  # the compiled decode step, built on first use
        self.step_key = object()  # names that step for the thread governor (an id() can be reused)
        self.collectives: dict | None = None  # collectives of one decode step, noted on its first call

    def _tokenizer_path(self) -> Path:
        mc = self.cfg.model_config
        if mc.tokenizer_path:
            return Path(mc.tokenizer_path)
        if self.model_path and (Path(self.model_path) / "tokenizer.json").is_file():
            return Path(self.model_path) / "tokenizer.json"
        if self.model_path and mc.with_ckpt:
            raise TokenizerError(f"{self.model_path}: tokenizer.json not found (set model_config.tokenizer_path)")
        return Path(BUILTIN_TOKENIZER)

    # ------------------------------------------------------------------ model steps
    def log(self, line: str) -> None:
        print(line, file=self.stream, flush=True)

    def prompts(self) -> list[str]:
        return load_prompts(self.cfg.data_config, self.cfg.scheduler_config.batch_size)

    def _decode_step(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """(B, 1) tokens at (B, 1) positions -> (B, V) logits. The function that gets compiled."""
        hidden = self.model(input_ids, positions, self.cache, self.decode_scopes)
        return self.model.logits(hidden[:, -1])

    def prepare(self, batch: int) -> None:
        """Size the static KV cache for `batch` rows and compile the decode step (once each).

        The cache is sized from config only, so every call has the same shapes (no recompiles).
        Reusing it is safe: each slot a query can see is rewritten by prefill before it is read."""
        if self.cache is None or self.cache.k[0].shape[0] != batch:
            self.cache = KVCache(
                len(self.model.layers),
                batch,
                self.parallel.layout.kv_heads_per_rank(self.arch.num_kv_heads),
                self.max_len,
                self.arch.head_dim,
                self.dtype,
                self.device,
            )
        if self.step is None:
            self.step = self.backend.compile(self._decode_step)

    def prefill(self, prompt_ids: list[list[int]], width: int = 0) -> Prefill:
        """Run the right-padded prompts through the model eagerly, outside any scope; with
        `max_prefill_tokens`, in consecutive groups of rows of at most that many prompt tokens.
        `width` pads to at least that many tokens (attention-DP groups pad to the same length,
        so the collectives of their prefills have the same shapes)."""
        lengths = torch.tensor([len(p) for p in prompt_ids], device=self.device)
        t0 = self.now()
        logits = [self._prefill_rows(prompt_ids, a, b, width) for a, b in self._prefill_groups(prompt_ids)]
        return Prefill(torch.cat(logits), lengths, (self.now() - t0) * 1e3)

    def _prefill_groups(self, prompt_ids: list[list[int]]) -> list[tuple[int, int]]:
        """[start, stop) row ranges; one range unless scheduler_config.max_prefill_tokens > 0."""
        limit = self.cfg.scheduler_config.max_prefill_tokens
        if limit <= 0:
            return [(0, len(prompt_ids))]
        groups, start, used = [], 0, 0
        for i, p in enumerate(prompt_ids):
            if len(p) > limit:
                raise ConfigError(
                    f"scheduler_config.max_prefill_tokens: prompt {i} has {len(p)} tokens, more than the limit {limit} "
                    "(raise the limit or lower data_config.input_truncated_len)"
                )
            if used + len(p) > limit:
                groups.append((start, i))
                start, used = i, 0
            used += len(p)
        return [*groups, (start, len(prompt_ids))]

    def _prefill_rows(
        self,
        prompt_ids: list[list[int]],
        start: int,
        stop: int,
        width: int = 0,
        scopes: ScopeRunner | None = None,
    ) -> torch.Tensor:
        """Prefill rows [start, stop), right-padded to at least `width` tokens; `scopes` is
        replaced only by the NaN locator's region tracker."""
        rows = prompt_ids[start:stop]
        lengths = torch.tensor([len(p) for p in rows], device=self.device)
        width = max(width, int(lengths.max()))
        ids = torch.zeros(len(rows), width, dtype=torch.long, device=self.device)  # (b, S) right-padded
        for i, p in enumerate(rows):
            ids[i, : len(p)] = torch.tensor(p)
        positions = torch.arange(ids.shape[1], device=self.device).expand_as(ids)
        cache = self.cache.rows(start, stop, ids.shape[1])  # the prompt's slots only
        with self.prefill_kernels.active():
            hidden = self.model(ids, positions, cache, scopes or self.prefill_scopes)
            return self.model.logits(hidden[torch.arange(len(rows)), lengths - 1])  # (b, V)

    def decode_one(self, token: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """One compiled decode step: (B, 1) tokens at (B, 1) positions -> (B, V) logits."""
        if self.collectives is not None:
            return self.step(token, positions)
        log = self.parallel.log  # the first call runs (or traces) every collective of a step once
        log.calls.clear()
        log.recording = True
        try:
            return self.step(token, positions)
        finally:
            log.recording = False
            self.collectives = log.summary()

    @contextlib.contextmanager
    def session(self, batch: int) -> Iterator[None]:
        """Where prefill / decode_one may be called: no autograd, the run's execution context
        active, the KV cache sized for `batch` rows and the decode step compiled (on first use)."""
        with torch.no_grad(), self.context.active():
            self.prepare(batch)
            yield

    def generate(
        self,
        prompt_ids: list[list[int]],
        max_new_tokens: int,
        on_step: Callable[[int, float], None] | None = None,
        on_prefill: Callable[[float], None] | None = None,
    ) -> Generation:
        """Greedy decoding: prefill, then `max_new_tokens - 1` timed decode steps. On several
        devices this rank runs its attention-DP group's rows; the result holds every row."""
        if max_new_tokens > self.cfg.scheduler_config.max_new_tokens:
            raise ValueError(f"max_new_tokens {max_new_tokens} exceeds scheduler_config.max_new_tokens")
        all_rows, (first, last) = prompt_ids, self.parallel.local_rows(len(prompt_ids))
        prompt_ids = all_rows[first:last]
        b = len(prompt_ids)
        with self.session(b):
            width = max(len(p) for p in all_rows)
            with self.threads.prefilling():  # on the count decode chose: fewer threads on a busy host
                prefill_threads = torch.get_num_threads()
                pre = self.prefill(prompt_ids, width=width)
            self.check_finite(
                pre.logits,
                "prefill",
                lambda scopes: [
                    self._prefill_rows(prompt_ids, *rows, width, scopes) for rows in self._prefill_groups(prompt_ids)
                ],
            )
            if on_prefill:
                on_prefill(pre.ms)
            token = greedy.next_tokens(pre.logits)  # (B, 1)
            out, step_ms, logits = [token], [], pre.logits
            pos = pre.lengths.view(b, 1).clone()
            step_threads, compile_steps = [], []
            macs = b * self.arch.weight_bytes(1)  # rows x weights a token multiplies (MoE: k experts): tiny -> 1 thread
            decoding = self.threads.decoding((self.step_key, b), max_new_tokens - 1, self.step.compiles, macs)
            with decoding as threads:
                for i in range(max_new_tokens - 1):
                    step_threads.append(threads.threads)
                    waited, t0 = threads.waited_ms(), self.now()
                    logits = self.decode_one(token, pos)
                    step_ms.append((self.now() - t0) * 1e3)
                    if not threads.observe(step_ms[-1], threads.waited_ms() - waited):  # may change the next count
                        compile_steps.append(i)
                    self.check_finite(
                        logits,
                        f"decode step {i + 1}",
                        lambda scopes, token=token, pos=pos: self.model(token, pos, self.cache, scopes),
                    )
                    token = greedy.next_tokens(logits)
                    out.append(token)
                    pos += 1
                    if on_step:
                        on_step(i, step_ms[-1])
        tokens = runtime.gather_rows(torch.cat(out, dim=1).tolist(), self.parallel)
        first, last = (runtime.gather_row_tensor(t, self.parallel) for t in (pre.logits, logits))
        return Generation(all_rows, tokens, pre.ms, step_ms, first, last, step_threads, compile_steps, prefill_threads)

    def check_finite(self, logits: torch.Tensor, step: str, rerun: Callable[[numerics.RegionTracker], object]) -> None:
        """Stop at the first step whose (B, V) logits hold NaN or inf, naming the step and the
        region where it first appeared (found by re-running the step eagerly with `rerun`)."""
        row = numerics.first_bad_row(logits)
        if row is None:
            return
        mc = self.cfg.model_config
        if self.parallel.layout.attn_dp > 1:
            # Only this attention-DP group's rows are bad: re-running the step here alone would
            # issue collectives the other ranks never match.
            where = "not located (attention data parallel: the other ranks do not re-run the step)"
        else:  # every rank holds the same logits, so every rank re-runs the step and its collectives
            where = numerics.locate(rerun)
        first = self.parallel.local_rows(self.cfg.scheduler_config.batch_size)[0]  # this rank's rows in the batch
        weights = f"checkpoint {self.model_path}" if mc.with_ckpt else f"random weights (seed {mc.seed})"
        raise numerics.NonFiniteError(
            f"{numerics.kind_of(logits[row])} in the logits at {step}, row {first + row}: {where}; "
            f"weights: {weights}, dtype {mc.dtype}"
        )

    def encode_prompts(self) -> list[list[int]]:
        """Token ids per row, each cut to its last `input_truncated_len` tokens; a cut is logged
        and kept in `self.truncation` for metrics.json, never silent."""
        limit = self.cfg.data_config.input_truncated_len
        full = [self.tokenizer.encode(p) for p in self.prompts()]
        if any(not e for e in full):
            raise ConfigError("data_config.prompts: a prompt encodes to zero tokens")
        self.truncation = [{"row": i, "given": len(e), "kept": min(len(e), limit)} for i, e in enumerate(full)]
        for t in self.truncation:
            if t["given"] > t["kept"]:
                self.log(
                    f"[run] prompt {t['row']}: {t['given']} tokens, kept the last {t['kept']} "
                    "(data_config.input_truncated_len)"
                )
        return [e[-limit:] for e in full]

    # ------------------------------------------------------------------ the whole run
    def run(self) -> dict:
        sc, mc = self.cfg.scheduler_config, self.cfg.model_config
        prompt_ids = self.encode_prompts()
        self.log(self.memory.describe())
        self.log(
            f"[run] {mc.model_name}: {self.arch.model_type} from {self.arch.source}, "
            f"{'checkpoint' if mc.with_ckpt else 'random'} weights, {self.dtype_name}, "
            f"platform {self.platform.describe()}, "
            f"exe_mode {mc.exe_mode}, superkernel {'plan ' + self.plan.name if mc.superkernel_enabled else 'off'}"
        )
        self.log(f"[run] {self.custom_ops_note}")
        if self.platform.kind == "cpu" and self.dtype_name == "bfloat16" and not cpu_runs_bf16():
            self.log(
                "[run] bfloat16 on a CPU without AVX512-BF16 or AMX: the large projections run AVX2 kernels "
                "of ours (bf16 widened to fp32 in registers); aten's other bf16 matmuls (attention, small "
                "weights) are emulated"
            )
        # Warm-up on the same shapes: compiles the decode step (idempotent: same tokens, same slots).
        t0 = self.now()
        self.generate(prompt_ids, min(2, sc.max_new_tokens))
        warmup_s = self.now() - t0
        self.log(f"[run] warm-up (compile) took {warmup_s:.2f} s")
        if self.parallel.world > 1:
            runtime.steady_state()
        profiler = self._profiler()
        with profiler:
            gen = self.generate(
                prompt_ids,
                sc.max_new_tokens,
                on_step=lambda i, ms: self.log(logs.format_decode(self.name, ms)),
                on_prefill=lambda ms: self.log(logs.format_prefill(self.name, ms)),
            )
        tps = self._summarise_decode(gen)
        texts = [self.tokenizer.decode(self._until_eos(t)) for t in gen.token_ids]
        for prompt, text in zip(self.prompts(), texts):
            self.log(f"[prompt] {prompt!r}\n[output] {text!r}")
        metrics = self._metrics(gen, texts, tps, warmup_s)
        if self.out_dir is not None and self.parallel.rank == 0:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            (self.out_dir / "metrics.json").write_text(json.dumps(metrics, indent=2))
            if mc.enable_profiler:
                profiler.export_chrome_trace(str(self.out_dir / "decode_trace.json"))
            write_scope_report(self.out_dir, metrics["superkernel"])
        return metrics

    def _profiler(self):
        if not self.cfg.model_config.enable_profiler:
            import contextlib

            return contextlib.nullcontext()
        return torch.profiler.profile(activities=profiler_activities(self.platform))

    def _summarise_decode(self, gen: Generation) -> float | None:
        """Log the decode average, the throughput and the run's shape; returns tokens/s. Steps that
        compiled the step for a new thread count (executor/threads.py) are left out of both, as the
        warm-up's compile is: one 20 s recompile among 31 steps of 1 ms read as 1.4 tokens/s."""
        batch, samples = len(gen.token_ids), gen.sample_ms()
        tps = batch * len(samples) / (sum(samples) / 1e3) if samples else None
        if samples:
            self.log(logs.format_average(self.name, logs.decode_average_ms(samples)))
            self.log(logs.format_throughput(self.name, tps))
        if gen.compile_steps:
            self.log(
                f"[run] the average and the throughput leave out decode step(s) "
                f"{', '.join(map(str, gen.compile_steps))}: they compiled the step for a new thread count "
                f"({(sum(gen.decode_ms) - sum(samples)) / 1e3:.1f} s), as the warm-up's compile is left out"
            )
        self.log(logs.format_run_shape(self.name, batch, len(gen.decode_ms)))
        return tps

    def _until_eos(self, tokens: list[int]) -> list[int]:
        eos = self.tokenizer.eos_token_id
        return tokens[: tokens.index(eos)] if eos is not None and eos in tokens else tokens

    def _metrics(self, gen: Generation, texts: list[str], tps: float | None, warmup_s: float) -> dict:
        mc = self.cfg.model_config
        report = self.step.report()
        peak = (
            torch.cuda.max_memory_allocated() / 2**20
            if self.platform.kind == "cuda"
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        )
        measured, measured_by = memory.measured_peak(self.platform.kind)
        ran = bool(report.superkernel_ran) and mc.superkernel_enabled
        samples = gen.sample_ms()
        return {
            "model_name": mc.model_name,
            "recipe": self.recipe,
            "model_type": self.arch.model_type,
            "model_path": self.model_path,  # resolved ("builtin" -> models/<recipe>/builtin); "" = debug_size
            "weights": "checkpoint" if mc.with_ckpt else f"random (seed {mc.seed})",
            "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "platform": self.platform.kind,
            "soc_class": self.platform.soc_class,
            "device_name": self.platform.device_name,
            "platform_reason": self.platform.reason,
            "versions": software_versions(),
            "torch_version": torch.__version__,
            "threads": torch.get_num_threads(),
            # fewer threads while the host is shared
            "thread_governor": self.threads.to_metrics(gen.decode_threads, gen.prefill_threads),
            "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "libgomp default"),  # see executor/__init__.py
            "omp_reason": os.environ.get("CANN_RECIPES_OMP_REASON", "set outside this project"),
            "thp_alloc": f"THP_MEM_ALLOC_ENABLE={os.environ.get('THP_MEM_ALLOC_ENABLE', '0')}, kernel: {thp_mode()}",
            "weights_on_huge_pages": self.placement.to_metrics(),  # executor/huge_pages.py
            "kv_cache_on_huge_pages": self.cache.placement() if self.cache else "no cache",
            "malloc": MALLOC_POLICY,  # freed memory kept for reuse: see executor/__init__.py
            "exe_mode": mc.exe_mode,
            "backend": report.backend,
            "dtype": self.dtype_name,  # resolved (config may say auto)
            "ops": ops.implementations(self.context.op_table),
            "custom_ops": {"chosen": list(mc.custom_ops), "why": self.custom_ops_note},
            "superkernel": {
                "requested": mc.superkernel_enabled,
                "ran": ran,
                "plan": self.plan.name,
                "options": mc.superkernel.options,
                "scopes": report.scopes,
            },
            "regions": [r.name for r in self.model.regions()],
            "compile": report.compile_info() | {"warmup_s": round(warmup_s, 3)},
            "batch_size": len(gen.token_ids),
            "decode_steps": len(gen.decode_ms),
            "prefill_ms": gen.prefill_ms,
            **self.prefill_kernels.to_metrics(),
            "decode_ms": gen.decode_ms,
            "decode_compile_steps": gen.compile_steps,  # 0-based indices into decode_ms, left out of the stats
            "decode_ms_median": statistics.median(samples) if samples else None,
            "decode_ms_average": logs.decode_average_ms(samples) if samples else None,
            "tokens_per_s": tps,
            "peak_memory_mb": round(peak, 1),
            "memory": self.memory.to_metrics(measured, measured_by),  # estimate (checked before allocating) vs peak
            **self._parallel_metrics(peak),
            "prompt_token_ids": gen.prompt_ids,
            "prompt_truncation": self.truncation,  # tokens given / kept per row (data_config.input_truncated_len)
            "generated_token_ids": gen.token_ids,
            "text": texts,
            "config": to_dict(self.cfg),
        }

    def _parallel_metrics(self, peak_mb: float) -> dict:
        """world_size, the layout, the collectives of one decode step, every rank's peak memory and
        intra-op threads (on CPU the launcher gives each rank its share of the cores)."""
        p = self.parallel
        every = runtime.gather_objects((round(peak_mb, 1), torch.get_num_threads()), p)
        return {
            "world_size": p.world,
            "parallel": p.layout.describe() | {"backend": p.backend or None},
            "collectives_per_step": self.collectives,
            "peak_memory_mb_per_rank": [peak for peak, _ in every],
            "threads_per_rank": [threads for _, threads in every],
        }


def write_scope_report(out_dir: Path, sk: dict) -> None:
    """Per-scope report (label, options, ops, segments, why cut) next to metrics.json."""
    lines = [
        f"# SuperKernel scopes: plan {sk['plan']}, requested {sk['requested']}, ran {sk['ran']}",
        "",
        "| label | options | ops | segments | launches | unfused | collectives | cut reasons |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for s in sk["scopes"]:
        lines.append(
            f"| {s['label']} | {s.get('options') or '-'} | {s.get('ops', '-')} | {s.get('segments', '-')} | "
            f"{s.get('launches', '-')} | {s.get('unfused', '-')} | {s.get('collectives', '-')} | "
            f"{'; '.join(s.get('cut_reasons', [])) or '-'} |"
        )
    (out_dir / "superkernel_scopes.md").write_text("\n".join(lines) + "\n")


def default_out_dir(cfg: RunConfig, recipe: str) -> Path:
    mc = cfg.model_config
    return results_dir(recipe, f"{mc.exe_mode}_{'sk-' + mc.superkernel.plan if mc.superkernel_enabled else 'nosk'}")
