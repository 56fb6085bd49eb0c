"""A growing mixer state as fixed-size tensors per sequence, for serving's state blocks.

DeepSeek-V4's attention with compressors (docs/design.md) keeps in its cache layer
(transformers' ``DeepseekV4HCACache`` / ``DeepseekV4CSACache``, sliding-window layers) state
that grows with the sequence, but every part of it is bounded by the context and its length is
a function of how many tokens the sequence has run (``n``):

- the sliding-window keys (K = V): ``min(n, window - 1)`` of them;
- per compressor entry (``"compressor"``, and the CSA indexer's ``"indexer"``), the projected
  keys and gates of the tokens since the last full window: ``n % rate``; the compressed entries
  emitted so far: ``n // rate``; for CSA the previous window's overlap half, once one closed.

So a deployment whose sequences reach at most ``max_len`` tokens holds each of them in
tensors of ``window - 1``, ``rate - 1`` and ``max_len // rate`` rows, padded, and ``n`` (which
the paged step knows: the request's computed tokens) says how many rows are real. That is what
vLLM's Mamba-style state blocks hold (one block per request, its size counted by vLLM), at the
price of reserving a full-length block for every request however short (docs/serving.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from afdc.errors import UnsupportedModelError
from afdc.mixer_site import StateTensor

# a part's length at n tokens, and its bound over a context of max_len tokens
_WINDOW, _BUFFER, _ENTRIES, _OVERLAP = "window", "buffer", "entries", "overlap"


@dataclass(frozen=True)
class _Part:
    attr: str  # the cache layer's attribute
    key: str | None  # its entry, where the attribute is a dict by compressor name
    kind: str
    shape: tuple[int, ...]  # per sequence, padded to the bound

    @property
    def name(self) -> str:
        return self.attr if self.key is None else f"{self.attr}.{self.key}"


class BoundedState:
    """How one stateful mixer's cache layer maps to fixed tensors per sequence (see the module)."""

    def __init__(self, module: torch.nn.Module, layer, max_len: int, dtype: torch.dtype):
        window = getattr(layer, "sliding_window", None)
        if not isinstance(window, int) or not hasattr(layer, "cumulative_length"):
            raise UnsupportedModelError(
                f"the stateful mixer {type(module).__name__} keeps state that grows with the sequence in a cache "
                f"layer ({type(layer).__name__}) whose bound afdc does not know: serving holds only sliding-window "
                "layers with compressed entries (DeepSeek-V4's) in fixed-size state blocks"
            )
        self.window, self.dtype = window, dtype
        self.rate = getattr(layer, "compress_rate", 0)
        heads_dim = _width(module, "kv_proj"), module.head_dim
        key_shape = (heads_dim[0] // heads_dim[1], window - 1, heads_dim[1])
        # K = V: a compressed-attention layer's values are its keys (its update aliases them)
        self.aliased = hasattr(layer, "compressed_kv")
        parts = [_Part("keys", None, _WINDOW, key_shape)]
        if not self.aliased:
            parts.append(_Part("values", None, _WINDOW, key_shape))
        for name in getattr(layer, "compressed_kv", {}):
            owner = _compressor(module, name)
            width, entry = _width(owner, "kv_proj"), owner.head_dim
            parts += [
                _Part("buffer_kv", name, _BUFFER, (self.rate - 1, width)),
                _Part("buffer_gate", name, _BUFFER, (self.rate - 1, width)),
                _Part("compressed_kv", name, _ENTRIES, (max_len // self.rate, entry)),
            ]
            if name in getattr(layer, "overlap_kv", {}):
                # the last closed window's first series (Ca): one row per token of the window
                parts += [_Part(f"overlap_{kind}", name, _OVERLAP, (self.rate, entry)) for kind in ("kv", "gate")]
        self.parts = parts

    @property
    def tensors(self) -> tuple[StateTensor, ...]:
        dtype = str(self.dtype).removeprefix("torch.")
        return tuple(StateTensor(p.name, p.shape, dtype) for p in self.parts)

    def _length(self, part: _Part, n: int) -> int:
        """Rows of ``part`` that are real after ``n`` tokens (overlap: 1 once a window closed)."""
        if part.kind == _WINDOW:
            return min(n, self.window - 1)
        if part.kind == _BUFFER:
            return n % self.rate
        if part.kind == _ENTRIES:
            return n // self.rate
        return int(n >= self.rate)

    def pack(self, layer) -> list[torch.Tensor]:
        """The layer's state of its ``b`` sequences (which ran the same number of tokens) as the
        fixed tensors ``[b, *shape]``, zeros past the real rows."""
        n = layer.cumulative_length
        out = []
        for part in self.parts:
            held = _get(layer, part)
            batch = layer.keys.shape[0]
            fixed = torch.zeros(batch, *part.shape, dtype=self.dtype, device=layer.keys.device)
            rows = self._length(part, n)
            if part.kind == _WINDOW:
                fixed[:, :, :rows] = held
            elif part.kind == _OVERLAP:
                if rows:
                    fixed.copy_(held)
            elif rows:
                fixed[:, :rows] = held
            out.append(fixed)
        return out

    def unpack(self, layer, tensors: list[torch.Tensor], n: int) -> None:
        """Give the fresh ``layer`` the state of sequences that ran ``n`` tokens, from :meth:`pack`'s tensors."""
        layer.lazy_initialization(tensors[0], tensors[0])  # its dtype and device (it leaves empty keys)
        for part, t in zip(self.parts, tensors):
            rows = self._length(part, n)
            if part.kind == _WINDOW:
                value = t[:, :, :rows]
            elif part.kind == _OVERLAP:
                value = t if rows else None
            else:
                value = t[:, :rows]
            _set(layer, part, value)
        if self.aliased:
            layer.values = layer.keys
        layer.cumulative_length = n
        for name in getattr(layer, "entry_count", {}):
            layer.entry_count[name] = n // self.rate


def _width(module: torch.nn.Module, projection: str) -> int:
    return getattr(module, projection).out_features


def _compressor(module: torch.nn.Module, name: str) -> torch.nn.Module:
    """The submodule that fills a cache layer's entry ``name`` (``compressor``, ``compressor.indexer``)."""
    for path, sub in module.named_modules():
        if path.split(".")[-1] == name:
            return sub
    raise UnsupportedModelError(f"{type(module).__name__} has no submodule {name!r} for its cache layer's entries")


def _get(layer, part: _Part):
    held = getattr(layer, part.attr)
    return held if part.key is None else held[part.key]


def _set(layer, part: _Part, value) -> None:
    if part.key is None:
        setattr(layer, part.attr, value)
    else:
        getattr(layer, part.attr)[part.key] = value
