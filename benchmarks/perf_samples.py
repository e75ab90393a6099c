"""Linux `perf` sampling of chosen stretches of this process, summed per thread and shared object.

Why: on CPU a compiled decode step is one opaque call to the PyTorch profiler (two Inductor kernels
at the 0.6B shape), so it cannot say whether the step's time goes to the GEMMs, the fused layer
kernels, OpenMP barriers or the Python host side. Sampling by shared object can: the forty-first
pass read batch 16 in bf16 as 73% `cann_cpu_rows_linear`, 10% Inductor's kernels, and 6.6% / 14.5%
libgomp on the main thread / the worker (BENCHMARKS.md).

How: `perf record` attaches to this process disabled (`-D -1`) and is switched on and off over a
control pipe (`--control fd:`), so only the chosen steps are sampled, not prefill or compiles.
Start the recorder after the compile and run a few steps before enabling it:
- perf learns where each library sits from the process's maps when it attaches, and records no
  mapping made while it is disabled, so a kernel library loaded later has no name ("[unknown]");
- right after perf starts, the process's first writes fault (most likely perf's fork, which makes
  the pages copy-on-write for a moment): enabled at once, a batch-64 step showed 1.7% of its
  samples in the kernel's `clear_page_erms`, which the process without perf does not take (~3 minor
  faults a step); with steps run in between, under 0.2%.
Each sample carries its period (ns of CPU time on `cpu-clock`); the sums are per thread, so a
thread waiting in libgomp is counted for the time it spins.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
from collections import Counter
from pathlib import Path

from executor.errors import RecipeError

# Inductor names a compiled kernel's library after a hash: c<base32>.so or c<base32>.main.so
_INDUCTOR_SO = re.compile(r"c[a-z0-9]{40,}(\.main)?\.so")


class PerfError(RecipeError):
    """perf is missing or could not attach (perf_event_paranoid, a container without the syscall)."""


def group(dso: str) -> str:
    """The row a sample's shared object is summed into (`dso` as `perf script -F ip,dso` prints it)."""
    name = dso.strip().strip("()").rsplit("/", 1)[-1]
    if _INDUCTOR_SO.fullmatch(name):
        return "Inductor's kernels"
    if (name.startswith("perf-") and name.endswith(".map")) or name in ("[JIT]", "[unknown]", ""):
        return "JIT or unnamed code (oneDNN)"
    if name.startswith("libgomp"):
        return "libgomp (barriers, waits)"
    if name.startswith("libpython"):
        return "Python"
    if name == "[kernel.kallsyms]":
        return "kernel"
    return re.sub(r"\.so(\.[0-9.]+)?$", "", name)


def tally(script: str) -> dict[int, Counter]:
    """CPU ns per thread id and group, from `perf script -F tid,period,ip,dso` lines ("tid period ip
    (dso)"; perf prints a sample's object only with its address)."""
    out: dict[int, Counter] = {}
    for line in script.splitlines():
        parts = line.split(None, 3)
        if len(parts) < 3 or not (parts[0].isdigit() and parts[1].isdigit()):
            continue
        out.setdefault(int(parts[0]), Counter())[group(parts[3] if len(parts) > 3 else "")] += int(parts[1])
    return out


def require_perf() -> str:
    """perf's path, or PerfError: checked before a run builds and compiles anything."""
    exe = shutil.which("perf")
    if exe is None:
        raise PerfError("--perf needs Linux perf on PATH (not found); install linux-tools or perf")
    return exe


class PerfRecorder:
    """`perf record` attached to this process, sampling only between enable() and disable()."""

    def __init__(self, data: Path, freq: int = 2999):
        self.exe = exe = require_perf()
        self.data, self.freq = data, freq
        ctl_r, ctl_w = os.pipe()
        ack_r, ack_w = os.pipe()
        # --no-buildid-cache: perf otherwise copies every library it sampled into ~/.debug, each
        # compiled kernel library included (552 MB on the reference machine after a few sessions of profiles)
        cmd = [exe, "record", "-q", "--no-buildid-cache", "-F", str(freq), "-D", "-1",
               f"--control=fd:{ctl_r},{ack_w}", "-p", str(os.getpid()), "-o", str(data)]  # fmt: skip
        self.proc = subprocess.Popen(
            cmd, pass_fds=(ctl_r, ack_w), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
        )
        os.close(ctl_r)
        os.close(ack_w)  # perf holds the only write end: its exit reads as EOF here, not a hang
        self._ctl, self._ack = os.fdopen(ctl_w, "w"), os.fdopen(ack_r)

    def _command(self, word: str) -> None:
        try:
            self._ctl.write(word + "\n")
            self._ctl.flush()
            answered = self._ack.readline()
        except BrokenPipeError:
            answered = ""
        if not answered:  # perf exited: it could not attach
            self.proc.wait()
            why = (self.proc.stderr.read() or "").strip().splitlines()
            raise PerfError(f"perf record stopped (exit {self.proc.returncode}): {why[-1] if why else 'no message'}")

    def enable(self) -> None:
        self._command("enable")

    def disable(self) -> None:
        self._command("disable")

    def finish(self) -> None:
        """End the recording (perf writes its file on SIGINT); again, or after perf exited: nothing."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            self.proc.wait()
        self._ctl.close()
        self._ack.close()

    def stop(self) -> dict[int, Counter]:
        """End the recording; CPU ns per thread and group."""
        self.finish()
        fields = ["-F", "tid,period,ip,dso"]
        script = subprocess.run([self.exe, "script", "-i", str(self.data), *fields], capture_output=True, text=True)
        if script.returncode != 0:
            why = script.stderr.strip().splitlines()
            raise PerfError(f"perf script failed (exit {script.returncode}): {why[-1] if why else 'no message'}")
        return tally(script.stdout)


Row = tuple[str, str, float, float]  # thread, group, CPU ms per step, share of the thread's CPU time


def rows(counts: dict[int, Counter], main_tid: int, steps: int, top: int) -> list[Row]:
    """(thread, group, CPU ms per step, share of that thread's time), the main thread first, then the
    others with 1% of the time or more, by time; each thread's `top` groups."""
    everything = sum(sum(c.values()) for c in counts.values())
    order = sorted(counts, key=lambda t: (t != main_tid, -sum(counts[t].values())))
    order = [t for t in order if t == main_tid or sum(counts[t].values()) >= 0.01 * everything]  # no stray threads
    out = []
    for i, tid in enumerate(order):
        total = sum(counts[tid].values())
        name = "main" if tid == main_tid else f"thread {i}"
        for grp, ns in counts[tid].most_common(top):
            out.append((name, grp, ns / 1e6 / steps, ns / total))
    return out
