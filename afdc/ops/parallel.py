"""Ops that sharded programs call: an FFN rank's share of the experts, and the attention TP
ranks' all-reduce (over the active group, :mod:`afdc.ops.context`)."""

from __future__ import annotations

import torch

from afdc.ops import context


def grouped_mm_local_body(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, first: int) -> torch.Tensor:
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


grouped_mm_local = torch.library.custom_op("afdc::grouped_mm_local", grouped_mm_local_body, mutates_args=())


@grouped_mm_local.register_fake
def _(x, w, offs, first):
    return x.new_empty((x.shape[0], w.shape[2]))


def gather_local_body(w: torch.Tensor, ids: torch.Tensor, first: int) -> torch.Tensor:
    """``w_full[ids]`` where this rank holds rows ``[first, first + w.shape[0])`` of ``w_full``.

    Rows whose id another rank holds come out as zeros.
    """
    local = (ids >= first) & (ids < first + w.shape[0])
    rows = w[(ids - first).clamp(0, w.shape[0] - 1)]
    return torch.where(local.reshape(*local.shape, *([1] * (w.dim() - 1))), rows, torch.zeros((), dtype=w.dtype))


gather_local = torch.library.custom_op("afdc::gather_local", gather_local_body, mutates_args=())


@gather_local.register_fake
def _(w, ids, first):
    return w.new_empty((*ids.shape, *w.shape[1:]))


def tp_all_reduce_body(x: torch.Tensor) -> torch.Tensor:
    """The sum of ``x`` over the attention rank's TP ranks (the active group), as a new tensor."""
    out = x.contiguous().clone()
    group = context.current_group()
    if group is not None and group.size > 1:
        group.all_reduce(out)
    return out


tp_all_reduce = torch.library.custom_op("afdc::tp_all_reduce", tp_all_reduce_body, mutates_args=())


@tp_all_reduce.register_fake
def _(x):
    return x.new_empty(x.shape)
