"""Decode benchmark: transformers (eager generate, and static cache + torch.compile) vs our
eager, ge_graph and ge_graph + SuperKernel for every plan, in one process, on the same checkpoint.

Why one process and one checkpoint: the comparison must differ only in execution mode.
A random-weight checkpoint of a named size (configs/model_sizes.yaml) is written with
transformers' save_pretrained, then loaded by every side in --dtype. For every --batch it prints
a table (median decode ms/step over --steps steps after warm-up, tokens/s, ratio to ge_graph,
ratio to the roofline, ratios to both transformers peers, compile seconds, greedy tokens against
our eager run) and the roofline terms it used:

  roofline = max(bytes read per step / measured read bandwidth, FLOPs per step / measured matmul rate)

Our modes take turns: all are built first, then timed over --rounds calls each, mode after mode
within every round, and the ratio to ge_graph is the median of the per-round ratios (with their
range). Timed once each in sequence, five readings of SK decoder / ge_graph at bench-overhead ran
0.89-1.44 on the reference VM, whose speed moves by 1.5x within a minute (BENCHMARKS.md,
"thirty-seventh pass"). Holding every mode at once costs memory, so by default a size whose modes
would not fit runs one round, each mode built, timed and freed in turn (the header says which).
The transformers peers run after ours, one call each.

The read bandwidth is measured again right before and right after each mode's timed steps (with
rounds: before the first round and after each), and that mode's roofline uses their mean (column
"read GB/s"): the reference VM's bandwidth moved by 1.5x within minutes, so one reading at the
start made later modes look better or worse than they were. A mode whose readings differ by more
than 15% is flagged: the machine changed
speed while it ran, so its ratio is no verdict. Each reading is the median of 7 full reductions,
as the step time is the median of the steps: the VM's bandwidth comes in bursts of a few
seconds, and a best-of-7 reading caught one (18.5 ms where its median was 34.3, for the 0.6B
weights' bytes) while the steps around it ran at the slow rate, so ratios against it measured
the VM, not the step (BENCHMARKS.md, "twelfth pass"). The machine line prints the best as well.
The matmul rate is taken next to every mode too (column "TFLOP/s", best of 7 products each side)
and flags the mode the same way: on a slow minute of the VM the start's best-of-20 once read 0.14
fp32 TFLOP/s where minutes before and after it read 0.23, and every compute-bound mode of that
run then "beat" its roofline (0.79x; BENCHMARKS.md, "fifteenth pass").

bytes = weights (MoE: the router and the experts a batch is expected to touch) + the KV cache
that is valid at the timed positions; FLOPs = 2 x parameters used per token x batch + attention.
Both rates are measured by this script on this machine, in --dtype.

With --world-size N > 1 the same modes run on N ranks (torchrun, executor.parallel.launch;
layout `tp`: attention, MLP and lm_head tensor parallel over all ranks, MoE experts split
by moe TP; `dp-ep`: attention data parallel, experts split by expert parallel), without the
transformers peers, and the table adds the collectives of one decode step and their share of
it: each collective the step issues is timed alone (same op, group and size, both ranks
ready, median of 200), summed, and divided by the step time.

  python benchmarks/decode_bench.py --size bench-overhead --rounds 9
  python benchmarks/decode_bench.py --size bench-overhead --world-size 2 --plans decoder
  python benchmarks/decode_bench.py --size qwen3-0.6b --plans decoder --dtype bfloat16 --batch 1,4,16,64 --plot b.png
  python benchmarks/decode_bench.py --size qwen3-0.6b --plans decoder --prompt-len 2048 --max-len 16384
  python benchmarks/decode_bench.py --model qwen3_moe --size moe-debugmodel
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.cli import guarded, int_list, json_path, paired, round_ratios, write_json  # noqa: E402
from executor.arch import ModelArch, arch_from_dict, named_size  # noqa: E402
from executor.backends import eager_linear, packed_linear  # noqa: E402
from executor.config import load_config  # noqa: E402
from executor.memory import forget_runners  # noqa: E402
from executor.parallel import launch, runtime  # noqa: E402
from executor.platform import Platform, detect, timer  # noqa: E402
from executor.registry import default_config, runner_class  # noqa: E402
from executor.tokenizer import BUILTIN_TOKENIZER  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass
class Row:
    name: str
    ms: float  # median decode ms/step
    compile_s: float | None
    tokens: list[list[int]]  # greedy tokens per row
    calls: list = field(default_factory=list)  # with several ranks: the collectives of one decode step
    read_gbs: tuple[float, ...] = ()  # read bandwidth right before and right after the timed steps (or rounds)
    tflops: tuple[float, ...] = ()  # matmul rate right before and right after the timed steps (or rounds)
    roof_ms: float = 0.0  # this mode's roofline (set when its batch's table is made)
    round_ms: tuple[float, ...] = ()  # with --rounds > 1: the median step of each round (the modes took turns)

    def roofline_ms(self, nbytes: float, flops: float, read_gbs: float, tflops: float) -> float:
        """This mode's roofline: against the mean of its own readings of each rate, else the defaults."""
        bw = statistics.fmean(self.read_gbs) if self.read_gbs else read_gbs
        rate = statistics.fmean(self.tflops) if self.tflops else tflops
        return max(nbytes / (bw * 1e9), flops / (rate * 1e12)) * 1e3

    def unsteady(self) -> bool:
        """The machine's read bandwidth or matmul rate moved by more than 15% while this mode's steps
        were timed."""
        return moved(self.read_gbs) or moved(self.tflops)


def moved(readings: tuple[float, ...]) -> bool:
    """Readings (before/after a mode, or between rounds) of which two are more than 15% apart."""
    return len(readings) >= 2 and max(readings) > 1.15 * min(readings)


def readings(values: tuple[float, ...], digits: int) -> str:
    """A cell of readings: before/after, or with rounds their range and count; flagged when two
    differ by more than 15%."""
    if len(values) > 2:
        cell = f"{min(values):.{digits}f}-{max(values):.{digits}f} ({len(values)})"
    else:
        cell = "/".join(f"{v:.{digits}f}" for v in values)
    return cell + (" UNSTEADY" if moved(values) else "")


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


def read_bandwidth_gbs(platform: Platform, nbytes: int = 1 << 29) -> float:
    """Read bandwidth in GB/s: the median of 7 full reductions over a tensor far larger than the
    caches (~0.3 s for the default 512 MiB at ~30 GB/s), cheap enough to take next to every mode;
    the median, the statistic the step times use (module docstring)."""
    return _read_gbs(platform, nbytes)[0]


def _read_gbs(platform: Platform, nbytes: int) -> tuple[float, float]:
    """(median, best) read bandwidth in GB/s over 7 full reductions."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=platform.kind).uniform_()
    times = _times(platform, src.sum, 7)
    return nbytes / statistics.median(times) / 1e9, nbytes / min(times) / 1e9


def memory_bandwidth_gbs(platform: Platform, nbytes: int = 1 << 29) -> tuple[float, float, float]:
    """(read, best read, copy) bandwidth in GB/s on a tensor far larger than the caches; read is
    the median of 7 (read_bandwidth_gbs), the others the best of 7.

    read: a full reduction over the tensor, the traffic pattern of a decode step (weights are
    only read). copy: bytes copied per second (dst.copy_(src)). A decode step cannot beat
    weight bytes / read bandwidth; the copy rate is printed for reference (it moves each byte
    twice, so weight bytes / copy rate is not a floor).
    """
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=platform.kind).uniform_()
    dst = torch.empty_like(src)
    copy = nbytes / _best(platform, lambda: dst.copy_(src), 7) / 1e9
    return (*_read_gbs(platform, nbytes), copy)


def _times(platform: Platform, fn, runs: int) -> list[float]:
    """`runs` timed calls after one warm-up, waiting for the device around each."""
    now = timer(platform)
    fn()
    times = []
    for _ in range(runs):
        t0 = now()
        fn()
        times.append(now() - t0)
    return times


def _best(platform: Platform, fn, runs: int) -> float:
    """Shortest of `runs` timed calls after one warm-up."""
    return min(_times(platform, fn, runs))


def matmul_tflops(platform: Platform, dtype: torch.dtype, n: int = 1536, runs: int = 20) -> float:
    """Dense matmul rate in TFLOP/s for `dtype` (an n x n x n product, best of `runs` per library):
    the compute side of the roofline, what a large-batch or prefill step can at best reach on this
    machine. Best of 20 at the start, not 5: on the shared reference VM five calls (~0.15 s) once
    read 0.11 TFLOP/s in fp32, below what the same run's batch-64 decode step reached (0.14). The
    readings next to each mode take 7 (`Probe`)."""
    if platform.kind != "cpu":
        n = 8192  # an accelerator needs a large product to reach its rate
    a, b = (torch.randn(n, n, device=platform.kind).to(dtype) for _ in range(2))
    products = [lambda: a @ b]
    if platform.kind == "cpu" and eager_linear.rows_run_plain(dtype):
        # the rows kernel on the weight as stored, what the eager path's products of many rows run:
        # in bf16 on an AVX2 host alone, as oneDNN would emulate it there (aten's product ran at
        # 0.8 GFLOP/s, ~9 s a call, the kernel at 150; BENCHMARKS.md, "nineteenth pass"); elsewhere
        # next to the libraries below (the faster counts)
        weight = b.t().contiguous()
        rows = lambda: torch.ops.cann_cpu.rows_linear(a, weight, None)  # noqa: E731
        emulated = dtype == torch.bfloat16 and not packed_linear.supported(dtype)
        products = [rows] if emulated else [*products, rows]
    if platform.kind == "cpu" and packed_linear.supported(dtype):  # never where bf16 is emulated
        # The fastest of the CPU's libraries: aten's fp32 product is MKL's sgemm, which ran at
        # 0.13 TFLOP/s on the AMD reference machine where oneDNN ran the same product at 0.21
        # (what the runner's prefill and batched decode use); a roofline on the slower one flatters.
        packed = torch.ops.mkldnn._reorder_linear_weight(b.t().contiguous(), n)
        products.append(lambda: torch.ops.mkldnn._linear_pointwise(a, packed, None, "none", [], ""))
    return max(2 * n**3 / _best(platform, fn, runs) / 1e12 for fn in products)  # the warm-up creates oneDNN's primitive


@dataclass
class Probe:
    """Both roofline rates, read right before and right after one mode's timed steps (~1 s each side
    in fp32): (read GB/s, matmul TFLOP/s)."""

    platform: Platform
    dtype: torch.dtype

    def __call__(self) -> tuple[float, float]:
        return read_bandwidth_gbs(self.platform), matmul_tflops(self.platform, self.dtype, runs=7)


def step_cost(arch: ModelArch, dtype_bytes: int, batch: int, context: int) -> tuple[float, float]:
    """(bytes read, FLOPs) of one decode step at `context` valid cached tokens per row."""
    weights = arch.weight_bytes(dtype_bytes)
    params_per_token = arch.weight_bytes(1)
    if arch.num_experts:  # a batch touches the union of its rows' experts, not k per row
        e, k = arch.num_experts, arch.num_experts_per_tok
        weights += more_experts_bytes(arch, dtype_bytes, e * (1 - (1 - k / e) ** batch) - k)
    kv = batch * context * arch.num_layers * 2 * arch.num_kv_heads * arch.head_dim * dtype_bytes
    attn_flops = batch * arch.num_layers * 4 * arch.num_heads * arch.head_dim * context
    return weights + kv, 2 * params_per_token * batch + attn_flops


def _stamps(platform: Platform):
    """A stopping criterion recording when each generated token is ready (never stops)."""
    import transformers

    class Stamp(transformers.StoppingCriteria):
        times: list[float] = []

        def __call__(self, input_ids, scores, **kwargs):
            self.times.append(self.now())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    Stamp.times, Stamp.now = [], staticmethod(timer(platform))
    return Stamp()


def hf_decode(
    path: Path, prompts: list[list[int]], steps: int, dtype: torch.dtype, compiled: bool, device: str = "cpu",
    probe: Probe | None = None,
) -> Row:  # fmt: skip
    """transformers' own generate: eager with its default (dynamic) cache, or what a user tries
    first for graph-mode decode: the static cache with the forward under torch.compile. Median
    per-token time from the stopping criterion's timestamps."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval().to(device)
    ids = torch.tensor(prompts, device=device)
    kwargs = dict(do_sample=False, min_new_tokens=steps + 1, max_new_tokens=steps + 1, pad_token_id=0)
    if compiled:
        cc = transformers.CompileConfig(fullgraph=True, mode="default")
        cc._compile_all_devices = True  # transformers compiles only on accelerators unless told
        kwargs |= dict(cache_implementation="static", compile_config=cc)
    with torch.no_grad():
        t0 = time.perf_counter()
        model.generate(ids, **kwargs)  # warm-up (and compile)
        compile_s = time.perf_counter() - t0 if compiled else None
        if compiled:
            model.generate(ids, **kwargs)  # a second call: any recompile for the new cache happens here
        stamp = _stamps(detect(device))
        before = probe() if probe else None
        out = model.generate(ids, stopping_criteria=transformers.StoppingCriteriaList([stamp]), **kwargs)
        rates = tuple(zip(before, probe())) if probe else ((), ())
    deltas = [(b - a) * 1e3 for a, b in itertools.pairwise(stamp.times)]
    tokens = out[:, ids.shape[1] :].tolist()
    del model
    forget_runners()
    name = "transformers static cache + torch.compile" if compiled else "transformers eager generate"
    return Row(name, statistics.median(deltas), compile_s, tokens, read_gbs=rates[0], tflops=rates[1])


LAYOUTS = {  # --layout -> parallel_config for N ranks
    "tp": lambda n: [f"attn_tp_size={n}", f"moe_tp_size={n}", f"lmhead_tp_size={n}"],
    "dp-ep": lambda n: ["attn_tp_size=1", "moe_tp_size=1"],
}


@dataclass
class Built:
    """One of our modes, compiled and warm, ready for timed calls."""

    name: str
    runner: object
    compile_s: float | None  # the first call (Dynamo + Inductor, cold); None for eager


def build_ours(
    recipe: str, path: Path, exe_mode: str, plan: str | None, prompts: list[list[int]], steps: int, dtype: str,
    max_len: int, parallel: list[str] = (), platform: Platform | None = None,
) -> Built:  # fmt: skip
    overrides = [
        f"model_config.model_path={path}",
        "model_config.with_ckpt=true",
        f"model_config.exe_mode={exe_mode}",
        f"model_config.dtype={dtype}",
        f"model_config.device={platform.kind if platform else 'cpu'}",
        "model_config.enable_cache_compile=false",  # every mode compiles cold, so compile_s compares
        f"model_config.enable_superkernel={'true' if plan else 'false'}",
        f"scheduler_config.batch_size={len(prompts)}",
        f"scheduler_config.max_new_tokens={steps + 1}",
        f"data_config.input_truncated_len={max_len - steps - 1}",
        f"model_config.tokenizer_path={BUILTIN_TOKENIZER}",
    ]  # ids are given; text is not used
    if plan:
        overrides.append(f"model_config.superkernel.plan={plan}")
    overrides += [f"parallel_config.{p}" for p in parallel]
    cfg = load_config(default_config(recipe), overrides)
    runner = runner_class(recipe)(cfg, platform or detect("cpu"), None)
    t0 = time.perf_counter()
    runner.generate(prompts, 2)  # warm-up + compile
    compile_s = time.perf_counter() - t0
    runner.generate(prompts, steps + 1)  # warm caches
    name = f"ours {exe_mode}" + (f" + SK {plan}" if plan else "")
    return Built(name, runner, None if exe_mode == "eager" else compile_s)


def timed(built: Built, prompts: list[list[int]], steps: int):
    """One timed generate call (its Generation), noting steps the thread governor ran on fewer threads."""
    gen = built.runner.generate(prompts, steps + 1)
    threads = built.runner.threads
    # the host was busy: say so (not where a tiny step runs on one thread by design)
    if not threads.pinned and (fewer := sum(n < threads.full for n in gen.decode_threads)):
        said = f"{fewer} of {steps} timed steps ran on fewer intra-op threads (executor/threads.py)"
        print(f"  note: {built.name}: {said}")
    return gen


def our_decode(
    recipe: str, path: Path, exe_mode: str, plan: str | None, prompts: list[list[int]], steps: int, dtype: str,
    max_len: int, parallel: list[str] = (), platform: Platform | None = None, probe: Probe | None = None,
) -> Row:  # fmt: skip
    """One mode alone: build it, time one call between two readings of the rates, free it."""
    built = build_ours(recipe, path, exe_mode, plan, prompts, steps, dtype, max_len, parallel, platform)
    before = probe() if probe else None
    gen = timed(built, prompts, steps)
    rates = tuple(zip(before, probe())) if probe else ((), ())
    calls = list(built.runner.parallel.log.calls)  # the collectives of one decode step
    row = Row(built.name, statistics.median(gen.decode_ms), built.compile_s, gen.token_ids, calls, *rates)
    del built
    forget_runners()
    return row


def our_rounds(
    recipe: str, path: Path, specs: list[tuple[str, str | None]], prompts: list[list[int]], steps: int, dtype: str,
    max_len: int, rounds: int, platform: Platform, probe: Probe,
) -> list[Row]:  # fmt: skip
    """Every mode of `specs` built first, then timed in turns: `rounds` rounds of one call per mode,
    the rates read before the first round and after each (why turns: the module docstring). A row's
    step time is the median over all its rounds' steps; its ratio to ge_graph is taken per round
    (vs_graph)."""
    built = []
    for exe_mode, plan in specs:
        built.append(build_ours(recipe, path, exe_mode, plan, prompts, steps, dtype, max_len, platform=platform))
        print(f"  built {built[-1].name}", flush=True)
    gens = {b.name: [] for b in built}
    rates = [probe()]
    for _ in range(rounds):
        for b in built:
            gens[b.name].append(timed(b, prompts, steps))
        rates.append(probe())
    read_gbs, tflops = tuple(r[0] for r in rates), tuple(r[1] for r in rates)
    rows = []
    for b in built:
        runs = gens[b.name]
        ms = statistics.median([t for gen in runs for t in gen.decode_ms])
        # greedy tokens: a round whose tokens depart from the first round's is the one shown (and checked)
        tokens = next((g.token_ids for g in runs if g.token_ids != runs[0].token_ids), runs[0].token_ids)
        round_ms = tuple(statistics.median(g.decode_ms) for g in runs)
        rows.append(Row(b.name, ms, b.compile_s, tokens, [], read_gbs, tflops, round_ms=round_ms))
    built.clear()
    forget_runners()
    return rows


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


def token_check(tokens: list[list[int]], ref: list[list[int]]) -> str:
    """Whether greedy tokens equal our eager run's, else the first step where a row departs."""
    if tokens == ref:
        return "same tokens"
    first = min(next((i for i, (a, b) in enumerate(zip(r, t)) if a != b), len(r)) for r, t in zip(ref, tokens))
    return f"differs from step {first}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen", help="recipe under models/ (qwen, qwen3_moe)")
    p.add_argument("--size", default="bench-overhead", help="named size in configs/model_sizes.yaml")
    p.add_argument("--steps", type=int, default=64, help="decode steps per timed call (>= 50 recommended)")
    p.add_argument(
        "--rounds", type=int, help="timed calls per mode, the modes taking turns (all held in memory at once); "
        "default 3 where they fit in memory, else 1: each mode built, timed once and freed in turn"
    )  # fmt: skip
    p.add_argument("--plans", default="all", help="comma list of SuperKernel plans, 'all' or 'none'")
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES), help="every side's dtype (default float32)")
    p.add_argument("--batch", type=int_list, default="1", help="batch size or a comma list (a table each): 1,4,16")
    p.add_argument("--prompt-len", type=int, default=16, help="prompt tokens per row: the cached context")
    p.add_argument("--max-len", type=int, help="static KV-cache slots (default: prompt + generated tokens)")
    p.add_argument("--no-hf", action="store_true", help="skip both transformers peers")
    p.add_argument("--no-compiled-peer", action="store_true", help="skip transformers static cache + torch.compile")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where every side runs (default cpu)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default)")
    p.add_argument("--plot", help="PNG: tokens/s per batch and mode, and each mode's x roofline")
    p.add_argument(
        "--json", type=json_path, help="also write every table as JSON here, after each batch (benchmarks/targets.py)"
    )
    p.add_argument("--world-size", type=int, default=1, help="ranks (torchrun); > 1 skips the transformers peers")
    p.add_argument("--layout", choices=list(LAYOUTS), default="tp", help="with --world-size > 1 (default: tp)")
    p.add_argument("--checkpoint", help=argparse.SUPPRESS)  # set by the launching process for its ranks
    p.add_argument("--log-dir", help=argparse.SUPPRESS)
    p.add_argument(
        "--layers", type=int, default=0, help="override num_hidden_layers (shrink a big shape to fit memory)"
    )
    args = p.parse_args(argv)
    batches = args.batch
    max_len = args.max_len or args.prompt_len + args.steps + 1
    if args.steps < 2 or max_len < args.prompt_len + args.steps + 1:
        p.error("--steps >= 2 and --max-len >= --prompt-len + --steps + 1")
    if args.rounds is not None and args.rounds < 1:
        p.error(f"--rounds: expected a positive integer, got {args.rounds}")
    if args.json and args.world_size > 1:
        p.error("--json: the tables of one rank only (--world-size 1)")
    if args.device != "cpu" and args.world_size > 1:
        p.error("--device cuda measures one device: use --world-size 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cfg = named_size(args.size, "--size")
    default_config(args.model)  # an unknown recipe is refused before a checkpoint is written
    if args.layers:
        cfg["num_hidden_layers"] = args.layers
    arch = arch_from_dict(cfg, args.size)
    dtype, dtype_bytes = DTYPES[args.dtype], DTYPES[args.dtype].itemsize
    platform = detect(args.device)
    if args.world_size > 1:
        return bench_ranks(args, list(sys.argv[1:] if argv is None else argv), cfg, arch, platform, max_len)
    plans = _plans(args, arch)
    specs = [("eager", None), ("ge_graph", None)] + [("ge_graph", pl) for pl in plans]
    rounds, why = choose_rounds(args.rounds, arch, dtype_bytes, len(specs), platform)
    if rounds is None:
        p.error(why)
    print(
        f"# decode_bench: recipe {args.model}, size {args.size} ({arch.num_layers} layers), {args.steps} steps, "
        f"batch {','.join(map(str, batches))}, {args.dtype}, prompt {args.prompt_len} tokens, max_len {max_len}, "
        f"{platform.describe()}, torch {torch.__version__}, {torch.get_num_threads()} threads\n# {why}",
        flush=True,
    )
    read_bw, best_bw, copy_bw = memory_bandwidth_gbs(platform)
    tflops = matmul_tflops(platform, dtype)
    print(
        f"# machine: read bandwidth {read_bw:.1f} GB/s (median of 7; best {best_bw:.1f}, copy {copy_bw:.1f} GB/s), "
        f"{args.dtype} matmul {tflops:.2f} TFLOP/s",
        flush=True,
    )
    probe = Probe(platform, dtype)
    ours = partial(our_decode, platform=platform, probe=probe)
    record = {"bench": "decode_bench", "model": args.model, "size": args.size, "dtype": args.dtype}
    record |= {"platform": platform.describe(), "read_gbs": read_bw, "tflops": tflops, "batches": []}
    summary: dict[int, tuple[list[Row], float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "ckpt"
        make_checkpoint(cfg, path, seed=0)
        for batch in batches:
            prompts = [[(7 * i + 3 + 11 * r) % arch.vocab_size for i in range(args.prompt_len)] for r in range(batch)]
            if rounds > 1:
                rows = our_rounds(
                    args.model, path, specs, prompts, args.steps, args.dtype, max_len, rounds, platform, probe
                )
                print(f"  batch {batch}: measured our {len(rows)} modes in {rounds} rounds", flush=True)
            else:
                rows = []
                for exe_mode, plan in specs:
                    rows.append(ours(args.model, path, exe_mode, plan, prompts, args.steps, args.dtype, max_len))
                    print(f"  batch {batch}: measured {rows[-1].name}", flush=True)
            if not args.no_hf:
                for compiled in (False,) if args.no_compiled_peer else (False, True):
                    rows.append(hf_decode(path, prompts, args.steps, dtype, compiled, args.device, probe))
                    print(f"  batch {batch}: measured {rows[-1].name}", flush=True)
            # the timed steps see prompt_len + 1 ... prompt_len + steps valid cached tokens
            nbytes, flops = step_cost(arch, dtype_bytes, batch, args.prompt_len + args.steps // 2)
            bw_ms, compute_ms = nbytes / (read_bw * 1e9) * 1e3, flops / (tflops * 1e12) * 1e3
            roof_ms = max(bw_ms, compute_ms)
            for r in rows:  # each mode against the rates read next to its own steps
                r.roof_ms = r.roofline_ms(nbytes, flops, read_bw, tflops)
            summary[batch] = (rows, roof_ms)
            print_table(rows, batch)
            record["batches"].append({"batch": batch, "roof_ms": roof_ms, "rows": [row_record(r, rows) for r in rows]})
            write_json(args.json, record)
            print(
                f"\nroofline, batch {batch}: {nbytes / 1e6:.1f} MB read per step ({args.dtype} weights + valid KV) / "
                f"{read_bw:.1f} GB/s = {bw_ms:.3f} ms; {flops / 1e9:.2f} GFLOP / {tflops:.2f} TFLOP/s = "
                f"{compute_ms:.3f} ms -> {roof_ms:.3f} ms/step (the start's readings; each mode's uses its own) "
                f"({'bandwidth' if bw_ms >= compute_ms else 'compute'}-bound)\n",
                flush=True,
            )
    if len(batches) > 1:
        print_batch_summary(summary)
    if args.plot:
        plot(Path(args.plot), summary, f"{args.size}, {args.dtype}, {platform.describe()}")
        print(f"plot: {args.plot}")
    return 0


def choose_rounds(
    asked: int | None, arch: ModelArch, dtype_bytes: int, modes: int, platform: Platform
) -> tuple[int | None, str]:
    """(rounds, the header's line saying why), or (None, the one-line refusal) when --rounds > 1
    was asked for and every mode would not fit in memory at once. The estimate is generous: each
    compiled mode counted with a second (packed) copy of the weights, and the last mode's loading
    (the checkpoint read beside its weights) on top."""
    if asked == 1:
        return 1, "1 round: each mode built, timed once and freed in turn (--rounds 1)"
    from executor.memory import available, fmt_bytes

    one = resident_bytes(arch, dtype_bytes)
    need = one * (2 * modes - 1) + 2 * one
    free, source, _ = available(platform.kind)
    rounds = asked or 3
    if free is None or need <= 0.8 * free:
        room = f"about {fmt_bytes(need)} of {fmt_bytes(free)} available" if free else f"memory not checked: {source}"
        return rounds, f"{rounds} rounds: the {modes} modes of ours held at once and timed in turns ({room})"
    said = f"{modes} modes held at once need about {fmt_bytes(need)}, {fmt_bytes(free)} is available ({source})"
    if asked:
        return None, f"--rounds {asked}: {said}; use --rounds 1 (each mode alone, in turn) or fewer --plans"
    return 1, f"1 round: each mode built, timed once and freed in turn, as {said} (--rounds to choose)"


def resident_bytes(arch: ModelArch, dtype_bytes: int) -> float:
    """Bytes of one loaded model: weight_bytes (k experts per MoE layer) plus the others."""
    return arch.weight_bytes(dtype_bytes) + more_experts_bytes(
        arch, dtype_bytes, arch.num_experts - arch.num_experts_per_tok
    )


def more_experts_bytes(arch: ModelArch, dtype_bytes: int, experts: float) -> float:
    """Bytes of `experts` more experts in every MoE layer than the k of ModelArch.weight_bytes."""
    moe_layers = sum(arch.is_moe_layer(i) for i in range(arch.num_layers))
    return moe_layers * experts * 3 * arch.hidden_size * arch.moe_intermediate_size * dtype_bytes


def _plans(args, arch) -> list[str]:
    return {"all": ["attention", "moe" if arch.num_experts else "mlp", "layer", "decoder"], "none": []}.get(
        args.plans, [x for x in args.plans.split(",") if x]
    )


def bench_ranks(args, argv: list[str], cfg: dict, arch, platform, max_len: int) -> int:
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
    prompts = [[(7 * i + 3) % arch.vocab_size for i in range(args.prompt_len)]] * batch

    def say(text: str) -> None:
        if console is not None:
            print(text, file=console, flush=True)

    say(
        f"# decode_bench: recipe {args.model}, size {args.size} ({arch.num_layers} layers), {args.steps} steps, "
        f"{n} ranks ({args.layout}: {', '.join(parallel[1:])}), batch {batch}, {args.dtype}, {platform.describe()}, "
        f"torch {torch.__version__}, {torch.get_num_threads()} thread(s) per rank"
    )
    rows, tokens_ref = [], None
    modes = [("eager", None), ("ge_graph", None)] + [("ge_graph", pl) for pl in _plans(args, arch)]
    for exe_mode, plan in modes:
        row = our_decode(
            args.model, Path(args.checkpoint), exe_mode, plan, prompts, args.steps, args.dtype, max_len, parallel
        )
        ms, compile_s, tokens, calls = row.ms, row.compile_s, row.tokens, row.calls
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


def vs_graph(r: Row, graph: Row) -> str:
    """ge_graph's step over this mode's: per round when the two took turns ("median (min-max)"),
    else the ratio of the two medians."""
    if r.round_ms and graph.round_ms:
        return paired(list(graph.round_ms), list(r.round_ms)).replace(" (", "x (", 1)
    return f"{graph.ms / r.ms:.2f}x"


def row_record(r: Row, rows: list[Row]) -> dict:
    """One table row for --json: the numbers print_table formats (ratios as "the other's ms over
    this row's", so above 1 is this row faster)."""
    graph = next(g for g in rows if g.name == "ours ge_graph")
    if r.round_ms and graph.round_ms:  # as vs_graph: per round where the two took turns
        vs_ge = statistics.median(round_ratios(list(graph.round_ms), list(r.round_ms)))
    else:
        vs_ge = graph.ms / r.ms
    return {
        "name": r.name, "ms": r.ms, "x_roofline": r.ms / r.roof_ms, "unsteady": r.unsteady(),
        "vs_ge_graph": vs_ge,
        "vs_peers": {p.name: p.ms / r.ms for p in rows if p.name.startswith("transformers")},
        "compile_s": r.compile_s, "tokens": token_check(r.tokens, rows[0].tokens),
    }  # fmt: skip


def print_table(rows: list[Row], batch: int) -> None:
    graph = next(r for r in rows if r.name == "ours ge_graph")
    peers = {r.name: r.ms for r in rows if r.name.startswith("transformers")}
    ref = rows[0].tokens  # ours eager
    rounds = len(graph.round_ms)
    head = ["mode", "decode ms/step (median)", "tokens/s"]
    head += [f"vs ge_graph (per round: median (range) of {rounds})" if rounds else "vs ge_graph", "x roofline"]
    head += [f"read GB/s ({'range between rounds' if rounds else 'before/after'})"]
    head += [f"TFLOP/s ({'range between rounds' if rounds else 'before/after'})"]
    head += [f"vs {n}" for n in peers] + ["compile s", "greedy tokens vs ours eager"]
    print(f"\n### batch {batch}\n\n| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for r in rows:
        ratio = f"{r.ms / r.roof_ms:.2f}"
        cells = [r.name, f"{r.ms:.3f}", f"{batch * 1e3 / r.ms:.1f}", vs_graph(r, graph), ratio]
        cells += [readings(r.read_gbs, 1), readings(r.tflops, 2)]
        cells += [f"{ms / r.ms:.2f}x" for ms in peers.values()]
        cells += ["" if r.compile_s is None else f"{r.compile_s:.1f}", token_check(r.tokens, ref)]
        print("| " + " | ".join(cells) + " |")


def print_batch_summary(summary: dict[int, tuple[list[Row], float]]) -> None:
    names = [r.name for r in next(iter(summary.values()))[0]]
    print("\n### tokens/s per batch size (x roofline in brackets)\n")
    print("| mode | " + " | ".join(f"batch {b}" for b in summary) + " |\n|---|" + "---|" * len(summary))
    for n in names:
        cells = []
        for b, (rows, _) in summary.items():
            r = next(r for r in rows if r.name == n)
            cells.append(f"{b * 1e3 / r.ms:.1f} ({r.ms / r.roof_ms:.2f}{'?' if r.unsteady() else ''})")
        print(f"| {n} | " + " | ".join(cells) + " |")
    print(
        "| roofline (the start's readings) | "
        + " | ".join(f"{b * 1e3 / roof:.1f}" for b, (_, roof) in summary.items())
        + " |"
    )
    print("\nx roofline: against the rates measured next to that mode's steps; ? = one moved by > 15% there")


def plot(path: Path, summary: dict[int, tuple[list[Row], float]], title: str) -> None:
    """tokens/s against batch size per mode (log-log), the roofline dashed; beside it each mode's
    x roofline (figure)."""
    fig = figure(summary, title)
    fig.savefig(path, dpi=100)
    import matplotlib.pyplot as plt  # after figure(), which chose the Agg backend

    plt.close(fig)


def figure(summary: dict[int, tuple[list[Row], float]], title: str):
    """The plot's figure, batches in increasing order whatever order --batch gave them in, each
    batch labelled once: a log axis also labels its minor ticks, which printed "6x10^4" over "64".

    Left, tokens/s with the roofline at the start's readings; right, each mode's step over its own
    roofline (the table's "x roofline", hollow where the machine's rates moved by more than 15%).
    The right panel is the one to read against a target: the memory's rate can move 2x between the
    start and a mode's steps on a shared VM, and the left panel's line does not follow it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = sorted(summary)
    fig, (ax, rx) = plt.subplots(1, 2, figsize=(13, 5))
    for n in [r.name for r in summary[batches[0]][0]]:
        rows = [next(r for r in summary[b][0] if r.name == n) for b in batches]
        (line,) = ax.plot(batches, [b * 1e3 / r.ms for b, r in zip(batches, rows)], "o-", label=n)
        timed = [(b, r) for b, r in zip(batches, rows) if r.roof_ms > 0]
        xs, ys = [b for b, _ in timed], [r.ms / r.roof_ms for _, r in timed]
        rx.plot(xs, ys, "-", color=line.get_color(), label=n)
        for b, r in timed:
            face = "none" if r.unsteady() else line.get_color()
            rx.plot([b], [r.ms / r.roof_ms], "o", color=line.get_color(), markerfacecolor=face)
    ax.plot(batches, [b * 1e3 / summary[b][1] for b in batches], "k--", label="roofline (the start's readings)")
    ax.set(xscale="log", yscale="log", xlabel="batch size", ylabel="decode tokens/s", title=title)
    rx.axhline(1.0, color="k", linestyle="--", linewidth=1, label="roofline")
    rx.set(xscale="log", xlabel="batch size", ylabel="step time / own roofline (hollow: rates moved > 15%)")
    rx.set_title("x roofline, each mode against its own readings")
    rx.set_ylim(bottom=0)
    for a in (ax, rx):
        a.set_xticks(batches, [str(b) for b in batches])
        a.set_xticks([], minor=True)
        a.grid(alpha=0.3, which="both")
        a.legend(fontsize=8)
    fig.tight_layout()
    return fig


if __name__ == "__main__":
    if runtime.under_torchrun():
        runtime.run_rank(lambda: guarded(main))  # a rank of --world-size: see exit_rank
    sys.exit(guarded(main))
