"""What a run's start costs before its first token: nothing that is thrown away.

Why: PyTorch initialises every parameter a module creates, and the runner fills every one of them
next (from the checkpoint, or init_random); at the Qwen3-0.6B shape that initialisation took 4.3-7.5
s of each start on the 2-core dev VM. And the pre-flight's meta model, the world-size-1 collective
log and anything else imported on the way must not pull in Dynamo (2.3 s) for an eager run.
"""

from __future__ import annotations

import torch

from tests.fresh_python import run_code


def test_the_runner_builds_its_model_without_torchs_initialisation(make_qwen_runner, qwen3_ckpt):
    """torch.nn.init draws from the global generator; the runner seeds it and builds its model,
    and the generator must not have moved (its weights come from the checkpoint or init_random's
    own generator), in both kinds of start."""
    for with_ckpt in (True, False):
        runner = make_qwen_runner(qwen3_ckpt, "model_config.exe_mode=eager", with_ckpt=with_ckpt)
        after = torch.get_rng_state()
        torch.manual_seed(runner.cfg.model_config.seed)
        assert torch.equal(after, torch.get_rng_state()), f"with_ckpt={with_ckpt}: torch's init ran"


def test_an_eager_run_does_not_import_dynamo(tmp_path):
    code = (
        "import sys\n"
        "from executor.cli import main\n"
        "sets = ['model_config.exe_mode=eager', 'model_config.enable_superkernel=false',\n"
        "        'model_config.enable_cache_compile=false', 'scheduler_config.max_new_tokens=4']\n"
        f"assert main(['run', *[a for s in sets for a in ('--set', s)], '--out', {str(tmp_path / 'out')!r}]) == 0\n"
        "print('dynamo', 'torch._dynamo' in sys.modules)\n"
    )
    assert run_code(code).splitlines()[-1] == "dynamo False"
