"""GPUs on one host: the shared-memory transport with its payload bytes in device memory.

Everything but where a slot's payload lives is :mod:`afdc.runtime.transport.shm`: the Unix-socket
handshake and its token proof, a :class:`~afdc.runtime.transport.shm.Mailbox` per direction of a
link whose control words and headers sit in a sealed memfd, the sequence numbers, the futex waits,
the peer's death heard as the socket's end. Here each mailbox also owns one buffer in the sending
rank's GPU memory, a slot per micro-batch, which the receiving rank maps through CUDA IPC (the
handle travels in the handshake, as hex: nothing is pickled). A payload goes device to device,
never through the host: the sender copies its tensors into the slot and waits for that copy on its
current stream before it posts the slot's sequence number; the receiver copies them out onto its
device and waits for that before it frees the slot. Two processes may share one GPU.

The waits are host-side: a step through it cannot be captured in a CUDA graph (that needs the
completion flags in device memory, waited on by the GPU). Run on one H200 with both processes on it,
where a round trip costs about what two processes taking turns on one GPU cost by themselves
(``benchmarks/RESULTS.md``); the shm transport it extends is tested on CPU.
"""

from __future__ import annotations

import torch

from afdc.errors import AfdcError
from afdc.runtime import wire
from afdc.runtime.transport.shm import Mailbox, ShmTransport


def _share(region: torch.Tensor) -> list:
    """What another process needs to map ``region``'s CUDA allocation (as JSON: bytes in hex)."""
    return [v.hex() if isinstance(v, bytes) else v for v in region.untyped_storage()._share_cuda_()]


def _mapped(shared: list) -> torch.Tensor:
    """The region another process shared (:func:`_share`), as a flat uint8 tensor on its device.
    The same steps as ``torch.multiprocessing``'s ``rebuild_cuda_tensor``, from JSON."""
    device, handle, size, offset, counter, counter_offset, event, event_sync = shared
    torch.cuda._lazy_init()
    storage = torch.UntypedStorage._new_shared_cuda(
        device, bytes.fromhex(handle), size, offset, bytes.fromhex(counter), counter_offset,
        bytes.fromhex(event), event_sync,
    )  # fmt: skip
    typed = torch.storage.TypedStorage(wrap_storage=storage, dtype=torch.uint8, _internal=True)
    return torch._utils._rebuild_tensor(typed, 0, (size,), (1,))


class DeviceMailbox(Mailbox):
    """A mailbox whose slots' payload bytes are in a GPU buffer of the sender's, shared by CUDA IPC."""

    payloads_in_file = False

    def __init__(self, fd: int, slots: int, slot_bytes: int, create: bool = False):
        super().__init__(fd, slots, slot_bytes, create)
        self._region: torch.Tensor | None = None  # set by create() or open()
        self._device = torch.device("cpu")  # where taken tensors go

    @classmethod
    def create(cls, slots: int, slot_bytes: int, device: torch.device) -> DeviceMailbox:
        box = super().create(slots, slot_bytes, device)
        box._region = torch.empty(slots * slot_bytes, dtype=torch.uint8, device=device)
        box._device = device
        return box

    def describe(self) -> dict:
        return {**super().describe(), "cuda_ipc": _share(self._region)}

    @classmethod
    def open(cls, description: dict, fd: int, device: torch.device, slots: int, slot_bytes: int) -> DeviceMailbox:
        box = super().open(description, fd, device, slots, slot_bytes)
        if "cuda_ipc" not in description:
            raise ConnectionError("the peer's mailbox has no device buffer: it runs another connector")
        box._region, box._device = _mapped(description["cuda_ipc"]), device
        if box._region.numel() != slots * slot_bytes:
            raise ConnectionError(f"the peer's device buffer holds {box._region.numel()} bytes, not the "
                                  f"{slots * slot_bytes} agreed: it runs another afdc")
        return box

    def _write(self, k: int, tensors: list[torch.Tensor]) -> None:
        at = k * self.slot_bytes
        with torch.cuda.device(self._region.device):
            for t in tensors:
                n = t.numel() * t.element_size()
                self._region[at : at + n].copy_(t.reshape(-1).view(torch.uint8))
                at += n
            torch.cuda.current_stream().synchronize()  # the bytes are there before the slot is posted

    def _read(self, k: int, specs: tuple[wire.TensorSpec, ...]) -> list[torch.Tensor]:
        tensors, at = [], k * self.slot_bytes
        with torch.cuda.device(self._device):
            for spec in specs:
                t = torch.empty(spec.shape, dtype=spec.dtype, device=self._device)
                t.reshape(-1).view(torch.uint8).copy_(self._region[at : at + spec.nbytes])
                tensors.append(t)
                at += spec.nbytes
            torch.cuda.current_stream().synchronize()  # copied out before the slot is freed
        return tensors


class CudaIpcTransport(ShmTransport):
    mailbox = DeviceMailbox

    def _open(self) -> None:
        if self.device.type != "cuda":
            raise AfdcError(
                f"the cuda-ipc connector moves GPU memory, but this rank runs on {self.device}; "
                "run it with --device cuda, or use the shm connector"
            )
        super()._open()

    def _staged(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` as its mailbox copies it: contiguous, on this rank's GPU (a step plan's counts
        are made in host memory)."""
        return t.detach().to(self.device).contiguous()
