"""The first processor's fields in /proc/cpuinfo, read by the tests apart from the code under test
(executor.platform reads the same file), so a CPU-keyed rule is checked against Linux's word."""

from __future__ import annotations


def first_processor() -> dict[str, str]:
    """Field -> value of the first processor block; empty where there is no /proc/cpuinfo."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as fh:
            block = fh.read().split("\n\n")[0]
    except OSError:
        return {}
    return {k.strip(): v.strip() for k, sep, v in (line.partition(":") for line in block.splitlines()) if sep}


def flags() -> set[str]:
    """The CPU's flags (x86: "avx512_bf16", "amx_bf16", ...); empty where Linux lists none."""
    return set(first_processor().get("flags", "").split())
