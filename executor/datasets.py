"""Where a run's prompts come from: `data_config.dataset`, as in cann-recipes-infer.

- "default": the YAML's own `data_config.prompts` (upstream reads a default prompt file; a
  recipe here carries its prompts in the YAML so one file says everything about a run);
- "LongBench": a LOCAL copy of the LongBench benchmark (nothing is downloaded at run time). Put
  its JSONL files (one JSON object per line with a "context" field, as LongBench ships them)
  in `data_config.dataset_path`, default `<repo>/dataset/LongBench/` (upstream's location);
  every file's contexts are used, files in name order;
- anything else: a UTF-8 text file with one prompt per line (blank lines skipped).

Batch rows cycle through the prompts.
"""

from __future__ import annotations

import json
from pathlib import Path

from executor.config import ConfigError, DataConfig, read_text_file
from executor.paths import REPO_ROOT

LONGBENCH_DIR = REPO_ROOT / "dataset" / "LongBench"


def load_prompts(dc: DataConfig, batch_size: int) -> list[str]:
    """`batch_size` prompts for the run (rows cycle through the dataset's prompts)."""
    if dc.dataset == "default":
        prompts = list(dc.prompts)
    elif dc.dataset == "LongBench":
        prompts = _longbench(Path(dc.dataset_path) if dc.dataset_path else LONGBENCH_DIR)
    else:
        text = read_text_file(Path(dc.dataset), "data_config.dataset")
        prompts = [line for line in text.splitlines() if line.strip()]
        if not prompts:
            raise ConfigError(f"data_config.dataset: {dc.dataset} has no prompt (every line is blank)")
    return [prompts[i % len(prompts)] for i in range(batch_size)]


def _longbench(root: Path) -> list[str]:
    if root.exists() and not root.is_dir():
        raise ConfigError(f"data_config.dataset_path {root} is a file, not the directory of a LongBench copy")
    files = sorted(root.rglob("*.jsonl")) if root.is_dir() else []
    if not files:
        raise ConfigError(
            f"data_config.dataset: LongBench needs a local copy: no *.jsonl files under {root} "
            "(put LongBench's data/*.jsonl there or set data_config.dataset_path)"
        )
    prompts = []
    for path in files:
        for n, line in enumerate(read_text_file(path, "LongBench file").splitlines(), 1):
            if not line.strip():
                continue
            try:
                context = json.loads(line)["context"]
            except (json.JSONDecodeError, KeyError, TypeError):
                raise ConfigError(f"{path}:{n}: not a LongBench record (a JSON object with a 'context')") from None
            if isinstance(context, str) and context.strip():
                prompts.append(context)
    if not prompts:
        raise ConfigError(f"data_config.dataset: the LongBench files under {root} hold no context")
    return prompts
