"""Command line: `cann-recipes-infer [run|compare|search|ge-check|analyze] ...` (infer.sh calls `run`).

Every known failure (bad config, missing checkpoint, impossible platform request: a
executor.errors.RecipeError) prints one line `error: ...` and exits with code 2; anything else
is a bug and keeps its traceback.

`run` with parallel_config.world_size > 1 starts its ranks with torchrun (executor.parallel.launch)
and each rank runs this same command; a failed rank ends the job with that rank's one line.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import sys
from pathlib import Path

from executor.errors import run_command
from executor.paths import REPO_ROOT, claim_output_dir
from executor.registry import config_path, recipe_parser, runner_class

USAGE = "bash infer.sh"
DESCRIPTION = (
    "Run a model recipe: prefill + decode with the recipe's exe_mode and SuperKernel plan; "
    "prints per-step timings (cann-recipes-infer log format) and writes metrics.json."
)
EPILOG = (
    "examples:\n  bash infer.sh\n  bash infer.sh --set model_config.exe_mode=ge_graph "
    "--set model_config.enable_superkernel=true --set model_config.superkernel.plan=attention\n"
    "  bash infer.sh --model qwen --yaml qwen3_8b_1tp.yaml --set model_config.model_path=/data/Qwen3-8B\n"
    "  bash infer.sh --model qwen --config my.yaml --set scheduler_config.max_new_tokens=32 --out /tmp/run\n"
    "  bash infer.sh --model qwen --yaml qwen3_8b_2tp.yaml   # world_size 2: starts 2 ranks with torchrun\n"
    '  bash infer.sh --yaml qwen3_8b_2tp.yaml --torchrun "--nnodes 2 --node-rank 0 --rdzv-backend c10d '
    '--rdzv-endpoint HOST:29500"   # on each machine'
)


def run_parser() -> argparse.ArgumentParser:
    p = recipe_parser(USAGE, DESCRIPTION, EPILOG, config_help="a recipe YAML anywhere (instead of --yaml)")
    p.add_argument("--out", help="output directory (default: models/<model>/res/<date>/<case>/)")
    p.add_argument(
        "--torchrun",
        default="",
        metavar="OPTIONS",
        help="torchrun options for a run over several machines (--nnodes, --node-rank, --rdzv-*), passed through",
    )
    return p


def cmd_run(argv: list[str]) -> int:
    args = run_parser().parse_args(argv)
    from executor.config import load_config
    from executor.platform import detect

    # The recipe, the YAML and its keys are checked before anything imports torch (2-3 s): a typo
    # is answered at once.
    config = config_path(args.model, args.yaml, args.config)
    cfg = load_config(config, args.overrides)
    runner_cls = runner_class(args.model)
    from executor.runner import default_out_dir

    platform = detect(cfg.model_config.device)
    out = Path(args.out or cfg.model_config.output_path or default_out_dir(cfg, args.model))
    where = "--out" if args.out else "model_config.output_path"
    if cfg.parallel_config.world_size > 1:
        return _run_ranks(args, argv, cfg, platform, out.resolve(), where, runner_cls)
    with claim_output_dir(out, "metrics.json", where), (out / "infer.log").open("w") as log_file:
        _run_and_report(runner_cls(cfg, platform, out, _Tee(sys.stdout, log_file)), out)
    return 0


def _run_and_report(runner, out: Path) -> None:
    metrics = runner.run()
    sk = metrics["superkernel"]
    runner.log(f"[run] superkernel requested={sk['requested']} ran={sk['ran']} plan={sk['plan']}; results in {out}")


def _run_ranks(args, argv: list[str], cfg, platform, out: Path, where: str, runner_cls) -> int:
    """world_size > 1. Here (not under torchrun): check what can be checked, start the ranks.
    In a rank: agree on the output directory, let rank 0 hold it, log to this rank's file, run."""
    from executor.parallel import launch, runtime

    pc = cfg.parallel_config
    if not runtime.under_torchrun():
        plan = launch.plan(pc.world_size, args.torchrun, platform, "executor.cli", ["run", *argv, "--out", str(out)])
        runner_cls.check_before_run(cfg, platform, plan.per_node)  # layout vs config.json, memory of every rank here
        with claim_output_dir(out, "metrics.json", where):
            pass  # refused now (another run's results, or in use) rather than by rank 0 later
        return launch.launch(plan, out)
    import torch.distributed as dist

    runtime.init_process_group(platform)
    try:
        out = Path(runtime.broadcast_object(str(out)))
        first = runtime.is_first()
        with claim_output_dir(out, "metrics.json", where) if first else contextlib.nullcontext():
            dist.barrier()  # rank 0 holds the directory: the others may now write their logs into it
            console = runtime.redirect_to_rank_log(out)
            with (out / "infer.log").open("w") if first else contextlib.nullcontext() as log_file:
                stream = _Tee(console, log_file) if first else sys.stdout
                _run_and_report(runner_cls(cfg, platform, out, stream), out)
    finally:
        dist.destroy_process_group()
    return 0


class _Tee:
    def __init__(self, *streams):
        self.streams = streams

    def write(self, text: str) -> None:
        for s in self.streams:
            s.write(text)

    def flush(self) -> None:
        for s in self.streams:
            s.flush()


COMMANDS = {
    "run": (cmd_run, "run a recipe (what infer.sh does)"),
    "compare": ("tools.sk_compare", "baseline vs SuperKernel measurement and report"),
    "search": ("tools.scope_search", "find the fastest accurate SuperKernel plan"),
    "ge-check": ("tools.ge_check", "convert the decode graph to GE on CPU (torchair), list GE ops per scope"),
    "accuracy": ("tools.accuracy", "the configured run against the eager float32 reference (cosine, PPL, audit)"),
    "analyze": ("tools.op_analysis", "where decode time goes, Ascend op mapping, ranked opportunities"),
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-h", "--help"):
        print(f"usage: cann-recipes-infer {{{','.join(COMMANDS)}}} [--help] ...\n\ncommands:")
        for name, (_, help_text) in COMMANDS.items():
            print(f"  {name:8s} {help_text}")
        return 0
    command = argv.pop(0) if argv and argv[0] in COMMANDS else "run"
    target = COMMANDS[command][0]
    if not callable(target):  # a tool: tools/ is a package at the repo root
        if str(REPO_ROOT) not in sys.path:
            sys.path.insert(0, str(REPO_ROOT))
        target = importlib.import_module(target).main
    return run_command(target, argv)


if __name__ == "__main__":
    if "LOCAL_RANK" in os.environ:  # perhaps a rank: runtime imports torch, which a rank imports anyway
        from executor.parallel import runtime

        if runtime.under_torchrun():
            runtime.run_rank(main)
    sys.exit(main())
