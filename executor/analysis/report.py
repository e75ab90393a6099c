"""The analysis as files: op_analysis.md (biggest opportunity first), op_analysis.json, op_analysis.png.

Every file says what the timings are: measured on the machine that ran the tool, ops run one by
one (eager); on CPU a portable measurement, never an Ascend result. The GE mapping is torchair's
converter's answer, not an NPU run.
"""

from __future__ import annotations

import json
from pathlib import Path

TOP_OPS = 15  # op types per table and chart
HEADLINE_CHARS = 160  # the PNG subtitle: one line of the 14-inch figure


def what(a: dict) -> str:
    kind = "portable CPU measurement, not an Ascend result" if a["platform_kind"] == "cpu" else "measured on the device"
    return (
        f"timings: {a['platform']}, {a['threads']} torch thread{'s' if a['threads'] != 1 else ''}, ops run one by "
        f"one (eager) with the run's op table `{a['ops_table']}` ({kind}); "
        f"GE mapping: {a['graph']['converters']}"
    )


def headline(a: dict) -> str:
    """The biggest opportunity in one line: the md's first line after the title, the PNG's subtitle,
    what the command prints last."""
    if not a["opportunities"]:
        return "Biggest opportunity: none found"
    o = a["opportunities"][0]
    saving = "blocks ge_graph" if o["saving_ms"] is None else f"~{o['saving_ms']:.3f} ms/step, {_share(o['share'])}"
    return f"Biggest opportunity: {o['what']} ({saving}); {o['action'] or 'no action known'}"


def _ms(v) -> str:
    return "blocks ge_graph" if v is None else f"{v:.3f}"


def _share(v) -> str:
    return "-" if v is None else f"{100 * v:.1f}%"


def markdown(a: dict) -> str:
    r, m = a["run"], a["machine"]
    lines = [
        f"# Op analysis: {a['recipe']} ({a['model_type']}, {a['layers']} layers), "
        f"batch {a['batch_size']}, {r['dtype']}",
        "",
        headline(a),
        "",
        what(a),
        "",
        f"Config: exe_mode {r['exe_mode']}, SuperKernel {'plan ' + r['plan'] if r['superkernel'] else 'off'}, "
        f"custom ops {r['custom_ops'] or 'none'}; decode at {r['valid_slots']} valid of {r['max_len']} KV-cache slots. "
        f"Machine: read {m['read_gbs']} GB/s, matmul {m['peak_gflops']} GFLOP/s ({m['dtype']}), "
        f"balance {m['balance_flop_per_byte']} FLOP/byte.",
        "",
        "## Opportunities, biggest first (estimated saving per decode step)",
        "",
        "| # | kind | opportunity | model lines | est. saving ms | share of step | action |",
        "|---|---|---|---|---|---|---|",
    ]
    for i, o in enumerate(a["opportunities"], 1):
        where = ", ".join(o["where"][:4]) or "-"
        lines.append(
            f"| {i} | {o['kind']} | {o['what']} | {where} | {_ms(o['saving_ms'])} | {_share(o['share'])} | "
            f"{o['action'] or '-'} |"
        )
    for phase in ("decode", "prefill"):
        p = a[phase]
        size = f"{p['steps_profiled']} steps profiled" if phase == "decode" else f"{p['tokens']} prompt tokens"
        lines += ["", f"## {phase.capitalize()}: {p['step_ms']:.3f} ms per step ({size})", ""]
        lines += ["| region | ms | share |", "|---|---|---|"]
        lines += [f"| {x['region']} | {x['ms']:.3f} | {_share(x['share'])} |" for x in p["regions"]]
        lines += [
            "",
            "| op type | ms | share | calls | MFLOP | MB | FLOP/byte | bound here |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for x in p["op_types"][:TOP_OPS]:
            lines.append(
                f"| {x['op']} | {x['ms']:.3f} | {_share(x['share'])} | {x['calls']:.0f} | {x['flops'] / 1e6:.2f} | "
                f"{x['bytes'] / 1e6:.3f} | {x['flop_per_byte'] if x['flop_per_byte'] is not None else '-'} | "
                f"{x['bound']} |"
            )
    g = a["graph"]
    lines += [
        "",
        f"## Ascend mapping of the decode graph ({g['nodes']} FX nodes in {g['graphs']} graph(s))",
        "",
        f"GE converters: {g['converters']}. Ops inside an executor.ops entry are replaced on an NPU by the fused "
        "torch_npu op of our NPU table; ops in model code are converted one by one.",
        "",
        "| FX op | count (in model code) | from executor.ops | on NPU | GE converter | fused op converter "
        "| model lines | problems |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for x in g["mapping"]:
        lines.append(
            f"| {x['target']} | {x['count']} ({x['in_model_code']}) | {', '.join(x['entries']) or '-'} | "
            f"{', '.join(x['npu']) or 'itself'} | {x['converter']} | {', '.join(x['fused_converter']) or '-'} | "
            f"{', '.join(x['sources'][:3]) or '-'} | {'; '.join(x['problems']) or '-'} |"
        )
    breaks = "; ".join(f"{b['reason']} ({b['source']})" for b in g["breaks"]) or "none"
    lines += [
        "",
        f"Graph breaks: {breaks}.",
        f"Communication ops per decode step: {g['communication_ops_per_step']} "
        f"({', '.join(g['communication']) or 'single-device config'}).",
    ]
    return "\n".join(lines) + "\n"


def chart(a: dict, path: Path) -> None:
    """Time per region and per op type, decode and prefill (largest on top)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(14, 10))
    for row, phase in enumerate(("decode", "prefill")):
        p = a[phase]
        for col, (key, label) in enumerate((("regions", "region"), ("op_types", "op"))):
            items = p[key][:TOP_OPS][::-1]
            ax = axes[row][col]
            ax.barh([x[label] for x in items], [x["ms"] for x in items], color="tab:blue" if col == 0 else "tab:orange")
            ax.set_title(f"{phase}: ms per step by {label}")
            ax.set_xlabel("ms (" + ("CPU, portable" if a["platform_kind"] == "cpu" else a["platform"]) + ")")
            ax.tick_params(axis="y", labelsize=7)
    line = headline(a)
    line = line if len(line) <= HEADLINE_CHARS else line[: HEADLINE_CHARS - 3] + "..."
    fig.suptitle(
        f"op_analysis: {a['recipe']} ({a['model_type']}), {a['run']['dtype']}, batch {a['batch_size']}\n{line}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def write(a: dict, out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "op_analysis.md", out / "op_analysis.json", out / "op_analysis.png"]
    paths[0].write_text(markdown(a))
    paths[1].write_text(json.dumps(a | {"what": what(a), "headline": headline(a)}, indent=1, default=str) + "\n")
    chart(a, paths[2])
    return paths
