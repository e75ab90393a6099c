"""Starting the ranks of a multi-device run: torchrun's own launcher, run in this process.

`bash infer.sh --set parallel_config.world_size=2 ...` lands here: the command re-runs itself
as `torchrun --standalone --nproc-per-node 2 -m executor.cli run <same args>`. We call
torch.distributed.run (what the torchrun script runs) in-process rather than exec'ing it, for
one reason: it hands us torchrun's ChildFailedError, which says which rank failed first and
how (exit code or signal). So a failed job ends with one line, that rank's error, instead of
torchrun's multi-screen report; torchrun itself stops the other ranks within seconds.

Several machines: torchrun's own options, passed through unchanged with
`--torchrun "--nnodes 2 --node-rank 0 --rdzv-backend c10d --rdzv-endpoint HOST:PORT"` (the same
command on every machine); ranks per machine = world_size / nnodes.

On CPU every rank gets its share of this process's cores (OMP_NUM_THREADS and Inductor's
compile workers), so ranks never oversubscribe the machine. Ranks are not pinned to cores:
pinning was slower on a shared machine.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shlex
import signal
import sys
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from executor.config import ConfigError
from executor.context import environment
from executor.errors import EXIT_INTERRUPTED, EXIT_USAGE
from executor.parallel.layout import check_devices, cpu_cores
from executor.parallel.runtime import LAUNCHED_ENV, devices_here, rank_log
from executor.paths import REPO_ROOT
from executor.platform import Platform

_OURS = ("--nproc-per-node", "--nproc_per_node", "--standalone", "--module", "-m", "--no-python")


@dataclass(frozen=True)
class Plan:
    """What `launch` will start: torchrun's arguments, and the ranks on this machine."""

    args: list[str]
    per_node: int
    platform: Platform


def plan(world_size: int, extra: str, platform: Platform, module: str, module_args: list[str]) -> Plan:
    """Check the machine can hold the ranks and build the torchrun command line (no `torchrun`)."""
    from torch.distributed.run import get_args_parser, parse_min_max_nnodes

    user = shlex.split(extra)
    taken = [a for a in user if a.split("=", 1)[0] in _OURS]
    if taken:
        raise ConfigError(
            f"--torchrun: {taken[0]} is set by this command (ranks per machine come from parallel_config.world_size)"
        )
    try:
        parsed = get_args_parser().parse_args([*user, "placeholder"])
    except SystemExit:
        raise ConfigError(f"--torchrun {extra!r}: not valid torchrun options (see torchrun --help)") from None
    low, high = parse_min_max_nnodes(parsed.nnodes)
    if low != high:
        raise ConfigError(f"--torchrun --nnodes {parsed.nnodes}: an elastic range is not supported; give one number")
    devices, what = devices_here(platform)
    per_node = check_devices(world_size, high, devices, what)
    given = {a.split("=", 1)[0].replace("_", "-") for a in user}
    local = high == 1 and not given & {"--rdzv-endpoint", "--master-addr", "--master-port"}
    head = ["--standalone"] if local else []
    return Plan([*head, *user, "--nproc-per-node", str(per_node), "--module", module, *module_args], per_node, platform)


def launch(plan: Plan, log_dir: Path) -> int:
    """Run the planned ranks of this machine; 0, or the first failed rank's one-line error on
    stderr and its exit status (2 for a user error, as everywhere). Rank logs are in `log_dir`."""
    import torch.distributed.run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    for stale in log_dir.glob("rank_*.log"):  # an earlier failed run's: never report its error as ours
        stale.unlink()
    env = {LAUNCHED_ENV: "1", "PYTHONUNBUFFERED": "1", "PYTHONPATH": _pythonpath()}
    if plan.platform.kind == "cpu":
        share = str(max(1, cpu_cores() // plan.per_node))
        env |= {"OMP_NUM_THREADS": share, "TORCHINDUCTOR_COMPILE_THREADS": share}
    with environment(env), _quiet_torchrun(), _torchrun_log_dir(plan.args) as args, _signal_handlers_kept():
        try:
            torchrun.run(torchrun.parse_args(args))
        except ChildFailedError as exc:
            rank, failure = root_cause(exc.failures, log_dir)
            log = rank_log(log_dir, rank)
            if failure.exitcode < 0:
                what = f"was killed by {failure.signal_name()}; its log: {log}"
            else:
                what = f"exited with code {failure.exitcode}: {last_error(log)} [{log}]"
            print(f"error: rank {rank} (pid {failure.pid}) {what}", file=sys.stderr)
            return EXIT_USAGE if failure.exitcode == EXIT_USAGE else 1
        except SignalException as exc:  # Ctrl-C / SIGTERM to this process: torchrun stopped the ranks
            print(f"interrupted ({exc.sigval.name}); the ranks were stopped", file=sys.stderr)
            return EXIT_INTERRUPTED
    return 0


TORCHRUN_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")  # torchelastic's default TORCHELASTIC_SIGNALS_TO_HANDLE


@contextlib.contextmanager
def _signal_handlers_kept() -> Iterator[None]:
    """The process's handlers for TORCHRUN_SIGNALS, put back when the ranks are done.

    Why: torchrun installs its own (they raise its SignalException) and leaves them installed. A
    tool that runs ranks in-process and then goes on (accuracy, sk_compare with several ranks)
    would afterwards get that exception instead of KeyboardInterrupt on Ctrl-C; a test of the
    interrupt handling in the same pytest worker found torchrun's handler still there."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    saved = {sig: signal.getsignal(sig) for sig in (getattr(signal, n) for n in TORCHRUN_SIGNALS if hasattr(signal, n))}
    try:
        yield
    finally:
        for sig, handler in saved.items():
            if handler is not None:  # None: not installed from Python, nothing to put back
                signal.signal(sig, handler)


@contextlib.contextmanager
def _torchrun_log_dir(args: list[str]) -> Iterator[list[str]]:
    """`args` with a `--log-dir` of our own, removed when the job ends, unless the user gave one.

    Why: without one, torchrun makes a `torchelastic_*` directory in the temporary directory for
    its per-rank error files and never removes it; one per job piled up (58 on one development
    machine). Our rank logs are in the output directory, so nothing in it is needed afterwards."""
    own = args[: args.index("--module")] if "--module" in args else args
    if any(a.split("=", 1)[0].replace("_", "-") == "--log-dir" for a in own):
        yield args
        return
    with tempfile.TemporaryDirectory(prefix="torchrun_") as logs:
        yield ["--log-dir", logs, *args]


_PEER_GONE = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "Socket Timeout")


def root_cause(failures: dict, log_dir: Path) -> tuple[int, object]:
    """The failure that caused the others. torchrun stops the surviving ranks with SIGTERM, and a
    rank blocked in a collective with a dead peer fails with a connection error; both are
    consequences. torchrun's own "first failure" compares whole-second timestamps, so it cannot
    tell them apart from the cause."""

    def consequence(item) -> int:
        rank, failure = item
        if failure.exitcode == EXIT_USAGE:
            return 0  # a user error: the reason for everything else
        if failure.exitcode < 0:
            return 2 if failure.signal_name() == "SIGTERM" else 0
        return 1 if any(s in last_error(rank_log(log_dir, rank)) for s in _PEER_GONE) else 0

    return min(failures.items(), key=lambda item: (consequence(item), item[1].timestamp, item[0]))


_EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Interrupt)\b.*")


def last_error(log: Path) -> str:
    """The one line that says why a rank failed: its `error: ...` line, else the last line of
    its traceback, else its last line."""
    if not log.is_file():
        return "it failed before writing its log"
    lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    for ln in reversed(lines):
        if ln.startswith("error: "):
            return ln.removeprefix("error: ")
    for ln in reversed(lines):
        if _EXCEPTION_LINE.match(ln):
            return ln[:300]
    return lines[-1][:300] if lines else "its log is empty"


def _pythonpath() -> str:
    """The ranks import executor, models and tools from this repository wherever they start."""
    current = os.environ.get("PYTHONPATH")
    return f"{REPO_ROOT}{os.pathsep}{current}" if current else str(REPO_ROOT)


@contextlib.contextmanager
def _quiet_torchrun() -> Iterator[None]:
    """torchrun's agent logs every step of a failure at WARNING/ERROR; we report it in one line."""
    loggers = [logging.getLogger(name) for name in ("torch.distributed.elastic", "torch.distributed.run")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)
