"""Where things live in the repository, and where results go.

One module for paths so that no other module (arch, runner, tools) owns the repository root,
and every command names its result directory the same way: `models/<recipe>/res/<date>/<case>/`,
as cann-recipes-infer does.
"""

from __future__ import annotations

import datetime
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
MODELS_DIR = REPO_ROOT / "models"
CONFIGS_DIR = REPO_ROOT / "configs"


def results_dir(recipe: str, case: str, now: datetime.datetime | None = None) -> Path:
    """`models/<recipe>/res/<YYYY-MM-DD>/<case>_<HHMMSS>/`: the default output of a run or tool."""
    now = now or datetime.datetime.now()
    return MODELS_DIR / recipe / "res" / f"{now:%Y-%m-%d}" / f"{case}_{now:%H%M%S}"
