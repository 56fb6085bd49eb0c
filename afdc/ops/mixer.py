"""The opaque stateful-mixer op and its typed call.

A stateful token mixer mixes tokens and carries per-sequence state from step to step besides (or
instead of) keys and values: a convolution window, an SSM state, a linear-attention state. Each
call site of one becomes a single ``afdc::mixer`` node on the attention side, so the Python loops
of its torch code (chunked scans, per-token recurrences) stay out of the captured graph. At run
time the op hands the call to the active mixer table (:mod:`afdc.ops.context`), which runs the
model's own module code over the state kept for the call's sequences.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from afdc.ops import context
from afdc.ops.call import OpCall


def mixer_body(hidden: torch.Tensor, mask: torch.Tensor | None, weights: list[torch.Tensor], slot: int) -> torch.Tensor:
    """Mixer call site ``slot`` over ``hidden [b, s, d]``; ``mask`` is the call's 2-D padding mask
    of the step's tokens (None: none), ``weights`` the module's parameters and buffers."""
    return context.current_mixers().mix(slot, hidden, mask, list(weights))


mixer = torch.library.custom_op("afdc::mixer", mixer_body, mutates_args=())


@mixer.register_fake
def _(hidden, mask, weights, slot):
    return torch.empty_like(hidden)  # a mixer's output is added back to the stream it reads


@dataclass(frozen=True)
class MixerCall(OpCall):
    """One ``afdc::mixer`` node's arguments by name."""

    node: fx.Node
    hidden: fx.Node
    mask: fx.Node | None
    weights: list[fx.Node]
    slot: int

    OP = torch.ops.afdc.mixer.default
