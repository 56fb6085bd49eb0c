"""The NCCL transport: headers on gloo between hosts, payloads on NCCL between GPUs.

A header is small and its receive must be able to wait indefinitely (a server waits for the
next message), which NCCL cannot do: its watchdog aborts an operation that outlives the group's
timeout. So headers keep gloo's parked receives (:mod:`afdc.runtime.transport.gloo`), and a payload's NCCL
receive is posted only once its header has arrived, when the matching send is already queued;
no NCCL operation waits for longer than a message takes to cross.

Payloads go over two NCCL groups, one per direction. NCCL runs a communicator's operations in
order on one stream, so a reply queued on the communicator that also carries requests could
wait behind a receive; with a group per direction every communicator sees its sends and its
receives in the same order on both ends (a per-peer lock on the sender, one receiver thread per
peer). Each rank needs its own GPU (NCCL refuses two ranks on one device; use ``shm`` there).

A payload announced and not sent within ``timeout`` fails its receive and costs the peer its
link, as over gloo (a wait given a timeout blocks the receiving thread until the receive is done
or the timeout passed). It may cost more than that link: NCCL's watchdog aborts the communicator
of an operation that timed out (``TORCH_NCCL_ASYNC_ERROR_HANDLING=2``: without killing the
process), and the other links of that direction then fail and regroup.

Not yet run on a GPU: the sessions that built it had none. The same message path runs on CPU
with gloo (:class:`GlooTransport`), only the payload plane differs.
"""

from __future__ import annotations

import datetime
import os
import time

import torch
import torch.distributed as dist

from afdc.errors import AfdcError
from afdc.runtime import wire
from afdc.runtime.transport.gloo import GlooTransport


class NcclTransport(GlooTransport):
    def _open_payload_plane(self) -> None:
        if self.device.type != "cuda":
            raise AfdcError(
                f"the nccl connector moves GPU memory, but this rank runs on {self.device}; "
                "run it with --device cuda, or use the gloo or shm connector"
            )
        if not dist.is_nccl_available():
            raise AfdcError("this torch build has no NCCL; install a CUDA build of torch, or use the gloo connector")
        # a peer dying mid-payload must fail that operation, not abort this process (NCCL's default)
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
        self._planes = {}
        for role in ("attn", "ffn"):  # keyed by the sending role
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = datetime.timedelta(seconds=self.timeout)
            store = self.rendezvous.prefixed(self.group.generation, f"nccl-from-{role}")
            self._planes[role] = dist.ProcessGroupNCCL(store, self.slot, self.layout.world, options)

    def _payload(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        return wire.pack(tensors).to(self.device)

    def _send_payload(self, peer: int, payload: torch.Tensor) -> dist.Work:
        return self._planes[self.role].send([payload], peer, 0)

    def _recv_payload(self, peer: int, nbytes: int) -> torch.Tensor:
        sender_role, _ = self.layout.role_rank(peer)
        with torch.cuda.device(self.device):
            payload = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            # bounded by the transport's timeout, as over gloo (see the module docstring)
            self._await_payload(payload, self._planes[sender_role].recv([payload], peer, 0))
            # delivered only once its bytes are there: the program that reads it may run on any stream
            torch.cuda.current_stream(self.device).synchronize()
        return payload

    def _release(self) -> None:
        # NCCL's wait() does not block the host; let queued sends finish before the groups go
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline and not all(w.is_completed() for ws, _, _ in self._pending for w in ws):
            time.sleep(1e-3)
        super()._release()
        for plane in self._planes.values():
            plane.abort()
