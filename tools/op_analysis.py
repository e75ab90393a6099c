"""op_analysis: where a recipe's decode (and prefill) time goes, and what will not map onto the NPU.

    python tools/op_analysis.py --model qwen                      # or: cann-recipes-infer analyze ...
    python tools/op_analysis.py --model qwen3_moe --set model_config.dtype=bfloat16 --out /tmp/moe
    python tools/op_analysis.py --model qwen --config my.yaml --no-ge --threads 1   # a shared machine

For the configured recipe (its op table and custom ops, its prompts and batch): time per model
region (layer_i_attn, layer_i_mlp/moe, embed, final_norm, lm_head) and per op type from the
torch profiler over several eager decode steps, FLOPs and bytes per op and what bounds each on
this machine; prefill separately. Then the decode graph as graph mode captures it: for every
aten/custom op, whether torchair (from the torch-npu wheel, as tools/ge_check.py) has a GE
converter, which fused torch_npu op our NPU table uses instead, graph breaks and host fallbacks,
each with its model source line. Ranked opportunities (fusions, custom ops, dtype, overhead)
come first in op_analysis.md; op_analysis.json and op_analysis.png hold the same.
Timings are of the machine that runs the tool: on CPU, portable measurements, not Ascend ones.

Exit codes: 0 report written, 2 bad input (config, recipe, device).
"""

from __future__ import annotations

import io
import sys
from pathlib import Path

import torch

if __package__ in (None, ""):  # `python tools/op_analysis.py`: make the repo importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from executor.analysis import report
from executor.analysis.analyze import analyze
from executor.config import load_config
from executor.errors import RecipeError, run_command
from executor.paths import claim_output_dir, results_dir
from executor.platform import detect
from executor.registry import config_path, recipe_parser, runner_class


class AnalysisError(RecipeError):
    """Bad analysis arguments; one line."""


def parser():
    p = recipe_parser(
        "python tools/op_analysis.py",
        "Where a recipe's decode time goes (regions, op types, FLOPs, bytes, bound), how its decode graph maps "
        "onto Ascend (GE converters, fused ops, graph breaks), and the biggest opportunities first.",
        "examples:\n  python tools/op_analysis.py --model qwen\n"
        "  cann-recipes-infer analyze --model qwen3_moe --set model_config.dtype=bfloat16 --out /tmp/moe\n"
        "outputs: op_analysis.md, op_analysis.json, op_analysis.png in --out\n"
        "exit codes: 0 report written, 2 bad input",
        config_help="a recipe YAML anywhere, instead of --yaml",
    )
    p.add_argument("--steps", type=int, default=5, help="decode steps profiled (default: %(default)s)")
    p.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch intra-op threads while profiling (0 = torch default); 1 on a machine other jobs share, "
        "where OpenMP regions that wait for a descheduled thread inflate every parallel op",
    )
    p.add_argument("--out", help="output directory (default: models/<model>/res/<date>/op_analysis_<time>/)")
    p.add_argument("--no-ge", action="store_true", help="skip the GE converter check (needs the torch-npu wheel)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.steps < 1:
        raise AnalysisError(f"--steps: must be >= 1, got {args.steps}")
    if args.threads < 0:
        raise AnalysisError(f"--threads: must be >= 0 (0 = torch default), got {args.threads}")
    runner_cls = runner_class(args.model)
    cfg = load_config(config_path(args.model, args.yaml, args.config), args.overrides)
    platform = detect(cfg.model_config.device)
    out = Path(args.out) if args.out else results_dir(args.model, "op_analysis")
    if args.threads:
        torch.set_num_threads(args.threads)
    with claim_output_dir(out, "op_analysis.json"):
        print(f"[analyze] building {args.model} ({cfg.model_config.exe_mode}) on {platform.describe()}", flush=True)
        runner = runner_cls(cfg, platform, None, stream=io.StringIO())
        result = analyze(runner, steps=args.steps, ge=not args.no_ge, log=lambda line: print(line, flush=True))
        paths = report.write(result, out)
    print(report.what(result))
    print(f"[analyze] {report.headline(result)}")
    print(f"[analyze] wrote {', '.join(str(p) for p in paths)}")
    return 0


if __name__ == "__main__":  # the repo root is on sys.path (top of this file)
    sys.exit(run_command(main, sys.argv[1:]))
