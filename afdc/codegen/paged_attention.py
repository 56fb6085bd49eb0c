"""A Triton decode-attention kernel over a paged KV cache.

:func:`paged_decode_attention` attends one query per request over that request's cached keys,
found through its block table, in vLLM's paged layout (keys ``[blocks, block_size, kv_heads,
head_dim]``). It takes raw tensors only: the runtime's paged cache
(:mod:`afdc.runtime.paged`) decides when a step is a pure decode step it covers
(:func:`decode_kernel_runs`) and runs every other step in torch.
"""

from __future__ import annotations

import torch

from afdc.codegen.triton_support import jit, launches, next_power_of_2, tl

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# keys per loop step, gathered through the block table, so any cache block size works
_KEY_TILE = 32


def _decode_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    block_table_ptr,
    seq_lens_ptr,
    sinks_ptr,
    scale,
    softcap,
    stride_q_head,
    stride_q_token,
    stride_q_dim,
    stride_k_token,
    stride_k_head,
    stride_k_dim,
    stride_v_token,
    stride_v_head,
    stride_v_dim,
    stride_table,
    stride_out_token,
    stride_out_head,
    block_size,
    group: tl.constexpr,
    head_dim: tl.constexpr,
    value_dim: tl.constexpr,
    window: tl.constexpr,
    chunked: tl.constexpr,
    has_softcap: tl.constexpr,
    has_sinks: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """One program per (request, query head): the request's single query, at position
    ``seq_len - 1``, against its cached keys, with an online softmax in fp32."""
    request = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // group
    seq_len = tl.load(seq_lens_ptr + request)
    pos = seq_len - 1
    # the first key the query reaches (SlotSpec.allowed); every key from there to pos is reached
    if chunked:
        lo = pos // window * window
    elif window > 0:
        lo = tl.maximum(pos - window + 1, 0)
    else:
        lo = 0

    d = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    q = tl.load(q_ptr + head * stride_q_head + request * stride_q_token + d * stride_q_dim, mask=d < head_dim, other=0)
    q = q.to(tl.float32)

    # a sink is one more logit in the denominator: start the running max and sum from it
    if has_sinks:
        m = tl.load(sinks_ptr + head).to(tl.float32)
        total = tl.full([], 1.0, tl.float32)
    else:
        m = tl.full([], float("-inf"), tl.float32)
        total = tl.full([], 0.0, tl.float32)
    acc = tl.zeros([BLOCK_DV], dtype=tl.float32)

    # every tile starts at a reached key, so the running max is finite after the first one
    for start in range(lo, seq_len, BLOCK_N):
        keys = start + tl.arange(0, BLOCK_N)
        valid = keys < seq_len
        # positions past the request's length are not loaded: its block table row may be padded
        # with invalid ids, and unwritten cache memory may hold NaN
        block = tl.load(block_table_ptr + request * stride_table + keys // block_size, mask=valid, other=0)
        token = block.to(tl.int64) * block_size + keys % block_size

        k = tl.load(
            k_ptr + token[:, None] * stride_k_token + kv_head * stride_k_head + d[None, :] * stride_k_dim,
            mask=valid[:, None] & (d[None, :] < head_dim),
            other=0,
        ).to(tl.float32)
        s = tl.sum(q[None, :] * k, 1) * scale
        if has_softcap:
            # softcap * tanh(s / softcap), with tanh(x) = 2 sigmoid(2x) - 1 (tl has no tanh)
            s = softcap * (2.0 * tl.sigmoid(2.0 * s / softcap) - 1.0)
        s = tl.where(valid, s, float("-inf"))

        m_new = tl.maximum(m, tl.max(s, 0))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new)
        v = tl.load(
            v_ptr + token[:, None] * stride_v_token + kv_head * stride_v_head + dv[None, :] * stride_v_dim,
            mask=valid[:, None] & (dv[None, :] < value_dim),
            other=0,
        ).to(tl.float32)
        acc = acc * alpha + tl.sum(p[:, None] * v, 0)
        total = total * alpha + tl.sum(p, 0)
        m = m_new

    out = acc / total
    out_ptrs = out_ptr + request * stride_out_token + head * stride_out_head + dv
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=dv < value_dim)


def decode_kernel_runs(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    sinks: torch.Tensor | None,
) -> bool:
    """Whether :func:`paged_decode_attention` runs on these tensors (device and dtypes)."""
    tensors = (q, keys, values, block_table, seq_lens, *(() if sinks is None else (sinks,)))
    return (
        launches(*tensors)
        and q.dtype in _DTYPES
        and keys.dtype in _DTYPES
        and (sinks is None or sinks.numel() == q.shape[1])
    )


def paged_decode_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    block_size: int,
    window: int,
    chunked: bool,
    scale: float,
    softcap: float,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """One decode query per request against its cached keys, with an online softmax in fp32.

    ``q`` is ``[1, hq, R, d]`` (request ``r``'s query at position ``seq_lens[r] - 1``); ``keys``
    and ``values`` are ``[blocks, block_size, kv_heads, d | dv]``; ``block_table [R, max_blocks]``
    names each request's blocks. A query reaches the keys at positions up to its own; with a
    ``window`` only the last ``window`` of them, or with ``chunked`` only those of its chunk.
    Covers grouped-query and multi-query attention, soft-capping, attention sinks and a value
    head size that differs from the keys'. Returns ``[1, R, hq, dv]`` in ``q``'s dtype.
    """
    requests, heads = q.shape[2], q.shape[1]
    kv_heads, head_dim, value_dim = keys.shape[2], keys.shape[3], values.shape[3]
    out = q.new_empty(requests, heads, value_dim)
    jit(_decode_kernel)[(requests, heads)](
        q,
        keys,
        values,
        out,
        block_table,
        seq_lens,
        q if sinks is None else sinks.contiguous(),  # without sinks, a pointer the kernel never reads
        float(scale),
        float(softcap) if softcap else 1.0,
        *q.stride()[1:],
        *keys.stride()[1:],
        *values.stride()[1:],
        block_table.stride(0),
        *out.stride()[:2],
        block_size,
        group=heads // kv_heads,
        head_dim=head_dim,
        value_dim=value_dim,
        window=window,
        chunked=chunked,
        has_softcap=bool(softcap),
        has_sinks=sinks is not None,
        BLOCK_D=next_power_of_2(head_dim),
        BLOCK_DV=next_power_of_2(value_dim),
        BLOCK_N=_KEY_TILE,
    )
    return out[None]
