"""Who serves each FFN slot, and hot spares that take a lost one over.

An FFN server owns its slot from the generation it started in: ``owner/SLOT`` in the store
names its process and that generation, signed with the deployment's token. An attention rank
that loses an FFN rank it exchanged with in generation ``g`` (its link broke, or no reply came)
records the loss (``lost/SLOT``: ``g``). A spare (``afdc serve --role ffn --spare``, ``afdc up
--ffn-spares N``) has imported everything and reached the store but holds no slot: it watches
the losses, and claims a slot whose loss is newer than its owner's claim with one
compare-and-set of the owner record, so exactly one spare wins. The winner loads that rank's
weights and serves it like a restarted rank.

A claim is fenced by the store's generation: the owner record names the claimer and its claim's
generation, every generation it joins is a later one, and a server checks every
``poll_interval`` that it still owns its slot. An original that comes back late (stalled, not
dead) finds itself replaced and leaves instead of serving beside the spare; a rank started by
hand for a slot takes it (the last start wins). A launcher that sees a claimer exit before it
joined records the loss past the claim's generation (nobody else lost it), and another spare
claims the slot.
"""

from __future__ import annotations

import hmac
import json
import logging
import os
import signal
import socket
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, NoReturn

import torch.distributed as dist

from afdc.runtime.rendezvous import Layout, Rendezvous, read_key, sign, wait_listening

if TYPE_CHECKING:
    from afdc.runtime.options import RuntimeOptions
    from afdc.runtime.programs import FFNProgram

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

    def claim(self, slot: int) -> Owner | None:
        """Claim the slot if its rank was lost since its owner took it: the new owner (this
        process, from the store's current generation) where this process won, else None."""
        lost = self._lost_at(slot)
        owner, raw = self.owner(slot)
        # an owner joins only generations after its claim's: a loss in its claim's generation or
        # before is its predecessor's
        if lost is None or (owner is not None and lost <= owner.generation):
            return None
        mine = Owner.me(self.rdv.generation())
        desired = self._encode(slot, mine)
        # one compare-and-set: of spares that read the same record, exactly one replaces it
        return mine if self.rdv.store.compare_set(f"owner/{slot}", raw or b"", desired) == desired else None


def wait_for_a_lost_slot(rendezvous: Rendezvous, stop: threading.Event, poll: float) -> tuple[int, Owner] | None:
    """Watch the deployment's FFN slots every ``poll`` seconds and claim the first lost one: the
    slot and this process's ownership of it, or None once ``stop`` is set."""
    slots = Slots(rendezvous)
    ffn_slots = rendezvous.layout.peers("attn")
    while not stop.wait(poll):
        for slot in ffn_slots:
            owner = slots.claim(slot)
            if owner is not None:
                return slot, owner
    return None


def serve_spare(load_rank: Callable[[int], FFNProgram], layout: Layout, deployment: bytes,
                options: RuntimeOptions) -> NoReturn:
    """Entry point of a spare's process: reach the store, wait for a lost FFN rank, claim it,
    ``load_rank(rank)`` and serve it (:func:`afdc.runtime.server.serve_program`, which exits the
    process). SIGTERM or SIGINT stops the wait."""
    from afdc.runtime.server import serve_program

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    stop, asked = threading.Event(), []

    def ask(signum: int, _frame) -> None:
        asked.append(signal.Signals(signum).name)
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, ask)
    claimed = None
    while claimed is None and wait_listening(options.rendezvous, options.join_timeout, stop):
        rdv = Rendezvous(options.rendezvous, layout, deployment, options.token,
                         connect_timeout=options.join_timeout, insecure_no_token=options.insecure_no_token)
        rdv.check_host()  # another token or artifact than the store's: said now, not by never claiming
        log.info("spare: waiting for a lost FFN rank of the deployment at %s", options.rendezvous)
        try:
            claimed = wait_for_a_lost_slot(rdv, stop, options.poll_interval)
        except dist.DistError as err:  # the store went away with its host: reach the next one
            log.warning("spare: lost the rendezvous store (%s)", str(err).splitlines()[0])
        if stop.is_set():
            break
    if claimed is None:
        log.info("spare: stopped%s", f" (asked for by {asked[0]})" if asked else "")
        logging.shutdown()
        os._exit(0)
    slot, owner = claimed
    _, rank = layout.role_rank(slot)
    log.info("spare: claimed ffn rank %d (%s); loading its weights", rank, owner)
    serve_program(load_rank(rank), layout, deployment, options, claim=owner)
