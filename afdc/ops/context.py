"""The forward context: what afdc's ops hand their work to while a program runs.

A captured program has no cache, link or process group in its graph. Its attention ops carry a
constant ``slot``, its send/recv ops a layer number, and at run time each op hands its call to
what the runtime made active in this thread (the same idea as vLLM's forward context):
an :class:`AttentionCache`, a :class:`Link` to the FFN side, the program's :class:`MixerTable`
and, under ``--attn-tp``, a :class:`ReduceGroup`. The protocols are here, beside the ops, so that
the ops know nothing of the runtime that implements them. Micro-batches run in threads, so each context is per thread.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Protocol

import torch

_LOCAL = threading.local()


class AttentionCache(Protocol):
    """What the attention op hands its call to while the cache is active.

    ``attend`` stores ``k``/``v`` (``[b, hk, s, d]``) in ``slot`` and returns the attention of ``q``
    (``[b, hq, s, d]``) over everything cached for the slot, ``[b, s, hq, dv]``. ``mask`` and
    ``window`` are the call's own; a cache that knows better where each query's keys are (a paged
    cache over a flat batch of requests) may ignore them. ``logit_rows``, where set, lists the token
    rows whose logits a step wants (``afdc::sampled_rows``). A cache that keeps a sparse-attention
    indexer's keys has ``extend_keys(slot, keys [b, s, d]) -> [b, kv, d]`` (``afdc::cached_keys``).
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


class Link(Protocol):
    """The attention side's end of the link to the FFN side, addressed per FFN segment (``layer``)."""

    def send(self, layer: int, tensors: list[torch.Tensor]) -> None: ...

    def recv(self, layer: int, index: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor: ...


class MixerTable(Protocol):
    """What runs a program's stateful mixers (``afdc::mixer``): ``mix`` runs call site ``slot``'s
    module over ``hidden`` with ``weights``, reading and extending the state the active cache
    keeps for the slot (none active: from an empty state, which is prefill from scratch)."""

    def mix(
        self, slot: int, hidden: torch.Tensor, mask: torch.Tensor | None, weights: list[torch.Tensor]
    ) -> torch.Tensor: ...


class ReduceGroup(Protocol):
    """The TP ranks of one attention rank: ``all_reduce`` sums a tensor over them, in place."""

    size: int

    def all_reduce(self, tensor: torch.Tensor) -> None: ...


def _get(kind: str):
    return getattr(_LOCAL, kind, None)


@contextlib.contextmanager
def _activate(kind: str, value) -> Iterator:
    outer = _get(kind)
    setattr(_LOCAL, kind, value)
    try:
        yield value
    finally:
        setattr(_LOCAL, kind, outer)


def current_cache() -> AttentionCache | None:
    return _get("cache")


def current_link() -> Link:
    link = _get("link")
    if link is None:
        raise RuntimeError("an afdc send/recv op ran with no active connector; run the program through afdc's runtime")
    return link


def current_mixers() -> MixerTable:
    mixers = _get("mixers")
    if mixers is None:
        raise RuntimeError("an afdc mixer op ran with no mixer table; run the program through afdc's runtime")
    return mixers


def current_group() -> ReduceGroup | None:
    return _get("group")


def current_previous_hidden() -> torch.Tensor | None:
    return _get("previous_hidden")


@contextlib.contextmanager
def cache_active(cache: AttentionCache | None) -> Iterator[None]:
    """Make ``cache`` the one attention ops hand their calls to (``None``: leave the context as it is)."""
    if cache is None:
        yield
        return
    with _activate("cache", cache):
        yield


def link_active(link: Link):
    """Make ``link`` the one send/recv ops talk to, for the ``with`` block."""
    return _activate("link", link)


def mixers_active(mixers: MixerTable):
    """Make ``mixers`` the table ``afdc::mixer`` ops hand their calls to, for the ``with`` block."""
    return _activate("mixers", mixers)


def group_active(group: ReduceGroup):
    """Make ``group`` the one ``afdc::tp_all_reduce`` sums over, for the ``with`` block."""
    return _activate("group", group)


def previous_hidden_active(hidden: torch.Tensor):
    """Make ``hidden`` what ``afdc::previous_hidden`` returns where the active cache holds none
    (a drafter run outside a serving step), for the ``with`` block."""
    return _activate("previous_hidden", hidden)
