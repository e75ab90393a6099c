"""Decode benchmark: HF transformers eager generate (the peer) vs our eager, ge_graph and
ge_graph + SuperKernel for every plan, in one process, on the same checkpoint.

Why one process and one checkpoint: the comparison must differ only in execution mode.
A random-weight checkpoint of a named size (configs/model_sizes.yaml) is written with
transformers' save_pretrained, then loaded by both sides. Prints a table (median decode
ms/step over >= --steps steps after warm-up, tokens/s, ratio to ge_graph, compile seconds)
and the bandwidth floor: weight bytes / measured read bandwidth (copy rate printed too).

With --world-size N > 1 the same modes run on N ranks (torchrun, executor.parallel.launch;
layout `tp`: attention, MLP and lm_head tensor parallel over all ranks, MoE experts split
by moe TP; `dp-ep`: attention data parallel, experts split by expert parallel), without the
transformers peer, and the table adds the collectives of one decode step and their share of
it: each collective the step issues is timed alone (same op, group and size, both ranks
ready, median of 200), summed, and divided by the step time.

  python benchmarks/decode_bench.py --size bench-overhead
  python benchmarks/decode_bench.py --size qwen3-0.6b --plans decoder --steps 50
  python benchmarks/decode_bench.py --model qwen3_moe --size moe-debugmodel
  python benchmarks/decode_bench.py --size bench-overhead --world-size 2 --plans decoder
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
from executor.parallel import launch, runtime  # noqa: E402
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


LAYOUTS = {  # --layout -> parallel_config for N ranks
    "tp": lambda n: [f"attn_tp_size={n}", f"moe_tp_size={n}", f"lmhead_tp_size={n}"],
    "dp-ep": lambda n: ["attn_tp_size=1", "moe_tp_size=1"],
}


def our_decode(
    recipe: str,
    path: Path,
    exe_mode: str,
    plan: str | None,
    prompt: list[int],
    steps: int,
    parallel: list[str] = (),
) -> tuple[float, float, list[int], list[tuple[str, str, int]]]:
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
    overrides += [f"parallel_config.{p}" for p in parallel]
    if "attn_tp_size=1" in parallel:  # attention data parallel: one row per rank
        overrides.append(f"scheduler_config.batch_size={parallel[0].split('=')[1]}")
    cfg = load_config(default_config(recipe), overrides)
    runner = runner_class(recipe)(cfg, detect("cpu"), None)
    rows = [prompt] * cfg.scheduler_config.batch_size  # one row per attention data parallel group
    t0 = time.perf_counter()
    runner.generate(rows, 2)  # warm-up + compile
    compile_s = time.perf_counter() - t0
    runner.generate(rows, steps + 1)  # warm caches
    gen = runner.generate(rows, steps + 1)
    calls = list(runner.parallel.log.calls)  # the collectives of one decode step
    return statistics.median(gen.decode_ms), compile_s, gen.token_ids[0], calls


def collective_ms(calls: list[tuple[str, str, int]], iters: int = 200) -> float:
    """Sum over a step's collectives of each one's median time, run alone (eager funcol)."""
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    total = 0.0
    for op, group, nbytes in calls:
        size = dist.get_world_size(dist.distributed_c10d._resolve_process_group(group))
        if op == "all_reduce":
            x = torch.zeros(nbytes // 4)
            run = lambda x=x, group=group: funcol.wait_tensor(funcol.all_reduce(x, "sum", group))  # noqa: E731
        else:  # all_gather: bytes are the gathered output's
            x = torch.zeros(nbytes // 4 // size)
            run = lambda x=x, group=group: funcol.wait_tensor(funcol.all_gather_single(x, 0, group))  # noqa: E731
        for _ in range(10):
            run()
        dist.barrier()
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            run()
            times.append(time.perf_counter() - t0)
        total += statistics.median(times) * 1e3
    return total


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
    p.add_argument("--world-size", type=int, default=1, help="ranks (torchrun); > 1 skips the transformers peer")
    p.add_argument("--layout", choices=list(LAYOUTS), default="tp", help="with --world-size > 1 (default: tp)")
    p.add_argument("--checkpoint", help=argparse.SUPPRESS)  # set by the launching process for its ranks
    p.add_argument("--log-dir", help=argparse.SUPPRESS)
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
    if args.world_size > 1:
        return bench_ranks(args, list(sys.argv[1:] if argv is None else argv), cfg, arch, prompt, platform)
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
        modes = [("eager", None), ("ge_graph", None)] + [("ge_graph", pl) for pl in _plans(args, arch)]
        tokens_ref = None
        for exe_mode, plan in modes:
            ms, compile_s, tokens, _ = our_decode(args.model, path, exe_mode, plan, prompt, args.steps)
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


def _plans(args, arch) -> list[str]:
    return {"all": ["attention", "moe" if arch.num_experts else "mlp", "layer", "decoder"], "none": []}.get(
        args.plans, [x for x in args.plans.split(",") if x]
    )


def bench_ranks(args, argv: list[str], cfg: dict, arch, prompt: list[int], platform) -> int:
    """--world-size N: here, write the checkpoint and start N ranks running this script; in a
    rank, time every mode (each rank holds its share of the weights) and let rank 0 print."""
    if not runtime.under_torchrun():
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "ckpt"
            make_checkpoint(cfg, path, seed=0)
            extra = ["--checkpoint", str(path), "--log-dir", tmp]
            plan = launch.plan(args.world_size, "", platform, "benchmarks.decode_bench", [*argv, *extra])
            return launch.launch(plan, Path(tmp))
    console = runtime.redirect_to_rank_log(Path(args.log_dir))
    n = args.world_size
    parallel = [f"world_size={n}", *LAYOUTS[args.layout](n)]
    batch = n if args.layout == "dp-ep" else 1  # one row per attention data parallel group

    def say(text: str) -> None:
        if console is not None:
            print(text, file=console, flush=True)

    say(
        f"# decode_bench: recipe {args.model}, size {args.size} ({arch.num_layers} layers), {args.steps} steps, "
        f"{n} ranks ({args.layout}: {', '.join(parallel[1:])}), batch {batch}, fp32, {platform.describe()}, "
        f"torch {torch.__version__}, {torch.get_num_threads()} thread(s) per rank"
    )
    rows, tokens_ref = [], None
    modes = [("eager", None), ("ge_graph", None)] + [("ge_graph", pl) for pl in _plans(args, arch)]
    for exe_mode, plan in modes:
        ms, compile_s, tokens, calls = our_decode(
            args.model, Path(args.checkpoint), exe_mode, plan, prompt, args.steps, parallel
        )
        coll = collective_ms(calls)
        name = f"ours {exe_mode}" + (f" + SK {plan}" if plan else "")
        tokens_ref = tokens_ref or tokens
        same = "same tokens" if tokens == tokens_ref else "TOKENS DIFFER FROM EAGER"
        rows.append((name, ms, compile_s if exe_mode != "eager" else None, same, len(calls), coll))
        say(f"  measured {name} ({same})")
    graph_ms = next(row[1] for row in rows if row[0] == "ours ge_graph")
    say("")
    say("| mode | decode ms/step (median) | tokens/s | vs ge_graph | collectives/step | collectives alone ms/step "
        "| share of step | compile s | check |")  # fmt: skip
    say("|---|---|---|---|---|---|---|---|---|")
    for name, ms, compile_s, same, count, coll in rows:
        say(
            f"| {name} | {ms:.3f} | {batch * 1e3 / ms:.1f} | {graph_ms / ms:.2f}x | {count} | {coll:.3f} | "
            f"{coll / ms:.0%} | {'' if compile_s is None else f'{compile_s:.1f}'} | {same} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
