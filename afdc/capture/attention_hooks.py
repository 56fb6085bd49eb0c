"""afdc's attention implementation and mask builder, registered with transformers by name.

The implementation calls the ``afdc::attention`` custom op, so every softmax-attention call
becomes exactly one graph node, whatever backend the model would have used. During a capture the
calls are numbered (each one's KV slot) by the current :class:`~afdc.capture.session.CaptureSession`;
outside one they run as plain attention with slot -1.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from transformers import AttentionInterface, PreTrainedModel
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from afdc import ops
from afdc.capture import session
from afdc.errors import UnsupportedModelError

IMPLEMENTATION = "afdc"

# Keyword arguments that change what attention computes and that afdc's op does not apply:
# refusing is better than a silently wrong model.
_UNSUPPORTED_ATTENTION_KWARGS = ("sinks",)


def _attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, softcap=None, **kwargs):
    for name in _UNSUPPORTED_ATTENTION_KWARGS:
        if kwargs.get(name) is not None:
            raise UnsupportedModelError(f"attention passes `{name}`, which afdc's attention op does not implement yet")
    tracing = session.current()
    slot = next(tracing.attention_slots) if tracing else -1
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    sinks = kwargs.get("s_aux")
    window = (tracing.window(attention_mask) if tracing else 0) or kwargs.get("sliding_window") or 0
    mask = _fold_into_mask(attention_mask, kwargs.get("indices"), kwargs.get("position_bias"), softcap)
    out = ops.attention(query, key, value, mask, slot, float(scale), float(softcap or 0.0), sinks, window)
    return out, None


def _fold_into_mask(mask, indices, position_bias, softcap):
    """The mask with what some models pass beside it folded in, as transformers' eager path does.

    ``indices [b, s, topk]``: the keys a sparse-attention indexer chose for each query
    (DeepSeek-V3.2-style); the rest are masked. ``position_bias``: an additive score bias
    ``[b, h, q, kv]`` (a learned relative-position bias). The graph then computes the mask from
    the hidden states, which the paged serving path, which rebuilds masks from positions, refuses.
    """
    if indices is None and position_bias is None:
        return mask
    if mask is None:
        raise UnsupportedModelError("attention passes `indices` or `position_bias` without a mask to fold them into")
    if indices is not None:
        chosen = torch.zeros(mask.shape[0], mask.shape[-2], mask.shape[-1], dtype=torch.bool, device=mask.device)
        chosen = chosen.scatter(-1, indices.long(), True).unsqueeze(1)
        mask = mask & chosen if mask.dtype == torch.bool else mask.masked_fill(~chosen, torch.finfo(mask.dtype).min)
    if position_bias is not None:
        if softcap:
            raise UnsupportedModelError("attention passes both a softcap and a `position_bias`; their order is unknown")
        if mask.dtype == torch.bool:
            mask = ops.open_empty_rows(mask)  # a row with no key to attend to attends everything
            mask = position_bias.masked_fill(~mask, torch.finfo(position_bias.dtype).min)
        else:
            mask = mask + position_bias
    return mask


def _mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None, attention_mask=None, **kwargs):
    """The stock boolean mask, with the queries placed at the end of the keys.

    afdc never hands transformers a cache, so transformers sees ``kv`` positions in the 2-D mask
    and ``s`` queries; placing the queries last makes one graph serve prefill and decode.
    """
    local_size = kwargs.get("local_size")
    kwargs = {k: v for k, v in kwargs.items() if k in ("use_vmap", "device")}
    mask = sdpa_mask(
        batch_size=batch_size,
        q_length=q_length,
        kv_length=kv_length,
        q_offset=kv_length - q_length,
        kv_offset=0,
        mask_function=mask_function,
        attention_mask=attention_mask,
        allow_is_causal_skip=False,
        allow_is_bidirectional_skip=False,
        **kwargs,
    )
    tracing = session.current()
    if local_size and tracing:
        tracing.note_window(mask, int(local_size))
    return mask


AttentionInterface.register(IMPLEMENTATION, _attention_forward)
AttentionMaskInterface.register(IMPLEMENTATION, _mask)


@contextlib.contextmanager
def afdc_attention(model: PreTrainedModel) -> Iterator[None]:
    """Route attention through afdc's op, and keep the cache out of the outputs.

    A model with hard-coded attention cannot switch; it is captured as it is, its attention
    inline (the classifier keeps token-mixing computation on the attention side). Switching the
    name anyway would hand its code afdc's boolean mask where it expects an additive one.
    """
    configs = list(_all_configs(model.config))
    saved = [(c, c._attn_implementation, getattr(c, "use_cache", None)) for c in configs]
    switch = type(model)._can_set_attn_implementation()
    if switch:
        model.set_attn_implementation(IMPLEMENTATION)
    for c in configs:
        if switch:
            c._attn_implementation = IMPLEMENTATION
        c.use_cache = False  # a DynamicCache in the outputs is not exportable
    try:
        yield
    finally:
        for c, impl, use_cache in saved:
            c._attn_implementation = impl
            c.use_cache = use_cache


def _all_configs(config) -> Iterator:
    yield config
    for name in getattr(config, "sub_configs", {}) or {}:
        sub = getattr(config, name, None)
        if sub is not None:
            yield from _all_configs(sub)
