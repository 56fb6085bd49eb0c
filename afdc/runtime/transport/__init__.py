"""The transports by connector name: the one place that knows every concrete transport.

What all transports share lives in :mod:`afdc.runtime.transport.base`, which imports none of them;
each medium is its own module (:mod:`~afdc.runtime.transport.gloo`, :mod:`~afdc.runtime.transport.nccl`,
:mod:`~afdc.runtime.transport.shm`, :mod:`~afdc.runtime.transport.cuda_ipc`). A new transport is added to
:data:`REGISTRY` here.
"""

from __future__ import annotations

from enum import Enum

from afdc.errors import AfdcError
from afdc.runtime.transport.base import Transport
from afdc.runtime.transport.cuda_ipc import CudaIpcTransport
from afdc.runtime.transport.gloo import GlooTransport
from afdc.runtime.transport.nccl import NcclTransport
from afdc.runtime.transport.shm import ShmTransport


class ConnectorKind(str, Enum):
    """What carries activations between the attention and the FFN side: the one list of them,
    from the CLI's choices to the transport registry (:data:`REGISTRY`)."""

    GLOO = "gloo"  # torch.distributed over TCP: any hosts
    NCCL = "nccl"  # GPU to GPU, any hosts
    SHM = "shm"  # shared memory, same host
    CUDA_IPC = "cuda-ipc"  # GPU memory shared between processes, same host
    LOOPBACK = "loopback"  # no link: the FFN programs run in the attention rank's process (monolithic)

    @property
    def in_process(self) -> bool:
        """Whether the FFN side runs in the attention rank's own process (no servers, no store)."""
        return self is ConnectorKind.LOOPBACK

    @classmethod
    def parse(cls, value: str | ConnectorKind) -> ConnectorKind:
        """``value`` as a kind, or an error naming the kinds there are."""
        try:
            return cls(value)
        except ValueError:
            names = ", ".join(k.value for k in cls)
            raise AfdcError(f"unknown connector {value!r}; choose one of {names}") from None

    def __str__(self) -> str:
        return self.value


REGISTRY: dict[ConnectorKind, type[Transport]] = {
    ConnectorKind.CUDA_IPC: CudaIpcTransport,
    ConnectorKind.GLOO: GlooTransport,
    ConnectorKind.NCCL: NcclTransport,
    ConnectorKind.SHM: ShmTransport,
}


def transport_class(kind: ConnectorKind | str) -> type[Transport]:
    """The transport that carries ``kind`` (or the connector so named) between processes."""
    kind = ConnectorKind.parse(kind)
    if kind.in_process:
        raise AfdcError("the loopback connector runs the FFN ranks in this process; launch them with 'gloo' or 'shm'")
    return REGISTRY[kind]
