"""The decode loop's thread governor (executor/threads.py): its choices for given step times and
waits, the real schedstat clock, and real runs (eager and ge_graph) on the count it chose."""

import io
import os
import statistics
import subprocess
import sys
import time

import pytest
import torch
from torch._dynamo.utils import counters

from executor import threads as th
from executor.backends import inductor as inductor_backend
from executor.threads import RunQueueClock, ThreadGovernor


@pytest.fixture
def governor():
    """An enabled governor over this machine's 2..1 threads; the process's count is put back."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    lines = []
    gov = ThreadGovernor(2, True, "test", log=lines.append)
    gov.lines = lines
    yield gov
    torch.set_num_threads(before)


def feed(
    gov: ThreadGovernor, steps: list[tuple[float, float]], known: bool = False, compiles: bool = True
) -> list[int]:
    """Run `steps` (ms, wait ms) through one decode call (`known`: the governor is told how many
    steps it has; `compiles`: a step compiled per thread count, not eager's or a large model's); the
    thread count each step ran with. `gov.samples` is what observe returned."""
    ran, gov.samples = [], []
    with gov.decoding(key="step", steps=len(steps) if known else None, compiles=compiles):
        for ms, wait in steps:
            ran.append(gov.threads)
            gov.samples.append(gov.observe(ms, wait))
    return ran


def test_an_idle_host_keeps_every_thread(governor):
    ran = feed(governor, [(1.0, 0.0)] * 200)
    assert ran == [2] * 200 and governor.changes == []


def test_scheduler_blips_on_short_steps_are_not_a_busy_host(governor):
    # 10% of a 0.6 ms step is 60 us of waiting: not worth a recompile at another thread count
    ran = feed(governor, [(0.6, 0.06)] * 200)
    assert ran == [2] * 200 and governor.changes == []
    # the same share of a 20 ms step (2 ms waited per step) is
    assert feed(governor, [(20.0, 2.0)] * 5)[-1] == 1


def test_a_burst_of_one_or_two_waiting_steps_is_not_a_busy_host(governor):
    # an idle VM once made two 35 ms steps wait 4 and 12 ms (its own kernel work): over three steps
    # that is 15% and 5 ms a step on average, but only two steps waited; bursts of two, a window apart
    governor.compiled.add(("step", 1))  # a try would cost nothing: only the waiting holds it back
    quiet, burst = [(35.0, 0.0)] * th.WINDOW, [(35.0, 4.0), (35.0, 12.0)]
    ran = feed(governor, [(35.0, 0.0), *(burst + quiet) * 5])
    assert set(ran) == {2} and governor.changes == [] and governor.trying is None
    # a third such step within the window is
    ran = feed(governor, [(35.0, 0.0), *burst, (35.0, 0.0), (35.0, 4.0), (20.0, 0.0)])
    assert ran == [2] * 5 + [1]


def test_waiting_for_a_core_moves_to_fewer_threads_when_they_are_not_slower(governor):
    # the first step at a count compiles (not a sample); three steps that waited half their time
    # -> a try on 1 thread: its first step compiles again, then three samples
    # (a first step of 6 ms: a compile that cheap is paid for by the 7.5 ms those three steps waited)
    contended, alone = [(5.0, 2.5)] * 3, [(1.2, 0.3), (1.1, 0.3), (1.3, 0.3)]
    ran = feed(governor, [(6.0, 0.0), *contended, (900.0, 0.0), *alone, (1.2, 0.3)])
    assert ran == [2] * 4 + [1] * 5
    assert [(c.step, c.was, c.threads) for c in governor.changes] == [(8, 2, 1)]
    assert "1 thread(s) ran 1.200 ms/step against 5.000 at 2" in governor.changes[0].why
    assert [line.split(":")[0] for line in governor.lines] == ["[run] decode step 4", "[run] decode step 8"]
    assert "first step on 1 intra-op thread(s), 0.9 s" in governor.lines[0]
    # the steps that compiled are not samples: the runner leaves them out of its averages
    assert [i for i, sample in enumerate(governor.samples) if not sample] == [0, 4]
    assert torch.get_num_threads() == 2  # the call's end restores the process's count
    # the next call of the same compiled step starts at the chosen count, compiled already
    assert feed(governor, [(1.2, 0.3)] * 3) == [1, 1, 1]


def test_a_new_count_is_not_compiled_for_a_little_waiting_on_long_steps(governor):
    # a 56 s first compile; 2.5 ms of waiting per 50 ms step: 200 steps wait 0.5 s, far from 56 s
    ran = feed(governor, [(56_000.0, 0.0), *[(50.0, 2.5)] * 200])
    assert ran == [2] * 201 and governor.changes == []
    assert len(governor.lines) == 1 and "would compile the step again (~56.0 s)" in governor.lines[0]


def test_moderate_waiting_tries_once_it_would_have_paid_for_the_compile(governor):
    # 20% waiting (under HEAVY): the 50th such step brings the waiting to the 1 s first compile;
    # the try's first step compiles, three 1-thread steps as fast keep it
    ran = feed(governor, [(1_000.0, 0.0), *[(100.0, 20.0)] * 50, (1_000.0, 0.0), *[(80.0, 5.0)] * 3])
    assert ran == [2] * 51 + [1] * 4
    assert [(c.was, c.threads) for c in governor.changes] == [(2, 1)]


def test_heavy_waiting_tries_after_a_full_window_whatever_the_compile_costs(governor):
    # a neighbour holding a core: two thirds of each step waited; tried once WINDOW steps show it
    heavy = [(300.0, 200.0)] * th.WINDOW
    ran = feed(governor, [(56_000.0, 0.0), *heavy, (56_000.0, 0.0), *[(150.0, 10.0)] * 3])
    assert ran == [2] * (1 + th.WINDOW) + [1] * 4
    assert [(c.was, c.threads) for c in governor.changes] == [(2, 1)]


def test_no_compile_is_tried_that_the_steps_left_cannot_pay_for(governor):
    # `bash infer.sh`: an 8.5 s first compile (the warm-up), then 31 steps of ~4 ms on a host busy
    # for a moment. One thread could at best save all of the ~0.1 s left: never worth 8.5 s
    governor.compiled.add(("step", 2))
    governor.compile_ms["step"] = 8_500.0
    busy = [(4.0, 3.0)] * 31
    assert feed(governor, busy, known=True) == [2] * 31 and governor.changes == []
    assert all(governor.samples)
    assert len(governor.lines) == 1
    assert "longer than the 28 step(s) left in this call take (~0.11 s): not tried" in governor.lines[0]
    # a call long enough for the steps left to pay for it tries as soon as the waiting is heavy
    ran = feed(governor, [*[(4.0, 3.0)] * 3_000], known=True)
    assert ran[: th.WINDOW] == [2] * th.WINDOW and ran[th.WINDOW] == 1


def test_a_step_with_nothing_to_compile_at_a_new_count_tries_it_at_once(governor):
    # the compiled case above, for a step that runs at any count as it is (eager, or a large
    # model's compiled step): every step is a sample, no "first step on" line, and the few steps
    # left do not hold a try back (its first step costs what the others do), even where its first
    # call compiled it (a large model's: 100 s)
    governor.compiled.add(("step", 2))
    governor.compile_ms["step"] = 100_000.0
    busy = [(4.0, 3.0)] * 31
    ran = feed(governor, busy, known=True, compiles=False)
    assert all(governor.samples) and not any("first step on" in line or "not tried" in line for line in governor.lines)
    assert [(c.was, c.threads) for c in governor.changes] == [(2, 1)] and ran[-1] == 1


def test_a_tiny_step_runs_on_one_thread_and_nothing_is_tried(governor):
    # a debug model's batch-1 step: one thread from its first step, however busy the host, and the
    # process's count is back afterwards; a step one multiply-add larger is governed as before
    busy = [(4.0, 3.0)] * 200
    ran, governor.samples = [], []
    for _ in range(2):
        with governor.decoding(key="step", steps=len(busy), macs=th.TINY_MACS) as gov:
            for ms, wait in busy:
                ran.append(gov.threads)
                governor.samples.append(gov.observe(ms, wait))
        assert torch.get_num_threads() == 2
    assert ran == [1] * 400 and all(governor.samples) and governor.changes == []
    assert len(governor.lines) == 1 and "a step of 16.0M multiply-adds" in governor.lines[0]
    assert governor.to_metrics(ran)["one_thread_tiny_step"] is True
    with governor.decoding(key="step", macs=th.TINY_MACS + 1):
        assert governor.threads == 2 and not governor.pinned
    assert feed(governor, busy)[-1] == 1 and governor.changes  # the try the tiny step never had
    assert governor.to_metrics(ran)["one_thread_tiny_step"] is False
    off = ThreadGovernor(2, False, f"off: {th.ENV}=0")  # the user's count, tiny step or not
    with off.decoding(key="step", macs=1):
        assert off.threads == 2 and not off.pinned


def test_a_lost_try_goes_back_and_waits_longer_before_the_next(governor):
    slow_alone = [(8.0, 0.5)] * 3  # one thread is slower: keep two
    ran = feed(governor, [(6.0, 0.0), *[(5.0, 2.5)] * 3, (900.0, 0.0), *slow_alone])
    assert ran == [2] * 4 + [1] * 4 and governor.changes == []
    assert governor.wait_for["down"] == 6 and governor.lost_ms["down"] == pytest.approx(3 * 8.0 - 3 * 5.0)
    # the next try waits for 6 steps and for 20x the 9 ms lost: 36 steps of 5 ms; as fast, so kept
    ran = feed(governor, [(5.0, 2.5)] * 40)
    assert ran == [2] * 36 + [1] * 4
    assert [(c.step, c.was, c.threads) for c in governor.changes] == [(39, 2, 1)]


def test_back_to_more_threads_once_the_host_is_free(governor):
    governor.level, governor.compiled = 1, {("step", 1), ("step", 2)}  # learnt in earlier calls
    free, faster = [(2.0, 0.0)] * 8, [(1.0, 0.0)] * 3
    ran = feed(governor, [*free, *faster, (1.0, 0.0)])
    assert ran == [1] * 8 + [2] * 4
    assert [(c.was, c.threads) for c in governor.changes] == [(1, 2)]


def test_a_try_at_more_threads_under_load_ends_at_its_first_slow_step(governor):
    governor.level, governor.compiled = 1, {("step", 1), ("step", 2)}
    busy = [(2.0, 0.5)] * (th.FIRST_WAIT["up"] * th.BUSY_UP)
    ran = feed(governor, [*busy, (600.0, 300.0), *busy])
    at = len(busy)
    assert ran[at] == 2 and set(ran[:at]) == {1} and set(ran[at + 1 :]) == {1}
    assert governor.changes == [] and governor.lost_ms["up"] == pytest.approx(598.0)
    # the next try waits until the decode time since then is 20x what that step lost
    assert not governor._may("up", busy=True)


def test_a_stall_is_tried_at_once_whatever_the_window_and_the_back_off_say(governor):
    # a late neighbour on the 2-core VM: 67 ms steps, then every step on 2 threads ~2.85 s, each
    # waiting as long (every parallel region waited for a core); earlier lost tries had backed off
    governor.wait_for["down"] = th.LAST_WAIT
    calm, stall, alone = [(67.0, 0.5)] * 4, (2_850.0, 2_850.0), [(120.0, 2.0)] * th.PROBE
    ran = feed(governor, [*calm, stall, *alone, (120.0, 2.0)], compiles=False)
    assert ran == [2] * 5 + [1] * 4
    assert [(c.step, c.was, c.threads) for c in governor.changes] == [(8, 2, 1)]
    assert "1 thread(s) ran 120.000 ms/step against 623.600 at 2" in governor.changes[0].why  # the window's mean
    # and it counts against the next try at 2 threads as a lost one would
    assert governor.lost_ms["up"] == pytest.approx(2_850.0 - 67.0)
    assert governor.wait_for["up"] == 2 * th.FIRST_WAIT["up"]


def test_what_is_not_a_stall(governor):
    governor.wait_for["down"] = th.LAST_WAIT  # only the stall rule could try fewer threads here
    calm = [(67.0, 0.5)] * 4
    # a long step that did not wait for a core (a collection, a first call's work): the host is not busy
    assert feed(governor, [*calm, (2_850.0, 10.0), (67.0, 0.5)], compiles=False) == [2] * 6
    # waiting on a step under STALL times the count's calm steps: the window decides, as before
    assert feed(governor, [*calm, (260.0, 200.0), (67.0, 0.5)], compiles=False) == [2] * 6
    # no calm measure yet for this step at this count (a call that starts on a busy host)
    governor.calm.clear()
    assert feed(governor, [(67.0, 0.5), (67.0, 0.5), (2_850.0, 2_850.0), (67.0, 0.5)], compiles=False) == [2] * 4
    assert governor.changes == []


def test_a_stall_does_not_try_a_compile_the_steps_left_cannot_pay_for(governor):
    # a compiled step whose 1-thread count is not compiled: a stall still weighs the compile
    governor.compile_ms["step"] = 60_000.0
    governor.compiled.add(("step", 2))
    ran = feed(governor, [(67.0, 0.5)] * 4 + [(2_850.0, 2_850.0)] + [(67.0, 0.5)] * 3, known=True)
    assert ran == [2] * 8 and governor.changes == []
    assert "would compile the step again (~60.0 s)" in governor.lines[0]


def test_the_prefill_runs_on_the_count_decode_chose(governor):
    with governor.prefilling():
        assert torch.get_num_threads() == 2  # nothing learnt yet: every thread
    governor.level = 1  # decode moved to 1 thread on a busy host
    torch.set_num_threads(2)
    with pytest.raises(RuntimeError), governor.prefilling():
        assert torch.get_num_threads() == 1
        raise RuntimeError("prefill failed")
    assert torch.get_num_threads() == 2
    off = ThreadGovernor(2, False, f"off: {th.ENV}=0")
    off.level = 1
    with off.prefilling():
        assert torch.get_num_threads() == 2  # the user's count when the governor is off


def test_the_process_thread_count_is_restored_after_an_error(governor):
    torch.set_num_threads(1)
    with pytest.raises(RuntimeError), governor.decoding(key="step"):
        assert governor.threads == 2  # the call runs at the chosen count
        raise RuntimeError("decode failed")
    assert torch.get_num_threads() == 1


def test_off_where_thread_counts_cannot_change_safely(monkeypatch):
    monkeypatch.delenv(th.ENV, raising=False)  # tests/conftest.py turns it off for the other tests
    cores = os.cpu_count()
    assert "cuda" in ThreadGovernor.for_run("cuda", 1).reason
    assert (
        ThreadGovernor.for_run("cpu", 2).reason
        == "off: 2 ranks (each must compute replicated values in the same order)"
    )
    monkeypatch.setenv(th.ENV, "0")
    assert ThreadGovernor.for_run("cpu", 1).reason == f"off: {th.ENV}=0"
    monkeypatch.delenv(th.ENV)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert ThreadGovernor.for_run("cpu", 1).reason == "off: 1 intra-op thread"
        torch.set_num_threads(cores)
        on = ThreadGovernor.for_run("cpu", 1)
        assert on.enabled == (cores > 1) and on.levels[0] == cores and on.levels[-1] == 1
    finally:
        torch.set_num_threads(before)


def test_the_clock_counts_time_spent_waiting_for_a_core():
    spin = "import time\nend = time.time() + 3\nwhile time.time() < end: pass\n"
    hogs = [subprocess.Popen([sys.executable, "-c", spin]) for _ in range(os.cpu_count())]
    try:
        time.sleep(0.3)  # the hogs are running
        clock = RunQueueClock()
        before, end = clock.read_ms(), time.time() + 1.0
        while time.time() < end:  # a third runnable task per core: this one must wait
            pass
        waited = clock.read_ms() - before
        clock.close()
    finally:
        for h in hogs:
            h.kill()
            h.wait()
    assert 50.0 < waited < 1000.0


@pytest.mark.parametrize(
    "exe_mode,large", [("eager", False), ("ge_graph", False), ("ge_graph", True)], ids=["eager", "ge_graph", "large"]
)
def test_steps_on_fewer_threads_give_the_same_tokens(make_qwen_runner, qwen3_ckpt, exe_mode, large, monkeypatch):
    """A real run whose governor has learnt "1 thread" gives the tokens of a run on 2 threads. In
    ge_graph the step is compiled again for 1 thread; `large`: as a large model's, whose kernels
    read the count and which Dynamo does not guard on it, the same compiled step runs."""
    monkeypatch.setattr(th, "CONTENDED", float("inf"))  # no tries of its own: the counts are the test's
    monkeypatch.setattr(th, "FIRST_WAIT", {"down": 10**6, "up": 10**6})
    monkeypatch.setattr(th, "TINY_MACS", 0)  # the test model's steps are tiny: let them run on 2 threads
    if large:  # the test model's weights are small: let it be treated as a large model's
        monkeypatch.setattr(inductor_backend, "DYNAMIC_THREADS_NUMEL", 0)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        runner = make_qwen_runner(qwen3_ckpt, f"model_config.exe_mode={exe_mode}", max_new_tokens=6)
        runner.threads = ThreadGovernor(2, True, "test")
        prompt = [[5, 6, 7, 8], [9, 10, 11, 12]]
        both = runner.generate(prompt, 6)
        runner.threads.level = 1
        graphs, lookups = (
            runner.step.graphs,
            counters["inductor"]["fxgraph_cache_miss"] + counters["inductor"]["fxgraph_cache_hit"],
        )
        one = runner.generate(prompt, 6)
        if exe_mode == "ge_graph":  # traced and lowered again for 1 thread, unless large
            assert runner.step.compiles != large and runner.step.compiler.stats.dynamic_threads == large
            assert runner.step.graphs == graphs + (not large)
            lowered = counters["inductor"]["fxgraph_cache_miss"] + counters["inductor"]["fxgraph_cache_hit"] - lookups
            assert (lowered == 0) == large
        assert both.decode_threads == [2] * 5 and one.decode_threads == [1] * 5
        assert one.token_ids == both.token_ids
        torch.testing.assert_close(one.last_logits, both.last_logits, rtol=1e-4, atol=1e-4)
        assert torch.get_num_threads() == 2
        metrics = runner._metrics(one, [""] * 2, None, 0.0)
        assert both.prefill_threads == 2  # the prefill runs on the count decode chose
        assert metrics["thread_governor"] == {
            "enabled": True,
            "reason": "test",
            "one_thread_tiny_step": False,
            "prefill_threads": 1,
            "steps_per_thread_count": {"1": 5},
            "changes": [],
        }
        # each call's first step ran at a count new to the step: in ge_graph it compiled it, not a
        # sample; eager has nothing to compile, so every step is one, and a large model's step
        # compiled once, on 2 threads
        skip = [0] if exe_mode == "ge_graph" and not large else []
        assert both.compile_steps == ([0] if exe_mode == "ge_graph" else [])
        assert one.compile_steps == skip and metrics["decode_compile_steps"] == skip
        assert metrics["decode_ms_median"] == statistics.median(one.decode_ms[len(skip) :])
        if not skip:
            return
        runner.stream = io.StringIO()
        one.decode_ms[0] = 20_000.0  # as a recompile on a busy host took
        assert runner._summarise_decode(one) == pytest.approx(2 * 4 / (sum(one.decode_ms[1:]) / 1e3))
        assert "leave out decode step(s) 0: they compiled the step for a new thread count (20.0 s)" in (
            runner.stream.getvalue()
        )
    finally:
        torch.set_num_threads(before)


def test_a_tiny_models_run_decodes_on_one_thread(make_qwen_runner, qwen3_ckpt):
    """The test model's batch-2 step is tiny (TINY_MACS): a real ge_graph run decodes it on one
    thread from its first step (compiled there once), says so, and is not read as a busy host."""
    from tools.measure import fewer_threads

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        runner = make_qwen_runner(qwen3_ckpt, "model_config.exe_mode=ge_graph", max_new_tokens=6)
        runner.threads = ThreadGovernor(2, True, "test", log=runner.log)
        runner.stream = io.StringIO()
        gen = runner.generate([[5, 6, 7, 8], [9, 10, 11, 12]], 6)
        assert gen.decode_threads == [1] * 5 and gen.compile_steps == [] and runner.step.graphs == 1
        assert torch.get_num_threads() == 2
        assert "[run] decode on 1 intra-op thread: a step of" in runner.stream.getvalue()
        metrics = runner._metrics(gen, [""] * 2, None, 0.0)
        assert metrics["thread_governor"]["one_thread_tiny_step"] is True
        assert fewer_threads(metrics) is None
    finally:
        torch.set_num_threads(before)


def test_an_moe_step_is_sized_by_the_experts_its_tokens_run(tmp_path, monkeypatch):
    """TINY_MACS counts rows x the weights a token multiplies: of an MoE layer only the k experts it
    is routed to (ModelArch.weight_bytes), not every expert the model holds."""
    from executor.config import load_config
    from executor.platform import detect
    from executor.registry import default_config, runner_class
    from tests.tool_fixtures import TINY_MOE, tiny_model

    sets = [f"model_config.model_path={tiny_model(tmp_path / 'moe', TINY_MOE)}", "model_config.with_ckpt=false"]
    sets += ["scheduler_config.max_new_tokens=3", "data_config.input_truncated_len=8"]
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        runner = runner_class("qwen3_moe")(load_config(default_config("qwen3_moe"), sets), detect("cpu"))
        rows, routed = 2, runner.arch.weight_bytes(1)
        held = sum(p.numel() for p in runner.model.parameters())
        assert held > 1.5 * routed  # 4 experts held, 2 run per token: a count of every weight would be well over
        monkeypatch.setattr(th, "TINY_MACS", rows * routed)
        runner.threads = ThreadGovernor(2, True, "test", log=runner.log)
        runner.stream = io.StringIO()
        gen = runner.generate([[5, 6, 7, 8], [9, 10, 11, 12]], 3)
        assert gen.decode_threads == [1, 1] and runner.threads.pinned
        assert f"a step of {rows * routed / 1e6:.1f}M multiply-adds" in runner.stream.getvalue()
        monkeypatch.setattr(th, "TINY_MACS", rows * routed - 1)  # one less: governed, on 2 threads
        assert runner.generate([[5, 6, 7, 8], [9, 10, 11, 12]], 3).decode_threads == [2, 2]
    finally:
        torch.set_num_threads(before)
