"""Large CPU weights and KV caches on whole 2 MiB pages (executor/huge_pages.py): where they land,
that their pages are huge ones, that tied weights stay tied, and that the runner, the packed copies
and the KV cache use it."""

from __future__ import annotations

import ctypes
import struct

import pytest
import torch

from executor import huge_pages, thp_mode
from executor.backends import packed_linear
from executor.kv_cache import KVCache

REGION = 2 << 20
needs_thp = pytest.mark.skipif(not huge_pages.wanted(), reason=f"huge pages not wanted here (kernel: {thp_mode()})")


def huge_share(t: torch.Tensor) -> float | None:
    """Share of `t`'s 4 KiB pages that belong to a transparent huge page (the page map and the
    kernel's page flags; None where this process may not read them)."""
    first, last = t.data_ptr() // 4096, (t.data_ptr() + t.numel() * t.element_size() - 1) // 4096
    try:
        with open("/proc/self/pagemap", "rb") as pm, open("/proc/kpageflags", "rb") as flags:
            pm.seek(first * 8)
            entries = struct.unpack(f"<{last - first + 1}Q", pm.read((last - first + 1) * 8))
            frames = [e & ((1 << 55) - 1) for e in entries if e >> 63]  # present pages
            if not frames or not any(frames):
                return None  # frame numbers hidden (not CAP_SYS_ADMIN)
            huge = 0
            for frame in frames:
                flags.seek(frame * 8)
                huge += struct.unpack("<Q", flags.read(8))[0] >> 22 & 1  # KPF_THP
    except OSError:
        return None
    return huge / len(entries)


class Tied(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.big = torch.nn.Linear(1024, 1536, bias=False)  # 6 MiB in fp32
        self.same = torch.nn.Linear(1024, 1536, bias=False)
        self.same.weight = self.big.weight  # one Parameter, two modules
        self.shared = torch.nn.Parameter(self.big.weight.data)  # another Parameter, the same storage
        self.small = torch.nn.Linear(64, 64)


@needs_thp
def test_large_weights_move_to_region_boundaries_and_stay_tied():
    torch.manual_seed(0)
    model = Tied()
    values = model.big.weight.detach().clone()
    small_at = model.small.weight.data_ptr()
    placed = huge_pages.place(model)
    assert placed.moved == 1 and placed.nbytes == 6 << 20, placed.to_metrics()
    assert model.big.weight.data_ptr() % REGION == 0
    assert torch.equal(model.big.weight, values) and model.big.weight.is_contiguous()
    assert model.same.weight is model.big.weight
    assert model.shared.data_ptr() == model.big.weight.data_ptr()  # still one copy
    assert model.small.weight.data_ptr() == small_at  # below one region: left where it was
    assert placed.to_metrics().startswith("1 tensors (6 MiB) on 2 MiB boundaries")


@needs_thp
def test_placed_weights_are_on_huge_pages():
    """Every page of a placed weight is part of a huge page, also when the tensor it came from was
    not (allocated at a 4 KiB offset, in memory that glibc hands out again)."""
    torch.manual_seed(0)
    weights = [torch.randn(1536, 1024) for _ in range(4)]  # 6 MiB each, one after another
    if huge_share(weights[1]) is None:
        pytest.skip("the kernel's page flags are not readable here")
    # 32 MiB that glibc's malloc faults in as small pages (no advice) and keeps when freed
    # (executor/__init__.py): the copy's allocation below is carved from it
    libc = ctypes.CDLL(None)
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    block = libc.malloc(32 << 20)
    ctypes.memset(block, 1, 32 << 20)
    libc.free(block)
    placed, collapsed = huge_pages.aligned_copy(weights[1])
    assert collapsed, "MADV_COLLAPSE failed (Linux older than 6.1?)"
    assert torch.equal(placed, weights[1])
    assert huge_share(placed) == 1.0


def test_nothing_moves_when_huge_pages_are_off(monkeypatch):
    monkeypatch.setenv("THP_MEM_ALLOC_ENABLE", "0")
    model = Tied()
    at = model.big.weight.data_ptr()
    placed = huge_pages.place(model)
    assert placed.moved == 0 and model.big.weight.data_ptr() == at
    assert placed.to_metrics().startswith("not placed (THP_MEM_ALLOC_ENABLE=0, kernel: ")


@needs_thp
def test_a_packed_copy_is_the_same_layout_on_a_region_boundary():
    """pack_rows makes its copy with huge_pages.contiguous: the values and strides of the plain
    re-layout, starting on a 2 MiB boundary."""
    torch.manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        weight = torch.randn(1024, 1024).to(dtype)  # 2-4 MiB
        for cols in (16, 64):
            packed = packed_linear.pack_rows(weight, cols)
            n, k = weight.shape
            if dtype == torch.bfloat16 and cols == 64:
                plain = weight.view(n // cols, cols, k // 2, 2).permute(0, 2, 1, 3).contiguous()
            elif dtype == torch.bfloat16:
                plain = weight.view(n // cols, 2, cols // 2, k).permute(0, 3, 2, 1).reshape(n // cols, k, cols)
            else:
                plain = weight.view(n // cols, cols, k).permute(0, 2, 1).contiguous()
            assert packed.data_ptr() % REGION == 0, (dtype, cols)
            assert packed.is_contiguous() and torch.equal(packed, plain), (dtype, cols)


def test_the_runner_places_its_weights(make_qwen_runner):
    """The built-in model's tied 3 MiB embedding (fp32) is the one weight of a region or more."""
    runner = make_qwen_runner(
        "builtin", "model_config.exe_mode=eager", "model_config.enable_superkernel=false", "model_config.dtype=float32"
    )
    embed = runner.model.embed_tokens.weight
    if huge_pages.wanted():
        assert runner.placement.moved == 1 and embed.data_ptr() % REGION == 0
        assert runner.model.lm_head.weight.data_ptr() == embed.data_ptr()
    else:
        assert runner.placement.to_metrics().startswith("not placed")
    runner.prepare(1)
    placed = runner.cache.placement()  # the built-in model's cache is far under a region a tensor
    assert placed.startswith("not placed (") and ("under one 2 MiB region" in placed) == huge_pages.wanted(), placed


@needs_thp
def test_a_large_cpu_kv_cache_is_zeros_on_huge_pages():
    """Each layer's K and V of 2 MiB or more start on a region boundary, hold zeros, are counted as
    collapsed, and are huge pages where the page flags can be read; a row view shares them."""
    cache = KVCache(2, 1, 2, 4096, 128, torch.float32)  # 4 MiB a tensor
    assert cache.on_huge_pages == 4
    assert cache.placement() == "4 layer tensors on 2 MiB boundaries, 4 of them collapsed into huge pages"
    for t in cache.k + cache.v:
        assert t.data_ptr() % REGION == 0 and t.shape == (1, 2, 4096, 128) and t.dtype == torch.float32
        assert t.is_contiguous() and not t.any()
        share = huge_share(t)
        assert share in (None, 1.0), share
    view = cache.rows(0, 1, 64)
    assert view.k[0].data_ptr() == cache.k[0].data_ptr() and view.on_huge_pages == 4
    cache.update(1, torch.ones(1, 2, 1, 128), torch.ones(1, 2, 1, 128), torch.tensor([[5]]))
    assert cache.k[1][0, :, 5].eq(1).all() and cache.k[1].sum() == 2 * 128  # an ordinary tensor to write


def test_a_small_or_unwanted_kv_cache_is_plain_zeros(monkeypatch):
    small = KVCache(2, 1, 2, 64, 16, torch.bfloat16)  # 4 KiB a tensor: under one region
    assert small.on_huge_pages == 0 and not any(t.any() for t in small.k + small.v)
    t, collapsed = huge_pages.zeros((1, 2, 64, 16), torch.bfloat16)
    assert not collapsed and t.dtype == torch.bfloat16 and not t.any()
    monkeypatch.setenv("THP_MEM_ALLOC_ENABLE", "0")
    large = KVCache(1, 1, 2, 4096, 128, torch.float32)
    assert large.on_huge_pages == 0 and not large.k[0].any()
    assert large.placement().startswith("not placed (THP_MEM_ALLOC_ENABLE=0, kernel: ")
    assert huge_pages.why_not().startswith("THP_MEM_ALLOC_ENABLE=0, kernel: ")
