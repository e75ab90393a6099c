"""The eager path's norms, SwiGLU and RoPE: the reference (executor.ops.reference) vs the kernels.

Why: the eager prefill calls each of these once or twice per layer; the reference is several aten
calls each, the kernels (executor/backends/csrc/pointwise.cpp) one pass. This times the calls of
one decoder layer of a named size at a prompt length, as the model makes them (q and k as strided
views of the fused projection, RoPE on their transposed views, cos/sin broadcast over heads),
random inputs of --dtype. Each round times both in turn, 20 calls each; the best round is kept.

  python benchmarks/pointwise_bench.py
  python benchmarks/pointwise_bench.py --size qwen3-0.6b --dtype float32 --tokens 512
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import executor  # noqa: E402, F401  (the runner's allocator policy, as a run sees it)
from benchmarks.cli import int_list  # noqa: E402
from executor.arch import load_arch  # noqa: E402
from executor.backends import eager_pointwise  # noqa: E402
from executor.errors import RecipeError  # noqa: E402
from executor.ops import reference  # noqa: E402
from models.qwen.models.modeling_qwen import rope_cos_sin  # noqa: E402


def layer_calls(arch, tokens: int, dtype: torch.dtype) -> list[tuple[str, tuple]]:
    """(op, args) of one layer's norms, RoPEs and SwiGLU."""
    h, d, hq, hkv = arch.hidden_size, arch.head_dim, arch.num_heads, arch.num_kv_heads
    qkv = torch.randn(1, tokens, (hq + 2 * hkv) * d).to(dtype)
    q, k, _v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    q, k = q.view(1, tokens, hq, d), k.view(1, tokens, hkv, d)
    x, residual = torch.randn(2, 1, tokens, h).to(dtype)
    w, wd = torch.randn(h).to(dtype), torch.randn(d).to(dtype)
    cos, sin = rope_cos_sin(torch.arange(tokens).view(1, tokens), d, arch.rope_theta, dtype)
    qn, kn = reference.rms_norm(q, wd, 1e-6), reference.rms_norm(k, wd, 1e-6)
    return [
        ("rms_norm", (x, w, 1e-6)),
        ("rms_norm", (q, wd, 1e-6)),
        ("rms_norm", (k, wd, 1e-6)),
        ("rotary_mul", (qn.transpose(1, 2), cos, sin)),
        ("rotary_mul", (kn.transpose(1, 2), cos, sin)),
        ("add_rms_norm", (x, residual, w, 1e-6)),
        ("swiglu", (torch.randn(1, tokens, 2 * arch.intermediate_size).to(dtype),)),
    ]


def best_us(fn, args, rounds: int, calls: int = 20) -> float:
    best = float("inf")
    for _ in range(rounds):
        fn(*args)
        t0 = time.perf_counter()
        for _ in range(calls):
            fn(*args)
        best = min(best, (time.perf_counter() - t0) / calls * 1e6)
    return best


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="qwen3-0.6b", help="named size in configs/model_sizes.yaml (default: qwen3-0.6b)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--tokens", type=int_list, default="128,512", help="comma list of prompt lengths (default: 128,512)")
    p.add_argument("--rounds", type=int, default=7, help="timing rounds; the best is kept (default: 7)")
    args = p.parse_args(argv)
    try:
        arch = load_arch("", args.size)
        tokens = args.tokens
    except RecipeError as exc:
        print(f"pointwise_bench: {exc}", file=sys.stderr)
        return 2
    if not eager_pointwise.kernel_runs():
        print("pointwise_bench: the kernels cannot be built here (see the line above)", file=sys.stderr)
        return 2
    dtype = getattr(torch, args.dtype)
    kernels = eager_pointwise.PointwiseKernels()
    print(f"# pointwise_bench: {args.size}, {args.dtype}, {torch.get_num_threads()} threads, best of {args.rounds}")
    print("| tokens | op | reference us | kernels us | ratio |")
    print("|---|---|---|---|---|")
    for n in tokens:
        totals = [0.0, 0.0]
        for op, call in layer_calls(arch, n, dtype):
            ref, ours = (
                best_us(getattr(reference, op), call, args.rounds),
                best_us(getattr(kernels, op), call, args.rounds),
            )
            totals = [totals[0] + ref, totals[1] + ours]
            print(f"| {n} | {op} {tuple(call[0].shape)} | {ref:.1f} | {ours:.1f} | {ours / ref:.2f} |")
        print(f"| {n} | **one layer** | {totals[0]:.1f} | {totals[1]:.1f} | {totals[1] / totals[0]:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
