"""Checkpoint loading: HF safetensors (single or sharded) -> our module names, strictly.

Why a mapping table: our layers fuse q/k/v into one `qkv_proj` and gate/up into one
`gate_up_proj` (one matmul each in decode, and the layout npu_swiglu expects). The table
says how HF tensors stack into them, so model code never handles checkpoint names. Every
parameter must be loaded and every checkpoint tensor consumed: a partial load is an error,
never random weights in disguise.

Why lazy: on several devices each rank keeps only its slices of most weights (a ShardSpec on
the parameter, executor.parallel.shards). The mapping therefore builds a tree of *sources*
(a tensor in a file, a concatenation of parts, a stack of experts) and each parameter reads
exactly its ranges through it, each HF part sliced before fusing (safetensors' get_slice reads
only the rows asked for; a column block touches every row's pages but keeps only the block).
So a rank's memory is its share of the sharded weights, never a whole file.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file

from executor.errors import RecipeError
from executor.parallel.shards import Index, read_index, shard_spec

# fused name -> HF parts, concatenated along dim 0 in this order
STACKED: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class LoadError(RecipeError):
    """A checkpoint problem, naming the file or tensor."""


def checkpoint_files(model_path: str | Path) -> list[Path]:
    root = Path(model_path)
    if not root.is_dir():
        raise LoadError(f"{root}: checkpoint directory not found")
    index = root / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as exc:
            raise LoadError(f"{index}: not a valid safetensors index ({exc.__class__.__name__})") from None
        files = [root / f for f in sorted(set(weight_map.values()))]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise LoadError(f"{index}: shard {missing[0]} is missing")
        return files
    single = root / "model.safetensors"
    if single.is_file():
        return [single]
    raise LoadError(
        f"{root}: no model.safetensors or model.safetensors.index.json (only safetensors checkpoints are supported)"
    )


# ----------------------------------------------------------------------------- sources
class Source:
    """A tensor of the checkpoint that is read on demand, whole or in part."""

    shape: tuple[int, ...]

    def read(self, index: Index | None = None) -> torch.Tensor:
        """The ranges of `index` (per dimension; None = all), or the whole tensor."""
        return read_index(self._box, self.shape, index or (None,) * len(self.shape))

    def _box(self, box: tuple[tuple[int, int], ...]) -> torch.Tensor:  # one [start, stop) per dimension
        raise NotImplementedError


class InMemory(Source):
    def __init__(self, tensor: torch.Tensor):
        self.tensor, self.shape = tensor, tuple(tensor.shape)

    def _box(self, box):
        return self.tensor[tuple(slice(a, b) for a, b in box)]


class InFile(Source):
    """One tensor of a safetensors file, read with get_slice (only the requested box)."""

    def __init__(self, handle, name: str, path: Path):
        self.slice, self.name, self.path = handle.get_slice(name), name, path
        self.shape = tuple(self.slice.get_shape())

    def _box(self, box):
        try:
            return self.slice[tuple(slice(a, b) for a, b in box)]
        except (SafetensorError, OSError, ValueError) as exc:
            raise LoadError(f"{self.path}: cannot read tensor {self.name} ({str(exc).splitlines()[0][:120]})") from None


class Concat(Source):
    """Parts joined along `dim` (q/k/v -> qkv_proj): a range of the result reads only the
    overlapping ranges of the parts."""

    def __init__(self, parts: Sequence[Source], dim: int = 0):
        self.parts, self.dim = list(parts), dim
        first = parts[0].shape
        self.shape = (*first[:dim], sum(p.shape[dim] for p in parts), *first[dim + 1 :])

    def _box(self, box):
        a, b = box[self.dim]
        out, offset = [], 0
        for part in self.parts:
            n = part.shape[self.dim]
            lo, hi = max(a, offset), min(b, offset + n)
            if lo < hi:
                sub = list(box)
                sub[self.dim] = (lo - offset, hi - offset)
                out.append(part._box(tuple(sub)))
            offset += n
        return torch.cat(out, dim=self.dim)


class Stack(Source):
    """Equal-shaped parts stacked on a new dimension 0 (one tensor per expert -> experts)."""

    def __init__(self, parts: Sequence[Source]):
        self.parts = list(parts)
        self.shape = (len(self.parts), *self.parts[0].shape)

    def _box(self, box):
        (a, b), rest = box[0], tuple(box[1:])
        return torch.stack([self.parts[e]._box(rest) for e in range(a, b)])


def as_source(value: Source | torch.Tensor) -> Source:
    return value if isinstance(value, Source) else InMemory(value)


@contextlib.contextmanager
def open_checkpoint(model_path: str | Path) -> Iterator[dict[str, Source]]:
    """Every tensor of the checkpoint as a lazily read source; files stay open inside the block."""
    sources: dict[str, Source] = {}
    with contextlib.ExitStack() as stack:
        for f in checkpoint_files(model_path):
            try:
                handle = stack.enter_context(safe_open(str(f), "pt"))
                sources.update({name: InFile(handle, name, f) for name in handle.keys()})  # noqa: SIM118 (not iterable)
            except (SafetensorError, OSError, ValueError) as exc:
                raise LoadError(f"{f}: cannot read safetensors file ({str(exc).splitlines()[0][:120]})") from None
        yield sources


def read_checkpoint(model_path: str | Path) -> dict[str, torch.Tensor]:
    """The whole checkpoint in memory (tests and tools; loading a model reads only its slices)."""
    tensors: dict[str, torch.Tensor] = {}
    for f in checkpoint_files(model_path):
        try:
            tensors.update(load_file(str(f)))
        except (SafetensorError, OSError, ValueError) as exc:
            raise LoadError(f"{f}: cannot read safetensors file ({str(exc).splitlines()[0][:120]})") from None
    return tensors


def remap(hf: dict[str, Source | torch.Tensor], stacked: dict[str, tuple[str, ...]] = STACKED) -> dict[str, Source]:
    """HF names -> ours: drop the `model.` prefix and join the parts of fused projections."""
    out: dict[str, Source] = {}
    pending: dict[str, dict[int, Source]] = {}
    for name, tensor in hf.items():
        if name.endswith(IGNORED_SUFFIXES):
            continue
        name = name.removeprefix("model.")
        for fused, parts in stacked.items():
            hit = next((j for j, p in enumerate(parts) if f".{p}." in name), None)
            if hit is not None:
                pending.setdefault(name.replace(f".{parts[hit]}.", f".{fused}."), {})[hit] = as_source(tensor)
                break
        else:
            out[name] = as_source(tensor)
    for name, parts in pending.items():
        fused = next(f for f in stacked if f".{f}." in name)
        if len(parts) != len(stacked[fused]):
            missing = [p for j, p in enumerate(stacked[fused]) if j not in parts]
            raise LoadError(f"checkpoint has {name.replace(fused, '*')} without {', '.join(missing)}")
        out[name] = Concat([parts[j] for j in range(len(parts))], dim=0)
    return out


class NoInit(torch.overrides.TorchFunctionMode):
    """torch.nn.init as a no-op while a model is built whose every parameter is filled next
    (load_weights, init_random: both fill all of them) or never read (the pre-flight's meta model).
    PyTorch's default initialisation of the Qwen3-0.6B shape took 4.3-7.5 s of each run's start on
    the 2-core dev VM and was then overwritten; on the meta device its random fills are Python
    refs whose first call imports Dynamo, 2.3 s of an eager run that needs Dynamo nowhere else."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__module__", None) == "torch.nn.init":
            tensor = args[0] if args else kwargs.get("tensor")
            if isinstance(tensor, torch.Tensor):
                return tensor
        return func(*args, **kwargs)


def load_weights(
    model: torch.nn.Module,
    model_path: str | Path,
    dtype: torch.dtype,
    extra_remap: Callable[[dict], dict] | None = None,
) -> None:
    """Load a checkpoint into `model` in place, each parameter reading only its own part (its
    ShardSpec); any missing/unexpected/mis-shaped tensor is an error."""
    with open_checkpoint(model_path) as sources:
        state = remap(sources)
        if extra_remap is not None:
            state = extra_remap(state)
        own = model.state_dict(keep_vars=True)
        for ours, theirs in _tied(model).items():  # tied embeddings are saved once
            if ours in own and ours not in state and theirs in state:
                state[ours] = state[theirs]
        missing = sorted(set(own) - set(state))
        unexpected = sorted(set(state) - set(own))
        if missing or unexpected:
            what = f"missing {missing[:3]}" if missing else f"unexpected {unexpected[:3]}"
            raise LoadError(f"{model_path}: checkpoint does not match the model architecture: {what}")
        for name, param in own.items():
            full = _full_shape(param)
            if tuple(state[name].shape) != full:
                raise LoadError(
                    f"{model_path}: tensor {name} has shape {tuple(state[name].shape)}, model expects {full}"
                )
        with torch.no_grad():
            for name, param in own.items():
                spec = shard_spec(param)
                param.copy_(state[name].read(spec.index if spec else None).to(dtype))


def _tied(model: torch.nn.Module) -> dict[str, str]:
    """{parameter: the checkpoint tensor it is filled from} for weights stored once (tied embeddings)."""
    tied = getattr(model, "tied_weights", None)
    return tied() if tied is not None else {}


def _full_shape(param: torch.Tensor) -> tuple[int, ...]:
    spec = shard_spec(param)
    return spec.full_shape if spec else tuple(param.shape)


def init_random(model: torch.nn.Module, seed: int, std: float = 0.1) -> None:
    """Deterministic random weights (with_ckpt: false): normal linears/embeddings, unit norms.

    std 0.1 (not HF's 0.02) so a random debug model's logits are peaked enough that greedy
    decoding does not repeat one token forever, which makes token-level checks meaningful.
    Each tensor is drawn at its full size and cut to the rank's part, and tied weights are
    filled from the tensor they tie to, so every layout draws the same model as one device."""
    gen = torch.Generator().manual_seed(seed)
    tied = _tied(model)
    drawn: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        params = dict(model.named_parameters())
        for name, p in params.items():
            spec = shard_spec(p)
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            elif name in tied and tied[name] in params:
                continue  # filled below from the tensor it ties to
            else:
                full = torch.randn(_full_shape(p), generator=gen) * std
                p.copy_(spec.take(full) if spec else full)
                if name in tied.values():
                    drawn[name] = full
        for name, source in tied.items():
            if name in params and source in drawn:
                spec = shard_spec(params[name])
                params[name].copy_(spec.take(drawn[source]) if spec else drawn[source])
