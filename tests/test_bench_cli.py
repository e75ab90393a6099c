"""The benchmarks' command lines: a bad value is one line naming the option (exit 2), never a
traceback. Each main() runs in this process and stops at its argument check, so nothing is
measured; load_bench's parent starts its measured process, which does the check and says why.
One small real load_bench run checks what its table says of the tokens.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from benchmarks import (
    attention_bench,
    decode_bench,
    gemm_bench,
    load_bench,
    overlap_bench,
    pointwise_bench,
    prefill_bench,
    step_profile,
    verdict_bench,
)
from benchmarks.cli import guarded, int_list, name_list, write_json
from executor.custom_ops._build import cpu_has_amx
from tests.fresh_python import REPO

BAD = [
    (gemm_bench, ["--rows", "1,x"], "argument --rows: expected a comma list of positive integers, got '1,x'"),
    (decode_bench, ["--batch", "4,16,"], "argument --batch: expected a comma list of positive integers"),
    (decode_bench, ["--batch", "0"], "argument --batch: expected positive integers, got '0'"),
    (decode_bench, ["--rounds", "0"], "--rounds: expected a positive integer, got 0"),
    (  # every mode held at once would not fit (Qwen3-30B-A3B's 48 layers, fp32: ~120 GB a mode)
        decode_bench,
        ["--model", "qwen3_moe", "--size", "qwen3-30b-a3b-shallow", "--layers", "48", "--rounds", "3"],
        "--rounds 3: 6 modes held at once need about",
    ),
    (attention_bench, ["--lengths", "2k"], "argument --lengths: expected a comma list of positive integers"),
    (attention_bench, ["--modes", "eager,sk"], "--modes: unknown ['sk']; known: eager, ge_graph, decoder"),
    (pointwise_bench, ["--tokens", "a"], "argument --tokens: expected a comma list of positive integers"),
    (prefill_bench, ["--lengths", "-1"], "argument --lengths: expected positive integers, got '-1'"),
    (step_profile, ["--modes", "eager,nope"], "--modes: unknown mode 'nope'"),
    (step_profile, ["--perf", "--device", "cuda"], "--perf: CPU only"),
    (step_profile, ["--perf", "--trace-dir", "t"], "--perf and --trace-dir: a perf run writes no chrome trace"),
    (load_bench, ["--rounds", "0"], "--steps, --rounds and --batch: expected positive integers, got 64, 0 and 1"),
    (load_bench, ["--batch", "0"], "--steps, --rounds and --batch: expected positive integers, got 64, 4 and 0"),
    (decode_bench, ["--json", "."], "argument --json: '.' is a directory; name a file"),
    (prefill_bench, ["--json", "benchmarks/cli.py/x.json"], "argument --json: cannot write"),
    (verdict_bench, ["--gains", "1,x"], "argument --gains: expected a comma list of numbers, got '1,x'"),
    (verdict_bench, ["--slow", "2"], "--slow between 0 and 1"),
    (overlap_bench, ["--rows", "16,x"], "argument --rows: expected a comma list of positive integers, got '16,x'"),
    (overlap_bench, ["--rounds", "1"], "--rounds (2 or more), --threads, --mbytes (1 or more): got 1, "),
    (overlap_bench, ["--loops", "fp32,bf16"], "--loops: unknown ['bf16']; known: fp32, amx"),
]


@pytest.mark.parametrize(("bench", "argv", "said"), BAD, ids=[f"{b.__name__.split('.')[-1]}{a}" for b, a, _ in BAD])
def test_a_bad_list_is_argparses_one_line(bench, argv, said, capsys):
    with pytest.raises(SystemExit) as stop:
        bench.main(argv)
    err = capsys.readouterr().err
    assert stop.value.code == 2 and said in err and "Traceback" not in err, err


def test_the_list_types():
    assert int_list("1,4,16,64") == [1, 4, 16, 64]
    assert name_list(" eager, ge_graph ,,decoder") == ["eager", "ge_graph", "decoder"]


LOAD_BAD = [
    (["--modes", "eager,nope"], "--modes: unknown ['nope']; known: eager, ge_graph, attention"),
    (["--size", "nope"], "--size: 'nope' is not a named size"),
]


@pytest.mark.parametrize(("argv", "said"), LOAD_BAD)
def test_load_bench_says_what_its_measured_process_refused(argv, said):
    proc = subprocess.run(
        [sys.executable, "benchmarks/load_bench.py", "--policies", "passive", "--governor", "off", *argv],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 2 and f"error: {said}" in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and "the measured process exited with 2" in proc.stderr


def test_load_bench_says_whether_each_rows_tokens_are_ours_eagers(tmp_path):
    """A small real run (the debugmodel size, ge_graph alone, 3 steps, one round, a 1-thread
    neighbour): the reference is an eager runner built for it, and the row names how the tokens of
    its idle and its loaded calls compare. Its --json record has the row's two medians."""
    argv = ["--size", "debugmodel", "--modes", "ge_graph", "--steps", "3", "--rounds", "1"]
    argv += ["--json", str(tmp_path / "l.json")]
    argv += ["--policies", "gomp default", "--governor", "on", "--neighbour-threads", "1"]
    proc = subprocess.run(
        [sys.executable, "benchmarks/load_bench.py", *argv], cwd=REPO, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    header = next(line for line in proc.stdout.splitlines() if line.startswith("| OMP wait policy"))
    assert header.endswith("| greedy tokens vs ours eager (idle), idle / loaded |")
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| gomp default | on |")]
    assert len(rows) == 1 and rows[0].startswith("| gomp default | on | ge_graph |")
    assert rows[0].endswith("| same tokens / same tokens |")
    # progress while it builds and times (minutes per mode at the 0.6B shape), on stderr, in order
    said = [line.strip().split(" in ")[0] for line in proc.stderr.splitlines() if line.startswith("    ")]
    assert said == ["built eager", "built ge_graph", "timing ge_graph idle: 1 round", "timing ge_graph loaded: 1 round"]
    record = json.loads((tmp_path / "l.json").read_text())
    assert [(r["policy"], r["governor"], r["mode"]) for r in record["rows"]] == [("gomp default", "on", "ge_graph")]
    row = record["rows"][0]
    assert 0 < row["idle_ms"] <= row["idle_p90_ms"] and 0 < row["loaded_ms"] <= row["loaded_p90_ms"]


def test_load_bench_rounds_run_each_pair_of_modes_in_both_orders():
    """Over any two consecutive rounds every mode runs once before and once after every other, so a
    host that drifts within a round cannot favour the mode that would always run second (SK decoder,
    after ge_graph, in the card's SK decoder / ge_graph ratio)."""
    modes = ["eager", "ge_graph", "decoder"]
    for r in range(4):
        pair = load_bench.turns(modes, r), load_bench.turns(modes, r + 1)
        assert sorted(pair[0]) == sorted(modes) and sorted(pair[1]) == sorted(modes)
        for a in modes:
            for b in modes:
                if a != b:
                    assert [o.index(a) < o.index(b) for o in pair] in ([True, False], [False, True])
    assert modes == ["eager", "ge_graph", "decoder"]  # the caller's list is left as it was


SIZED = (decode_bench, prefill_bench, attention_bench, step_profile)
UNKNOWN = [(b, ["--size", "nope"], "--size: 'nope' is not a named size") for b in SIZED]
UNKNOWN += [(b, ["--model", "nope"], "'nope' is not a") for b in (decode_bench, prefill_bench, attention_bench)]


@pytest.mark.parametrize(
    ("bench", "argv", "said"), UNKNOWN, ids=[f"{b.__name__.split('.')[-1]}{a[0]}" for b, a, _ in UNKNOWN]
)
def test_an_unknown_size_or_recipe_is_one_line(bench, argv, said, capsys):
    """What the recipe code refuses (a RecipeError) reaches the user as infer.sh says it: one line
    naming the option typed (not the config key a size becomes), exit 2, before anything is measured."""
    assert guarded(lambda: bench.main(argv)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and said in err[0], err


# The benchmark run as its command, in a Python where transformers cannot be imported (None in
# sys.modules is what Python's own import system reads as "not installed": ModuleNotFoundError).
WITHOUT_TRANSFORMERS = (
    "import runpy, sys; sys.modules['transformers'] = None; sys.argv = sys.argv[1:]; "
    "runpy.run_path(sys.argv[0], run_name='__main__')"
)


@pytest.mark.parametrize("script", ["decode_bench.py", "prefill_bench.py"])
def test_a_benchmark_without_transformers_says_how_to_install_it(script):
    """After `bash infer.sh` alone (no test extras), decode_bench stopped with a traceback from
    make_checkpoint; it must say what is missing and the install command, exit 2."""
    argv = ["--size", "debugmodel", "--no-hf"] if script == "decode_bench.py" else ["--size", "debugmodel"]
    proc = subprocess.run(
        [sys.executable, "-c", WITHOUT_TRANSFORMERS, f"benchmarks/{script}", *argv],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert err[-1].startswith("error: this benchmark needs transformers (") and "pip install -e '.[test]'" in err[-1]


@pytest.mark.parametrize("position, slots", [(63, 64), (31, 96)])  # every slot valid; a third of them
def test_attention_bench_stream_reads_every_layers_cache_in_both_dtypes(capsys, position, slots):
    """--stream alone (no step table): a row per dtype whose KV bytes are the 28 layers' K and V at the
    valid slots of a cache of --lengths slots, so its GB/s is over what the op must read."""
    argv = ["--stream", "--position", str(position), "--lengths", str(slots), "--no-op-table", "--modes", ""]
    assert attention_bench.main(argv) == 0
    out = capsys.readouterr().out
    assert f"{position + 1} valid slots of {slots}" in out
    rows = [line.split("|")[1:-1] for line in out.splitlines() if line.startswith("| ")]
    table = {r[0].strip(): [float(x) for x in r[1:]] for r in rows if r[0].strip() in ("float32", "bfloat16")}
    kv_mb = {
        d: attention_bench.STREAM_LAYERS * 2 * 8 * (position + 1) * 128 * size / 1e6
        for d, size in (("float32", 4), ("bfloat16", 2))
    }
    assert set(table) == {"float32", "bfloat16"}
    for dtype, (mb, ms, gbs, share) in table.items():
        # the share of the sum's rate is printed to 0.01: a pass slowed ~300x by a loaded host (288 ms for
        # 7.3 MB, a run beside another suite's spinning processes) printed 0.00
        assert mb == pytest.approx(kv_mb[dtype], abs=0.05) and ms > 0 and share >= 0
        # GB/s = the exact MB / the exact ms, printed to 0.1 (on a busy host, ~0.6 GB/s, that alone is ~8%):
        # the printed MB is rounded to 0.1 (1.4% at 3.7 MB) and the ms to 0.001 (0.4% at 0.25 ms, a fast
        # host), so the rate must lie in what the printed ms allows, give or take its own rounding
        low, high = kv_mb[dtype] / (ms + 0.0005), kv_mb[dtype] / max(ms - 0.0005, 1e-9)
        assert low - 0.0501 <= gbs <= high + 0.0501, (gbs, low, high)


def test_overlap_bench_runs_its_probe_and_derives_the_bounds(tmp_path, capsys):
    """A small real run (an 8 MiB weight, 2 rounds; the AMX loop too where the CPU has it): the probe
    is built for this CPU, checks each loop's sums against a plain loop (exit 3 if wrong: the bench
    then fails), and each row's bounds follow from its two rates: serial = 1 / (1 / stream + FLOPs a
    byte / compute)."""
    path = tmp_path / "o.json"
    loops = ["fp32", "amx"] if cpu_has_amx() else ["fp32"]
    argv = ["--rows", "3,17", "--mbytes", "8", "--rounds", "2", "--threads", "2", "--json", str(path)]
    assert overlap_bench.main(argv) == 0
    out = capsys.readouterr().out
    assert [line.split("|")[1:3] for line in out.splitlines() if line.startswith(tuple(f"| {x} |" for x in loops))] == [
        [f" {loop} ", f" {rows} "] for loop in loops for rows in (3, 17)
    ], out
    assert "fp32: a 6-row tile on a block in L2 ran " in out
    rows = json.loads(path.read_text())["rows"]
    assert [(r["loop"], r["rows"]) for r in rows] == [(loop, n) for loop in loops for n in (3, 17)]
    for r in rows:
        assert min(r[k] for k in overlap_bench.KEYS) > 0
        per_byte = 2 * r["rows"] / overlap_bench.LOOPS[r["loop"]]
        assert r["serial"] == pytest.approx(1 / (1 / r["stream"] + per_byte / r["compute"]))
        assert r["overlapped"] == pytest.approx(min(r["stream"], r["compute"] / per_byte))


def test_overlap_bench_without_a_compiler_is_one_line(monkeypatch, capsys):
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    assert guarded(lambda: overlap_bench.main(["--rows", "2", "--mbytes", "8", "--rounds", "2"])) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: overlap_bench: /nonexistent/c++ could not build"), err


def test_write_json_makes_its_directories_and_replaces_the_record_whole(tmp_path):
    """A record is written to a temporary file and renamed over the old one: a reader sees the old
    record or the new one, and no temporary file is left."""
    path = tmp_path / "a" / "b" / "r.json"
    write_json(str(path), {"rows": [1]})
    write_json(str(path), {"rows": [1, 2]})
    assert json.loads(path.read_text()) == {"rows": [1, 2]} and [p.name for p in path.parent.iterdir()] == ["r.json"]
    write_json(None, {"rows": []})  # no --json: nothing written, no error
