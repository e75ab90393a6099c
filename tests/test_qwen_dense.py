"""The qwen dense recipe against HuggingFace transformers on tiny checkpoints.

Why HF is the reference: our model fuses q/k/v and gate/up, computes RoPE itself and runs on a
static KV cache, so agreement with an independent implementation (fp32, eager attention) is
the only evidence that the architecture, the weight mapping and the cache are right. Loading
failures must be errors naming the file, never random weights in disguise.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch

import tests.checkpoints as ckpt
from executor.arch import ArchError
from executor.kv_cache import KVCache
from executor.loader import LoadError
from executor.scope import PREFILL_SCOPES

PROMPT = [7, 42, 133, 250, 9, 311, 77, 400, 15]  # arbitrary ids < vocab 512
NEW_TOKENS = 12


@torch.no_grad()
def full_logits(runner, ids: list[int]) -> torch.Tensor:
    """(S, V) fp32 logits of every position in one forward, like HF's full-sequence call."""
    x = torch.tensor([ids])
    cache = KVCache(
        len(runner.model.layers), 1, runner.arch.num_kv_heads, len(ids) + 4, runner.arch.head_dim, torch.float32
    )
    hidden = runner.model(x, torch.arange(len(ids)).view(1, -1), cache, PREFILL_SCOPES)
    return runner.model.logits(hidden)[0]


@torch.no_grad()
def hf_logits(ref, ids: list[int]) -> torch.Tensor:
    return ref(input_ids=torch.tensor([ids]), use_cache=False).logits[0].float()


def assert_close_logits(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    assert ours.shape == theirs.shape
    diff = (ours - theirs).abs().max().item()
    cos = torch.nn.functional.cosine_similarity(ours.flatten(), theirs.flatten(), dim=0).item()
    assert diff < 1e-4, f"max abs diff {diff:.3e}"
    assert cos > 0.9999, f"cosine {cos:.6f}"


@pytest.fixture(scope="module")
def hub_style_ckpt(tmp_path_factory) -> Path:
    """Qwen3 with a non-default rope_theta, config.json rewritten to the Hub layout
    (top-level rope_theta): a loader that ignored it would fall back to 10000 and differ."""
    path = ckpt.make_qwen3_checkpoint(tmp_path_factory.mktemp("hub") / "qwen3_hub", rope_theta=5e5, seed=3)
    ckpt.to_hub_style_config(path)
    return path


@pytest.fixture(scope="module")
def dense(qwen2_ckpt, qwen3_ckpt, qwen3_sharded_ckpt, hub_style_ckpt):
    return {"qwen2": qwen2_ckpt, "qwen3": qwen3_ckpt, "qwen3_sharded": qwen3_sharded_ckpt, "qwen3_hub": hub_style_ckpt}


@pytest.fixture(scope="module")
def loaded(dense, make_qwen_runner):
    """name -> (our runner, HF reference model), built once per module."""
    return {name: (make_qwen_runner(path), ckpt.load_reference(path)) for name, path in dense.items()}


CASES = ["qwen2", "qwen3", "qwen3_sharded", "qwen3_hub"]


@pytest.mark.parametrize("name", CASES)
def test_full_sequence_logits_match_hf(loaded, name):
    runner, ref = loaded[name]
    assert_close_logits(full_logits(runner, PROMPT), hf_logits(ref, PROMPT))


@pytest.mark.parametrize("name", CASES)
def test_greedy_tokens_match_hf(loaded, name):
    runner, ref = loaded[name]
    expected = ckpt.reference_greedy(ref, PROMPT, NEW_TOKENS)
    assert len(set(expected)) > 3, "degenerate reference; the comparison would prove little"
    gen = runner.generate([PROMPT], NEW_TOKENS)
    assert gen.token_ids == [expected]
    assert len(gen.decode_ms) == NEW_TOKENS - 1
    # the logits returned for the first token are the prefill's, equal to HF's last position
    assert_close_logits(gen.first_logits[0], hf_logits(ref, PROMPT)[-1])


def test_architecture_features_are_what_the_checkpoints_say(loaded):
    q2, q3 = loaded["qwen2"][0], loaded["qwen3"][0]
    assert (q2.arch.qkv_bias, q2.arch.qk_norm, q2.arch.tie_word_embeddings) == (True, False, False)
    assert q2.model.layers[0].self_attn.qkv_proj.bias is not None
    assert q2.model.lm_head.weight is not q2.model.embed_tokens.weight
    assert (q3.arch.qkv_bias, q3.arch.qk_norm, q3.arch.tie_word_embeddings) == (False, True, True)
    assert q3.arch.head_dim == 32 and q3.arch.hidden_size // q3.arch.num_heads == 16
    assert q3.model.lm_head.weight is q3.model.embed_tokens.weight
    assert len(loaded["qwen3_sharded"][0].model.layers) == 3


def test_hub_style_config_loads_identically(loaded, hub_style_ckpt):
    cfg = json.loads((hub_style_ckpt / "config.json").read_text())
    assert cfg["rope_theta"] == 5e5 and "rope_parameters" not in cfg
    assert loaded["qwen3_hub"][0].arch.rope_theta == 5e5


@pytest.mark.parametrize("name", ["qwen2", "qwen3"])
def test_batch_rows_equal_running_alone(loaded, name):
    runner, ref = loaded[name]
    prompts = [PROMPT, [5, 99, 301], [480, 2, 63, 17, 200, 11, 9, 404, 88, 150, 3, 61, 290]]
    batched = runner.generate(prompts, NEW_TOKENS).token_ids
    alone = [runner.generate([p], NEW_TOKENS).token_ids[0] for p in prompts]
    assert batched == alone
    assert batched[1] == ckpt.reference_greedy(ref, prompts[1], NEW_TOKENS)  # short row: padded
    assert len({tuple(r) for r in batched}) == 3


def test_without_ckpt_builds_random_weights_from_config_json(qwen3_sharded_ckpt, loaded, make_qwen_runner):
    runner = make_qwen_runner(qwen3_sharded_ckpt, with_ckpt=False)
    model = runner.model
    assert runner.arch.rope_theta == 1e6 and len(model.layers) == 3
    assert tuple(model.layers[0].self_attn.qkv_proj.weight.shape) == ((4 + 2 * 2) * 32, 64)
    assert tuple(model.layers[2].mlp.gate_up_proj.weight.shape) == (2 * 128, 64)
    assert tuple(model.embed_tokens.weight.shape) == (512, 64)
    assert tuple(full_logits(runner, PROMPT).shape) == (len(PROMPT), 512)
    loaded_w = loaded["qwen3_sharded"][0].model.embed_tokens.weight
    assert not torch.allclose(model.embed_tokens.weight, loaded_w), "random init must not be the checkpoint"


# ----------------------------------------------------------------------------- loading errors
def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_missing_checkpoint_dir(tmp_path, make_qwen_runner):
    missing = tmp_path / "no_such_ckpt"
    with pytest.raises((ArchError, LoadError), match=re.escape(str(missing))):
        make_qwen_runner(missing)


def test_missing_model_safetensors(tmp_path, qwen3_ckpt, make_qwen_runner):
    path = _copy(qwen3_ckpt, tmp_path / "c")
    (path / "model.safetensors").unlink()
    with pytest.raises(LoadError, match=rf"{re.escape(str(path))}.*no model\.safetensors"):
        make_qwen_runner(path)


def test_corrupt_safetensors(tmp_path, qwen3_ckpt, make_qwen_runner):
    path = _copy(qwen3_ckpt, tmp_path / "c")
    (path / "model.safetensors").write_bytes(b"\x00this is not a safetensors file\xff" * 40)
    with pytest.raises(LoadError, match=re.escape(str(path / "model.safetensors"))):
        make_qwen_runner(path)


def test_truncated_safetensors(tmp_path, qwen3_ckpt, make_qwen_runner):
    path = _copy(qwen3_ckpt, tmp_path / "c")
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(LoadError, match=re.escape(str(path / "model.safetensors"))):
        make_qwen_runner(path)


def test_missing_shard(tmp_path, qwen3_sharded_ckpt, make_qwen_runner):
    path = _copy(qwen3_sharded_ckpt, tmp_path / "c")
    shards = sorted(path.glob("model-*-of-*.safetensors"))
    assert len(shards) >= 2
    shards[1].unlink()
    with pytest.raises(LoadError, match=rf"{re.escape(str(shards[1]))} is missing"):
        make_qwen_runner(path)


@pytest.mark.parametrize("change", [{"intermediate_size": 96}, {"num_hidden_layers": 3}, {"head_dim": 16}])
def test_config_json_not_matching_tensors(tmp_path, qwen3_ckpt, make_qwen_runner, change):
    path = _copy(qwen3_ckpt, tmp_path / "c")
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(change)
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(LoadError, match=re.escape(str(path))):
        make_qwen_runner(path)


def test_untied_config_without_lm_head_tensor_is_an_error(tmp_path, qwen3_ckpt, make_qwen_runner):
    """The Qwen3 checkpoint is tied (no lm_head tensor on disk); a config.json claiming untied
    embeddings describes a model these tensors cannot build, so loading must fail, not tie."""
    path = _copy(qwen3_ckpt, tmp_path / "c")
    cfg = json.loads((path / "config.json").read_text())
    cfg["tie_word_embeddings"] = False
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(LoadError, match=rf"{re.escape(str(path))}.*lm_head"):
        make_qwen_runner(path)


def test_unparseable_config_json(tmp_path, qwen3_ckpt, make_qwen_runner):
    path = _copy(qwen3_ckpt, tmp_path / "c")
    (path / "config.json").write_text("{not json")
    with pytest.raises(ArchError, match=re.escape(str(path / "config.json"))):
        make_qwen_runner(path)
