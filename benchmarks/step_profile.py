"""Where one decode step's time goes, per mode: how many kernels (or ops) a step runs, how long the
device is busy, and the kernels that take most of it.

Why: a decode step far above its roofline is either slow kernels or many of them with gaps between
(launch latency, a Python wrapper). The wall time alone cannot tell the two apart; a profile of a few
steps can. On CUDA the kernels are the GPU's own (a CUDA graph's kernels included); on CPU the rows
are the profiler's top-level CPU events (aten ops, our custom ops, Inductor's compiled calls).

The model is a named size with random weights (configs/model_sizes.yaml), run by the qwen recipe's
runner exactly as `bash infer.sh` runs it: prefill, warm-up steps (the first compiles), then
--steps profiled decode steps, each under a `decode_step` record_function.

  python benchmarks/step_profile.py --device cuda --size qwen3-0.6b --dtype bfloat16 --modes eager,ge_graph,decoder
  python benchmarks/step_profile.py --size bench-overhead --modes ge_graph,decoder --top 8
  python benchmarks/step_profile.py --size qwen3-0.6b --dtype bfloat16 --batch 16 --modes ge_graph --perf

--perf (CPU, Linux perf on PATH): sample the profiled steps with `perf record` instead, and print each
thread's CPU time per step by shared object: Inductor's kernels, our kernels (cann_cpu_*), oneDNN's JIT
code, libgomp (a thread waiting at a barrier or for the main thread), Python. The one view of where a
compiled CPU step's time goes inside its kernels (benchmarks/perf_samples.py).

Modes: eager, ge_graph, or a SuperKernel plan name (ge_graph with that plan).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.cli import guarded, name_list  # noqa: E402
from benchmarks.perf_samples import PerfRecorder, require_perf, rows  # noqa: E402
from executor.arch import named_size  # noqa: E402
from executor.backends import greedy  # noqa: E402
from executor.config import PLANS, load_config  # noqa: E402
from executor.platform import detect, profiler_activities, timer  # noqa: E402
from executor.registry import default_config, runner_class  # noqa: E402
from executor.tokenizer import BUILTIN_TOKENIZER  # noqa: E402

STEP = "decode_step"  # the record_function around each profiled step


def build_runner(args, mode: str):
    """The qwen recipe's runner on a random-weight named size, in `mode`."""
    plan = None if mode in ("eager", "ge_graph") else mode
    overrides = [
        "model_config.model_path=",
        "model_config.with_ckpt=false",
        f"model_config.debug_size={args.size}",
        f"model_config.tokenizer_path={BUILTIN_TOKENIZER}",
        f"model_config.exe_mode={'eager' if mode == 'eager' else 'ge_graph'}",
        f"model_config.enable_superkernel={'true' if plan else 'false'}",
        f"model_config.enable_cache_compile={'false' if mode == 'eager' else 'true'}",
        f"model_config.dtype={args.dtype}",
        f"model_config.device={args.device}",
        f"scheduler_config.batch_size={args.batch}",
        f"scheduler_config.max_new_tokens={args.steps + args.warmup + args.timed + 1}",
        f"data_config.input_truncated_len={args.prompt_len}",
    ]
    if plan:
        overrides.append(f"model_config.superkernel.plan={plan}")
    cfg = load_config(default_config("qwen"), overrides)
    return runner_class("qwen")(cfg, detect(args.device), None)


def profile_mode(args, mode: str) -> dict:
    """Profile --steps decode steps of `mode` after --warmup unprofiled ones (--perf: sampled by perf)."""
    if getattr(args, "perf", False):
        with tempfile.TemporaryDirectory(prefix="step_perf_") as tmp:
            return _profile_mode(args, mode, Path(tmp) / "perf.data")
    return _profile_mode(args, mode, None)


def _profile_mode(args, mode: str, perf_data: Path | None) -> dict:
    runner = build_runner(args, mode)
    recorder = None
    platform = runner.platform
    now = timer(platform)
    prompts = [[(7 * r + i) % 100 + 1 for i in range(args.prompt_len)] for r in range(args.batch)]
    wall: list[float] = []
    plain: list[float] = []
    try:
        with runner.session(args.batch):
            pre = runner.prefill(prompts)
            token = greedy.next_tokens(pre.logits)
            pos = pre.lengths.view(args.batch, 1).clone()
            t0 = time.perf_counter()
            for _ in range(args.warmup):  # the first compiles the step
                token = greedy.next_tokens(runner.decode_one(token, pos))
                pos += 1
            compile_s = time.perf_counter() - t0
            if perf_data is not None:  # after the compile, before the timed steps: see perf_samples
                recorder = PerfRecorder(perf_data)
            for _ in range(args.timed):  # the wall time, without the profiler's own cost
                t = now()
                token = greedy.next_tokens(runner.decode_one(token, pos))
                pos += 1
                plain.append((now() - t) * 1e3)
            if recorder is not None:
                recorder.enable()
                for _ in range(args.steps):
                    t = now()
                    token = greedy.next_tokens(runner.decode_one(token, pos))
                    pos += 1
                    wall.append((now() - t) * 1e3)
                recorder.disable()
            else:
                with torch.profiler.profile(activities=profiler_activities(platform)) as prof:
                    for _ in range(args.steps):
                        t = now()
                        with torch.profiler.record_function(STEP):
                            token = greedy.next_tokens(runner.decode_one(token, pos))
                            pos += 1
                        wall.append((now() - t) * 1e3)
    finally:
        if recorder is not None:
            recorder.finish()  # perf leaves with the steps, whatever happened in them
    del runner
    torch._dynamo.reset()
    common = {
        "mode": mode,
        "wall_ms": statistics.median(wall),
        "wall_mean_ms": statistics.fmean(wall),  # what a per-step CPU time (all steps' over their count) is bounded by
        "plain_ms": statistics.median(plain) if plain else None,
        "compile_s": compile_s,
    }
    if recorder is not None:
        return {**common, "perf": rows(recorder.stop(), os.getpid(), args.steps, args.top)}
    if args.trace_dir:
        Path(args.trace_dir).mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(Path(args.trace_dir) / f"step_{mode}.json"))
    summary = summarise(prof, platform.kind == "cuda", args.steps)
    summary.update(common, host=host_events(prof, args.steps))
    return summary


def _per_step(events: Iterable[tuple[str, float]], steps: int) -> list[tuple[str, float, float]]:
    """(name, us) events grouped by name: (name, count per step, us per step), the most time first."""
    by_name: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for name, us in events:
        by_name[name][0] += 1
        by_name[name][1] += us
    return [(name, c / steps, t / steps) for name, (c, t) in sorted(by_name.items(), key=lambda kv: -kv[1][1])]


def host_events(prof, steps: int) -> list[tuple[str, float, float]]:
    """The top-level CPU events inside each profiled step, by CPU time."""
    cpu = torch.autograd.DeviceType.CPU
    steps_ev = [e for e in prof.events() if e.name == STEP and e.device_type == cpu]
    return _per_step(((e.name, e.cpu_time_total) for step in steps_ev for e in step.cpu_children), steps)


def device_kernels(prof, steps: int) -> list[tuple[str, float, float]]:
    """The GPU kernels of the profiled steps (a CUDA graph's too; not the step's own GPU-side range)."""
    cuda = torch.autograd.DeviceType.CUDA
    return _per_step(
        ((e.name, e.device_time) for e in prof.events() if e.device_type == cuda and e.name != STEP), steps
    )


def summarise(prof, device: bool, steps: int) -> dict:
    """Per step: kernels (`device`: CUDA) or top-level CPU events, their busy time, the top ones by time."""
    top = device_kernels(prof, steps) if device else host_events(prof, steps)
    return {"per_step": sum(n for _, n, _ in top), "busy_ms": sum(us for *_, us in top) / 1e3, "top": top}


def short(name: str, width: int = 90) -> str:
    return name if len(name) <= width else name[: width - 3] + "..."


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description="Kernels (CUDA) or ops (CPU) per decode step, busy time and the top kernels, per mode.",
        epilog=__doc__.split("\n\n", 3)[3] if __doc__ else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--size", default="bench-overhead", help="named size (configs/model_sizes.yaml)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--prompt-len", type=int, default=16, help="prompt tokens per row")
    p.add_argument("--modes", type=name_list, default="eager,ge_graph,decoder", help="eager, ge_graph, plans")
    p.add_argument("--steps", type=int, default=8, help="decode steps profiled per mode")
    p.add_argument("--warmup", type=int, default=3, help="decode steps before profiling (the first compiles)")
    p.add_argument("--timed", type=int, default=32, help="decode steps timed without the profiler, before it")
    p.add_argument("--top", type=int, default=12, help="kernels listed per mode")
    p.add_argument("--trace-dir", default="", help="also write each mode's chrome trace here")
    p.add_argument("--perf", action="store_true", help="CPU: sample the steps with Linux perf, by thread and library")
    args = p.parse_args(argv)
    if args.perf and args.device != "cpu":
        p.error("--perf: CPU only (on CUDA the profiler already sees each kernel)")
    if args.perf and args.trace_dir:
        p.error("--perf and --trace-dir: a perf run writes no chrome trace; drop one")
    modes = args.modes
    for m in modes:
        if m not in ("eager", "ge_graph") and m not in PLANS:
            p.error(f"--modes: unknown mode {m!r}; use eager, ge_graph or a plan ({', '.join(PLANS)})")
    named_size(args.size, "--size")  # said as the option the user typed, not the config key it becomes
    if args.perf:
        require_perf()  # before any model is built
    what = "GPU kernels" if args.device == "cuda" else "top-level CPU events"
    if args.perf:
        what = "perf samples by thread and shared object"
    print(f"{args.size}, {args.dtype}, batch {args.batch}, {args.prompt_len}-token prompt, {args.device}; "
          f"{args.steps} profiled steps per mode; rows: {what}")  # fmt: skip
    for mode in modes:
        s = profile_mode(args, mode)
        plain = f"{s['plain_ms']:.3f} ms/step (median of {args.timed}), " if s["plain_ms"] else ""
        if "perf" in s:
            print(f"\n== {mode}: wall {plain}{s['wall_ms']:.3f} under perf; warm-up {s['compile_s']:.1f} s")
            print(f"   {'thread':<9} {'CPU ms/step':>11} {'share':>6}  shared object")
            for thread, grp, ms, share in s["perf"]:
                print(f"   {thread:<9} {ms:11.3f} {share:6.1%}  {grp}")
            continue
        print(
            f"\n== {mode}: wall {plain}{s['wall_ms']:.3f} under the profiler; "
            f"{s['per_step']:.0f} {what}/step, busy {s['busy_ms']:.3f} ms/step; warm-up {s['compile_s']:.1f} s"
        )
        print(f"   {'per step':>8} {'us/step':>9} {'us each':>8}  name")
        for name, n, us in s["top"][: args.top]:
            print(f"   {n:8.1f} {us:9.1f} {us / n:8.2f}  {short(name)}")
        if args.device == "cuda":
            print("   host (top-level CPU events of a step, their CPU time):")
            for name, n, us in s["host"][: args.top // 2]:
                print(f"   {n:8.1f} {us:9.1f} {us / n:8.2f}  {short(name)}")
    return 0


if __name__ == "__main__":
    sys.exit(guarded(main))
