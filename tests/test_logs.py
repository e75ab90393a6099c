"""executor.logs: formats round-trip, real-looking logs parse, the outlier rule holds."""

import pytest

from executor.logs import (
    LogParseError,
    decode_average_ms,
    format_average,
    format_decode,
    format_prefill,
    format_run_shape,
    format_throughput,
    iqr_filter,
    parse_log,
    parse_log_file,
)

# Ten decode steps, the last one a compile-time hiccup. By hand (numpy 'linear'):
# sorted 15.40 15.40 15.45 15.50 15.50 15.50 15.55 15.60 15.60 120.00
# Q1 = 15.45 + 0.25*0.05 = 15.4625, Q3 = 15.55 + 0.75*0.05 = 15.5875, IQR = 0.125,
# limit = 15.5875 + 1.5*0.125 = 15.775 -> 120.00 dropped; mean of the other 9 = 139.5/9 = 15.5
STEPS = [15.40, 15.50, 15.60, 15.45, 15.55, 15.50, 15.40, 15.60, 15.50, 120.00]


def test_format_verbatim():
    assert format_prefill("qwen3_8b", 41.12) == "qwen3_8b inference time cost of prefill is 41.12 ms"
    assert format_decode("qwen3_8b", 15.48) == "qwen3_8b inference time cost of decode is 15.48 ms"
    assert format_average("qwen3_8b", 15.511) == "qwen3_8b average inference time cost is 15.51 ms"
    assert format_throughput("qwen3_8b", 64.52) == "qwen3_8b decode throughput is 64.52 tokens/s"
    assert format_run_shape("qwen3_8b", 4, 255) == "qwen3_8b batch size is 4, decode steps is 255"


def test_round_trip():
    text = "\n".join(
        [
            format_run_shape("qwen3-8b.w8a8", 2, 3),
            format_prefill("qwen3-8b.w8a8", 41.12),
            format_decode("qwen3-8b.w8a8", 15.48),
            format_decode("qwen3-8b.w8a8", 15.52),
            format_decode("qwen3-8b.w8a8", 15.50),
            format_average("qwen3-8b.w8a8", 15.50),
            format_throughput("qwen3-8b.w8a8", 129.03),
        ]
    )
    log = parse_log(text)
    assert log.model_name == "qwen3-8b.w8a8"
    assert (log.batch_size, log.decode_steps) == (2, 3)
    assert log.prefill_ms == 41.12 and log.prefill_ms_all == [41.12]
    assert log.decode_ms == [15.48, 15.52, 15.50]
    assert log.average_ms == 15.50 and log.decode_average_ms is None
    assert log.tokens_per_s == 129.03
    assert log.step_ms() == pytest.approx(15.50)


def test_cann_style_log_drops_outlier(tmp_path):
    lines = ["some banner", format_prefill("qwen3_8b", 41.12)]
    lines += [format_decode("qwen3_8b", s) for s in STEPS]
    lines += [format_average("qwen3_8b", 15.5), "done"]
    p = tmp_path / "run.log"
    p.write_text("\n".join(lines) + "\n")
    log = parse_log_file(p)
    assert log.path == str(p)
    assert log.prefill_ms == 41.12
    assert log.decode_ms == STEPS
    assert log.average_ms == 15.5
    assert iqr_filter(log.decode_ms) == STEPS[:-1]
    assert log.step_ms() == pytest.approx(15.5)
    assert decode_average_ms(STEPS) == pytest.approx(139.5 / 9)


def test_decode_average_variant_alone():
    log = parse_log("qwen3_8b decode average inference time cost is 15.51 ms\n")
    assert log.decode_average_ms == 15.51
    assert log.average_ms is None
    assert log.model_name == "qwen3_8b"
    assert log.step_ms() == 15.51


def test_average_and_decode_average_kept_apart():
    log = parse_log(
        "m average inference time cost is 20 ms\n"
        "m decode average inference time cost is 15.5 ms\n"
        "[INFO] decode average inference time cost is 16 ms\n"
    )
    assert log.average_ms == 20.0
    assert log.decode_average_ms == 16.0  # last one wins; the unnamed one is still not 'average'
    assert log.model_name == "m"
    assert log.step_ms() == 16.0  # decode average beats the plain average


def test_prefixes_ansi_units_crlf():
    text = (
        "\x1b[32m[INFO] 2026-01-01 12:00:00 qwen3_8b inference time cost of prefill is 41 ms\x1b[0m\r\n"
        "[rank0]:qwen3_8b inference time cost of decode is 15.48ms\r\n"
        "\x1b[1;33mWARN\x1b[0m 12:00:01 qwen3_8b inference time cost of decode is 16 ms\r\n"
        "2026-01-01 12:00:02 qwen3_8b average inference time cost is 15.74ms\r\n"
    )
    log = parse_log(text)
    assert log.model_name == "qwen3_8b"
    assert log.prefill_ms == 41.0
    assert log.decode_ms == [15.48, 16.0]
    assert log.average_ms == 15.74


def test_multiple_prefills_and_averages():
    log = parse_log(
        "a inference time cost of prefill is 40 ms\n"
        "a average inference time cost is 1 ms\n"
        "a inference time cost of prefill is 42 ms\n"
        "a average inference time cost is 2 ms\n"
    )
    assert log.prefill_ms == 40.0 and log.prefill_ms_all == [40.0, 42.0]
    assert log.average_ms == 2.0


def test_no_decode_timing_names_file(tmp_path):
    p = tmp_path / "prefill_only.log"
    p.write_text(format_prefill("qwen3_8b", 41.12) + "\n")
    log = parse_log_file(p)
    with pytest.raises(LogParseError, match=r"prefill_only\.log") as e:
        log.step_ms()
    assert "no decode timing found" in str(e.value)
    assert "inference time cost of decode is X ms" in str(e.value)


def test_missing_file_names_path(tmp_path):
    with pytest.raises(LogParseError, match=r"nope\.log"):
        parse_log_file(tmp_path / "nope.log")


def test_unrelated_text_parses_empty():
    log = parse_log("nothing here\nthe inference was fast\n")
    assert log.model_name is None and log.decode_ms == [] and log.prefill_ms is None
    with pytest.raises(LogParseError, match="<log text>"):
        log.step_ms()


@pytest.mark.parametrize(
    "values, kept",
    [
        ([], []),
        ([1.0, 2.0, 1000.0], [1.0, 2.0, 1000.0]),  # < 4 values: unchanged
        ([1.0, 1.0, 1.0, 100.0], [1.0, 1.0, 1.0]),  # Q3 = 25.75, limit 62.875
        ([5.0, 5.0, 5.0, 5.0], [5.0, 5.0, 5.0, 5.0]),  # value == limit is kept
        ([10.0, 10.0, 0.0, 10.0, 10.0], [10.0, 10.0, 0.0, 10.0, 10.0]),  # low side never cut
        ([3, 100, 1, 2, 4], [3.0, 1.0, 2.0, 4.0]),  # order kept, ints -> floats
    ],
)
def test_iqr_filter_edges(values, kept):
    assert iqr_filter(values) == kept


def test_decode_average_empty_raises():
    with pytest.raises(ValueError):
        decode_average_ms([])
