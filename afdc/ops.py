"""afdc's custom ops: the opaque attention op and the send/recv connector ops.

They are ``torch.library`` custom ops with fake kernels, so they survive ``torch.export`` and
``torch.compile`` as single nodes. The attention op is what makes attention one opaque node per
call site in a captured graph, whatever the model's attention backend; send/recv are what the
partitioner inserts at the cut between the attention and the FFN program.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from afdc.runtime import connector as _connector
from afdc.runtime import kv_cache as _kv_cache
from afdc.runtime import tensor_parallel as _tensor_parallel

# -- attention -----------------------------------------------------------------------------------


def _mask_for_queries_at_end(q_len: int, kv_len: int, device: torch.device) -> torch.Tensor:
    """Causal mask when the queries are the last ``q_len`` of ``kv_len`` positions."""
    q_pos = torch.arange(kv_len - q_len, kv_len, device=device)
    return (torch.arange(kv_len, device=device)[None, :] <= q_pos[:, None])[None, None]


def reference_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Softmax attention; q ``[b, hq, s, d]``, k/v ``[b, hk, kv, d]``; returns ``[b, s, hq, dv]``.

    ``mask`` is boolean (True = attend) or additive, broadcastable to ``[b, hq, s, kv]``; None
    means causal with the queries at the end of the keys. Rows with no key to attend to (left
    padding) attend to everything rather than producing NaN, which would leak into valid rows
    through ``0 * NaN`` in the value product.
    """
    if mask is None:
        mask = _mask_for_queries_at_end(q.shape[2], k.shape[2], q.device)
    if mask.dtype == torch.bool:
        mask = mask | ~mask.any(dim=-1, keepdim=True)
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


@torch.library.custom_op("afdc::attention", mutates_args=())
def attention(
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

    With a cache active (:mod:`afdc.runtime.kv_cache`) the cache stores the call's keys and values
    and computes the attention: the contiguous cache applies ``mask``, a paged cache over a flat
    batch of requests ignores it and attends per request. ``window`` (0: none) is the
    sliding-window or chunk size this call's mask was built with: it tells cost models and paged
    kernels how many cached keys a query can reach.
    """
    cache = _kv_cache.current()
    if cache is not None:
        return cache.attend(slot, q, k, v, mask, scale, softcap, sinks, window)
    return reference_attention(q, k, v, mask, scale, softcap, sinks)


@attention.register_fake
def _(q, k, v, mask, slot, scale, softcap, sinks, window):
    b, hq, s, _ = q.shape
    return q.new_empty((b, s, hq, v.shape[-1]))


@torch.library.custom_op("afdc::sampled_rows", mutates_args=())
def sampled_rows(hidden: torch.Tensor) -> torch.Tensor:
    """The token rows of ``hidden [1, T, ...]`` whose logits are wanted.

    All of them, unless the active cache context lists ``last_rows`` (a serving step samples each
    request's last token only: the LM head then runs on R rows, not on every prefill token).
    """
    cache = _kv_cache.current()
    rows = getattr(cache, "last_rows", None)
    return hidden.clone() if rows is None else hidden.index_select(1, rows)


@sampled_rows.register_fake
def _(hidden):
    return hidden.new_empty((hidden.shape[0], torch.library.get_ctx().new_dynamic_size(), *hidden.shape[2:]))


# -- connector ops -------------------------------------------------------------------------------


@torch.library.custom_op("afdc::send", mutates_args=())
def send(tensors: list[torch.Tensor], layer: int) -> torch.Tensor:
    """Hand the activations of FFN segment ``layer`` to the FFN side.

    Returns an empty ticket that the matching ``recv`` ops take as input: the data dependency
    keeps send before recv and keeps both alive through dead-code elimination.
    """
    _connector.current().send(layer, list(tensors))
    return tensors[0].new_empty((0,), dtype=torch.int8)


@send.register_fake
def _(tensors, layer):
    return tensors[0].new_empty((0,), dtype=torch.int8)


@torch.library.custom_op("afdc::recv", mutates_args=())
def recv(ticket: torch.Tensor, layer: int, index: int, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """Take output ``index`` of FFN segment ``layer`` back from the FFN side."""
    out = _connector.current().recv(layer, index, tuple(shape), dtype)
    if tuple(out.shape) != tuple(shape) or out.dtype != dtype:
        raise RuntimeError(
            f"FFN segment {layer} output {index}: expected {tuple(shape)} {dtype}, "
            f"got {tuple(out.shape)} {out.dtype}; the FFN program does not match the attention program"
        )
    return out.to(ticket.device)


@recv.register_fake
def _(ticket, layer, index, shape, dtype):
    return ticket.new_empty(tuple(shape), dtype=dtype)


# -- expert parallelism --------------------------------------------------------------------------


@torch.library.custom_op("afdc::grouped_mm_local", mutates_args=())
def grouped_mm_local(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, first: int) -> torch.Tensor:
    """A grouped matmul restricted to this rank's experts ``[first, first + w.shape[0])``.

    ``x`` holds the rows of all experts sorted by expert, ``offs[e]`` is the end row of expert
    ``e`` over all experts (as transformers' grouped matmul takes it), ``w`` only the local
    experts' ``[k, n]`` weights. Rows of other experts come out as zeros, so the ranks' results
    add up to the full grouped matmul.
    """
    out = torch.zeros(x.shape[0], w.shape[2], device=x.device, dtype=x.dtype)
    ends = offs.tolist()
    start = ends[first - 1] if first > 0 else 0
    for e in range(w.shape[0]):
        end = ends[first + e]
        if end > start:
            torch.mm(x[start:end], w[e], out=out[start:end])
        start = end
    return out


@grouped_mm_local.register_fake
def _(x, w, offs, first):
    return x.new_empty((x.shape[0], w.shape[2]))


@torch.library.custom_op("afdc::gather_local", mutates_args=())
def gather_local(w: torch.Tensor, ids: torch.Tensor, first: int) -> torch.Tensor:
    """``w_full[ids]`` where this rank holds rows ``[first, first + w.shape[0])`` of ``w_full``.

    Rows whose id another rank holds come out as zeros.
    """
    local = (ids >= first) & (ids < first + w.shape[0])
    rows = w[(ids - first).clamp(0, w.shape[0] - 1)]
    return torch.where(local.reshape(*local.shape, *([1] * (w.dim() - 1))), rows, torch.zeros((), dtype=w.dtype))


@gather_local.register_fake
def _(w, ids, first):
    return w.new_empty((*ids.shape, *w.shape[1:]))


# -- tensor parallelism inside an attention rank ---------------------------------------------------


@torch.library.custom_op("afdc::tp_all_reduce", mutates_args=())
def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """The sum of ``x`` over the attention rank's TP ranks (the active group), as a new tensor."""
    return _tensor_parallel.all_reduce(x)


@tp_all_reduce.register_fake
def _(x):
    return x.new_empty(x.shape)
