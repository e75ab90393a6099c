"""Tests for executor.tokenizer and for the tiny-checkpoint builders in tests/checkpoints.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import tests.checkpoints as ckpt
from executor.tokenizer import (
    BUILTIN_CORPUS,
    BUILTIN_TOKENIZER,
    ENDOFTEXT,
    Tokenizer,
    TokenizerError,
    train_builtin_tokenizer,
)

TEXTS = [
    "",
    "Hello world!",
    "The quick brown fox jumps over the lazy dog.",
    "  leading spaces, trailing spaces  \n\tand tabs\r\n",
    "Numbers 0 1 2 42 3.14159 and symbols {}[]()<>#@%^&*",
    "def add(a, b):\n    return a + b\n",
    "Unicode: café naïve Ünïcødé — 你好，世界 🤖🚀",  # noqa: RUF001 (the full-width comma is the point)
    "zzqxj unseen wordz like xylophonist",
]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_file(BUILTIN_TOKENIZER)


# ---------------------------------------------------------------------------
# tokenizer


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(tok, text):
    ids = tok.encode(text)
    assert all(isinstance(i, int) and 0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text


def test_round_trip_corpus_and_compression(tok):
    text = BUILTIN_CORPUS.read_text(encoding="utf-8")
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    # BPE merges were learnt: far fewer tokens than bytes
    assert len(ids) < 0.6 * len(text.encode("utf-8"))


def test_builtin_vocab_and_eos(tok):
    assert tok.vocab_size == 512
    assert tok.eos_token_id is not None
    assert tok.eos_token_id == tok.token_to_id(ENDOFTEXT) == 511
    assert tok.eos_token_ids == (511,)
    assert Tokenizer.builtin().vocab_size == 512


def test_no_special_tokens_added_and_special_skipped(tok):
    assert tok.encode("") == []
    ids = tok.encode("hello")
    assert tok.eos_token_id not in ids
    assert tok.decode(ids + [tok.eos_token_id]) == "hello"
    assert tok.decode([tok.eos_token_id]) == ""


def test_missing_path_raises(tmp_path):
    missing = tmp_path / "nope" / "tokenizer.json"
    with pytest.raises(TokenizerError, match="nope"):
        Tokenizer.from_file(missing)
    with pytest.raises(TokenizerError, match=str(tmp_path.name)):
        Tokenizer.from_file(tmp_path)  # a directory without tokenizer.json


def test_unreadable_file_raises(tmp_path):
    bad = tmp_path / "tokenizer.json"
    bad.write_text("{not json")
    with pytest.raises(TokenizerError, match=r"tokenizer\.json"):
        Tokenizer.from_file(bad)


def test_eos_from_sibling_configs(tmp_path):
    ckpt.copy_tokenizer(tmp_path)
    assert Tokenizer.from_file(tmp_path).eos_token_id == 511  # tokenizer_config / special token

    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 7}))
    assert Tokenizer.from_file(tmp_path).eos_token_id == 7

    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, 6]}))
    t = Tokenizer.from_file(tmp_path / "tokenizer.json")
    assert t.eos_token_id == 5
    assert t.eos_token_ids == (5, 6)


def test_training_is_deterministic_and_matches_committed_file():
    a = train_builtin_tokenizer(BUILTIN_CORPUS, vocab_size=512)
    b = train_builtin_tokenizer(BUILTIN_CORPUS, vocab_size=512)
    assert a.to_str() == b.to_str()
    committed = Tokenizer.from_file(BUILTIN_TOKENIZER).backend
    assert a.get_vocab(with_added_tokens=True) == committed.get_vocab(with_added_tokens=True)
    model_a = json.loads(a.to_str())["model"]
    model_c = json.loads(committed.to_str())["model"]
    assert model_a["merges"] == model_c["merges"]


# ---------------------------------------------------------------------------
# checkpoint builders

BUILDERS = {
    "qwen2": ckpt.make_qwen2_checkpoint,
    "qwen3": ckpt.make_qwen3_checkpoint,
    "qwen3_moe": ckpt.make_qwen3_moe_checkpoint,
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ckpts")
    return {name: build(root / name) for name, build in BUILDERS.items()}


@pytest.mark.parametrize("name", list(BUILDERS))
def test_checkpoint_files_and_config(checkpoints, name):
    path = checkpoints[name]
    for f in ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json"):
        assert (path / f).is_file(), f
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["vocab_size"] == 512
    assert cfg["hidden_size"] == 64
    assert cfg["num_attention_heads"] == 4 and cfg["num_key_value_heads"] == 2
    assert cfg["max_position_embeddings"] == 256
    assert cfg["eos_token_id"] == 511
    gen = json.loads((path / "generation_config.json").read_text())
    assert gen["eos_token_id"] == 511
    if name == "qwen2":
        assert cfg["num_hidden_layers"] == 2 and cfg["tie_word_embeddings"] is False
    elif name == "qwen3":
        assert cfg["num_hidden_layers"] == 2 and cfg["tie_word_embeddings"] is True
        assert cfg["head_dim"] == 32 != cfg["hidden_size"] // cfg["num_attention_heads"]
    else:
        assert cfg["num_hidden_layers"] == 3
        assert cfg.get("num_experts", cfg.get("num_local_experts")) == 8
        assert cfg["num_experts_per_tok"] == 2 and cfg["moe_intermediate_size"] == 32
        assert cfg["norm_topk_prob"] is True and cfg["mlp_only_layers"] == []
    # the checkpoint's own tokenizer agrees with the model
    t = Tokenizer.from_file(path)
    assert t.vocab_size == cfg["vocab_size"] and t.eos_token_id == 511


@pytest.mark.parametrize("name", list(BUILDERS))
def test_checkpoint_loads_and_is_not_degenerate(checkpoints, tok, name):
    from safetensors import safe_open

    path = checkpoints[name]
    model = ckpt.load_reference(path)
    assert model.dtype == torch.float32
    assert model.config._attn_implementation == "eager"
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    if name == "qwen2":
        assert "model.layers.0.self_attn.q_proj.bias" in keys
    if name == "qwen3":
        assert "lm_head.weight" not in keys  # tied
        assert "model.layers.0.self_attn.q_norm.weight" in keys
        assert model.model.layers[0].self_attn.q_proj.out_features == 4 * 32
    if name == "qwen3_moe":
        assert "model.layers.0.mlp.experts.7.gate_proj.weight" in keys
        assert "model.layers.2.mlp.gate.weight" in keys

    prompt = tok.encode("The weather today is")
    out = ckpt.reference_greedy(model, prompt, max_new_tokens=16)
    assert len(out) == 16
    assert len(set(out)) >= 3, out


def test_checkpoint_is_deterministic(tmp_path, checkpoints):
    from safetensors.torch import load_file

    again = ckpt.make_qwen2_checkpoint(tmp_path / "again")
    a = load_file(str(checkpoints["qwen2"] / "model.safetensors"))
    b = load_file(str(again / "model.safetensors"))
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert a["model.layers.0.self_attn.q_proj.bias"].abs().min() > 0  # biases are nonzero
    norm = a["model.norm.weight"]
    assert norm.min() >= 0.9 and norm.max() <= 1.1 and norm.std() > 0


@pytest.mark.parametrize("name", ["qwen2", "qwen3_moe"])
def test_shard_checkpoint(tmp_path, tok, name):
    path = BUILDERS[name](tmp_path / name)
    prompt = torch.tensor([tok.encode("Bake the cake")])
    before = ckpt.load_reference(path)(input_ids=prompt).logits

    index = ckpt.shard_checkpoint(path)
    assert index == path / "model.safetensors.index.json" and index.is_file()
    assert not (path / "model.safetensors").exists()
    weight_map = json.loads(index.read_text())["weight_map"]
    shards = set(weight_map.values())
    assert len(shards) >= 2
    assert all((path / s).is_file() for s in shards)
    assert (path / "tokenizer.json").is_file()

    after = ckpt.load_reference(path)(input_ids=prompt).logits
    torch.testing.assert_close(after, before, rtol=0, atol=0)


def test_hub_style_config_still_loads(tmp_path, tok):
    path = ckpt.make_qwen3_moe_checkpoint(tmp_path / "moe", rope_theta=1e6)
    prompt = torch.tensor([tok.encode("Tea tastes best")])
    before = ckpt.load_reference(path)(input_ids=prompt).logits
    ckpt.to_hub_style_config(path)
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["rope_theta"] == 1e6 and "rope_parameters" not in cfg
    assert cfg["torch_dtype"] == "float32" and "dtype" not in cfg
    assert cfg["num_experts"] == 8 and "num_local_experts" not in cfg
    after = ckpt.load_reference(path)(input_ids=prompt).logits
    torch.testing.assert_close(after, before, rtol=0, atol=0)
