"""Transports: one rank's message links to its peers for one rendezvous generation.

A transport sends typed messages (:mod:`afdc.runtime.wire`) to a peer slot and delivers what
arrives from any peer, from receiver threads: into one inbox, or straight to a ``deliver``
callback (the attention side files replies as they land, one thread hand-off fewer). A peer that drops its link or
sends something malformed shows up in the inbox as a :class:`Failure`; the transport itself
never raises on the receiving side. Transports are chosen by connector name from the registry in
:mod:`afdc.runtime.transport`; this module holds what they all share and imports none of them.

Tensors are sent from any device and delivered on the rank's ``device`` (where its program
runs): a medium that moves host bytes (gloo, shared memory) stages device tensors through host
memory; NCCL moves GPU memory directly.
"""

from __future__ import annotations

import contextlib
import math
import os
import queue
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from enum import Enum

import torch

from afdc.errors import AfdcError
from afdc.runtime.rendezvous import Group, Layout, Rendezvous
from afdc.runtime.transport.spin_budget import BudgetSettings, SpinBudget
from afdc.runtime.wire import Header, Kind, WireError, unpack


@dataclass
class Incoming:
    header: Header
    tensors: list[torch.Tensor]


LEFT = "left the deployment"


@dataclass
class Failure:
    """No more comes from ``peer``: it said BYE (reason :data:`LEFT`), or its link broke (closed,
    or a message that cannot be parsed)."""

    peer: int
    reason: str


Deliver = Callable[["Incoming | Failure"], None]


_UNLEARNED = 64  # answers noted before they are learned anyway (a party that never waits long)

SPIN_CORES = 8  # --wait cores: a host with fewer has no core to spare for an FFN server's polls (default_spin)


class WaitPolicy(str, Enum):
    """How a rank's wait for its peer over shm chooses between polling and sleeping, unless
    ``spin`` fixes it (see :class:`afdc.runtime.transport.base.Waiter`)."""

    ADAPTIVE = "adaptive"  # poll only while the peer's answer is likely soon, learned per link and phase
    CORES = "cores"  # the earlier fixed policy: attention ranks poll 2 ms, FFN servers only on 8 cores or more

    @classmethod
    def parse(cls, value: str | WaitPolicy) -> WaitPolicy:
        try:
            return cls(value)
        except ValueError:
            raise AfdcError(f"unknown wait policy {value!r}; choose one of {', '.join(k.value for k in cls)}") from None

    def __str__(self) -> str:
        return self.value



def default_spin(role: str, cores: int | None = None) -> float:
    """How long a wait of a ``role`` rank polls before it blocks under ``--wait cores`` (the
    policy before the adaptive wait, kept to compare against it).

    An attention rank polls for up to 2 ms wherever it runs; an FFN server polls (2 ms) only
    where this process may run on :data:`SPIN_CORES` cores or more (``cores``; default: those it
    may run on). Right for the load it was chosen on (vLLM serving the demo on 2 cores, where the
    server's polls took the attention engine's core), wrong for the next: under ``dm.launch()``
    a tiny model's server then waits out a futex wake-up for every layer (issue 54)."""
    if role == "attn":
        return 2e-3
    cores = len(os.sched_getaffinity(0)) if cores is None else cores
    return 2e-3 if cores >= SPIN_CORES else 0.0


@dataclass(frozen=True)
class Pacing:
    """How a rank waits for a word that a peer writes into shared memory (see :class:`Waiter`)."""

    spin: float | None = 2e-3  # the longest a wait polls before it blocks; None: learned (SpinBudget)
    max_sleep: float = 2e-4  # no wake-up to block on: the longest sleep between two polls of a busy rank
    idle_sleep: float = 2e-3  # ... of a rank that has waited ``idle_after`` seconds
    idle_after: float = 0.05
    block: float = 0.05  # the longest one block on a wake-up lasts (a wait looks at its deadline then)
    budget: BudgetSettings = field(default_factory=BudgetSettings)  # how a learned spin is learned (``spin`` None)
    # a poll that comes back this late from its yield ends the spin: another task wanted the core
    yield_late: float = 2e-4
    # of the newest count in the moving average of the host's runnable tasks a learned spin looks at
    crowd_weight: float = 0.05


class Waiter:
    """One party's waits. A wait polls, yielding the core between polls, for a while, then
    blocks: on a word that wakes it when the awaited message is posted (a futex,
    :meth:`Transport.block`), for up to ``block`` seconds at a time; where there is none, it
    sleeps between polls, doubling the sleep from 20 us up to ``max_sleep``, and up to
    ``idle_sleep`` once nothing has come for ``idle_after``: a busy exchange answers within
    microseconds, an idle deployment does not burn its cores. Idle is counted from the last wait
    that ended with something, across waits (a server's wait returns every ``poll_interval`` to
    look for a regrouping; a wait that started spinning afresh each time burned 5% of a core).

    How long a wait polls: with a fixed ``spin`` (``--spin``, ``--wait cores``) up to ``spin``,
    unless its waits have lately outlasted it (the peer computes for milliseconds, on the same
    cores of a CPU host): then it blocks from the first pause and leaves the core to that
    computation. With ``spin`` None, what the caller's key (its link and phase) has left of its
    learned budget (:meth:`spin_left`, :mod:`.spin_budget`), counted from the message it answers;
    such a spin also ends where a poll comes back late from its yield (``yield_late``): the core
    was wanted by another task (or by the peer itself, sharing it), and spinning on would only
    delay that task."""

    def __init__(self, pacing: Pacing):
        self.pacing = pacing
        self.typical = 0.0  # seconds, a moving average of this party's recent waits
        self.last = time.monotonic()  # when a wait last ended with something
        self.budget = SpinBudget(pacing.budget) if pacing.spin is None else None
        self._answers: list[tuple[Hashable, float]] = []  # heard, not yet learned (see answered)
        self.crowd = 1.0  # tasks runnable on the host when this party's learned spins began, on average

    def spin_left(self, key: Hashable, since: float, now: float) -> float:
        """A learned wait for ``key``'s answer to a message posted at ``since``: how long it may
        still poll at ``now`` (0 under a fixed spin, which :meth:`pauses` applies itself). Not
        thread-safe, as :class:`SpinBudget`: the caller serializes it with :meth:`answered`."""
        if self.budget is None:
            return 0.0
        self._learn()
        return max(0.0, since + self.budget.budget(key) - now)

    def answered(self, key: Hashable, seconds: float) -> None:
        """The peer answered ``key`` ``seconds`` after the message (learned where the spin is).

        Only noted here: the answer is on the path of the exchange (the peer waits for what this
        party does with it), and learning it is a few dict and float operations, slow with the
        caches cold from the computation before it. It is learned by the next wait that asks
        :meth:`spin_left`, which only asks once its message is posted and its answer not there."""
        if self.budget is not None:
            self._answers.append((key, seconds))
            if len(self._answers) > _UNLEARNED:
                self._learn()

    def _learn(self) -> None:
        answers, self._answers = self._answers, []
        for key, seconds in answers:
            self.budget.answered(key, seconds)

    def pauses(
        self,
        spin: bool = True,
        block: Callable[[float], None] = time.sleep,
        wakes: bool = False,
        until: float = math.inf,
        spin_for: float = 0.0,
    ) -> Callable[[], None]:
        """A pause to call between two polls of one wait. ``spin=False`` blocks from the first
        pause: a thread that polls takes Python's GIL back from a sched_yield before a thread
        waiting for it wakes, so where other threads of the process compute meanwhile (the other
        micro-batches), polling would starve them. ``spin_for``: how long a learned wait polls
        (:meth:`spin_left`; a fixed spin ignores it). ``block(seconds)`` sleeps; ``wakes``: it
        wakes when the awaited word changes, or when the transport wakes it for a message that
        came another way (:meth:`Transport.block`), so it sleeps ``block`` seconds at a time.
        No pause sleeps past ``until`` (a monotonic time: the wait's own deadline)."""
        p = self.pacing
        start = time.monotonic()
        idle = start - self.last >= p.idle_after
        if not spin or idle or (p.spin is None and spin_for and not self._core_free()):
            spin_for = 0.0
        elif p.spin is not None:
            spin_for = p.spin if self.typical < p.spin else 0.0
        sleep = p.idle_sleep if idle else 2e-5
        late = p.yield_late if p.spin is None else math.inf

        def pause() -> None:
            nonlocal sleep, spin_for
            now = time.monotonic()
            if now - start < spin_for:
                os.sched_yield()
                if time.monotonic() - now > late:
                    # the yield gave the core away: another task wants it, and spinning on would
                    # take it from that task (or from the peer itself, where both share the core)
                    spin_for = 0.0
                return
            if wakes:
                block(max(0.0, min(p.block, until - now)))
                return
            block(max(0.0, min(sleep, until - now)))
            sleep = min(2 * sleep, p.max_sleep if now - self.last < p.idle_after else p.idle_sleep)

        return pause

    def _core_free(self) -> bool:
        """Whether a learned spin would have a core to itself: fewer tasks runnable on the host
        besides this one than it has cores, as a moving average over this party's spins (the
        kernel's count at each: :func:`runnable_tasks`). A spin pays only where a core would
        otherwise idle; on a host with more to run than cores (vLLM's API server, its engine and
        the benchmark's client beside the FFN server on two cores) it takes a core from that work
        at every yield that does not give it away, and the peer's answer is no sooner for it."""
        running = runnable_tasks()
        if running is None:  # the system does not say: spin as learned
            return True
        self.crowd += self.pacing.crowd_weight * (running - self.crowd)
        return self.crowd - 1 < (os.cpu_count() or 1)

    def busy(self) -> None:
        """Something is due soon: the next wait is not idle."""
        self.last = time.monotonic()

    def waited(self, seconds: float) -> None:
        """A wait ended with something after ``seconds``."""
        self.typical += 0.25 * (seconds - self.typical)
        self.busy()


def _open_loadavg() -> int:
    try:
        return os.open("/proc/loadavg", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return -1


_LOADAVG = _open_loadavg()  # read in place by every thread (pread), for as long as the process lives


def runnable_tasks() -> int | None:
    """How many tasks on this host are runnable now, the caller included (Linux's /proc/loadavg;
    about two microseconds a read); None where the system does not say."""
    if _LOADAVG < 0:
        return None
    try:
        return int(os.pread(_LOADAVG, 128, 0).split()[3].split(b"/")[0])
    except (OSError, ValueError, IndexError):
        return None


class Transport(ABC):
    # The largest message a rank takes (header's claim, before anything is allocated for it); a peer
    # that sends a bigger one loses its link. Every rank runs the same afdc, so both ends agree.
    max_message_bytes = 1 << 28

    def __init__(
        self,
        rendezvous: Rendezvous,
        group: Group,
        slot: int,
        role: str,
        timeout: float = 60.0,
        deliver: Deliver | None = None,
        device: torch.device | str = "cpu",
        pacing: Pacing = Pacing(),
    ):
        self.rendezvous = rendezvous
        self.group = group
        self.slot = slot
        self.role = role
        self.timeout = timeout  # for forming links and for a send that cannot proceed
        self.device = torch.device(device)
        self.pacing = pacing
        self.inbox: queue.Queue[Incoming | Failure] = queue.Queue()
        self.deliver: Deliver = deliver or self.inbox.put
        self._open()

    @abstractmethod
    def _open(self) -> None:
        """Form this generation's links to the peers and start receiving."""

    @property
    def layout(self) -> Layout:
        return self.rendezvous.layout

    @abstractmethod
    def send(self, peer: int, header: Header, tensors: list[torch.Tensor]) -> None:
        """Queue a message to ``peer``; returns before it is delivered where the medium allows."""

    polled = False  # True: data messages wait in slots that the receiving rank reads (:meth:`receive`)

    def receive(self, peers: list[int], micro_batch: int) -> list[Incoming]:
        """A polled transport's data messages from ``peers`` for ``micro_batch`` that have arrived
        (without waiting); the rest arrive through ``deliver``."""
        raise NotImplementedError(f"{type(self).__name__} delivers every message through its receiver threads")

    def block(self, peers: list[int], micro_batch: int, seconds: float) -> None:
        """A polled transport: sleep up to ``seconds`` between two :meth:`receive` calls, less
        where it can wake when a message for ``micro_batch`` from ``peers`` is posted."""
        time.sleep(seconds)

    wakes = False  # whether :meth:`block` ends when a message is posted, or when one comes another way

    def collect(self, wait: float) -> list[Incoming | Failure]:
        """Everything that has arrived for a rank without ``deliver`` (the FFN server), waiting up
        to ``wait`` s for the first."""
        try:
            items = [self.inbox.get(timeout=wait) if wait else self.inbox.get_nowait()]
        except queue.Empty:
            return []
        return items + self._drain()

    def _drain(self) -> list[Incoming | Failure]:
        items = []
        while True:
            try:
                items.append(self.inbox.get_nowait())
            except queue.Empty:
                return items

    def close(self) -> None:
        """Leave this generation: say BYE to every peer (so their receivers stop cleanly), then
        release the links."""
        for peer in self.layout.peers(self.role):
            self._say_bye(peer)
        self._release()

    def _say_bye(self, peer: int) -> None:
        bye = Header(Kind.BYE, self.rendezvous.deployment, self.group.generation, 0, 0, 0, 0, self.slot)
        with contextlib.suppress(RuntimeError, OSError):  # a peer already gone needs no goodbye
            self.send(peer, bye, [])

    def _refusal(self, peer: int, header: Header) -> str:
        """Why a message that came on ``peer``'s link cannot be taken ("" when it can), said before
        anything is allocated for its payload: it claims to come from another slot, or it is bigger
        than any message a rank takes. Either ends the link."""
        if header.sender != peer:
            return f"a message on the link of slot {peer} says it comes from slot {header.sender}"
        if header.payload_bytes > self.max_message_bytes:
            return (f"a message of {header.payload_bytes} bytes, more than the {self.max_message_bytes} "
                    "a rank takes")
        return ""

    def _check_outgoing(self, header: Header) -> None:
        """Refuse to send what the peer would refuse (:meth:`_refusal`), saying so here."""
        if header.payload_bytes > self.max_message_bytes:
            raise WireError(
                f"a message of {header.payload_bytes} bytes ({len(header.tensors)} tensors, {header.tokens} tokens) "
                f"exceeds the {self.max_message_bytes} bytes a rank takes; send fewer tokens per step"
            )

    def _arrived(self, header: Header, payload: torch.Tensor) -> None:
        """Deliver a message whose payload bytes (uint8, on any device) have all arrived."""
        self.deliver(self._incoming(header, payload))

    def _incoming(self, header: Header, payload: torch.Tensor) -> Incoming:
        return Incoming(header, unpack(payload.to(self.device), header.tensors))

    @abstractmethod
    def _release(self) -> None:
        """Close this generation's links; receivers stop without reporting failures."""

    @staticmethod
    def address(rendezvous: Rendezvous, slot: int) -> str:
        """What this slot publishes in its hello for peers to reach it (empty: nothing)."""
        return ""
