"""One analysis of a recipe's runner: prefill and decode measured, the decode graph mapped, findings.

The runner is built from the user's config as a run would build it (same op table, custom ops
included); its decode step is run eagerly with the model's regions as profiler ranges (the
scope plan does not matter here: regions are what is timed), at the position its prompts reach.
Decode steps repeat the same position (a step rewrites its own cache slot), so every profiled
step does the same work.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable

import torch

from executor.analysis import findings, mapping, roofline
from executor.analysis.trace import MODULE_REGIONS, OTHER, OpRecorder, RegionMarker, module_regions, profile_times
from executor.scope import NO_PLAN, ScopeRunner


def _prefill(runner, marker, prompt_ids: list[list[int]]) -> torch.Tensor:
    """The runner's prefill (right-padded rows, every row's last real token), with `marker` as scopes."""
    lengths = torch.tensor([len(p) for p in prompt_ids])
    ids = torch.zeros(len(prompt_ids), int(lengths.max()), dtype=torch.long)
    for i, p in enumerate(prompt_ids):
        ids[i, : len(p)] = torch.tensor(p)
    positions = torch.arange(ids.shape[1]).expand_as(ids)
    hidden = runner.model(ids, positions, runner.cache, marker)
    return runner.model.logits(hidden[torch.arange(len(prompt_ids)), lengths - 1])


def _decode(runner, scopes) -> Callable:
    def step(ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return runner.model.logits(runner.model(ids, positions, runner.cache, scopes)[:, -1])

    return step


def analyze(runner, steps: int = 5, ge: bool = True, log: Callable[[str], None] = print) -> dict:
    """Everything the report shows, as plain data. `ge`: ask torchair about GE converters (subprocess)."""
    mc = runner.cfg.model_config
    prompt_ids = runner.encode_prompts()
    batch = len(prompt_ids)
    regions = {r.name for r in runner.model.regions()} | set(MODULE_REGIONS.values())
    marker = RegionMarker()
    with torch.no_grad(), runner.context.active(), module_regions(runner.model, marker):
        runner.prepare(batch)
        log(f"[analyze] prefill of {batch} row(s), {max(map(len, prompt_ids))} tokens: profiling")
        logits = _prefill(runner, marker, prompt_ids)
        prefill_times = profile_times(lambda: _prefill(runner, marker, prompt_ids), 2, regions)
        with OpRecorder(marker) as rec:
            _prefill(runner, marker, prompt_ids)
        prefill_calls = rec.calls
        ids = logits.argmax(-1, keepdim=True)
        positions = torch.tensor([[len(p)] for p in prompt_ids])
        decode = _decode(runner, marker)
        decode(ids, positions)  # warm-up
        log(f"[analyze] decode at position {positions.max().item()} of {runner.max_len} cache slots: {steps} steps")
        decode_times = profile_times(lambda: decode(ids, positions), steps, regions)
        with OpRecorder(marker) as rec:
            decode(ids, positions)
        decode_calls = rec.calls
    with torch.no_grad(), runner.context.active():  # no profiler ranges: the graph as graph mode sees it
        log("[analyze] capturing the decode graph (dynamo + AOT, the run's op table)")
        cap = mapping.capture(_decode(runner, ScopeRunner(NO_PLAN)), (ids, positions))
    status, converter_note = None, "not run (--no-ge)"
    if ge:
        log("[analyze] asking torchair (torch-npu wheel, subprocess) for GE converters")
        status, converter_note = mapping.converter_status(mapping.converter_targets(cap.nodes), mc.custom_ops)
        if status is None:
            converter_note = f"not run: {converter_note}"
            log(f"[analyze] GE converter check {converter_note}")
    log("[analyze] measuring this machine's read bandwidth and matmul rate")
    machine = roofline.measure(runner.dtype)
    run = {
        "dtype": runner.dtype_name,
        "exe_mode": mc.exe_mode,
        "superkernel": mc.superkernel_enabled,
        "plan": runner.plan.name,
        "custom_ops": list(mc.custom_ops),
        "valid_slots": round(statistics.mean(len(p) + 1 for p in prompt_ids), 1),
        "max_len": runner.max_len,
    }
    found = findings.opportunities(cap, status, decode_calls, decode_times, machine, run)
    step_ms = sum(t.ms for t in decode_times)
    comm = mapping.communication_ops(cap.nodes)
    return {
        "recipe": runner.recipe,
        "model_type": runner.arch.model_type,
        "layers": runner.arch.num_layers,
        "platform": runner.platform.describe(),
        "platform_kind": runner.platform.kind,
        "threads": torch.get_num_threads(),  # intra-op threads the timings were taken with
        "batch_size": batch,
        "run": run,
        "ops_table": runner.context.op_table,
        "machine": dataclasses.asdict(machine) | {"balance_flop_per_byte": round(machine.balance, 2)},
        "decode": {
            "steps_profiled": steps,
            "step_ms": step_ms,
            "regions": findings.region_table(decode_times),
            "op_types": findings.op_table(decode_times, decode_calls, machine),
        },
        "prefill": {
            "tokens": sum(map(len, prompt_ids)),
            "step_ms": sum(t.ms for t in prefill_times),
            "regions": findings.region_table(prefill_times),
            "op_types": findings.op_table(prefill_times, prefill_calls, machine),
        },
        "graph": {
            "graphs": cap.graphs,
            "nodes": len(cap.nodes),
            "breaks": cap.breaks,
            "converters": converter_note,
            "mapping": findings.mapping_table(cap.nodes, status),
            "communication_ops_per_step": len(comm),
            "communication": sorted({n.target for n in comm}),
        },
        "opportunities": [o.as_dict(step_ms) for o in found],
        "other_region": OTHER,
    }
