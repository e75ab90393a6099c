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
from executor.config import RunConfig
from executor.runner import DTYPES, ModelRunner

LOGITS = "logits"  # the region name of the final logits


@dataclass(frozen=True)
class Gate:
    cosine_min: float = 0.99  # every region's minimum cosine must be above this
    ppl_rel_max: float = 0.10  # |candidate ppl / reference ppl - 1| must be below this


def reference_config(cfg: RunConfig) -> RunConfig:
    """The configured run made the reference: eager, float32, no SuperKernel, no compile cache."""
    mc = dataclasses.replace(
        cfg.model_config,
        exe_mode="eager",
        dtype="float32",
        enable_superkernel=False,
        custom_params=dataclasses.replace(cfg.model_config.custom_params, enable_superkernel=None),
        enable_cache_compile=False,
        enable_static_kernel=False,
        enable_profiler=False,
    )
    return dataclasses.replace(cfg, model_config=mc)


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


def install_decode_taps(ref: ModelRunner, cand: ModelRunner, batch: int) -> None:
    """Observe both sides' decode steps for the whole evaluation. Installed before the
    candidate's step compiles and never removed, so the step compiles once (with the copies)."""
    layers = [f"layer_{i}" for i in range(len(cand.model.layers))]
    cand.decode_scopes.observer = _Buffers(layers, (batch, 1, cand.arch.hidden_size), cand.dtype, cand.device)
    ref.decode_scopes.observer = _Copies()


def compare_regions(
    ref: ModelRunner, cand: ModelRunner, prompt_ids: list[list[int]], steps: int, progress: Callable[[str], None]
) -> RegionCosines:
    """Per-region cosines over prefill and `steps` decode steps, both sides fed the reference's
    greedy tokens (so one early flip of a near-tie cannot make every later step incomparable).
    The decode taps must be installed (install_decode_taps)."""
    b, layers = len(prompt_ids), [f"layer_{i}" for i in range(len(cand.model.layers))]
    out = RegionCosines()
    lengths = torch.tensor([len(p) for p in prompt_ids])
    valid = torch.arange(int(lengths.max())).view(1, -1) < lengths.view(-1, 1)  # (B, S) real prompt tokens
    prefill = {}
    for side, runner in (("ref", ref), ("cand", cand)):
        taps = _Copies()
        runner.prefill_scopes.observer = taps
        try:
            with runner.session(b):
                pre = runner.prefill(prompt_ids)
        finally:
            runner.prefill_scopes.observer = None
        prefill[side] = (pre, taps.values)
    for name in layers:
        r, c = prefill["ref"][1][name], prefill["cand"][1][name]
        out.add("prefill", name, _cosine(r[valid], c[valid]))
    out.add("prefill", LOGITS, _cosine(prefill["ref"][0].logits, prefill["cand"][0].logits))
    progress(f"prefill compared: worst {min(out.prefill.values()):.6f}")

    token = prefill["ref"][0].logits.argmax(-1, keepdim=True)
    pos = lengths.view(b, 1).to(cand.device)
    for step in range(steps):
        with ref.session(b):
            ref_logits = ref.decode_one(token, pos)
        with cand.session(b):
            cand_logits = cand.decode_one(token, pos)
        ref_values, cand_values = ref.decode_scopes.observer.values, cand.decode_scopes.observer.values
        for name in layers:
            out.add("decode", name, _cosine(ref_values[name], cand_values[name]))
        out.add("decode", LOGITS, _cosine(ref_logits, cand_logits))
        token, pos = ref_logits.argmax(-1, keepdim=True), pos + 1
        if (step + 1) % 8 == 0 or step + 1 == steps:
            progress(f"decode step {step + 1}/{steps} compared: worst so far {min(out.decode.values()):.6f}")
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
    from executor.parallel import runtime

    every = runtime.gather_objects((local.nll, local.tokens), p)
    return Perplexity(sum(every[r][0] for r in p.dp_leaders), sum(every[r][1] for r in p.dp_leaders))


def perplexity_prefill(runner: ModelRunner, wins: list[list[int]], batch: int) -> Perplexity:
    """Teacher-forced perplexity of whole windows through the prefill path (eager, no scopes)."""
    result = Perplexity()
    for rows, real in _groups(wins, batch):
        ids = torch.tensor(rows, device=runner.device)  # (B, L)
        positions = torch.arange(ids.shape[1], device=runner.device).expand_as(ids)
        with runner.session(batch):
            hidden = runner.model(ids, positions, runner.cache, runner.prefill_scopes)
            logits = runner.model.logits(hidden)  # (B, L, V)
        result.add(logits[:real, :-1].reshape(-1, logits.shape[-1]), ids[:real, 1:].reshape(-1))
    return result


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


def relative_difference(cand: float, ref: float) -> float:
    return cand / ref - 1.0 if ref and math.isfinite(ref) and math.isfinite(cand) else float("inf")
