"""Runner of the qwen3_moe recipe: builds the model and stacks per-expert checkpoint tensors.

Prefill/decode split, static KV cache, compilation and timing are shared in executor.runner.
"""

from __future__ import annotations

import re

from executor.arch import ModelArch
from executor.loader import LoadError, Source, Stack
from executor.parallel.groups import Parallel
from executor.runner import ModelRunner
from models.qwen3_moe.models.modeling_qwen3_moe import build_model

# After executor.loader.remap (gate/up already concatenated into gate_up_proj):
#   layers.L.mlp.experts.E.gate_up_proj.weight (2I, H), layers.L.mlp.experts.E.down_proj.weight (H, I)
_EXPERT = re.compile(r"^(layers\.\d+\.mlp)\.experts\.(\d+)\.(gate_up_proj|down_proj)\.weight$")
# transformers 5 in-memory layout, if a checkpoint was saved that way: already stacked (E, ., .)
_FUSED = re.compile(r"^(layers\.\d+\.mlp)\.experts\.(gate_up_proj|down_proj)$")
_OURS = {"gate_up_proj": "experts_gate_up", "down_proj": "experts_down"}


class Qwen3MoeRunner(ModelRunner):
    recipe = "qwen3_moe"
    model_types = ("qwen3_moe",)

    def build_model(self, arch: ModelArch, parallel: Parallel):
        return build_model(arch, parallel)

    def remap_weights(self, state: dict) -> dict:
        """Stack the Hub's one-tensor-per-expert layout into (E, ., .) tensors; the router
        (`layers.L.mlp.gate.weight`) already has our name. A missing expert is an error.
        Stacking is lazy (executor.loader.Stack): a rank reads only its experts' slices."""
        out: dict[str, Source] = {}
        experts: dict[str, dict[int, Source]] = {}
        for name, tensor in state.items():
            m = _EXPERT.match(name)
            if m:
                experts.setdefault(f"{m[1]}.{_OURS[m[3]]}", {})[int(m[2])] = tensor
                continue
            m = _FUSED.match(name)
            out[f"{m[1]}.{_OURS[m[2]]}" if m else name] = tensor
        for name, parts in experts.items():
            missing = sorted(set(range(self.arch.num_experts)) - set(parts))
            if missing or len(parts) != self.arch.num_experts:
                raise LoadError(
                    f"checkpoint has {len(parts)} experts for {name}, config.json says "
                    f"{self.arch.num_experts} (missing experts {missing[:5]})"
                )
            out[name] = Stack([parts[e] for e in range(len(parts))])
        return out


RUNNER = Qwen3MoeRunner
