"""Command line: `cann-recipes-infer [run|compare|search|ge-check|analyze] ...` (infer.sh calls `run`).

Every known failure (bad config, missing checkpoint, impossible platform request: a
executor.errors.RecipeError) prints one line `error: ...` and exits with code 2; anything else
is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import importlib
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
    "  bash infer.sh --model qwen --config my.yaml --set scheduler_config.max_new_tokens=32 --out /tmp/run"
)


def run_parser() -> argparse.ArgumentParser:
    p = recipe_parser(USAGE, DESCRIPTION, EPILOG, config_help="a recipe YAML anywhere (instead of --yaml)")
    p.add_argument("--out", help="output directory (default: models/<model>/res/<date>/<case>/)")
    return p


def cmd_run(argv: list[str]) -> int:
    args = run_parser().parse_args(argv)
    from executor.config import load_config
    from executor.platform import detect
    from executor.runner import default_out_dir

    runner_cls = runner_class(args.model)
    config = config_path(args.model, args.yaml, args.config)
    cfg = load_config(config, args.overrides)
    platform = detect(cfg.model_config.device)
    out = Path(args.out or cfg.model_config.output_path or default_out_dir(cfg, args.model))
    where = "--out" if args.out else "model_config.output_path"
    with claim_output_dir(out, "metrics.json", where), (out / "infer.log").open("w") as log_file:
        stream = _Tee(sys.stdout, log_file)
        metrics = runner_cls(cfg, platform, out, stream).run()
        sk = metrics["superkernel"]
        stream.write(
            f"[run] superkernel requested={sk['requested']} ran={sk['ran']} plan={sk['plan']}; results in {out}\n"
        )
        stream.flush()
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
    sys.exit(main())
