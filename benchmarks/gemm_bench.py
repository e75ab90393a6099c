"""Decode GEMMs alone: the project's kernel (`cann_cpu::rows_linear`, and in bf16 on a CPU with AMX
its AMX loop `cann_cpu::amx_linear`) vs oneDNN on packed weights (vs aten's linear where oneDNN
cannot run the dtype natively: bf16 on an AVX2 CPU); and the eager path's kernels on the weights as
stored (`cann_cpu::gemv` for 1-4 rows, `cann_cpu::dot_linear` for 3-64 (in bf16 on a CPU without AMX), its
AVX-512 or its AVX2 loop; in bf16 on a CPU with AMX the AMX loop for 2-192) next to aten's linear (bf16)
or oneDNN's (fp32) on the same weights; past dot_linear's rows, where the eager path gives them to the
kernel on the weight as stored (packing each block as it goes: eager_linear.rows_run_plain), that pass
next to aten's linear on the same weights.

Why: a batched decode step is one pass over every projection with M = batch rows. This times that
pass outside the model, on the projections of a named size as the loader merges them (qkv_proj,
o_proj, gate_up_proj, down_proj per layer, and the lm_head), with random weights of --dtype, so the
GEMM's own streaming rate is seen without the rest of the step. The weights are on whole 2 MiB pages
(executor/huge_pages.py), as the runner places a model's and packed_linear its packed copies: before,
only the packed copies were, and the kernels on the weights as stored read 0.04-0.07 of a sum's rate
less for it (BENCHMARKS.md, "seventy-seventh pass").

Each round times one full pass per method and, right before it, one fp32 sum over 512 MiB; the
ratio pass rate / sum rate is taken per round and the median printed: on the reference VM the
sum rate itself moved between 33 and 64 GB/s from run to run, so the ratio is what compares.
GFLOP/s = 2 x M x parameters / pass time.

  python benchmarks/gemm_bench.py
  python benchmarks/gemm_bench.py --size qwen3-0.6b --dtype float32 --rows 1,4,16,64 --rounds 7
  python benchmarks/gemm_bench.py --size qwen3-0.6b --dtype bfloat16 --rows 128,512 --rounds 5
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.cli import int_list  # noqa: E402
from executor import huge_pages  # noqa: E402
from executor.arch import ModelArch, load_arch  # noqa: E402
from executor.backends import eager_linear, packed_linear  # noqa: E402
from executor.errors import RecipeError  # noqa: E402


def projections(arch: ModelArch) -> list[tuple[int, int]]:
    """(N, K) of every decode GEMM of one step of a dense `arch`, merged as the loader merges them."""
    h, d, inter = arch.hidden_size, arch.head_dim, arch.intermediate_size
    layer = [((arch.num_heads + 2 * arch.num_kv_heads) * d, h), (h, arch.num_heads * d), (2 * inter, h), (h, inter)]
    return layer * arch.num_layers + [(arch.vocab_size, h)]


def kernel_pass(xs: dict, weights: list[torch.Tensor], packed: list[torch.Tensor]) -> None:
    for w, p in zip(weights, packed):
        torch.ops.cann_cpu.rows_linear(xs[w.shape[1]], p, None)


def amx_pass(xs: dict, weights: list[torch.Tensor], packed: list[torch.Tensor]) -> None:
    for w, p in zip(weights, packed):
        torch.ops.cann_cpu.amx_linear(xs[w.shape[1]], p, None)


def aten_pass(xs: dict, weights: list[torch.Tensor], _packed: list[torch.Tensor]) -> None:
    for w in weights:
        torch.nn.functional.linear(xs[w.shape[1]], w)


def gemv_pass(xs: dict, weights: list[torch.Tensor], _packed: list[torch.Tensor]) -> None:
    for w in weights:
        torch.ops.cann_cpu.gemv(xs[w.shape[1]], w, None)


def dot_pass(xs: dict, weights: list[torch.Tensor], _packed: list[torch.Tensor]) -> None:
    for w in weights:
        torch.ops.cann_cpu.dot_linear(xs[w.shape[1]], w, None)


def stored_kernel_pass(xs: dict, weights: list[torch.Tensor], _packed: list[torch.Tensor]) -> None:
    """The eager path's products of many rows: the kernel on each weight as stored where it takes
    it, aten's linear on the others."""
    for w in weights:
        if eager_linear.plain_fits(w):
            torch.ops.cann_cpu.rows_linear(xs[w.shape[1]], w, None)
        else:
            torch.nn.functional.linear(xs[w.shape[1]], w)


def stored_onednn_pass(xs: dict, weights: list[torch.Tensor], _packed: list[torch.Tensor]) -> None:
    for w in weights:
        torch.ops.mkldnn._linear_pointwise(xs[w.shape[1]], w, None, "none", [], "")


def onednn_pass(xs: dict, weights: list[torch.Tensor], packed: list[torch.Tensor]) -> None:
    for w, p in zip(weights, packed):
        torch.ops.mkldnn._linear_pointwise(xs[w.shape[1]], p, None, "none", [], "")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="qwen3-0.6b", help="named size in configs/model_sizes.yaml (a dense one)")
    ap.add_argument("--rows", type=int_list, default="1,4,16,64", help="comma list of row counts M (the decode batch)")
    ap.add_argument("--rounds", type=int, default=7, help="timed rounds per row count (after one warm-up)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="weight and row dtype")
    args = ap.parse_args(argv)
    try:
        arch = load_arch("", args.size)
    except RecipeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if arch.num_experts:
        print(f"error: --size {args.size} is a MoE model; this bench times the dense projections", file=sys.stderr)
        return 2
    dtype = getattr(torch, args.dtype)
    if not packed_linear.kernel_runs(dtype):
        print(
            f"error: the {args.dtype} kernel does not run here (no AVX-512 or AVX2, or it could not be built)",
            file=sys.stderr,
        )
        return 2
    torch.manual_seed(0)
    shapes = projections(arch)
    # on whole huge pages, as the runner places a model's weights and packed_linear its packed copies
    weights = [huge_pages.contiguous((torch.randn(n, k) * 0.02).to(dtype)) for n, k in shapes]
    size = weights[0].element_size()
    nbytes = sum(w.numel() * size for w in weights)
    threads = torch.get_num_threads()
    cols = packed_linear.kernel_cols(dtype)
    print(
        f"# gemm_bench: {args.size}, {len(shapes)} projections, {nbytes / 1e6:.0f} MB {args.dtype}, {threads} threads,"
        f" the kernel's {'AVX-512' if cols == 64 else 'AVX2'} loop ({cols}-column blocks)"
    )
    total = torch.empty(1 << 27).uniform_()  # 512 MiB fp32: the sum rate next to every pass

    def sum_rate() -> float:
        t0 = time.perf_counter()
        total.sum()
        return total.numel() * 4 / (time.perf_counter() - t0) / 1e9

    print("| M | method | GB/s (median) | x fp32 sum rate | GFLOP/s |")
    print("|---|---|---|---|---|")
    for rows in args.rows:
        xs = {k: torch.randn(rows, k).to(dtype) for k in {k for _, k in shapes}}
        methods = {"kernel": (kernel_pass, [packed_linear.pack_rows(w) for w in weights])}
        if dtype == torch.bfloat16 and rows > 1 and packed_linear.amx_runs():  # the AVX-512 loop's packing
            blocks = methods["kernel"][1] if cols == 64 else [packed_linear.pack_rows(w, 64) for w in weights]
            methods["amx"] = (amx_pass, blocks)
            if rows <= eager_linear.AMX_STORED_MAX_ROWS:  # eager's bf16 rows: the same op on the weight as stored
                methods["amx (stored)"] = (amx_pass, weights)
        if rows <= eager_linear.GEMV_MAX_ROWS and eager_linear.gemv_runs(dtype):  # eager's few-row kernel
            methods["gemv"] = (gemv_pass, [])
        if eager_linear.DOT_MIN_ROWS <= rows <= eager_linear.DOT_MAX_ROWS and eager_linear.dot_runs(dtype):
            methods["dot (stored)"] = (dot_pass, [])  # eager's 3-64 rows; before it, on the weight as stored:
            methods["aten (stored)" if dtype == torch.bfloat16 else "oneDNN (stored)"] = (
                aten_pass if dtype == torch.bfloat16 else stored_onednn_pass,
                [],
            )
        if rows > eager_linear.dot_max_rows(dtype) and eager_linear.rows_run_plain(dtype):
            methods["kernel (stored)"] = (stored_kernel_pass, [])  # eager's many rows, packed as it goes
            if dtype == torch.bfloat16 and packed_linear.supported(dtype):
                methods["aten (stored)"] = (aten_pass, [])  # what the eager path ran them on before
        if packed_linear.supported(dtype):
            reordered = [torch.ops.mkldnn._reorder_linear_weight(w, rows) for w in weights]
            methods["oneDNN packed"] = (onednn_pass, reordered)
        else:  # oneDNN would emulate the dtype (bf16 without AVX512-BF16 or AMX): aten's linear is what runs
            methods["aten linear"] = (aten_pass, [])
        rates: dict[str, list[float]] = {m: [] for m in methods}
        ratios: dict[str, list[float]] = {m: [] for m in methods}
        for round_ in range(args.rounds + 1):
            for name, (run, packed) in methods.items():
                reference = sum_rate()
                t0 = time.perf_counter()
                run(xs, weights, packed)
                rate = nbytes / (time.perf_counter() - t0) / 1e9
                if round_:  # round 0 warms up (oneDNN creates its primitives)
                    rates[name].append(rate)
                    ratios[name].append(rate / reference)
        for name in methods:
            rate = statistics.median(rates[name])
            gflops = 2 * rows * rate / size  # 2 FLOPs per parameter and row
            print(f"| {rows} | {name} | {rate:.1f} | {statistics.median(ratios[name]):.2f} | {gflops:.0f} |")
        del methods  # one packed copy of the weights per method: free them before the next M
    return 0


if __name__ == "__main__":
    sys.exit(main())
