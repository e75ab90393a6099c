"""Running a backend kernel's caller where the kernel cannot be built: a fresh kernel cache and
CXX pointing at nothing, in a fresh Python (a built kernel stays loaded in this process)."""

from __future__ import annotations

from pathlib import Path

from tests.fresh_python import run_code


def run_without_compiler(tmp_path: Path, code: str, tag: str) -> tuple[str, str]:
    """Run `code`, which must succeed; the build failure must be said in exactly one `[tag]` line
    naming the missing compiler, and nothing may be built. Returns (that line, stdout)."""
    cxx = tmp_path / "no" / "g++"
    stdout = run_code(code, CXX=str(cxx), CANN_RECIPES_EXTENSIONS_DIR=str(tmp_path / "ext"))
    lines = [line for line in stdout.splitlines() if line.startswith(f"[{tag}]")]
    assert len(lines) == 1, stdout
    assert str(cxx) in lines[0], lines[0]
    assert not list((tmp_path / "ext").glob("*/*.so"))
    return lines[0], stdout
