"""loss_curve.png and README.md of a built-in model, written from its training record.

Why generated: every number in the README (losses, perplexity, wall time, samples, hashes)
comes from the run that produced the shipped weights, so the text cannot drift from them.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent

SMOOTH = 20  # steps in the moving average drawn over the raw training loss


def plot_losses(record: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = record["train_curve"]
    smooth = [
        sum(train[max(0, i - SMOOTH + 1) : i + 1]) / len(train[max(0, i - SMOOTH + 1) : i + 1])
        for i in range(len(train))
    ]
    steps = list(range(1, len(train) + 1))
    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    ax.plot(steps, train, color="tab:blue", alpha=0.25, linewidth=0.8, label="train loss (per step)")
    ax.plot(steps, smooth, color="tab:blue", linewidth=1.5, label=f"train loss ({SMOOTH}-step mean)")
    ev_steps, ev_loss = zip(*record["eval_curve"])
    ax.plot(ev_steps, ev_loss, "o-", color="tab:red", markersize=3, label="held-out loss (eval.txt)")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("next-token loss (nats)")
    ax.set_ylim(bottom=min(min(train), min(ev_loss)) - 0.2, top=min(max(train), 9.0))
    ax.set_title(f"built-in {record['model']}: {record['parameters'] / 1e6:.2f}M parameters, seed {record['seed']}")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def executor_sample(model: str, checkpoint: Path) -> dict:
    """The recipe's default run (prompt, 32 greedy tokens, eager) on `checkpoint` through the
    real entry point, i.e. this repository's loader and model code rather than transformers."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "executor.cli", "run", "--model", model, "--out", tmp]
        cmd += ["--set", f"model_config.model_path={checkpoint}", "--set", "model_config.with_ckpt=true"]
        cmd += ["--set", "model_config.exe_mode=eager", "--set", "model_config.enable_superkernel=false"]
        cmd += ["--set", "model_config.enable_cache_compile=false"]
        proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"executor run failed ({proc.returncode}): {proc.stderr.strip()[-300:]}")
        metrics = json.loads((Path(tmp) / "metrics.json").read_text())
    prompts = metrics["config"]["data_config"]["prompts"]
    return {"prompt": prompts[0], "text": metrics["text"][0], "token_ids": metrics["generated_token_ids"][0]}


def _arch_lines(cfg: dict) -> str:
    keys = (
        "model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
        "head_dim", "intermediate_size", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
        "norm_topk_prob", "router_aux_loss_coef", "tie_word_embeddings", "rope_theta", "max_position_embeddings",
    )  # fmt: skip
    return "\n".join(f"| `{k}` | {json.dumps(cfg[k])} |" for k in keys if k in cfg)


def write_readme(record: dict, path: Path) -> None:
    r, rec, c = record, record["recipe"], record["corpus"]
    cfg = rec["config"]
    moe = cfg["model_type"] == "qwen3_moe"
    tokens = rec["steps"] * rec["batch"] * rec["seq_len"]
    load = r["load_average"]
    shared = (
        f"The CPU was shared with other jobs during this run (load average {load[0]:.1f} at the start, "
        f"{load[1]:.1f} at the end, on {r['cpus']} cores), so these times are inflated; on an idle machine "
        f"the training loop takes about its CPU time per thread, {r['train_cpu_minutes'] / r['threads']:.1f} min."
        if max(load) > r["threads"] + 0.5
        else f"Load average {load[0]:.1f} at the start, {load[1]:.1f} at the end, on {r['cpus']} cores."
    )
    early = (
        f"\n**Stopped early** at step {r['stopped_early']} of {rec['steps']} (`--max-minutes`): this "
        "checkpoint is not the deterministic result of the recipe.\n"
        if r["stopped_early"]
        else ""
    )
    samples = "\n".join(f"- **{p}** → {json.dumps(text[len(p) :])}" for p, text in r["samples"].items())
    flag = "" if r["model"] == "qwen" else f" --model {r['model']}"
    ex = r.get("executor_sample")
    executor = (
        f"Through this repository's executor (`bash infer.sh{flag}` in eager mode: our loader and model code, greedy, "
        f"{len(ex['token_ids'])} new tokens), "
        f"**{ex['prompt']}** → {json.dumps(ex['text'])}"
        + (" (the same as transformers)." if r["samples"].get(ex["prompt"], "").endswith(ex["text"]) else ".")
        if ex
        else ""
    )
    aux = (
        f" The training loss adds the router load-balancing loss (coefficient {cfg.get('router_aux_loss_coef')}); "
        "the curve and the numbers below are the language-model loss alone."
        if moe
        else ""
    )
    f32 = r.get("float32_eval")  # set when the float32 weights were stored in bfloat16 after training
    fp32 = (
        f"| held-out perplexity of the float32 weights, before storing them as {r['weights_dtype']} "
        f"| {f32['eval_ppl']:.3f} |\n"
        if f32
        else ""
    )
    mb = r["weights_bytes"] / 1e6
    kind = "Qwen3-MoE" if moe else "Qwen3"
    eos = f"`<\\|endoftext\\|>` = id {cfg['eos_token_id']}"  # \| : a pipe inside a markdown table
    text = f"""# Built-in {r["model"]} model: a trained {r["parameters"] / 1e6:.2f}M-parameter {kind}

A small model trained from scratch on English prose (the Python 3.11 documentation) by
`tools/train_builtin.py`, shipped in HuggingFace format and loaded by the same loader as any
user checkpoint. It is the default of the recipe (`models/{r["model"]}/config/builtin.yaml`:
`model_path: "builtin"`, `with_ckpt: true`):

```bash
bash infer.sh{flag}
```

It continues a prompt with short English sentences in the register of software documentation,
and then, decoding greedily, repeats itself: a model trained for minutes, for demos and for
checking the executor against transformers (held-out perplexity), not for content.

| file | what |
|---|---|
| `config.json`, `generation_config.json` | written by transformers {r["transformers"]} `save_pretrained` |
| `model.safetensors` | {r.get("weights_dtype", "float32")} weights (trained in float32), {mb:.1f} MB |
| `tokenizer.json`, `tokenizer_config.json` | byte-level BPE, {cfg["vocab_size"]} tokens, {eos} |
| `eval.txt` | the held-out text ({c["eval_chars"]:,} characters, {r["eval_tokens"]:,} tokens), never trained on |
| `loss_curve.png`, `train_log.json` | losses per step and every number in this README |
| `CORPUS_LICENSE.txt` | the corpus licence (PSF License Agreement), copyright notice, summary of changes |

model.safetensors sha256: `{r["weights_sha256"]}`

## Corpus
- **Source**: the Debian package `{c["package"]}`
  (sha256 `{c["deb_sha256"]}`), the HTML build of the Python 3.11 documentation, whose Sphinx
  sources (`_sources/**/*.rst.txt`) are the text.
- **Licence**: the PSF License Agreement (Python Software Foundation License Version 2), stated
  in the package's `usr/share/doc/python3.11-doc/copyright` and in the documentation itself
  (`license.rst.txt`: "Python software and documentation are licensed under the PSF License
  Agreement"). It allows redistributing derivative works that carry the licence and PSF's
  copyright notice and summarise the changes; `CORPUS_LICENSE.txt` does that.
- **How obtained**: the script runs `apt-get download python3.11-doc` (as any user) into
  `~/.cache/cann-recipes-infer/corpus/` and reads the .deb directly (an `ar` archive holding a
  tar; no dpkg-deb needed); `--deb FILE` takes a .deb fetched some other way. The training text
  is not committed.
- **Cleaning** (`tools/builtin_corpus.py`, fixed rules): the sections about, bugs, contents,
  copyright, license, includes, whatsnew (mostly names and issue numbers) and distutils
  (deprecated, duplicates others) are left out. In every other document, directives go with
  their bodies except prose ones (notes, warnings, version notes and API descriptions keep their
  text); literal blocks (`::`), doctest blocks, tables, titles, comments and field lists go;
  inline markup becomes its words (``:func:`len` `` → `len`, ``:pep:`8` `` → `PEP 8`, a link →
  its text). A paragraph is kept if it has at least 6 words, is at least 75% letters and ends
  like a sentence. One paragraph per line; documents apart by a blank line.
- **Split**, by whole document: of the {c["train_docs"] + len(c["held_out_docs"])} non-empty documents in sorted path
  order, every 50th from the 35th is held out ({len(c["held_out_docs"])} documents: {", ".join(c["held_out_docs"])}).
  Training text: {c["train_docs"]} documents, {c["train_chars"]:,} characters, {c["train_tokens"]:,} tokens.

## Tokenizer
`executor.tokenizer.train_builtin_tokenizer` (the function behind the repository's 512-token
tokenizer) on the training text, vocab {cfg["vocab_size"]}: byte-level BPE, all 256 bytes in the
alphabet, `<|endoftext|>` last. Deterministic. No BOS is added; prompts are encoded as they are.

## Architecture
transformers `{"Qwen3MoeForCausalLM" if moe else "Qwen3ForCausalLM"}`, {r["parameters"]:,} parameters (the tied
embedding counted once).

| field | value |
|---|---|
{_arch_lines(cfg)}

## Training
```bash
{r["command"]}
```
- Seed {r["seed"]} (weights init and data order), `torch.set_num_threads({r["threads"]})`,
  `torch.use_deterministic_algorithms(True)`, torch {r["torch"]}, float32, SDPA attention.
- {rec["steps"]} steps of {rec["batch"]} x {rec["seq_len"]} tokens ({tokens / 1e6:.1f}M tokens, \
{tokens / c["train_tokens"]:.1f} passes over the training text). Each pass starts at a seeded random offset and
  visits the non-overlapping windows in a seeded order.
- AdamW (betas 0.9/0.95, weight decay {rec["weight_decay"]} on matrices), peak lr {rec["lr"]}, {rec["warmup"]}
  warmup steps then cosine to 10%, gradient norm clipped at 1.0.{aux}
- Wall time: {r["train_minutes"]:.1f} min of training ({r["train_cpu_minutes"]:.1f} CPU-minutes, \
{r["threads"]} thread{"s" if r["threads"] > 1 else ""}), {r["total_minutes"]:.1f} min in all (corpus, tokenizer, \
evaluations, saving). {shared}
{r.get("note", "")}
{early}
![loss curve](loss_curve.png)

## Results
| | |
|---|---|
| final training loss (mean of the last 20 steps) | {r["final_train_loss"]:.4f} |
| held-out loss (eval.txt) | {r["eval_loss"]:.4f} nats/token |
| held-out perplexity | {r["eval_ppl"]:.3f} |
{fp32}
**Perplexity method** (the checkpoint as saved, loaded by transformers in float32, eager attention):
`ids = tokenizer.encode(open("eval.txt").read())` with this directory's `tokenizer.json`, no
special tokens ({r["eval_tokens"]:,} ids); consecutive non-overlapping windows of 256 ids
(`ids[0:256]`, `ids[256:512]`, ..., the last one shorter), each scored alone from an empty
context (`model(input_ids=w, labels=w).loss` is the mean NLL of its `len(w) - 1` predictions);
the NLL summed over all windows, divided by the {r["eval_predicted"]:,} predicted tokens, is the
held-out loss; perplexity = exp(loss). `tools/train_builtin.py:eval_nll` is this computation.

Greedy continuations by transformers ({r["sample_tokens"]} new tokens, full recompute):

{samples}

{executor}

## Determinism
Everything random is seeded (weights init, data order), `torch.use_deterministic_algorithms(True)`
is on and the thread count is fixed, so the same CPU type, thread count and corpus give the same
weights; the step count is fixed, so the result does not depend on how fast the machine is.
{r.get("determinism_check", "")}
Another CPU (SIMD width) or thread count may give slightly different floats.

`python tools/builtin_report.py models/{r["model"]}/builtin` rewrites this README and the plot from
`train_log.json` (and re-runs the executor sample).
"""
    path.write_text(text)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Rewrite README.md and loss_curve.png of a built-in model.")
    ap.add_argument("checkpoint", help="models/<model>/builtin")
    args = ap.parse_args(argv)
    out = Path(args.checkpoint)
    record = json.loads((out / "train_log.json").read_text())
    record["executor_sample"] = executor_sample(record["model"], out.resolve())
    (out / "train_log.json").write_text(json.dumps(record, indent=1) + "\n")
    plot_losses(record, out / "loss_curve.png")
    write_readme(record, out / "README.md")
    print(f"wrote {out / 'README.md'} and {out / 'loss_curve.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
