"""Argument types shared by the benchmarks' command lines, the paired ratio of their tables, and
their --json records.

Why: a comma list parsed after argparse (`[int(x) for x in text.split(",")]`) turned a typo such
as `--batch 1,x` into a ValueError traceback. As an argparse type, a bad value is argparse's own
usage line naming the option (exit 2), like every other bad argument. No torch import here: the
load bench's parent process parses with it and must stay free of torch and executor.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from collections.abc import Callable
from pathlib import Path


def int_list(text: str) -> list[int]:
    """A comma list of positive integers, e.g. "1,4,16,64" (argparse applies it to string defaults too)."""
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma list of positive integers, got {text!r}") from None
    if min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def float_list(text: str) -> list[float]:
    """A comma list of numbers, e.g. "0,5,20" (blanks dropped; an empty list is an error)."""
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma list of numbers, got {text!r}") from None
    if not values:
        raise argparse.ArgumentTypeError(f"expected a comma list of numbers, got {text!r}")
    return values


def name_list(text: str) -> list[str]:
    """A comma list of names, blanks dropped ("eager, ge_graph" -> ["eager", "ge_graph"])."""
    return [x.strip() for x in text.split(",") if x.strip()]


# Packages a benchmark needs beyond what `bash infer.sh` installs, and why: the test extras bring them.
OPTIONAL = {
    "transformers": "the reference peer, and the writer of the benchmark's random checkpoint (save_pretrained)",
}


def guarded(main: Callable[[], int]) -> int:
    """Run a benchmark's main: a RecipeError (an unknown size or recipe, a bad config value, a
    missing checkpoint) is its one line and exit 2, as in infer.sh and the tools. So is a package
    of OPTIONAL that is not installed: after `bash infer.sh` alone, decode_bench stopped with a
    ModuleNotFoundError traceback from inside make_checkpoint."""
    from executor.errors import RecipeError  # here, not at the top: see the module docstring

    try:
        return main()
    except RecipeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as exc:
        top = (exc.name or "").split(".")[0]
        if top not in OPTIONAL:
            raise
        print(
            f"error: this benchmark needs {top} ({OPTIONAL[top]}), which is not installed;"
            " install the test extras: pip install -e '.[test]'",
            file=sys.stderr,
        )
        return 2


def paired(base: list[float], other: list[float]) -> str:
    """base / other within each round: "median (min-max)". Why within a round: the VM's speed
    drifts by 1.5x or more within minutes, and a round's two timings share its speed; a ratio of
    the two overall medians would carry the drift (BENCHMARKS.md, "twenty-third pass")."""
    ratios = round_ratios(base, other)
    return f"{statistics.median(ratios):.3f} ({ratios[0]:.2f}-{ratios[-1]:.2f})"


def round_ratios(base: list[float], other: list[float]) -> list[float]:
    """base / other within each round, sorted (paired's numbers, for --json records)."""
    return sorted(b / o for b, o in zip(base, other, strict=True))


def json_path(text: str) -> str:
    """--json's file, checked before anything is measured: the record is first written after the first
    table, minutes in, and a directory or an unwritable place then was a traceback that lost them."""
    path = Path(text).absolute()
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a directory; name a file")
    where = path.parent
    while not where.exists():  # write_json makes the missing directories
        where = where.parent
    if not where.is_dir() or not os.access(where, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: {where} is not a writable directory")
    return text


def write_json(path: str | None, record: dict) -> None:
    """A benchmark's --json record, written whole (a temporary file renamed over the old one), so a
    reader such as benchmarks/targets.py never sees half a file. Called after each table, not once at
    the end: a run stopped an hour in keeps what it measured. None: no --json asked, nothing written."""
    if not path:
        return
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp")
    tmp.write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
    os.replace(tmp, target)
