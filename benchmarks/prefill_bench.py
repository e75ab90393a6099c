"""Prefill benchmark: time to first token (TTFT) of our runner against transformers eager, for
one prompt of each --lengths, in one process, on the same random-weight checkpoint.

Prefill always runs eagerly and outside SuperKernel scopes (as upstream does: the scopes are
for the decode step), so one eager runner serves every exe_mode. TTFT here is the prefill call
that produces the first token's logits: ours is `ModelRunner.prefill` (embedding, every layer
over the prompt, the lm_head on the last position only); transformers' is
`generate(max_new_tokens=1)` with its default attention (SDPA). Each is the median of
--repeats calls after one warm-up call, the two sides called in turns (the VM's speed moves by
tens of percent between minutes: one side's calls all after the other's read that as a speed
difference). The first token (argmax) of both sides is compared.

  roofline = max(bytes / measured read bandwidth, FLOPs / measured matmul rate)

bytes = the weights read once + the KV cache written; FLOPs = 2 x matmul parameters x prompt
tokens (the lm_head once) + causal attention (QK^T and PV over the lower triangle). Both rates are
measured by the script on this machine in --dtype (benchmarks/decode_bench.py's measurements).

  python benchmarks/prefill_bench.py --size qwen3-0.6b --lengths 128,512,2048
  python benchmarks/prefill_bench.py --size qwen3-0.6b --dtype bfloat16 --plot ttft.png
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.cli import guarded, int_list, json_path, write_json  # noqa: E402
from benchmarks.decode_bench import DTYPES, make_checkpoint, matmul_tflops, memory_bandwidth_gbs  # noqa: E402
from executor.arch import ModelArch, arch_from_dict, named_size  # noqa: E402
from executor.config import load_config  # noqa: E402
from executor.platform import Platform, detect, timer  # noqa: E402
from executor.registry import default_config, runner_class  # noqa: E402
from executor.tokenizer import BUILTIN_TOKENIZER  # noqa: E402


def prefill_cost(arch: ModelArch, dtype_bytes: int, tokens: int) -> tuple[float, float]:
    """(bytes, FLOPs) of one prefill of `tokens` tokens, batch 1."""
    lm_head = arch.vocab_size * arch.hidden_size
    layer_params = arch.weight_bytes(1) - lm_head  # MoE: k experts per token, as decode counts them
    kv = tokens * arch.num_layers * 2 * arch.num_kv_heads * arch.head_dim * dtype_bytes
    pairs = tokens * (tokens + 1) / 2  # (query, key) pairs under the causal mask
    attn = arch.num_layers * 4 * arch.num_heads * arch.head_dim * pairs
    return arch.weight_bytes(dtype_bytes) + kv, 2 * layer_params * tokens + 2 * lm_head + attn


def ours(path: Path, model: str, dtype: str, platform: Platform, max_len: int):
    """An eager runner with one KV-cache row of `max_len` slots; returns prefill(prompt) -> (ms, token)."""
    overrides = [
        f"model_config.model_path={path}",
        "model_config.with_ckpt=true",
        "model_config.exe_mode=eager",
        "model_config.enable_superkernel=false",
        "model_config.enable_cache_compile=false",
        f"model_config.dtype={dtype}",
        f"model_config.device={platform.kind}",
        "scheduler_config.batch_size=1",
        "scheduler_config.max_new_tokens=2",
        f"data_config.input_truncated_len={max_len - 2}",
        f"model_config.tokenizer_path={BUILTIN_TOKENIZER}",
    ]
    runner = runner_class(model)(load_config(default_config(model), overrides), platform, None)

    def run(prompt: list[int]) -> tuple[float, int]:
        with runner.session(1):
            pre = runner.prefill([prompt])
        return pre.ms, int(pre.logits[0].argmax())

    return run


def hf(path: Path, dtype: torch.dtype, platform: Platform):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval().to(platform.kind)
    now = timer(platform)

    def run(prompt: list[int]) -> tuple[float, int]:
        ids = torch.tensor([prompt], device=platform.kind)
        with torch.no_grad():
            t0 = now()
            out = model.generate(ids, max_new_tokens=1, do_sample=False, pad_token_id=0)
            ms = (now() - t0) * 1e3
        return ms, int(out[0, -1])

    return run


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen", help="recipe under models/ (qwen, qwen3_moe)")
    p.add_argument("--size", default="qwen3-0.6b", help="named size in configs/model_sizes.yaml")
    p.add_argument("--lengths", type=int_list, default="128,512,2048", help="prompt lengths, a comma list")
    p.add_argument("--repeats", type=int, default=3, help="timed calls per side and length (median)")
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES), help="both sides' dtype")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where both sides run (default cpu)")
    p.add_argument("--no-hf", action="store_true", help="skip transformers")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default)")
    p.add_argument("--plot", help="PNG of TTFT per prompt length, with the roofline")
    p.add_argument(
        "--json", type=json_path, help="also write the table as JSON here, after each length (benchmarks/targets.py)"
    )
    args = p.parse_args(argv)
    lengths = args.lengths
    if args.repeats < 1:
        p.error("--repeats >= 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = named_size(args.size, "--size")
    default_config(args.model)  # an unknown recipe is refused before a checkpoint is written
    arch = arch_from_dict(cfg, args.size)
    platform, dtype = detect(args.device), DTYPES[args.dtype]
    print(
        f"# prefill_bench: recipe {args.model}, size {args.size}, {args.dtype}, batch 1, prompts {lengths}, "
        f"median of {args.repeats}, {platform.describe()}, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads",
        flush=True,
    )
    read_bw, tflops = memory_bandwidth_gbs(platform)[0], matmul_tflops(platform, dtype)
    print(
        f"# machine: read bandwidth {read_bw:.1f} GB/s (median of 7), {args.dtype} matmul {tflops:.2f} TFLOP/s",
        flush=True,
    )
    rows = []
    record = {"bench": "prefill_bench", "model": args.model, "size": args.size, "dtype": args.dtype}
    record |= {"platform": platform.describe(), "read_gbs": read_bw, "tflops": tflops}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "ckpt"
        make_checkpoint(cfg, path, seed=0)
        sides = {"ours": ours(path, args.model, args.dtype, platform, max(lengths) + 2)}
        if not args.no_hf:
            sides["transformers eager"] = hf(path, dtype, platform)
        for n in lengths:
            prompt = [(7 * i + 3) % arch.vocab_size for i in range(n)]
            nbytes, flops = prefill_cost(arch, dtype.itemsize, n)
            roof = max(nbytes / (read_bw * 1e9), flops / (tflops * 1e12)) * 1e3
            for run in sides.values():
                run(prompt)  # warm-up: allocator, oneDNN primitives
            timed = {name: [] for name in sides}
            for r in range(args.repeats):  # the sides in turns, so a change of the VM's speed hits both
                for name in list(sides) if r % 2 == 0 else list(sides)[::-1]:
                    timed[name].append(sides[name](prompt))
            result = {}
            for name, calls in timed.items():
                result[name] = (statistics.median(ms for ms, _ in calls), calls[0][1])
                print(f"  {n} tokens: {name} {result[name][0]:.1f} ms", flush=True)
            rows.append((n, roof, flops, result))
            write_json(args.json, record | {"rows": [length_record(*row) for row in rows]})
    print_table(rows, tflops)
    if args.plot:
        plot(Path(args.plot), rows, f"{args.size}, {args.dtype}, batch 1, {platform.describe()}")
        print(f"plot: {args.plot}")
    return 0


def length_record(tokens: int, roof: float, flops: float, result: dict) -> dict:
    """One prompt length for --json: each side's TTFT ms and first token, and the roofline."""
    sides = {name: {"ms": ms, "first_token": tok} for name, (ms, tok) in result.items()}
    return {"tokens": tokens, "roof_ms": roof, "gflop": flops / 1e9, "sides": sides}


def print_table(rows: list, tflops: float) -> None:
    names = list(rows[0][3])
    head = ["prompt tokens", "GFLOP", "roofline ms (bound)"]
    for n in names:
        head += [f"{n} TTFT ms", f"{n} x roofline"]
    if len(names) > 1:
        head += ["ours vs transformers", "first token"]
    print(f"\n| {' | '.join(head)} |\n|" + "---|" * len(head))
    for n, roof, flops, result in rows:
        bound = "compute" if flops / (tflops * 1e9) >= roof * 0.999 else "bandwidth"
        cells = [str(n), f"{flops / 1e9:.1f}", f"{roof:.1f} ({bound})"]
        for name in names:
            cells += [f"{result[name][0]:.1f}", f"{result[name][0] / roof:.2f}"]
        if len(names) > 1:
            (ms, tok), (peer_ms, peer_tok) = result["ours"], result[names[1]]
            cells += [f"{peer_ms / ms:.2f}x", "same" if tok == peer_tok else f"differs ({tok} vs {peer_tok})"]
        print("| " + " | ".join(cells) + " |")


def plot(path: Path, rows: list, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths = [r[0] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name in rows[0][3]:
        ax.plot(lengths, [r[3][name][0] for r in rows], "o-", label=name)
    ax.plot(lengths, [r[1] for r in rows], "k--", label="roofline")
    ax.set(xscale="log", yscale="log", xlabel="prompt tokens", ylabel="time to first token (ms)", title=title)
    ax.set_xticks(lengths, [str(n) for n in lengths])
    ax.set_xticks([], minor=True)  # the log axis would label its minor ticks over these
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(guarded(main))
