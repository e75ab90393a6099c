"""Decode benchmark: HF transformers eager generate (the peer) vs our eager, ge_graph and
ge_graph + SuperKernel for every plan, in one process, on the same checkpoint.

Why one process and one checkpoint: the comparison must differ only in execution mode.
A random-weight checkpoint of a named size (configs/model_sizes.yaml) is written with
transformers' save_pretrained, then loaded by both sides. Prints a table (median decode
ms/step over >= --steps steps after warm-up, tokens/s, ratio to ge_graph, compile seconds)
and the bandwidth floor: weight bytes / measured read bandwidth (copy rate printed too).

  python benchmarks/decode_bench.py --size bench-overhead
  python benchmarks/decode_bench.py --size qwen3-0.6b --plans decoder --steps 50
  python benchmarks/decode_bench.py --model qwen3_moe --size moe-debugmodel
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from executor.arch import MODEL_SIZES, arch_from_dict  # noqa: E402
from executor.config import load_config  # noqa: E402
from executor.platform import detect  # noqa: E402
from executor.registry import default_config, runner_class  # noqa: E402
from executor.tokenizer import BUILTIN_TOKENIZER  # noqa: E402

PROMPT_LEN = 16


def make_checkpoint(cfg: dict, path: Path, seed: int) -> None:
    """Random HF checkpoint of an architecture (std 0.1 weights, like our with_ckpt: false)."""
    import transformers

    config = transformers.AutoConfig.for_model(**cfg)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.ones_like(p) if "norm" in name else torch.randn_like(p) * 0.1)
    model.save_pretrained(path)


def memory_bandwidth_gbs(nbytes: int = 1 << 29) -> tuple[float, float]:
    """(read, copy) bandwidth in GB/s, best of 7, on a tensor far larger than the caches.

    read: a full reduction over the tensor, the traffic pattern of a decode step (weights are
    only read). copy: bytes copied per second (dst.copy_(src)). A decode step cannot beat
    weight bytes / read bandwidth; the copy rate is printed for reference (it moves each byte
    twice, so weight bytes / copy rate is not a floor).
    """
    src = torch.empty(nbytes // 4, dtype=torch.float32).uniform_()
    dst = torch.empty_like(src)

    def best(fn) -> float:
        times = []
        for _ in range(7):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return min(times)

    return nbytes / best(src.sum) / 1e9, nbytes / best(lambda: dst.copy_(src)) / 1e9


def hf_decode_ms(path: Path, prompt: list[int], steps: int) -> float:
    """Median per-token time of transformers' own generate (timestamps from a stopping criterion)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    stamps: list[float] = []

    class Stamp(transformers.StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            stamps.append(time.perf_counter())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    ids = torch.tensor([prompt])
    kwargs = dict(do_sample=False, min_new_tokens=steps + 1, max_new_tokens=steps + 1, pad_token_id=0)
    with torch.no_grad():
        model.generate(ids, **kwargs)  # warm-up
        stamps.clear()
        model.generate(ids, stopping_criteria=transformers.StoppingCriteriaList([Stamp()]), **kwargs)
    deltas = [(b - a) * 1e3 for a, b in itertools.pairwise(stamps)]
    del model
    return statistics.median(deltas)


def our_decode(
    recipe: str, path: Path, exe_mode: str, plan: str | None, prompt: list[int], steps: int
) -> tuple[float, float, list[int]]:
    overrides = [
        f"model_config.model_path={path}",
        "model_config.with_ckpt=true",
        f"model_config.exe_mode={exe_mode}",
        "model_config.enable_cache_compile=false",  # every mode compiles cold, so compile_s compares
        f"model_config.enable_superkernel={'true' if plan else 'false'}",
        f"scheduler_config.max_new_tokens={steps + 1}",
        f"data_config.input_truncated_len={PROMPT_LEN}",
        f"model_config.tokenizer_path={BUILTIN_TOKENIZER}",
    ]  # ids are given; text is not used
    if plan:
        overrides.append(f"model_config.superkernel.plan={plan}")
    cfg = load_config(default_config(recipe), overrides)
    runner = runner_class(recipe)(cfg, detect("cpu"), None)
    t0 = time.perf_counter()
    runner.generate([prompt], 2)  # warm-up + compile
    compile_s = time.perf_counter() - t0
    runner.generate([prompt], steps + 1)  # warm caches
    gen = runner.generate([prompt], steps + 1)
    return statistics.median(gen.decode_ms), compile_s, gen.token_ids[0]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen", help="recipe under models/ (qwen, qwen3_moe)")
    p.add_argument("--size", default="bench-overhead", help="named size in configs/model_sizes.yaml")
    p.add_argument("--steps", type=int, default=64, help="decode steps timed per mode (>= 50 recommended)")
    p.add_argument("--plans", default="all", help="comma list of SuperKernel plans, 'all' or 'none'")
    p.add_argument("--no-hf", action="store_true", help="skip the transformers peer")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default)")
    p.add_argument(
        "--layers", type=int, default=0, help="override num_hidden_layers (shrink a big shape to fit memory)"
    )
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cfg = dict(yaml.safe_load(MODEL_SIZES.read_text())[args.size])
    if args.layers:
        cfg["num_hidden_layers"] = args.layers
    arch = arch_from_dict(cfg, args.size)
    prompt = [(7 * i + 3) % arch.vocab_size for i in range(PROMPT_LEN)]
    platform = detect("cpu")
    print(
        f"# decode_bench: recipe {args.model}, size {args.size} ({arch.num_layers} layers), "
        f"{args.steps} steps, batch 1, fp32, "
        f"{platform.describe()}, torch {torch.__version__}, {torch.get_num_threads()} threads",
        flush=True,
    )
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "ckpt"
        make_checkpoint(cfg, path, seed=0)
        if not args.no_hf:
            rows.append(("transformers eager generate", hf_decode_ms(path, prompt, args.steps), None, None))
            print(f"  measured {rows[-1][0]}", flush=True)
        plans = {"all": ["attention", "moe" if arch.num_experts else "mlp", "layer", "decoder"], "none": []}.get(
            args.plans, [x for x in args.plans.split(",") if x]
        )
        modes = [("eager", None), ("ge_graph", None)] + [("ge_graph", pl) for pl in plans]
        tokens_ref = None
        for exe_mode, plan in modes:
            ms, compile_s, tokens = our_decode(args.model, path, exe_mode, plan, prompt, args.steps)
            name = f"ours {exe_mode}" + (f" + SK {plan}" if plan else "")
            tokens_ref = tokens_ref or tokens
            same = "same tokens" if tokens == tokens_ref else "TOKENS DIFFER FROM EAGER"
            rows.append((name, ms, compile_s if exe_mode != "eager" else None, same))
            print(f"  measured {name} ({same})", flush=True)
    graph_ms = next(ms for name, ms, _, _ in rows if name == "ours ge_graph")
    read_bw, copy_bw = memory_bandwidth_gbs()
    weight_bytes = arch.weight_bytes(4)
    floor_ms = weight_bytes / (read_bw * 1e9) * 1e3
    print()
    print("| mode | decode ms/step (median) | tokens/s | vs ge_graph | x floor | compile s | check |")
    print("|---|---|---|---|---|---|---|")
    for name, ms, compile_s, same in rows:
        print(
            f"| {name} | {ms:.3f} | {1e3 / ms:.1f} | {graph_ms / ms:.2f}x | {ms / floor_ms:.2f} | "
            f"{'' if compile_s is None else f'{compile_s:.1f}'} | {same or ''} |"
        )
    print(
        f"\nweights read per step: {weight_bytes / 1e6:.1f} MB fp32; read bandwidth {read_bw:.1f} GB/s "
        f"-> bandwidth floor {floor_ms:.3f} ms/step (copy rate {copy_bw:.1f} GB/s copied, "
        f"weight bytes / copy rate = {weight_bytes / (copy_bw * 1e9) * 1e3:.3f} ms)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
