"""The ``torch.distributed`` transport: gloo point-to-point sends in one group of all A+F ranks.

Each generation forms its own gloo process group over the rendezvous store. A message is two
sends on the same pair: the fixed-size header, then the payload bytes, with distinct tags; a
per-peer lock keeps the two in order when several micro-batches send at once. One receiver
thread per peer posts blocking receives. Payloads ride the same group here; the NCCL transport
(:mod:`afdc.runtime.transport.nccl`) keeps the headers on gloo and moves the payloads between GPUs.

A receive that gives up cannot be withdrawn from gloo (its buffer would swallow the next
message), so a receiver thread waits for the next header without a deadline (deadlines for
replies are enforced by the attention side's exchange, see :mod:`afdc.runtime.exchange`). A
payload, though, is due once its header came: a peer that announces one and does not send it
within ``timeout`` loses its link, and only that link. Gloo ends a receive that times out by
closing every link of its group, so payloads go over a group of two per link (the headers'
group is never given a deadline): a timed-out payload closes its own link's group. The link is
then dropped (what the peer sends later is never read; the abandoned buffer is kept, since gloo
may still fill it). When a generation is left, its groups' links are closed (:meth:`GlooTransport._close_links`):
the receiver threads parked on them end, and their sockets go, whether or not the peers said BYE
(before, a peer that never did, stalled or gone silent, kept a thread and the group's sockets of
every generation it missed open until the process exited).
"""

from __future__ import annotations

import collections
import contextlib
import datetime
import threading

import torch
import torch.distributed as dist

from afdc.runtime import wire
from afdc.runtime.transport.base import LEFT, Failure, Transport

_HEADER_TAG, _PAYLOAD_TAG, _CLOSING_TAG = 1, 2, 3  # nothing is ever sent on the closing tag
_NO_DEADLINE = datetime.timedelta(days=365)  # see the module docstring: receives cannot be abandoned
_EMPTY = torch.empty(0, dtype=torch.uint8)
_CLOSING_WAIT = datetime.timedelta(milliseconds=1)


class GlooTransport(Transport):
    def _open(self) -> None:
        store = self.rendezvous.prefixed(self.group.generation, "gloo")
        self.pg = dist.ProcessGroupGloo(store, self.slot, self.layout.world, datetime.timedelta(seconds=self.timeout))
        self._links: dict[int, tuple[dist.ProcessGroupGloo, int]] = {}  # peer -> its link's group, its rank there
        self._open_payload_plane()
        self._locks = {p: threading.Lock() for p in self.layout.peers(self.role)}
        self._pending: collections.deque = collections.deque()
        self._dropped: set[int] = set()  # peers whose messages this end stopped reading
        self._abandoned: list[tuple[torch.Tensor, dist.Work]] = []  # payload receives given up on, kept
        self._closed = False
        for peer in self.layout.peers(self.role):
            threading.Thread(target=self._receive, args=(peer,), daemon=True, name=f"afdc-recv-{peer}").start()

    # -- where payloads go: the header's group (gloo moves host bytes) -------------------------

    def _open_payload_plane(self) -> None:
        """Set up what carries payloads (called before any receiver starts): a gloo group of two
        per link (see the module docstring). Every rank forms its links' groups in the order of
        (attention slot, FFN slot), so no two ranks wait for each other's next group."""
        me = 0 if self.role == "attn" else 1  # within a link's group
        for peer in self.layout.peers(self.role):
            pair = (self.slot, peer) if self.role == "attn" else (peer, self.slot)
            store = self.rendezvous.prefixed(self.group.generation, f"gloo-link-{pair[0]}-{pair[1]}")
            group = dist.ProcessGroupGloo(store, me, 2, datetime.timedelta(seconds=self.timeout))
            self._links[peer] = (group, 1 - me)

    def _payload(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        return wire.pack(tensors).cpu()

    def _send_payload(self, peer: int, payload: torch.Tensor) -> dist.Work:
        group, rank = self._links[peer]
        return group.send([payload], rank, _PAYLOAD_TAG)

    def _recv_payload(self, peer: int, nbytes: int) -> torch.Tensor:
        group, rank = self._links[peer]
        payload = torch.empty(nbytes, dtype=torch.uint8)
        self._await_payload(payload, group.recv([payload], rank, _PAYLOAD_TAG))
        return payload

    def _await_payload(self, payload: torch.Tensor, work: dist.Work) -> None:
        """Wait up to ``timeout`` for a payload's receive; past it, the peer loses its link
        (:class:`wire.WireError`) and the receive's buffer is kept: the medium may still write
        into it, so it must outlive the receive."""
        try:
            work.wait(datetime.timedelta(seconds=self.timeout))
        except RuntimeError as err:
            self._abandoned.append((payload, work))
            raise wire.WireError(
                f"it announced a payload of {payload.numel()} bytes and did not send it within {self.timeout:g} s "
                f"({str(err).splitlines()[0]})"
            ) from err

    # -- messages ------------------------------------------------------------------------------

    def send(self, peer: int, header: wire.Header, tensors: list[torch.Tensor]) -> None:
        self._check_outgoing(header)
        head = torch.frombuffer(bytearray(header.encode()), dtype=torch.uint8)
        payload = self._payload(tensors)
        with self._locks[peer]:
            works = [self.pg.send([head], peer, _HEADER_TAG)]
            if payload.numel():
                works.append(self._send_payload(peer, payload))
        # sends complete asynchronously; their buffers must live until they do
        self._pending.append((peer, works, head, payload))
        while self._pending and all(w.is_completed() for w in self._pending[0][1]):
            self._pending.popleft()

    def _receive(self, peer: int) -> None:
        """Receive ``peer``'s messages until it leaves or sends one that cannot be taken: then its
        link is dropped (what it sends next is never read, so it cannot be misparsed) and told so
        with BYE."""
        while not self._closed:
            head = torch.empty(wire.HEADER_BYTES, dtype=torch.uint8)
            try:
                self.pg.recv([head], peer, _HEADER_TAG).wait(_NO_DEADLINE)
            except RuntimeError as err:  # the peer's process is gone
                self._failed(peer, str(err))
                return
            try:
                header = wire.Header.decode(head.numpy().tobytes())
                if header.kind == wire.Kind.BYE:
                    self._failed(peer, LEFT)
                    return
                refusal = self._refusal(peer, header)
                if refusal:
                    raise wire.WireError(refusal)
                payload = self._recv_payload(peer, header.payload_bytes) if header.payload_bytes else _EMPTY
                incoming = self._incoming(header, payload)
            except (wire.WireError, RuntimeError, ValueError) as err:  # Runtime, Value: a payload torch refuses
                self._dropped.add(peer)
                self._failed(peer, f"a message it cannot take: {err}")
                if not self._closed:
                    self._say_bye(peer)
                return
            self.deliver(incoming)

    def _failed(self, peer: int, reason: str) -> None:
        if not self._closed:
            self.deliver(Failure(peer, reason))

    def _release(self) -> None:
        self._closed = True
        # the BYEs included: a peer must not see a half-sent message. A send to a dropped peer may
        # never complete (it does not post the receive): its buffers stay with this transport.
        kept = collections.deque(p for p in self._pending if p[0] in self._dropped)
        for peer, works, _, _ in self._pending:
            if peer not in self._dropped:
                for w in works:
                    with contextlib.suppress(RuntimeError):
                        w.wait()
        self._pending = kept
        self._close_links()

    def _close_links(self) -> None:
        """Close every link of this generation's gloo groups, so that the receives parked on them
        end now. Gloo offers no call that does (``ProcessGroupGloo.abort`` leaves them parked), but
        it closes every link of a group when a receive times out: a receive on a tag nobody
        sends on, given a millisecond, does it."""
        groups = [(self.pg, self.layout.peers(self.role)[0]), *self._links.values()]
        for group, peer in groups:
            with contextlib.suppress(RuntimeError):  # the timeout: what closes the links
                group.recv([torch.empty(1, dtype=torch.uint8)], peer, _CLOSING_TAG).wait(_CLOSING_WAIT)
