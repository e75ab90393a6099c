"""A deliberately wrong op table for the accuracy gate on several ranks (tests/test_accuracy_ranks.py).

Why a module of its own: the ranks of a multi-device candidate are other processes, so an --ops
table reaches them only through the module that defines it, which they import
(tools/rank_generate.py); registering here, at import time, is what makes that work.
"""

from __future__ import annotations

from executor import ops
from executor.ops import reference

WRONG_EPS = "wrong_eps_on_ranks"


def rms_norm_wrong_eps(x, weight, eps):
    return reference.rms_norm(x, weight, 1.0)  # epsilon 1.0 instead of the model's ~1e-6


ops.register(WRONG_EPS, {"rms_norm": rms_norm_wrong_eps}, base="reference")
