"""Connectors carry activations across the cut between the attention and the FFN program.

The attention program's ``afdc::send`` / ``afdc::recv`` ops talk to the connector made active
with :func:`active`. A connector is addressed per FFN segment (``layer``): the attention side
sends the segment's inputs, then receives its outputs one by one.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

import torch

from afdc.ops import context
from afdc.runtime import trace, wire


@dataclass
class Traffic:
    """Bytes and messages that crossed a connector, each way."""

    to_ffn_bytes: int = 0
    to_attn_bytes: int = 0
    messages: int = 0

    @classmethod
    def total(cls, parts: list[Traffic]) -> Traffic:
        return cls(
            sum(t.to_ffn_bytes for t in parts), sum(t.to_attn_bytes for t in parts), sum(t.messages for t in parts)
        )


class Connector(ABC):
    """The attention side's end of the link to the FFN side."""

    def __init__(self) -> None:
        self.traffic = Traffic()

    @abstractmethod
    def send(self, layer: int, tensors: list[torch.Tensor]) -> None:
        """Send the inputs of FFN segment ``layer``."""

    @abstractmethod
    def recv(self, layer: int, index: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Receive output ``index`` of FFN segment ``layer`` (blocks until it is there), as ``shape``
        (of ``dtype``, which the program checks)."""


class LoopbackConnector(Connector):
    """In-process connector: runs the FFN side synchronously when a result is first asked for."""

    def __init__(self, run_ffn: Callable[[int, list[torch.Tensor]], list[torch.Tensor]]):
        super().__init__()
        self._run_ffn = run_ffn
        self._pending: dict[int, list[torch.Tensor]] = {}
        self._results: dict[int, list[torch.Tensor | None]] = {}

    def send(self, layer: int, tensors: list[torch.Tensor]) -> None:
        if layer in self._pending or layer in self._results:
            raise RuntimeError(f"FFN segment {layer} was sent twice before its results were received")
        self._pending[layer] = tensors
        self.traffic.to_ffn_bytes += wire.nbytes(tensors)
        self.traffic.messages += 1

    @trace.phase("loopback.recv")
    def recv(self, layer: int, index: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        if layer in self._pending:
            self._results[layer] = list(self._run_ffn(layer, self._pending.pop(layer)))
            self.traffic.messages += 1
        results = self._results.get(layer)
        if results is not None and not 0 <= index < len(results):
            # a negative index would quietly read another output
            raise RuntimeError(f"FFN segment {layer} has {len(results)} outputs; output {index} was asked for")
        if results is None or results[index] is None:
            raise RuntimeError(f"FFN segment {layer} output {index} was received before it was sent")
        out, results[index] = results[index], None
        out = out.reshape(shape)  # a layer served by rows comes back as [tokens, per-token...]
        self.traffic.to_attn_bytes += out.numel() * out.element_size()
        if all(r is None for r in results):
            del self._results[layer]
        return out


def current() -> Connector:
    return context.current_link()


def active(connector: Connector):
    """Make ``connector`` the one send/recv ops talk to, for the ``with`` block."""
    return context.link_active(connector)
