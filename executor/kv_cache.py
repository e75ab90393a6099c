"""Static, preallocated KV cache.

Why static: the decode step must have the same shapes every step so it compiles once (GE
graph mode needs `dynamic=False`; Inductor would otherwise recompile). Every row owns slots
0..max_len-1; a token at absolute position p writes slot p, and attention masks slots > p.
"""

from __future__ import annotations

import torch

from executor import huge_pages, ops


class KVCache:
    def __init__(
        self,
        num_layers: int,
        batch: int,
        num_kv_heads: int,
        max_len: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ):
        shape = (batch, num_kv_heads, max_len, head_dim)  # (B, Hkv, T, D)
        self.on_huge_pages = 0  # CPU tensors collapsed into huge pages (executor/huge_pages.zeros)
        self.k = [self._zeros(shape, dtype, device) for _ in range(num_layers)]
        self.v = [self._zeros(shape, dtype, device) for _ in range(num_layers)]
        self.max_len = max_len

    def _zeros(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
        """A zeroed cache tensor; on the CPU a large one goes on huge pages, as the weights do."""
        if torch.device(device).type != "cpu":
            return torch.zeros(shape, dtype=dtype, device=device)
        t, collapsed = huge_pages.zeros(shape, dtype)
        self.on_huge_pages += collapsed
        return t

    def update(
        self, layer: int, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v (B, Hkv, S, D) at `positions` (B, S); return the full (B, Hkv, T, D) caches.
        The write is an op (ops.kv_update): how to update a graph input in place is backend-specific."""
        ops.kv_update(self.k[layer], k, positions)
        ops.kv_update(self.v[layer], v, positions)
        return self.k[layer], self.v[layer]

    def rows(self, start: int, stop: int, slots: int | None = None) -> KVCache:
        """A cache over rows [start, stop) (and only the first `slots` slots) that shares this
        one's storage (views): prefill of a group of rows writes straight into the full cache.
        Prefill starts at slot 0, so its S tokens need S slots: attending over all max_len slots
        would cost S x max_len instead of S x S."""
        slots = self.max_len if slots is None else slots
        view = KVCache.__new__(KVCache)
        view.k = [t[start:stop, :, :slots] for t in self.k]
        view.v = [t[start:stop, :, :slots] for t in self.v]
        view.max_len = slots
        view.on_huge_pages = self.on_huge_pages
        return view

    def placement(self) -> str:
        """metrics.json: how many layer tensors are on huge pages, or why none (huge_pages.zeros)."""
        if self.k[0].device.type != "cpu":
            return f"not placed (a {self.k[0].device.type} cache)"
        if not huge_pages.wanted():
            return f"not placed ({huge_pages.why_not()})"
        total = 2 * len(self.k)
        if self.nbytes() // total < huge_pages.REGION:
            return f"not placed ({self.nbytes() // total} bytes a layer tensor, under one 2 MiB region)"
        return f"{total} layer tensors on 2 MiB boundaries, {self.on_huge_pages} of them collapsed into huge pages"

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)
