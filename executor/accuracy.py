"""Accuracy of a configured run against a reference run of the same checkpoint.

The Ascend fused-operator workflow accepts a speed-up only with an accuracy check: output cosine
similarity > 0.99 against the reference, perplexity difference < 10%, and proof that no operator
silently fell back to another path. Here the reference is the same recipe and checkpoint run
eagerly, in float32, with the reference op table; the candidate is the configured run (any
exe_mode, SuperKernel plan, dtype, op table). What is compared:

- per region: the hidden state every `layer_{i}` hands on (the models `tap` their layer outputs,
  a no-op outside this tool), at every prompt token in prefill and at every decode step, the
  decode steps running through the candidate's compiled step with both sides fed the same
  (reference greedy) tokens; and the final logits. The minimum cosine names the worst region.
- perplexity on an evaluation text, through the DECODE path (one token at a time through the
  compiled step, so what SuperKernel scopes compute is what is measured) and through prefill
  (whole windows at once), on both sides, in windows as long as the static KV cache;
- greedy-token agreement over the configured number of new tokens;
- an audit: the op implementation each executor.ops op resolved to (a table lacking an op falls
  back to the reference: FAIL), every requested SuperKernel scope ran as asked (never opened,
  unfused, or cut: FAIL), the dtype that really ran.

Each side is measured alone (`measure_side`), so a multi-rank candidate runs the same code on
every rank (tools/rank_generate.py) while the reference stays one device; every value the
report compares is the whole batch's (the ranks' rows gathered).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from executor import ops
from executor.backends.base import EagerBackend
from executor.config import ParallelConfig, RunConfig
from executor.parallel import runtime
from executor.runner import DTYPES, ModelRunner

LOGITS = "logits"  # the region name of the final logits


@dataclass(frozen=True)
class Gate:
    cosine_min: float = 0.99  # every region's minimum cosine must be above this
    ppl_rel_max: float = 0.10  # |candidate ppl / reference ppl - 1| must be below this


def reference_config(cfg: RunConfig) -> RunConfig:
    """The configured run made the reference: eager, float32, no SuperKernel, no custom ops, no
    compile cache, one device (every parallel layout computes the same model, so one reference serves them all)."""
    mc = dataclasses.replace(
        cfg.model_config,
        exe_mode="eager",
        dtype="float32",
        enable_superkernel=False,
        custom_params=dataclasses.replace(cfg.model_config.custom_params, enable_superkernel=None),
        enable_cache_compile=False,
        enable_static_kernel=False,
        enable_profiler=False,
        custom_ops=(),  # its table is the reference (use_reference_ops): nothing to choose or build
    )
    return dataclasses.replace(cfg, model_config=mc, parallel_config=ParallelConfig())


class _Copies:
    """Region observer for eager code: keeps float32 copies of each region's output."""

    def __init__(self):
        self.values: dict[str, torch.Tensor] = {}

    def __call__(self, name: str, value: torch.Tensor) -> None:
        self.values[name] = value.detach().float().clone()


class _Buffers:
    """Region observer that also works inside a compiled decode step: each region's output is
    copied into a fixed buffer (an input mutation, like the KV cache write), read after the step."""

    def __init__(self, names: list[str], shape: tuple[int, ...], dtype: torch.dtype, device: torch.device):
        self.buffers = {n: torch.zeros(shape, dtype=dtype, device=device) for n in names}

    def __call__(self, name: str, value: torch.Tensor) -> None:
        self.buffers[name].copy_(value)

    @property
    def values(self) -> dict[str, torch.Tensor]:
        return {n: b.float().clone() for n, b in self.buffers.items()}


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    """Minimum row cosine of (..., H) tensors; NaN/inf anywhere counts as -1 (a failure)."""
    a, b = a.reshape(-1, a.shape[-1]).float(), b.reshape(-1, b.shape[-1]).float()
    if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
        return -1.0
    return float(F.cosine_similarity(a, b, dim=-1).min())


@dataclass
class RegionCosines:
    """Minimum cosine per region, separately for prefill and decode."""

    prefill: dict[str, float] = field(default_factory=dict)
    decode: dict[str, float] = field(default_factory=dict)

    def add(self, phase: str, name: str, value: float) -> None:
        table = getattr(self, phase)
        table[name] = min(table.get(name, 1.0), value)

    def first_below(self, limit: float) -> str | None:
        """The first region, in execution order (prefill, then decode), whose cosine is not above
        `limit`: where an error starts, while the worst region is often where it has grown most."""
        for phase in ("prefill", "decode"):
            for name, value in getattr(self, phase).items():
                if not value > limit:
                    return f"{phase}:{name}"
        return None

    def worst(self) -> tuple[str, float]:
        """(region, cosine) of the lowest cosine, phase in the name, e.g. ("decode:layer_3", 0.98)."""
        every = {f"{p}:{n}": c for p in ("prefill", "decode") for n, c in getattr(self, p).items()}
        name = min(every, key=every.get)
        return name, every[name]


def tap_decode(runner: ModelRunner) -> None:
    """Observe every decode step of `runner` for the whole evaluation. Installed before its step
    compiles and never removed, so the step compiles once (with the copies)."""
    if runner.step is not None:
        raise RuntimeError("tap_decode: the decode step is already compiled; a tap added now would never run")
    b = runner.cfg.scheduler_config.batch_size // runner.parallel.layout.attn_dp  # this rank's rows
    layers = [f"layer_{i}" for i in range(len(runner.model.layers))]
    runner.decode_scopes.observer = _Buffers(layers, (b, 1, runner.arch.hidden_size), runner.dtype, runner.device)


@dataclass
class Recording:
    """What one side computed region by region, for the whole batch, in float32.

    prefill: region -> (B, S, H) at every (right-padded) prompt position, and LOGITS -> (B, V);
    decode: per step, region -> (B, 1, H) and LOGITS -> (B, V); fed: per decode step, the (B,)
    tokens fed in; lengths: the prompt lengths (which prefill positions are real)."""

    prefill: dict[str, torch.Tensor]
    decode: list[dict[str, torch.Tensor]]
    fed: list[list[int]]
    lengths: list[int]


def record(
    runner: ModelRunner,
    prompt_ids: list[list[int]],
    steps: int,
    feed: list[list[int]] | None,
    progress: Callable[[str], None],
) -> Recording:
    """Prefill `prompt_ids`, then `steps` decode steps fed `feed` (None: this side's own greedy
    tokens, what the reference does, so the candidate can be fed the same ones and one early flip
    of a near-tie cannot make every later step incomparable). The decode tap must be installed.

    On several devices every rank calls this: each attention-DP group runs its rows (padded to the
    batch's longest prompt, so the groups' collectives have the same shapes), and every region's
    rows are gathered from the first rank of each group. Those are whole layer outputs: under
    tensor parallelism a layer's output is complete (after its all-reduce) on every rank."""
    first, last = runner.parallel.local_rows(len(prompt_ids))
    b, p = last - first, runner.parallel

    def whole(values: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {n: runtime.gather_row_tensor(v.float().cpu(), p) for n, v in values.items()}

    taps = _Copies()
    runner.prefill_scopes.observer = taps
    try:
        with runner.session(b):
            pre = runner.prefill(prompt_ids[first:last], width=max(len(r) for r in prompt_ids))
    finally:
        runner.prefill_scopes.observer = None
    out = Recording(whole(taps.values | {LOGITS: pre.logits}), [], [], [len(r) for r in prompt_ids])
    progress(f"prefill recorded: {len(taps.values)} regions, {len(prompt_ids)} rows")
    token = out.prefill[LOGITS].argmax(-1)  # (B,) the whole batch's next tokens
    pos = pre.lengths.view(b, 1)
    for step in range(steps):
        fed = torch.tensor(feed[step]) if feed is not None else token
        out.fed.append(fed.tolist())
        with runner.session(b):
            logits = runner.decode_one(fed[first:last].view(b, 1).to(runner.device), pos + step)
        out.decode.append(whole(runner.decode_scopes.observer.values | {LOGITS: logits}))
        token = out.decode[-1][LOGITS].argmax(-1)
        if (step + 1) % 8 == 0 or step + 1 == steps:
            progress(f"decode step {step + 1}/{steps} recorded")
    return out


def compare(ref: Recording, cand: Recording) -> RegionCosines:
    """Per-region minimum cosines of two recordings of the same inputs (prefill: real prompt
    positions only; every row of the batch)."""
    out = RegionCosines()
    lengths = torch.tensor(ref.lengths)
    for name, r in ref.prefill.items():
        if name != LOGITS:
            valid = torch.arange(r.shape[1]).view(1, -1) < lengths.view(-1, 1)  # (B, S) real prompt tokens
            r, c = r[valid], cand.prefill[name][valid]
        else:
            c = cand.prefill[name]
        out.add("prefill", name, _cosine(r, c))
    for r_step, c_step in zip(ref.decode, cand.decode):
        for name, r in r_step.items():
            out.add("decode", name, _cosine(r, c_step[name]))
    return out


def windows(token_ids: list[int], length: int) -> list[list[int]]:
    """Consecutive windows of `length` tokens (the last one shorter); a window of one token
    predicts nothing and is dropped."""
    return [w for w in (token_ids[i : i + length] for i in range(0, len(token_ids), length)) if len(w) >= 2]


def _groups(wins: list[list[int]], batch: int) -> list[tuple[list[list[int]], int]]:
    """Batches of `batch` equal-length windows for the fixed-shape step; short groups are padded
    with copies whose loss is not counted. Returns (rows, real row count) per group."""
    by_len: dict[int, list[list[int]]] = {}
    for w in wins:
        by_len.setdefault(len(w), []).append(w)
    groups = []
    for same in by_len.values():
        for i in range(0, len(same), batch):
            rows = same[i : i + batch]
            groups.append((rows + [rows[0]] * (batch - len(rows)), len(rows)))
    return groups


@dataclass
class Perplexity:
    nll: float = 0.0  # summed negative log likelihood (nats)
    tokens: int = 0  # predicted tokens

    @property
    def ppl(self) -> float:
        return math.exp(self.nll / self.tokens) if self.tokens else float("nan")

    def add(self, logits: torch.Tensor, targets: torch.Tensor) -> None:
        """logits (N, V), targets (N,)."""
        self.nll += float(F.cross_entropy(logits.float(), targets, reduction="sum"))
        self.tokens += targets.numel()


def perplexity_decode(runner: ModelRunner, wins: list[list[int]], batch: int) -> Perplexity:
    """Teacher-forced perplexity one token at a time through the (compiled) decode step: a
    window's first token is prefilled, each later token goes through `decode_one`.

    On several devices every rank calls this: each attention data parallel group runs its share
    of each group of rows (as generate() does), and the groups' sums are added up on every rank."""
    result = Perplexity()
    first, last = runner.parallel.local_rows(batch)  # this rank's rows of every group
    b = last - first
    for rows, real in _groups(wins, batch):
        ids = torch.tensor(rows[first:last], device=runner.device)  # (b, L)
        mine = max(0, min(real, last) - first)  # real (counted) rows among this rank's
        with runner.session(b):
            logits = runner.prefill([r[:1] for r in rows[first:last]]).logits  # predicts token 1
            for t in range(1, ids.shape[1]):
                result.add(logits[:mine], ids[:mine, t])
                if t + 1 < ids.shape[1]:
                    logits = runner.decode_one(ids[:, t : t + 1], torch.full((b, 1), t, device=runner.device))
    return _sum_over_row_groups(result, runner)


def _sum_over_row_groups(local: Perplexity, runner: ModelRunner) -> Perplexity:
    """Add up the attention-DP groups' sums (one rank per group); one group: `local` itself."""
    p = runner.parallel
    if p.layout.attn_dp == 1:
        return local
    every = runtime.gather_objects((local.nll, local.tokens), p)
    return Perplexity(sum(every[r][0] for r in p.dp_leaders), sum(every[r][1] for r in p.dp_leaders))


def perplexity_prefill(runner: ModelRunner, wins: list[list[int]], batch: int) -> Perplexity:
    """Teacher-forced perplexity of whole windows through the prefill path (eager, no scopes);
    on several devices, each attention-DP group its rows, as perplexity_decode."""
    result = Perplexity()
    first, last = runner.parallel.local_rows(batch)
    for rows, real in _groups(wins, batch):
        ids = torch.tensor(rows[first:last], device=runner.device)  # (b, L)
        mine = max(0, min(real, last) - first)
        positions = torch.arange(ids.shape[1], device=runner.device).expand_as(ids)
        with runner.session(last - first):
            hidden = runner.model(ids, positions, runner.cache, runner.prefill_scopes)
            logits = runner.model.logits(hidden)  # (b, L, V)
        result.add(logits[:mine, :-1].reshape(-1, logits.shape[-1]), ids[:mine, 1:].reshape(-1))
    return _sum_over_row_groups(result, runner)


def greedy_agreement(ref_tokens: list[list[int]], cand_tokens: list[list[int]]) -> dict:
    """Tokens that agree, and the first step where a row's greedy tokens part."""
    agree = sum(a == b for r, c in zip(ref_tokens, cand_tokens) for a, b in zip(r, c))
    total = sum(len(r) for r in ref_tokens)
    firsts = [next((i for i, (a, b) in enumerate(zip(r, c)) if a != b), None) for r, c in zip(ref_tokens, cand_tokens)]
    mismatches = [f for f in firsts if f is not None]
    return {"tokens": total, "agree": agree, "first_mismatch": min(mismatches) if mismatches else None}


def audit(cand: ModelRunner, active_table: str) -> list[dict]:
    """What really ran: op implementations, requested scopes, dtype. Each item PASS or FAIL."""
    items = []
    table = cand.context.op_table
    items.append(
        {
            "check": "op table active during the run",
            "status": "PASS" if active_table == table else "FAIL",
            "detail": f"requested {table!r}, active {active_table!r}",
        }
    )
    impls, sources = ops.implementations(table), ops.provenance(table)
    for op in ops.OP_NAMES:
        fallback = sources[op] == "fallback"
        how = f"fell back to the reference: table {table!r} lacks it" if fallback else sources[op]
        items.append({"check": f"op {op}", "status": "FAIL" if fallback else "PASS", "detail": f"{impls[op]} ({how})"})
    report = cand.step.report() if cand.step is not None else None
    seen = {s["label"]: s for s in (report.scopes if report else [])}
    for label in cand.plan.labels:
        s = seen.get(label)
        if s is None:
            status, detail = "FAIL", "requested but never opened"
        elif s.get("unfused"):
            status, detail = "FAIL", "ran unfused (strict-scope-check=bypass)"
        elif s.get("segments", 1) > 1:
            status, detail = (
                "FAIL",
                "cut: " + "; ".join(s.get("cut_reasons", [])) + " (those ops ran outside the scope)",
            )
        elif s.get("launches", s.get("traced", 1)) == 0:
            status, detail = "FAIL", "compiled but never launched"
        else:
            status, detail = (
                "PASS",
                ", ".join(f"{k} {v}" for k, v in s.items() if k in ("ops", "segments", "launches", "traced")),
            )
        items.append({"check": f"scope {label}", "status": status, "detail": detail})
    dtype = next(cand.model.parameters()).dtype
    want = DTYPES[cand.dtype_name]  # the resolved dtype (the config may say auto)
    items.append(
        {"check": "dtype", "status": "PASS" if dtype == want else "FAIL", "detail": f"requested {want}, ran {dtype}"}
    )
    return items


def use_reference_ops(runner: ModelRunner) -> None:
    """The reference runs eagerly with the reference op table, whatever the platform."""
    runner.use_backend(EagerBackend("reference"))


def use_op_table(runner: ModelRunner, table: str) -> None:
    """Run the candidate with op table `table` (tools/accuracy.py --ops) instead of its backend's."""
    runner.backend.op_table = table
    runner.use_backend(runner.backend)


@dataclass
class SideInputs:
    """What both sides are given (plain data: it travels to the ranks as JSON)."""

    prompt_ids: list[list[int]]  # the batch
    steps: int  # decode steps recorded region by region
    windows: list[list[int]]  # evaluation-text windows for both perplexities
    new_tokens: int  # greedy tokens compared
    feed: list[list[int]] | None = None  # tokens fed to the recorded decode steps (None: own greedy)


def measure_side(runner: ModelRunner, inputs: SideInputs, progress: Callable[[str], None]) -> dict:
    """Everything one side contributes to the report, whole-batch values only (plain data, so a
    rank can save it for the tool's process): the region recording (see record), both
    perplexities, the greedy tokens and the audit. On several devices every rank calls this (the
    steps hold collectives); the audit is every rank's, merged."""
    batch, wins = runner.cfg.scheduler_config.batch_size, inputs.windows
    tap_decode(runner)
    rec = record(runner, inputs.prompt_ids, inputs.steps, inputs.feed, progress)
    with runner.session(batch // runner.parallel.layout.attn_dp):
        active = ops.active()
    progress(f"perplexity on {sum(map(len, wins))} tokens in {len(wins)} window(s) ...")
    decode, prefill = perplexity_decode(runner, wins, batch), perplexity_prefill(runner, wins, batch)
    progress(f"PPL {decode.ppl:.4f} through decode, {prefill.ppl:.4f} through prefill")
    greedy = runner.generate(inputs.prompt_ids, inputs.new_tokens).token_ids
    return {
        "recording": dataclasses.asdict(rec),
        "ppl": decode.ppl,
        "ppl_prefill": prefill.ppl,
        "tokens": decode.tokens,
        "greedy_tokens": greedy,
        "audit": _merge_ranks(audit(runner, active), runner),
        "ran": {"exe_mode": runner.cfg.model_config.exe_mode, "dtype": runner.dtype_name, "plan": runner.plan.name}
        | {"op_table": runner.context.op_table, "backend": runner.backend.name},
    }


def _merge_ranks(items: list[dict], runner: ModelRunner) -> list[dict]:
    """Every rank's audit as one: an item fails if it fails on any rank (the first such rank named)."""
    every = runtime.gather_objects(items, runner.parallel)
    merged = []
    for i, item in enumerate(items):
        bad = [(r, mine[i]) for r, mine in enumerate(every) if mine[i]["status"] != "PASS"]
        if len(every) > 1 and bad:
            item = bad[0][1] | {"detail": f"rank {bad[0][0]}: {bad[0][1]['detail']}"}
        merged.append(item)
    return merged


def relative_difference(cand: float, ref: float) -> float:
    return cand / ref - 1.0 if ref and math.isfinite(ref) and math.isfinite(cand) else float("inf")
