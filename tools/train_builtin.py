"""Train the built-in models (`models/qwen/builtin`, `models/qwen3_moe/builtin`) from scratch on CPU.

    python tools/train_builtin.py --model qwen         # dense Qwen3, writes models/qwen/builtin/
    python tools/train_builtin.py --model qwen3_moe    # Qwen3-MoE, writes models/qwen3_moe/builtin/

Why a trained model at all: a model with random weights prints token soup, so nobody can see
whether a run is right. A few-million-parameter model trained for a few CPU-minutes on English
prose continues a prompt with readable English, and its held-out perplexity is a number that
the executor must reproduce (against transformers) to 0.1%.

Why transformers: Qwen3ForCausalLM / Qwen3MoeForCausalLM are the reference implementation, and
`save_pretrained` writes the same HF checkpoint layout a user's checkpoint has, so the built-in
model goes through the same loader. transformers is a test dependency of the project; this tool
is for maintainers, not needed to run inference.

Deterministic: fixed seed, `torch.use_deterministic_algorithms(True)`, a fixed thread count, a
fixed number of steps and a seeded data order; two runs on one machine give the same weights
(`--max-minutes` is only a safety stop, and a run that hits it says so in the README).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # `python tools/train_builtin.py` from anywhere
    sys.path.insert(0, str(REPO_ROOT))

from executor.tokenizer import ENDOFTEXT, train_builtin_tokenizer  # noqa: E402
from tools.builtin_corpus import DEFAULT_CACHE, PACKAGE_VERSION, Corpus, CorpusError, load_corpus  # noqa: E402

VOCAB_SIZE = 4096  # byte-level BPE: ~4 characters per token on this corpus, embeddings ~1M parameters
EOS_ID = VOCAB_SIZE - 1  # train_builtin_tokenizer puts <|endoftext|> last
EVAL_WINDOW = 256  # perplexity windows = the training sequence length (see eval_nll)
# The first two are the recipes' default prompts (config/builtin.yaml); the third is out of domain.
SAMPLE_PROMPTS = ("The function returns", "Python is a programming language that", "The weather today is")
SAMPLE_TOKENS = 32  # greedy new tokens per sample, as `bash infer.sh` generates by default
STORE_DTYPE = torch.bfloat16  # checkpoint dtype: keeps the model directories at a few MB


@dataclass(frozen=True)
class Recipe:
    """Architecture (HF config fields) and training schedule of one built-in model."""

    config: dict
    steps: int  # optimizer steps; fixed, so the result does not depend on machine speed
    batch: int  # sequences per step
    seq_len: int  # tokens per sequence
    lr: float  # peak learning rate (AdamW)
    warmup: int  # linear warmup steps, then cosine decay to lr * MIN_LR_FRACTION
    weight_decay: float = 0.1  # on matrices only (not norms)
    eval_every: int = 50
    log_every: int = 10
    extra_forward: dict = field(default_factory=dict)  # kwargs of the training forward


MIN_LR_FRACTION = 0.1
GRAD_CLIP = 1.0  # global grad-norm clip; keeps the early high-lr steps stable
_COMMON = dict(
    vocab_size=VOCAB_SIZE,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,  # sequences are short (256 training, ~100 at inference)
    max_position_embeddings=4096,  # the runner's KV cache holds input_max_len + max_new_tokens
    tie_word_embeddings=True,  # the embedding is a quarter of the parameters; tying halves it
    attention_bias=False,
    hidden_act="silu",
    bos_token_id=EOS_ID,
    eos_token_id=EOS_ID,
    dtype="float32",
)
RECIPES = {
    "qwen": Recipe(
        config=dict(_COMMON, model_type="qwen3", hidden_size=192, intermediate_size=512, num_hidden_layers=4),
        steps=500,
        batch=8,  # small batches, more steps: at ~1M tokens that learns more per FLOP than 16 x 256
        seq_len=256,
        lr=2e-3,
        warmup=30,
        eval_every=100,
    ),
    "qwen3_moe": Recipe(
        config=dict(
            _COMMON,
            model_type="qwen3_moe",
            hidden_size=192,
            intermediate_size=384,  # dense MLP size, unused: every layer is MoE
            num_hidden_layers=4,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=128,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            router_aux_loss_coef=0.01,  # load balancing, so all 8 experts get used
        ),
        steps=350,
        batch=8,
        seq_len=256,
        lr=2e-3,
        warmup=30,
        eval_every=100,
        extra_forward={"output_router_logits": True},
    ),
}


def build_model(recipe: Recipe, seed: int) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict(recipe.config)
    config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")


def lr_at(step: int, recipe: Recipe) -> float:
    """Linear warmup, then cosine from lr down to lr * MIN_LR_FRACTION at the last step."""
    if step < recipe.warmup:
        return recipe.lr * (step + 1) / recipe.warmup
    t = (step - recipe.warmup) / max(1, recipe.steps - recipe.warmup)
    return recipe.lr * (MIN_LR_FRACTION + (1 - MIN_LR_FRACTION) * 0.5 * (1 + math.cos(math.pi * t)))


def batches(ids: torch.Tensor, recipe: Recipe, seed: int):
    """(batch, seq_len) windows of the token stream, forever. Each epoch: a seeded random start
    offset and a seeded permutation of the non-overlapping windows from there."""
    epoch = 0
    while True:
        gen = torch.Generator().manual_seed(seed * 1000 + epoch)
        offset = int(torch.randint(0, recipe.seq_len, (1,), generator=gen))
        n = (len(ids) - offset) // recipe.seq_len
        windows = ids[offset : offset + n * recipe.seq_len].view(n, recipe.seq_len)
        order = torch.randperm(n, generator=gen)
        for i in range(0, n - recipe.batch + 1, recipe.batch):
            yield windows[order[i : i + recipe.batch]]
        epoch += 1


@torch.no_grad()
def eval_nll(model: torch.nn.Module, ids: list[int], window: int = EVAL_WINDOW) -> tuple[float, int]:
    """Mean next-token NLL (nats) of `ids` under `model`, and the number of predicted tokens.

    The method the README states, so anyone can reproduce it: consecutive non-overlapping
    windows ids[0:W], ids[W:2W], ... (the last one shorter; dropped if it has 1 token), each
    scored on its own from an empty context; every token but each window's first is predicted
    once; the result is the sum of NLLs over all predicted tokens divided by their count."""
    model.eval()
    total, count = 0.0, 0
    for start in range(0, len(ids), window):
        chunk = torch.tensor([ids[start : start + window]])
        if chunk.shape[1] < 2:
            continue
        loss = model(input_ids=chunk, labels=chunk).loss  # mean over chunk_len - 1 predictions
        total += float(loss) * (chunk.shape[1] - 1)
        count += chunk.shape[1] - 1
    return total / count, count


@torch.no_grad()
def greedy(model: torch.nn.Module, tokenizer, prompt: str, new_tokens: int = SAMPLE_TOKENS) -> str:
    """Greedy continuation (full recompute each step, no early stop) of `prompt`."""
    model.eval()
    ids = torch.tensor([tokenizer.encode(prompt, add_special_tokens=False).ids])
    for _ in range(new_tokens):
        nxt = model(input_ids=ids).logits[0, -1].argmax()
        ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
    return tokenizer.decode(ids[0].tolist(), skip_special_tokens=True)


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def save_checkpoint(model: torch.nn.Module, tokenizer, out: Path) -> None:
    """config.json, generation_config.json, model.safetensors, tokenizer.json, tokenizer_config.json.

    The weights are stored in STORE_DTYPE (half the bytes of float32); every number the README
    reports is measured on the checkpoint as stored (evaluate_saved), read back as float32."""
    from transformers import GenerationConfig

    model.to(STORE_DTYPE)
    model.generation_config = GenerationConfig(bos_token_id=EOS_ID, eos_token_id=EOS_ID, do_sample=False)
    model.save_pretrained(out)
    tokenizer.save(str(out / "tokenizer.json"), pretty=True)
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": ENDOFTEXT,
        "pad_token": ENDOFTEXT,
        "model_max_length": 4096,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")


def train(args: argparse.Namespace) -> dict:
    """The whole run; returns the record that train_log.json and the README are written from."""
    from tools.builtin_report import executor_sample, plot_losses, write_readme

    recipe = RECIPES[args.model]
    if args.steps:
        recipe = Recipe(**{**asdict(recipe), "steps": args.steps})
    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True)
    out = Path(args.out or REPO_ROOT / "models" / args.model / "builtin")
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()

    load_start = os.getloadavg()[0]
    corpus, license_text = load_corpus(Path(args.deb) if args.deb else None, Path(args.cache))
    if corpus.version != PACKAGE_VERSION:
        print(f"[train] note: {corpus.deb.name} is not {PACKAGE_VERSION}; the corpus differs from the shipped model's")
    train_text, eval_text = Corpus.join(corpus.train), Corpus.join(corpus.held_out)
    Path(args.cache).mkdir(parents=True, exist_ok=True)
    corpus_file = Path(args.cache) / "train.txt"
    corpus_file.write_text(train_text, encoding="utf-8")
    (out / "eval.txt").write_text(eval_text, encoding="utf-8")
    (out / "CORPUS_LICENSE.txt").write_text(license_text, encoding="utf-8")
    tokenizer = train_builtin_tokenizer(corpus_file, VOCAB_SIZE)
    train_ids = torch.tensor(tokenizer.encode(train_text, add_special_tokens=False).ids)
    eval_ids = tokenizer.encode(eval_text, add_special_tokens=False).ids
    print(
        f"[train] corpus {len(corpus.train)} train docs ({len(train_text):,} chars, {len(train_ids):,} tokens), "
        f"{len(corpus.held_out)} held-out docs ({len(eval_text):,} chars, {len(eval_ids):,} tokens), "
        f"prepared in {time.time() - t0:.0f}s",
        flush=True,
    )

    model = build_model(recipe, args.seed)
    n_params = sum(p.numel() for p in model.parameters())  # tied weights counted once
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": recipe.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=recipe.lr,
        betas=(0.9, 0.95),  # beta2 0.95: the usual choice for short LM runs with large lr
    )
    print(f"[train] {args.model}: {n_params:,} parameters, {recipe.steps} steps of {recipe.batch}x{recipe.seq_len}")
    train_curve, eval_curve = [], []
    data = batches(train_ids, recipe, args.seed)
    t_train, cpu_train = time.time(), time.process_time()
    stopped_early = None
    for step in range(recipe.steps):
        if step % recipe.eval_every == 0:
            eval_curve.append((step, eval_nll(model, eval_ids)[0]))
        model.train()
        for group in opt.param_groups:
            group["lr"] = lr_at(step, recipe)
        x = next(data)
        out_ = model(input_ids=x, labels=x, **recipe.extra_forward)
        out_.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
        lm_loss = float(out_.loss.detach())
        if getattr(out_, "aux_loss", None) is not None:  # MoE: report the language-model part alone
            lm_loss -= recipe.config["router_aux_loss_coef"] * float(out_.aux_loss.detach())
        train_curve.append(lm_loss)
        elapsed = time.time() - t_train
        if (step + 1) % recipe.log_every == 0 or step + 1 == recipe.steps:
            eta = elapsed / (step + 1) * (recipe.steps - step - 1)
            held = f", held-out {eval_curve[-1][1]:.3f} @ {eval_curve[-1][0]}" if eval_curve else ""
            print(
                f"[train] step {step + 1}/{recipe.steps} loss {lm_loss:.3f} lr {lr_at(step, recipe):.2e}{held} "
                f"elapsed {elapsed / 60:.1f} min, eta {eta / 60:.1f} min",
                flush=True,
            )
        if elapsed > args.max_minutes * 60 and step + 1 < recipe.steps:
            stopped_early = step + 1
            print(
                f"[train] STOPPED EARLY at step {stopped_early}: --max-minutes {args.max_minutes} reached", flush=True
            )
            break
    steps_done = stopped_early or recipe.steps
    eval_curve.append((steps_done, eval_nll(model, eval_ids)[0]))
    train_minutes = (time.time() - t_train) / 60
    train_cpu_minutes = (time.process_time() - cpu_train) / 60  # all threads; / threads ~ wall time alone

    save_checkpoint(model, tokenizer, out)
    record = evaluate_saved(out, eval_text)
    record.update(
        model=args.model,
        command=" ".join(["python", "tools/train_builtin.py", *sys.argv[1:]]),
        seed=args.seed,
        threads=args.threads,
        cpus=os.cpu_count(),
        load_average=(load_start, os.getloadavg()[0]),
        recipe=asdict(recipe),
        parameters=n_params,
        steps_done=steps_done,
        stopped_early=stopped_early,
        train_minutes=round(train_minutes, 2),
        train_cpu_minutes=round(train_cpu_minutes, 2),
        total_minutes=round((time.time() - t0) / 60, 2),
        final_train_loss=sum(train_curve[-20:]) / len(train_curve[-20:]),  # mean of the last 20 steps
        train_curve=train_curve,
        eval_curve=eval_curve,
        corpus=dict(
            package=corpus.deb.name,
            deb_sha256=corpus.deb_sha256,
            train_docs=len(corpus.train),
            held_out_docs=[name for name, _ in corpus.held_out],
            train_chars=len(train_text),
            train_tokens=len(train_ids),
            eval_chars=len(eval_text),
        ),
        torch=torch.__version__,
        transformers=__import__("transformers").__version__,
    )
    (out / "train_log.json").write_text(json.dumps(record, indent=1) + "\n")
    plot_losses(record, out / "loss_curve.png")
    try:  # the same checkpoint through our own loader and model code
        record["executor_sample"] = executor_sample(args.model, out.resolve())
        (out / "train_log.json").write_text(json.dumps(record, indent=1) + "\n")
    except RuntimeError as exc:
        print(f"[train] WARNING: {exc}", flush=True)
    write_readme(record, out / "README.md")
    print(
        f"[train] wrote {out}: held-out loss {record['eval_loss']:.4f}, perplexity {record['eval_ppl']:.3f}, "
        f"model.safetensors sha256 {record['weights_sha256'][:16]}, {record['total_minutes']:.1f} min in all",
        flush=True,
    )
    return record


def evaluate_saved(out: Path, eval_text: str) -> dict:
    """Held-out loss/perplexity and samples of the checkpoint as saved, reloaded by transformers (fp32)."""
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, attn_implementation="eager")
    tokenizer = Tokenizer.from_file(str(out / "tokenizer.json"))
    eval_ids = tokenizer.encode(eval_text, add_special_tokens=False).ids
    loss, count = eval_nll(model, eval_ids)
    return dict(
        eval_loss=loss,
        eval_ppl=math.exp(loss),
        eval_tokens=len(eval_ids),
        eval_predicted=count,
        samples={p: greedy(model, tokenizer, p) for p in SAMPLE_PROMPTS},
        sample_tokens=SAMPLE_TOKENS,
        weights_sha256=sha256(out / "model.safetensors"),
        weights_bytes=(out / "model.safetensors").stat().st_size,
        weights_dtype=str(STORE_DTYPE).removeprefix("torch."),
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", choices=sorted(RECIPES), default="qwen", help="which built-in model (default qwen)")
    ap.add_argument("--out", default="", help="output directory (default models/<model>/builtin)")
    ap.add_argument("--steps", type=int, default=0, help="override the recipe's step count (e.g. a quick check)")
    ap.add_argument("--seed", type=int, default=0, help="weights init and data order (default 0)")
    # 1 thread: at these matrix sizes a second OpenMP thread gains little on an idle 2-core machine,
    # and on a shared one (threads descheduled at every barrier) one step cost ~3.5x the CPU time.
    ap.add_argument("--threads", type=int, default=1, help="torch threads; results depend on it (default 1)")
    ap.add_argument("--max-minutes", type=float, default=28.0, help="safety stop of the training loop (default 28)")
    ap.add_argument("--cache", default=str(DEFAULT_CACHE), help=f"corpus cache directory (default {DEFAULT_CACHE})")
    ap.add_argument("--deb", default="", help="use this python3.11-doc .deb instead of fetching it")
    args = ap.parse_args(argv)
    try:
        __import__("transformers")
    except ImportError:
        print("train_builtin: needs transformers (pip install -e .[test])", file=sys.stderr)
        return 2
    try:
        train(args)
    except CorpusError as exc:
        print(f"train_builtin: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
