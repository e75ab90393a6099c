"""sk_compare: baseline (SuperKernel off) vs optimized (SuperKernel on), measured and reported.

Replaces the manual SuperKernel workflow (edit YAML, run twice, grep logs, write a report) with
one command::

    python tools/sk_compare.py --model qwen              # or: cann-recipes-infer compare --model qwen

Both sides run the real entry point (`bash infer.sh`) on YAML copies written into the output
directory, so the user's config is only ever read: nothing to restore after Ctrl-C, a crash or
a killed process. `--from-logs` parses existing logs (e.g. from an Atlas A3 run of upstream
cann-recipes-infer) and `--cmd-baseline/--cmd-optimized` run any command whose stdout is a log.
"""

from __future__ import annotations

import argparse
import datetime
import json
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # `python tools/sk_compare.py`: make the repo importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import pandas as pd

from executor.errors import run_command
from executor.paths import claim_output_dir, results_dir
from executor.platform import Platform, PlatformError, software_versions
from executor.registry import recipe_parser
from tools import measure
from tools.config_edit import unified_diff
from tools.measure import RunResult, Side
from tools.measure import fmt as _f
from tools.startup import ToolStart, start

REPORT = "superkernel_optimization_report.md"
SIDES = ("baseline", "optimized")


USAGE = "python tools/sk_compare.py"
DESCRIPTION = (
    "Measure decode latency with SuperKernel off (baseline) and on (optimized), same config "
    "otherwise, and write superkernel_optimization_report.md + results.json + runs.csv + plots."
)
EPILOG = (
    "examples:\n  python tools/sk_compare.py --model qwen\n"
    "  python tools/sk_compare.py --model qwen --plan decoder --runs 5 --set scheduler_config.max_new_tokens=64\n"
    "  python tools/sk_compare.py --model qwen --from-logs base.log opt.log\n"
    "exit codes: 0 report written, 1 a side had no successful run, 2 bad input, 130 interrupted"
)


def parser() -> argparse.ArgumentParser:
    p = recipe_parser(
        USAGE,
        DESCRIPTION,
        EPILOG,
        config_help="a recipe YAML anywhere, instead of --yaml; only read; --set applies to both sides",
    )
    p.add_argument("--runs", type=int, default=3, help="measured runs per side, alternating (default: 3)")
    p.add_argument("--warmup", type=int, default=1, help="warm-up runs per side, not measured (default: 1)")
    p.add_argument("--plan", help="SuperKernel plan of the optimized side (default: the config's plan)")
    p.add_argument("--out", help="output directory (default: models/<model>/res/<date>/sk_compare_<time>/)")
    p.add_argument(
        "--cmd-baseline",
        metavar="CMD",
        help="shell command run instead of infer.sh for the baseline; "
        "its stdout is the log (env SK_SIDE, SK_RUN, SK_OUT are set)",
    )
    p.add_argument("--cmd-optimized", metavar="CMD", help="same for the optimized side")
    p.add_argument("--from-logs", nargs=2, metavar=("BASE.log", "OPT.log"), help="only parse two existing logs")
    p.add_argument("--require-a3", action="store_true", help="exit 2 before running unless this is an Atlas A3")
    p.add_argument("--verbose", "-v", action="store_true", help="also echo every run's output")
    return p


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    if args.runs < 1 or args.warmup < 0:
        p.error(f"--runs must be >= 1 and --warmup >= 0 (got {args.runs}, {args.warmup})")
    st = start(args, "sk_compare")
    platform = st.platform
    if args.require_a3 and not platform.is_a3:
        raise PlatformError(f"--require-a3: this machine is {platform.describe()}, not an Atlas A3 ({platform.reason})")
    now = datetime.datetime.now()
    out = (Path(args.out) if args.out else results_dir(args.model, "sk_compare", now)).resolve()
    with claim_output_dir(out, "results.json"):
        return _compare(args, st, out, now)


def _compare(args: argparse.Namespace, st: ToolStart, out: Path, now: datetime.datetime) -> int:
    config, cfg, platform = st.config, st.cfg, st.platform
    progress = measure.Progress("sk_compare")
    notes: dict[str, list[str]] = {}
    if args.from_logs:
        results = {
            name: [_from_log(name, Path(path), cfg.scheduler_config.batch_size)]
            for name, path in zip(SIDES, args.from_logs)
        }
    else:
        sides = []
        for name, cmd in zip(SIDES, (args.cmd_baseline, args.cmd_optimized)):
            sk = None if name == "baseline" else ({"plan": args.plan} if args.plan else {})
            changes, notes[name] = measure.side_changes(cfg, sk)
            copy = out / f"{name}.yaml"
            side_cfg = measure.write_side_config(config, copy, changes, args.overrides)  # validates before any run
            if cmd is None:  # what infer.sh would refuse (plan vs the model's regions, memory, cache): refuse now
                st.runner.check_before_run(side_cfg, platform)
            sides.append(Side(name, copy, tuple(args.overrides), cmd))
        progress(
            f"{args.model}: {args.warmup} warm-up + {args.runs} measured run(s) per side, alternating; output in {out}"
        )
        with measure.signals_as_interrupt():
            results = measure.measure(
                args.model, sides, args.runs, args.warmup, out, progress, cfg.scheduler_config.batch_size, args.verbose
            )
    return _report(args, cfg, config, platform, out, results, notes, now)


def _from_log(side: str, path: Path, batch: int) -> RunResult:
    if path.is_dir():
        raise measure.MeasureError(f"--from-logs: {side} log {path} is a directory, not a log file")
    if not path.is_file():
        raise measure.MeasureError(f"--from-logs: {side} log {path} does not exist")
    r = measure.parse_run(side, 1, path.resolve(), None, batch)  # MeasureError names the file and line
    print(
        f"{side}: {path}: {len(r.decode_ms)} per-step decode line(s), {r.steps_dropped} left out as outliers "
        f"(IQR rule), {r.lines_ignored} line(s) without a timing ignored"
    )
    return r


# ----------------------------------------------------------------------------- checklist
def _metrics(runs: list[RunResult]) -> list[dict]:
    return [r.metrics for r in runs if r.ok and r.index >= 1 and r.metrics]


def checklist(cfg, platform: Platform, results: dict[str, list[RunResult]], external: bool) -> list[dict]:
    """The workflow's prerequisites, each PASS / FAIL / WARN with its reason."""
    base_m, opt_m = _metrics(results["baseline"]), _metrics(results["optimized"])
    every = base_m + opt_m
    items = []

    def add(item: str, status: str, reason: str) -> None:
        items.append({"item": item, "status": status, "reason": reason})

    modes = sorted({m["exe_mode"] for m in every})
    if modes:
        add(
            "exe_mode is ge_graph",
            "PASS" if modes == ["ge_graph"] else "FAIL",
            f"runs used exe_mode {', '.join(modes)}",
        )
    else:
        add("exe_mode is ge_graph", "WARN", "no metrics.json: the logs do not say which exe_mode ran")
    if external and not every:
        add("hardware is Atlas A3", "WARN", f"the logs do not say where they ran (this machine: {platform.describe()})")
    elif platform.is_a3:
        add("hardware is Atlas A3", "PASS", platform.reason)
    else:
        add(
            "hardware is Atlas A3",
            "FAIL" if platform.kind == "npu" else "WARN",
            f"{platform.describe()}: portable measurement, not an Ascend result ({platform.reason})",
        )
    v = (every[0].get("versions") if every else None) or software_versions()
    shown = ", ".join(f"{k} {v.get(k) or 'absent'}" for k in ("torch", "torch_npu", "cann"))
    add("framework is PyTorch", "FAIL" if platform.kind == "npu" and not v.get("torch_npu") else "PASS", shown)
    if every:
        add(
            "prefill and decode are separate",
            "PASS",
            "this project's runner: prefill runs eagerly outside any scope, only the decode step is compiled",
        )
    else:
        has = [r.prefill_ms is not None for side in SIDES for r in results[side] if r.ok]
        add(
            "prefill and decode are separate",
            "PASS" if has and all(has) else "WARN",
            "the logs have a prefill line apart from the per-step decode lines"
            if has and all(has)
            else "a log has no prefill line, so prefill may be mixed into the decode timing",
        )
    if opt_m:
        regions, scopes = opt_m[0].get("regions") or [], opt_m[0]["superkernel"]["scopes"]
        add(
            "model declares regions and the plan marks at least one",
            "PASS" if regions and scopes else "FAIL",
            f"{len(regions)} regions declared; plan {opt_m[0]['superkernel']['plan']} marks {len(scopes)}",
        )
        ran = [m["superkernel"]["ran"] for m in opt_m]
        base_ran = [m["superkernel"]["ran"] for m in base_m]
        ok = all(ran) and not any(base_ran)
        add(
            "SuperKernel really ran in the optimized runs",
            "PASS" if ok else "FAIL",
            f"superkernel.ran in metrics.json: optimized {sum(ran)}/{len(ran)} runs, "
            f"baseline {sum(base_ran)}/{len(base_ran)}",
        )
    else:
        for item in (
            "model declares regions and the plan marks at least one",
            "SuperKernel really ran in the optimized runs",
        ):
            add(item, "WARN", "no metrics.json from a successful optimized run")
    fewer = {"baseline": measure.steps_on_fewer_threads(base_m), "optimized": measure.steps_on_fewer_threads(opt_m)}
    if any(n is not None for n in fewer.values()):  # a CPU run with the thread governor on
        busy = {side: n or 0 for side, n in fewer.items()}
        add(
            "every decode step ran on all intra-op threads",
            "WARN" if any(busy.values()) else "PASS",
            f"decode steps on fewer threads (the host was busy; executor/threads.py): baseline {busy['baseline']}, "
            f"optimized {busy['optimized']}" + ("; compare on an idle host" if any(busy.values()) else ""),
        )
    return items


# ----------------------------------------------------------------------------- report
def conclusion(cmp: dict, plan: str, portable: bool) -> str:
    sb, so = cmp["baseline"], cmp["optimized"]
    where = " (portable CPU/CUDA measurement, not an Ascend result)" if portable else ""
    if sb["step_ms"] is None or so["step_ms"] is None:
        failed = [s for s in SIDES if cmp[s]["step_ms"] is None]
        return f"No comparison: every run of {', '.join(failed)} failed (see Runs)."
    imp = cmp["latency_improvement_percent"]
    method = cmp.get("noise_method") or "run-to-run"
    if not cmp["exceeds_noise"]:
        return (
            f"SuperKernel plan {plan}: {imp:+.1f}% decode latency, which does not exceed the noise{where}; "
            f"decided by {method}; add runs (--runs 5) or a longer decode before drawing a conclusion."
        )
    verb = "reduces" if imp > 0 else "increases"
    return (
        f"SuperKernel plan {plan} {verb} decode latency from {sb['step_ms']:.3f} to {so['step_ms']:.3f} ms/step "
        f"({abs(imp):.1f}%, {sb['step_ms'] / so['step_ms']:.2f}x, beyond the noise){where}; decided by {method}."
    )


@dataclass
class Report:
    """Everything the report is written from (results.json carries the same facts)."""

    args: argparse.Namespace
    cfg: Any
    config: Path
    platform: Platform
    out: Path
    results: dict[str, list[RunResult]]
    cmp: dict
    checks: list[dict]
    conclusion: str
    header: str
    plan: str
    m0: dict | None  # metrics.json of the first successful optimized run
    plots: dict[str, str]
    notes: dict[str, list[str]]
    when: datetime.datetime

    def repro(self) -> str:
        a = self.args
        parts = [
            "python",
            "tools/sk_compare.py",
            "--model",
            a.model,
            "--config",
            str(self.config),
            "--runs",
            str(a.runs),
            "--warmup",
            str(a.warmup),
        ] + (["--plan", a.plan] if a.plan else [])
        parts += [x for item in a.overrides for x in ("--set", item)]
        parts += [
            x
            for flag, cmd in (("--cmd-baseline", a.cmd_baseline), ("--cmd-optimized", a.cmd_optimized))
            if cmd
            for x in (flag, cmd)
        ]
        return " ".join(shlex.quote(p) for p in parts + (["--from-logs", *a.from_logs] if a.from_logs else []))


def _report(
    args,
    cfg,
    config: Path,
    platform: Platform,
    out: Path,
    results: dict[str, list[RunResult]],
    notes: dict[str, list[str]],
    when: datetime.datetime,
) -> int:
    cmp = measure.compare(results["baseline"], results["optimized"])
    opt_m = _metrics(results["optimized"])
    any_m = _metrics(results["baseline"]) + opt_m
    ran_on = any_m[0]["platform"] if any_m else (None if args.from_logs else platform.kind)
    portable = ran_on not in ("npu", None)
    plan = (
        opt_m[0]["superkernel"]["plan"]
        if opt_m
        else args.plan or ("(not recorded)" if args.from_logs else cfg.model_config.superkernel.plan)
    )
    checks = checklist(cfg, platform, results, bool(args.from_logs or (args.cmd_baseline and args.cmd_optimized)))
    rows = [r.row() for side in SIDES for r in results[side]]
    pd.DataFrame(rows).to_csv(out / "runs.csv", index=False)
    plots = {
        "steps": measure.plot_steps(
            out / "decode_step_latency.png", results, f"{args.model}: decode step latency"
        ).name,
        "medians": measure.plot_medians(
            out / "decode_latency_runs.png", {s: cmp[s] for s in SIDES}, f"{args.model}: decode ms/step"
        ).name,
    }
    header = (
        f"portable measurement on {ran_on.upper()}, not an Ascend result"
        if portable
        else "parsed from existing logs; the logs do not record the platform that produced them"
        if ran_on is None
        else f"Ascend measurement on {platform.describe()}"
    )
    rep = Report(
        args,
        cfg,
        config,
        platform,
        out,
        results,
        cmp,
        checks,
        conclusion(cmp, plan, portable),
        header,
        plan,
        opt_m[0] if opt_m else None,
        plots,
        notes,
        when,
    )
    result = {
        "tool": "sk_compare",
        "model": args.model,
        "date": when.isoformat(timespec="seconds"),
        "header": header,
        "portable": portable,
        "platform": ran_on,
        "this_machine": platform.describe(),
        "config": str(config),
        "overrides": args.overrides,
        "plan": plan,
        "runs": args.runs,
        "warmup": args.warmup,
        "from_logs": args.from_logs,
        "summary": cmp,
        "checklist": checks,
        "conclusion": rep.conclusion,
        "runs_detail": rows,
        "plots": plots,
        "reproduce": rep.repro(),
        "config_changes": notes,
    }
    (out / "results.json").write_text(json.dumps(result, indent=2, default=str))
    (out / REPORT).write_text(render(rep))
    print(
        f"{header}\nbaseline {_f(cmp['baseline']['step_ms'])} ms/step, optimized {_f(cmp['optimized']['step_ms'])} "
        f"ms/step, improvement {_f(cmp['latency_improvement_percent'], '+.1f', '%')}\n{rep.conclusion}\n"
        f"report: {out / REPORT}"
    )
    return 0 if cmp["speedup"] is not None else 1


def _model_and_scope(r: Report) -> list[str]:
    mc, m0 = r.cfg.model_config, r.m0 or {}
    source = mc.model_path or mc.debug_size
    weights = f"checkpoint {mc.model_path}" if mc.with_ckpt else f"random ({source})"
    scopes = m0.get("superkernel", {}).get("scopes", [])
    shown = ", ".join(s["label"] for s in scopes[:12]) + (" ..." if len(scopes) > 12 else "")
    options = m0.get("superkernel", {}).get("options") or mc.superkernel.options or "-"
    if r.args.from_logs:
        names = sorted({x.model_name or "?" for s in SIDES for x in r.results[s] if x.ok})
        model = [
            f"- as named in the logs: {', '.join(names) or 'n/a'} (recipe argument `{r.args.model}`); weights, "
            "dtype and batch are whatever the run that wrote the logs used"
        ]
        options = "(not recorded)"
    else:
        model = [
            f"- recipe `{r.args.model}`, model_name `{mc.model_name}`"
            + (f", {m0['model_type']} from {source}" if m0 else ""),
            f"- weights: {weights}, dtype {m0.get('dtype', mc.dtype)}",
            f"- batch size {r.cfg.scheduler_config.batch_size}, max_new_tokens "
            f"{r.cfg.scheduler_config.max_new_tokens}, {len(r.cfg.data_config.prompts)} prompt(s)",
        ]
    return [
        "## Model",
        "",
        *model,
        "",
        "## Scope strategy",
        "",
        f"- plan **{r.plan}**, options `{options}`",
        f"- {len(scopes)} scope(s): {shown}" if scopes else "- scopes: not recorded (no metrics.json)",
        "",
        "## Date",
        "",
        r.when.strftime("%Y-%m-%d %H:%M:%S"),
        "",
    ]


def _changes(r: Report) -> list[str]:
    lines = [
        "## Config changes",
        "",
        f"Parsed existing logs {r.args.from_logs[0]} and {r.args.from_logs[1]}; nothing ran."
        if r.args.from_logs
        else f"The user's config `{r.config}` is only read; each side runs a copy.",
        "",
    ]
    lines += [f"- {side}: " + ("; ".join(r.notes.get(side, [])) or "external command/log") for side in SIDES]
    if not r.args.from_logs:
        b, o = ((r.out / f"{s}.yaml").read_text() for s in SIDES)
        lines += [
            "",
            "```diff",
            unified_diff(b, o, "baseline.yaml", "optimized.yaml").rstrip() or "(no difference)",
            "```",
        ]
    if r.args.overrides:
        lines += ["", "Overrides on both sides: " + ", ".join(f"`{o}`" for o in r.args.overrides)]
    lines += ["", "## Code changes", ""]
    if not r.m0:
        return lines + ["Not recorded: the runs wrote no metrics.json.", ""]
    lines += [
        f"None in the modeling file: the model declares {len(r.m0.get('regions', []))} scope regions "
        f"(`with ctx.scopes.region(name)`); plan {r.plan} makes these SuperKernel scopes, in decode only:",
        "",
    ]
    for s in r.m0["superkernel"]["scopes"]:
        detail = f", {s['ops']} ops, {s['segments']} segment(s), {s['launches']} launches" if "ops" in s else ""
        lines.append(f"- `{s.get('region', s['label'])}` -> label `{s['label']}`{detail}")
    return lines + [""]


def _environment_and_results(r: Report) -> list[str]:
    sb, so, cmp, m0 = r.cmp["baseline"], r.cmp["optimized"], r.cmp, r.m0
    v = (m0 or {}).get("versions") or software_versions()
    versions = ", ".join(f"{k} {v[k]}" for k in v if v[k])
    if m0:
        env = [
            f"- platform: {m0['device_name']} ({m0['platform_reason']})",
            f"- exe_mode {m0['exe_mode']}, backend {m0['backend']}, dtype {m0['dtype']}",
            f"- {versions}",
        ]
    else:
        names = sorted({x.model_name or "?" for s in SIDES for x in r.results[s] if x.ok})
        env = [
            f"- platform, exe_mode, backend: not recorded in the logs (this machine: {r.platform.describe()})",
            f"- model name in the logs: {', '.join(names) or 'n/a'}",
            f"- this machine: {versions}",
        ]
    noise = "n/a" if cmp["exceeds_noise"] is None else "yes" if cmp["exceeds_noise"] else "no"
    lines = [
        "## Environment",
        "",
        *env,
        "",
        "## Results",
        "",
        f"Median over {sb['ok_runs']} baseline and {so['ok_runs']} optimized successful run(s) (decode ms/step "
        "per run after the IQR outlier rule; tokens/s = batch x 1000 / ms/step).",
        "",
        "| metric | baseline | optimized | improvement |",
        "|---|---|---|---|",
        f"| decode ms/step | {_f(sb['step_ms'])} | {_f(so['step_ms'])} | "
        f"{_f(cmp['latency_improvement_percent'], '+.1f', '%')} |",
        f"| tokens/s | {_f(sb.get('tokens_per_s'), '.1f')} | {_f(so.get('tokens_per_s'), '.1f')} | "
        f"{_f(cmp['throughput_gain_percent'], '+.1f', '%')} |",
        f"| prefill ms | {_f(sb.get('prefill_ms'), '.2f')} | {_f(so.get('prefill_ms'), '.2f')} | |",
        f"| peak memory MB | {_f(sb.get('peak_memory_mb'), '.1f')} | {_f(so.get('peak_memory_mb'), '.1f')} | |",
        f"| run-to-run CV | {_f(sb.get('cv_percent'), '.1f', '%')} {sb.get('stability', '')} | "
        f"{_f(so.get('cv_percent'), '.1f', '%')} {so.get('stability', '')} | |",
        f"| failed runs | {sb['failed_runs']} | {so['failed_runs']} | |",
        "",
        f"Speedup {_f(cmp['speedup'], '.3f', 'x')}; difference exceeds the noise: {noise}"
        + (f" (decided by {cmp['noise_method']})." if cmp.get("noise_method") else "."),
        "",
        "### Runs",
        "",
        "| side | run | status | ms/step | tokens/s | prefill ms | steps (outliers left out) | other lines | log |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for side in SIDES:
        for x in r.results[side]:
            steps = f"{len(x.decode_ms)} ({x.steps_dropped})" if x.ok and x.decode_ms else "-"
            lines.append(
                f"| {side} | {'warm-up' if x.index == 0 else x.index} | {'ok' if x.ok else 'FAILED: ' + x.error} | "
                f"{_f(x.step_ms)} | {_f(x.tokens_per_s, '.1f')} | {_f(x.prefill_ms, '.2f')} | {steps} | "
                f"{_f(x.lines_ignored, 'd', missing='-')} | {Path(x.log).name} |"
            )
    return lines + [
        "",
        f"![decode step latency]({r.plots['steps']})",
        "",
        f"![median ms/step per side]({r.plots['medians']})",
        "",
    ]


def render(r: Report) -> str:
    lines = [f"# SuperKernel optimization report: {r.args.model}", "", f"> **{r.header}.**", f"> {r.conclusion}", ""]
    lines += _model_and_scope(r) + _changes(r) + _environment_and_results(r)
    lines += ["## Prerequisite checklist", "", "| item | status | reason |", "|---|---|---|"]
    lines += [f"| {c['item']} | {c['status']} | {c['reason']} |" for c in r.checks]
    lines += ["", "## Conclusion", "", r.conclusion, "", "## How to reproduce", "", "```", r.repro()]
    if not r.args.from_logs:
        lines.append(
            f"# one side by hand: bash infer.sh --model {r.args.model} --config {r.out / 'optimized.yaml'}"
            + "".join(f" --set {shlex.quote(o)}" for o in r.args.overrides)
        )
    return "\n".join(lines + ["```", ""])


if __name__ == "__main__":  # the repo root is on sys.path (top of this file)
    sys.exit(run_command(main, sys.argv[1:]))
