"""afdc's custom ops: the opaque attention and stateful-mixer ops, the send/recv connector ops and the ops sharded
programs call.

They are ``torch.library`` custom ops with fake kernels, so they survive ``torch.export`` and
``torch.compile`` as single nodes. Each op's module also defines its typed call
(:class:`AttentionCall`, :class:`SendCall`, :class:`RecvCall`): passes read an op's arguments
through it, by name. What the ops hand their work to at run time is in :mod:`afdc.ops.context`.

Each op's body is a plain function that runs on every device; :data:`BODIES` maps the op to it,
so that eager execution (:mod:`afdc.passes.straight_line`) calls the body without the dispatcher's
round trip.
"""

import torch

from afdc.ops.attention import (
    AttentionCall,
    attention,
    attention_body,
    cached_keys,
    cached_keys_body,
    causal_mask,
    open_empty_rows,
    reference_attention,
    sampled_rows,
    sampled_rows_body,
)
from afdc.ops.connector import RecvCall, SendCall, recv, recv_body, send, send_body
from afdc.ops.mixer import MixerCall, mixer, mixer_body
from afdc.ops.parallel import (
    gather_local,
    gather_local_body,
    grouped_mm_local,
    grouped_mm_local_body,
    tp_all_reduce,
    tp_all_reduce_body,
)

BODIES = {
    torch.ops.afdc.attention.default: attention_body,
    torch.ops.afdc.mixer.default: mixer_body,
    torch.ops.afdc.cached_keys.default: cached_keys_body,
    torch.ops.afdc.sampled_rows.default: sampled_rows_body,
    torch.ops.afdc.send.default: send_body,
    torch.ops.afdc.recv.default: recv_body,
    torch.ops.afdc.grouped_mm_local.default: grouped_mm_local_body,
    torch.ops.afdc.gather_local.default: gather_local_body,
    torch.ops.afdc.tp_all_reduce.default: tp_all_reduce_body,
}

__all__ = [
    "BODIES",
    "AttentionCall",
    "MixerCall",
    "RecvCall",
    "SendCall",
    "attention",
    "cached_keys",
    "causal_mask",
    "gather_local",
    "grouped_mm_local",
    "mixer",
    "open_empty_rows",
    "recv",
    "reference_attention",
    "sampled_rows",
    "send",
    "tp_all_reduce",
]
