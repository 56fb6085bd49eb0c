"""Rendezvous: how the ranks of a deployment find each other, prove they belong, and regroup.

A deployment of plan ``xAyF`` has ``x + y`` slots: attention ranks ``0..x-1`` take slots
``0..x-1``, FFN rank ``j`` takes slot ``x + j``. They meet in a ``torch.distributed.TCPStore``
(hosted by attention rank 0, or by the process that launched the deployment).

Membership is organised in *generations*. A generation is formed when every slot has posted a
hello for it; the hello carries an HMAC of the deployment's shared token, so a process without
the token is refused (and logged) and never becomes a member. A rank that (re)starts, or that
lost a peer, bumps the store's generation counter; every live rank sees the counter move and
joins the new generation. That is how a restarted FFN rank rejoins without restarting anyone.

The store's host stamps it with its deployment id and a proof of its token: a process of another
artifact or token learns at once that it is refused, and why (:class:`JoinError`), and so does one
whose slot a live process of this host holds. A launcher that sees one of its processes exit
records it (:meth:`Rendezvous.record_exit`), so a rank waiting for that slot hears it at once.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import json
import logging
import os
import socket
import threading
import time
from dataclasses import asdict, dataclass

import torch.distributed as dist

from afdc.errors import AfdcError

log = logging.getLogger("afdc.rendezvous")


class PeerLost(AfdcError):
    """A peer rank died, stalled, or did not (re)join in time. Names the rank and, when known, the layer."""

    def __init__(self, role: str, rank: int, reason: str, layer: int | None = None):
        self.role, self.rank, self.layer = role, rank, layer
        where = f" at FFN layer {layer}" if layer is not None else ""
        super().__init__(f"{role} rank {rank} lost{where}: {reason}")


class RendezvousError(AfdcError):
    """The rendezvous store cannot be reached or hosted."""


class JoinError(RendezvousError):
    """A rank cannot join the deployment: this process was refused (another token or artifact than
    the store's host, or its slot held by a live process), or the missing rank's launcher saw its
    process exit. ``role`` and ``rank`` name the rank, None where the refusal came before this
    process named its slot."""

    def __init__(self, reason: str, role: str | None = None, rank: int | None = None):
        self.reason, self.role, self.rank = reason, role, rank
        super().__init__(f"{role} rank {rank} {reason}" if role is not None else reason)


@dataclass(frozen=True)
class Layout:
    """The slots of a plan: attention ranks first, then FFN ranks."""

    attention_ranks: int
    ffn_ranks: int

    @property
    def world(self) -> int:
        return self.attention_ranks + self.ffn_ranks

    def slot(self, role: str, rank: int) -> int:
        count = self.attention_ranks if role == "attn" else self.ffn_ranks
        if role not in ("attn", "ffn") or not 0 <= rank < count:
            raise AfdcError(f"the plan has {count} {role} ranks; rank {rank} is not one of them")
        return rank if role == "attn" else self.attention_ranks + rank

    def role_rank(self, slot: int) -> tuple[str, int]:
        return ("attn", slot) if slot < self.attention_ranks else ("ffn", slot - self.attention_ranks)

    def peers(self, role: str) -> list[int]:
        """The slots a rank of ``role`` exchanges messages with (the other role's)."""
        if role == "attn":
            return list(range(self.attention_ranks, self.world))
        return list(range(self.attention_ranks))


@dataclass(frozen=True)
class Member:
    """A slot's hello for one generation."""

    slot: int
    pid: int
    host: str
    address: str  # transport-specific (the shared-memory connector's socket path)
    proof: str  # HMAC-SHA256 of the token over (deployment, generation, slot)


SERVING, DEGRADED, UNAVAILABLE = "serving", "degraded", "unavailable"
_HEALTH_BYTES = 4096  # the most a health record may hold (the store is writable by whoever reaches it)


@dataclass(frozen=True)
class Health:
    """What a rank reports of itself. ``degraded``: it cannot serve (``problem`` says why) and
    holds its requests while it waits for the problem to pass; ``unavailable``: it has stopped
    waiting, and its requests fail."""

    state: str = SERVING
    problem: str = ""

    def encode(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def decode(cls, raw: bytes) -> Health:
        """A stored record, read as data: anything malformed is an unavailable rank that says so."""
        try:
            if len(raw) > _HEALTH_BYTES:
                raise ValueError(f"{len(raw)} bytes")
            record = json.loads(raw)
            health = cls(str(record["state"]), str(record["problem"]))
            if health.state not in (SERVING, DEGRADED, UNAVAILABLE):
                raise ValueError(f"state {health.state[:32]!r}")
        except (TypeError, ValueError, KeyError) as err:
            return cls(UNAVAILABLE, f"a malformed health record in the rendezvous store ({str(err)[:200]})")
        return health


@dataclass(frozen=True)
class Group:
    generation: int
    members: dict[int, Member]


def _proof(token: str, deployment: bytes, generation: int, slot: int) -> str:
    return sign(token, deployment.hex(), str(generation), str(slot))


def sign(token: str, *parts: str) -> str:
    """HMAC-SHA256 of the token over ``parts`` joined by ":". A hello's proof signs hex first, the
    other records a word that is not hex, so no record's proof passes for another's."""
    return hmac.new(token.encode(), ":".join(parts).encode(), hashlib.sha256).hexdigest()


def _alive(pid: int) -> bool:
    """Whether process ``pid`` of this host runs (an exited one its parent has not reaped does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rpartition(")")[2].split()[0] != "Z"
    except (OSError, IndexError):
        return True


_ABSENT = "\x00afdc:absent"  # no record's value: records are JSON or text


def read_key(store: dist.Store, key: str) -> bytes | None:
    """``key``'s value, or None at once when it is not there. One compare-and-set that changes
    nothing: a check then a get would block until the store's timeout when the key is deleted
    between them (an exit record cleared, a refused hello dropped)."""
    value = store.compare_set(key, _ABSENT, _ABSENT)
    return None if value == _ABSENT.encode() else value


INSECURE_FLAG = "--insecure-no-token"


def deployment_token(token: str | None, insecure_no_token: bool = False) -> str:
    """The deployment's token: ``token``, else ``$AFDC_TOKEN``. Without one any process that
    reaches the store could join and send the FFN servers what it likes, so a deployment without
    a token is refused unless its user said so (``insecure_no_token``, the CLI's
    ``--insecure-no-token``)."""
    token = token if token is not None else os.environ.get("AFDC_TOKEN", "")
    if not token and not insecure_no_token:
        raise RendezvousError(
            "no deployment token: set AFDC_TOKEN (or --token) to the same secret on every rank (`afdc up` and "
            f"dm.launch() make one themselves), or pass {INSECURE_FLAG} to let any process that reaches the "
            "rendezvous store join"
        )
    if not token:
        log.warning("no deployment token (%s): any process reaching the rendezvous can join", INSECURE_FLAG)
    return token


def parse_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise RendezvousError(f"rendezvous address {address!r} is not HOST:PORT")
    return host or "127.0.0.1", int(port)


def wait_listening(address: str, timeout: float, stop: threading.Event, poll: float = 0.2) -> bool:
    """Wait until something listens at ``address`` (the store's host is up): True then, False at
    once when ``stop`` is set, :class:`RendezvousError` after ``timeout`` seconds. TCPStore's own
    connect retries in C++ with a growing backoff (tens of seconds) that no signal interrupts, and
    logs a trace per try: a rank started before the store's host waits here instead, then
    connects at once."""
    host, port = parse_address(address)
    deadline = time.monotonic() + timeout
    while not stop.is_set():
        try:
            with socket.create_connection((host, port), timeout=poll) as probe:
                # a probe from a port in the ephemeral range can connect to itself (TCP self-connect)
                if probe.getsockname()[:2] != probe.getpeername()[:2]:
                    return True
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise _unreachable(address, timeout, "nothing listens there")
        stop.wait(poll)
    return False


def _unreachable(address: str, seconds: float, why: object, host: bool = False) -> RendezvousError:
    return RendezvousError(
        f"cannot {'host' if host else 'reach'} the rendezvous store at {address} within {seconds:g} s ({why}); "
        "check the address, that attention rank 0 (or the launcher) is up, and firewalls"
    )


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class Rendezvous:
    """One rank's handle on the deployment's store."""

    def __init__(
        self,
        address: str,
        layout: Layout,
        deployment: bytes,
        token: str | None,
        host: bool = False,
        connect_timeout: float = 30.0,
        insecure_no_token: bool = False,
    ):
        self.layout = layout
        self.deployment = deployment
        self.address = address
        hostname, port = parse_address(address)
        try:
            self.store = dist.TCPStore(
                hostname,
                port,
                is_master=host,
                wait_for_workers=False,
                timeout=datetime.timedelta(seconds=connect_timeout),
            )
        except (RuntimeError, OSError) as err:
            raise _unreachable(address, connect_timeout, err, host) from err
        self.token = deployment_token(token, insecure_no_token)  # after the store: an unreachable one is said first
        self._host_checked = host  # whether this process's token and deployment are the store host's
        self._refused: dict[int, str] = {}  # slot -> the last process refused for it (said if the slot stays empty)
        self.replacing: set[int] = set()  # slots this process claimed as a spare: it replaces their holder, live or not
        if host:
            self.store.set("host", json.dumps({"deployment": deployment.hex(), "proof": self._stamp()}))

    def generation(self) -> int:
        return self.store.add("generation", 0)

    def bump(self) -> int:
        """Start a new generation (after a restart or a lost peer); returns its number. A process the
        store's host refuses raises :class:`JoinError` instead: it must not make the members regroup."""
        self._check_host()
        return self.store.add("generation", 1)

    def check_slot(self, slot: int) -> None:
        """Raise :class:`JoinError` now where :meth:`join` would refuse this process for ``slot``
        (another token or artifact than the store's host, or the slot held by a live process of
        this host); a server that calls it before :meth:`bump` makes no one regroup when refused."""
        self._check_host(slot)
        self._check_held(slot)

    def check_host(self) -> None:
        """Raise :class:`JoinError` where the store's host has another token or artifact than this process."""
        self._check_host()

    def proof(self, generation: int, slot: int) -> str:
        """What ``slot`` presents for ``generation``: proves the token without sending it."""
        return _proof(self.token, self.deployment, generation, slot)

    def join(
        self,
        slot: int,
        address: str = "",
        timeout: float | None = None,
        stop: threading.Event | None = None,
        poll: float = 0.02,
    ) -> Group | None:
        """Post this slot's hello for the current generation and wait until every slot has one.

        Follows the generation counter if it moves while waiting. ``timeout`` None waits until
        ``stop`` is set (servers waiting for clients; returns None then); otherwise
        :class:`PeerLost` names a missing slot, and :class:`JoinError` one whose launcher recorded
        that its process exited (:meth:`record_exit`). :class:`JoinError` also says why this
        process is refused: another token or artifact than the store's host, or its slot held.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        next_log = time.monotonic() + 10.0
        self._refused.clear()  # refusals seen by an earlier join are not this one's
        self._check_held(slot)
        while True:
            gen = self.generation()
            me = Member(
                slot, os.getpid(), socket.gethostname(), address, self.proof(gen, slot)
            )
            hello = json.dumps(asdict(me))
            # checked before the hello is up: once a member can count it, nothing a stranger then
            # writes into the store may refuse it. A refused hello still goes up, for the members' logs.
            try:
                self._check_host(slot)
            finally:
                self.store.set(f"g{gen}/hello/{slot}", hello)
            members = {slot: me}
            while self.generation() == gen and len(members) < self.layout.world:
                self._check_host(slot)  # a host that stamps the store after this process came
                for other in range(self.layout.world):
                    if other not in members:
                        member = self._hello(gen, other)
                        if member is not None:
                            members[other] = member
                        elif deadline is not None:
                            self._check_exit(other)
                if len(members) == self.layout.world:
                    break
                if stop is not None and stop.is_set():
                    return None
                now = time.monotonic()
                if deadline is not None and now > deadline:
                    missing = [s for s in range(self.layout.world) if s not in members]
                    role, rank = self.layout.role_rank(missing[0])
                    why = f"did not join the deployment within {timeout:g} s"
                    if missing[0] in self._refused:
                        why += f"; a process that came for it was refused ({self._refused[missing[0]]})"
                    raise PeerLost(role, rank, why)
                if now > next_log:
                    waiting = [self.layout.role_rank(s) for s in range(self.layout.world) if s not in members]
                    log.info("generation %d: waiting for %s", gen, ", ".join(f"{r} {k}" for r, k in waiting))
                    next_log = now + 10.0
                time.sleep(poll)
            if self.generation() == gen:
                if deadline is not None:  # a member whose hello was there, and whose process exited since
                    for other, member in members.items():
                        if other != slot:
                            self._check_exit(other, member.pid)
                self.store.set(f"held/{slot}", json.dumps({"generation": gen, **asdict(me)}))
                self.store.delete_key(f"exited/{slot}")  # a stale record of a process it replaced by hand
                return Group(gen, members)

    def _stamp(self) -> str:
        return sign(self.token, "host", self.deployment.hex())

    def _check_host(self, slot: int | None = None) -> None:
        """Raise :class:`JoinError` when the store's host stamped it with another deployment or
        token; once they matched, a member never checks again (nothing a stranger writes then
        can make it leave)."""
        raw = None if self._host_checked else read_key(self.store, "host")
        if raw is None:
            return
        try:
            stamp = json.loads(raw)
            deployment, proof = str(stamp["deployment"]), str(stamp["proof"])
        except (TypeError, ValueError, KeyError) as err:
            log.warning("ignored a malformed host stamp in the rendezvous store: %s", err)
            return
        role, rank = self.layout.role_rank(slot) if slot is not None else (None, None)
        if deployment != self.deployment.hex():
            raise JoinError(
                f"refused: another artifact or plan (deployment {self.deployment.hex()}; the store at "
                f"{self.address} serves deployment {deployment})", role, rank,
            )
        if not hmac.compare_digest(proof, self._stamp()):
            raise JoinError(
                f"refused: wrong deployment token (the store at {self.address} was hosted with another token; "
                "check AFDC_TOKEN or --token)", role, rank,
            )
        self._host_checked = True

    def _check_held(self, slot: int) -> None:
        """Raise :class:`JoinError` when another live process of this host was the slot's member
        last (two FFN servers started for one rank). Another host's process cannot be checked. A
        spare that claimed the slot (:mod:`afdc.runtime.spare`) replaces its holder, live or not."""
        raw = read_key(self.store, f"held/{slot}")
        if raw is None or slot in self.replacing:
            return
        try:
            held = json.loads(raw)
            generation, pid, host, proof = int(held["generation"]), int(held["pid"]), held["host"], held["proof"]
        except (TypeError, ValueError, KeyError):
            return
        if (
            hmac.compare_digest(str(proof), self.proof(generation, slot))
            and host == socket.gethostname()
            and pid != os.getpid()
            and _alive(pid)
        ):
            role, rank = self.layout.role_rank(slot)
            raise JoinError(f"refused: its slot is held by a live process (pid {pid} on {host})", role, rank)

    def record_exit(self, slot: int, pid: int, reason: str) -> None:
        """Record that ``slot``'s process ``pid`` exited (its launcher saw it, ``reason`` says how): a
        :meth:`join` with a deadline that waits for the slot raises :class:`JoinError` at once."""
        proof = sign(self.token, "exited", self.deployment.hex(), str(slot), str(pid), reason)
        self.store.set(f"exited/{slot}", json.dumps({"pid": pid, "reason": reason, "proof": proof}))

    def clear_exit(self, slot: int) -> None:
        """Forget ``slot``'s recorded exit (its launcher starts it again)."""
        self.store.delete_key(f"exited/{slot}")

    def _check_exit(self, slot: int, pid: int | None = None) -> None:
        """Raise :class:`JoinError` when the slot's launcher recorded that its process (``pid``,
        when given: the one whose hello is here) exited. A record without the token's proof is ignored."""
        raw = read_key(self.store, f"exited/{slot}")
        if raw is None:
            return
        try:
            record = json.loads(raw)
            exited, reason, proof = int(record["pid"]), str(record["reason"]), str(record["proof"])
        except (TypeError, ValueError, KeyError):
            return
        signed = sign(self.token, "exited", self.deployment.hex(), str(slot), str(exited), reason)
        if hmac.compare_digest(proof, signed) and pid in (None, exited):
            role, rank = self.layout.role_rank(slot)
            raise JoinError(f"cannot join: {reason}", role, rank)

    def _hello(self, gen: int, slot: int) -> Member | None:
        key = f"g{gen}/hello/{slot}"
        raw = read_key(self.store, key)
        if raw is None:
            return None
        try:
            member = Member(**json.loads(raw))
        except (TypeError, ValueError) as err:
            log.warning("refused a malformed hello for slot %d: %s", slot, err)
            self.store.delete_key(key)
            return None
        if not hmac.compare_digest(member.proof, self.proof(gen, slot)):
            role, rank = self.layout.role_rank(slot)
            self._refused[slot] = f"pid {member.pid} on {member.host}: wrong deployment token or another artifact"
            log.warning("refused %s rank %d (%s)", role, rank, self._refused[slot])
            self.store.delete_key(key)
            return None
        return member

    def report_health(self, role: str, rank: int, health: Health) -> None:
        """Publish ``role`` rank ``rank``'s health."""
        self.store.set(f"health/{role}/{rank}", health.encode())

    def health(self, role: str, rank: int) -> Health:
        """``role`` rank ``rank``'s last reported health (serving when it never reported)."""
        raw = read_key(self.store, f"health/{role}/{rank}")
        return Health() if raw is None else Health.decode(raw)

    def prefixed(self, generation: int, name: str) -> dist.Store:
        return dist.PrefixStore(f"g{generation}/{name}/", self.store)
