"""Round-trip YAML edits of recipe configs: copies for measurement runs, and `--apply`.

Why ruamel.yaml round-trip and not yaml.safe_load + dump: recipe configs are documented in
place (every key carries a comment listing its allowed values). A tool that rewrites the file
must keep those comments and the key order, or users stop trusting it with their configs.

Why backup + temp file + os.replace: the user's config is the one file these tools must never
leave broken. The new text is validated before it replaces the original, the replacement is
atomic (a crash leaves either the old or the new file, never half of one), and the previous
version stays next to it as `<name>.bak-<timestamp>`.
"""

from __future__ import annotations

import datetime
import difflib
import io
import itertools
import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ruamel.yaml import YAML
from ruamel.yaml.comments import CommentedMap, CommentedSeq
from ruamel.yaml.scalarstring import DoubleQuotedScalarString

from executor.config import ConfigError

__all__ = ["ApplyResult", "apply_changes", "edited_text", "unified_diff", "write_copy"]


def _yaml(text: str = "") -> YAML:
    y = YAML()  # round-trip mode: comments, key order and quoting survive
    y.preserve_quotes = True
    y.width = 4096  # never re-wrap long comment-carrying lines
    if text.strip():
        # Keep the file's own list indentation ("    - item" vs "  - item"): ruamel cannot
        # remember it per file, so it is measured and set before dumping.
        y.indent(**_guess_indent(text))
    return y


def _guess_indent(text: str) -> dict[str, int]:
    """Indentation of the first block list under a key: `key:` at column k, `- ` at k + offset."""
    lines = text.splitlines()
    for prev, line in itertools.pairwise(lines):
        m_key = re.match(r"^( *)[^\s#-][^#]*:\s*(#.*)?$", prev)
        m_item = re.match(r"^( *)- ", line)
        if m_key and m_item:
            offset = len(m_item.group(1)) - len(m_key.group(1))
            if offset >= 0:
                return {"mapping": 2, "sequence": offset + 2, "offset": offset}
    return {"mapping": 2, "sequence": 2, "offset": 0}


def _plain_to_yaml(value: Any) -> Any:
    """Lists/dicts from Python become ruamel containers (block style reads best in configs)."""
    if isinstance(value, Mapping):
        out = CommentedMap()
        for k, v in value.items():
            out[k] = _plain_to_yaml(v)
        return out
    if isinstance(value, (list, tuple)):
        seq = CommentedSeq(_plain_to_yaml(v) for v in value)
        if all(not isinstance(v, (Mapping, list, tuple)) for v in value):
            seq.fa.set_flow_style()  # ["layer_*_attn"] stays on one line
        return seq
    if isinstance(value, str):
        # Quoted, like the recipe configs, and because a plain `layer_*_m??` inside a flow
        # list is not valid YAML (`?` is an indicator there).
        return DoubleQuotedScalarString(value)
    return value


def _set(data: CommentedMap, dotted: str, value: Any) -> None:
    node = data
    parts = dotted.split(".")
    for part in parts[:-1]:
        if part not in node or node[part] is None:
            node[part] = CommentedMap()
        node = node[part]
        if not isinstance(node, Mapping):
            raise ConfigError(f"cannot set {dotted}: {part} is not a section")
    node[parts[-1]] = _plain_to_yaml(value)


def _scalar_text(value: Any, old: str) -> str | None:
    """`value` as YAML in the style of the token it replaces (`True` stays capitalised, as the
    SuperKernel workflow's sed edit leaves it); None for values that are not plain scalars."""
    if isinstance(value, bool):
        word = "true" if value else "false"
        return word.capitalize() if old[:1].isupper() else word
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string is a valid double-quoted YAML scalar
    return None


def _edit_in_place(text: str, data: CommentedMap, dotted: str, value: Any) -> str | None:
    """Replace the scalar value of an existing key on its own line, leaving every other byte as
    it was; None when that is not possible (missing key, a block value, a flow collection)."""
    node, parts = data, dotted.split(".")
    for part in parts[:-1]:
        node = node.get(part) if isinstance(node, Mapping) else None
        if not isinstance(node, CommentedMap):
            return None
    key = parts[-1]
    if key not in node or isinstance(node[key], (Mapping, list)):
        return None
    line_no, col = node.lc.value(key)
    lines = text.splitlines(keepends=True)
    line = lines[line_no]
    rest = line[col:]
    m = re.match(r'"(?:[^"\\]|\\.)*"|\'(?:[^\']|\'\')*\'|[^\s#][^#\n]*?(?=\s+#|\s*$)', rest)
    new = _scalar_text(value, m.group(0) if m else "")
    if m is None or new is None:
        return None
    lines[line_no] = line[:col] + new + rest[m.end() :]
    return "".join(lines)


def edited_text(text: str, changes: Mapping[str, Any]) -> str:
    """`text` with each dotted key of `changes` set (missing sections are created).

    A scalar key that is already in the file is changed on its own line and nothing else moves
    (the diff is exactly the changed values, as with the workflow's sed edit); anything else is
    a round-trip edit that keeps comments and order."""
    y = _yaml(text)
    data = y.load(text) if text.strip() else CommentedMap()
    if data is None:
        data = CommentedMap()
    if not isinstance(data, Mapping):
        raise ConfigError("config top level is not a mapping of sections")
    rest = {}
    for key, value in changes.items():
        edited = _edit_in_place(text, data, key, value) if isinstance(data, CommentedMap) else None
        if edited is None:
            rest[key] = value
        else:
            text = edited
            data = y.load(text)
    if not rest:
        return text
    for key, value in rest.items():
        _set(data, key, value)
    buf = io.StringIO()
    y.dump(data, buf)
    # ruamel writes every boolean as true/false: give back lines that differ from the file's own
    # only in that case, so untouched keys stay as the user wrote them (True, False).
    original = {line.lower(): line for line in text.splitlines()}
    lines = [original.get(line.lower(), line) for line in buf.getvalue().splitlines()]
    return "\n".join(lines) + "\n"


def write_copy(src: Path, dst: Path, changes: Mapping[str, Any]) -> Path:
    """Write `src` with `changes` applied to `dst`; `src` is only read."""
    src, dst = Path(src), Path(dst)
    if not src.is_file():
        raise ConfigError(f"config file {src} does not exist")
    dst.parent.mkdir(parents=True, exist_ok=True)
    dst.write_text(edited_text(src.read_text(), changes))
    return dst


def unified_diff(old: str, new: str, old_name: str, new_name: str) -> str:
    return "".join(
        difflib.unified_diff(
            old.splitlines(keepends=True), new.splitlines(keepends=True), fromfile=old_name, tofile=new_name
        )
    )


@dataclass
class ApplyResult:
    path: Path
    backup: Path
    diff: str


def _atomic_write(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        shutil.copymode(path, tmp)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def apply_changes(
    path: Path, changes: Mapping[str, Any], validate: Callable[[Path], None] | None = None
) -> ApplyResult:
    """Edit the config at `path` in place, safely.

    Order: backup copy -> new text written to a temp file next to it and validated there
    (`validate(temp_path)` raises to refuse) -> atomic os.replace. Any failure, including
    Ctrl-C, leaves the original bytes in place (restored from the backup if the replace
    had already happened).
    """
    path = Path(path)
    original = path.read_bytes()
    new_text = edited_text(original.decode("utf-8"), changes)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S-%f")
    backup = path.with_name(f"{path.name}.bak-{stamp}")
    shutil.copy2(path, backup)
    try:
        if validate is not None:
            fd, probe = tempfile.mkstemp(prefix=f".{path.stem}.check.", suffix=path.suffix, dir=path.parent)
            try:
                with os.fdopen(fd, "w") as fh:
                    fh.write(new_text)
                validate(Path(probe))
            finally:
                os.unlink(probe)
        _atomic_write(path, new_text.encode("utf-8"))
    except BaseException:
        if path.read_bytes() != original:
            _atomic_write(path, original)
        raise
    return ApplyResult(
        path, backup, unified_diff(original.decode("utf-8"), new_text, f"{path} (before)", f"{path} (after)")
    )
