"""ge_check: convert a recipe's decode graph with torchair's real FX-to-GE converter, on CPU.

    python tools/ge_check.py --model qwen --plan attention          # or: cann-recipes-infer ge-check ...
    python tools/ge_check.py --model qwen3_moe --plan moe --plan layer --set scheduler_config.batch_size=8
    python tools/ge_check.py --model qwen --config my.yaml --json ge_check.json

A CPU conversion check, not an NPU run. For each plan it builds the recipe's model from the
config (+ --set; exe_mode ge_graph, dtype as an NPU run resolves it, random weights are enough),
installs the NPU op table and SuperKernel scopes exactly as an NPU run does (the adapter's own
TorchairGEBackend and CompilerConfig), and calls the decode step once: torchair (from the
torch-npu wheel, executor/backends/ge_offline.py) converts the FX graph into a GE graph and dumps
it; the stand-in for GE's C++ runtime stops there. Printed per plan: the GE ops per SuperKernel
scope, FX ops without a GE converter, and the checks (fused ops became their GE ops, every op of
a scope carries exactly its `_super_kernel_scope` label and options, nothing outside does).
What only an NPU can verify: GE compilation, kernel support per chip, timing.

Exit codes: 0 every plan converts and passes, 1 a check failed, 2 bad input or no torch-npu wheel.
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import json
import sys
import tempfile
from collections import Counter
from collections.abc import Callable, Iterable
from pathlib import Path

if __package__ in (None, ""):  # `python tools/ge_check.py`: make the repo importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from executor.backends import ge_offline
from executor.backends.ge_dump import GeGraph
from executor.compile import resolve_dtype
from executor.config import PLANS, RunConfig, load_config
from executor.errors import RecipeError, run_command
from executor.platform import Platform
from executor.registry import config_path, recipe_parser, runner_class

NOT_AN_NPU_RUN = (
    "CPU conversion check (torchair's FX-to-GE converter from the torch-npu {version} wheel, SoC {soc}): "
    "the decode graph is converted to GE, not compiled or run on an NPU"
)
ONLY_ON_NPU = (
    "verified here: conversion, op mapping, scope attributes; "
    "only an NPU verifies GE compilation, kernel support per chip, timing"
)
# Known and accepted for now (performance, not correctness); see README "What is verified where".
KNOWN = {
    "ScatterElements": "the KV-cache write (executor/kv_cache.py, Tensor.scatter_) becomes ScatterElements over the "
    "whole (B, Hkv, T, D) cache; upstream recipes use an in-place scatter_update_",
    "FusedInferAttentionScore": "attention attends over all T static cache slots with a mask "
    "(no actual_seq_lengths_kv): correct, extra work per step; model_config.custom_ops: [decode_attention] "
    "reads only the valid slots",
}
# The GE op each executor.ops op becomes on A2/A3 (torchair's converters; tests/data/ascend_facts/fused_ops.yaml).
GE_OP = {
    "rms_norm": "RmsNorm",
    "add_rms_norm": "AddRmsNorm",
    "swiglu": "SwiGlu",
    "rotary_mul": "RotaryMul",
    "attention": "FusedInferAttentionScore",
    "moe_gating_top_k_softmax": "MoeGatingTopKSoftmax",
    "moe_init_routing": "MoeInitRouting",
    "grouped_matmul": "GroupedMatmul",
}
# The fused ops the models call inside each region kind in decode (models/qwen, models/qwen3_moe).
REGION_OPS = {
    "attention": ("rms_norm", "rotary_mul", "attention"),
    "mlp": ("add_rms_norm", "swiglu"),
    "moe": ("add_rms_norm", "moe_gating_top_k_softmax", "swiglu"),
}


class GeCheckError(RecipeError):
    """The GE check cannot run (no wheel, torchair cannot be set up); one line."""


def parser() -> argparse.ArgumentParser:
    p = recipe_parser(
        "python tools/ge_check.py",
        "Convert a recipe's decode graph to GE with torchair's real converter on CPU (no NPU) and list "
        "the GE ops per SuperKernel scope; a conversion check, not an NPU run.",
        "examples:\n  python tools/ge_check.py --model qwen --plan attention --plan decoder\n"
        "  cann-recipes-infer ge-check --model qwen3_moe --plan moe --json ge_check.json\n"
        "exit codes: 0 all plans pass, 1 a check failed, 2 bad input or no torch-npu wheel",
        config_help="a recipe YAML anywhere, instead of --yaml; exe_mode is set to ge_graph",
    )
    p.add_argument(
        "--plan",
        action="append",
        choices=("none", *PLANS),
        help="SuperKernel plan to convert (repeatable; default: the config's own; 'none' = no scopes)",
    )
    p.add_argument("--json", metavar="PATH", help="also write the report (GE ops per plan and scope) as JSON")
    p.add_argument("--soc", default=ge_offline.DEFAULT_SOC, help="SoC the converters target (default: %(default)s)")
    p.add_argument("--dump-dir", help="where torchair writes the pbtxt graphs (default: a temporary directory)")
    p.add_argument("--probe", action="store_true", help="also convert one graph calling every op of the NPU table")
    return p


# --------------------------------------------------------------------------- checks (pure: parsed GE graph in)
def expected_ge_ops(kind: str, ffn_kinds: Iterable[str]) -> set[str]:
    """The GE ops a scope over a region of `kind` must contain (layer/decoder: attention + the FFNs)."""
    kinds = ("attention", *ffn_kinds) if kind in ("layer", "decoder") else (kind,)
    return {GE_OP[op] for k in kinds for op in REGION_OPS[k]}


def check(graph: GeGraph, scopes: dict[str, tuple[str, str]], ffn_kinds: set[str]) -> list[str]:
    """What must hold of one converted decode graph; returns the failures (empty = pass).

    `scopes`: label -> (region kind, options) of the plan (a custom label may span regions of one
    kind each; the last one's kind is used for the expectation)."""
    problems = []
    groups = graph.by_scope()
    found = {label for label in groups if label is not None}
    if found != set(scopes):
        problems.append(f"scope labels in the GE graph {sorted(found)} != the plan's {sorted(scopes)}")
    for label, nodes in groups.items():
        if label is None:
            stray = [n.name for n in nodes if n.scope_options is not None]
            if stray:
                problems.append(f"ops outside every scope carry _super_kernel_options: {stray[:5]}")
            continue
        want = scopes.get(label, (None, None))[1]
        bad = [n.name for n in nodes if n.scope_options != want]
        if bad:
            problems.append(f"scope {label}: ops whose _super_kernel_options != {want!r}: {bad[:5]}")
    for label, (kind, _options) in scopes.items():
        missing = expected_ge_ops(kind, ffn_kinds) - {n.type for n in groups.get(label, [])}
        if missing:
            problems.append(f"scope {label} ({kind}): GE ops {sorted(missing)} missing")
    everything = expected_ge_ops("decoder", ffn_kinds)
    if everything - graph.types():
        problems.append(f"fused GE ops missing from the graph: {sorted(everything - graph.types())}")
    return problems


# FusedInferAttentionScore's inputs in GE IR order (torchair ge_apis): query, key[0], value[0], pse_shift,
# atten_mask, actual_seq_lengths, actual_seq_lengths_kv, ... (one key and one value tensor here)
FIA_KV_LENGTHS_INPUT = 6


def kv_lengths_sources(graph: GeGraph) -> list[dict]:
    """Per FusedInferAttentionScore node: its scope and the GE op feeding actual_seq_lengths_kv (None:
    unfed, the whole static cache is read). The custom op decode_attention feeds it (ReduceMax of the mask)."""
    types = {n.name: n.type for n in graph.nodes}
    found = []
    for node in graph.nodes:
        if node.type != "FusedInferAttentionScore":
            continue
        fed = node.inputs[FIA_KV_LENGTHS_INPUT] if len(node.inputs) > FIA_KV_LENGTHS_INPUT else ""
        found.append({"node": node.name, "scope": node.scope, "from": types.get(fed.split(":")[0]) if fed else None})
    return found


def known_notes(graph: GeGraph) -> list[str]:
    """The KNOWN notes that apply to this graph (attention's only while some FIA reads the whole cache)."""
    notes = [note for op, note in KNOWN.items() if op in graph.types() and op != "FusedInferAttentionScore"]
    if any(f["from"] is None for f in kv_lengths_sources(graph)):
        notes.append(KNOWN["FusedInferAttentionScore"])
    return notes


def summarize(types_: Iterable[str]) -> str:
    counts = Counter(types_)
    return ", ".join(f"{t} x{c}" if c > 1 else t for t, c in counts.items())


# --------------------------------------------------------------------------- converting
def _plan_sets(plan: str | None) -> list[str]:
    if plan is None:
        return []
    if plan == "none":
        return ["model_config.enable_superkernel=false"]
    return ["model_config.enable_superkernel=true", f"model_config.superkernel.plan={plan}"]


def plan_config(args: argparse.Namespace, plan: str | None, npu_platform: Platform) -> RunConfig:
    """The run config an NPU run of `plan` would use: exe_mode ge_graph, dtype resolved for the NPU
    (auto -> bfloat16; float32 is refused as on a device), no compile cache (a hit converts nothing)."""
    config = config_path(args.model, args.yaml, args.config)
    sets = [*args.overrides, *_plan_sets(plan), "model_config.exe_mode=ge_graph"]
    sets.append("model_config.enable_cache_compile=false")
    cfg = load_config(config, sets)
    dtype = resolve_dtype(cfg.model_config.dtype, npu_platform)
    return load_config(config, [*sets, f"model_config.dtype={dtype}"])


def build_runner(args: argparse.Namespace, plan: str | None, npu_platform: Platform):
    """The recipe's runner as an NPU run would configure it, built on CPU (model and weights stay here)."""
    cpu = Platform("cpu", None, "cpu", "ge_check: the model is built on CPU; conversion only")
    cfg = plan_config(args, plan, npu_platform)
    return runner_class(args.model)(cfg, cpu, stream=io.StringIO())  # its log lines are not ours to print


def convert_plan(air, args: argparse.Namespace, plan: str | None, npu_platform: Platform, dump_dir: Path) -> dict:
    from executor.backends import npu  # torch_npu = the ge_offline stand-in by now

    runner = build_runner(args, plan, npu_platform)
    spec = dataclasses.replace(runner.decode_spec(), device=npu_platform.device_name)
    cfg = npu.ge_compiler_config()  # exactly the adapter's settings ...
    checks = air.instrument(cfg, dump_dir)  # ... plus the pbtxt dump and a read-only FX pass
    runner.use_backend(npu.TorchairGEBackend(spec, compiler_config=cfg))
    b = spec.batch_size
    ids, positions = torch.ones(b, 1, dtype=torch.long), torch.full((b, 1), 3, dtype=torch.long)

    def first_call():
        with torch.no_grad(), runner.context.active():
            runner.prepare(b)
            runner.decode_one(ids, positions)

    try:
        conv = air.convert(first_call, dump_dir, checks)
    finally:
        torch._dynamo.reset()
    graph = conv.optimized[-1]
    kinds = {r.name: r.kind for r in runner.model.regions()}
    scopes = {s.label: (kinds[s.region], s.options) for s in runner.plan.scopes}
    ffn_kinds = {k for k in kinds.values() if k in ("mlp", "moe")}
    groups = graph.by_scope()
    return {
        "plan": runner.plan.name,
        "dtype": spec.dtype,
        "batch_size": spec.batch_size,
        "max_len": spec.max_len,
        "layers": spec.arch.num_layers,
        "seconds": round(conv.seconds, 2),
        "fx_graphs": len(conv.fx),
        "ge_ops": len(graph.nodes),
        "without_converter": conv.without_converter,
        # the adapter's CompilerConfig as torchair's own config objects read it back
        "compiler_config": {
            f"experimental_config.{name}": getattr(cfg.experimental_config, name).value
            for name in ("frozen_parameter", "tiling_schedule_optimize", "topology_sorting_strategy")
        },
        "plan_scopes": {label: {"kind": kind, "options": options} for label, (kind, options) in scopes.items()},
        "ffn_kinds": sorted(ffn_kinds),
        "scopes": {
            label: {"options": sorted({str(n.scope_options) for n in nodes}), "ops": [n.type for n in nodes]}
            for label, nodes in groups.items()
            if label is not None
        },
        "outside": {
            "ops": [n.type for n in groups.get(None, [])],
            "with_scope_attrs": [n.name for n in groups.get(None, []) if n.scope_options is not None],
        },
        "attention_kv_lengths": kv_lengths_sources(graph),
        "fx_custom_ops": sorted({t for fx in conv.fx for t in fx.targets if t.startswith("cann.")}),
        "known": known_notes(graph),
        "problems": check(graph, scopes, ffn_kinds),
        "dump": str(graph.path),
    }


def op_table_probe() -> tuple[Callable, tuple[torch.Tensor, torch.Tensor]]:
    """Every op of executor.ops in one static graph, including the MoE prefill ops (routing +
    grouped matmul) that the decode step never reaches, so their converters are exercised too."""
    from executor import ops

    n, h, e, k, d = 4, 16, 4, 2, 8  # tokens, hidden, experts, top-k, head dim
    g = torch.Generator().manual_seed(0)
    bf = {"dtype": torch.bfloat16}
    w = torch.rand(h, generator=g).to(**bf) + 0.5
    router = torch.randn(h, e, generator=g).to(**bf)
    w_up = torch.randn(e, h, 2 * h, generator=g).to(**bf)  # (E, K, N) in x @ W orientation
    cos, sin = torch.randn(1, 1, n, d, generator=g).to(**bf), torch.randn(1, 1, n, d, generator=g).to(**bf)
    mask = torch.ones(n, n, dtype=torch.bool).triu(1).view(1, 1, n, n)  # True = masked out

    def probe(x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        y = ops.rms_norm(x, w, 1e-6)
        y, _ = ops.add_rms_norm(y, residual, w, 1e-6)
        q = ops.rotary_mul(y.view(1, n, 2, d).transpose(1, 2), cos, sin)  # (1, 2, N, D)
        kv = q[:, :1]  # one kv head (GQA 2:1)
        att = ops.attention(q, kv, kv, mask, d**-0.5).transpose(1, 2).reshape(n, h)
        weights, idx = ops.moe_gating_top_k_softmax(att @ router, k)
        rows, order, counts = ops.moe_init_routing(att, idx, e)
        act = ops.swiglu(ops.grouped_matmul(rows, w_up, counts))  # (N*k, H)
        return act.sum() + weights.sum() + order.sum()

    return probe, (torch.randn(n, h, generator=g).to(**bf), torch.randn(n, h, generator=g).to(**bf))


def convert_probe(air, args: argparse.Namespace, npu_platform: Platform, dump_dir: Path) -> dict:
    from executor.backends import npu
    from executor.context import ExecutionContext

    runner = build_runner(args, "none", npu_platform)  # only for a spec; the probe is not the model
    spec = dataclasses.replace(runner.decode_spec(), device=npu_platform.device_name)
    cfg = npu.ge_compiler_config()
    checks = air.instrument(cfg, dump_dir)
    backend = npu.TorchairGEBackend(spec, compiler_config=cfg)
    probe, inputs = op_table_probe()
    step = backend.compile(probe)

    def first_call():
        with torch.no_grad(), ExecutionContext.for_backend(backend).active():
            step(*inputs)

    try:
        conv = air.convert(first_call, dump_dir, checks)
    finally:
        torch._dynamo.reset()
    graph = conv.optimized[-1]
    missing = sorted(set(GE_OP.values()) - graph.types())
    return {
        "without_converter": conv.without_converter,
        "ops": [n.type for n in graph.nodes],
        "problems": [f"GE ops missing: {missing}"] if missing else [],
    }


# --------------------------------------------------------------------------- the command
def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    npu_platform = Platform("npu", None, args.soc, "ge_check: converters target this SoC; no device")
    plans = args.plan or [None]
    for plan in plans:  # a bad recipe, config or dtype is a one-line error before the wheel is fetched
        runner_class(args.model)
        plan_config(args, plan, npu_platform)
    try:
        air = ge_offline.OfflineTorchair.install(soc=args.soc)
    except ge_offline.GeOfflineError as exc:
        raise GeCheckError(str(exc)) from None
    dump_root = Path(args.dump_dir) if args.dump_dir else Path(tempfile.mkdtemp(prefix="ge_check_"))
    print(NOT_AN_NPU_RUN.format(version=ge_offline.TORCH_NPU_VERSION, soc=args.soc), flush=True)
    report: dict = {
        "tool": "ge_check",
        "what": NOT_AN_NPU_RUN.format(version=ge_offline.TORCH_NPU_VERSION, soc=args.soc),
        "model": args.model,
        "soc": args.soc,
        "torch_npu": ge_offline.TORCH_NPU_VERSION,
        "torchair_root": str(air.root),
        "schemas": {name: op.schema for name, op in air.schemas.items() if name in _FUSED_NPU_OPS},
        "plans": {},
    }
    failed = False
    for plan in plans:
        try:
            result = convert_plan(air, args, plan, npu_platform, dump_root / (plan or "config"))
        except ge_offline.ConversionFailed as exc:
            result = {"plan": plan or "config", "without_converter": exc.missing, "problems": [str(exc)]}
        failed |= bool(result["problems"] or result["without_converter"])
        report["plans"][result["plan"]] = result
        _print_plan(args.model, result)
    if args.probe:
        result = convert_probe(air, args, npu_platform, dump_root / "probe")
        failed |= bool(result["problems"] or result["without_converter"])
        report["probe"] = result
        print(f"\n== op table probe (every executor.ops op, NPU table): {summarize(result['ops'])}")
        _print_checks(result)
    report["passed"] = not failed
    print(f"\n{ONLY_ON_NPU}; dumps under {dump_root}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 1 if failed else 0


# the torch_npu ops executor/backends/npu.py calls (their schemas go into the report)
_FUSED_NPU_OPS = (
    "npu_rms_norm",
    "npu_add_rms_norm",
    "npu_swiglu",
    "npu_rotary_mul",
    "npu_fused_infer_attention_score",
    "npu_moe_gating_top_k_softmax",
    "npu_moe_init_routing",
    "npu_grouped_matmul",
)


def _print_checks(result: dict) -> None:
    print(f"  FX ops without a GE converter: {', '.join(result['without_converter']) or 'none'}")
    print("  checks: " + ("pass" if not result["problems"] else "FAIL\n    " + "\n    ".join(result["problems"])))


def _print_plan(model: str, r: dict) -> None:
    if "scopes" not in r:  # conversion stopped before a GE graph existed
        print(f"\n== {model} plan {r['plan']}: not converted")
        _print_checks(r)
        return
    print(
        f"\n== {model} plan {r['plan']} ({r['layers']} layers, {r['dtype']}, batch {r['batch_size']}, "
        f"KV cache {r['max_len']} slots): {r['ge_ops']} GE ops, converted in {r['seconds']} s"
    )
    print(f"  [outside scopes]: {summarize(r['outside']['ops'])}")
    for label, scope in r["scopes"].items():
        print(f"  {label} ({', '.join(scope['options']) or 'no options'}): {summarize(scope['ops'])}")
    if r["fx_custom_ops"]:
        fed = sorted({str(f["from"]) for f in r["attention_kv_lengths"]})
        custom = ", ".join(r["fx_custom_ops"])
        print(f"  custom ops in the FX graph: {custom} (FIA actual_seq_lengths_kv from: {', '.join(fed)})")
    _print_checks(r)
    for note in r["known"]:
        print(f"  known: {note}")


if __name__ == "__main__":  # the repo root is on sys.path (top of this file)
    sys.exit(run_command(main, sys.argv[1:]))
