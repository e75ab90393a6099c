"""Hardware detection is tested on recorded npu-smi text and fake modules, because no NPU is
available to CI: the parsers must be right before they ever meet a real card."""

import importlib.machinery
import sys
import types

import pytest

import tests.cpuinfo as cpuinfo
from executor import platform as plat
from executor.platform import (
    NpuChip,
    Platform,
    PlatformError,
    cann_version,
    detect,
    parse_npu_smi,
    parse_npu_smi_board,
    soc_class_from_name,
    soc_class_from_npu_smi,
    software_versions,
)

# Verbatim from shared/reference/ascend-apis.md, "Detecting the hardware".
A2_SMI = """\
| NPU   Name                | Health        | Power(W)    Temp(C)           Hugepages-Usage(page)|
| Chip                      | Bus-Id        | AICore(%)   Memory-Usage(MB)  HBM-Usage(MB)        |
+===========================+===============+====================================================+
| 0     910B3               | OK            | 93.7        32                0    / 0             |
| 0                         | 0000:C1:00.0  | 0           0    / 0          3389 / 65536         |
"""
A3_SMI = """\
| NPU   Name                | Health        | Power(W)    Temp(C)           Hugepages-Usage(page)|
| Chip  Phy-ID              | Bus-Id        | AICore(%)   Memory-Usage(MB)  HBM-Usage(MB)        |
+===========================+===============+====================================================+
| 0     Ascend910           | OK            | 174.3       37                0    / 0             |
| 0     0                   | 0000:9D:00.0  | 0           0    / 0          3440 / 65536         |
| 0     Ascend910           | OK            | -           36                0    / 0             |
| 1     1                   | 0000:9F:00.0  | 0           0    / 0          3205 / 65536         |
"""
PROCESS_TABLE = """\
+---------------------------+---------------+----------------------------------------------------+
| NPU     Chip              | Process id    | Process name             | Process memory(MB)      |
+===========================+===============+====================================================+
| 0       0                 | 12345         | python                   | 3000                    |
+===========================+===============+====================================================+
"""


def test_parse_a2_sample():
    assert parse_npu_smi(A2_SMI) == [NpuChip(0, 0, "910B3", "0000:C1:00.0")]
    assert soc_class_from_npu_smi(A2_SMI) == "A2"


def test_parse_a3_sample_two_chips_per_npu():
    assert parse_npu_smi(A3_SMI) == [
        NpuChip(0, 0, "Ascend910", "0000:9D:00.0"),
        NpuChip(0, 1, "Ascend910", "0000:9F:00.0"),
    ]
    assert soc_class_from_npu_smi(A3_SMI) == "A3"


def test_parse_ignores_process_table_and_junk():
    assert parse_npu_smi(A2_SMI + PROCESS_TABLE) == parse_npu_smi(A2_SMI)
    assert parse_npu_smi("") == []
    assert soc_class_from_npu_smi("no devices") == "unknown"


def test_a3_detected_by_two_chips_without_phy_id_header():
    text = A3_SMI.replace("Chip  Phy-ID ", "Chip         ")
    assert "Phy-ID" not in text
    assert soc_class_from_npu_smi(text) == "A3"
    one_chip = "\n".join(A3_SMI.splitlines()[:4] + [A3_SMI.splitlines()[4]]).replace("Phy-ID", "      ")
    assert soc_class_from_npu_smi(one_chip) == "unknown"  # bare Ascend910, single chip: ambiguous


@pytest.mark.parametrize(
    "name",
    ["Ascend910B1", "Ascend910B2", "Ascend910B2C", "Ascend910B3", "Ascend910B4", "Ascend910B4-1", "910B3", "910B4-1"],
)
def test_a2_names(name):
    assert soc_class_from_name(name) == "A2"


@pytest.mark.parametrize(
    "name",
    [
        "Ascend910_9391",
        "Ascend910_9392",
        "Ascend910_9381",
        "Ascend910_9382",
        "Ascend910_9372",
        "Ascend910_9362",
        "Ascend910_9363",
    ],
)
def test_a3_names(name):
    assert soc_class_from_name(name) == "A3"


@pytest.mark.parametrize(
    "name,cls",
    [
        ("Ascend950PR", "950"),
        ("Ascend950DT", "950"),
        ("Ascend910", "unknown"),
        ("Ascend310P3", "unknown"),
        ("NVIDIA H100", "unknown"),
        ("", "unknown"),
    ],
)
def test_other_names(name, cls):
    assert soc_class_from_name(name) == cls


def test_board_output_a3():
    text = """
        NPU ID                         : 0
        Chip ID                        : 0
        Chip Type                      : Ascend
        Chip Name                      : Ascend910
        NPU Name                       : 9392
        Chip Version                   : V1
    """
    assert parse_npu_smi_board(text) == "Ascend910_9392"
    assert parse_npu_smi_board("Chip Name:Ascend910\nNPU Name:   9392") == "Ascend910_9392"


def test_board_output_a2_and_absent():
    assert parse_npu_smi_board("  Chip Type : Ascend\n  Chip Name : 910B3\n") == "Ascend910B3"
    assert parse_npu_smi_board("  Chip Name : 910B3\n  NPU Name : NA\n") == "Ascend910B3"
    assert parse_npu_smi_board("Board ID : 0x02\n") is None
    assert parse_npu_smi_board("") is None


def _fake_toolkit(root, version="8.3.RC2", arch="aarch64"):
    d = root / f"{arch}-linux"
    d.mkdir(parents=True)
    (d / "ascend_toolkit_install.info").write_text(
        f"package_name=Ascend-cann-toolkit\nversion={version}\narch={arch}\n"
    )


def test_cann_version_explicit_root(tmp_path):
    _fake_toolkit(tmp_path, "8.3.RC2")
    assert cann_version(str(tmp_path)) == "8.3.RC2"
    assert cann_version(str(tmp_path / "missing")) is None


def test_cann_version_from_env(tmp_path, monkeypatch):
    _fake_toolkit(tmp_path, "8.2.RC1", arch="x86_64")
    monkeypatch.setenv("ASCEND_HOME_PATH", str(tmp_path))
    assert cann_version() == "8.2.RC1"
    assert software_versions()["cann"] == "8.2.RC1"


def test_software_versions_keys():
    import torch

    v = software_versions()
    assert set(v) == {"python", "torch", "torch_npu", "cann", "transformers"}
    assert v["torch"] == torch.__version__
    assert v["python"] == "{}.{}.{}".format(*sys.version_info[:3])
    assert v["torch_npu"] is None  # not installed on CPU machines
    assert "torch_npu" not in sys.modules


def test_detect_auto_on_this_machine_is_cpu():
    p = detect("auto")
    assert p.kind == "cpu" and p.soc_class is None and not p.is_a3
    assert p.reason and "\n" not in p.reason
    assert p.device_name
    assert p.describe() == f"cpu ({p.device_name})"
    assert detect("cpu").kind == "cpu"
    assert detect() == p


def test_detect_npu_and_cuda_raise_here():
    with pytest.raises(PlatformError, match="torch_npu"):
        detect("npu")
    with pytest.raises(PlatformError, match="cuda"):
        detect("cuda")


def test_detect_unknown_device_names_allowed_values():
    with pytest.raises(PlatformError) as err:
        detect("tpu")
    msg = str(err.value)
    assert "tpu" in msg and all(d in msg for d in ("auto", "cpu", "cuda", "npu"))


def _install_fake_torch_npu(monkeypatch, get_device_name):
    mod = types.ModuleType("torch_npu")
    mod.__spec__ = importlib.machinery.ModuleSpec("torch_npu", None)
    mod.npu = types.SimpleNamespace(is_available=lambda: True, get_device_name=get_device_name)
    monkeypatch.setitem(sys.modules, "torch_npu", mod)


def test_detect_npu_with_fake_torch_npu(monkeypatch):
    _install_fake_torch_npu(monkeypatch, lambda: "Ascend910_9392")
    p = detect("auto")
    assert p == Platform("npu", "A3", "Ascend910_9392", "torch_npu.npu.get_device_name() = Ascend910_9392")
    assert p.is_a3 and p.describe() == "npu (Atlas A3, Ascend910_9392)"
    assert detect("npu") == p


def test_detect_npu_falls_back_to_npu_smi(monkeypatch):
    def broken():
        raise RuntimeError("driver")

    _install_fake_torch_npu(monkeypatch, broken)
    calls = []

    def fake_smi(*args):
        calls.append(args)
        return None if "board" in args else A2_SMI

    monkeypatch.setattr(plat, "_run_npu_smi", fake_smi)
    p = detect("npu")
    assert calls == [("info", "-t", "board", "-i", "0", "-c", "0"), ("info",)]
    assert (p.kind, p.soc_class, p.device_name) == ("npu", "A2", "910B3")
    assert "npu-smi" in p.reason and not p.is_a3
    assert p.describe() == "npu (Atlas A2, 910B3)"


def test_no_top_level_torch_npu_import():
    import re
    from pathlib import Path

    src = Path(plat.__file__).read_text(encoding="utf-8")
    assert not re.search(r"^\s*(import|from) torch_npu", src, re.M)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_a_bf16_run_on_a_cpu_without_native_bf16_says_it_is_emulated(make_qwen_runner, qwen3_ckpt, dtype):
    """The run's log says so exactly when the CPU lacks AVX512-BF16/AMX and the run is bf16 (there
    the projections run our AVX2 kernels, and what aten still computes in bf16 is emulated); never
    for fp32, never where bf16 is native. On either kind of host one of the two cases checks each
    direction."""
    import io

    runner = make_qwen_runner(
        qwen3_ckpt,
        f"model_config.dtype={dtype}",
        "model_config.exe_mode=eager",
        "model_config.enable_superkernel=false",
        max_new_tokens=2,
    )
    runner.stream = io.StringIO()
    runner.run()
    said = "aten's other bf16 matmuls (attention, small weights) are emulated" in runner.stream.getvalue()
    assert said == (dtype == "bfloat16" and not plat.cpu_runs_bf16())


@pytest.mark.skipif(not cpuinfo.flags(), reason="no x86 flags in /proc/cpuinfo to check against")
def test_bf16_is_native_exactly_where_linux_lists_avx512_bf16_or_amx():
    """cpu_runs_bf16 agrees with the CPU flags Linux reads (an independent source): oneDNN's own check
    also says yes on an AVX-512 core without AVX512-BF16 (an Intel Xeon, Ice Lake), where it emulates
    bf16 at a third of our AVX2 loop's rate (BENCHMARKS.md, "fifty-sixth pass"). On every kind of host
    either side of the equality can be the one that is wrong."""
    flags = cpuinfo.flags()
    native = "avx512_bf16" in flags or "amx_bf16" in flags
    assert plat.cpu_runs_bf16() == native


def test_cpu_family_is_what_linux_says_of_the_first_processor():
    """cpu_family (a lowering rule keyed on AMD Zen 4: eager_linear.gemv_in_graphs) against
    /proc/cpuinfo read here; None where Linux gives no vendor or family (Arm, no /proc)."""
    info = cpuinfo.first_processor()
    vendor, family = info.get("vendor_id"), info.get("cpu family")
    assert plat.cpu_family() == ((vendor, int(family)) if vendor and family and family.isdigit() else None)
