"""The recipe executor.

Importing it sets one process default before torch loads: OpenMP threads that finish a parallel
region sleep instead of spinning (`OMP_WAIT_POLICY=PASSIVE`). A decode step runs hundreds of
short parallel regions; on a host shared with another busy process, libgomp's default spinning
burns the time slices of the very thread the others wait for, and a 1 ms step became 300 ms
(BENCHMARKS.md, "Under load", measured with benchmarks/load_bench.py). libgomp reads the policy
once, when it loads, so this must happen before `import torch`; it has no effect in a process
that imported torch first. A policy the user set is kept; `CANN_RECIPES_OMP_DEFAULTS=0` leaves
the environment alone (load_bench uses it to measure libgomp's own default).
"""

import os

if os.environ.get("CANN_RECIPES_OMP_DEFAULTS", "1") != "0":
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
