"""afdc's custom ops: the opaque attention and stateful-mixer ops, the send/recv connector ops and the ops sharded
programs call.

They are ``torch.library`` custom ops with fake kernels, so they survive ``torch.export`` and
``torch.compile`` as single nodes. Each op's module also defines its typed call
(:class:`AttentionCall`, :class:`SendCall`, :class:`RecvCall`): passes read an op's arguments
through it, by name. What the ops hand their work to at run time is in :mod:`afdc.ops.context`.

Each op's body is a plain function that runs on every device; :func:`body_of` finds it, so that
eager execution (:mod:`afdc.lowering.straight_line`) calls the body without the dispatcher's round
trip.

One op of another library stays in captured graphs, ``transformers::grouped_mm_fallback`` (an
unsharded MoE segment's grouped matmul). It is registered on demand (:func:`register_library_ops`),
not by importing this package: transformers' MoE integration imports ``torch._dynamo`` and DTensor,
about a quarter of an FFN server's start, which a server whose programs never call it need not pay.
"""

from collections.abc import Callable

import torch
import torch.fx as fx
from torch._library import custom_ops

from afdc.ops.attention import (
    AttentionCall,
    attention,
    cached_keys,
    causal_mask,
    open_empty_rows,
    previous_hidden,
    reference_attention,
    sampled_rows,
)
from afdc.ops.mixer import MixerCall, mixer
from afdc.ops.parallel import (
    gather_local,
    grouped_mm_local,
    tp_all_reduce,
)
from afdc.ops.send_recv import RecvCall, SendCall, recv, send
from afdc.ops.slot import SlotSpec

LIBRARY_NAMESPACES = ("transformers",)  # of the ops of other libraries that captured graphs keep


def register_library_ops() -> None:
    """Register the ops of other libraries that captured graphs keep (transformers' grouped
    expert matmul), before a program naming one is read or traced again."""
    import transformers.integrations.moe  # noqa: F401


def calls_library_ops(module: fx.GraphModule) -> bool:
    """Whether ``module``'s graph calls an op of another library."""
    return any(
        isinstance(node.target, torch._ops.OpOverload) and node.target.namespace in LIBRARY_NAMESPACES
        for node in module.graph.nodes
    )


class LibraryOps:
    """Pickled ahead of a graph module that calls another library's op: unpickling it registers
    the op before the module's code is traced again, which looks every op up by name."""

    def __reduce__(self):
        return register_library_ops, ()


def body_of(op) -> Callable | None:
    """The function a Python custom op (``torch.library.custom_op``: afdc's, transformers' grouped
    matmul fallback) runs on every device, to call without the dispatcher's round trip back into
    Python (autograd, kernel selection, an aliasing check: a tenth of the demo model's MoE layer
    on a CPU). None for other ops, and for one with a kernel of its own for some device.
    Called as its function, an op whose body writes into ``out=`` tensors (transformers' grouped
    matmul) fails where grad is on and a weight requires it; the dispatcher ran it without
    recording. Programs only run inference, so their eager code runs under ``torch.no_grad()``."""
    if type(op) is not torch._ops.OpOverload:
        return None
    opdef = custom_ops._maybe_get_opdef(op)
    if opdef is None or set(opdef._backend_fns) != {None}:
        return None
    return opdef._init_fn


__all__ = [
    "AttentionCall",
    "LibraryOps",
    "MixerCall",
    "RecvCall",
    "SendCall",
    "SlotSpec",
    "attention",
    "body_of",
    "cached_keys",
    "calls_library_ops",
    "causal_mask",
    "gather_local",
    "grouped_mm_local",
    "mixer",
    "open_empty_rows",
    "previous_hidden",
    "recv",
    "reference_attention",
    "register_library_ops",
    "sampled_rows",
    "send",
    "tp_all_reduce",
]
