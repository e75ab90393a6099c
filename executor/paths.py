"""Where things live in the repository, and where results go.

One module for paths so that no other module (arch, runner, tools) owns the repository root,
and every command names its result directory the same way: `models/<recipe>/res/<date>/<case>/`,
as cann-recipes-infer does.
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
from collections.abc import Iterator
from pathlib import Path

from executor.errors import RecipeError

REPO_ROOT = Path(__file__).resolve().parent.parent
MODELS_DIR = REPO_ROOT / "models"
CONFIGS_DIR = REPO_ROOT / "configs"


def results_dir(recipe: str, case: str, now: datetime.datetime | None = None) -> Path:
    """`models/<recipe>/res/<YYYY-MM-DD>/<case>_<HHMMSS>/`: the default output of a run or tool,
    created here, empty. `_2`, `_3`, ... are appended when that name is taken.

    Why created here: the name is only as fine as the clock's second, and two commands started
    in the same second (a script, two test workers) would otherwise pick the same directory and
    the second would be refused (claim_output_dir) for a name neither user chose."""
    now = now or datetime.datetime.now()
    day = MODELS_DIR / recipe / "res" / f"{now:%Y-%m-%d}"
    name = f"{case}_{now:%H%M%S}"
    path, n = day / name, 1
    while True:
        try:
            path.mkdir(parents=True)
            return path
        except FileExistsError:
            n += 1
            path = day / f"{name}_{n}"
        except OSError as exc:
            raise OutputDirError(f"results directory {path} cannot be created ({exc.strerror}); use --out") from None


class OutputDirError(RecipeError):
    """An output directory that cannot be used: a file, not writable, or another run's results."""


# The file that marks a directory as holding a command's results, and whose they are.
RESULT_MARKERS = {
    "metrics.json": "a run of bash infer.sh",
    "results.json": "an sk_compare report",
    "search_status.json": "a scope_search search",
}


@contextlib.contextmanager
def claim_output_dir(
    out: Path, results: str | None, option: str = "--out", resumes: str | None = None
) -> Iterator[Path]:
    """Create `out` and hold it for one command while the `with` block runs.

    A directory that already holds a finished run's `results` file is refused, so two runs
    given the same --out never overwrite each other's results, and so is one holding another
    command's results (RESULT_MARKERS), except the marker `resumes` of a command that continues
    its own unfinished work there (scope_search). One that another live process is writing to
    is refused too (an flock on `out/.lock`, released when the command ends, also if it
    crashes). A run that failed before writing its results leaves the directory usable."""
    if out.exists() and not out.is_dir():
        raise OutputDirError(f"{option} {out} is a file, not a directory")
    if results is not None and (out / results).exists():
        raise OutputDirError(
            f"{option} {out} already holds a run ({results} exists); choose another directory or remove that one"
        )
    for marker, whose in RESULT_MARKERS.items():
        if marker not in (results, resumes) and (out / marker).exists():
            raise OutputDirError(
                f"{option} {out} holds the results of {whose} ({marker} exists); choose another directory"
            )
    try:
        out.mkdir(parents=True, exist_ok=True)
        lock = open(out / ".lock", "w")  # noqa: SIM115 (held until the block ends)
    except OSError as exc:
        raise OutputDirError(f"{option} {out} cannot be written ({exc.strerror})") from None
    try:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise OutputDirError(
                f"{option} {out} is in use by another run right now; choose another directory"
            ) from None
        yield out
    finally:
        lock.close()
