"""A run's own scratch directory for compiled kernels, removed when the run ends, however it ends.

Why a module of its own: nothing here is about Inductor; the portable backend keeps a cold
compile's kernels in one (executor.backends.inductor.InductorBackend).
"""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
import weakref


class ScratchDir:
    """A run's own compile directory, removed once nothing holds it or the process exits, and
    by the next ScratchDir of the same prefix if the process was killed (SIGKILL, the OOM killer).

    Why: without enable_cache_compile each run compiles into a fresh directory, so that a cold
    compile really is cold. Left behind, every such run (the upstream-shaped configs, each scope
    search candidate, the benchmarks, most test runners) added 0.3-3 MB to the temporary
    directory for good: 2,187 of them, 2.6 GB, on one development machine. Kernels already
    loaded keep working after the removal: the process holds them mapped.

    A killed process runs no finalizer, so each directory holds an flock on its LOCK file for its
    owner's lifetime; the kernel drops the lock when the owner dies, however it dies. A directory
    whose lock can be taken is nobody's. Not a pid check: a process in another pid namespace that
    shares the temporary directory (two containers of one pod) would look dead."""

    LOCK = "LOCK"

    def __init__(self, prefix: str):
        sweep_orphans(prefix)
        self.path = tempfile.mkdtemp(prefix=prefix)
        # locked under another name first: a sweep that opened LOCK before this flock would take it
        fd = os.open(os.path.join(self.path, f"{self.LOCK}.new"), os.O_CREAT | os.O_RDWR, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.rename(os.path.join(self.path, f"{self.LOCK}.new"), os.path.join(self.path, self.LOCK))
        weakref.finalize(self, _remove_locked, self.path, fd)


def _remove_locked(path: str, fd: int) -> None:
    shutil.rmtree(path, ignore_errors=True)  # removed while still locked: no sweep can race it
    os.close(fd)


def sweep_orphans(prefix: str) -> None:
    """Remove the ScratchDirs of `prefix` in the temporary directory whose owner is gone. A
    directory without a LOCK file (being created, or not a ScratchDir) is left alone."""
    base = tempfile.gettempdir()
    for name in os.listdir(base):
        if not name.startswith(prefix):
            continue
        path = os.path.join(base, name)
        try:
            fd = os.open(os.path.join(path, ScratchDir.LOCK), os.O_RDWR)
        except OSError:  # no LOCK, not ours to open, not a directory
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # held: its owner is alive
            os.close(fd)
            continue
        _remove_locked(path, fd)
