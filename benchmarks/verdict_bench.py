"""How often sk_compare's and scope_search's noise verdict says "beyond the noise", by simulation.

Why: the verdict (`executor.stats.exceeds_noise`) decides what the headline tool reports and
whether scope_search may apply a winner. Its two error rates depend on the number of runs and on
how the noise looks, and neither can be read off the rule. On a shared VM the noise is not only
a few percent of jitter: now and then a whole process runs slow (a neighbour, a cold page cache),
1.5-2.5x its usual step. This benchmark draws both sides' run times from that model, for each run
count and true gain, and prints how often the rule calls the difference real:

- at gain 0 that is the false-positive rate (a verdict for a difference that is not there);
- at a real gain it is the power (how often a real speedup gets its verdict).

  python benchmarks/verdict_bench.py
  python benchmarks/verdict_bench.py --runs 3,5 --gains 0,10 --slow 0,0.3 --trials 20000

Deterministic for a given --seed; the default table takes about 15 s.
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.cli import float_list, int_list
from executor.stats import exceeds_noise


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int_list, default="2,3,5,7,10", help="runs per side (default: 2,3,5,7,10)")
    p.add_argument("--gains", type=float_list, default="0,5,20", help="true latency gains in %% (default: 0,5,20)")
    p.add_argument("--slow", type=float_list, default="0,0.15", help="share of slow processes (default: 0,0.15)")
    p.add_argument("--jitter", type=float, default=5.0, help="run-to-run std in percent of the step (default: 5)")
    p.add_argument("--trials", type=int, default=5000, help="simulated comparisons per cell (default: 5000)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.trials < 1 or not all(0 <= s <= 1 for s in args.slow) or max(args.gains) >= 100 or args.jitter < 0:
        p.error("--trials must be >= 1, --slow between 0 and 1, --gains below 100 and --jitter >= 0")
    return args


def side(rng: random.Random, n: int, step: float, jitter: float, slow: float) -> list[float]:
    """n run times around `step`: Gaussian jitter, and a process slowed 1.5-2.5x with probability `slow`."""
    return [
        step * (1 + rng.gauss(0, jitter)) * (rng.uniform(1.5, 2.5) if rng.random() < slow else 1.0) for _ in range(n)
    ]


def main(argv=None) -> int:
    args = parse_args(argv)
    rng = random.Random(args.seed)
    print(f"jitter {args.jitter:g}% std, a slow process 1.5-2.5x, {args.trials} comparisons a cell, seed {args.seed}")
    print(f"{'runs a side':>11} {'slow share':>10} {'true gain':>9} {'says beyond the noise':>22}")
    for n in args.runs:
        for slow in args.slow:
            for gain in args.gains:
                hits = sum(
                    exceeds_noise(
                        side(rng, n, 1.0, args.jitter / 100, slow),
                        side(rng, n, 1.0 - gain / 100, args.jitter / 100, slow),
                    )
                    for _ in range(args.trials)
                )
                print(f"{n:>11} {slow:>10.2f} {gain:>8g}% {hits / args.trials:>22.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
