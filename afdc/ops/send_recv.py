"""The connector ops the partition inserts at the cut, and their typed calls.

``afdc::send`` hands an FFN segment's inputs to the FFN side, ``afdc::recv`` takes one of its
outputs back; at run time both talk to the active link (:mod:`afdc.ops.context`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.fx as fx

from afdc.ops import context
from afdc.ops.call import OpCall


def send_body(tensors: list[torch.Tensor], layer: int) -> torch.Tensor:
    """Hand the activations of FFN segment ``layer`` to the FFN side.

    Returns an empty ticket that the matching ``recv`` ops take as input: the data dependency
    keeps send before recv and keeps both alive through dead-code elimination.
    """
    context.current_link().send(layer, list(tensors))
    return tensors[0].new_empty((0,), dtype=torch.int8)


send = torch.library.custom_op("afdc::send", send_body, mutates_args=())


@send.register_fake
def _(tensors, layer):
    return tensors[0].new_empty((0,), dtype=torch.int8)


def recv_body(ticket: torch.Tensor, layer: int, index: int, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """Take output ``index`` of FFN segment ``layer`` back from the FFN side."""
    out = context.current_link().recv(layer, index, tuple(shape), dtype)
    if tuple(out.shape) != tuple(shape) or out.dtype != dtype:
        raise RuntimeError(
            f"FFN segment {layer} output {index}: expected {tuple(shape)} {dtype}, "
            f"got {tuple(out.shape)} {out.dtype}; the FFN program does not match the attention program"
        )
    return out.to(ticket.device)


recv = torch.library.custom_op("afdc::recv", recv_body, mutates_args=())


@recv.register_fake
def _(ticket, layer, index, shape, dtype):
    return ticket.new_empty(tuple(shape), dtype=dtype)


@dataclass(frozen=True)
class SendCall(OpCall):
    """An ``afdc::send`` node: the values it sends for FFN segment ``layer``."""

    node: fx.Node
    tensors: list[fx.Node]
    layer: int

    OP = torch.ops.afdc.send.default

    @classmethod
    def emit(cls, graph: fx.Graph, tensors: list[fx.Node], layer: int) -> fx.Node:
        return graph.call_function(cls.OP, (tensors, layer))


@dataclass(frozen=True)
class RecvCall(OpCall):
    """An ``afdc::recv`` node: output ``index`` of FFN segment ``layer``, of ``shape`` and ``dtype``."""

    node: fx.Node
    ticket: fx.Node
    layer: int
    index: int
    shape: list
    dtype: torch.dtype

    OP = torch.ops.afdc.recv.default

    @classmethod
    def emit(cls, graph: fx.Graph, ticket: fx.Node, layer: int, index: int, shape: list, dtype: torch.dtype) -> fx.Node:
        return graph.call_function(cls.OP, (ticket, layer, index, shape, dtype))
