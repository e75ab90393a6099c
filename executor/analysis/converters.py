"""Ask torchair (from the torch-npu wheel) which FX targets it has GE converters for. A subprocess.

    python -m executor.analysis.converters --targets TARGETS.json --out STATUS.json [--custom-op NAME ...]

Why a process of its own: torchair cannot be imported twice, nor next to anything else that
defines its scope ops (executor/backends/ge_offline.py says why), and the analysis process has
already traced the model. TARGETS.json is a list of target names as FX prints them
("aten.mm.default", "npu.npu_rms_norm.default", "cann.decode_attention.default"); the answer per
target is "converter", "not needed" (torchair handles it in place) or "missing"; a name that is
no op in this process is "unknown op". The configured custom ops are installed first exactly as
an NPU ge_graph run installs them (their GE converters register then).
Exit code 2 with one line on stderr when the wheel or torchair cannot be set up.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

import torch

from executor.errors import RecipeError, run_command


class ConverterCheckError(RecipeError):
    """torchair from the wheel cannot be set up here (no wheel, no network)."""


def resolve(target: str):
    """FX's printed name -> the op overload (torch.ops.<ns>.<op>.<overload>), or None."""
    try:
        return functools.reduce(getattr, target.split("."), torch.ops)
    except (AttributeError, RuntimeError):
        return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m executor.analysis.converters", description=__doc__.splitlines()[0])
    p.add_argument("--targets", required=True, help="JSON list of FX target names")
    p.add_argument("--out", required=True, help="where the JSON answer goes")
    p.add_argument("--custom-op", action="append", default=[], help="a configured custom op (repeatable)")
    args = p.parse_args(argv)
    from executor import custom_ops
    from executor.backends import ge_offline

    try:
        air = ge_offline.OfflineTorchair.install()
    except ge_offline.GeOfflineError as exc:
        raise ConverterCheckError(str(exc)) from None
    from executor.backends import npu  # torch_npu is the ge_offline stand-in by now

    npu.register_ops()
    if args.custom_op:
        custom_ops.layer("npu", args.custom_op, npu.custom_op_installer("ge_graph"))
    status = {}
    for name in json.loads(Path(args.targets).read_text()):
        target = resolve(name)
        if target is None:
            status[name] = "unknown op"
        elif not air.needs_converter(target):
            status[name] = "not needed"
        else:
            status[name] = "converter" if air.has_converter(target) else "missing"
    Path(args.out).write_text(json.dumps({"torch_npu": ge_offline.TORCH_NPU_VERSION, "status": status}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(run_command(main, sys.argv[1:]))
