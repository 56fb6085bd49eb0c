"""The ``torch.distributed`` transport: gloo point-to-point sends in one group of all A+F ranks.

Each generation forms its own gloo process group over the rendezvous store. A message is two
sends on the same pair: the fixed-size header, then the payload bytes, with distinct tags; a
per-peer lock keeps the two in order when several micro-batches send at once. One receiver
thread per peer posts blocking receives.

A receive that gives up cannot be withdrawn from gloo (its buffer would swallow the next
message), so receiver threads wait without a deadline; deadlines are enforced by the
attention side's exchange (see :mod:`afdc.runtime.exchange`). When a generation is left, its
receiver threads stay parked on the abandoned group until the process exits (one per peer per
regrouping).
"""

from __future__ import annotations

import collections
import contextlib
import datetime
import threading

import torch
import torch.distributed as dist

from afdc.runtime import wire
from afdc.runtime.rendezvous import Group, Rendezvous
from afdc.runtime.transport import LEFT, Deliver, Failure, Incoming, Transport, register

_HEADER_TAG, _PAYLOAD_TAG = 1, 2
_NO_DEADLINE = datetime.timedelta(days=365)  # see the module docstring: receives cannot be abandoned


@register("gloo")
class GlooTransport(Transport):
    def __init__(
        self,
        rendezvous: Rendezvous,
        group: Group,
        slot: int,
        role: str,
        timeout: float = 60.0,
        deliver: Deliver | None = None,
    ):
        super().__init__(rendezvous, group, slot, role, deliver)
        store = rendezvous.prefixed(group.generation, "gloo")
        self.pg = dist.ProcessGroupGloo(store, slot, self.layout.world, datetime.timedelta(seconds=timeout))
        self._locks = {p: threading.Lock() for p in self.layout.peers(role)}
        self._pending: collections.deque = collections.deque()
        self._closed = False
        for peer in self.layout.peers(role):
            threading.Thread(target=self._receive, args=(peer,), daemon=True, name=f"afdc-recv-{peer}").start()

    def send(self, peer: int, header: wire.Header, tensors: list[torch.Tensor]) -> None:
        head = torch.frombuffer(bytearray(header.encode()), dtype=torch.uint8)
        payload = wire.pack(tensors)
        with self._locks[peer]:
            works = [self.pg.send([head], peer, _HEADER_TAG)]
            if payload.numel():
                works.append(self.pg.send([payload], peer, _PAYLOAD_TAG))
        # sends complete asynchronously; their buffers must live until they do
        self._pending.append((works, head, payload))
        while self._pending and all(w.is_completed() for w in self._pending[0][0]):
            self._pending.popleft()

    def _receive(self, peer: int) -> None:
        while not self._closed:
            head = torch.empty(wire.HEADER_BYTES, dtype=torch.uint8)
            try:
                self.pg.recv([head], peer, _HEADER_TAG).wait(_NO_DEADLINE)
                header = wire.Header.decode(head.numpy().tobytes())
                if header.kind == wire.Kind.BYE:
                    self.deliver(Failure(peer, LEFT))
                    return
                payload = torch.empty(header.payload_bytes, dtype=torch.uint8)
                if header.payload_bytes:
                    self.pg.recv([payload], peer, _PAYLOAD_TAG).wait(_NO_DEADLINE)
            except (RuntimeError, wire.WireError) as err:
                if not self._closed:
                    self.deliver(Failure(peer, str(err)))
                return
            self.deliver(Incoming(header, wire.unpack(payload, header.tensors)))

    def _release(self) -> None:
        self._closed = True
        for works, _, _ in self._pending:  # the BYEs included: a peer must not see a half-sent message
            for w in works:
                with contextlib.suppress(RuntimeError):
                    w.wait()
        self._pending.clear()
