"""The opaque attention op, its reference implementation and its typed call.

``afdc::attention`` is what makes attention one opaque node per call site in a captured graph,
whatever the model's attention backend: the capture registers an attention implementation that
calls it, and at run time it hands the call to the active cache (:mod:`afdc.ops.context`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from afdc.ops import context
from afdc.ops.call import OpCall


def causal_mask(q_len: int, kv_len: int, device: torch.device) -> torch.Tensor:
    """Causal mask ``[1, 1, q_len, kv_len]`` when the queries are the last ``q_len`` of ``kv_len`` positions."""
    q_pos = torch.arange(kv_len - q_len, kv_len, device=device)
    return (torch.arange(kv_len, device=device)[None, :] <= q_pos[:, None])[None, None]


def open_empty_rows(mask: torch.Tensor) -> torch.Tensor:
    """A boolean ``mask`` whose rows with no key to attend to (left padding) attend to every key,
    rather than produce NaN, which would leak into valid rows through ``0 * NaN`` in the value
    product; an additive mask as it is."""
    return mask | ~mask.any(dim=-1, keepdim=True) if mask.dtype == torch.bool else mask


def reference_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
    rows_open: bool = False,
) -> torch.Tensor:
    """Softmax attention; q ``[b, hq, s, d]``, k/v ``[b, hk, kv, d]``; returns ``[b, s, hq, dv]``.

    ``mask`` is boolean (True = attend) or additive, broadcastable to ``[b, hq, s, kv]``; None
    means causal with the queries at the end of the keys. Rows with no key to attend to attend
    to everything (:func:`open_empty_rows`; ``rows_open``: the caller did that already).
    """
    if mask is None:
        mask = causal_mask(q.shape[2], k.shape[2], q.device)
    elif not rows_open:
        mask = open_empty_rows(mask)
    if softcap == 0.0 and sinks is None:
        out = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
        )
        return out.transpose(1, 2).contiguous()
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * scale
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    if mask.dtype == torch.bool:
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    else:
        scores = scores + mask.float()
    if sinks is not None:
        sink_col = sinks.float().reshape(1, -1, 1, 1).expand(scores.shape[0], -1, scores.shape[2], 1)
        probs = torch.softmax(torch.cat([scores, sink_col], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    return torch.matmul(probs.to(v.dtype), v).transpose(1, 2).contiguous()


def attention_body(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    slot: int,
    scale: float,
    softcap: float,
    sinks: torch.Tensor | None,
    window: int,
) -> torch.Tensor:
    """One attention call site. ``slot`` names its KV-cache entry in the active cache.

    With a cache active (:func:`afdc.ops.context.cache_active`) the cache stores the call's keys and values
    and computes the attention: the contiguous cache applies ``mask``, a paged cache over a flat
    batch of requests ignores it and attends per request. ``window`` (0: none) is the
    sliding-window or chunk size this call's mask was built with: it tells cost models and paged
    kernels how many cached keys a query can reach.
    """
    cache = context.current_cache()
    if cache is not None:
        return cache.attend(slot, q, k, v, mask, scale, softcap, sinks, window)
    return reference_attention(q, k, v, mask, scale, softcap, sinks)


attention = torch.library.custom_op("afdc::attention", attention_body, mutates_args=())


@attention.register_fake
def _(q, k, v, mask, slot, scale, softcap, sinks, window):
    b, hq, s, _ = q.shape
    return q.new_empty((b, s, hq, v.shape[-1]))


def cached_keys_body(keys: torch.Tensor, slot: int, length: int) -> torch.Tensor:
    """The keys ``[b, s, d]`` of this call appended to those the active cache holds for ``slot``
    (a sparse-attention indexer's key cache): ``[b, length, d]``, ``length`` the key count. With
    no cache active they are all the keys there are (prefill from scratch)."""
    cache = context.current_cache()
    out = keys if cache is None else cache.extend_keys(slot, keys)
    if out.shape[1] != length:
        raise RuntimeError(f"cached keys of slot {slot}: {out.shape[1]} positions, the step's mask has {length}")
    return out


cached_keys = torch.library.custom_op("afdc::cached_keys", cached_keys_body, mutates_args=())


@cached_keys.register_fake
def _(keys, slot, length):
    return keys.new_empty((keys.shape[0], length, *keys.shape[2:]))


def sampled_rows_body(hidden: torch.Tensor) -> torch.Tensor:
    """The token rows of ``hidden [1, T, ...]`` whose logits are wanted.

    All of them, unless the active cache context lists ``logit_rows`` (a serving step samples each
    request's last token only: the LM head then runs on R rows, not on every prefill token). A
    cache context that sets ``keep_hidden`` gets every row as ``hidden`` (what an MTP drafter
    continues from: the LM head's input at each token).
    """
    cache = context.current_cache()
    if getattr(cache, "keep_hidden", False):  # every token's, for a drafter (a copy: compiled code reuses buffers)
        cache.hidden = hidden.clone()
    rows = getattr(cache, "logit_rows", None)
    return hidden.clone() if rows is None else hidden.index_select(1, rows)


sampled_rows = torch.library.custom_op("afdc::sampled_rows", sampled_rows_body, mutates_args=())


@sampled_rows.register_fake
def _(hidden):
    return hidden.new_empty((hidden.shape[0], torch.library.get_ctx().new_dynamic_size(), *hidden.shape[2:]))


def previous_hidden_body(embeds: torch.Tensor) -> torch.Tensor:
    """The hidden states a multi-token-prediction (MTP) drafter continues from, one per token of
    ``embeds [b, s, h]``: the target model's (or the drafter's previous pass's) at each token's
    preceding position. They are the step's data, not the graph's: the active cache holds them
    (``previous_hidden``), or, with no such cache, :func:`afdc.ops.context.previous_hidden_active`."""
    hidden = getattr(context.current_cache(), "previous_hidden", None)
    if hidden is None:
        hidden = context.current_previous_hidden()
    if hidden is None:
        raise RuntimeError("an MTP drafter ran without the hidden states it continues from; run it through "
                           "afdc's runtime, or give them with afdc.ops.context.previous_hidden_active")
    if hidden.shape != embeds.shape:
        raise RuntimeError(f"the MTP drafter's previous hidden states are {tuple(hidden.shape)}, its tokens' "
                           f"embeddings {tuple(embeds.shape)}")
    return hidden.to(embeds.dtype).clone()


previous_hidden = torch.library.custom_op("afdc::previous_hidden", previous_hidden_body, mutates_args=())


@previous_hidden.register_fake
def _(embeds):
    return torch.empty_like(embeds)


@dataclass(frozen=True)
class AttentionCall(OpCall):
    """One ``afdc::attention`` node's arguments by name: q, k, v, mask and sinks are graph values
    (mask and sinks may be None), the rest constants."""

    node: fx.Node
    q: fx.Node
    k: fx.Node
    v: fx.Node
    mask: fx.Node | None
    slot: int
    scale: float
    softcap: float
    sinks: fx.Node | None
    window: int

    OP = torch.ops.afdc.attention.default
