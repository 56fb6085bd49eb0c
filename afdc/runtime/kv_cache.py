"""The attention side's KV cache, reached by the attention op through a context.

The captured attention program has no cache in its graph: each attention call site carries a
constant ``slot`` and the op hands the call to the active cache (the same idea as vLLM's forward
context), which stores the step's keys and values in that slot and computes the attention.
Without an active cache the op attends over the keys of the current call only, which is prefill
from scratch. :class:`KVCache` is the contiguous cache of ``dm.generate``;
:class:`afdc.runtime.paged.PagedBatch` is the paged one a serving engine drives.
"""

from __future__ import annotations

import torch

from afdc.ops import open_empty_rows, reference_attention
from afdc.ops.context import AttentionCache, cache_active, current_cache

__all__ = ["AttentionCache", "KVCache", "active", "current"]


class KVCache:
    """Contiguous per-slot key/value tensors, grown along the sequence dimension."""

    def __init__(self) -> None:
        self._keys: dict[int, torch.Tensor] = {}
        self._values: dict[int, torch.Tensor] = {}
        self._tp_shards: dict[int, KVCache] = {}
        # mask id -> (mask, its empty rows opened): every layer of a step passes the same mask (or
        # a few, alternating), so it is opened once per step, not once per layer
        self._opened: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._mixer_states = None  # the stateful mixers' cache, made by the program's mixer table
        self._indexer_keys: dict[int, torch.Tensor] = {}  # sparse-attention indexers' keys [b, kv, d]

    def extend_keys(self, slot: int, keys: torch.Tensor) -> torch.Tensor:
        """``afdc::cached_keys``: the slot's keys so far, then ``keys``."""
        held = self._indexer_keys.get(slot)
        keys = keys.contiguous() if held is None else torch.cat([held, keys], dim=1)
        self._indexer_keys[slot] = keys
        return keys

    def run_mixer(self, mixers, slot, hidden, mask, run) -> torch.Tensor:
        """A stateful mixer's call (:mod:`afdc.runtime.mixer_modules`): the batch's rows are these
        sequences, whose state lives here from their first step on."""
        if self._mixer_states is None:
            self._mixer_states = mixers.new_state()
        return run(hidden, mask, self._mixer_states)

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
        if mask is not None:
            mask = self._open(mask)
        return reference_attention(q, k, v, mask, scale, softcap, sinks, rows_open=True)

    def _open(self, mask: torch.Tensor) -> torch.Tensor:
        held = self._opened.get(id(mask))
        if held is None or held[0] is not mask:  # (a copied cache holds copies of its masks)
            if len(self._opened) >= 4:  # the masks of past steps
                self._opened.clear()
            held = self._opened[id(mask)] = (mask, open_empty_rows(mask))
        return held[1]


current = current_cache
active = cache_active
