"""The attention side of the distributed runtime: one endpoint per attention rank.

The endpoint joins the deployment, sends each micro-batch's FFN inputs to the FFN ranks that
serve them and collects their replies, filed by (step, layer, micro-batch) and FFN rank, so
micro-batches can wait for their own results in any order: a polled transport's replies are
read out of their slots by the waiting micro-batch thread itself, other transports' receiver
threads file them as they land. A reply that does not
come within the timeout, or an FFN rank whose link breaks, raises :class:`afdc.PeerLost`
naming the rank and the layer; the next step regroups (a restarted FFN rank is picked up then).
"""

from __future__ import annotations

import functools
import hashlib
import threading
import time
from collections.abc import Sequence

import torch

from afdc.runtime import trace, wire
from afdc.runtime.link import Connector
from afdc.runtime.metrics import Metrics
from afdc.runtime.options import RuntimeOptions
from afdc.runtime.rendezvous import Layout, PeerLost, Rendezvous, RendezvousError
from afdc.runtime.spare import Slots
from afdc.runtime.transport import transport_class
from afdc.runtime.transport.base import LEFT, Failure, Incoming, Transport, Waiter
from afdc.segment import Dispatch, Share


def deployment_id(*parts: str | bytes) -> bytes:
    """8 bytes that every rank of one deployment computes alike (from the artifact or the programs)."""
    h = hashlib.sha256()
    for p in parts:
        h.update(p.encode() if isinstance(p, str) else p)
    return h.digest()[:8]


class AttentionEndpoint:
    def __init__(
        self, rank: int, rendezvous: Rendezvous, options: RuntimeOptions, device: torch.device | str = "cpu"
    ):
        self.rank = rank
        self.device = torch.device(device)  # where replies are delivered: the attention program's
        self.rendezvous = rendezvous
        self.options = options
        self.layout = rendezvous.layout
        self.slot = self.layout.slot("attn", rank)
        self.ffn_slots = self.layout.peers("attn")
        self.metrics = Metrics("attn", rank)
        self.transport: Transport | None = None
        self._broken = False
        self._failed: tuple[int, str, int | None] | None = None  # (FFN rank, reason, layer) of a failed exchange
        self._step = 0
        self._cond = threading.Condition()
        self._results: dict[tuple, list[torch.Tensor]] = {}
        self._errors: dict[tuple, str] = {}
        self._lost: dict[int, str] = {}
        self._sent_at: dict[tuple, float] = {}
        self._generation = -1  # of the transport whose deliveries are filed
        self._checked = 0.0  # when the store's generation was last read

    @classmethod
    def connect(
        cls, rank: int, layout: Layout, deployment: bytes, options: RuntimeOptions, device: torch.device | str = "cpu"
    ) -> AttentionEndpoint:
        """Attention rank ``rank``'s endpoint at ``options.rendezvous``; it joins at its first step."""
        rendezvous = Rendezvous(
            options.rendezvous, layout, deployment, options.token, connect_timeout=options.join_timeout,
            insecure_no_token=options.insecure_no_token,
        )
        return cls(rank, rendezvous, options, device)

    # -- membership --------------------------------------------------------------------------

    def begin_step(self, join_timeout: float | None = None) -> int:
        """Regroup if needed (first step, a lost peer, or a new generation); returns the step id.
        A regrouping waits up to ``join_timeout`` (default: the options') for every rank.

        A peer that restarts or leaves is heard at once (its link ends); a generation started by
        another attention rank is looked for in the store every ``poll_interval``, not every step
        (a store round trip, about half a millisecond of a busy host's step)."""
        stale = self.transport is None or self._broken or bool(self._lost)
        now = time.monotonic()
        if not stale and now - self._checked >= self.options.poll_interval:
            stale = self.rendezvous.generation() != self.transport.group.generation
            self._checked = now
        if stale:
            self._regroup(self.options.join_timeout if join_timeout is None else join_timeout)
            self._checked = time.monotonic()
        self._step += 1
        with self._cond:
            self._results.clear()
            self._errors.clear()
            self._sent_at.clear()
        return self._step

    def _regroup(self, join_timeout: float) -> None:
        # a rank that said BYE left a generation another rank started, or was stopped: not lost
        lost = {p for p, why in self._lost.items() if p in self.ffn_slots and why != LEFT}
        if self._failed is not None:
            lost.add(self.layout.slot("ffn", self._failed[0]))
        for slot in lost if self._generation >= 0 else ():  # for a spare to take over (afdc.runtime.spare)
            Slots(self.rendezvous).lost(slot, self._generation)
        self.close()
        # A lost peer's hello stays up in its generation: rejoining that generation would dial the
        # dead address until the connect timeout, so a new one is started unless a peer already did
        # (a restarted FFN rank bumps when it comes back).
        if self._broken or (self._lost and self.rendezvous.generation() == self._generation):
            self.rendezvous.bump()
        cls = transport_class(self.options.connector)
        group = self.rendezvous.join(self.slot, cls.address(self.rendezvous, self.slot), join_timeout)
        with self._cond:
            self._lost.clear()
        self._generation = group.generation
        file = functools.partial(self._file, group.generation)
        try:
            transport = cls(
                self.rendezvous, group, self.slot, "attn", self.options.timeout, deliver=file, device=self.device,
                pacing=self.options.pacing("attn"),
            )
        except (RuntimeError, OSError) as err:
            self._broken = True
            raise RendezvousError(
                f"attention rank {self.rank} could not reach the FFN ranks (generation {group.generation}): {err}"
            ) from err
        self.transport, self._broken, self._failed = transport, False, None
        self._waiter = Waiter(transport.pacing)

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()
            self.transport = None

    def _file(self, generation: int, item: Incoming | Failure) -> None:
        """File what a receiver thread got; what a left generation's threads still deliver is dropped."""
        with self._cond:
            self._filed(generation, item)
            self._cond.notify_all()

    def _filed(self, generation: int, item: Incoming | Failure) -> None:
        """:meth:`_file` with ``_cond`` held, waking no one (the waiting thread read it itself)."""
        if generation != self._generation:
            return
        if isinstance(item, Failure):
            self._lost[item.peer] = item.reason
        else:
            h = item.header
            key = (h.key, h.sender)
            self.metrics.received(h.payload_bytes)
            if h.kind == wire.Kind.ERROR:
                self._errors[key] = bytes(item.tensors[0].cpu().numpy()).decode(errors="replace")
            else:
                self._results[key] = item.tensors

    # -- exchange ----------------------------------------------------------------------------

    def _header(self, kind: wire.Kind, tensors: list[torch.Tensor], step: int, layer: int, micro_batch: int,
                tokens: int) -> wire.Header:
        """This rank's header of a ``kind`` message carrying ``tensors``, in its current generation."""
        return wire.Header.carrying(
            kind, tensors, deployment=self.rendezvous.deployment, generation=self.transport.group.generation,
            step=step, layer=layer, micro_batch=micro_batch, tokens=tokens, sender=self.slot,
        )

    def announce(self, step: int, tokens: list[int]) -> None:
        """Tell every FFN rank what step ``step`` holds (each micro-batch's token count), so each
        runs a layer once it has heard from every attention rank that sends it one."""
        assert self.transport is not None
        counts = [torch.tensor(tokens, dtype=torch.int64)]
        header = self._header(wire.Kind.STEP, counts, step, 0, len(tokens), sum(tokens))
        with self.metrics.phases.timed("plan"):
            for peer in self.ffn_slots:
                try:
                    self.transport.send(peer, header, counts)
                except (RuntimeError, OSError) as err:
                    # the step is lost before its first FFN layer: reported there, as a send would be
                    self._fail(peer, 0, f"could not send the step plan: {err}")

    @trace.phase("attn.endpoint_send")
    def send(self, step: int, layer: int, micro_batch: int, tokens: int, tensors: list[torch.Tensor], ffn_rank: int):
        """Send one message to FFN rank ``ffn_rank`` (a micro-batch's layer may go to several)."""
        assert self.transport is not None
        with self.metrics.phases.timed("send", per_message=True):
            sent_at = time.monotonic()
            header = self._header(wire.Kind.DATA, tensors, step, layer, micro_batch, tokens)
            peer = self.ffn_slots[ffn_rank]
            try:
                self.transport.send(peer, header, tensors)
            except (RuntimeError, OSError) as err:
                self._fail(peer, layer, f"send failed: {err}")
            # the rest runs while the FFN rank computes: nothing of it delays the reply
            # one dict operation, atomic under the GIL: no lock on the path of every message
            self._sent_at.setdefault((step, layer, micro_batch), sent_at)
            self._waiter.busy()  # a reply is due: its wait starts from the spin, however long this rank idled
            self.metrics.sent(header.payload_bytes)
            self.metrics.settle()

    @trace.phase("attn.wait")
    def wait(
        self, step: int, layer: int, micro_batch: int, ffn_ranks: list[int], spin: bool = True
    ) -> list[list[torch.Tensor]]:
        """The outputs of each of ``ffn_ranks`` for this message, in that order.

        Over a polled transport the calling micro-batch thread reads its replies out of their
        slots itself (``spin=False`` where other threads of this process compute meanwhile, see
        :meth:`Waiter.pauses`); otherwise the transport's receiver threads file them and this waits."""
        with self.metrics.phases.timed("wait", per_message=True):
            return self._wait(step, layer, micro_batch, ffn_ranks, spin)

    def _wait(self, step: int, layer: int, micro_batch: int, ffn_ranks: list[int], spin: bool) -> list:
        key = (step, layer, micro_batch)
        peers = [self.ffn_slots[r] for r in ffn_ranks]
        deadline = time.monotonic() + self.options.timeout
        polled = self.transport.polled
        phase = (peers[0], layer)  # its spin budget's key: the link and the layer
        sent_at = self._sent_at.get(key) or time.monotonic()
        generation = self._generation
        # a polled reply is mostly posted by the time its wait starts (the server ran meanwhile on
        # the core this rank gave up): it is looked for first, and filed and returned under one lock
        missing, pause = peers, None
        arrived = self.transport.receive(missing, micro_batch) if polled else []
        while True:
            with self._cond:
                for item in arrived:
                    self._filed(generation, item)
                if self._failed is not None:  # another micro-batch's exchange failed: a regroup follows
                    raise PeerLost("ffn", *self._failed)
                for peer in peers:
                    if (key, peer) in self._errors:
                        _, rank = self.layout.role_rank(peer)
                        raise PeerLost("ffn", rank, f"refused the message: {self._errors[key, peer]}", layer)
                    if peer in self._lost:
                        self._fail(peer, layer, f"its link broke ({self._lost[peer]})")
                missing = [p for p in peers if (key, p) not in self._results]
                now = time.monotonic()
                if not missing:
                    self._waiter.waited(now - deadline + self.options.timeout)
                    self._waiter.answered(phase, now - sent_at)
                    self.metrics.exchanged(now - self._sent_at.pop(key, sent_at))
                    return [self._results.pop((key, p)) for p in peers]
                if now >= deadline:
                    self._fail(missing[0], layer, f"no reply within {self.options.timeout:g} s (step {step})")
                if not polled:
                    self._cond.wait(deadline - now)
                    continue
                if pause is None:  # under the lock: the waiter's budgets are this rank's threads' in common
                    spin_for = self._waiter.spin_left(phase, sent_at, now)
            if pause is None:  # blocks on the first reply still missing (the others are taken as they land)
                block = lambda seconds: self.transport.block(missing, micro_batch, seconds)  # noqa: B023, E731
                pause = self._waiter.pauses(spin, block, self.transport.wakes, deadline, spin_for)
            # poll the slots alone until something lands; a lost peer or a refusal (filed by the
            # socket's receiver thread) or the deadline sends the wait back to the checks above
            arrived = []
            while not arrived and not (self._lost or self._errors) and time.monotonic() < deadline:
                pause()
                arrived = self.transport.receive(missing, micro_batch)
            if not arrived:  # another rank's loss filed meanwhile must not make this wait a hot loop
                pause()

    def _fail(self, peer: int, layer: int | None, reason: str):
        self._broken = True
        self.metrics.errors += 1
        _, rank = self.layout.role_rank(peer)
        self._failed = (rank, reason, layer)
        raise PeerLost("ffn", rank, reason, layer)


class RemoteConnector(Connector):
    """One micro-batch's connector for one step: sends each layer's inputs to the FFN ranks that
    serve them (:class:`Dispatch`) and combines their replies."""

    def __init__(
        self,
        endpoint: AttentionEndpoint,
        step: int,
        micro_batch: int,
        tokens: int,
        dispatch: list[Dispatch],
        spin: bool = True,
    ):
        super().__init__()
        self.endpoint, self.step, self.micro_batch, self.tokens = endpoint, step, micro_batch, tokens
        self.spin = spin  # whether waiting for a reply may poll without sleeping (no other thread computes)
        self.dispatch = dispatch
        self._shares: dict[int, Sequence[Share]] = {}  # layer -> where its tokens went
        self._replies: dict[int, list[list[torch.Tensor]]] = {}  # layer -> per share, its outputs

    @trace.phase("attn.connector_send")
    def send(self, layer: int, tensors: list[torch.Tensor]) -> None:
        dispatch = self.dispatch[layer]
        shares = self._shares[layer] = dispatch.shares(tensors, self.tokens, len(self.endpoint.ffn_slots))
        for share in shares:
            part = dispatch.take(tensors, share, self.tokens)
            self.endpoint.send(self.step, layer, self.micro_batch, share.count, part, share.rank)
            self.traffic.to_ffn_bytes += wire.nbytes(part)
        self.traffic.messages += 1

    @trace.phase("attn.connector_recv")
    def recv(self, layer: int, index: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        shares = self._shares[layer]
        if layer not in self._replies:
            self._replies[layer] = self.endpoint.wait(
                self.step, layer, self.micro_batch, [s.rank for s in shares], self.spin
            )
            self.traffic.messages += 1
        # a batched FFN run replies with [tokens, per-token...]: each rank's part takes the program's
        # shape (a reshape is a torch call of microseconds, skipped where the shape is already right)
        dispatch = self.dispatch[layer]
        replies = [reply[index] for reply in self._replies[layer]]
        if not dispatch.partial_rows:
            replies = [r if r.shape == shape else r.reshape(shape) for r in replies]
        out = dispatch.combine(index, replies, shares)
        self.traffic.to_attn_bytes += sum(r.numel() * r.element_size() for r in replies)
        return out if out.shape == shape else out.reshape(shape)
