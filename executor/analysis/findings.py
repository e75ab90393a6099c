"""From measurements and the decode graph to tables and ranked opportunities.

Breakdowns: time per region and per op type (with FLOPs, bytes, intensity and what bounds it
here). Opportunities, each with an estimated saving per decode step from the measured times:

- blockers (rank first, no saving number: they stop graph mode): graph breaks, ops without a GE
  converter, data-dependent shapes (a host round trip; a cut in a SuperKernel scope);
- attention over the whole static KV cache -> the custom op decode_attention (the estimate takes
  attention's measured time as proportional to the slots it reads);
- op sequences in model code that match a fused op we have (add + rms_norm, rms_norm, swiglu,
  rotary, gating top-k) but do not go through its executor.ops entry;
- q/k RMSNorm feeding rotary (Qwen3): a fused custom op candidate;
- fp32 ops in a bf16/fp16 run (model code; inside fused ops fp32 is by design);
- in-place writes into graph inputs (the KV-cache scatter) that graph mode turns into whole-tensor
  copies per step (estimate: the bytes written and copied back at the measured bandwidth);
- per-op overhead (measured far above the roofline) -> graph mode / SuperKernel, when not on.

Estimates assume the fused form costs its roofline time; they rank work, they are not promises.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import asdict, dataclass, field

from executor.analysis.mapping import NPU_TABLE, Capture, Node
from executor.analysis.roofline import Machine, bound, roofline_ms
from executor.analysis.trace import PYTHON, OpCall, OpTime

BLOCKER = float("inf")  # sorts first
VIEW_OPS = {"aten.view.default", "aten._unsafe_view.default", "aten.transpose.int", "aten.permute.default"}
VIEW_OPS |= {"aten.clone.default", "aten.expand.default", "aten.alias.default", "aten.unsqueeze.default"}
VIEW_OPS |= {"aten.slice.Tensor", "aten.split_with_sizes.default", "<built-in function getitem>"}


@dataclass
class Opportunity:
    kind: str  # blocker, custom op, graph, fusion, dtype, overhead
    what: str
    where: list[str]  # model source lines
    saving_ms: float  # per decode step (BLOCKER: stops graph mode)
    action: str
    detail: dict = field(default_factory=dict)

    def as_dict(self, step_ms: float) -> dict:
        d = asdict(self)
        blocker = self.saving_ms == BLOCKER
        d["saving_ms"] = None if blocker else round(self.saving_ms, 4)
        d["share"] = None if blocker else round(self.saving_ms / step_ms, 4) if step_ms else 0.0
        return d


# --------------------------------------------------------------------------- breakdowns
def per_call_ms(times: list[OpTime]) -> dict[tuple[str, str], float]:
    return {(t.region, t.op): t.ms / t.calls for t in times if t.calls}


def region_table(times: list[OpTime]) -> list[dict]:
    total = sum(t.ms for t in times)
    by: dict[str, float] = defaultdict(float)
    for t in times:
        by[t.region] += t.ms
    rows = [{"region": r, "ms": ms, "share": ms / total if total else 0.0} for r, ms in by.items()]
    return sorted(rows, key=lambda r: -r["ms"])


def op_table(times: list[OpTime], calls: list[OpCall], machine: Machine) -> list[dict]:
    total = sum(t.ms for t in times)
    ms, n = defaultdict(float), defaultdict(float)
    for t in times:
        ms[t.op] += t.ms
        n[t.op] += t.calls
    flops, nbytes = defaultdict(int), defaultdict(int)
    for c in calls:
        flops[c.op] += c.flops
        nbytes[c.op] += c.bytes
    rows = []
    for op in ms:
        f, b = flops.get(op, 0), nbytes.get(op, 0)
        rows.append(
            {
                "op": op,
                "ms": ms[op],
                "share": ms[op] / total if total else 0.0,
                "calls": n[op],
                "flops": f,
                "bytes": b,
                "flop_per_byte": round(f / b, 3) if b else None,
                "roofline_ms": roofline_ms(f, b, machine),
                "bound": "python" if op == PYTHON else bound(f, b, ms[op], machine),
            }
        )
    return sorted(rows, key=lambda r: -r["ms"])


# --------------------------------------------------------------------------- the decode graph
def mapping_table(nodes: list[Node], status: dict[str, str] | None) -> list[dict]:
    """Per FX target: where it comes from, what replaces it on an NPU, its GE converter, problems."""
    groups: dict[str, list[Node]] = defaultdict(list)
    for n in nodes:
        if n.target.startswith("<"):  # Python builtins (getitem, ...): run in Python by torchair too
            continue
        groups[n.target].append(n)
    rows = []
    for target, members in groups.items():
        entries = sorted({n.entry for n in members if n.entry})
        model_code = [n for n in members if not n.entry]
        converter = (status or {}).get(target, "not checked")
        npu = sorted({f"{NPU_TABLE[e][0]} (GE {NPU_TABLE[e][1]})" for e in entries if e in NPU_TABLE})
        npu += [f"{e}: plain aten ops in the NPU table too" for e in entries if e not in NPU_TABLE]  # e.g. kv_update
        fused = [e for e in entries if e in NPU_TABLE]
        npu_status = sorted({(status or {}).get(f"npu.{NPU_TABLE[e][0]}.default", "not checked") for e in fused})
        problems = []
        if model_code and converter == "missing":
            problems.append("no GE converter: ge_graph cannot convert it")
        if any(n.data_dependent for n in members):
            problems.append("data-dependent output shape: host round trip, cuts a SuperKernel scope")
        if "missing" in npu_status:
            problems.append("the fused torch_npu op has no GE converter")
        rows.append(
            {
                "target": target,
                "count": len(members),
                "in_model_code": len(model_code),
                "entries": entries,
                "npu": npu or (["custom op: see executor/backends/"] if target.startswith("cann.") else []),
                "converter": converter,
                "fused_converter": npu_status if fused else [],
                "sources": sorted({n.source for n in members if n.source})[:4],
                "problems": problems,
            }
        )
    return sorted(rows, key=lambda r: (not r["problems"], -r["in_model_code"], -r["count"]))


# --------------------------------------------------------------------------- opportunities
def _ms(calls: list[OpCall], times: dict, pick) -> float:
    return sum(times.get((c.region, c.op), 0.0) for c in calls if pick(c))


def _lines(nodes: list[Node]) -> list[str]:
    return sorted({n.source for n in nodes if n.source})


def _producer_through_views(node: Node, by_name: dict[str, Node], want) -> Node | None:
    """The first input (walking back through view-like model-code nodes) for which want(node) holds."""
    todo, seen = list(node.inputs), set()
    while todo:
        n = by_name.get(todo.pop())
        if n is None or n.name in seen:
            continue
        seen.add(n.name)
        if want(n):
            return n
        if n.target in VIEW_OPS or n.entry == node.entry:
            todo.extend(n.inputs)
    return None


def opportunities(
    capture: Capture,
    status: dict[str, str] | None,
    calls: list[OpCall],
    times: list[OpTime],
    machine: Machine,
    run: dict,
) -> list[Opportunity]:
    """`run`: dtype, exe_mode, superkernel (bool), plan, custom_ops, valid_slots, max_len."""
    nodes, found = capture.nodes, []
    by_name = {n.name: n for n in nodes}
    t = per_call_ms(times)
    for b in capture.breaks:
        found.append(Opportunity("blocker", f"graph break: {b['reason']}", [b["source"]], BLOCKER, "remove the break"))
    for row in mapping_table(nodes, status):
        if row["problems"]:
            lines = row["sources"]
            found.append(Opportunity("blocker", f"{row['target']}: {'; '.join(row['problems'])}", lines, BLOCKER, ""))

    # attention over every static cache slot
    attention = [n for n in nodes if n.entry == "attention"]
    if attention and not any(n.target.startswith("cann.decode_attention") for n in attention):
        t_attn = _ms(calls, t, lambda c: c.entry == "attention")
        unused = 1 - run["valid_slots"] / run["max_len"]
        found.append(
            Opportunity(
                "custom op",
                f"attention reads all {run['max_len']} static KV-cache slots; {run['valid_slots']} are valid",
                _lines(attention),
                t_attn * unused,
                "model_config.custom_ops: [decode_attention] (reads only the valid slots; NPU: FIA with "
                "actual_seq_lengths_kv)",
                {"attention_ms": t_attn, "unused_share": round(unused, 4)},
            )
        )

    rewrites = [n for n in nodes if n.rewrites_input]
    if rewrites:
        nbytes = sum(n.nbytes for n in rewrites)
        found.append(
            Opportunity(
                "graph",
                f"{len(rewrites)} in-place writes into graph inputs (the static KV cache) become whole-tensor copies "
                f"in graph mode ({', '.join(sorted({n.target for n in rewrites}))}: {nbytes / 1e6:.2f} MB per step)",
                _lines(rewrites),
                2 * nbytes / (machine.read_gbs * 1e9) * 1e3,  # written by the op, copied back into the input
                "write the cache with an op graph mode keeps in place (index_put_; on NPU scatter_update_)",
                {"bytes": nbytes},
            )
        )
    found += _fusions(nodes, by_name, calls, t, machine)
    found += _dtype_findings(nodes, calls, machine, run)
    found += _overhead(times, calls, machine, run)
    return sorted(found, key=lambda o: -o.saving_ms)


def _pattern(what, action, members: list[Node], calls, t, machine) -> Opportunity:
    lines = set(_lines(members))
    picked = [c for c in calls if c.entry is None and c.source in lines]
    measured = sum(t.get((c.region, c.op), 0.0) for c in picked)
    fused = roofline_ms(sum(c.flops for c in picked), max((c.bytes for c in picked), default=0), machine)
    return Opportunity("fusion", what, sorted(lines), max(0.0, measured - fused), action, {"measured_ms": measured})


def _fusions(nodes, by_name, calls, t, machine) -> list[Opportunity]:
    model = [n for n in nodes if n.entry is None]
    found = []
    # add (model code) whose result an ops.rms_norm normalises: ops.add_rms_norm does both
    adds = []
    for n in nodes:
        if n.entry != "rms_norm":
            continue
        add = _producer_through_views(n, by_name, lambda m: m.entry is None and m.target == "aten.add.Tensor")
        if add is not None and add not in adds:
            adds.append(add)
    if adds:
        found.append(
            _pattern(
                "residual add followed by ops.rms_norm (unfused add + RmsNorm)",
                "ops.add_rms_norm(x, residual, weight, eps) (GE AddRmsNorm) instead of `h + ...` then ops.rms_norm",
                adds,
                calls,
                t,
                machine,
            )
        )
    patterns = (
        ("aten.rsqrt.default", "rms_norm written out in model code", "ops.rms_norm (GE RmsNorm)"),
        ("aten.silu.default", "silu(gate) * up written out in model code", "ops.swiglu (GE SwiGlu)"),
        ("aten.neg.default", "rotate-half RoPE written out in model code", "ops.rotary_mul (GE RotaryMul)"),
        ("aten.topk.default", "softmax + top-k routing in model code", "ops.moe_gating_top_k_softmax"),
    )
    for target, what, action in patterns:
        members = [n for n in model if n.target == target]
        if members:
            found.append(_pattern(what, action, members, calls, t, machine))
    # q/k RMSNorm feeding rotary (Qwen3 attention): one fused kernel would pass over q and k once
    pairs = []
    for n in nodes:
        if n.entry != "rotary_mul":
            continue
        norm = _producer_through_views(n, by_name, lambda m: m.entry == "rms_norm")
        if norm is not None:
            pairs += [norm, n]
    if pairs:
        norm_lines = set(_lines([p for p in pairs if p.entry == "rms_norm"]))
        rope_lines = set(_lines([p for p in pairs if p.entry == "rotary_mul"]))
        t_norm = _ms(calls, t, lambda c: c.entry == "rms_norm" and c.source in norm_lines)
        t_rope = _ms(calls, t, lambda c: c.entry == "rotary_mul" and c.source in rope_lines)
        found.append(
            Opportunity(
                "custom op",
                "q/k RMSNorm feeding rotary: two passes over q and k per layer",
                sorted(norm_lines | rope_lines),
                min(t_norm, t_rope),
                "a fused q/k RMSNorm + rotary custom op (docs/custom_ops.md)",
                {"rms_norm_ms": t_norm, "rotary_ms": t_rope},
            )
        )
    return found


def _dtype_findings(nodes, calls, machine, run) -> list[Opportunity]:
    if run["dtype"] not in ("bfloat16", "float16"):
        return []
    fp32 = [n for n in nodes if n.entry is None and n.dtype == "float32"]
    lines = set(_lines(fp32))
    picked = [c for c in calls if c.entry is None and c.dtype == "float32" and c.source in lines]
    if not picked:
        return []
    nbytes = sum(c.bytes for c in picked)
    return [
        Opportunity(
            "dtype",
            f"{len(fp32)} float32 ops in model code of a {run['dtype']} run ({nbytes / 1e6:.2f} MB/step)",
            sorted(lines),
            nbytes / 2 / (machine.read_gbs * 1e9) * 1e3,
            f"compute in {run['dtype']} where accuracy allows (RoPE tables and logits are fp32 in HF too)",
            {"bytes": nbytes, "inside_fused_ops_fp32": sum(1 for n in nodes if n.entry and n.dtype == "float32")},
        )
    ]


def _overhead(times, calls, machine, run) -> list[Opportunity]:
    """Op time above the roofline (dispatch, launch, tiny kernels) plus Python between ops, measured
    eagerly. In a graph mode the Python is gone already (dynamo traced it away), so only the per-op
    excess is left for a wider SuperKernel scope to cut: an upper bound, the scopes already cut some."""
    graph = run["exe_mode"] != "eager"
    if graph and run["superkernel"] and run["plan"] == "decoder":
        return []  # the configuration already removes what this would suggest
    flops, nbytes = defaultdict(int), defaultdict(int)
    for c in calls:
        flops[c.op] += c.flops
        nbytes[c.op] += c.bytes
    ms = defaultdict(float)
    for x in times:
        ms[x.op] += x.ms
    python_ms = ms.pop(PYTHON, 0.0)
    excess = sum(max(0.0, v - roofline_ms(flops[op], nbytes[op], machine)) for op, v in ms.items())
    if not graph:
        what = "per-op dispatch/launch cost: measured op time above the roofline, plus Python between ops"
        action = "model_config.exe_mode: ge_graph with enable_superkernel: true (plan decoder)"
        saving = excess + python_ms
    else:
        now = f"plan {run['plan']} scopes part of the step" if run["superkernel"] else "SuperKernel is off"
        what = (
            f"per-op dispatch/launch cost left in {run['exe_mode']} ({now}): op time above the roofline, "
            "measured eagerly (an upper bound)"
        )
        action = "model_config.enable_superkernel: true, superkernel.plan: decoder (one scope over every layer)"
        saving = excess
    return [Opportunity("overhead", what, [], saving, action, {"python_ms": python_ms, "above_roofline_ms": excess})]
