"""One rank of a multi-device greedy generation whose logits are needed (accuracy checks).

A log carries tokens and timings but not logits, so tools that compare logits (scope_search's
accuracy gate) generate in their own process; a multi-rank config cannot run in one process.
tools.measure.generate_ranks starts this module on every rank with torchrun
(executor.parallel.launch), for one or more jobs in a row (each its own runner, the ranks in
step); rank 0 saves, per job, what generate() returns for the whole batch plus what the
decode step reported. A job with an `accuracy` entry runs the accuracy tool's candidate side
instead (executor.accuracy.measure_side, for tools/accuracy.py on a multi-rank config).

    python -m tools.rank_generate --jobs JOBS.json       # under torchrun only
"""

from __future__ import annotations

import argparse
import importlib
import io
import json
import sys
from pathlib import Path

if __package__ in (None, ""):  # `python tools/rank_generate.py`: make the repo importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from executor import accuracy, ops
from executor.config import ConfigError, load_config
from executor.errors import run_command
from executor.memory import forget_runners
from executor.parallel import runtime
from executor.platform import detect
from executor.registry import runner_class
from tools.measure import Progress, decode_path_ppl


def run_job(job: dict, console) -> dict | None:
    """One job; its result (rank 0) or None (other ranks). `console`: rank 0's terminal."""
    runner_cls = runner_class(job["model"])
    cfg = load_config(job["config"], job["overrides"])
    platform = detect(cfg.model_config.device)
    runner = runner_cls(cfg, platform, None, io.StringIO())
    try:
        result = accuracy_side(runner, job["accuracy"], console) if "accuracy" in job else generation(runner, job)
        return result if runtime.is_first() else None
    finally:
        del runner
        forget_runners()  # the compiled step and the runner's memory freed before the next job


def accuracy_side(runner, spec: dict, console) -> dict:
    """tools/accuracy.py's candidate on this rank. An --ops table registered in the tool's process
    reaches the ranks through the modules that define it (imported here: registering at import
    time is what makes a table usable on several devices)."""
    if spec["ops"]:
        for module in spec["ops_modules"]:
            try:
                importlib.import_module(module)
            except ImportError as exc:
                raise ConfigError(
                    f"--ops {spec['ops']}: the ranks cannot import {module}, which defines it ({exc})"
                ) from None
        if spec["ops"] not in ops.registered():
            raise ConfigError(
                f"--ops {spec['ops']}: not registered on the ranks after importing {', '.join(spec['ops_modules'])} "
                "(register the table when its module is imported)"
            )
        accuracy.use_op_table(runner, spec["ops"])
    progress = Progress(f"accuracy rank {runtime.rank()}", console or sys.stdout)  # others: their rank log
    inputs = accuracy.SideInputs(**{k: v for k, v in spec.items() if k not in ("ops", "ops_modules")})
    return accuracy.measure_side(runner, inputs, progress)


def generation(runner, job: dict) -> dict:
    """Greedy generation (and the decode-path perplexity) with what the decode step reported."""
    prompt_ids = job.get("prompt_ids") or runner.encode_prompts()
    gen = runner.generate(prompt_ids, job["tokens"])
    text = job.get("ppl_text")  # every rank: the perplexity's decode steps hold collectives
    ppl = None if text is None else decode_path_ppl(runner, text, job["ppl_tokens"])
    report = runner.step.report()
    param_bytes = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    every_rank = runtime.gather_objects(param_bytes, runner.parallel)
    est = runner.memory  # the pre-flight's per-rank estimate, next to what the rank allocated
    memory = runtime.gather_objects(
        {"weights": est.weights, "kv_cache": est.kv_cache, "kv_cache_allocated": runner.cache.nbytes()},
        runner.parallel,
    )
    shapes = {name: tuple(p.shape) for name, p in runner.model.state_dict().items()}
    return {
        "prompt_ids": gen.prompt_ids,
        "ppl": ppl,  # decode-path perplexity of job["ppl_text"], or None
        "token_ids": gen.token_ids,
        "prefill_ms": gen.prefill_ms,
        "decode_ms": gen.decode_ms,
        "first_logits": gen.first_logits,
        "last_logits": gen.last_logits,
        "regions": [(r.name, r.kind, r.layer) for r in runner.model.regions()],
        "graphs": report.graphs,
        "recompiles": report.recompiles,
        "scopes": report.scopes,
        "superkernel_ran": report.superkernel_ran,
        "collectives_per_step": runner.collectives,
        "param_bytes_per_rank": every_rank,
        "memory_per_rank": memory,
        "param_shapes": shapes,  # rank 0's
    }


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.rank_generate", description=__doc__)
    p.add_argument("--jobs", required=True, help="JSON: {out, jobs: [{model, config, overrides, tokens, save}]}")
    args = p.parse_args(argv)
    spec = json.loads(Path(args.jobs).read_text())
    first_cfg = load_config(spec["jobs"][0]["config"], spec["jobs"][0]["overrides"])
    import torch.distributed as dist

    runtime.init_process_group(detect(first_cfg.model_config.device))
    try:
        console = runtime.redirect_to_rank_log(Path(spec["out"]))
        for job in spec["jobs"]:
            result = run_job(job, console)
            if result is not None:
                torch.save(result, job["save"])
            print(f"[rank_generate] job done: {job['save']}", flush=True)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    runtime.run_rank(lambda: run_command(main, sys.argv[1:]))  # always a rank: see exit_rank
