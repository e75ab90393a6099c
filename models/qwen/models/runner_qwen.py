"""Runner of the qwen recipe (Qwen2 / Qwen2.5 / Qwen3 dense): builds the model, nothing else.

Prefill/decode split, static KV cache, compilation and timing are shared in executor.runner.
"""

from executor.arch import ModelArch
from executor.parallel.groups import Parallel
from executor.runner import ModelRunner
from models.qwen.models.modeling_qwen import build_model


class QwenRunner(ModelRunner):
    recipe = "qwen"
    model_types = ("qwen2", "qwen3")

    def build_model(self, arch: ModelArch, parallel: Parallel):
        return build_model(arch, parallel)


RUNNER = QwenRunner
