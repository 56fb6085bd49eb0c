"""One attention call site's cache entry, as the paged KV cache and the serving worker hold it.

The lowering that reads these off a program (:mod:`afdc.lowering.attention_slots`) and the paged
cache that honours them (:mod:`afdc.runtime.paged`) sit in different layers; this is their contract.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SlotSpec:
    """One attention call site's cache entry, and which keys its queries reach.

    A query at position ``p`` reaches the keys at positions ``<= p``; with a ``window`` only
    those in ``(p - window, p]`` (sliding window, transformers' ``kv > q - window``), or with
    ``chunked`` only those in ``p``'s chunk ``[p // window * window, p]`` (Llama 4's chunked
    attention). The two are told apart by the mask, not by the window size, which is the same
    constant in the graph either way.
    """

    kv_heads: int
    head_dim: int  # of queries and keys
    value_dim: int
    window: int = 0  # 0: no window
    chunked: bool = False

    def __post_init__(self) -> None:
        if self.chunked and self.window <= 0:
            raise ValueError("chunked attention needs a chunk size (window > 0)")

    def allowed(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        """Whether the query at ``q_pos`` attends to the key at ``k_pos`` (broadcast)."""
        ok = k_pos <= q_pos
        if self.chunked:
            return ok & (k_pos // self.window == q_pos // self.window)
        if self.window:
            return ok & (k_pos > q_pos - self.window)
        return ok
