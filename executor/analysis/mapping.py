"""The decode graph's ops and how each maps onto Ascend.

The step is captured the way graph mode captures it (dynamo, then AOT autograd to aten ops,
functionalized: what torchair converts), with the run's op table. Per FX node: its target, the
model source line and the executor.ops entry it comes from (both from the node's stack trace),
its dtype, whether its output shape depends on data. Then torchair, from the torch-npu wheel in
a subprocess (executor/analysis/converters.py), says per target whether a GE converter exists.
Ops inside an executor.ops entry are replaced on an NPU by the fused torch_npu op of our NPU
table (NPU_TABLE), so their own converters do not matter; the fused op's does. Graph breaks are
found by dynamo's explain only when the capture gave more than one graph.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

from executor.paths import REPO_ROOT

# executor.ops entry -> (torch_npu op the NPU table calls, the GE op torchair makes of it)
# (executor/backends/npu.py register_ops; tests/data/ascend_facts/fused_ops.yaml ge_op)
NPU_TABLE = {
    "rms_norm": ("npu_rms_norm", "RmsNorm"),
    "add_rms_norm": ("npu_add_rms_norm", "AddRmsNorm"),
    "swiglu": ("npu_swiglu", "SwiGlu"),
    "rotary_mul": ("npu_rotary_mul", "RotaryMul"),
    "attention": ("npu_fused_infer_attention_score", "FusedInferAttentionScore"),
    "moe_gating_top_k_softmax": ("npu_moe_gating_top_k_softmax", "MoeGatingTopKSoftmax"),
    "moe_init_routing": ("npu_moe_init_routing", "MoeInitRouting"),
    "grouped_matmul": ("npu_grouped_matmul", "GroupedMatmul"),
}
# Out-of-place updates AOT makes of an in-place write into a graph input (the static KV cache): each
# builds a whole new tensor per step, which is copied back into the input after the graph.
FUNCTIONAL_UPDATES = {"aten.scatter.src", "aten.scatter.value", "aten.index_copy.default", "aten.slice_scatter.default"}
COMM_NAMESPACES = ("_c10d_functional", "c10d_functional", "c10d")  # collectives in a captured graph
_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\w+)')
_OPS_INTERFACE = str(REPO_ROOT / "executor" / "ops" / "__init__.py")


@dataclass
class Node:
    target: str  # "aten.mm.default"
    source: str  # "models/qwen/models/modeling_qwen.py:63" ("" if no model frame)
    entry: str | None  # executor.ops entry, None = the model's own code
    dtype: str
    data_dependent: bool  # output shape depends on values: a host round trip / a cut in a SK scope
    name: str = ""  # FX node name
    inputs: list[str] = field(default_factory=list)  # FX names of the node's tensor inputs
    users: int = 0
    nbytes: int = 0  # of its output
    rewrites_input: bool = False  # a functional update (e.g. scatter) of a graph input: a whole new copy


@dataclass
class Capture:
    nodes: list[Node]
    graphs: int
    breaks: list[dict]  # {"reason", "source"} per graph break (empty: one graph)


def _where(stack_trace: str) -> tuple[str, str | None]:
    source, entry = "", None
    for path, line, func in _FRAME.findall(stack_trace or ""):
        if path == _OPS_INTERFACE and entry is None:  # outermost interface frame comes first
            entry = func
        if path.startswith(str(REPO_ROOT / "models")):
            source = f"{Path(path).relative_to(REPO_ROOT)}:{line}"  # innermost model frame comes last
    return source, entry


def _dtype(value) -> str:
    return str(value.dtype).removeprefix("torch.") if isinstance(value, torch.Tensor) else ""


def capture(step: Callable, args: tuple) -> Capture:
    """The aten FX graph(s) of `step(*args)` as graph mode sees them (no fullgraph: breaks are counted)."""
    from torch._functorch.aot_autograd import aot_module_simplified

    graphs: list[torch.fx.GraphModule] = []

    def keep(gm, _inputs):
        graphs.append(gm)
        return gm.forward

    def backend(gm, inputs):
        return aot_module_simplified(gm, inputs, fw_compiler=keep)

    torch._dynamo.reset()
    try:
        torch.compile(step, backend=backend, dynamic=False)(*args)
        breaks = _breaks(step, args) if len(graphs) > 1 else []
    finally:
        torch._dynamo.reset()
    nodes = []
    for gm in graphs:
        for n in gm.graph.nodes:
            if n.op != "call_function":
                continue
            source, entry = _where(n.meta.get("stack_trace", ""))
            value = n.meta.get("val")
            nodes.append(
                Node(
                    str(n.target),
                    source,
                    entry,
                    _dtype(value),
                    bool(isinstance(value, torch.Tensor) and free_unbacked_symbols(value)),
                    n.name,
                    [a.name for a in n.all_input_nodes],
                    len(n.users),
                    value.numel() * value.element_size() if isinstance(value, torch.Tensor) else 0,
                    str(n.target) in FUNCTIONAL_UPDATES and n.all_input_nodes[0].op == "placeholder",
                )
            )
    return Capture(nodes, len(graphs), breaks)


def _breaks(step: Callable, args: tuple) -> list[dict]:
    explained = torch._dynamo.explain(step)(*args)
    found = []
    for reason in explained.break_reasons:
        frames = [f for f in reason.user_stack if f.filename.startswith(str(REPO_ROOT / "models"))]
        where = f"{Path(frames[-1].filename).relative_to(REPO_ROOT)}:{frames[-1].lineno}" if frames else ""
        found.append({"reason": str(reason.reason).strip().splitlines()[0], "source": where})
    return found


def converter_targets(nodes: list[Node]) -> list[str]:
    """The op targets torchair is asked about: the graph's ops and the fused torch_npu ops of the
    entries they come from (what the NPU graph holds instead)."""
    ops = {n.target for n in nodes if n.target.count(".") >= 2 and not n.target.startswith("<")}
    fused = {f"npu.{NPU_TABLE[n.entry][0]}.default" for n in nodes if n.entry in NPU_TABLE}
    return sorted(ops | fused)


def converter_status(targets: list[str], custom_ops: tuple[str, ...]) -> tuple[dict[str, str] | None, str]:
    """(target -> "converter" | "not needed" | "missing" | "unknown op", note); None + the reason
    when torchair could not be set up (the mapping is then reported as not run)."""
    with tempfile.TemporaryDirectory(prefix="op_analysis_") as tmp:
        src, out = Path(tmp) / "targets.json", Path(tmp) / "status.json"
        src.write_text(json.dumps(targets))
        cmd = [sys.executable, "-m", "executor.analysis.converters", "--targets", str(src), "--out", str(out)]
        for name in custom_ops:
            cmd += ["--custom-op", name]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])))
        proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=900, env=env)
        if proc.returncode != 0 or not out.is_file():
            lines = [ln for ln in (proc.stderr or proc.stdout).splitlines() if ln.strip()]
            return None, lines[-1] if lines else f"exit code {proc.returncode}"
        answer = json.loads(out.read_text())
    return answer["status"], f"torchair from the torch-npu {answer['torch_npu']} wheel"


def communication_ops(nodes: list[Node]) -> list[Node]:
    return [n for n in nodes if n.target.split(".")[0] in COMM_NAMESPACES]
