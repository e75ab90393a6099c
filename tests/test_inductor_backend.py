"""The CPU graph mode's lowering of large decode GEMVs (executor.backends.inductor).

The tiny test models never reach the size where a GEMV is rewritten, so this checks the
rewrite directly: which linears it takes, and that compiled code computes the same thing, with
and without a SuperKernel scope around it.
"""

import pytest
import torch

from executor.backends.inductor import INDUCTOR_DECOMPOSE_MAX_DIM, _gemv_to_reduction, compile_inductor
from executor.scope import superkernel_scope


def _trace(fn, *args) -> torch.fx.GraphModule:
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch.compile(fn, backend=capture, fullgraph=True, dynamic=False)(*args)
    return graphs[0]


def test_only_single_row_linears_above_inductors_own_limit_are_rewritten():
    big = torch.nn.Linear(64, INDUCTOR_DECOMPOSE_MAX_DIM + 64)
    small = torch.nn.Linear(64, 32, bias=False)
    gm = _trace(lambda x, y: (big(x), small(x), big(y)), torch.randn(1, 1, 64), torch.randn(2, 64))
    assert _gemv_to_reduction(gm) == 1  # big(x) only: small is Inductor's, y has two rows
    linears = [n for n in gm.graph.nodes if n.target is torch._C._nn.linear]
    assert len(linears) == 2
    # The row is stored before the reduction reads it, so Inductor cannot recompute whatever made
    # it (a norm) once per weight row inside the reduction.
    force = torch.ops.prims.inductor_force_stride_order.default
    assert [n.target for n in gm.graph.nodes].count(force) == 1


@pytest.mark.parametrize("superkernel", [False, True])
def test_large_gemv_compiles_to_the_same_result(superkernel):
    torch.manual_seed(0)
    lin = torch.nn.Linear(256, 3 * INDUCTOR_DECOMPOSE_MAX_DIM)
    norm = torch.nn.RMSNorm(256, eps=1e-6)

    def step(x, _positions):
        with superkernel_scope(superkernel, "big", ""):
            return torch.relu(lin(norm(x + 1.0))).sum(-1)

    x = torch.randn(1, 1, 256)
    with torch.no_grad():
        compiled = compile_inductor(step, superkernel, "cpu")
        got = compiled(x, None)
        want = step(x, None)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-3)
    if superkernel:
        scope = compiled.compiler.stats.scopes["big"]
        assert scope.segments == 1 and scope.launches == 1
