"""Inside one rank: torch.distributed start-up, the run's `Parallel`, rank logs and row gathering.

A rank is a process started by torchrun (it sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR...).
The backend follows the platform: gloo on CPU, NCCL on CUDA, HCCL on an Ascend NPU (set up by
the NPU adapter, executor.backends.npu, the only code that touches torch_npu).

Timeouts, so that a rank that hangs never hangs the job: collectives wait at most
STARTUP_TIMEOUT while the ranks load weights and compile (compile times differ between ranks,
and the first collective waits for the slowest), then STEADY_TIMEOUT once every rank has
compiled. A rank that dies is torchrun's to notice: it stops the others within seconds.
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import os
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn, TextIO

import torch

from executor.config import ConfigError, ParallelConfig
from executor.errors import RecipeError
from executor.parallel.groups import SINGLE_DEVICE, Parallel, build, created_groups
from executor.parallel.layout import Layout, check_devices, cpu_cores
from executor.platform import Platform

STARTUP_TIMEOUT = datetime.timedelta(minutes=15)  # load + compile, the ranks far apart
STEADY_TIMEOUT = datetime.timedelta(minutes=2)  # prefill/decode: ranks in step, collectives every few ms
LAUNCHED_ENV = "CANN_RECIPES_LAUNCHED"  # set by executor.parallel.launch: it reports a failed rank itself


def under_torchrun() -> bool:
    return all(key in os.environ for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def is_first() -> bool:
    """Rank 0: the one that prints to the console and writes metrics.json."""
    return rank() == 0


def init_process_group(platform: Platform) -> str:
    """Start torch.distributed in this rank (idempotent); returns the backend name."""
    import torch.distributed as dist

    if dist.is_initialized():
        return dist.get_backend()
    if platform.kind == "npu":
        from executor.backends import npu  # HCCL, through the adapter only

        backend = npu.init_distributed(local_rank())
    elif platform.kind == "cuda":
        torch.cuda.set_device(local_rank())
        backend = "nccl"
    else:
        backend = "gloo"
    dist.init_process_group(backend, timeout=STARTUP_TIMEOUT)
    return backend


def devices_here(platform: Platform) -> tuple[int, str]:
    """(how many ranks this machine can hold, what they are, in words)."""
    if platform.kind == "cuda":
        return torch.cuda.device_count(), "CUDA devices"
    if platform.kind == "npu":
        from executor.backends import npu

        return npu.device_count(), "NPUs"
    return cpu_cores(), "CPU cores usable by this process (each rank needs at least one)"


def parallel_for(pc: ParallelConfig, platform: Platform) -> Parallel:
    """The run's process groups by role; world size 1 needs none."""
    if pc.world_size == 1:
        return SINGLE_DEVICE
    if not under_torchrun():
        raise RecipeError(
            f"parallel_config.world_size {pc.world_size} needs one process per rank: run it with `bash infer.sh` "
            "(or `cann-recipes-infer run`), which starts them with torchrun"
        )
    backend = init_process_group(platform)
    import torch.distributed as dist

    if dist.get_world_size() != pc.world_size:
        raise ConfigError(
            f"parallel_config.world_size: {pc.world_size}, but torchrun started {dist.get_world_size()} ranks"
        )
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", pc.world_size))  # a torchrun started by hand, too
    check_devices(pc.world_size, pc.world_size // per_node, *devices_here(platform))
    return build(Layout.from_config(pc), dist.get_rank(), backend)


def steady_state() -> None:
    """Every rank has compiled: from now on a collective that waits longer than STEADY_TIMEOUT
    means a rank is stuck (gloo and NCCL let us lower the timeout; HCCL keeps STARTUP_TIMEOUT)."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_backend() not in ("gloo", "nccl"):
        return
    from torch.distributed.distributed_c10d import _set_pg_timeout  # the documented setter is private

    for group in created_groups():
        if dist.get_rank(group) >= 0:  # -1: a group this rank is not in
            _set_pg_timeout(STEADY_TIMEOUT, group)


def broadcast_object(value):
    """Rank 0's `value` on every rank (e.g. the output directory, so all ranks agree on it)."""
    import torch.distributed as dist

    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def gather_objects(value, parallel: Parallel) -> list:
    """Every rank's `value`, in rank order (world size 1: [value])."""
    if parallel.world == 1:
        return [value]
    import torch.distributed as dist

    out = [None] * parallel.world
    dist.all_gather_object(out, value)
    return out


def gather_rows(rows: list, parallel: Parallel) -> list:
    """Per-row values of this rank's attention-DP group -> the whole batch, in row order."""
    if parallel.layout.attn_dp == 1:
        return rows
    everyone = gather_objects(rows, parallel)
    return [row for leader in parallel.dp_leaders for row in everyone[leader]]


def gather_row_tensor(t: torch.Tensor, parallel: Parallel) -> torch.Tensor:
    """(b, ...) rows of this attention-DP group -> (B, ...) the whole batch, on every rank."""
    if parallel.layout.attn_dp == 1:
        return t
    return torch.stack(gather_rows(list(t), parallel))


def rank_log(out_dir: Path, index: int) -> Path:
    return out_dir / f"rank_{index}.log"


def run_rank(command: Callable[[], int]) -> NoReturn:
    """Run a rank's `command` and end the process through exit_rank with its exit status. A bug's
    exception (not a user error: those are exit codes already) prints its traceback and ends it with
    status 1, as Python would, but without the finalisation exit_rank avoids: a rank that failed after
    a compiled step could otherwise abort there instead (SIGABRT), and its launcher would report that.
    SystemExit and KeyboardInterrupt go on as usual."""
    try:
        code = command()
    except Exception:
        traceback.print_exc()
        code = 1
    exit_rank(code)


def exit_rank(code: int) -> NoReturn:
    """End this rank's process with `code`, skipping Python's finalisation: the atexit handlers
    (a compile directory's removal, Inductor's worker pool) run first, while the interpreter is
    whole, and stdout/stderr are flushed (Python's buffers and libc's).

    Why: destroy_process_group() stops only the backends nothing else holds, and after a
    compiled decode step something in torch does (2.13, gloo: the backend's three threads still
    run after destroy_process_group and a garbage collection; after an eager run none do). A
    backend thread that drops the last reference to a collective's tensor while Python finalises
    takes the GIL of a dying interpreter, and the process aborts ("terminate called without an
    active exception", SIGABRT) after its results were written: rank 0 of a two-rank run did so
    once in a test-suite run, and sk_compare counted the finished run as failed. Without
    finalisation there is no dying interpreter for such a thread to meet."""
    import atexit

    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    with contextlib.suppress(Exception):  # C and C++ output still in libc's buffers (a rank log is a file)
        ctypes.CDLL(None).fflush(None)
    os._exit(code)


def redirect_to_rank_log(out_dir: Path) -> TextIO | None:
    """Send this rank's stdout and stderr (file descriptors, so C++ output too) to its log file.

    Rank 0 gets back a handle on the original console for the cann-recipes-infer lines; its
    errors go to its log like everyone's, and the launcher prints the failing rank's one line.
    Under a torchrun the user started (no launcher to report), rank 0 keeps stderr on the console."""
    path = rank_log(out_dir, rank())
    console = os.fdopen(os.dup(1), "w", buffering=1) if is_first() else None
    sys.stdout.flush()
    sys.stderr.flush()
    log = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log, 1)
    if not is_first() or os.environ.get(LAUNCHED_ENV):
        os.dup2(log, 2)
    os.close(log)
    sys.stdout.reconfigure(line_buffering=True)  # a watcher (or the launcher) sees progress as it happens
    print(f"[rank {rank()}/{os.environ.get('WORLD_SIZE')}] pid {os.getpid()} logs to {path}", flush=True)
    return console
