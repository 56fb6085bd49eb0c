"""The attention side's KV cache, reached by the attention op through a context.

The captured attention program has no cache in its graph: each attention call site carries a
constant ``slot`` and the op appends the step's keys and values to that slot of the active
cache (the same idea as vLLM's forward context). Without an active cache the op attends over
the keys of the current call only, which is prefill from scratch.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch

_LOCAL = threading.local()  # micro-batches run in threads, each with its own cache


class KVCache:
    """Contiguous per-slot key/value tensors, grown along the sequence dimension."""

    def __init__(self) -> None:
        self._keys: dict[int, torch.Tensor] = {}
        self._values: dict[int, torch.Tensor] = {}

    def update(self, slot: int, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if slot in self._keys:
            key = torch.cat([self._keys[slot], key], dim=2)
            value = torch.cat([self._values[slot], value], dim=2)
        else:
            # the graph hands over [b, h, s, d] views of [b, s, h, d] projections: copy them once at
            # prefill rather than have the next step's cat (and attention) read them strided
            key, value = key.contiguous(), value.contiguous()
        self._keys[slot], self._values[slot] = key, value
        return key, value


def current() -> KVCache | None:
    return getattr(_LOCAL, "cache", None)


@contextlib.contextmanager
def active(cache: KVCache | None) -> Iterator[None]:
    """Make ``cache`` the one attention ops read and extend (``None``: no cache)."""
    if cache is None:
        yield
        return
    outer, _LOCAL.cache = current(), cache
    try:
        yield
    finally:
        _LOCAL.cache = outer
