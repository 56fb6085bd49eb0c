"""The transports by connector name: the one place that knows every concrete transport.

What all transports share lives in :mod:`afdc.runtime.transport.base`, which imports none of them;
each medium is its own module (:mod:`~afdc.runtime.transport.gloo`, :mod:`~afdc.runtime.transport.nccl`,
:mod:`~afdc.runtime.transport.shm`, :mod:`~afdc.runtime.transport.cuda_ipc`). A new transport is added to
:data:`REGISTRY` here.
"""

from __future__ import annotations

from afdc.errors import AfdcError
from afdc.runtime.options import ConnectorKind
from afdc.runtime.transport.base import Transport
from afdc.runtime.transport.cuda_ipc import CudaIpcTransport
from afdc.runtime.transport.gloo import GlooTransport
from afdc.runtime.transport.nccl import NcclTransport
from afdc.runtime.transport.shm import ShmTransport

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
