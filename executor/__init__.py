"""The recipe executor.

Importing it sets three process defaults before torch allocates anything.

Huge pages for large tensors (`THP_MEM_ALLOC_ENABLE=1`, read by PyTorch's CPU allocator at its
first allocation): a decode step streams every weight once, and the CPU's prefetchers stop at
each 4 KiB page; on the 2-core reference VM a 1 GiB sum read 29 GB/s on 4 KiB pages and 33 GB/s
on 2 MiB ones, and the 0.6B fp32 ge_graph step went from 92-112 to 79-96 ms (BENCHMARKS.md).
It only asks (madvise): a kernel whose transparent huge pages are `never` ignores it. A value the
user set is kept (`THP_MEM_ALLOC_ENABLE=0` turns it off). metrics.json records `thp_alloc`. The
allocator aligns a tensor to 4 KiB only, which leaves each tensor's ends in small pages: the runner
moves the large weights onto 2 MiB boundaries (executor/huge_pages.py).

The OpenMP wait policy: on a busy host, OpenMP threads that finish a parallel region sleep
instead of spinning (`OMP_WAIT_POLICY=PASSIVE`). A decode step runs
hundreds of short parallel regions; next to another busy process, libgomp's default spinning burns
the time slices of the very thread the others wait for, and a 2 ms ge_graph step took 135-175 ms
(BENCHMARKS.md, "Under load", benchmarks/load_bench.py). Sleeping is not free either: on an idle
VM, waking a sleeping thread costs tens of microseconds, and the passive policy made the same
steps 2-8x slower. So the policy follows the host: PASSIVE when other tasks are running on this
process's cores as it starts (/proc/loadavg's runnable count, sampled), libgomp's default otherwise.
libgomp reads the policy once, when it loads, so this must happen before `import torch`; it has no
effect in a process that imported torch first. A policy the user set is kept;
`CANN_RECIPES_OMP_DEFAULTS=0` leaves the environment alone. The choice and its reason are in
metrics.json (`omp_wait_policy`, `omp_reason`). A neighbour that arrives later is the decode
loop's business: it runs on fewer threads while they wait for a core (executor/threads.py).

Freed memory is kept for reuse (glibc malloc: no mmap for large blocks, trim only past 1 GiB of
free heap top): PyTorch's CPU allocator hands every tensor to malloc, and glibc serves large blocks
with fresh mmaps and returns them on free, so a tensor made every step got new pages from the
kernel every step. The (64, 151936) fp32 logits of a batch-64 decode step, converted from bf16,
took 15-20 ms in new pages against 1.4 ms in reused ones (BENCHMARKS.md "eleventh pass"); the
batch-16 ones 1.3-5 ms. The same policy PyTorch's CPU inference guides get from jemalloc or
tcmalloc; the price is that the process's resident memory stays near its peak, so the memory
pre-flight gives the free pages back before it reads what is available (`release_freed_memory`).
Left alone when the user set glibc's own malloc variables (MALLOC_*_, GLIBC_TUNABLES) or preloads
another allocator, on a C library that is not glibc, and with `CANN_RECIPES_MALLOC_DEFAULTS=0`.
metrics.json records `malloc`.
"""

import contextlib
import ctypes
import os
import time


def busy_host(samples: int = 5) -> tuple[bool, str]:
    """(whether other tasks want this process's cores now, the reason in words)."""
    try:
        cores = len(os.sched_getaffinity(0))
        running = []
        for _ in range(samples):
            with open("/proc/loadavg") as f:
                running.append(int(f.read().split()[3].split("/")[0]) - 1)  # minus this process
            time.sleep(0.005)
    except (OSError, ValueError, IndexError, AttributeError):
        return False, "no /proc/loadavg: libgomp's default"
    others = sorted(running)[len(running) // 2]
    busy = others * 2 >= cores  # other runnable tasks on at least half the cores
    return busy, f"{others} other runnable task(s) on {cores} core(s) at start"


def thp_mode() -> str:
    """The kernel's transparent-huge-page mode (always / madvise / never), or why it is unknown."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            text = f.read()
    except OSError:
        return "unknown (no /sys/kernel/mm/transparent_hugepage)"
    chosen = [w.strip("[]") for w in text.split() if w.startswith("[")]
    return chosen[0] if chosen else "unknown"


KEEP_FREED_TOP = 1 << 30  # free heap top returned to the kernel only past this
GLIBC_MALLOC_VARIABLES = ("MALLOC_MMAP_MAX_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")


def keep_freed_memory() -> str:
    """Ask glibc's malloc to keep freed memory for reuse (see the module docstring); what was
    done, in words."""
    if os.environ.get("CANN_RECIPES_MALLOC_DEFAULTS", "1") == "0":
        return "system default (CANN_RECIPES_MALLOC_DEFAULTS=0)"
    own = [k for k in GLIBC_MALLOC_VARIABLES if k in os.environ]
    if "glibc.malloc" in os.environ.get("GLIBC_TUNABLES", ""):
        own.append("GLIBC_TUNABLES")
    if "malloc" in os.environ.get("LD_PRELOAD", ""):
        own.append("LD_PRELOAD")
    if own:
        return f"left to the user's settings ({', '.join(own)})"
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version.restype = ctypes.c_char_p
        version = libc.gnu_get_libc_version().decode()
    except (OSError, AttributeError):
        return "system default (not glibc)"
    m_trim_threshold, m_mmap_max = -1, -4  # glibc's malloc.h
    if not (libc.mallopt(m_mmap_max, 0) and libc.mallopt(m_trim_threshold, KEEP_FREED_TOP)):
        return f"system default (glibc {version} refused mallopt)"
    return f"glibc {version}: freed memory kept (M_MMAP_MAX=0, M_TRIM_THRESHOLD={KEEP_FREED_TOP})"


def release_freed_memory() -> None:
    """Give the kernel back the pages of every free block of glibc's heap (malloc_trim(0)).

    Why: freed memory this process keeps is invisible to MemAvailable, so the memory pre-flight
    (executor.memory) would count a process that loaded one model and freed it as using that
    memory still: decode_bench, after writing a 30B-A3B-shaped checkpoint (6.1 GiB freed) and two
    runners, was refused its third with 9.9 GB said to be available of 22.7. Trimming took 22 ms
    there; the pages are faulted in again as the next tensors reuse them. A no-op off glibc."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).malloc_trim(0)


os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
MALLOC_POLICY = keep_freed_memory()

if os.environ.get("CANN_RECIPES_OMP_DEFAULTS", "1") != "0" and "OMP_WAIT_POLICY" not in os.environ:
    _busy, _why = busy_host()
    if _busy:
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    os.environ["CANN_RECIPES_OMP_REASON"] = _why
