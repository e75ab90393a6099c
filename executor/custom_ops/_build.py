"""Building a custom op's C++ CPU kernel on first use, once per machine (torch.utils.cpp_extension).

Why built here and not shipped: the kernel must match this process's torch headers and ABI, so it
is compiled against the installed torch the first time a run asks for the op, and kept in a
cache directory keyed on everything that changes the binary (sources, flags, torch and Python
versions, the CPU's vector extensions). A later run, or another process, loads the cached
library without a compiler. Concurrent first builds are safe: one process builds while the
others wait on a flock in the build directory (_build_lock), then load what it built.

The library only registers kernels (`TORCH_LIBRARY_IMPL(cann, CPU, m)`) for ops whose schema the
Python module defined, so loading it adds no Python module: torch.ops.load_library does it.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import sys
from pathlib import Path

import torch

from executor.errors import RecipeError

EXTENSIONS_ENV = "CANN_RECIPES_EXTENSIONS_DIR"  # where built kernels are kept
DEFAULT_EXTENSIONS_DIR = Path.home() / ".cache" / "cann-recipes-infer" / "extensions"
CSRC = Path(__file__).resolve().parent / "csrc"
# The vector extensions torch itself found on this CPU -> the flags the kernel is compiled with,
# so that the compiler can vectorise its inner loops (part of the cache key: another CPU, another
# build). -mf16c as in PyTorch's own AVX2 and AVX-512 builds: ATen's vector headers convert fp16
# with F16C intrinsics, which GCC does not enable with -mavx2 or -mavx512f, so an AVX2 build of a
# kernel that converts halves fails without it. Capabilities not listed (DEFAULT, ZVECTOR, SVE...)
# compile with the target's baseline.
ARCH_FLAGS = {
    "AVX512": ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c"),
    "AVX2": ("-mavx2", "-mfma", "-mf16c"),
}
# -fopenmp: at::parallel_for is an inline OpenMP region; the library then resolves libgomp.so.1 to
# the one torch already loaded (torch/lib/libgomp.so.1), so both share one thread pool.
CFLAGS = ("-O3", "-fopenmp", "-fopenmp-simd")
LDFLAGS = ("-fopenmp",)

_loaded: dict[str, Path] = {}  # library name -> path, loaded in this process


class KernelBuildError(RecipeError):
    """A custom op's CPU kernel cannot be built here (no compiler, no ninja, a compile error)."""


def extensions_dir() -> Path:
    return Path(os.environ.get(EXTENSIONS_ENV) or DEFAULT_EXTENSIONS_DIR).expanduser()


def compile_flags() -> tuple[str, ...]:
    return CFLAGS + ARCH_FLAGS.get(torch.backends.cpu.get_cpu_capability(), ())


def build_key(name: str, sources: list[Path]) -> str:
    """What the built library depends on; any change gives another directory."""
    h = hashlib.sha256()
    for part in (name, torch.__version__, sys.version, sys.platform, *compile_flags(), *LDFLAGS):
        h.update(part.encode() + b"\0")
    for src in [*sources, *headers()]:
        h.update(src.name.encode() + b"\0" + src.read_bytes())
    return h.hexdigest()[:16]


def headers() -> list[Path]:
    """The shared headers every kernel build can include (CSRC is on its include path)."""
    return sorted(CSRC.glob("*.h"))


def compiler() -> str:
    """The C++ compiler cpp_extension will run: $CXX, else `c++` (its own default on Linux)."""
    return os.environ.get("CXX") or "c++"


CUSTOM_OPS_REMEDY = ", or remove it from model_config.custom_ops"


def _check_toolchain(op: str, remedy: str = CUSTOM_OPS_REMEDY) -> None:
    """Fail before cpp_extension does, with one line naming the op and what is missing (and
    `remedy`, the user's other way out, appended)."""
    cxx = compiler()
    if shutil.which(cxx) is None:
        where = "$CXX" if os.environ.get("CXX") else "the default compiler c++"
        raise KernelBuildError(
            f"custom op {op}: its CPU kernel is compiled on first use, but {where} ({cxx}) is not an executable "
            f"compiler here; install g++ (or set CXX to one){remedy}"
        )
    if shutil.which("ninja") is None:
        raise KernelBuildError(
            f"custom op {op}: torch.utils.cpp_extension needs ninja to build its CPU kernel and none is on PATH; "
            f"`pip install ninja`{remedy}"
        )


def _sources(op: str, sources: list[str]) -> list[Path]:
    """`sources` as paths: file names under executor/custom_ops/csrc/, or absolute paths; all must exist."""
    paths = [Path(s) if Path(s).is_absolute() else CSRC / s for s in sources]
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise KernelBuildError(f"custom op {op}: kernel source {missing[0]} does not exist")
    return paths


FINISHED = "finished"  # written next to a library once its build has ended (_finished)


def _built(library: str, paths: list[Path]) -> Path:
    """Where the library built from `paths` is (or will be) kept."""
    return extensions_dir() / f"{library}-{build_key(library, paths)}" / f"{library}.so"


def _finished(built: Path) -> bool:
    """The library at `built` was built to the end. Its file alone does not say so: the linker
    writes it in place, and a process that loaded it meanwhile failed with "file too short" (two
    runs starting together on a fresh kernel cache, seen in the test suite). A library that is not
    marked finished is waited for under _build_lock, and built if nobody finished it."""
    return built.is_file() and built.with_name(FINISHED).is_file()


def _mark_finished(built: Path) -> None:
    tmp = built.with_name(f"{FINISHED}.{os.getpid()}")
    tmp.write_text(built.name + "\n")
    os.replace(tmp, built.with_name(FINISHED))


BUILD_LOCK = "build.lock"  # the file whose flock one build of a library holds (_build_lock)


@contextlib.contextmanager
def _build_lock(op: str, build_dir: Path):
    """One build of a library at a time, across processes: an exclusive flock on `build.lock` in
    its build directory, held until the build is marked finished. The kernel drops a flock when its
    holder exits, killed or not, so a build that died leaves nothing to wait for. cpp_extension's
    own lock (torch's FileBaton, `lock` in the same directory) is a plain file that a killed build
    leaves behind, and every later build of the library then waited for it forever; under this
    flock no other build can be inside cpp_extension, so a `lock` found there is that leftover, and
    it is said and removed. A cache directory that cannot be written is a one-line error."""
    try:
        build_dir.mkdir(parents=True, exist_ok=True)
        held = open(build_dir / BUILD_LOCK, "a")  # noqa: SIM115 (closed by the with below)
    except OSError as exc:
        raise KernelBuildError(
            f"custom op {op}: cannot write the kernel cache {build_dir} ({exc.strerror or exc}); "
            f"point ${EXTENSIONS_ENV} at a writable directory"
        ) from exc
    with held as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"[custom_ops] waiting for another process's build of {op}'s CPU kernel in {build_dir}", flush=True)
            fcntl.flock(f, fcntl.LOCK_EX)
        leftover = build_dir / "lock"
        if leftover.exists():
            print(f"[custom_ops] removing {leftover}: left by a build that did not finish", flush=True)
            leftover.unlink(missing_ok=True)
        yield  # the flock goes with the file


def _being_built(build_dir: Path) -> bool:
    """Another process holds the build's flock now (a look, not a wait: _build_lock waits)."""
    try:
        with open(build_dir / BUILD_LOCK, "rb") as f:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return True
            fcntl.flock(f, fcntl.LOCK_UN)
    except OSError:  # no lock file: nobody has started a build
        pass
    return False


def check_buildable(op: str, library: str, sources: list[str], remedy: str = CUSTOM_OPS_REMEDY) -> None:
    """Pre-flight: the kernel is loaded already, built already, being built by another process
    (load_kernel waits for it, needing no compiler), or can be built here (compiler, ninja)."""
    if library in _loaded:
        return
    built = _built(library, _sources(op, sources))
    if not _finished(built) and not _being_built(built.parent):
        _check_toolchain(op, remedy)


def load_kernel(op: str, library: str, sources: list[str], remedy: str = CUSTOM_OPS_REMEDY) -> Path:
    """Build (once per machine) and load (once per process) the CPU kernel library of `op`.

    `sources`: file names under executor/custom_ops/csrc/ (or absolute paths). Returns the
    library's path. A cached build is loaded without looking for a compiler. `remedy` ends the
    message of a missing toolchain (a kernel that is not a listed custom op has another one)."""
    if library in _loaded:
        return _loaded[library]
    paths = _sources(op, sources)
    built = _built(library, paths)
    build_dir = built.parent
    if not _finished(built):
        # The toolchain is asked for under the lock, once this process has to build: one that only
        # waits for another process's build loads the result without a compiler of its own.
        with _build_lock(op, build_dir):
            if not _finished(built):  # else another process built it while this one waited
                _check_toolchain(op, remedy)
                _compile(op, library, paths, built)
    try:
        torch.ops.load_library(str(built))
    except OSError as exc:  # a cache damaged after its build finished: one line, not a traceback
        raise KernelBuildError(
            f"custom op {op}: loading its CPU kernel {built} failed ({str(exc.__cause__ or exc).split(': ')[-1]}); "
            f"delete {build_dir} to build it again"
        ) from exc
    _loaded[library] = built
    return built


def _compile(op: str, library: str, paths: list[Path], built: Path) -> None:
    """Build the library at `built` from `paths` with cpp_extension and mark it finished (under
    _build_lock). cpp_extension also loads what it built; load_kernel's load of the same path
    afterwards finds it loaded already."""
    build_dir = built.parent
    print(f"[custom_ops] building the CPU kernel of {op} into {build_dir} (once per machine)", flush=True)
    from torch.utils import cpp_extension

    try:
        cpp_extension.load(
            library,
            [str(p) for p in paths],
            extra_cflags=list(compile_flags()),
            extra_ldflags=list(LDFLAGS),
            extra_include_paths=[str(CSRC)],
            build_directory=str(build_dir),
            is_python_module=False,
            verbose=False,
        )
    except (RuntimeError, OSError) as exc:  # cpp_extension reports compile errors as RuntimeError
        detail = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
        raise KernelBuildError(f"custom op {op}: building its CPU kernel in {build_dir} failed ({detail})") from exc
    if not built.is_file():
        raise KernelBuildError(f"custom op {op}: the build finished without {built}")
    _mark_finished(built)


def cpu_has_avx512(dtype: torch.dtype) -> bool:
    """This CPU runs the AVX-512 kernels for `dtype` (bf16: AVX512-BF16), as torch's cpuinfo sees
    it. Asked before building one of the backends' AVX-512 kernels (gemv, causal_attention, the
    64-column loop of rows_linear): they compile on any x86-64 host and check the CPU again
    themselves, but an AVX2 or Arm host would build them (about 15 s each, once per machine) only
    to never run them."""
    if dtype == torch.bfloat16:
        return torch.cpu._is_avx512_bf16_supported()
    return torch.cpu._is_avx512_supported()


def cpu_has_amx() -> bool:
    """This CPU has AMX tiles (Intel Xeon, Sapphire Rapids and later), which oneDNN uses for bf16
    products. The one such host measured here (2 vCPUs of an Intel Xeon with AMX-BF16) ran several
    lowerings differently from the AMD hosts the kernels were tuned on (BENCHMARKS.md,
    "twenty-fifth pass"): the backends ask this, not the vendor, as the kind of CPU it was."""
    return torch.cpu._is_amx_tile_supported()


def cpu_has_avx2() -> bool:
    """This CPU runs AVX2 code (rows_linear's 16-column loop, which also checks FMA itself)."""
    return torch.cpu._is_avx2_supported()


def load_optional_kernel(op: str, library: str, source: Path | list[Path], tag: str, instead: str) -> bool:
    """Build (once per machine) and load a backend's own kernel, one that is a speed choice and not
    something the user asked for (executor/backends/csrc/; `source`: its file, or its files). A build
    that cannot happen is said in one line, `[tag] <why>; <instead>`, not raised, and False is
    returned: the caller then runs what it ran before the kernel existed."""
    try:
        load_kernel(op, library, [str(s) for s in (source if isinstance(source, list) else [source])], remedy="")
    except KernelBuildError as exc:
        print(f"[{tag}] {exc}; {instead}", flush=True)
        return False
    return True
