"""Timing log lines: the one place that formats, parses and averages them.

The runner writes these lines and the tools (sk_compare, scope_search) read them back, so
both sides import this module; a format change in one place can then never silently break
the other. The formats are the verbatim cann-recipes-infer ones, so logs from the upstream
executor parse too::

    <model> inference time cost of prefill is 41.12 ms
    <model> inference time cost of decode is 15.48 ms        (one per decode step)
    <model> average inference time cost is 15.51 ms
    <model> decode average inference time cost is 15.51 ms   (upstream offline variant)
    <model> decode throughput is 64.52 tokens/s              (ours)
    <model> batch size is 1, decode steps is 255             (ours)

Parsing is per line and tolerant of what real logs add around these lines: ANSI colours,
logger prefixes (level, timestamp, rank), ``ms`` with or without a space, ints or floats,
CRLF line endings.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from executor.errors import RecipeError

__all__ = [
    "LogParseError",
    "ParsedLog",
    "decode_average_ms",
    "format_average",
    "format_decode",
    "format_prefill",
    "format_run_shape",
    "format_throughput",
    "iqr_filter",
    "parse_log",
    "parse_log_file",
]


class LogParseError(RecipeError):
    """A log is missing, unreadable, or lacks the timing a caller needs."""


def format_prefill(model_name: str, ms: float) -> str:
    return f"{model_name} inference time cost of prefill is {ms:.2f} ms"


def format_decode(model_name: str, ms: float) -> str:
    return f"{model_name} inference time cost of decode is {ms:.2f} ms"


def format_average(model_name: str, ms: float) -> str:
    return f"{model_name} average inference time cost is {ms:.2f} ms"


def format_throughput(model_name: str, tokens_per_s: float) -> str:
    return f"{model_name} decode throughput is {tokens_per_s:.2f} tokens/s"


def format_run_shape(model_name: str, batch_size: int, decode_steps: int) -> str:
    return f"{model_name} batch size is {int(batch_size)}, decode steps is {int(decode_steps)}"


def iqr_filter(values: Sequence[float]) -> list[float]:
    """Drop values above Q3 + 1.5*IQR, keeping order (the cann-recipes-infer outlier rule).

    Only the high side is cut: a decode step is only ever slowed down by a one-off event
    (compilation, GC, a page fault), never sped up. With fewer than 4 values the quartiles
    mean nothing, so the values come back unchanged.
    """
    vals = [float(v) for v in values]
    if len(vals) < 4:
        return vals
    q1, q3 = np.percentile(vals, [25, 75])  # numpy's default 'linear' interpolation
    limit = q3 + 1.5 * (q3 - q1)
    return [v for v in vals if v <= limit]


def decode_average_ms(step_ms: Sequence[float]) -> float:
    """Mean decode-step latency after iqr_filter; prefill must not be in ``step_ms``."""
    kept = iqr_filter(step_ms)
    if not kept:
        raise ValueError("decode_average_ms needs at least one decode step")
    return float(np.mean(kept))


# --- parsing -------------------------------------------------------------------------
_ANSI = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]")
# A model name is a whole token: not preceded by a name character, so a prefix such as
# "12:00:00 " or "[INFO]" is never swallowed into it.
_NAME = r"(?<![A-Za-z0-9_.\-])(?P<name>[A-Za-z0-9_.\-]+)"
_NUM = r"(?P<num>[-+]?\d+(?:\.\d*)?(?:[eE][-+]?\d+)?)"
_MS = r"\s*ms\b"
_F = re.IGNORECASE

_PREFILL = re.compile(_NAME + r"\s+inference time cost of prefill is\s*" + _NUM + _MS, _F)
_DECODE = re.compile(_NAME + r"\s+inference time cost of decode is\s*" + _NUM + _MS, _F)
# "decode average ..." and "average ..." must not be taken for one another: the plain
# average refuses the token "decode" as a model name (that is the other line), and the
# decode-average one needs "decode" right before "average".
_DECODE_AVG = re.compile(
    r"(?:" + _NAME + r"\s+)?(?<![A-Za-z0-9_.\-])decode average inference time cost is\s*" + _NUM + _MS, _F
)
_AVG = re.compile(
    r"(?<![A-Za-z0-9_.\-])(?!decode\s+average\b)(?P<name>[A-Za-z0-9_.\-]+)"
    r"\s+average inference time cost is\s*" + _NUM + _MS,
    _F,
)
_TPS = re.compile(_NAME + r"\s+decode throughput is\s*" + _NUM + r"\s*tokens/s", _F)
_SHAPE = re.compile(_NAME + r"\s+batch[ _]size is\s*(?P<bs>\d+)\s*,\s*decode[ _]steps is\s*(?P<steps>\d+)", _F)
# A timing line whatever its value: what the strict patterns above refuse ("nan ms", "inf ms",
# "-- ms") is reported as a rejected line instead of vanishing.
_TIMING_ANY = re.compile(
    r"(?:inference time cost (?:of (?:prefill|decode) )?is|decode throughput is)\s*(?P<value>\S*?)\s*(?:ms|tokens/s)\b",
    _F,
)


@dataclass
class ParsedLog:
    """Everything timing-related found in one log."""

    path: str | None = None
    model_name: str | None = None
    prefill_ms: float | None = None  # first prefill line
    prefill_ms_all: list[float] = field(default_factory=list)
    decode_ms: list[float] = field(default_factory=list)  # per-step lines, in order
    average_ms: float | None = None  # last "average inference time cost is" line
    decode_average_ms: float | None = None  # last "decode average ..." line
    tokens_per_s: float | None = None  # last "decode throughput is" line
    batch_size: int | None = None
    decode_steps: int | None = None
    rejected: list[tuple[int, str]] = field(default_factory=list)  # (line number, why): unusable timing lines
    lines_ignored: int = 0  # lines with no timing at all (logger output, prompts, ...)

    def check_timings(self) -> None:
        """Raise LogParseError naming the first timing line that is not a positive finite number
        (a negative, zero, infinite or NaN step time), with how many such lines the log has."""
        if self.rejected:
            line, why = self.rejected[0]
            more = f" ({len(self.rejected)} such lines in this log)" if len(self.rejected) > 1 else ""
            raise LogParseError(f"{self.path or '<log text>'}:{line}: {why}{more}; timings must be positive numbers")

    def step_ms(self) -> float:
        """Decode latency per step, from the most detailed evidence the log holds.

        Per-step lines are preferred because the average can then be recomputed with the
        same outlier rule whoever wrote the log; the summary lines are the fallback.
        """
        if self.decode_ms:
            return decode_average_ms(self.decode_ms)
        if self.decode_average_ms is not None:
            return self.decode_average_ms
        if self.average_ms is not None:
            return self.average_ms
        raise LogParseError(
            f"{self.path or '<log text>'}: no decode timing found (expected lines like "
            "'<model> inference time cost of decode is X ms' or "
            "'<model> average inference time cost is X ms')"
        )


def parse_log(text: str, path: str | None = None) -> ParsedLog:
    """Parse log text; lines that match no known format are ignored."""
    log = ParsedLog(path=None if path is None else str(path))

    def name(m: re.Match) -> None:
        if log.model_name is None and m.group("name"):
            log.model_name = m.group("name")

    for number, raw in enumerate(_ANSI.sub("", text).splitlines(), 1):
        line = raw.strip()
        m = next((m for m in (rx.search(line) for rx in _TIMINGS) if m), None)
        if m is not None and not (math.isfinite(value := float(m.group("num"))) and value > 0):
            log.rejected.append((number, f"{m.group(0).strip()!r}: {value:g} is not a positive time"))
            continue
        if m is None:
            if loose := _TIMING_ANY.search(line):
                log.rejected.append((number, f"{loose.group(0).strip()!r}: {loose.group('value')!r} is not a number"))
            elif m := _SHAPE.search(line):
                log.batch_size, log.decode_steps = int(m.group("bs")), int(m.group("steps"))
                name(m)
            else:
                log.lines_ignored += 1
            continue
        if m.re is _DECODE:
            log.decode_ms.append(value)
        elif m.re is _PREFILL:
            log.prefill_ms_all.append(value)
            if log.prefill_ms is None:
                log.prefill_ms = value
        elif m.re is _DECODE_AVG:
            log.decode_average_ms = value
        elif m.re is _AVG:
            log.average_ms = value
        else:
            log.tokens_per_s = value
        name(m)
    return log


# In the order a line is tried: a decode line must never be taken for a prefill or average line.
_TIMINGS = (_DECODE, _PREFILL, _DECODE_AVG, _AVG, _TPS)


def parse_log_file(path) -> ParsedLog:
    """Read and parse a log file; LogParseError (naming the path) if it cannot be read."""
    try:
        text = Path(path).read_text(encoding="utf-8", errors="replace")
    except OSError as e:
        raise LogParseError(f"cannot read log file {path}: {e.strerror or e}") from e
    return parse_log(text, str(path))
