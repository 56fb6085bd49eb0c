"""Who serves each FFN slot, and hot spares that take a lost one over.

An FFN server owns its slot from the generation it started in: ``owner/SLOT`` in the store
names its process and that generation, signed with the deployment's token. An attention rank
that loses an FFN rank it exchanged with in generation ``g`` (its link broke, or no reply came)
records the loss (``lost/SLOT``: ``g``). A spare (``afdc serve --role ffn --spare``, ``afdc up
--ffn-spares N``) has imported everything and reached the store but holds no slot: it watches
the losses, and claims a slot whose loss is newer than its owner's claim with one
compare-and-set of the owner record, so exactly one spare wins. The winner loads that rank's
weights and serves it like a restarted rank. An owner also says it is alive (``beat/...``, a
counter it adds to every ``poll_interval``, from its claim on, while it loads too): a spare
claims the slot of an owner whose beats have stopped for ``silent_after`` seconds (``--timeout``)
whether or not anyone lost it. That covers an owner no attention rank exchanged with: a spare
that died while loading under a launcher that does not watch its processes (Ray, Kubernetes),
and a rank that stalls while the deployment is idle.

A claim is fenced by the store's generation: the owner record names the claimer and its claim's
generation, every generation it joins is a later one, and a server checks every
``poll_interval`` that it still owns its slot. An original that comes back late (stalled, not
dead) finds itself replaced and leaves instead of serving beside the spare; a rank started by
hand for a slot takes it (the last start wins). A launcher that sees a claimer exit before it
joined records the loss past the claim's generation (nobody else lost it), and another spare
claims the slot.
"""

from __future__ import annotations

import contextlib
import hmac
import json
import logging
import os
import socket
import threading
import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import torch.distributed as dist

from afdc.runtime.rendezvous import Rendezvous, read_key, sign

if TYPE_CHECKING:
    pass

log = logging.getLogger("afdc.spare")
_RECORD_BYTES = 1024  # the most an owner or loss record may hold (the store is writable by whoever reaches it)


@dataclass(frozen=True)
class Owner:
    """The process that serves a slot, from its claim's generation on."""

    generation: int
    pid: int
    host: str

    @classmethod
    def me(cls, generation: int) -> Owner:
        return cls(generation, os.getpid(), socket.gethostname())

    @property
    def process(self) -> tuple[int, str]:
        return self.pid, self.host

    def __str__(self) -> str:
        return f"pid {self.pid} on {self.host} since generation {self.generation}"


class Slots:
    """The owner and loss records of a deployment's FFN slots."""

    def __init__(self, rendezvous: Rendezvous):
        self.rdv = rendezvous

    def _proof(self, kind: str, slot: int, *fields: object) -> str:
        return sign(self.rdv.token, kind, self.rdv.deployment.hex(), str(slot), *map(str, fields))

    def _encode(self, slot: int, owner: Owner) -> bytes:
        proof = self._proof("owner", slot, owner.generation, owner.pid, owner.host)
        return json.dumps({**asdict(owner), "proof": proof}).encode()

    def _read(self, key: str) -> tuple[dict | None, bytes | None]:
        """A record as data (None where absent or malformed) and its stored bytes."""
        raw = read_key(self.rdv.store, key)
        if raw is None or len(raw) > _RECORD_BYTES:
            return None, raw
        try:
            record = json.loads(raw)
        except ValueError:
            return None, raw
        return (record if isinstance(record, dict) else None), raw

    def owner(self, slot: int) -> tuple[Owner | None, bytes | None]:
        """The slot's owner (None where no valid record is signed with the token) and the stored bytes."""
        record, raw = self._read(f"owner/{slot}")
        try:
            owner = Owner(int(record["generation"]), int(record["pid"]), str(record["host"]))
            proof = str(record["proof"])
        except (TypeError, KeyError, ValueError):
            return None, raw
        if not hmac.compare_digest(proof, self._proof("owner", slot, owner.generation, owner.pid, owner.host)):
            return None, raw
        return owner, raw

    def own(self, slot: int, generation: int) -> Owner:
        """Take the slot as its started rank (whoever held it), before joining any generation after ``generation``."""
        owner = Owner.me(generation)
        self.rdv.store.set(f"owner/{slot}", self._encode(slot, owner))
        return owner

    def replaced_by(self, slot: int) -> Owner | None:
        """The slot's owner where it is another process than this one (None where it is this one,
        or unknown: a new store's)."""
        owner, _ = self.owner(slot)
        return owner if owner is not None and owner.process != Owner.me(0).process else None

    def beat(self, slot: int, owner: Owner) -> None:
        """Say that ``owner`` (this process) is alive."""
        self.rdv.store.add(_beat_key(slot, owner), 1)

    def beats(self, slot: int, owner: Owner) -> int:
        """How often ``owner`` said it is alive."""
        return self.rdv.store.add(_beat_key(slot, owner), 0)

    def lost(self, slot: int, generation: int) -> None:
        """Record that the slot's rank was lost while a member of ``generation`` (or, said by its
        launcher, after its owner's claim: past that claim's generation)."""
        proof = self._proof("lost", slot, generation)
        self.rdv.store.set(f"lost/{slot}", json.dumps({"generation": generation, "proof": proof}))

    def _lost_at(self, slot: int) -> int | None:
        record, _ = self._read(f"lost/{slot}")
        try:
            generation, proof = int(record["generation"]), str(record["proof"])
        except (TypeError, KeyError, ValueError):
            return None
        return generation if hmac.compare_digest(proof, self._proof("lost", slot, generation)) else None

    def claim(self, slot: int, silent: Owner | None = None) -> Owner | None:
        """Claim the slot if its rank was lost since its owner took it, or its owner is
        ``silent`` (its beats stopped): the new owner (this process, from the store's current
        generation) where this process won, else None."""
        lost = self._lost_at(slot)
        owner, raw = self.owner(slot)
        # an owner joins only generations after its claim's: a loss in its claim's generation or
        # before is its predecessor's
        stale = lost is None or (owner is not None and lost <= owner.generation)
        if stale and (owner is None or owner != silent):
            return None
        mine = Owner.me(self.rdv.generation())
        desired = self._encode(slot, mine)
        # one compare-and-set: of spares that read the same record, exactly one replaces it
        return mine if self.rdv.store.compare_set(f"owner/{slot}", raw or b"", desired) == desired else None


def _beat_key(slot: int, owner: Owner) -> str:
    return f"beat/{slot}/{owner.generation}/{owner.pid}/{owner.host}"


def keep_beating(rendezvous: Rendezvous, slot: int, owner: Owner, stop: threading.Event, poll: float) -> None:
    """Say every ``poll`` seconds that ``owner`` is alive, until ``stop`` is set (a thread's target)."""
    slots = Slots(rendezvous)
    while not stop.wait(poll):
        with contextlib.suppress(dist.DistError):  # the store went away: its next one knows no owner
            slots.beat(slot, owner)


def wait_for_a_lost_slot(rendezvous: Rendezvous, stop: threading.Event, poll: float,
                         silent_after: float) -> tuple[int, Owner] | None:
    """Watch the deployment's FFN slots every ``poll`` seconds and claim the first one lost, or
    whose owner has not said it is alive for ``silent_after`` seconds: the slot and this
    process's ownership of it, or None once ``stop`` is set."""
    slots = Slots(rendezvous)
    ffn_slots = rendezvous.layout.peers("attn")
    heard: dict[int, tuple[Owner, int, float]] = {}  # slot -> its owner, its beats, when they last changed
    while not stop.wait(poll):
        now = time.monotonic()
        for slot in ffn_slots:
            owner, _ = slots.owner(slot)
            silent = None
            if owner is not None:
                beats = slots.beats(slot, owner)
                last = heard.get(slot)
                if last is None or last[:2] != (owner, beats):
                    heard[slot] = (owner, beats, now)
                elif now - last[2] >= silent_after:
                    silent = owner
            claimed = slots.claim(slot, silent)
            if claimed is not None:
                return slot, claimed
    return None
