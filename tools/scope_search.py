"""scope_search: find the fastest SuperKernel plan that keeps accuracy, by measuring.

    python tools/scope_search.py --model qwen            # or: cann-recipes-infer search --model qwen

Candidates: the no-SuperKernel baseline, each built-in plan the model has regions for, option
variants for the platform and custom layouts, all from configs/search_space.yaml. Each one is
first checked against the eager run on the same prompts (greedy tokens and logits cosine, in
this process, where the logits are at hand), then measured with tools.measure, the code that
sk_compare uses. It runs unattended: search_status.json is rewritten after every candidate,
a restart with the same --out resumes from it, --max-minutes bounds the time (checked before
each candidate starts: a running candidate is finished, not cut), and a failing
candidate is recorded without stopping the search. Exit 0 only when the search finished and
named a winner.
"""

from __future__ import annotations

import argparse
import datetime
import fnmatch
import hashlib
import json
import os
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # `python tools/scope_search.py`: make the repo importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


from executor import stats
from executor.accuracy import Gate
from executor.compile import resolve_dtype
from executor.config import ConfigError, load_config, read_yaml
from executor.errors import run_command
from executor.paths import CONFIGS_DIR, MODELS_DIR, REPO_ROOT, claim_output_dir, results_dir
from executor.registry import recipe_parser
from executor.scope import REGION_KINDS, ScopeError, build_plan, parse_options
from tools import measure
from tools.accuracy import eval_text
from tools.config_edit import apply_changes
from tools.measure import fmt
from tools.startup import ToolStart, start

STATUS, REPORT, RESULTS, CSV, CHART = (
    "search_status.json",
    "scope_search_report.md",
    "scope_search_results.json",
    "scope_search.csv",
    "scope_search.png",
)
DEFAULT_SPACE = CONFIGS_DIR / "search_space.yaml"
FINAL = ("done", "rejected", "failed")


USAGE = "python tools/scope_search.py"
DESCRIPTION = (
    "Try every SuperKernel scope candidate, reject inaccurate ones, measure the rest and name "
    "the fastest; report .md/.json/.csv/.png in the model's result directory."
)
EPILOG = (
    "exit codes: 0 winner found, 1 no winner or search unfinished (rerun with the same --out to resume), "
    "2 bad input, 130 interrupted"
)


def parser() -> argparse.ArgumentParser:
    p = recipe_parser(
        USAGE,
        DESCRIPTION,
        EPILOG,
        config_help="a recipe YAML anywhere, instead of --yaml; read only unless --apply; "
        "--set applies to every candidate",
    )
    p.add_argument("--search-space", help=f"candidate file (default: {DEFAULT_SPACE.relative_to(REPO_ROOT)})")
    p.add_argument("--runs", type=int, default=3, help="measured runs per candidate (default: 3)")
    p.add_argument("--warmup", type=int, default=1, help="warm-up runs per candidate (default: 1)")
    p.add_argument("--check-tokens", type=int, default=8, help="greedy tokens that must equal eager (default: 8)")
    p.add_argument("--cosine-min", type=float, help="logits cosine floor (default: 0.999 fp32, 0.99 bf16/fp16)")
    p.add_argument(
        "--text", help="evaluation text for the decode-path perplexity (default: models/<model>/builtin/eval.txt)"
    )
    p.add_argument(
        "--ppl-tokens", type=int, default=256, help="evaluation-text tokens fed through each decode path (default: 256)"
    )
    p.add_argument(
        "--ppl-max-diff",
        type=float,
        default=100 * Gate.ppl_rel_max,
        help="|decode-path PPL difference| %% vs eager that rejects a candidate (default: 10, the accuracy gate)",
    )
    p.add_argument(
        "--max-minutes",
        type=float,
        help="time budget, checked before each candidate starts (a candidate already running finishes: compile, "
        "accuracy check and its runs); unstarted candidates stay pending for a resume",
    )
    p.add_argument("--out", help="output dir, resumed if it holds a search (default: models/<model>/res/<date>/...)")
    p.add_argument("--resume", action="store_true", help="without --out: resume the latest unfinished search")
    p.add_argument("--apply", action="store_true", help="write the winner into --config (backup kept, diff printed)")
    return p


# ----------------------------------------------------------------------------- candidates
def load_search_space(path: Path) -> dict:
    """Strictly read the search-space file: malformed YAML, duplicate keys, wrong shapes, unknown
    keys and bad values are errors naming the file and the key."""
    data = read_yaml(path, "search space") or {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping with builtin_plans, option_variants, custom")
    allowed = {"builtin_plans", "option_variants", "custom"}
    for key in data:
        if key not in allowed:
            raise ConfigError(f"{path}: {key}: unknown key; allowed keys: {', '.join(sorted(allowed))}")
    plans = data.get("builtin_plans", list(REGION_KINDS))
    if not isinstance(plans, list):
        raise ConfigError(f"{path}: builtin_plans: expected a list of plans ({', '.join(REGION_KINDS)})")
    for plan in plans:
        if plan not in REGION_KINDS:
            raise ConfigError(
                f"{path}: builtin_plans: {plan!r} is not allowed; allowed values: {', '.join(REGION_KINDS)}"
            )
    variants = data.get("option_variants") or {}
    if not isinstance(variants, dict):
        raise ConfigError(f"{path}: option_variants: expected a mapping of platform -> list of options strings")
    for kind, opts in variants.items():
        if kind not in ("npu", "cuda", "cpu"):
            raise ConfigError(f"{path}: option_variants.{kind}: unknown platform; allowed: npu, cuda, cpu")
        if not isinstance(opts or [], list) or not all(isinstance(o, str) for o in opts or []):
            raise ConfigError(f"{path}: option_variants.{kind}: expected a list of options strings")
        for o in opts or []:
            parse_options(o, key=f"{path}: option_variants.{kind}")
    if not isinstance(data.get("custom") or [], list):
        raise ConfigError(f"{path}: custom: expected a list of {{name: ..., scopes: [...]}}")
    names = set()
    shape = "expected {name: ..., scopes: [{regions: [patterns], label: ..., options: ...}]}"
    for i, c in enumerate(data.get("custom") or []):
        if (
            not isinstance(c, dict)
            or set(c) - {"name", "scopes"}
            or not isinstance(c.get("name"), str)
            or not isinstance(c.get("scopes"), list)
            or not c["scopes"]
        ):
            raise ConfigError(f"{path}: custom[{i}]: {shape}")
        if c["name"] in names or c["name"] in ("baseline", *REGION_KINDS):
            raise ConfigError(f"{path}: custom[{i}]: name {c['name']!r} is already taken")
        names.add(c["name"])
        for j, sc in enumerate(c["scopes"]):
            where = f"{path}: custom[{i}].scopes[{j}]"
            if (
                not isinstance(sc, dict)
                or set(sc) - {"regions", "label", "options"}
                or not sc.get("regions")
                or not all(isinstance(r, str) for r in sc["regions"])
                or not isinstance(sc.get("label"), str)
            ):
                raise ConfigError(f"{where}: {shape}")
            parse_options(sc.get("options") or "", key=f"{where}.options")
    return {"builtin_plans": plans, "option_variants": variants, "custom": data.get("custom") or []}


def candidates(regions, space: dict, platform_kind: str, base_options: str, model: str):
    """(runnable candidates, not-applicable ones with the reason); the baseline comes first."""
    cands = [{"name": "baseline", "kind": "baseline", "superkernel": None}]
    skipped = []
    variants = space["option_variants"].get(platform_kind) or [None]
    for plan in space["builtin_plans"]:
        try:
            build_plan(regions, plan, base_options, (), model)
        except ScopeError as exc:
            skipped.append({"name": plan, "reason": str(exc)})
            continue
        for opt in variants:
            cands.append(
                {
                    "name": plan if opt is None else f"{plan}[{opt}]",
                    "kind": "builtin",
                    "superkernel": {"plan": plan, "options": base_options if opt is None else opt},
                }
            )
    for c in space["custom"]:
        scopes = [
            {"regions": list(s["regions"]), "label": s["label"], "options": s.get("options", "")} for s in c["scopes"]
        ]
        names = [r.name for r in regions]
        unmatched = [p for s in scopes for p in s["regions"] if not fnmatch.filter(names, p)]
        if unmatched:  # a layout for other models; anything else wrong with it fails as a candidate
            skipped.append({"name": c["name"], "reason": f"{', '.join(unmatched)} match(es) no region of {model}"})
            continue
        cands.append(
            {
                "name": c["name"],
                "kind": "custom",
                "superkernel": {"plan": "custom", "options": base_options, "custom": scopes},
            }
        )
    return cands, skipped


def _safe(name: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "_.-" else "_" for ch in name)


# ----------------------------------------------------------------------------- status file
def _save(out: Path, status: dict) -> None:
    status["updated"] = datetime.datetime.now().isoformat(timespec="seconds")
    tmp = out / (STATUS + ".tmp")
    tmp.write_text(json.dumps(status, indent=2, default=str))
    os.replace(tmp, out / STATUS)  # a kill mid-write never leaves a half status file


def unfinished(status: dict) -> bool:
    """A search is finished only when its state says so and no candidate is left pending or
    running (a status written by a killed job may say either)."""
    return status.get("state") != "complete" or any(
        c.get("status") not in FINAL for c in status.get("candidates", {}).values()
    )


def _read_status(path: Path) -> dict | None:
    try:
        status = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return status if isinstance(status, dict) else None


def _out_dir(args) -> Path:
    if args.out:
        return Path(args.out).resolve()
    res = MODELS_DIR / args.model / "res"
    if args.resume:
        unfinished_dirs = [
            p.parent
            for p in sorted(res.glob(f"*/scope_search_*/{STATUS}"), key=os.path.getmtime)
            if (status := _read_status(p)) is not None and unfinished(status)
        ]
        if not unfinished_dirs:
            raise ConfigError(f"--resume: no unfinished search under {res}")
        return unfinished_dirs[-1]
    return results_dir(args.model, "scope_search")


def _open_status(out: Path, signature: dict, progress) -> dict:
    path = out / STATUS
    if path.is_file():
        status = _read_status(path)
        if status is None or not isinstance(status.get("candidates"), dict):
            raise ConfigError(f"--out {out}: {STATUS} is not a search status (unreadable or edited); use another --out")
        if status.get("signature") != signature:
            diff = [k for k in signature if status.get("signature", {}).get(k) != signature[k]]
            raise ConfigError(f"--out {out} holds a search with other settings ({', '.join(diff)}); use another --out")
        done = sum(c["status"] in FINAL for c in status["candidates"].values())
        progress(f"resuming {out}: {done} of {len(status['candidates'])} candidate(s) already finished")
        return status
    out.mkdir(parents=True, exist_ok=True)
    return {
        "tool": "scope_search",
        "signature": signature,
        "state": "running",
        "candidates": {},
        "skipped": [],
        "started": datetime.datetime.now().isoformat(timespec="seconds"),
    }


# ----------------------------------------------------------------------------- one candidate
@dataclass
class Search:
    """What every candidate of one search is run and judged with."""

    start: ToolStart
    out: Path
    progress: measure.Progress
    overrides: list[str]
    tokens: int  # greedy tokens that must equal the eager run
    cosine_min: float
    runs: int
    warmup: int
    ppl_text: str  # evaluation text: its perplexity through each decode path is compared with eager's
    ppl_tokens: int  # how many of its tokens
    ppl_max_diff: float  # relative
    prompts: list[list[int]] | None = None  # the eager reference's prompt ids and generation
    ref: Any = None
    ref_ppl: float | None = None  # the eager reference's decode-path perplexity


def run_candidate(search: Search, cand: dict, rec: dict, position: str) -> None:
    """Accuracy check, then measurement; every outcome ends up in `rec` (never raises, except Ctrl-C)."""
    out, progress, name, st = search.out, search.progress, cand["name"], search.start
    copy = out / "candidates" / f"{_safe(name)}.yaml"
    rec["started"] = datetime.datetime.now().isoformat(timespec="seconds")
    try:
        changes, rec["config_changes"] = measure.side_changes(st.cfg, cand["superkernel"])
        measure.write_side_config(st.config, copy, changes, search.overrides)  # validates the copy
        rec["config_copy"] = str(copy)
        progress(
            f"{position} {name}: compile + accuracy check vs eager ({search.tokens} tokens, PPL on "
            f"{search.ppl_tokens} tokens through the decode step) ..."
        )
        gen, _, _, ppl = measure.generate(
            st.model, st.runner, copy, search.overrides, st.platform, search.tokens, search.prompts, out / "ranks",
            search.ppl_text, search.ppl_tokens,
        )  # fmt: skip
        acc = rec["accuracy"] = measure.check_accuracy(
            search.ref, gen, search.tokens, search.cosine_min, (search.ref_ppl, ppl), search.ppl_max_diff
        )
        progress(
            f"{position} {name}: accuracy {'ok' if acc['passed'] else 'REJECTED'} ({acc['reason']}; "
            f"worst cosine {acc['cosine_worst']:.6f}, PPL {ppl:.4f} vs eager {search.ref_ppl:.4f})"
        )
        if not acc["passed"]:
            rec.update(status="rejected", reason=f"accuracy: {acc['reason']}")
            return
        side = measure.Side(_safe(name), copy, tuple(search.overrides))
        batch = st.cfg.scheduler_config.batch_size
        runs = measure.measure(st.model, [side], search.runs, search.warmup, out / "logs", progress, batch)[side.name]
        rec["runs"] = [r.row() for r in runs]
        rec["summary"] = summary = measure.summarise(runs)
        if summary["step_ms"] is None:
            rec.update(status="failed", reason="every measured run failed: " + "; ".join(summary["errors"])[:500])
        else:
            rec.update(status="done", reason="ok")
    except KeyboardInterrupt:
        rec.update(status="pending", reason="interrupted; runs again on resume")
        raise
    except Exception as exc:  # a compile error or crash fails this candidate, not the search
        first = (str(exc).strip().splitlines() or [""])[0][:300]
        rec.update(status="failed", reason=f"{type(exc).__name__}: {first}")
        (out / "candidates").mkdir(parents=True, exist_ok=True)
        (out / "candidates" / f"{_safe(name)}.error.txt").write_text(traceback.format_exc())
    finally:
        rec["finished"] = datetime.datetime.now().isoformat(timespec="seconds")
        progress(
            f"{position} {name}: {rec['status']}"
            + (f", {rec['summary']['step_ms']:.3f} ms/step" if rec["status"] == "done" else f" ({rec.get('reason')})")
            + (f"; {_busy(n)}" if (n := _fewer(rec)) else "")
        )


def _note(row: dict) -> str:
    """The report's note column: why a candidate was rejected or skipped, and whether its decode
    ran on fewer threads (the host was busy while it was measured: its time is not like for like)."""
    notes = [row["reason"]] if row["reason"] else []
    if row["steps_on_fewer_threads"]:
        notes.append(_busy(row["steps_on_fewer_threads"]))
    return "; ".join(notes)


def _busy(steps: int) -> str:
    return f"{steps} decode steps on fewer threads (a busy host)"


def _fewer(rec: dict) -> int:
    """Decode steps of a candidate that ran on fewer intra-op threads (executor/threads.py)."""
    return (rec.get("summary") or {}).get("steps_on_fewer_threads") or 0


# ----------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    if args.runs < 1 or args.warmup < 0 or args.check_tokens < 1 or (args.max_minutes or 0) < 0:
        p.error("--runs and --check-tokens must be >= 1, --warmup and --max-minutes >= 0")
    if args.ppl_tokens < 2 or not args.ppl_max_diff > 0:
        p.error("--ppl-tokens must be >= 2 and --ppl-max-diff > 0")
    st = start(args, "scope_search")
    config, cfg, platform = st.config, st.cfg, st.platform
    space_path = Path(args.search_space).resolve() if args.search_space else DEFAULT_SPACE
    space = load_search_space(space_path)
    text_path, text = eval_text(args.model, args.text)
    tokens = min(args.check_tokens, cfg.scheduler_config.max_new_tokens)
    dtype = resolve_dtype(cfg.model_config.dtype, platform)
    cosine_min = args.cosine_min if args.cosine_min is not None else measure.COSINE_MIN[dtype]
    out = _out_dir(args)
    progress = measure.Progress("scope_search")
    search = Search(
        st, out, progress, args.overrides, tokens, cosine_min, args.runs, args.warmup, text, args.ppl_tokens,
        args.ppl_max_diff / 100,
    )  # fmt: skip
    # What makes two searches the same one: resuming across a change of any of these would mix results.
    signature = {
        "model": args.model,
        "config": str(config),
        "overrides": args.overrides,
        "config_sha256": hashlib.sha256(config.read_bytes()).hexdigest(),
        "search_space_sha256": hashlib.sha256(space_path.read_bytes()).hexdigest(),
        "runs": args.runs,
        "warmup": args.warmup,
        "check_tokens": tokens,
        "cosine_min": cosine_min,
        "text": str(text_path),
        "text_sha256": hashlib.sha256(text.encode()).hexdigest(),
        "ppl_tokens": args.ppl_tokens,
        "ppl_max_diff_percent": args.ppl_max_diff,
        "platform": platform.kind,
    }
    with claim_output_dir(out, None, resumes=STATUS):  # a file, unwritable, another command's results, in use
        return _search(args, search, signature, space)


def _search(args, search: Search, signature: dict, space: dict) -> int:
    """Run (or resume) the search in its claimed output directory, then rank and report."""
    st, out, progress, tokens = search.start, search.out, search.progress, search.tokens
    config, cfg, platform = st.config, st.cfg, st.platform
    status = _open_status(out, signature, progress)
    # Until every candidate is final the state stays "running" on disk, so a search killed at any
    # point (kill -9 included) is found again by --resume and continued.
    status["state"] = "running"
    budget_s = None if args.max_minutes is None else args.max_minutes * 60
    # What every candidate shares (checkpoint config, memory, compile cache) is checked on the
    # baseline's copy before anything runs; what differs (the plan) fails that candidate only.
    changes, _ = measure.side_changes(cfg, None)
    baseline = measure.write_side_config(config, out / "candidates" / "baseline.yaml", changes, args.overrides)
    st.runner.check_before_run(baseline, platform)
    with measure.signals_as_interrupt():
        try:
            progress(f"eager reference: {tokens} greedy tokens on the config's prompts ...")
            eager = [
                *args.overrides,
                "model_config.exe_mode=eager",
                f"{measure.switch_key(cfg)}=false",
                "model_config.enable_cache_compile=false",
            ]
            search.ref, regions, search.prompts, search.ref_ppl = measure.generate(
                st.model, st.runner, config, eager, platform, tokens, None, out / "ranks", search.ppl_text,
                search.ppl_tokens,
            )  # fmt: skip
            status["reference_ppl"] = search.ref_ppl
            progress(f"eager reference: decode-path PPL {search.ref_ppl:.4f} (first {search.ppl_tokens} tokens)")
            cands, status["skipped"] = candidates(
                regions, space, platform.kind, cfg.model_config.superkernel.options, cfg.model_config.model_name
            )
            for c in cands:
                rec = status["candidates"].setdefault(c["name"], {"status": "pending"})
                rec.update(kind=c["kind"], superkernel=c["superkernel"])
                if rec["status"] not in FINAL:
                    rec["status"] = "pending"
            _save(out, status)
            progress(
                f"{len(cands)} candidate(s): {', '.join(c['name'] for c in cands)}; not applicable: "
                f"{', '.join(s['name'] for s in status['skipped']) or 'none'}; status in {out / STATUS}"
            )
            for i, c in enumerate(cands, 1):
                measure.check_interrupt()
                rec = status["candidates"][c["name"]]
                if rec["status"] in FINAL:
                    continue
                if budget_s is not None and progress.elapsed() >= budget_s:
                    status["state"] = "budget"
                    progress(
                        f"--max-minutes {args.max_minutes} used up after {progress.elapsed() / 60:.1f} min: stopping "
                        f"before {c['name']} (the budget is checked before each candidate starts; a running one "
                        "finishes)"
                    )
                    break
                rec["status"] = "running"  # a watcher sees which one; a killed job redoes it on resume
                _save(out, status)
                run_candidate(search, c, rec, f"[{i}/{len(cands)}]")
                _save(out, status)
            else:
                status["state"] = "complete"
        except KeyboardInterrupt:
            status["state"] = "interrupted"
            _save(out, status)
            raise
    _save(out, status)
    return finish(args, config, platform, out, status)


def rank(status: dict) -> tuple[list[tuple[str, dict]], dict | None]:
    """Measured candidates fastest first, with speedups; the winner is the fastest SuperKernel one."""
    recs = status["candidates"]
    ranked = sorted(
        ((n, r) for n, r in recs.items() if r["status"] == "done"), key=lambda x: x[1]["summary"]["step_ms"]
    )
    base = recs.get("baseline", {}).get("summary") if recs.get("baseline", {}).get("status") == "done" else None
    winner = next((n for n, r in ranked if r["kind"] != "baseline"), None)
    win_ms = recs[winner]["summary"]["step_ms"] if winner else None
    for _n, r in ranked:
        s = r["summary"]
        r["speedup_vs_baseline"] = base["step_ms"] / s["step_ms"] if base else None
        r["improvement_vs_baseline_percent"] = (
            stats.improvement_percent(base["step_ms"], s["step_ms"]) if base else None
        )
        judged = measure.judge(base, s) if base else {"exceeds_noise": None, "method": None}
        r["exceeds_noise_vs_baseline"], r["noise_method_vs_baseline"] = judged["exceeds_noise"], judged["method"]
        r["winner_speedup_over"] = s["step_ms"] / win_ms if win_ms else None
    return ranked, ({"name": winner, **recs[winner]} if winner else None)


def baseline_check(status: dict, winner: dict) -> str | None:
    """Why the winner must not be applied (None: it may be). The no-SuperKernel baseline is a
    candidate too: a plan slower than it beyond the measured noise is never written, and without
    a measured baseline there is nothing to show that it is not."""
    base = status["candidates"].get("baseline", {})
    if base.get("status") != "done":
        return (
            f"the no-SuperKernel baseline was not measured ({base.get('status', 'absent')}), so nothing shows "
            f"{winner['name']} is not slower than it"
        )
    if winner["summary"]["step_ms"] > base["summary"]["step_ms"] and winner["exceeds_noise_vs_baseline"]:
        return (
            f"{winner['name']} ({winner['summary']['step_ms']:.3f} ms/step) is slower than the no-SuperKernel "
            f"baseline ({base['summary']['step_ms']:.3f} ms/step, {winner['speedup_vs_baseline']:.2f}x) beyond "
            f"the noise ({winner['noise_method_vs_baseline']})"
        )
    return None


def finish(args, config: Path, platform, out: Path, status: dict) -> int:
    ranked, winner = rank(status)
    pending = [n for n, r in status["candidates"].items() if r["status"] not in FINAL]
    if status["state"] != "complete" or pending:
        reason = (
            f"search unfinished ({status['state']}): {len(pending)} candidate(s) not run "
            f"({', '.join(pending)}); rerun with --out {out} to resume"
        )
    elif winner is None:
        reason = "no winner: every SuperKernel candidate was rejected, failed or not applicable"
    else:
        reason = None
    status["winner"], status["exit_reason"] = (winner or {}).get("name"), reason
    refused = baseline_check(status, winner) if winner and not reason else None
    status["apply_refused"] = refused  # --apply never writes this winner (and the report says why)
    write_report(out, args, config, platform, status, ranked, winner, reason)
    _save(out, status)
    if reason:
        print(f"scope_search: {reason}\nreport: {out / REPORT}")
        if args.apply:
            print("--apply: nothing written (no winner from a finished search)")
        return 1
    sp = winner.get("speedup_vs_baseline")
    print(
        f"scope_search: winner {winner['name']}: {winner['summary']['step_ms']:.3f} ms/step"
        + (f", {sp:.3f}x vs no-SuperKernel baseline" if sp else "")
        + f"\nreport: {out / REPORT}"
    )
    if args.apply:
        if refused:
            print(f"scope_search: --apply refused, {config} left unchanged: {refused}", file=sys.stderr)
            return 1
        apply_winner(config, winner)
    return 0


def write_report(out: Path, args, config: Path, platform, status: dict, ranked, winner, reason) -> None:
    """scope_search_report.md + .json + .csv + bar chart, all from the status records."""
    import pandas as pd

    recs, sig = status["candidates"], status["signature"]
    order = [n for n, _ in ranked] + [n for n in recs if recs[n]["status"] != "done"]
    rows = []
    for n in order:
        r, s, a = recs[n], recs[n].get("summary") or {}, recs[n].get("accuracy") or {}
        sk = r.get("superkernel") or {}
        rows.append(
            {
                "rank": order.index(n) + 1 if r["status"] == "done" else None,
                "candidate": n,
                "kind": r.get("kind"),
                "plan": sk.get("plan", "none"),
                "options": sk.get("options", ""),
                "status": r["status"],
                "step_ms": s.get("step_ms"),
                "tokens_per_s": s.get("tokens_per_s"),
                "cv_percent": s.get("cv_percent"),
                "stability": s.get("stability"),
                "speedup_vs_baseline": r.get("speedup_vs_baseline"),
                "improvement_vs_baseline_percent": r.get("improvement_vs_baseline_percent"),
                "exceeds_noise_vs_baseline": r.get("exceeds_noise_vs_baseline"),
                "winner_speedup_over": r.get("winner_speedup_over"),
                "first_mismatch": a.get("first_mismatch"),
                "cosine_last_step": a.get("cosine_last_step"),
                "cosine_worst": a.get("cosine_worst"),
                "ppl": a.get("ppl"),
                "ppl_diff_percent": None if a.get("ppl_diff") is None else 100 * a["ppl_diff"],
                "reason": r.get("reason"),
                "steps_on_fewer_threads": s.get("steps_on_fewer_threads"),  # None: the governor was off
            }
        )
    table = pd.DataFrame(rows)
    table["rank"] = table["rank"].astype("Int64")  # blank, not NaN, for unranked candidates
    table.to_csv(out / CSV, index=False)
    measure.plot_medians(
        out / CHART, {n: recs[n]["summary"] for n, _ in ranked}, f"{args.model}: SuperKernel candidates"
    )
    (out / RESULTS).write_text(
        json.dumps({**status, "ranking": rows, "report": str(out / REPORT)}, indent=2, default=str)
    )
    portable = platform.kind != "npu"
    head = [f"# SuperKernel scope search: {args.model}", ""]
    if portable:
        head += [
            f"> **portable measurement on {platform.kind.upper()}, not an Ascend result** ({platform.describe()}).",
            "",
        ]
    if winner:
        sp = winner.get("speedup_vs_baseline")
        head += [
            f"**Winner: {winner['name']}** ({winner['summary']['step_ms']:.3f} ms/step"
            + (
                f", {sp:.3f}x vs the no-SuperKernel baseline, beyond noise: "
                f"{'yes' if winner['exceeds_noise_vs_baseline'] else 'no'}"
                if sp
                else ""
            )
            + ")."
        ]
        head += [f"- vs {n}: {r['winner_speedup_over']:.3f}x" for n, r in ranked if n != winner["name"]]
        if winner.get("noise_method_vs_baseline"):
            head += ["", f"Noise judged by {winner['noise_method_vs_baseline']}."]
        refused = status.get("apply_refused")
        head += [
            "",
            f"--apply {'refuses' if args.apply else 'would refuse'} to write it: {refused}."
            if refused
            else "--apply may write it: it is not slower than the no-SuperKernel baseline beyond the noise.",
        ]
    head += [
        "",
        f"Result: {reason}" if reason else "Result: search complete.",
        "",
        "## Setup",
        "",
        f"- config `{config}` (read only{'; --apply writes it' if args.apply else ''}), "
        f"overrides {', '.join(f'`{o}`' for o in sig['overrides']) or 'none'}",
        f"- platform {platform.describe()}; {sig['warmup']} warm-up + {sig['runs']} measured run(s) per candidate "
        "(tools/measure.py, the sk_compare measurement)",
        f"- accuracy vs the eager run on the same prompts: first {sig['check_tokens']} greedy tokens identical, "
        f"logits cosine >= {sig['cosine_min']} (prefill and last decode step), and perplexity through the decode "
        f"step on {sig['ppl_tokens']} tokens of `{sig['text']}` within {sig['ppl_max_diff_percent']:g}% of eager's"
        + (f" ({status['reference_ppl']:.4f})" if status.get("reference_ppl") else ""),
        f"- started {status.get('started')}, updated {status.get('updated')}"
        + (
            f"; --max-minutes {args.max_minutes} (checked before each candidate starts; a running one finishes)"
            if args.max_minutes is not None
            else ""
        ),
        "",
        "## Candidates",
        "",
        "| rank | candidate | plan | options | status | ms/step | tokens/s | CV | vs baseline "
        "| winner's speedup over it | worst cosine | PPL (diff) | note |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    head += [
        f"| {r['rank'] or '-'} | {r['candidate']} | {r['plan']} | {r['options'] or '-'} | {r['status']} | "
        f"{fmt(r['step_ms'])} | {fmt(r['tokens_per_s'], '.1f')} | {fmt(r['cv_percent'], '.1f', '%')} | "
        f"{fmt(r['speedup_vs_baseline'], '.3f', 'x')} | {fmt(r['winner_speedup_over'], '.3f', 'x')} | "
        f"{fmt(r['cosine_worst'], '.6f')} | {fmt(r['ppl'], '.4f')} ({fmt(r['ppl_diff_percent'], '+.2f', '%')}) | "
        f"{_note(r)} |"
        for r in rows
    ]
    head += ["", "Not applicable to this model:", ""] + [f"- {s['name']}: {s['reason']}" for s in status["skipped"]]
    head += [
        "",
        f"![median ms/step per candidate]({CHART})",
        "",
        "## Reproduce / resume / apply",
        "",
        "```",
        f"python tools/scope_search.py --model {args.model} --config {config}"
        + "".join(f" --set {o}" for o in sig["overrides"])
        + f" --runs {sig['runs']} --warmup {sig['warmup']}"
        + f" --out {out}  # same --out resumes; add --apply to write the winner",
        "```",
        "",
    ]
    (out / REPORT).write_text("\n".join(head))


def apply_winner(config: Path, winner: dict) -> None:
    """Write the winning plan into the user's config: backup, validate, atomic replace, diff."""
    cfg = load_config(config)
    sk, current = winner["superkernel"], cfg.model_config
    wanted = {"plan": sk["plan"], "options": sk.get("options", "")}
    if sk["plan"] == "custom":
        wanted["custom"] = sk["custom"]
    # Only keys whose value changes, so the diff shows exactly what the search decided.
    changes = {
        f"model_config.superkernel.{k}": v
        for k, v in wanted.items()
        if k == "custom" or getattr(current.superkernel, k) != v
    }
    if not current.superkernel_enabled:
        changes[measure.switch_key(cfg)] = True
    if current.exe_mode == "eager":
        changes["model_config.exe_mode"] = "ge_graph"
    if (winner.get("improvement_vs_baseline_percent") or 0) < 0:  # slower, but within the noise (else refused)
        print(f"note: {winner['name']} measured slower than the no-SuperKernel baseline, within the noise")
    result = apply_changes(config, changes, validate=lambda p: load_config(p))
    print(f"--apply: wrote {winner['name']} into {result.path} (backup {result.backup.name})\n{result.diff}", end="")


if __name__ == "__main__":  # the repo root is on sys.path (top of this file)
    sys.exit(run_command(main, sys.argv[1:]))
