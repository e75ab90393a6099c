"""accuracy: the configured run against the eager float32 reference, as a pass/fail gate.

    python tools/accuracy.py --model qwen                   # or: cann-recipes-infer accuracy --model qwen
    python tools/accuracy.py --model qwen --set model_config.dtype=bfloat16 --text my_eval.txt

Compares per-region hidden states (every `layer_{i}`, prefill and decode steps) and the final
logits by cosine, perplexity on an evaluation text through the decode path and through prefill,
greedy-token agreement, and audits what ran (op implementations, scopes, dtype): see
executor/accuracy.py. The reference is always one device; a multi-rank config
(parallel_config.world_size > 1) runs the candidate on its ranks through torchrun
(tools/rank_generate.py, rank logs in --out/ranks), every compared value gathered into the
whole batch. The gate: every cosine > --cosine-min (0.99), |PPL difference| <
--ppl-max-diff (10%), every audit item PASS. Writes accuracy.json, accuracy_report.md and
accuracy_cosine.png (per-layer 1 - cosine) into --out.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import io
import json
import math
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # `python tools/accuracy.py`: make the repo importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from executor import accuracy, ops
from executor.config import ConfigError, read_text_file
from executor.errors import run_command
from executor.parallel.layout import Layout
from executor.paths import MODELS_DIR, claim_output_dir, results_dir
from executor.registry import recipe_parser
from tools import measure
from tools.measure import Progress
from tools.startup import ToolStart, start

RESULTS, REPORT, PLOT = "accuracy.json", "accuracy_report.md", "accuracy_cosine.png"
USAGE = "python tools/accuracy.py"
DESCRIPTION = (
    "Compare the configured run (any exe_mode, SuperKernel plan, dtype, op table) with the eager float32 "
    "reference on the same checkpoint: per-region cosine, perplexity through the decode path and prefill, "
    "greedy agreement, and an audit of what ran. Exit 0 only when the gate passes."
)
EPILOG = "exit codes: 0 passed, 1 failed the gate, 2 bad input, 130 interrupted"


def parser() -> argparse.ArgumentParser:
    p = recipe_parser(USAGE, DESCRIPTION, EPILOG, config_help="a recipe YAML anywhere, instead of --yaml")
    p.add_argument("--text", help="evaluation text (default: models/<model>/builtin/eval.txt, the built-in model's)")
    p.add_argument("--out", help="report directory (default: models/<model>/res/<date>/accuracy_<time>/)")
    p.add_argument("--cosine-min", type=float, default=accuracy.Gate.cosine_min, help="cosine floor (default: 0.99)")
    p.add_argument(
        "--ppl-max-diff", type=float, default=100 * accuracy.Gate.ppl_rel_max, help="|PPL difference| %% (default: 10)"
    )
    p.add_argument("--steps", type=int, help="decode steps compared region by region (default: max_new_tokens - 1)")
    p.add_argument("--max-eval-tokens", type=int, default=2048, help="evaluation text tokens used (default: 2048)")
    p.add_argument("--ops", metavar="TABLE", help="op table for the configured run (default: its backend's)")
    return p


def eval_text(model: str, text: str | None) -> tuple[Path, str]:
    """The evaluation text `--text` names, or the built-in model's held-out text."""
    path = Path(text) if text else MODELS_DIR / model / "builtin" / "eval.txt"
    if not text and not path.is_file():
        raise ConfigError(f"--text: no evaluation text given and {path} (the built-in model's) does not exist")
    text = read_text_file(path, "--text")
    if not text.strip():
        raise ConfigError(f"--text {path} is empty")
    return path, text


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    if args.max_eval_tokens < 2 or (args.steps is not None and args.steps < 0):
        p.error("--max-eval-tokens must be >= 2 and --steps >= 0")
    st = start(args, "accuracy", owns_superkernel=False)
    text_path, text = eval_text(args.model, args.text)
    ops_modules = check_ops(args.ops, st.cfg.parallel_config.world_size)
    now = datetime.datetime.now()
    out = (Path(args.out) if args.out else results_dir(args.model, "accuracy", now)).resolve()
    with claim_output_dir(out, RESULTS):
        result = evaluate(st, args, text, ops_modules, out, Progress("accuracy"))
        result |= {"tool": "accuracy", "model": args.model, "config": str(st.config), "overrides": args.overrides,
                   "text": str(text_path), "date": now.isoformat(timespec="seconds")}  # fmt: skip
        plot(out / PLOT, result)
        (out / REPORT).write_text(render(result))
        (out / RESULTS).write_text(json.dumps(result, indent=2))
    verdict = "PASSED" if result["passed"] else "FAILED: " + "; ".join(result["reasons"])
    print(
        f"accuracy {verdict}\ncosine min {result['cosine_min']:.6f} ({result['worst_region']}), PPL reference "
        f"{result['reference']['ppl']:.4f} candidate {result['candidate']['ppl']:.4f} "
        f"({100 * result['ppl_diff']:+.2f}%)\nreport: {out / REPORT}"
    )
    return 0 if result["passed"] else 1


def check_ops(table: str | None, world: int) -> list[str]:
    """--ops names a registered table; returns the modules defining it, which the ranks of a
    multi-device candidate import to get it (they are other processes: a table registered only
    here, e.g. in a script run as __main__, cannot reach them)."""
    if not table:
        return []
    if table not in ops.registered():
        raise ConfigError(f"--ops {table}: not a registered op table; registered: {', '.join(ops.registered())}")
    modules = ops.defined_in(table)
    if world > 1 and "__main__" in modules:
        raise ConfigError(
            f"--ops {table}: defined in __main__, which the {world} ranks cannot import; define and register the "
            "table in an importable module"
        )
    return modules


def evaluate(
    st: ToolStart, args: argparse.Namespace, text: str, ops_modules: list[str], out: Path, progress: Progress
) -> dict:
    cfg, mc = st.cfg, st.cfg.model_config
    world = cfg.parallel_config.world_size
    if world > 1:  # the candidate's pre-flight (layout, memory of every rank) before anything is built
        st.runner.check_before_run(cfg, st.platform, world)
    progress("reference: one device, eager, float32, reference ops ...")
    ref_runner = st.runner(accuracy.reference_config(cfg), st.platform, None, io.StringIO())
    accuracy.use_reference_ops(ref_runner)
    capacity = cfg.max_len
    wins = accuracy.windows(ref_runner.tokenizer.encode(text)[: args.max_eval_tokens], capacity)
    if not wins:
        raise ConfigError("--text: the evaluation text has fewer than 2 tokens")
    steps = cfg.scheduler_config.max_new_tokens - 1 if args.steps is None else args.steps
    inputs = accuracy.SideInputs(ref_runner.encode_prompts(), steps, wins, cfg.scheduler_config.max_new_tokens)
    t0 = time.perf_counter()
    ref = accuracy.measure_side(ref_runner, inputs, lambda m: progress(f"reference: {m}"))
    del ref_runner
    inputs.feed = ref["recording"]["fed"]  # the candidate decodes the reference's greedy tokens
    where = f"on {world} ranks (torchrun; rank logs in {out / 'ranks'})" if world > 1 else "here"
    progress(f"candidate: {mc.exe_mode}, dtype {mc.dtype}, plan {ref_plan(cfg)}, {where} ...")
    cand = candidate(st, args, ops_modules, inputs, out / "ranks", progress)
    regions = accuracy.compare(*(accuracy.Recording(**side["recording"]) for side in (ref, cand)))
    worst, cosine_min = regions.worst()
    ppl_diff = accuracy.relative_difference(cand["ppl"], ref["ppl"])
    ppl_diff_prefill = accuracy.relative_difference(cand["ppl_prefill"], ref["ppl_prefill"])
    reasons = []
    first_bad = regions.first_below(args.cosine_min)
    if first_bad:
        reasons.append(f"cosine <= {args.cosine_min} from {first_bad} on (worst {cosine_min:.6f} at {worst})")
    for name, diff in (("decode-path", ppl_diff), ("prefill", ppl_diff_prefill)):
        if not abs(diff) < args.ppl_max_diff / 100:
            reasons.append(f"{name} PPL differs by {100 * diff:+.2f}% (limit {args.ppl_max_diff:g}%)")
    reasons += [f"audit {i['check']}: {i['detail']}" for i in cand["audit"] if i["status"] != "PASS"]
    ppl = {
        side: {k: d[k] for k in ("ppl", "ppl_prefill", "tokens")}
        for side, d in (("reference", ref), ("candidate", cand))
    }
    return {
        "passed": not reasons,
        "reasons": reasons,
        "reference": ppl["reference"],
        "candidate": ppl["candidate"] | cand["ran"],
        "ppl_diff": ppl_diff,
        "ppl_diff_prefill": ppl_diff_prefill,
        "cosine_min": cosine_min,
        "worst_region": worst,
        "first_region_below_gate": first_bad,
        "regions": {"prefill": regions.prefill, "decode": regions.decode},
        "decode_steps_compared": steps,
        "greedy": accuracy.greedy_agreement(ref["greedy_tokens"], cand["greedy_tokens"]),
        "audit": cand["audit"],
        "world_size": world,
        "parallel": Layout.from_config(cfg.parallel_config).describe(),
        "rows_compared": rows_compared(cfg),
        "gate": {"cosine_min": args.cosine_min, "ppl_max_diff_percent": args.ppl_max_diff},
        "platform": st.platform.describe(),
        "seconds": round(time.perf_counter() - t0, 1),
    }


def candidate(
    st: ToolStart, args: argparse.Namespace, ops_modules: list[str], inputs: accuracy.SideInputs, work: Path, progress
) -> dict:
    """The configured run's side (accuracy.measure_side): here on one device; on several, on its
    ranks started by torchrun (tools/rank_generate.py), rank 0's whole-batch result."""
    world = st.cfg.parallel_config.world_size
    if world == 1:
        runner = st.runner(st.cfg, st.platform, None, io.StringIO())
        if args.ops:
            accuracy.use_op_table(runner, args.ops)
        return accuracy.measure_side(runner, inputs, lambda m: progress(f"candidate: {m}"))
    spec = dataclasses.asdict(inputs) | {"ops": args.ops, "ops_modules": ops_modules}
    job = {"model": st.model, "config": str(st.config), "overrides": list(args.overrides), "accuracy": spec}
    (result,) = measure.generate_ranks([job], world, st.platform, work)
    return result


def rows_compared(cfg) -> str:
    """Which candidate values the cosines compare, in words (the report says it)."""
    layout = Layout.from_config(cfg.parallel_config)
    if layout.world == 1:
        return "one device: every row of the batch"
    share = cfg.scheduler_config.batch_size // layout.attn_dp
    groups = ", ".join(
        f"rows {g * share}-{(g + 1) * share - 1} from rank {g * layout.attn_tp}" for g in range(layout.attn_dp)
    )
    return (
        f"each layer's output as its rank holds it (under tensor parallelism complete, after the layer's all-reduce); "
        f"{groups} (the first rank of each attention-DP group), gathered into the whole batch and compared row for "
        "row with the reference"
    )


def ref_plan(cfg) -> str:
    return cfg.model_config.superkernel.plan if cfg.superkernel_on else "none"


def plot(path: Path, result: dict) -> None:
    """1 - cosine per region (log scale: cosines near 1 differ in their last digits), both phases."""
    from tools.measure import _pyplot

    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    floor = 1e-12  # plotted where the two sides agree exactly (1 - cos = 0 has no log)
    for phase, marker in (("prefill", "o"), ("decode", "s")):
        table = result["regions"][phase]
        names = list(table)
        ax.plot(names, [max(1 - table[n], floor) for n in names], marker=marker, label=phase)
    ax.axhline(1 - result["gate"]["cosine_min"], color="r", linestyle="--", label="gate")
    ax.set(yscale="log", ylabel="1 - cosine (lower is closer)", title="per-region cosine vs reference")
    ax.tick_params(axis="x", rotation=45)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _f(x: float, spec: str = ".6f") -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def render(r: dict) -> str:
    c = r["candidate"]
    lines = [
        f"# Accuracy: {r['model']} ({c['exe_mode']}, {c['dtype']}, plan {c['plan']}, ops {c['op_table']})",
        "",
        f"**{'PASSED' if r['passed'] else 'FAILED'}**" + ("" if r["passed"] else ": " + "; ".join(r["reasons"])),
        "",
        f"Reference: the same checkpoint, one device, eager, float32, reference ops. Platform: {r['platform']}. "
        f"Config `{r['config']}`, overrides {', '.join(f'`{o}`' for o in r['overrides']) or 'none'}.",
        "",
        f"Candidate: {r['world_size']} rank(s), layout "
        + ", ".join(f"{k} {v}" for k, v in r["parallel"].items() if k != "world")
        + f". Values compared: {r['rows_compared']}.",
        "",
        "## Gate",
        "",
        "| check | value | limit |",
        "|---|---|---|",
        f"| minimum cosine ({r['worst_region']}) | {_f(r['cosine_min'])} | > {r['gate']['cosine_min']} |",
        f"| PPL difference, decode path | {100 * r['ppl_diff']:+.2f}% | < {r['gate']['ppl_max_diff_percent']:g}% |",
        f"| PPL difference, prefill | {100 * r['ppl_diff_prefill']:+.2f}% | < {r['gate']['ppl_max_diff_percent']:g}% |",
        "",
        "## Perplexity",
        "",
        f"Text `{r['text']}`, {r['reference']['tokens']} predicted tokens.",
        "",
        "| side | through the decode path | through prefill |",
        "|---|---|---|",
        *(f"| {s} | {_f(r[s]['ppl'], '.4f')} | {_f(r[s]['ppl_prefill'], '.4f')} |" for s in ("reference", "candidate")),
        "",
        f"## Regions (minimum cosine; decode: {r['decode_steps_compared']} steps)",
        "",
        "| region | prefill | decode |",
        "|---|---|---|",
        *(
            f"| {n} | {_f(r['regions']['prefill'].get(n))} | {_f(r['regions']['decode'].get(n))} |"
            for n in r["regions"]["prefill"]
        ),
        "",
        f"![per-region cosine]({PLOT})",
        "",
        "## Greedy tokens",
        "",
        f"{r['greedy']['agree']} of {r['greedy']['tokens']} agree; first difference at step "
        f"{r['greedy']['first_mismatch'] if r['greedy']['first_mismatch'] is not None else '(none)'}.",
        "",
        "## Audit: what ran",
        "",
        "| check | status | detail |",
        "|---|---|---|",
        *(f"| {i['check']} | {i['status']} | {i['detail']} |" for i in r["audit"]),
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":  # the repo root is on sys.path (top of this file)
    sys.exit(run_command(main, sys.argv[1:]))
