"""executor/ops/reference.py against the torch_npu semantics of shared/reference/ascend-apis.md.

Every expected value here is computed a different way from the code under test (hand formulas,
explicit loops, torch's own scaled_dot_product_attention), because the reference ops are what
the NPU kernels and the CPU/CUDA paths are both held to.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from executor import ops
from executor.ops import reference


def test_rms_norm_hand_computed():
    x = torch.tensor([[3.0, 4.0], [1.0, -1.0]])
    w = torch.tensor([2.0, 0.5])
    y = reference.rms_norm(x, w, 0.0)
    r0, r1 = math.sqrt((9 + 16) / 2), 1.0  # root mean square of each row
    expected = torch.tensor([[2 * 3 / r0, 0.5 * 4 / r0], [2 * 1 / r1, 0.5 * -1 / r1]])
    torch.testing.assert_close(y, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_normalises_in_fp32_casts_then_scales(dtype):
    torch.manual_seed(0)
    x, w = (torch.randn(3, 64) * 5).to(dtype), (torch.rand(64) + 0.5).to(dtype)
    eps = 1e-6
    normed = torch.stack([row.double() / torch.sqrt((row.double() ** 2).mean() + eps) for row in x.float()])
    expected = w * normed.to(dtype)  # cast to x.dtype BEFORE the weight multiply
    y = reference.rms_norm(x, w, eps)
    assert y.dtype == dtype
    torch.testing.assert_close(y, expected, rtol=0, atol=0 if dtype == torch.bfloat16 else 1e-6)


def test_rms_norm_eps_is_used():
    x, w = torch.full((1, 4), 1e-3), torch.ones(4)
    torch.testing.assert_close(reference.rms_norm(x, w, 1e-6), x / math.sqrt(1e-6 + 1e-6))


def test_add_rms_norm_returns_normed_sum_and_sum():
    torch.manual_seed(1)
    x, res, w = torch.randn(2, 5, 16), torch.randn(2, 5, 16), torch.rand(16) + 0.5
    y, x_sum = reference.add_rms_norm(x, res, w, 1e-6)
    s = x + res
    torch.testing.assert_close(x_sum, s)
    torch.testing.assert_close(y, w * s / torch.sqrt(s.pow(2).mean(-1, keepdim=True) + 1e-6))


def test_swiglu_first_half_is_the_gate():
    a, b = torch.tensor([[1.0, -2.0]]), torch.tensor([[3.0, 0.5]])
    y = reference.swiglu(torch.cat([a, b], dim=-1))
    silu = lambda t: t / (1 + torch.exp(-t))  # noqa: E731
    torch.testing.assert_close(y, silu(a) * b)
    assert not torch.allclose(y, silu(b) * a)


def test_rotary_half_matches_explicit_pair_rotation():
    torch.manual_seed(2)
    b, h, s, d = 1, 2, 3, 8
    x = torch.randn(b, h, s, d)
    angle = torch.rand(s, d // 2) * 6  # one angle per (position, pair)
    cos = torch.cat([angle.cos(), angle.cos()], -1).view(1, 1, s, d)
    sin = torch.cat([angle.sin(), angle.sin()], -1).view(1, 1, s, d)
    expected = torch.empty_like(x)
    half = d // 2
    for p in range(s):
        for i in range(half):  # "half" mode rotates the pair (i, i + D/2) by angle[p, i]
            c, sn = angle[p, i].cos(), angle[p, i].sin()
            lo, hi = x[..., p, i], x[..., p, i + half]
            expected[..., p, i] = lo * c - hi * sn
            expected[..., p, i + half] = hi * c + lo * sn
    torch.testing.assert_close(reference.rotary_mul(x, cos, sin), expected)


@pytest.mark.parametrize("hq, hkv", [(4, 4), (4, 2), (6, 1)])
def test_attention_matches_sdpa_with_expanded_gqa(hq, hkv):
    torch.manual_seed(3)
    b, s, t, d, scale = 2, 3, 7, 8, 0.2
    q, k, v = torch.randn(b, hq, s, d), torch.randn(b, hkv, t, d), torch.randn(b, hkv, t, d)
    pos = torch.tensor([[4, 5, 6], [0, 1, 2]])
    masked_out = torch.arange(t).view(1, 1, 1, t) > pos.view(b, 1, s, 1)  # True = masked out
    g = hq // hkv
    expected = F.scaled_dot_product_attention(
        q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1), attn_mask=~masked_out, scale=scale
    )  # SDPA: True = attend
    out = reference.attention(q, k, v, masked_out, scale)
    assert out.shape == (b, hq, s, d)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def _explicit_attention(q, k, v, masked_out, scale):
    g = q.shape[1] // k.shape[1]
    scores = q @ k.repeat_interleave(g, 1).transpose(-1, -2) * scale
    return scores.masked_fill(masked_out, float("-inf")).softmax(-1) @ v.repeat_interleave(g, 1)


def test_prefill_attention_causal_and_other_square_masks():
    """A square causal mask takes SDPA's is_causal path; a square mask that is not causal (here a
    query that may not see slot 0) must still be honoured, not mistaken for the causal one."""
    torch.manual_seed(4)
    b, hq, hkv, s, d, scale = 2, 4, 2, 6, 8, 0.3
    q, k, v = torch.randn(b, hq, s, d), torch.randn(b, hkv, s, d), torch.randn(b, hkv, s, d)
    causal = (torch.arange(s).view(1, 1, 1, s) > torch.arange(s).view(1, 1, s, 1)).expand(b, 1, s, s).clone()
    other = causal.clone()
    other[1, 0, 3, 0] = True
    for mask in (causal, other):
        expected = _explicit_attention(q, k, v, mask, scale)
        torch.testing.assert_close(reference.attention(q, k, v, mask, scale), expected, rtol=1e-5, atol=1e-5)
    assert reference.is_causal_mask(causal) and not reference.is_causal_mask(other)
    causal[0, 0, 2, 1] = True  # changed in place after its verdict was kept: checked again
    assert not reference.is_causal_mask(causal)
    with torch.inference_mode():  # no version counter there: checked every time, no error
        fresh = torch.ones(s, s, dtype=torch.bool).triu(1).expand(b, 1, s, s)
        assert reference.is_causal_mask(fresh)


def test_attention_mask_polarity_true_means_ignored():
    q = torch.ones(1, 1, 1, 2)
    k = torch.ones(1, 1, 3, 2)
    v = torch.tensor([[[[1.0, 0.0], [0.0, 1.0], [5.0, 5.0]]]])
    mask = torch.tensor([[[[False, False, True]]]])  # the third key must not contribute
    torch.testing.assert_close(reference.attention(q, k, v, mask, 1.0), torch.tensor([[[[0.5, 0.5]]]]))


def test_moe_gating_is_softmax_then_topk_in_fp32():
    logits = torch.tensor([[0.0, 2.0, 1.0, -1.0], [3.0, 3.5, -2.0, 0.0]], dtype=torch.bfloat16)
    w, idx = reference.moe_gating_top_k_softmax(logits, 2)
    p = torch.exp(logits.double()) / torch.exp(logits.double()).sum(-1, keepdim=True)
    assert idx.tolist() == [[1, 2], [1, 0]]
    assert w.dtype == torch.float32
    torch.testing.assert_close(w.double(), torch.gather(p, 1, idx), rtol=1e-6, atol=1e-6)


def test_moe_init_routing_stable_sort_and_counts():
    n, k, e = 4, 2, 5
    x = torch.arange(n * 3, dtype=torch.float32).view(n, 3)
    expert_idx = torch.tensor([[2, 0], [0, 2], [4, 2], [0, 1]])
    expanded_x, order, counts = reference.moe_init_routing(x, expert_idx, e)
    expected_order = [i * k + j for ex in range(e) for i in range(n) for j in range(k) if expert_idx[i, j] == ex]
    assert order.tolist() == expected_order == [1, 2, 6, 7, 0, 3, 5, 4]  # by expert, ties by (token, slot)
    assert torch.equal(expanded_x, x[[p // k for p in expected_order]])
    assert counts.tolist() == [3, 1, 3, 0, 1]


def test_grouped_matmul_matches_per_expert_loop():
    torch.manual_seed(4)
    counts = torch.tensor([3, 0, 1, 2])
    x, w = torch.randn(6, 5), torch.randn(4, 5, 7)
    expected = torch.cat([x[0:3] @ w[0], x[3:4] @ w[2], x[4:6] @ w[3]])
    torch.testing.assert_close(reference.grouped_matmul(x, w, counts), expected)


def test_moe_pipeline_equals_per_token_loop():
    """gating -> init_routing -> grouped_matmul -> un-permute = sum_j w_ij * x_i @ W[e_ij]."""
    torch.manual_seed(5)
    n, e, k, h, f = 6, 4, 2, 5, 3
    x, router, w = torch.randn(n, h), torch.randn(n, e), torch.randn(e, h, f)
    weights, idx = reference.moe_gating_top_k_softmax(router, k)
    expanded_x, order, counts = reference.moe_init_routing(x, idx, e)
    y_sorted = reference.grouped_matmul(expanded_x, w, counts)
    y = torch.zeros(n * k, f).index_copy(0, order, y_sorted).view(n, k, f)
    out = (y * weights.unsqueeze(-1)).sum(1)
    expected = torch.stack([sum(weights[i, j] * (x[i] @ w[idx[i, j]]) for j in range(k)) for i in range(n)])
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_ops_interface_rejects_unknown_names():
    with pytest.raises(ValueError, match="unknown ops"):
        ops.register("bad", {"softmax": reference.swiglu})
    with pytest.raises(ValueError, match="not registered"), ops.using("nope"):
        pass
    assert ops.active() == "reference"


def test_kv_update_writes_each_row_at_its_own_positions_in_place():
    cache = torch.zeros(2, 3, 10, 4)
    new = torch.randn(2, 3, 2, 4)
    positions = torch.tensor([[4, 5], [7, 8]])  # rows of different lengths
    out = reference.kv_update(cache, new, positions)
    assert out.data_ptr() == cache.data_ptr()
    assert torch.equal(cache[0, :, 4:6], new[0]) and torch.equal(cache[1, :, 7:9], new[1])
    cache[0, :, 4:6] = 0
    cache[1, :, 7:9] = 0
    assert not cache.any()  # nothing else written


def test_kv_update_stays_in_place_in_a_compiled_step():
    """The reason kv_update is index_put_: Inductor keeps it in place on a graph input (a scatter_
    there became a copy of the whole cache per step). Checked on the generated code: no buffer of
    the cache's size is allocated."""
    from torch._inductor.utils import run_and_get_code

    cache = torch.zeros(1, 2, 512, 8)

    def step(cache, new, positions):
        return reference.kv_update(cache, new, positions).sum()

    _, code = run_and_get_code(torch.compile(step, fullgraph=True), cache, torch.ones(1, 2, 1, 8), torch.tensor([[3]]))
    assert cache[0, :, 3].eq(1).all() and cache.sum() == 16
    assert "empty_strided_cpu((1, 2, 512, 8)" not in "".join(code)


def test_large_tensors_get_huge_pages():
    """Importing executor asks PyTorch's allocator for transparent huge pages (THP_MEM_ALLOC_ENABLE)
    before the first tensor exists, so a 64 MiB tensor lands on 2 MiB pages where the kernel
    allows them on request; a value the user set is kept."""
    import os
    import subprocess
    import sys

    from executor import thp_mode

    if thp_mode() not in ("madvise", "always"):
        pytest.skip(f"transparent huge pages: {thp_mode()}")
    code = (
        "import os, executor, torch\n"
        "x = torch.ones(1 << 24)\n"
        "huge = [l.split()[1] for l in open('/proc/self/smaps_rollup') if l.startswith('AnonHugePages')]\n"
        "print(os.environ['THP_MEM_ALLOC_ENABLE'], int(huge[0]) >= 32 * 1024)"
    )
    env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    root = str(Path(__file__).resolve().parent.parent)

    def run(**extra) -> str:
        out = subprocess.run([sys.executable, "-c", code], env=env | extra, cwd=root, capture_output=True, text=True)
        return out.stdout.strip()

    assert run() == "1 True"
    assert run(THP_MEM_ALLOC_ENABLE="0").startswith("0 ")


def test_freed_memory_is_kept_for_the_next_tensor():
    """Importing executor makes glibc's malloc keep freed blocks (no mmap, no trim below 1 GiB), so
    a tensor made every decode step (the logits) reuses pages instead of faulting in new ones:
    a freed 64 MiB tensor stays resident. Settings the user gave glibc, and
    CANN_RECIPES_MALLOC_DEFAULTS=0, leave malloc alone (then its pages go back to the kernel)."""
    import os
    import subprocess
    import sys

    from executor import MALLOC_POLICY

    if not MALLOC_POLICY.startswith("glibc"):
        pytest.skip(f"malloc: {MALLOC_POLICY}")
    code = (
        "import executor, torch\n"
        "from executor.memory import process_resident\n"
        "before = process_resident()\n"
        "x = torch.ones(1 << 24); del x\n"
        "kept = process_resident() - before >= 48 << 20\n"
        "print(executor.MALLOC_POLICY.split(':')[0].split(' (')[0], kept)"
    )
    names = ("CANN_RECIPES_MALLOC_DEFAULTS", "MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_MAX_", "GLIBC_TUNABLES")
    env = {k: v for k, v in os.environ.items() if k not in names}
    root = str(Path(__file__).resolve().parent.parent)

    def run(**extra) -> str:
        out = subprocess.run([sys.executable, "-c", code], env=env | extra, cwd=root, capture_output=True, text=True)
        return out.stdout.strip() or out.stderr

    default = run()
    assert default.startswith("glibc") and default.endswith(" True"), default
    assert run(CANN_RECIPES_MALLOC_DEFAULTS="0") == "system default False"
    assert run(MALLOC_TRIM_THRESHOLD_="131072") == "left to the user's settings False"


def test_the_memory_check_counts_memory_this_process_freed_as_available():
    """What the process freed and malloc kept is invisible to MemAvailable: the memory pre-flight
    gives those pages back before it reads what is free, or a process that loaded and freed one
    model would be refused the next (executor.release_freed_memory)."""
    import subprocess
    import sys

    from executor import MALLOC_POLICY

    if not MALLOC_POLICY.startswith("glibc"):
        pytest.skip(f"malloc: {MALLOC_POLICY}")
    code = (
        "import executor, torch\n"
        "from executor.memory import available, process_resident\n"
        "before = process_resident()\n"
        "x = torch.ones(1 << 26); del x\n"  # 256 MiB, freed and kept
        "kept = process_resident() - before\n"
        "free, source, resident = available('cpu')\n"
        "print(kept >> 20, (resident - before) >> 20)"
    )
    root = str(Path(__file__).resolve().parent.parent)
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    kept_mb, after_mb = map(int, out.stdout.split())
    assert kept_mb >= 200 and after_mb < 64, (kept_mb, after_mb)


def test_openmp_wait_policy_follows_the_host(tmp_path):
    """executor picks the OpenMP wait policy before torch loads (benchmarks/load_bench.py: spinning
    threads made ge_graph decode 60-90x slower next to a busy neighbour, sleeping ones made idle
    steps 2-8x slower): PASSIVE next to a busy neighbour, libgomp's default on an idle host; a
    policy the user set is kept, and CANN_RECIPES_OMP_DEFAULTS=0 leaves the environment alone."""
    import os
    import subprocess
    import sys

    code = "import os, executor, torch; print(os.environ.get('OMP_WAIT_POLICY', '-'))"
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "CANN_RECIPES_OMP_DEFAULTS")}
    root = str(Path(__file__).resolve().parent.parent)

    def policy(**extra) -> str:
        run = subprocess.run([sys.executable, "-c", code], env=env | extra, cwd=root, capture_output=True, text=True)
        return run.stdout.strip()

    assert policy(OMP_WAIT_POLICY="ACTIVE") == "ACTIVE"
    assert policy(CANN_RECIPES_OMP_DEFAULTS="0") == "-"
    spin = "import time\nt = time.time()\nwhile time.time() - t < 20:\n    pass\n"
    cores = len(os.sched_getaffinity(0))
    neighbours = [subprocess.Popen([sys.executable, "-c", spin]) for _ in range(cores)]
    try:
        time.sleep(1.0)
        assert policy() == "PASSIVE"
    finally:
        for p in neighbours:
            p.kill()
            p.wait()
