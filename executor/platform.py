"""Hardware detection: which accelerator runs the recipe, and which Ascend SoC it is.

Why a module of its own: the NPU backend only works on Atlas A2/A3 (SuperKernel scopes are
documented for A2/A3 only; some fused ops differ per SoC), yet the project is developed and
tested on machines without an NPU. ``torch_npu`` cannot even be imported there (it needs the
CANN libraries), so it is imported lazily, only inside :func:`detect`, and every other piece
of evidence (``npu-smi`` text, the CANN install file) is parsed by pure functions that the
tests exercise with recorded samples. torch itself is imported inside the functions that use it:
a command's `--help` and its argument errors come before any of them, and `import torch` alone takes
2-3 s (sk_compare imports this module at its top).
"""

from __future__ import annotations

import glob
import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

from executor.backends.npu_probe import probe as probe_npu
from executor.config import DEVICES
from executor.errors import RecipeError

_SOC_LABEL = {"A2": "Atlas A2", "A3": "Atlas A3", "950": "Ascend 950"}
_BUS_ID = re.compile(r"^[0-9A-Fa-f]{4}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.[0-9A-Fa-f]$")


class PlatformError(RecipeError):
    """A requested device cannot be used here; the message says why in one line."""


@dataclass(frozen=True)
class Platform:
    kind: str  # "cpu" | "cuda" | "npu"
    soc_class: str | None  # npu only: "A2" | "A3" | "950" | "unknown"
    device_name: str
    reason: str  # one line: how it was detected

    @property
    def is_a3(self) -> bool:
        return self.kind == "npu" and self.soc_class == "A3"

    def describe(self) -> str:
        label = _SOC_LABEL.get(self.soc_class or "")
        return f"{self.kind} ({label}, {self.device_name})" if label else f"{self.kind} ({self.device_name})"


@dataclass(frozen=True)
class NpuChip:
    npu_id: int
    chip_id: int
    name: str
    bus_id: str


def soc_class_from_name(name: str) -> str:
    """Map a SoC name (``Ascend910B3``, ``Ascend910_9392``, npu-smi's ``910B3``) to its class."""
    n = name.strip()
    if not n.lower().startswith("ascend"):
        n = "Ascend" + n
    n = n.lower()
    if n.startswith("ascend910b"):
        return "A2"
    if n.startswith("ascend910_93"):
        return "A3"
    if n.startswith("ascend950"):
        return "950"
    return "unknown"


def parse_npu_smi(text: str) -> list[NpuChip]:
    """Parse the device table of ``npu-smi info``.

    Each NPU is an ``| <npu> <name> | <health> |`` row followed by chip rows whose second cell is
    a PCI bus id (A2: ``| <chip> |``, A3: ``| <chip> <phy-id> |``, two chips per NPU). Rows of
    other tables (processes) never carry a bus id, so they are skipped.
    """
    chips: list[NpuChip] = []
    npu_id: int | None = None
    name = ""
    for line in text.splitlines():
        line = line.strip()
        if not line.startswith("|"):
            continue
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) < 2:
            continue
        first = cells[0].split()
        if not first or not first[0].isdigit():
            continue
        if _BUS_ID.match(cells[1]):
            if npu_id is not None:
                chips.append(NpuChip(npu_id, int(first[0]), name, cells[1]))
        elif len(first) >= 2 and re.search(r"[A-Za-z]", first[1]):
            npu_id, name = int(first[0]), first[1]
    return chips


def soc_class_from_npu_smi(text: str) -> str:
    """Classify from ``npu-smi info``: names ``910B*`` mean A2; A3 lists ``Ascend910`` with two
    chips per NPU under a ``Chip  Phy-ID`` header (the bare name alone is ambiguous)."""
    chips = parse_npu_smi(text)
    for chip in chips:
        cls = soc_class_from_name(chip.name)
        if cls != "unknown":
            return cls
    ids = [c.npu_id for c in chips]
    bare_910 = bool(chips) and all(c.name.lower() in ("ascend910", "910") for c in chips)
    if re.search(r"Chip\s+Phy-ID", text) or (bare_910 and max(map(ids.count, ids)) >= 2):
        return "A3"
    return "unknown"


def parse_npu_smi_board(text: str) -> str | None:
    """Full SoC name from ``npu-smi info -t board -i 0 -c 0`` (A3: ``Ascend910`` + ``_9392``)."""
    fields: dict[str, str] = {}
    for line in text.splitlines():
        m = re.match(r"^\s*([A-Za-z][A-Za-z ]*?)\s*:\s*(.*?)\s*$", line)
        if m:
            fields.setdefault(m.group(1).lower(), m.group(2))
    chip = fields.get("chip name", "")
    if not chip:
        return None
    if not chip.lower().startswith("ascend"):
        chip = "Ascend" + chip
    npu = fields.get("npu name", "")
    if npu and npu.lower() not in ("na", "n/a", "-") and npu not in chip:
        chip = f"{chip}_{npu}"
    return chip


def _run_npu_smi(*args: str) -> str | None:
    exe = shutil.which("npu-smi")
    if not exe:
        return None
    try:
        res = subprocess.run([exe, *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return res.stdout if res.returncode == 0 else None


def _npu_platform(torch_npu) -> Platform:
    """Name the SoC: torch_npu first, then npu-smi's board view, then its table."""
    try:
        name = str(torch_npu.npu.get_device_name())
        return Platform("npu", soc_class_from_name(name), name, f"torch_npu.npu.get_device_name() = {name}")
    except Exception as exc:  # a broken driver must not hide the NPU itself
        first_error = f"get_device_name() failed ({type(exc).__name__})"
    board = _run_npu_smi("info", "-t", "board", "-i", "0", "-c", "0")
    name = parse_npu_smi_board(board) if board else None
    if name:
        return Platform("npu", soc_class_from_name(name), name, f"{first_error}; npu-smi board: Chip/NPU Name = {name}")
    table = _run_npu_smi("info")
    chips = parse_npu_smi(table) if table else []
    if chips:
        return Platform(
            "npu",
            soc_class_from_npu_smi(table),
            chips[0].name,
            f"{first_error}; npu-smi info lists {len(chips)} chip(s) named {chips[0].name}",
        )
    return Platform("npu", "unknown", "Ascend (unknown SoC)", f"{first_error}; npu-smi unavailable")


def _cpuinfo(field: str) -> str | None:
    """The first processor's `field` in /proc/cpuinfo (Linux), or None."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as fh:
            for line in fh:
                key, _, value = line.partition(":")
                if key.strip() == field and value.strip():
                    return value.strip()
    except OSError:
        pass
    return None


def _cpu_name() -> str:
    return _cpuinfo("model name") or "cpu"


ZEN4 = ("AuthenticAMD", 25)  # family 19h: Zen 3 and Zen 4; of the two only Zen 4 has AVX-512


def cpu_family() -> tuple[str, int] | None:
    """(vendor, family) of this x86 CPU from /proc/cpuinfo, e.g. ZEN4; None where Linux does not
    say. For the few lowering rules that measured one way on one CPU generation and the other way
    on the next (eager_linear.gemv_in_graphs)."""
    vendor, family = _cpuinfo("vendor_id"), _cpuinfo("cpu family")
    return (vendor, int(family)) if vendor and family and family.isdigit() else None


def cpu_kind() -> str:
    """This CPU as the benchmarks' by-kind table names it: model name, vendor family and model, the
    vector units the kernels choose by, and the cores torch uses. Why: on this project's CPUs one
    kind's numbers did not carry to another (a lowering faster on Zen 3 was slower on Zen 4, AMX
    hosts took other loops; BENCHMARKS.md, "Issue 13: where each target stands, by CPU kind"), so a
    recorded number has to say which kind it came from."""
    import torch

    family, model = _cpuinfo("cpu family"), _cpuinfo("model")
    where = f"{_cpuinfo('vendor_id')} family {family} model {model}" if family and model else "family unknown"
    units = [
        name
        for name, has in (
            ("AVX2", torch.cpu._is_avx2_supported()),
            ("AVX-512", torch.cpu._is_avx512_supported()),
            ("AVX512-BF16", torch.cpu._is_avx512_bf16_supported()),
            ("AMX", torch.cpu._is_amx_tile_supported()),
        )
        if has
    ]
    return f"{_cpu_name()} ({where}; {', '.join(units) or 'no AVX2'}; {torch.get_num_threads()} threads)"


def cpu_runs_bf16() -> bool:
    """This CPU multiplies bf16 natively (AVX512-BF16 or AMX on x86). Without it aten's bf16 matmuls
    convert on the fly: on an AVX2-only host the 0.6B batch-4 bf16 decode step took 1.7x the fp32
    one (BENCHMARKS.md, seventeenth pass), so a bf16 run there is told so. (The large projections of
    the prefill and of every decode step now run AVX2 kernels of ours there instead, "eighteenth"
    and "nineteenth pass"; attention and small weights still pay.)

    oneDNN's own answer (`_is_mkldnn_bf16_supported`) is not enough on x86: it says yes on any
    AVX-512 core (BW, VL, DQ), where it emulates bf16. On such a CPU without AVX512-BF16 (an Intel
    Xeon, Ice Lake) its packed bf16 products read the 0.6B shape's weights at 0.28 / 0.13 / 0.04 of
    a sum's rate at 4 / 16 / 64 rows, where the AVX2 loop of ours read 0.83 / 0.39 / 0.09, and the
    batch-1 ge_graph step took 0.93x the time with the GEMV kernel in place of the reductions
    (BENCHMARKS.md, "fifty-sixth pass")."""
    import platform as host

    import torch

    if not (torch.backends.mkldnn.is_available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())):
        return False
    if host.machine().lower() not in ("x86_64", "amd64", "i386", "i686"):
        return True  # Arm: oneDNN's check asks for the bf16 instructions themselves
    return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()


def detect(device: str = "auto") -> Platform:
    """Resolve ``device`` to a Platform; an explicit request that cannot be met raises."""
    import torch

    if device not in DEVICES:
        raise PlatformError(f"unknown device {device!r}; allowed: {', '.join(DEVICES)}")
    if device in ("auto", "npu"):
        mod, why = probe_npu()
        if mod is not None:
            return _npu_platform(mod)
        if device == "npu":
            raise PlatformError(f"device='npu' requested but {why}")
    else:
        why = "npu not requested"
    if device in ("auto", "cuda"):
        if torch.cuda.is_available():
            name = torch.cuda.get_device_name(0)
            return Platform("cuda", None, name, f"{why}; torch.cuda.get_device_name(0) = {name}")
        if device == "cuda":
            raise PlatformError("device='cuda' requested but torch.cuda.is_available() = False")
    name = _cpu_name()
    how = "requested explicitly" if device == "cpu" else f"{why}; torch.cuda.is_available() = False"
    return Platform("cpu", None, name, f"{how}; cpu model from /proc/cpuinfo: {name}")


def cann_version(toolkit_root: str | None = None) -> str | None:
    """CANN version from ``<root>/<arch>-linux/ascend_toolkit_install.info`` (``version=...``)."""
    root = toolkit_root or os.environ.get("ASCEND_HOME_PATH") or "/usr/local/Ascend/ascend-toolkit/latest"
    for info in sorted(glob.glob(os.path.join(root, "*-linux", "ascend_toolkit_install.info"))):
        try:
            with open(info, encoding="utf-8", errors="replace") as fh:
                for line in fh:
                    key, sep, value = line.partition("=")
                    if sep and key.strip() == "version" and value.strip():
                        return value.strip()
        except OSError:
            continue
    return None


def _dist_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def software_versions() -> dict[str, str | None]:
    """Versions for run reports; torch_npu is looked up in metadata, never imported."""
    import torch

    return {
        "python": "{}.{}.{}".format(*sys.version_info[:3]),
        "torch": torch.__version__,
        "torch_npu": _dist_version("torch_npu"),
        "cann": cann_version(),
        "transformers": _dist_version("transformers"),
    }


def timer(platform: Platform) -> Callable[[], float]:
    """perf_counter that first waits for the device, so step times are real."""
    import torch

    sync: Callable[[], None] = lambda: None  # noqa: E731
    if platform.kind == "cuda":
        sync = torch.cuda.synchronize
    elif platform.kind == "npu":
        sync = torch.npu.synchronize  # attribute added by torch_npu, present only on NPU hosts

    def now() -> float:
        sync()
        return time.perf_counter()

    return now


def profiler_activities(platform: Platform) -> list:
    """What the torch profiler records here: CPU events, and on CUDA the kernels themselves (a
    CPU-only trace of a CUDA step shows its launches, not where the GPU's time goes)."""
    import torch

    activities = [torch.profiler.ProfilerActivity.CPU]
    if platform.kind == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    return activities
