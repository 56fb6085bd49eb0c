"""afdc's custom ops: the opaque attention op, the send/recv connector ops and the ops sharded
programs call.

They are ``torch.library`` custom ops with fake kernels, so they survive ``torch.export`` and
``torch.compile`` as single nodes. Each op's module also defines its typed call
(:class:`AttentionCall`, :class:`SendCall`, :class:`RecvCall`): passes read an op's arguments
through it, by name. What the ops hand their work to at run time is in :mod:`afdc.ops.context`.
"""

from afdc.ops.attention import AttentionCall, attention, reference_attention, sampled_rows
from afdc.ops.connector import RecvCall, SendCall, recv, send
from afdc.ops.parallel import gather_local, grouped_mm_local, tp_all_reduce

__all__ = [
    "AttentionCall",
    "RecvCall",
    "SendCall",
    "attention",
    "gather_local",
    "grouped_mm_local",
    "recv",
    "reference_attention",
    "sampled_rows",
    "send",
    "tp_all_reduce",
]
