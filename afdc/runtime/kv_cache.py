"""The attention side's KV cache, reached by the attention op through a context.

The captured attention program has no cache in its graph: each attention call site carries a
constant ``slot`` and the op hands the call to the active cache (the same idea as vLLM's forward
context), which stores the step's keys and values in that slot and computes the attention.
Without an active cache the op attends over the keys of the current call only, which is prefill
from scratch. :class:`KVCache` is the contiguous cache of ``dm.generate``;
:class:`afdc.runtime.paged.PagedBatch` is the paged one a serving engine drives.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Protocol

import torch

from afdc import ops  # ops imports this module: use ops.* only at call time

_LOCAL = threading.local()  # micro-batches run in threads, each with its own cache


class AttentionCache(Protocol):
    """What the attention op hands its call to while the cache is active.

    ``attend`` stores ``k``/``v`` (``[b, hk, s, d]``) in ``slot`` and returns the attention of ``q``
    (``[b, hq, s, d]``) over everything cached for the slot, ``[b, s, hq, dv]``. ``mask`` and
    ``window`` are the call's own; a cache that knows better where each query's keys are (a paged
    cache over a flat batch of requests) may ignore them.
    """

    def attend(
        self,
        slot: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: torch.Tensor | None,
        scale: float,
        softcap: float,
        sinks: torch.Tensor | None,
        window: int,
    ) -> torch.Tensor: ...


class KVCache:
    """Contiguous per-slot key/value tensors, grown along the sequence dimension."""

    def __init__(self) -> None:
        self._keys: dict[int, torch.Tensor] = {}
        self._values: dict[int, torch.Tensor] = {}
        self._tp_shards: dict[int, KVCache] = {}

    def tp_shard(self, tp_rank: int) -> KVCache:
        """The cache of TP rank ``tp_rank`` of an attention rank under ``--attn-tp``: its own
        heads' keys and values (rank 0's are this cache's), living as long as this one."""
        return self if tp_rank == 0 else self._tp_shards.setdefault(tp_rank, KVCache())

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

    def attend(self, slot, q, k, v, mask, scale, softcap, sinks, window) -> torch.Tensor:
        """The queries are the last ``s`` of the cached keys, and the call's mask covers them all."""
        k, v = self.update(slot, k, v)
        return ops.reference_attention(q, k, v, mask, scale, softcap, sinks)


def current() -> AttentionCache | None:
    return getattr(_LOCAL, "cache", None)


@contextlib.contextmanager
def active(cache: AttentionCache | None) -> Iterator[None]:
    """Make ``cache`` the one attention ops hand their calls to (``None``: no cache)."""
    if cache is None:
        yield
        return
    outer, _LOCAL.cache = current(), cache
    try:
        yield
    finally:
        _LOCAL.cache = outer
