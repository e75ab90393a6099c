"""Intra-op threads for the CPU decode loop on a shared host.

Why: every parallel region of a decode step ends at a barrier where the step's threads wait for
each other. When another process takes some of the cores, the thread being waited for is often
not running, and the step waits for the scheduler instead of for work: on the 2-core reference
VM, with a neighbour running 2-thread matmuls that started after the process, a Qwen3-0.6B
ge_graph step went from 84 to 3,076 ms and bench-overhead ones took up to 144 ms instead of ~1,
while the same steps on one thread took 1.6x and 1.2x their idle time
(BENCHMARKS.md, "fifth pass"). The OpenMP wait policy chosen at start (executor/__init__.py) only
helps a host that is already busy then; libgomp reads it once.

So the decode loop watches how long its threads waited for a core (Linux schedstat: time
runnable but not running) and, when that is a noticeable share of the step, tries the next lower
thread count for a few steps and keeps it if it is not slower. From a reduced count it tries the
next higher one again, soon when the waiting has stopped, rarely while it lasts, backing off after
each try that lost. On an idle host the waiting share stays near zero (the main thread's read
0.000-0.002 per step), so nothing is tried and the cost is one read of a kept-open file per
thread and step (about 1 us each).

The counts tried halve from the process's intra-op thread count down to 1. A try at fewer threads
needs at least three recent steps whose threads each waited 5% of the step's time or more and 1 ms,
and as much on average over the recent steps, which an idle host does not show. Counting the steps
keeps a burst of one or two steps out: on an idle VM two steps once waited 4 and 12 ms while the
host's own kernel work ran (BENCHMARKS.md, "forty-third pass"), which passed the average over three
steps and cost a 3-step try on one thread; a neighbour that matters makes every step wait.

One step can be enough: a step that waited a quarter of its time or more and took STALL (4) times
the median of its count's recent calm steps is a stall, and the next lower count is tried from the
next step, past the window and the back-off; it also backs off the next try at more threads, as a lost
try would. Next to a late neighbour, the 2-core VM's 0.6B steps on 2 threads went from ~67 ms to
~2.85 s each, in runs of 5-7 steps (every parallel region waited ~7.7 ms for a core), which the window
let pass (BENCHMARKS.md, "eighty-first pass"). The prefill runs at the count decode chose
(`prefilling`): it is eager, and it stalled the same way.

What a try costs depends on the step. An eager step, and a large model's compiled step (its kernels
read the count when they run and Dynamo does not guard it: executor.backends.inductor.CPU_KERNELS),
run at a new count as they are. A small model's compiled step has the count compiled in and Dynamo
guards on it, so its first step at a new count compiles it again (seconds; once per process and
count). That step is logged and is not a sample, and a try at such a count also waits, unless the
waiting is heavy (a quarter of the time over a full window of steps: a neighbour holding a core,
which made 0.6B steps 2.8-4.8x slower), until the waiting since the last change adds up to what the
step's first compile took (rent until the rent would have paid for the purchase): 2.5 ms of waiting
per 50 ms step (a bf16 batch sweep on a VM with short bursts of kernel work) was not worth a 56 s
recompile, which that sweep paid three times before this rule (before a large model's kernels read
the count). Nor is it made, however heavy the waiting, when the steps left in the generate call take
less time in all than that compile: fewer threads cannot save more than all of them (`bash
infer.sh`, 31 steps of ~1 ms on a host busy for a moment, once paid a 21.7 s recompile for 1 thread
and then went back to 2). The window starts empty in each generate call, so calls shorter than it
only ever try once the waiting has paid. The step that compiles is reported by `observe`, so that
the runner leaves it out of the decode averages and the throughput, as it leaves out the warm-up's
compile. Off with several ranks (every rank must compute replicated values in the same order) and
off the CPU (host threads there only launch kernels). Each decode step's thread count is returned
with its time, and metrics.json says whether the governor was on, why not, and every change it made.
A step too small to share (TINY_MACS: rows x the weights a token multiplies, an MoE layer's k
experts only; a debug model's batch-1 step) runs on one thread from its first call, with nothing
tried: there one thread was as fast idle, and the count is compiled into its kernels, so the
governor could not move it under load without a compile.
`CANN_RECIPES_ADAPTIVE_THREADS=0` turns all of this off.
"""

from __future__ import annotations

import contextlib
import os
import statistics
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

TASKS = "/proc/self/task"  # <tid>/schedstat: "<ns on a core> <ns runnable, waiting for a core> <slices>"
ENV = "CANN_RECIPES_ADAPTIVE_THREADS"

WINDOW = 8  # recent steps at the current count that a decision looks at
PROBE = 3  # steps run at a candidate count before it is judged
CONTENDED = 0.05  # waiting share that starts a try at fewer threads; an idle host reads near 0
# ... and the waiting it takes per step, on average: on sub-ms steps a scheduler blip alone made
# 5% (`bash infer.sh`, 0.6 ms steps right after a test suite exited: 4 steps moved to one thread
# for a 14 s recompile). A neighbour that matters costs ms per step (fifth pass: up to 3 s).
MIN_WAIT_MS = 1.0
BUSY_STEPS = 3  # ... and the recent steps that each waited that much (share and ms): a burst is not a busy host
# ... at this share over a full WINDOW a try at a count not compiled yet does not wait for the
# waiting to pay for the compile: load_bench's late neighbour made the 0.6B steps 2.8-4.8x slower.
HEAVY = 0.25
CLEAR = 0.01  # waiting share under which the host counts as free again
KEEP_FEWER = 1.05  # fewer threads are kept unless more than 5% slower: they leave cores to the neighbour
KEEP_MORE = 0.9  # more threads are kept only if at least 10% faster
GIVE_UP = 2.0  # a try at more threads ends at its first step this much slower (a step can take 600x)
# A step this many times the median of the count's recent calm steps (waiting under CONTENDED), that
# waited HEAVY or more, is a stall: the next lower count is tried from the next step, with no window
# of busy steps first and no back-off from earlier tries (ThreadGovernor.observe says why).
STALL = 4.0
FIRST_WAIT = {"down": 3, "up": 8}  # steps between tries in each direction, doubled after each lost try ...
LAST_WAIT = 1024  # ... up to this
BUSY_UP = 8  # while the waiting lasts, tries at more threads wait this many times longer
BUDGET = 20  # and a try waits for at least 20x the time the last lost try cost: tries cost <= 5%
# A decode step of at most this many multiply-adds (rows x the weights a token multiplies; of an MoE
# layer's experts, the k it is routed to) runs on one thread, whatever the host: it is launch
# overhead, not arithmetic, and a second thread only adds barriers.
# bench-overhead (2.1M weights, count compiled in; BENCHMARKS.md, "thirty-seventh pass"), idle, 1
# thread against 2 (alternating rounds): ge_graph 0.95-1.13 and SK decoder 0.83-1.11 at 1-4 rows
# over four A/Bs, but 1.43 and 1.35 at 16 rows (33.6M); next to a late neighbour its 2-thread
# ge_graph step was 7.1x its idle time in one run of two (1.1x on one thread), and a try at 1
# thread would have been a compile of ~20 s.
TINY_MACS = 16_000_000


@dataclass
class Change:
    step: int  # decode step (0-based, within its generate call) from which `threads` applies
    was: int  # intra-op threads before
    threads: int  # and from that step on
    why: str


@dataclass
class ThreadGovernor:
    """Chooses the intra-op thread count of each decode step. `observe` is told each step's time
    and how long the process's threads waited for a core and sets the count for the next step through
    `set_threads`. What it has learnt (the count, how long to wait before the next try) is kept
    across generate calls."""

    full: int
    enabled: bool
    reason: str
    set_threads: Callable[[int], None] = torch.set_num_threads
    log: Callable[[str], None] = lambda line: None
    levels: list[int] = field(init=False)  # counts that can be chosen: full, full // 2, ..., 1
    level: int = field(init=False, default=0)  # index of the chosen count in levels
    changes: list[Change] = field(init=False, default_factory=list)

    def __post_init__(self):
        self.levels = [self.full]
        while self.levels[-1] > 1:
            self.levels.append(self.levels[-1] // 2)
        self.wait_for = dict(FIRST_WAIT)  # steps before the next try, per direction
        self.lost_ms = {"down": 0.0, "up": 0.0}  # what the last lost try cost, per direction
        self.since, self.since_ms = 0, 0.0  # steps and decode time since the last try
        self.since_wait_ms = 0.0  # and the threads' waiting for a core in that time
        self.compiled: set = set()  # (step key, thread count) pairs that have run once
        self.compile_ms: dict = {}  # step key -> its first step's time (the compile), the cost of a new count
        # logged once: tries held back (key, count) or not made (key, count, steps), a tiny step (key, "pinned")
        self.held: set = set()
        self.running = self.full  # the count the governor last set
        self.calm: dict = {}  # (step key, thread count) -> its last WINDOW calm steps' times (ms)
        self.clock: RunQueueClock | None = None
        self._new_call(key=None)

    @classmethod
    def for_run(cls, kind: str, world: int, log: Callable[[str], None] = lambda line: None) -> ThreadGovernor:
        """On when this process decodes on the CPU alone with several threads and schedstat is
        readable; otherwise off, with the reason."""
        threads = torch.get_num_threads()
        if os.environ.get(ENV, "1") == "0":
            why = f"off: {ENV}=0"
        elif kind != "cpu":
            why = f"off: decode runs on {kind}, host threads only launch its kernels"
        elif world > 1:
            why = f"off: {world} ranks (each must compute replicated values in the same order)"
        elif threads < 2:
            why = f"off: {threads} intra-op thread"
        elif not RunQueueClock.available():
            why = f"off: {TASKS}/<tid>/schedstat is not readable"
        else:
            return cls(threads, True, f"on: {threads} threads, fewer while they wait for a core", log=log)
        return cls(threads, False, why, log=log)

    @property
    def threads(self) -> int:
        """The count the next step runs with (torch's own, so a count set from outside is told too)."""
        return torch.get_num_threads()

    def waited_ms(self) -> float:
        """The process's threads' total wait for a core so far (0 when off); a step's is a difference."""
        return self.clock.read_ms() if self.clock else 0.0

    def _new_call(self, key: object, steps: int | None = None, compiles: bool = True) -> None:
        self.key, self.step, self.steps, self.compiles = key, 0, steps, compiles
        self.pinned = False  # this call runs on one thread, untouched (TINY_MACS)
        self.window: list[tuple[float, float]] = []  # (ms, wait ms) of recent steps at the chosen count
        self.trying: int | None = None  # the level being tried
        self.tried_ms: list[float] = []
        self.base_ms = 0.0  # mean step time at the chosen count when the try began

    def _set(self, level: int) -> None:
        self.running = self.levels[level]
        self.set_threads(self.running)

    @contextlib.contextmanager
    def decoding(
        self, key: object, steps: int | None = None, compiles: bool = True, macs: float | None = None
    ) -> Iterator[ThreadGovernor]:
        """One generate call's decode loop of `steps` steps (None: not known) for the step `key`,
        at the count chosen so far; `compiles`: the step is compiled per thread count (`CompiledStep.
        compiles`), not eager or a large model's compiled step, whose first step at a new count is a
        step like the others and costs nothing to try; `macs`: the step's multiply-adds, if known
        (at most TINY_MACS: one thread, nothing tried). The process's count is restored on exit,
        whatever happens."""
        before = torch.get_num_threads()
        self._new_call(key, steps, compiles)
        self.pinned = self.enabled and macs is not None and macs <= TINY_MACS
        try:
            if self.pinned:
                if (key, "pinned") not in self.held:
                    self.held.add((key, "pinned"))
                    self.log(
                        f"[run] decode on 1 intra-op thread: a step of {macs / 1e6:.1f}M multiply-adds is launch "
                        "overhead, which a second thread does not share (executor/threads.py, TINY_MACS)"
                    )
                self.set_threads(1)
            elif self.enabled:
                self.clock = RunQueueClock()
                self._set(self.level)
            yield self
        finally:
            if self.clock:
                self.clock.close()
                self.clock = None
            if self.enabled:
                self.set_threads(before)

    @contextlib.contextmanager
    def prefilling(self) -> Iterator[None]:
        """A generate call's prefill, at the count decode chose while that is fewer than all: the
        prefill is eager (it runs at any count as it is), and its parallel regions stall on a busy
        host as the decode step's do. Next to a late neighbour, with decode on one thread, the 0.6B
        prefill on two threads took ~2.9 s in about one call of three instead of ~0.2 s (BENCHMARKS.md,
        "eighty-first pass"). The process's count is restored on exit."""
        before = torch.get_num_threads()
        fewer = self.enabled and self.level > 0
        if fewer:
            self.set_threads(self.levels[self.level])
        try:
            yield
        finally:
            if fewer:
                self.set_threads(before)

    def observe(self, ms: float, wait_ms: float) -> bool:
        """The step just run took `ms`; its threads spent `wait_ms` (summed) waiting for a core.
        Returns False when that step compiled the step for a thread count (not a sample of the
        step's time), True otherwise."""
        step, self.step = self.step, self.step + 1
        if not self.enabled or self.pinned:
            return True
        if self.compiles and (self.key, self.running) not in self.compiled:
            # The first step of a compiled step at a thread count compiles it: Dynamo guards on the
            # count, and Inductor emits kernels for it (a one-off, kept in the compile cache). Not a sample.
            self.compiled.add((self.key, self.running))
            self.compile_ms.setdefault(self.key, ms)
            if step > 0:
                self.log(
                    f"[run] decode step {step}: first step on {self.running} intra-op thread(s), {ms / 1e3:.1f} s "
                    "(a compiled step is compiled again for each thread count)"
                )
            return False
        self.since, self.since_ms, self.since_wait_ms = self.since + 1, self.since_ms + ms, self.since_wait_ms + wait_ms
        stalled = self._stalled(ms, wait_ms)
        if self.trying is not None:
            self._judge(ms, step)
            return True
        self.window = [*self.window[-(WINDOW - 1) :], (ms, wait_ms)]
        # A stall is tried at once: with a late neighbour on the 2-core VM, runs of 5-7 consecutive
        # 0.6B steps on 2 threads took 2.8-2.9 s each (~42x their calm 67 ms; every parallel region
        # waited ~7.7 ms for a core), and the window, the busy steps and the back-off of earlier
        # tries let 7 of them pass before one thread ran (BENCHMARKS.md, "eighty-first pass").
        if stalled and self.level + 1 < len(self.levels) and self._worth(step, heavy=True):
            # and it counts against more threads as a lost try would: a try up under this load won
            # (2 threads ran 74-88 ms against 133-137 at 1) and stalled a few steps later
            self.lost_ms["up"] = max(self.lost_ms["up"], ms - statistics.median(self.calm[(self.key, self.running)]))
            self.wait_for["up"] = min(self.wait_for["up"] * 2, LAST_WAIT)
            self._try(self.level + 1)
            return True
        if len(self.window) < PROBE:
            return True
        waited = sum(w for _, w in self.window)
        share = waited / max(sum(m for m, _ in self.window), 1e-9)
        waiting = sum(w >= CONTENDED * m and w >= MIN_WAIT_MS for m, w in self.window)  # steps that waited
        contended = share >= CONTENDED and waited >= MIN_WAIT_MS * len(self.window) and waiting >= BUSY_STEPS
        heavy = share >= HEAVY and len(self.window) >= WINDOW
        if contended and self.level + 1 < len(self.levels) and self._may("down") and self._worth(step, heavy):
            self._try(self.level + 1)
        elif self.level > 0 and self._may("up", busy=share >= CLEAR):
            self._try(self.level - 1)
        return True

    def _stalled(self, ms: float, wait_ms: float) -> bool:
        """Whether this step, at the running count, is a stall (STALL); a calm step is remembered as
        the count's measure. A count with fewer than PROBE calm steps has no measure yet."""
        calm = self.calm.setdefault((self.key, self.running), [])
        if wait_ms < CONTENDED * ms:
            calm[:] = [*calm[-(WINDOW - 1) :], ms]
            return False
        return len(calm) >= PROBE and wait_ms >= HEAVY * ms and ms >= STALL * statistics.median(calm)

    def _may(self, way: str, busy: bool = False) -> bool:
        steps = self.wait_for[way] * (BUSY_UP if busy else 1)
        return self.since >= steps and self.since_ms >= BUDGET * self.lost_ms[way]

    def _worth(self, step: int, heavy: bool) -> bool:
        """Whether a try at the next lower count is worth what it costs: nothing when the step runs
        at any count as it is (its first call may have compiled it) or is compiled for it already;
        otherwise a compile, never worth it when the steps left in this call take less time in all
        than the compile (fewer threads cannot save more than all of it), else worth it under heavy
        waiting or once the waiting since the last change has added up to the step's first compile
        time."""
        count = self.levels[self.level + 1]
        cost = self.compile_ms.get(self.key, 0.0)
        if not self.compiles or (self.key, count) in self.compiled:
            return True
        if self.steps is not None:
            left = self.steps - step - 1
            left_ms = left * statistics.fmean(m for m, _ in self.window)
            if left_ms < cost:
                if (self.key, count, self.steps) not in self.held:
                    self.held.add((self.key, count, self.steps))
                    self.log(
                        f"[run] decode step {step}: threads wait for a core; a try at {count} thread(s) would compile "
                        f"the step again (~{cost / 1e3:.1f} s), longer than the {left} step(s) left in this call take "
                        f"(~{left_ms / 1e3:.2f} s): not tried"
                    )
                return False
        if heavy or self.since_wait_ms >= cost:
            return True
        if (self.key, count) not in self.held:
            self.held.add((self.key, count))
            self.log(
                f"[run] decode step {step}: threads wait for a core; a try at {count} thread(s) would compile the "
                f"step again (~{cost / 1e3:.1f} s): held until the waiting adds up to that or reaches {HEAVY:.0%}"
            )
        return False

    def _try(self, level: int) -> None:
        self.trying, self.tried_ms = level, []
        self.base_ms = statistics.fmean(m for m, _ in self.window)
        self._set(level)

    def _judge(self, ms: float, step: int) -> None:
        self.tried_ms.append(ms)
        way = "down" if self.trying > self.level else "up"
        lost_at_once = way == "up" and ms > GIVE_UP * self.base_ms
        if len(self.tried_ms) < PROBE and not lost_at_once:
            return
        got, base = statistics.fmean(self.tried_ms), self.base_ms
        if not lost_at_once and got <= base * (KEEP_FEWER if way == "down" else KEEP_MORE):
            frm, to = self.levels[self.level], self.levels[self.trying]
            why = f"{to} thread(s) ran {got:.3f} ms/step against {base:.3f} at {frm}"
            self.changes.append(Change(step + 1, frm, to, why))
            self.log(f"[run] decode step {step + 1}: {to} intra-op thread(s) from now on ({why})")
            self.level, self.wait_for[way], self.lost_ms[way] = self.trying, FIRST_WAIT[way], 0.0
        else:
            self.wait_for[way] = min(self.wait_for[way] * 2, LAST_WAIT)
            self.lost_ms[way] = max(0.0, sum(self.tried_ms) - base * len(self.tried_ms))
        self._set(self.level)
        self.trying, self.window, self.since, self.since_ms, self.since_wait_ms = None, [], 0, 0.0, 0.0

    def to_metrics(self, step_threads: list[int], prefill_threads: int = 0) -> dict:
        """For metrics.json: on/off and why, whether the last call ran on one thread untouched
        (TINY_MACS), the count its prefill ran on (`prefilling`; 0: not told), the steps run at each
        count, every change so far."""
        counts = {str(n): step_threads.count(n) for n in sorted(set(step_threads), reverse=True)}
        return {
            "enabled": self.enabled,
            "reason": self.reason,
            "one_thread_tiny_step": self.pinned,
            "prefill_threads": prefill_threads,
            "steps_per_thread_count": counts,
            "changes": [vars(c) for c in self.changes],
        }


class RunQueueClock:
    """Milliseconds the process's threads have spent runnable but not running, summed, from
    Linux's per-thread schedstat. All threads count: with a passive wait policy the main thread
    sleeps at the barrier while the worker it waits for queues for a core. The threads are listed
    once (the decode loop's OpenMP pool exists by then: prefill made it) and each file is re-read
    in place, about 1 us per thread per read; a thread that has exited reads as nothing."""

    def __init__(self):
        self.fds = []
        for tid in os.listdir(TASKS):
            with contextlib.suppress(OSError):
                self.fds.append(os.open(f"{TASKS}/{tid}/schedstat", os.O_RDONLY))

    @staticmethod
    def available() -> bool:
        try:
            with open(f"{TASKS}/{os.getpid()}/schedstat") as f:
                return len(f.read().split()) >= 2
        except OSError:
            return False

    def read_ms(self) -> float:
        total = 0
        for fd in self.fds:
            with contextlib.suppress(OSError, IndexError, ValueError):
                total += int(os.pread(fd, 64, 0).split()[1])
        return total / 1e6

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)
