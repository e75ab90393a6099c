"""Can this CPU stream a weight from memory while it computes? A decode GEMM loop's two parts, apart
and together, from a C++ probe (benchmarks/csrc/overlap_probe.cpp, built here for this CPU).

Why: target 2's roofline for a batched decode step is max(bytes / read rate, FLOPs / matmul rate).
A loop reaches the max only if the weight's stream and its arithmetic overlap; if they take turns,
its floor is their sum. At fp32 16 rows on the Intel AMX kind the two are close (a read of ~80 ms,
arithmetic of ~57 ms a step), so the max is ~80 ms and the sum ~140: the step's 1.8x there is a
question of overlap, not of either rate. This answers it for the CPU it runs on, with the loops of
this project's packed-weight kernels on a cold weight (on 2 MiB pages, as the runner places them):
- fp32: rows_linear's fp32 loop (tiles of up to 6 rows, four vectors of columns a block);
- amx (a CPU with AMX-BF16): amx_linear's bf16 loop itself (executor/custom_ops/csrc/amx_tiles.h; tiles of
  up to 16 rows, four 16-column products).
In both, each block of weight is read from memory by its first tile of rows and from L2 by the
others. Each round measures, in turn, on --threads threads:
- stream: a plain sum over the weight (GB/s);
- compute: every tile of rows on one block a thread, over and over, from L2 (GFLOP/s);
- pass: the loop over the whole weight without software prefetch, and pass+pf with the kernel's
  (fp32: every tile asks for its share of the next block's lines into L2, a lone tile for its own
  block 32 steps ahead; amx: the first tile asks for the weight 4 KB ahead into L1).
The table gives the medians (the first round dropped as a warm-up), the rates two bounds predict
for the pass: `serial` (stream time plus compute time) and `overlapped` (the larger of the two),
and `overlap`: how much of the way from serial to overlapped the faster pass got (0: none, 1: all).
A loop below serial loses time beyond the two parts (a stream slower inside the loop than alone).
For fp32 a last line says what asking costs a core: a 6-row tile on a block in L2, alone and asking
for one line of a cold stream each k step (into L2), its GFLOP/s both ways and the rate of the lines
asked for (asked, not seen to arrive).

  python benchmarks/overlap_bench.py
  python benchmarks/overlap_bench.py --loops amx --rows 16,32,64 --rounds 9 --mbytes 1024
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.cli import guarded, int_list, json_path, name_list, write_json  # noqa: E402
from executor.custom_ops._build import CSRC, compiler, cpu_has_amx  # noqa: E402
from executor.errors import RecipeError  # noqa: E402

PROBE = ROOT / "benchmarks" / "csrc" / "overlap_probe.cpp"
LOOPS = {"fp32": 4, "amx": 2}  # the loops the probe has, and the bytes of one weight value in each
KEYS = ("stream", "compute", "pass", "pass_pf")  # every loop's; fp32 adds ASKING
ASKING = ("alone6", "asking_compute", "asking_stream")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--loops", type=name_list, help="comma list of fp32, amx (default: fp32, and amx where the CPU has it)"
    )
    p.add_argument("--rows", type=int_list, default="4,16,64", help="comma list of row counts M (the decode batch)")
    p.add_argument("--mbytes", type=int, default=768, help="size of the packed weight in MiB (far past the caches)")
    p.add_argument("--rounds", type=int, default=7, help="rounds per row count; the first is a warm-up")
    cpus = len(os.sched_getaffinity(0))
    p.add_argument("--threads", type=int, default=cpus, help="threads (default: this process's CPUs)")
    p.add_argument("--json", type=json_path, help="also write the table to this file")
    args = p.parse_args(argv)
    if args.rounds < 2 or args.threads < 1 or args.mbytes < 1:
        p.error(
            f"--rounds (2 or more), --threads, --mbytes (1 or more): got {args.rounds}, {args.threads}, {args.mbytes}"
        )
    if args.loops is None:
        args.loops = ["fp32", "amx"] if cpu_has_amx() else ["fp32"]
    unknown = [x for x in args.loops if x not in LOOPS]
    if unknown or not args.loops:
        p.error(f"--loops: unknown {unknown}; known: {', '.join(LOOPS)}")
    return args


def build(where: Path) -> Path:
    """The probe compiled for this CPU (-march=native) with the compiler the kernels are built with
    ($CXX, else c++), amx_tiles.h from the kernels' headers (CSRC)."""
    cxx = compiler()
    exe = where / "overlap_probe"
    cmd = [cxx, "-O3", "-march=native", "-std=c++17", "-pthread", f"-I{CSRC}", str(PROBE), "-o", str(exe)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    except OSError as exc:  # $CXX names no program
        raise RecipeError(f"overlap_bench: {cxx} could not build {PROBE.name}: {exc.strerror}") from None
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise RecipeError(f"overlap_bench: {cxx} could not build {PROBE.name}: {last}")
    return exe


def probe(exe: Path, loop: str, rows: int, mbytes: int, rounds: int, threads: int) -> dict[str, float]:
    """The medians of the probe's rounds after the first, by key."""
    argv = [str(exe), loop, str(rows), str(mbytes), str(rounds), str(threads)]
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        why = done.stderr.strip() or f"exit status {done.returncode}"
        raise RecipeError(f"overlap_bench: the probe failed ({loop}, {rows} rows): {why}")
    seen: dict[str, list[float]] = {}
    for line in done.stdout.splitlines():
        words = line.split()
        if words[:1] == ["round"] and words[1] != "0":
            for key, value in zip(words[2::2], words[3::2], strict=True):
                seen.setdefault(key, []).append(float(value))
    return {k: statistics.median(v) for k, v in seen.items()}


def bounds(rows: int, value_bytes: int, got: dict[str, float]) -> dict[str, float]:
    """What the two parts predict for the pass, in GB/s of weight (2 * rows FLOPs a weight value)."""
    per_byte = 2 * rows / value_bytes
    t_read, t_math = 1 / got["stream"], per_byte / got["compute"]  # seconds a GB
    serial, overlapped = 1 / (t_read + t_math), 1 / max(t_read, t_math)
    best = max(got["pass"], got["pass_pf"])
    share = (1 / serial - 1 / best) / (1 / serial - 1 / overlapped)
    return {"serial": serial, "overlapped": overlapped, "overlap": share}


def main(argv=None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="overlap_probe_") as tmp:
        exe = build(Path(tmp))
        print(
            f"# overlap_bench: a {args.mbytes} MiB packed weight on 2 MiB pages, {args.threads} threads, "
            f"{args.rounds - 1} rounds after a warm-up (medians)"
        )
        print(
            "| loop | rows | stream GB/s | compute GFLOP/s | pass GB/s | pass+pf GB/s | serial GB/s "
            "| overlapped GB/s | overlap |"
        )
        print("|---|---|---|---|---|---|---|---|---|")
        record = []
        for loop in args.loops:
            for rows in args.rows:
                got = probe(exe, loop, rows, args.mbytes, args.rounds, args.threads)
                b = bounds(rows, LOOPS[loop], got)
                print(
                    f"| {loop} | {rows} | {got['stream']:.1f} | {got['compute']:.0f} | {got['pass']:.1f} "
                    f"| {got['pass_pf']:.1f} | {b['serial']:.1f} | {b['overlapped']:.1f} | {b['overlap']:.2f} |",
                    flush=True,
                )
                record.append({"loop": loop, "rows": rows, **got, **b})
                head = {"threads": args.threads, "mbytes": args.mbytes, "rounds": args.rounds}
                write_json(args.json, {**head, "rows": record})
        fp32 = [r for r in record if r["loop"] == "fp32"]
        if fp32:
            ask = {k: statistics.median(r[k] for r in fp32) for k in ASKING}
            print(
                f"fp32: a 6-row tile on a block in L2 ran {ask['alone6']:.0f} GFLOP/s alone, "
                f"{ask['asking_compute']:.0f} while asking for one line of a cold stream a k step; the lines asked "
                f"for came to {ask['asking_stream']:.1f} GB/s (medians over the row counts' runs)"
            )
    return 0


if __name__ == "__main__":
    sys.exit(guarded(main))
