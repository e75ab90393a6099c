"""The backends' own CPU kernels (executor/backends/csrc) build wherever a loop of theirs can run.

A kernel that cannot be built is said in one line and its calls go to what ran before it existed
(aten, oneDNN, SDPA, torch.argmax): right on a host without a compiler, a silent slowdown anywhere
else. Each kernel's own tests skip when it is not built, so without this file a kernel that stops
compiling on one kind of CPU reads as "this CPU cannot". That happened: gemv.cpp once failed to
build on every CPU without AVX-512 (an AVX-512 function used AVX512-VL instructions its target did
not name), and the suite stayed green on the AVX2 hosts.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from executor.backends import eager_attention, eager_linear, eager_pointwise, greedy, packed_linear
from executor.custom_ops import _build
from tests.fresh_python import REPO, run_code

CSRC = Path(eager_linear.__file__).resolve().parent / "csrc"


def needs_toolchain() -> None:
    if shutil.which(_build.compiler()) is None or shutil.which("ninja") is None:
        pytest.skip("no C++ toolchain here: the kernels are not built, by design")


def _any_simd() -> bool:
    return _build.cpu_has_avx2() or _build.cpu_has_avx512(torch.float32)


# source file -> (this CPU runs a loop of it, the kernel is built and loaded here)
KERNELS = {
    "gemv.cpp": (_any_simd, lambda: eager_linear.gemv_runs(torch.float32) and eager_linear.gemv_runs(torch.bfloat16)),
    "rows_linear.cpp": (_any_simd, lambda: packed_linear.kernel_runs(torch.float32)),
    "packed_call.cpp": (_any_simd, lambda: packed_linear.graph_op(torch.float32).name() == "cann_cpu::packed_call"),
    "amx_linear.cpp": (_build.cpu_has_amx, packed_linear.amx_runs),
    "causal_attention.cpp": (
        lambda: _build.cpu_has_avx512(torch.bfloat16) or _build.cpu_has_avx2(),
        lambda: eager_attention.kernel_runs(torch.bfloat16 if _build.cpu_has_avx512(torch.bfloat16) else torch.float32),
    ),
    "pointwise.cpp": (lambda: True, eager_pointwise.kernel_runs),  # ATen's vector types: any CPU
    "greedy.cpp": (lambda: True, greedy.kernel_runs),
}


def test_every_kernel_source_is_listed_here():
    """A new kernel gets a row above, or its build is never asked for outside its own (skipping) tests."""
    assert sorted(p.name for p in CSRC.glob("*.cpp")) == sorted(KERNELS)


@pytest.mark.parametrize("source", sorted(KERNELS))
def test_the_kernel_builds_wherever_a_loop_of_it_runs(source):
    needs_toolchain()
    cpu_runs, built = KERNELS[source]
    if not cpu_runs():
        pytest.skip(f"no loop of {source} runs on this CPU")
    assert built(), f"{source} did not build or load on a CPU that runs it (see the one-line message above)"


def test_a_library_still_being_built_is_waited_for_and_a_damaged_one_said_in_one_line(tmp_path):
    """Two runs that start together on a fresh kernel cache: the second saw the first's library
    file while the linker was still writing it, loaded it and died ("file too short"). Here the
    first build is played by this test: a library file cut short, no `finished` marker, and the
    build's flock held. The second process must wait, then load the finished library without
    building it again; a flock whose holder was killed, or a cpp_extension `lock` file that a killed
    build left, must not be waited for. The waiting process has no compiler of its own ($CXX names
    none): only a process that builds needs one."""
    needs_toolchain()
    ext = tmp_path / "ext"
    code = "from executor.backends import greedy\nprint(greedy.kernel_runs())\n"
    assert run_code(code, CANN_RECIPES_EXTENSIONS_DIR=str(ext)).split()[-1] == "True"
    (library,) = ext.glob("cann_cpu_greedy-*/cann_cpu_greedy.so")
    whole = library.read_bytes()
    finished = library.with_name(_build.FINISHED)
    library.write_bytes(whole[:64])  # what a reader sees mid-link
    finished.unlink()
    env = os.environ | {"CANN_RECIPES_EXTENSIONS_DIR": str(ext), "CXX": str(tmp_path / "no-compiler")}
    with open(library.with_name(_build.BUILD_LOCK), "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        proc = subprocess.Popen(
            [sys.executable, "-c", code], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        try:
            time.sleep(8)  # the import and the load attempt take ~3 s
            assert proc.poll() is None, f"did not wait for the build: {proc.communicate()[1][-1500:]}"
            library.write_bytes(whole)
            finished.write_text(library.name + "\n")
        except BaseException:
            proc.kill()
            raise
    try:
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 0 and out.split()[-1] == "True", err[-1500:]
    assert "[custom_ops] waiting for another process's build" in out and "[custom_ops] building" not in out, out
    # a finished library damaged afterwards: said in one line, and argmax picks the tokens
    library.write_bytes(whole[:64])
    said = run_code(code, CANN_RECIPES_EXTENSIONS_DIR=str(ext)).splitlines()
    assert said[-1] == "False" and said[0].startswith("[greedy]") and f"delete {library.parent}" in said[0]
    # a build killed mid-way: its flock goes with it, and cpp_extension's lock file it left is removed
    library.write_bytes(whole)  # newer than its objects: ninja has nothing to redo
    finished.unlink()
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"import fcntl, time\nf = open({str(library.with_name(_build.BUILD_LOCK))!r}, 'a')\n"
            "fcntl.flock(f, fcntl.LOCK_EX)\nprint('held', flush=True)\ntime.sleep(600)\n",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
    finally:
        holder.kill()
        holder.wait()
    lock = library.with_name("lock")
    lock.touch()
    said = run_code(code, timeout=120, CANN_RECIPES_EXTENSIONS_DIR=str(ext)).splitlines()
    assert said[-1] == "True" and any(line.startswith(f"[custom_ops] removing {lock}") for line in said), said
    assert not any("waiting" in line for line in said), said


def test_the_pre_flight_lets_a_run_without_a_compiler_wait_for_another_processs_build(tmp_path, monkeypatch):
    """A listed custom op whose library another process is building: the pre-flight must not ask
    this run for a compiler (load_kernel waits for that build and loads it). With nobody building,
    a run without a compiler is still told so in one line."""
    monkeypatch.setenv(_build.EXTENSIONS_ENV, str(tmp_path / "ext"))
    monkeypatch.setenv("CXX", str(tmp_path / "no-compiler"))
    op, library, sources = "cann_test::waits", "cann_test_waits", ["decode_attention.cpp"]
    with pytest.raises(_build.KernelBuildError, match="not an executable compiler"):
        _build.check_buildable(op, library, sources)
    build_dir = _build._built(library, _build._sources(op, sources)).parent
    build_dir.mkdir(parents=True)
    with open(build_dir / _build.BUILD_LOCK, "a") as held:
        with pytest.raises(_build.KernelBuildError, match="not an executable compiler"):
            _build.check_buildable(op, library, sources)  # a lock file nobody holds: no build running
        fcntl.flock(held, fcntl.LOCK_EX)  # another open file: the pre-flight's own flock conflicts with it
        _build.check_buildable(op, library, sources)


def test_a_kernel_cache_that_cannot_be_written_is_said_in_one_line(tmp_path, monkeypatch):
    """$CANN_RECIPES_EXTENSIONS_DIR under a file (as root, a read-only directory would still be
    writable): an optional kernel says so in one line and its calls go to the fallback; for a
    requested custom op it is a KernelBuildError (a RecipeError: one line, exit 2), not an
    OSError's traceback."""
    needs_toolchain()
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    code = "from executor.backends import greedy\nprint(greedy.kernel_runs())\n"
    said = run_code(code, CANN_RECIPES_EXTENSIONS_DIR=str(blocker / "ext")).splitlines()
    assert said[-1] == "False", said
    assert said[0].startswith("[greedy] custom op cann_cpu::greedy_tokens: cannot write the kernel cache"), said
    assert "CANN_RECIPES_EXTENSIONS_DIR" in said[0] and "torch.argmax" in said[0], said
    monkeypatch.setenv(_build.EXTENSIONS_ENV, str(blocker / "ext"))
    with pytest.raises(_build.KernelBuildError, match="cannot write the kernel cache"):
        _build.load_kernel("cann_cpu::greedy_tokens", "cann_cpu_greedy_unwritable", [str(CSRC / "greedy.cpp")])
