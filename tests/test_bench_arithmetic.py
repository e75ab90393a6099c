"""The benchmarks' arithmetic: decode_bench's and prefill_bench's roofline terms, how each decode
mode's row is judged, and the paired ratio of the benchmarks' rounds.

Why test a benchmark: its "x roofline" column is how issue 13's targets are read. A FLOP count
off by a factor, or a mode judged against the start's rates instead of those read next to its own
steps, would pass or fail targets for nothing. The timings themselves are not tested (they are
what the benchmark prints); this checks what it does with them.
"""

from __future__ import annotations

import dataclasses

import pytest

from benchmarks.cli import paired
from benchmarks.decode_bench import (
    Row,
    choose_rounds,
    figure,
    moved,
    print_batch_summary,
    print_table,
    step_cost,
    token_check,
)
from benchmarks.prefill_bench import prefill_cost
from executor.arch import load_arch
from executor.platform import detect

LM_HEAD = 151936 * 1024


def qwen3_06b_params_per_token() -> int:
    """Qwen3-0.6B's matrices, counted from its published shape (norms left out: 0.01% of them)."""
    h, i, layers, heads, kv, hd = 1024, 3072, 28, 16, 8, 128
    attention = h * heads * hd + 2 * h * kv * hd + heads * hd * h  # q, k, v, o
    mlp = 3 * h * i  # gate, up, down
    return layers * (attention + mlp) + LM_HEAD  # + the (tied) lm_head


def test_step_cost_counts_the_weights_once_and_flops_per_row():
    arch = load_arch("", "qwen3-0.6b")
    params = qwen3_06b_params_per_token()
    for batch, context in ((1, 24), (1, 2048), (16, 24), (64, 100)):
        nbytes, flops = step_cost(arch, 2, batch, context)
        kv = batch * context * 28 * 2 * 8 * 128 * 2  # K and V rows read, bf16
        attention = batch * 28 * 4 * 16 * 128 * context  # q.k and p.v, per query head
        assert nbytes == pytest.approx(2 * params + kv, rel=1e-3)  # weights read once, whatever the batch
        assert flops == pytest.approx(2 * params * batch + attention, rel=1e-3)
    assert step_cost(arch, 2, 16, 24)[1] == pytest.approx(19.16e9, rel=2e-3)  # BENCHMARKS.md's batch-16 figure


def test_prefill_cost_is_every_token_through_the_layers_and_one_through_the_lm_head():
    arch = load_arch("", "qwen3-0.6b")
    layers = qwen3_06b_params_per_token() - LM_HEAD
    for tokens in (128, 2048):
        nbytes, flops = prefill_cost(arch, 2, tokens)
        attention = 28 * 4 * 16 * 128 * tokens * (tokens + 1) / 2  # causal: key j <= query i
        assert flops == pytest.approx(2 * layers * tokens + 2 * LM_HEAD + attention, rel=1e-3)
        assert nbytes == pytest.approx(2 * (layers + LM_HEAD) + tokens * 28 * 2 * 8 * 128 * 2, rel=1e-3)


def test_a_mode_is_judged_against_the_rates_read_next_to_its_steps():
    start = {"read_gbs": 100.0, "tflops": 100.0}  # the start's readings: far off on purpose
    bandwidth_bound = Row("ours ge_graph", 50.0, None, [[1]], read_gbs=(20.0, 30.0), tflops=(0.1, 0.3))
    assert bandwidth_bound.roofline_ms(1e9, 1e9, **start) == pytest.approx(40.0)  # 1 GB at 25 GB/s
    compute_bound = Row("ours ge_graph", 50.0, None, [[1]], read_gbs=(50.0, 50.0), tflops=(0.1, 0.3))
    assert compute_bound.roofline_ms(1e9, 8e9, **start) == pytest.approx(40.0)  # 8 GFLOP at 0.2 TFLOP/s
    unread = Row("transformers eager generate", 50.0, None, [[1]])
    assert unread.roofline_ms(1e9, 2e9, read_gbs=25.0, tflops=0.2) == pytest.approx(40.0)


def test_more_than_15_percent_apart_is_moved():
    assert not moved((30.0, 34.0)) and moved((30.0, 35.0)) and moved((0.23, 0.14)) and not moved(())


def test_the_tables_show_each_modes_ratio_flags_and_tokens(capsys):
    rows = [  # ge_graph's matmul rate moved while its steps ran (0.14 then 0.23), its bandwidth did not
        Row("ours eager", 200.0, None, [[1, 2, 3]], read_gbs=(30.0, 34.0), tflops=(0.22, 0.23)),
        Row("ours ge_graph", 100.0, 40.0, [[1, 2, 4]], read_gbs=(30.0, 34.0), tflops=(0.14, 0.23)),
    ]
    for r in rows:
        r.roof_ms = 80.0
    print_table(rows, 16)
    eager, graph = (line for line in capsys.readouterr().out.splitlines() if line.startswith("| ours"))
    assert eager.split(" | ")[1:7] == ["200.000", "80.0", "0.50x", "2.50", "30.0/34.0", "0.22/0.23"]
    assert eager.endswith("same tokens |")
    assert graph.split(" | ")[4:7] == ["1.25", "30.0/34.0", "0.14/0.23 UNSTEADY"]
    assert graph.endswith("| 40.0 | differs from step 2 |")
    print_batch_summary({16: (rows, 80.0)})
    summary = capsys.readouterr().out
    assert "| ours eager | 80.0 (2.50) |" in summary and "| ours ge_graph | 160.0 (1.25?) |" in summary


def test_modes_that_took_turns_are_compared_round_by_round(capsys):
    """The ratio to ge_graph is taken within each round (the modes took turns), not between the
    pooled medians: here those would read 0.80x (10 / 12.5), the rounds 1.25x every time."""
    rates = dict(read_gbs=(30.0, 31.0, 30.0, 30.5), tflops=(0.2, 0.2, 0.2, 0.2))
    rows = [
        Row("ours eager", 20.0, None, [[1]], round_ms=(20.0, 40.0, 20.0), **rates),
        Row("ours ge_graph", 10.0, 30.0, [[1]], round_ms=(10.0, 20.0, 10.0), **rates),
        Row("ours ge_graph + SK decoder", 12.5, 30.0, [[1]], round_ms=(8.0, 16.0, 8.0), **rates),
    ]
    for r in rows:
        r.roof_ms = 5.0
    print_table(rows, 1)
    out = capsys.readouterr().out
    assert "| vs ge_graph (per round: median (range) of 3) |" in out and "| read GB/s (range between rounds) |" in out
    sk = next(line for line in out.splitlines() if line.startswith("| ours ge_graph + SK"))
    assert sk.split(" | ")[3:6] == ["1.250x (1.25-1.25)", "2.50", "30.0-31.0 (4)"]
    assert not rows[0].unsteady() and Row("x", 1.0, None, [[1]], read_gbs=(30.0, 36.0, 31.0)).unsteady()


def test_every_mode_is_held_at_once_only_where_they_fit():
    cpu = detect("cpu")
    small, big = load_arch("", "bench-overhead"), load_arch("", "qwen3-30b-a3b-shallow")
    big = dataclasses.replace(big, num_layers=48)  # the published depth: ~120 GB a mode in fp32
    assert choose_rounds(None, small, 4, 6, cpu)[0] == 3 and choose_rounds(9, small, 4, 6, cpu)[0] == 9
    rounds, why = choose_rounds(None, big, 4, 6, cpu)  # the default: one mode at a time, and the header says why
    assert rounds == 1 and why.startswith("1 round: each mode built, timed once and freed in turn, as 6 modes held")
    rounds, why = choose_rounds(3, big, 4, 6, cpu)  # asked for: refused in one line
    assert rounds is None and why.startswith("--rounds 3: 6 modes held at once need about") and "--rounds 1" in why
    assert choose_rounds(1, big, 4, 6, cpu)[0] == 1


def test_the_plot_puts_batches_in_order_and_labels_each_once():
    """--batch 64,16,4 ran in that order (the H200 sweep); its plot labelled the log axis' minor
    ticks over the batch labels ("6x10^4" on top of "64")."""
    import matplotlib.pyplot as plt

    summary = {b: ([Row("ours eager", 10.0 * b, None, [[1]])], 1.0 * b) for b in (64, 16, 4)}
    fig = figure(summary, "t")
    ax = fig.axes[0]
    assert list(ax.lines[0].get_xdata()) == [4, 16, 64]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["4", "16", "64"]
    assert [t.get_text() for t in ax.get_xticklabels(minor=True)] == []
    plt.close(fig)


def test_the_plot_shows_each_modes_own_x_roofline_hollow_where_the_rates_moved():
    """The left panel's roofline is the start's readings; a mode's ratio in the table is against its
    own. The right panel draws that ratio, with the batch the machine moved under drawn hollow."""
    import matplotlib.pyplot as plt

    def row(ms: float, roof: float, read: tuple[float, ...]) -> Row:
        return Row("ours ge_graph", ms, None, [[1]], read_gbs=read, roof_ms=roof)

    summary = {
        16: ([row(60.0, 40.0, (30.0, 31.0))], 40.0),
        4: ([row(33.0, 30.0, (30.0, 60.0))], 30.0),  # memory moved 2x: unsteady
    }
    fig = figure(summary, "t")
    right = fig.axes[1]
    ratio, *points, _one = right.lines
    assert list(ratio.get_xdata()) == [4, 16] and list(ratio.get_ydata()) == [1.1, 1.5]
    assert [(p.get_xdata()[0], p.get_markerfacecolor() == "none") for p in points] == [(4, True), (16, False)]
    plt.close(fig)


def test_token_check_names_the_first_step_any_row_departs():
    ref = [[1, 2, 3, 4], [5, 6, 7, 8]]
    assert token_check(ref, ref) == "same tokens"
    assert token_check([[1, 2, 3, 9], [5, 6, 0, 8]], ref) == "differs from step 2"


def test_the_paired_ratio_is_taken_within_each_round():
    # The machine slows 2x in round 2: per-round ratios stay 1.25, while best-of-rounds would compare
    # round 1's base with round 3's other.
    base, other = [10.0, 20.0, 12.0], [8.0, 16.0, 9.6]
    assert paired(base, other) == "1.250 (1.25-1.25)"
    assert paired([10.0, 30.0, 12.0], [10.0, 10.0, 12.0]) == "1.000 (1.00-3.00)"  # the median, not the mean
