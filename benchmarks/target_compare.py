"""Target cards compared (`python benchmarks/targets.py --compare BEFORE AFTER [MORE]`). Two: which
cells crossed their limit, which moved by more than the noise, and which only one card has. Three or
more: each cell's range across them and how often it was met.

Why: a change to a kernel or a runner default is checked by running the targets again, and two
51-row cards are not read side by side by eye. The seventieth pass's card read bf16 batch 1 at
1.12x / 1.19x where the sixty-eighth pass's sweep had read 1.06x / 1.07x; the question "did a
commit in between cost 5%?" needs exactly this table (BENCHMARKS.md, "seventy-first pass").

Each card's cells are judged again from the run records in its directory, with this tree's judges,
so a card written before a judge changed (the margin field came after the first cards) compares on
the same terms; a run that failed keeps the tables it finished and its failed cell, as on its card
(targets.cells_of, the card's own code). A cell's margin is its reading over its limit
(1.0 at the limit, lower is better, for every target), so the change is after / before of margins.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from benchmarks.targets import Cell, Run, cells_of, margin_axes

NOISE = 0.10  # a margin that moved by more than this is listed as moved (decode_bench's `?` is 15% of a rate)


@dataclass
class Side:
    """One card: where it is, its machine, and its cells by (target, cell name)."""

    path: Path
    machine: str
    cells: dict[tuple[int, str], Cell]
    argv: dict[str, list[str]]  # each run's arguments, by run name
    tree: str = ""  # the commit the card measured ("" on cards before it was recorded)


class CardError(ValueError):
    """A path that is not a targets card: its one line."""


def load(path: str) -> Side:
    """The card in `path` (its directory, or its targets.json), its cells judged again from its records."""
    where = Path(path)
    where = where.parent if where.is_file() else where  # its targets.json (or another file of it) named
    card_file = where / "targets.json"
    if not card_file.is_file():
        raise CardError(f"{path}: no targets card (targets.json); name the --out directory of a targets.py run")
    cells: dict[tuple[int, str], Cell] = {}
    try:
        card = json.loads(card_file.read_text(encoding="utf-8"))
        runs, machine = card["runs"], card["machine"]
        # the targets that card asked for: its cells name them (a decode run reads 1 and 2, asked or not)
        asked = tuple(sorted({c["target"] for c in card.get("cells", [])} or {t for r in runs for t in r["targets"]}))
        for run in runs:  # as the card made them: a failed run's finished tables and its failed cell
            cells |= {(c.target, c.cell): c for c in cells_of(Run(**run), where, asked)}
    except (KeyError, TypeError, ValueError) as exc:  # ValueError: JSON that does not parse
        why = f"{type(exc).__name__}: {exc}"
        raise CardError(f"{card_file}: not a targets card, or a record of it is not ({why})") from None
    return Side(where, machine, cells, {r["name"]: list(r.get("argv", [])) for r in runs}, card.get("tree", ""))


def _flags(argv: list[str]) -> dict[str, str]:
    """--flag value pairs of a run's arguments ("" for a flag without a value)."""
    flags, key = {}, None
    for word in argv:
        if word.startswith("--"):
            key = word
            flags[key] = ""
        elif key is not None:
            flags[key] = f"{flags[key]} {word}".strip()
    return flags


def other_settings(before: Side, after: Side) -> list[str]:
    """The runs both cards have whose arguments differ, each with the flags that differ: another
    --size or --quick makes a cell of the same name another measurement."""
    said = []
    for name in (n for n in after.argv if n in before.argv and after.argv[n] != before.argv[n]):
        b, a = _flags(before.argv[name]), _flags(after.argv[name])
        diff = [f"{k} {b.get(k, '(none)') or '(set)'} -> {a.get(k, '(none)') or '(set)'}"
                for k in dict.fromkeys([*b, *a]) if b.get(k) != a.get(k)]  # fmt: skip
        said.append(f"{name}: {', '.join(diff)}")
    return said


def change(before: Cell, after: Cell) -> float | None:
    """after / before of the two margins (below 1: nearer the limit's good side), None where either
    has no margin (target 7's ratios are reported, not judged)."""
    if before.margin is None or after.margin is None:
        return None
    return after.margin / before.margin


def _verdict(before: Cell, after: Cell) -> str:
    if before.met is None or after.met is None or before.met == after.met:
        return after.verdict.replace("**", "")
    return "**now met**" if after.met else "**now not met**"


def markdown(before: Side, after: Side, noise: float = NOISE) -> str:
    """The comparison as markdown: a row per cell both cards have, then the crossings, the moves past
    `noise`, and the cells only one card has."""
    lines = [f"# Targets: {after.path} against {before.path}", ""]
    trees = [f"{name} {side.tree or 'not recorded'}" for name, side in (("before", before), ("after", after))]
    lines += [f"Trees: {'; '.join(trees)}.", ""]
    if before.machine != after.machine:
        lines += [f"**Different machines** ({before.machine}; {after.machine}): these ratios compare two kinds,"
                  " not a change.", ""]  # fmt: skip
    else:
        lines += [f"Machine: {after.machine}.", ""]
    if settings := other_settings(before, after):
        lines += ["**Runs with other arguments** (another --size or --quick measures something else under the same"
                  " cell names):"]  # fmt: skip
        lines += [f"- {line}" for line in settings] + [""]
    lines += ["| target | cell | before | after | after / before (margin) | verdict |", "|---|---|---|---|---|---|"]
    both = [k for k in after.cells if k in before.cells]
    moved, crossed = [], []
    for key in sorted(both, key=lambda k: k[0]):
        b, a = before.cells[key], after.cells[key]
        ratio = change(b, a)
        shown = "-" if ratio is None else f"{ratio:.3f}"
        if ratio is not None and abs(ratio - 1.0) > noise:
            moved.append(f"{key[0]}: {key[1]} ({ratio:.2f}, {'worse' if ratio > 1 else 'better'})")
            shown = f"**{shown}**"
        if b.met is not None and a.met is not None and b.met != a.met:
            crossed.append(f"{key[0]}: {key[1]} ({'now met' if a.met else 'now not met'})")
        lines.append(f"| {key[0]} | {key[1]} | {b.reading} | {a.reading} | {shown} | {_verdict(b, a)} |")
    lines += ["", f"{len(both)} cells in both cards; margin = reading / limit, so above 1.000 is worse."]
    lines.append("Crossed their limit: " + ("; ".join(crossed) if crossed else "none") + ".")
    lines.append(f"Moved by more than {noise:.0%}: " + ("; ".join(moved) if moved else "none") + ".")
    for side, other, name in ((before, after, "before"), (after, before, "after")):
        only = sorted(k for k in side.cells if k not in other.cells)
        if len(only) > 6:  # a card of fewer targets against a whole one: counts, not 40 names
            per = {t: sum(1 for k in only if k[0] == t) for t in sorted({k[0] for k in only})}
            lines.append(f"Only {name} ({len(only)}): " + ", ".join(f"{n} of target {t}" for t, n in per.items()) + ".")
        elif only:
            lines.append(f"Only {name} ({len(only)}): " + "; ".join(f"{t}: {c}" for t, c in only) + ".")
    lines.append("One run each side: a move inside the cards' own spread (`?`, or the passes' noise in"
                 " BENCHMARKS.md) is not a change until it repeats.")  # fmt: skip
    return "\n".join(lines) + "\n"


def spread_markdown(sides: list[Side]) -> str:
    """Three or more cards (runs of one tree, or a series of changes): each judged cell's reading in
    each card, its margin's range, and in how many it was met. Why: one card cannot tell a cell at
    1.33x of a 1.3x limit from noise; on Zen 4 the same tree read bf16 batch 1 at 1.07x in one run and
    1.19x an hour later (BENCHMARKS.md, "seventy-first pass"), so a cell is settled by how it reads
    across runs, not by one."""
    lines = ["# Targets across cards", ""]
    lines += [f"{i}. {side.path} (tree {side.tree or 'not recorded'})" for i, side in enumerate(sides, 1)] + [""]
    machines = list(dict.fromkeys(side.machine for side in sides))
    lines += [f"**Different machines**: {'; '.join(machines)}.", ""] if len(machines) > 1 else []
    lines += [f"Machine: {machines[0]}.", ""] if len(machines) == 1 else []
    judged = (k for side in sides for k, c in side.cells.items() if c.margin is not None)
    keys = sorted(dict.fromkeys(judged), key=lambda k: k[0])  # the cards' own order within a target
    head = " | ".join(str(i) for i in range(1, len(sides) + 1))
    lines += [f"| target | cell | {head} | margin range | met in |", "|---|---|" + "---|" * len(sides) + "---|---|"]
    settled_not, unsettled = [], []
    for key in keys:
        cells = [side.cells.get(key) for side in sides]
        read = [c for c in cells if c is not None and c.margin is not None]
        shown = " | ".join(c.reading.split(" ")[0] if c is not None else "-" for c in cells)
        met = sum(bool(c.met) for c in read)
        span = f"{min(c.margin for c in read):.3f}-{max(c.margin for c in read):.3f}"
        lines.append(f"| {key[0]} | {key[1]} | {shown} | {span} | {met} of {len(read)} |")
        name = f"{key[0]}: {key[1]}"
        if met == 0 and len(read) > 1:
            settled_not.append(name)
        elif 0 < met < len(read):
            unsettled.append(name)
    lines += ["", "margin = reading / limit (above 1.000 is not met); a card without the cell reads `-`."]
    lines.append("Not met in any card that read it: " + ("; ".join(settled_not) or "none") + ".")
    lines.append(
        "Met in some cards, not in others (within these runs' noise): " + ("; ".join(unsettled) or "none") + "."
    )
    return "\n".join(lines) + "\n"


def plot(sides: list[Side], path: Path) -> None:
    """Each judged cell of the last card: its margin in every card that read it, the earlier ones grey,
    the last green (met) or red (not), joined by their range; the limit at 1.0. Why a picture: a
    change that moves many cells a little reads as a slope here, and noise as a wide range."""
    last = sides[-1]
    keys = sorted((k for k, c in last.cells.items() if c.margin is not None
                   and any(k in s.cells and s.cells[k].margin is not None for s in sides[:-1])),
                  key=lambda k: k[0])  # fmt: skip
    if not keys:
        raise CardError("no judged cell is in the last card and an earlier one: nothing to plot")
    xlabel = "reading / limit (1.0 = at the limit); grey: earlier cards, colour: the last (green met, red not)"
    title = " -> ".join("/".join(s.path.parts[-2:]) for s in sides)  # "full" is many runs' name
    with margin_axes([f"{t}: {c}" for t, c in keys], title, xlabel, path) as (ax, ys):
        for y, key in zip(ys, keys):
            earlier = [s.cells[key].margin for s in sides[:-1] if key in s.cells and s.cells[key].margin is not None]
            now = last.cells[key].margin
            ax.plot([min(*earlier, now), max(*earlier, now)], [y, y], color="0.7", linewidth=1.5, zorder=1)
            ax.scatter(earlier, [y] * len(earlier), color="0.55", s=18, zorder=2)
            ax.scatter([now], [y], color="tab:green" if last.cells[key].met else "tab:red", s=22, zorder=3)
