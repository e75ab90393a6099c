"""A compiled step's later calls skip torch.compile's per-call wrapper (executor.backends.direct_call)
but not Dynamo's guards: whatever would make Dynamo trace again (another input shape, a Python
value the trace read, grad mode, a new thread count compiled in) still goes through torch.compile,
and the entry that fits runs afterwards."""

import pytest
import torch

from executor.backends.inductor import compile_inductor
from executor.scope import superkernel_scope


def _step(superkernel: bool):
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 64)
    opts = {"scale": 2.0}  # a Python value the trace reads: Dynamo guards on it

    def step(x, _positions):
        with superkernel_scope(superkernel, "all", ""):
            return torch.relu(lin(x)) * opts["scale"]

    return step, opts


@pytest.mark.parametrize("superkernel", [False, True])
def test_later_calls_run_directly_and_whatever_dynamo_guards_still_decides(superkernel):
    step, opts = _step(superkernel)
    one, two = torch.randn(1, 1, 64), torch.randn(2, 1, 64)
    with torch.no_grad():
        compiled = compile_inductor(step, superkernel, "cpu")
        direct = compiled.direct
        torch.testing.assert_close(compiled(one, None), step(one, None))
        assert direct.active and direct.calls == 0  # the first call compiles, through torch.compile

        torch.testing.assert_close(compiled(one, None), step(one, None))
        assert direct.calls == 1 and compiled.graphs == 1

        torch.testing.assert_close(compiled(two, None), step(two, None))  # another shape: a new graph
        assert direct.calls == 1 and compiled.graphs == 2
        torch.testing.assert_close(compiled(two, None), step(two, None))
        torch.testing.assert_close(compiled(one, None), step(one, None))  # the first entry again, directly
        assert direct.calls == 3 and compiled.graphs == 2

        opts["scale"] = 3.0  # a value the trace read: Dynamo traces again, and so must we
        torch.testing.assert_close(compiled(one, None), step(one, None))
        assert compiled.graphs == 3 and direct.calls == 3
        torch.testing.assert_close(compiled(one, None), step(one, None))
        assert direct.calls == 4
    torch.testing.assert_close(compiled(one, None), step(one, None))  # grad mode on: a guard of Dynamo's
    assert compiled.graphs == 4 and direct.calls == 4
    assert compiled.report().compile_info()["direct_calls"] == 4


def test_a_step_torch_compile_cannot_call_directly_runs_through_it():
    """A callable object is no function whose code Dynamo's cache is kept on: every call goes
    through torch.compile, and the report says no call ran directly."""

    class Step:
        def __init__(self):
            self.lin = torch.nn.Linear(8, 8)

        def __call__(self, x, _positions):
            return self.lin(x)

    step, x = Step(), torch.randn(1, 1, 8)
    with torch.no_grad():
        compiled = compile_inductor(step, False, "cpu")
        for _ in range(3):
            torch.testing.assert_close(compiled(x, None), step(x, None))
    assert not compiled.direct.active and compiled.report().compile_info()["direct_calls"] == 0
