"""ge_check (prototype): convert a recipe's decode step with torchair's real FX-to-GE converter, no NPU.

    python tools/ge_check_proto.py --model qwen                      # plans none attention mlp layer decoder custom
    python tools/ge_check_proto.py --model qwen3_moe --plan moe --set scheduler_config.batch_size=8

For each plan it builds the recipe's model (its config + --set overrides, bfloat16 by default),
installs our NPU op table (executor.backends.npu.install_ops, which imports torch_npu: here the
stand-in of executor.backends.ge_offline) and compiles the decode step (ModelRunner._decode_step
on the static KV cache) with the adapter's own `npu.compile_ge`, i.e. the real torchair backend
with our real CompilerConfig, plus a pbtxt graph dump. The first call converts the graph and stops
where GE's C++ runtime would load it. Printed per plan: the GE ops per SuperKernel scope, FX
nodes without a converter, and the checks the CI tier will make (fused ops present, scope labels
and options exactly on the scoped ops). Exit code 0 all plans pass, 1 a check failed, 2 bad input or no torch-npu wheel.

Prototype: everything it needs beyond the adapter is recorded in PATCHES below.
"""

from __future__ import annotations

import argparse
import io
import json
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

if __package__ in (None, ""):  # `python tools/ge_check_proto.py`: make the repo importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from executor.arch import REPO_ROOT
from executor.backends import ge_offline
from executor.config import load_config
from executor.kv_cache import KVCache
from executor.platform import Platform

# What the prototype does around the adapter, so the reviewer sees every departure from a device run:
PATCHES = (
    "platform: the runner is built with Platform('cpu') (model on CPU, reference op table), then "
    "npu.install_ops() switches to the NPU table, as prepare_platform does on an NPU",
    "KV cache: allocated here exactly as ModelRunner.generate does (no prefill runs: the cache is zeros)",
    "torchair.get_npu_backend: wrapped while converting, to add debug.graph_dump (pbtxt) and a read-only "
    "post_grad_custom_post_pass that lists FX targets; every other CompilerConfig setting is the adapter's",
    "GE load: the stand-in TorchNpuGraphBase.load raises; the step's first call is expected to fail there",
)

DEFAULT_PLANS = {
    "qwen": ["none", "attention", "mlp", "layer", "decoder", "custom"],
    "qwen3_moe": ["none", "attention", "moe", "layer", "decoder", "custom"],
}
# A custom plan that mixes kinds, labels two regions as one scope and leaves others out.
CUSTOM = (
    '[{regions: ["layer_0_attn", "layer_1_attn"], label: "attn01", options: "stream-fusion=1"}, '
    '{regions: ["layer_2"], label: "whole_layer2", options: "feed-sync-all=1"}]'
)
OPTIONS = "stream-fusion=1:strict-scope-check=bypass"  # non-custom plans: proves options reach the GE ops
# GE op types each region kind must contain once converted (the fused ops of that region).
EXPECTED = {
    "attention": {"RmsNorm", "RotaryMul", "FusedInferAttentionScore"},
    "mlp": {"AddRmsNorm", "SwiGlu"},
    "moe": {"AddRmsNorm", "MoeGatingTopKSoftmax", "SwiGlu"},
}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python tools/ge_check_proto.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen", help="recipe directory under models/ (default: qwen)")
    p.add_argument("--config", help="recipe YAML (default: models/<model>/config.yaml)")
    p.add_argument("--plan", action="append", help="plan(s) to convert (default: all for the recipe)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--dump-dir", help="where torchair writes the pbtxt dumps (default: a temporary directory)")
    p.add_argument("--json", help="also write the GE op lists per plan and scope to this file")
    p.add_argument("--no-probe", dest="probe", action="store_false", help="skip the op-table probe graph")
    return p


def build_runner(model: str, config: str | None, overrides: list[str], plan: str):
    from executor.cli import runner_class

    sets = ["model_config.dtype=bfloat16", "model_config.exe_mode=ge_graph", *overrides]
    if plan != "none":
        sets += ["model_config.superkernel.enable=true", f"model_config.superkernel.plan={plan}"]
        sets += [f"model_config.superkernel.custom={CUSTOM}"] if plan == "custom" else []
        sets += [f"model_config.superkernel.options={OPTIONS}"] if plan != "custom" else []
    path = Path(config) if config else REPO_ROOT / "models" / model / "config.yaml"
    cfg = load_config(path, sets)
    platform = Platform("cpu", None, "cpu", "ge_check: conversion only, no device")
    return runner_class(model)(cfg, platform, stream=io.StringIO())  # its log lines are not ours to print


def decode_inputs(runner) -> tuple[torch.Tensor, torch.Tensor]:
    """Allocate the static KV cache as ModelRunner.generate does; one decode token per row."""
    cfg, arch = runner.cfg, runner.arch
    b = cfg.scheduler_config.batch_size
    max_len = cfg.data_config.input_max_len + cfg.scheduler_config.max_new_tokens
    runner.cache = KVCache(len(runner.model.layers), b, arch.num_kv_heads, max_len, arch.head_dim, runner.dtype, "cpu")
    return torch.ones(b, 1, dtype=torch.long), torch.full((b, 1), 3, dtype=torch.long)


def op_table_probe() -> tuple[Callable, tuple[torch.Tensor, torch.Tensor]]:
    """Every op of executor.ops in one static graph, including the MoE prefill ops (routing +
    grouped matmul) that the decode step never reaches, so their converters are exercised too."""
    from executor import ops

    n, h, e, k, d = 4, 16, 4, 2, 8  # tokens, hidden, experts, top-k, head dim
    g = torch.Generator().manual_seed(0)
    bf = dict(dtype=torch.bfloat16)
    w = torch.rand(h, generator=g).to(**bf) + 0.5
    router = torch.randn(h, e, generator=g).to(**bf)
    w_up = torch.randn(e, h, 2 * h, generator=g).to(**bf)  # (E, K, N) in x @ W orientation
    cos, sin = torch.randn(1, 1, n, d, generator=g).to(**bf), torch.randn(1, 1, n, d, generator=g).to(**bf)
    mask = torch.ones(n, n, dtype=torch.bool).triu(1).view(1, 1, n, n)  # True = masked out

    def probe(x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        y = ops.rms_norm(x, w, 1e-6)
        y, _ = ops.add_rms_norm(y, residual, w, 1e-6)
        q = ops.rotary_mul(y.view(1, n, 2, d).transpose(1, 2), cos, sin)  # (1, 2, N, D)
        kv = q[:, :1].contiguous()  # one kv head (GQA 2:1); FIA rejects non-contiguous inputs
        att = ops.attention(q, kv, kv, mask, d**-0.5).transpose(1, 2).reshape(n, h)
        weights, idx = ops.moe_gating_top_k_softmax(att @ router, k)
        rows, order, counts = ops.moe_init_routing(att, idx, e)
        act = ops.swiglu(ops.grouped_matmul(rows, w_up, counts))  # (N*k, H)
        return act.sum() + weights.sum() + order.sum()

    return probe, (torch.randn(n, h, generator=g).to(**bf), torch.randn(n, h, generator=g).to(**bf))


def summarize(nodes) -> str:
    counts = Counter(n.type for n in nodes)
    return ", ".join(f"{t} x{c}" if c > 1 else t for t, c in counts.items())


def check(runner, graph) -> list[str]:
    """The tier's assertions on one optimized GE graph; returns the failures (empty = pass)."""
    problems = []
    want = {s.label: s.options for s in runner.plan.scopes}
    groups = graph.by_scope()
    found = {label for label in groups if label is not None}
    if found != set(want):
        problems.append(f"scope labels in GE graph {sorted(found)} != plan labels {sorted(want)}")
    for label, nodes in groups.items():
        if label is None:
            stray = [n.name for n in nodes if n.scope_options is not None]
            if stray:
                problems.append(f"ops outside every scope carry _super_kernel_options: {stray[:5]}")
            continue
        bad = [n.name for n in nodes if n.scope_options != want.get(label)]
        if bad:
            problems.append(f"scope {label}: ops with options != {want.get(label)!r}: {bad[:5]}")
    kinds = {r.name: r.kind for r in runner.model.regions()}
    ffn_kinds = {k for k in kinds.values() if k in ("mlp", "moe")}
    per_layer = EXPECTED["attention"].union(*(EXPECTED[k] for k in ffn_kinds))  # what one decoder layer holds
    for spec in runner.plan.scopes:
        kind = kinds[spec.region]
        expected = per_layer if kind in ("layer", "decoder") else EXPECTED[kind]
        missing = expected - {n.type for n in groups.get(spec.label, [])}
        if missing:
            problems.append(f"scope {spec.label} ({spec.region}): GE ops {sorted(missing)} missing")
    if per_layer - graph.types():
        problems.append(f"fused GE ops missing from the graph: {sorted(per_layer - graph.types())}")
    return problems


def main(argv: list[str] | None = None) -> int:
    from executor.cli import user_errors

    args = parser().parse_args(argv)
    try:
        return run(args)
    except (*user_errors(), ge_offline.GeOfflineError) as exc:  # bad config or no wheel: one line, exit 2
        print(f"error: {exc}", file=sys.stderr)
        return 2


def run(args: argparse.Namespace) -> int:
    plans = args.plan or DEFAULT_PLANS.get(args.model, ["none", "attention", "layer", "decoder"])
    dump_root = Path(args.dump_dir) if args.dump_dir else Path(tempfile.mkdtemp(prefix="ge_check_"))
    report, failed = {}, False
    t_install = time.perf_counter()
    with ge_offline.OfflineTorchair() as air:
        print(
            f"[ge_check] torchair {ge_offline.TORCH_NPU_VERSION} from {air.root} "
            f"(installed in {time.perf_counter() - t_install:.1f} s); dumps under {dump_root}"
        )
        from executor import ops
        from executor.backends import npu
        from executor.scope import set_scope_impl

        for plan in plans:
            runner = build_runner(args.model, args.config, args.overrides, plan)
            npu.install_ops()  # imports torch_npu: the stand-in
            if plan != "none":
                set_scope_impl(npu.scope_factory("ge_graph"))
            ids, pos = decode_inputs(runner)
            mc = runner.cfg.model_config
            try:
                conv = air.convert(  # no_grad: ModelRunner.generate runs every decode step under it
                    lambda runner=runner, mc=mc: torch.no_grad()(
                        npu.compile_ge(runner._decode_step, mc, mc.superkernel.enable).step
                    ),
                    (ids, pos),
                    dump_root / plan,
                )
            finally:
                set_scope_impl(None)
                ops.use("reference")
                torch._dynamo.reset()
            graph = conv.optimized[-1]
            missing = sorted({t for c in conv.fx for t in c.without_converter})
            problems = check(runner, graph)
            failed |= bool(problems or missing)
            print(
                f"\n== {args.model} plan {plan}: {len(graph.nodes)} GE ops, converted in {conv.seconds:.1f} s "
                f"({len(conv.fx)} FX graph(s)); FX targets without converter: {', '.join(missing) or 'none'}"
            )
            groups = graph.by_scope()
            for label, nodes in groups.items():
                head = "[outside scopes]" if label is None else f"{label} ({nodes[0].scope_options or 'no options'})"
                print(f"  {head}: {summarize(nodes)}")
            print("  checks: " + ("pass" if not problems else "FAIL\n    " + "\n    ".join(problems)))
            report[plan] = {
                "seconds": round(conv.seconds, 2),
                "without_converter": missing,
                "problems": problems,
                "scopes": {str(k): [n.type for n in v] for k, v in groups.items()},
                "dump": str(graph.path),
            }
        if args.probe:
            probe, inputs = op_table_probe()
            mc = build_runner(args.model, args.config, args.overrides, "none").cfg.model_config
            npu.install_ops()  # after the runner: building it selects the CPU (reference) table
            try:
                conv = air.convert(
                    lambda: torch.no_grad()(npu.compile_ge(probe, mc, False).step), inputs, dump_root / "probe"
                )
            finally:
                ops.use("reference")
                torch._dynamo.reset()
            graph = conv.optimized[-1]
            missing = sorted({t for c in conv.fx for t in c.without_converter})
            want = {
                "RmsNorm",
                "AddRmsNorm",
                "RotaryMul",
                "FusedInferAttentionScore",
                "MoeGatingTopKSoftmax",
                "MoeInitRouting",
                "GroupedMatmul",
                "SwiGlu",
            }
            problems = [f"GE ops missing: {sorted(want - graph.types())}"] if want - graph.types() else []
            failed |= bool(problems or missing)
            print(f"\n== op table probe (all executor.ops, NPU table): {summarize(graph.nodes)}")
            print(
                f"  FX targets without converter: {', '.join(missing) or 'none'}; checks: "
                + ("pass" if not problems else "FAIL " + "; ".join(problems))
            )
            report["probe"] = {"without_converter": missing, "problems": problems, "ops": [n.type for n in graph.nodes]}
    print("\npatches around the adapter (prototype):\n  - " + "\n  - ".join(PATCHES))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
