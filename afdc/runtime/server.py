"""The FFN server: one FFN rank, serving every attention rank of a deployment.

It loads nothing but its FFN program and weights, joins the deployment, and loops: take every
message that has arrived, hold each until every attention rank that sends that layer and
micro-batch in its current step has (:mod:`afdc.runtime.gathering`), run each layer once over all
their tokens (the bigger FFN batch is the point of AFD), and reply to each sender with its rows. It
holds no state between messages, so a restarted server loses nothing: it bumps the rendezvous
generation and the attention ranks regroup with it at their next step.

A message for another deployment or generation, a malformed one, or one the program rejects is
answered with an ERROR message naming the reason and logged; the server keeps serving. SIGTERM
finishes the messages already received, then exits.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
import time
import traceback
from collections import defaultdict
from typing import NoReturn

import torch
import torch.distributed as dist

from afdc.errors import AfdcError
from afdc.runtime import wire
from afdc.runtime.gathering import Gathering
from afdc.runtime.metrics import Metrics
from afdc.runtime.options import RuntimeOptions
from afdc.runtime.programs import FFNProgram
from afdc.runtime.rendezvous import Layout, Rendezvous, RendezvousError
from afdc.runtime.transport import transport_class
from afdc.runtime.transport.base import LEFT, Failure, Incoming, Pacing, Transport

log = logging.getLogger("afdc.server")
_RECONNECT_SLICE = 1.0  # s: how often a server waiting for a lost store checks whether it was stopped


class FFNServer:
    def __init__(self, program: FFNProgram, layout: Layout, deployment: bytes, options: RuntimeOptions):
        if options.rendezvous is None:
            raise ValueError("an FFN server needs the rendezvous address (HOST:PORT)")
        self.program = program
        if options.token_buckets:
            program.use_buckets(options.token_buckets)
        self.rank = program.rank
        self.layout = layout
        self.slot = layout.slot("ffn", program.rank)
        self.deployment = deployment
        self.options = options
        self.metrics = Metrics("ffn", program.rank)
        self.stopping = threading.Event()
        self.rdv: Rendezvous | None = None  # the deployment's store, while the server runs

    def serve(self) -> None:
        """Serve until :meth:`stop` (or SIGTERM, when running in the main thread).

        The store lives with its host (attention rank 0, or the launcher): when it goes away the
        server reconnects to a new one at the same address for up to ``join_timeout`` seconds
        (a restarted attention rank 0), then gives up with :class:`RendezvousError`."""
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, lambda *_: self.stop())
        self.rdv = self._rendezvous()
        stop_logging = self.metrics.log_every(self.options.log_interval, self._publish)
        try:
            while not self.stopping.is_set():
                try:
                    self._serve_store()
                except dist.DistError as err:
                    if self.stopping.is_set():
                        break
                    log.warning(
                        "ffn rank %d: lost the rendezvous store at %s (%s); waiting up to %g s for it to come back",
                        self.rank, self.options.rendezvous, str(err).splitlines()[0], self.options.join_timeout,
                    )
                    if not self._reconnect():
                        break
        finally:
            stop_logging.set()
            self._publish(self.metrics.snapshot())
        log.info("ffn rank %d: stopped", self.rank)

    def _rendezvous(self, connect_timeout: float | None = None) -> Rendezvous:
        rdv = Rendezvous(
            self.options.rendezvous,
            self.layout,
            self.deployment,
            self.options.token,
            connect_timeout=self.options.join_timeout if connect_timeout is None else connect_timeout,
        )
        rdv.check_slot(self.slot)  # refused (token, artifact, slot held): said now, before anyone regroups
        rdv.bump()  # a (re)started rank: everyone regroups with it
        return rdv

    def _reconnect(self) -> bool:
        """Reach a new store within ``join_timeout``; False when stopped while waiting."""
        deadline = time.monotonic() + self.options.join_timeout
        while True:
            try:
                self.rdv = self._rendezvous(max(0.1, min(_RECONNECT_SLICE, deadline - time.monotonic())))
                return True
            except RendezvousError:
                if self.stopping.is_set():
                    return False
                if time.monotonic() > deadline:
                    raise

    def _serve_store(self) -> None:
        """Serve generation after generation of the deployment, until stopped."""
        cls = transport_class(self.options.connector)
        while not self.stopping.is_set():
            group = self.rdv.join(self.slot, cls.address(self.rdv, self.slot), timeout=None, stop=self.stopping)
            if group is None:
                return
            log.info("ffn rank %d: serving generation %d", self.rank, group.generation)
            transport = cls(
                self.rdv, group, self.slot, "ffn", timeout=self.options.timeout, device=self.program.device,
                pacing=Pacing(self.options.spin, self.options.max_sleep, self.options.idle_sleep),
            )
            try:
                self._serve_generation(transport)
            finally:
                transport.close()

    def stop(self) -> None:
        self.stopping.set()

    def _publish(self, snapshot: dict) -> None:
        try:
            self.rdv.store.set(f"metrics/ffn/{self.rank}", json.dumps(snapshot))
        except RuntimeError as err:  # the store went away with its host; metrics are best effort
            log.debug("could not publish metrics: %s", err)

    def _serve_generation(self, transport: Transport) -> None:
        gen = transport.group.generation
        gathering = Gathering(self.program, self.layout.ffn_ranks, self.options.gather)
        while True:
            deadline = gathering.deadline()
            wait = self.options.poll_interval if deadline is None else max(0.0, deadline - time.monotonic())
            items = self._arrived(transport, wait)
            self._handle(transport, gathering, items)
            if self.stopping.is_set():  # drain what has arrived, then go
                self._handle(transport, gathering, self._arrived(transport, 0))
                self._run(transport, [w.message for w in gathering.waiting])
                return
            if not items and not gathering.waiting and self.rdv.generation() != gen:
                return

    def _arrived(self, transport: Transport, wait: float) -> list[Incoming | Failure]:
        """Everything that has arrived, waiting up to ``wait`` s for the first item."""
        waited = time.monotonic()
        items = transport.collect(wait)
        self.metrics.idle_seconds += time.monotonic() - waited
        return items

    def _handle(self, transport: Transport, gathering: Gathering, items: list[Incoming | Failure]) -> None:
        for item in items:
            if isinstance(item, Failure):
                role, rank = self.layout.role_rank(item.peer)
                level = logging.INFO if item.reason == LEFT else logging.WARNING
                log.log(level, "ffn rank %d: %s rank %d: %s", self.rank, role, rank, item.reason)
                gathering.forget(item.peer)
                continue
            self.metrics.received(item.header.payload_bytes)
            reason = self._check(item.header, transport.group.generation)
            if reason:
                self._refuse(transport, item.header, reason)
            elif item.header.kind == wire.Kind.STEP:
                gathering.plan(item.header.sender, item.header.step, tuple(item.tensors[0].tolist()))
            else:
                gathering.add(item)
        self._run(transport, gathering.ready())

    def _run(self, transport: Transport, messages: list[Incoming]) -> None:
        """Run each FFN layer once over all of its messages and reply to each sender."""
        by_layer: dict[int, list[Incoming]] = defaultdict(list)
        for m in messages:
            by_layer[m.header.layer].append(m)
        for layer, group in by_layer.items():
            tokens = [m.header.tokens for m in group]
            try:
                outputs = self.program.run_batch(layer, [m.tensors for m in group], tokens)
            except Exception as err:  # the program rejected these inputs: tell the senders why
                for m in group:
                    self._refuse(transport, m.header, f"FFN layer {layer} failed: {type(err).__name__}: {err}")
                continue
            self.metrics.batch_tokens.observe(sum(tokens))
            for m, outs in zip(group, outputs):
                self._reply(transport, m.header, wire.Kind.RESULT, outs)

    def _check(self, h: wire.Header, generation: int) -> str:
        if h.deployment != self.deployment:
            return "the message is for another artifact or plan (deployment id mismatch)"
        if h.generation != generation:
            return f"the message is from generation {h.generation}, this server is in {generation}"
        if h.kind == wire.Kind.STEP:
            return ""
        if h.kind != wire.Kind.DATA:
            return f"an FFN server only takes DATA and STEP messages, got {h.kind.name}"
        if not 0 <= h.layer < len(self.program.layers):
            return f"FFN layer {h.layer} does not exist (the program has {len(self.program.layers)})"
        return ""

    def _refuse(self, transport: Transport, h: wire.Header, reason: str) -> None:
        role, rank = self.layout.role_rank(h.sender) if 0 <= h.sender < self.layout.world else ("?", h.sender)
        log.warning("ffn rank %d: refused a message from %s rank %s: %s", self.rank, role, rank, reason)
        self.metrics.errors += 1
        self._reply(transport, h, wire.Kind.ERROR, [torch.frombuffer(bytearray(reason.encode()), dtype=torch.uint8)])

    def _reply(self, transport: Transport, h: wire.Header, kind: wire.Kind, tensors: list[torch.Tensor]) -> None:
        header = wire.Header.carrying(
            kind,
            tensors,
            deployment=self.deployment,
            generation=transport.group.generation,
            step=h.step,
            layer=h.layer,
            micro_batch=h.micro_batch,
            tokens=h.tokens,
            sender=self.slot,
        )
        try:
            transport.send(h.sender, header, tensors)
            self.metrics.sent(header.payload_bytes)
        except (RuntimeError, OSError, KeyError) as err:
            log.warning("ffn rank %d: could not reply to slot %d: %s", self.rank, h.sender, err)


def serve_program(program: FFNProgram, layout: Layout, deployment: bytes, options: RuntimeOptions) -> NoReturn:
    """Entry point of an FFN server process (``afdc serve`` and ``dm.launch()``); exits the process."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    torch.set_grad_enabled(False)
    code = 0
    try:
        FFNServer(program, layout, deployment, options).serve()
    except AfdcError as err:
        print(f"error: {err}", file=sys.stderr)
        code = 2
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        # Skip interpreter and C++ static teardown: with daemon threads still parked in torch code
        # it can abort ("terminate called without an active exception") after a clean stop.
        os._exit(code)
