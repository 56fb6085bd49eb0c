"""The FFN server: one FFN rank, serving every attention rank of a deployment.

It loads nothing but its FFN program and weights, joins the deployment, and loops: take every
message that has arrived, hold each until every attention rank that sends that layer and
micro-batch in its current step has (:mod:`afdc.runtime.gathering`), run each layer once over all
their tokens (the bigger FFN batch is the point of AFD), and reply to each sender with its rows. It
holds no state between messages, so a restarted server loses nothing: it bumps the rendezvous
generation and the attention ranks regroup with it at their next step.

Nothing a peer sends can stop it. A message for another deployment or generation, of a kind or
layer it does not take, whose tensors do not fit the layer or hold an index out of its range, or
one the program rejects is answered with an ERROR message naming the reason; one that cannot be
parsed, is bigger than its slot or than any message a rank takes, or says it comes from another
slot than its link's drops that link (the transport's :class:`Failure`). Either is logged once per
peer with its rank, and a message's fault fails no other sender's tokens batched with it. SIGTERM
finishes the messages already received, then exits.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import math
import os
import signal
import sys
import threading
import time
import traceback
from collections import defaultdict
from collections.abc import Callable
from typing import NoReturn

import torch
import torch.distributed as dist

from afdc.codegen.triton_support import source_lock
from afdc.errors import AfdcError
from afdc.runtime import trace, wire
from afdc.runtime.gathering import Gathering
from afdc.runtime.metrics import IDLE, Metrics
from afdc.runtime.options import RuntimeOptions
from afdc.runtime.programs import FFNProgram
from afdc.runtime.rendezvous import Layout, Rendezvous, wait_listening
from afdc.runtime.spare import Owner, Slots, keep_beating, wait_for_a_lost_slot
from afdc.runtime.transport import transport_class
from afdc.runtime.transport.base import LEFT, Failure, Incoming, Transport
from afdc.segment import IndexBound
from afdc.segment import inputs as segment_inputs

log = logging.getLogger("afdc.server")
MAX_MICRO_BATCHES = 64  # the most micro-batches a step plan may name
_FITS_CACHE = 1 << 12  # remembered answers of whether a message's tensors fit its layer


class FFNServer:
    def __init__(self, program: FFNProgram, layout: Layout, deployment: bytes, options: RuntimeOptions,
                 on_step: Callable[[int], None] | None = None, claim: Owner | None = None):
        """``on_step(tokens)`` is called, in the serving thread, with the size of each step an
        attention rank announces (where the host places that thread by its load). ``claim``: this
        process is a spare that claimed the slot (:mod:`afdc.runtime.spare`); else it takes it."""
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
        self.on_step = on_step
        self.metrics = Metrics("ffn", program.rank)
        self.stopping = threading.Event()
        self.asked = ""  # the signal that asked this server to stop, if one did
        self._claim = claim
        self.rdv: Rendezvous | None = None  # the deployment's store, while the server runs
        self.owner: Owner | None = None  # this server's ownership of its slot, once it has it
        self._refused: set[int] = set()  # the slots whose refusals this generation were logged (once each)
        # (layer, tokens, tensor specs) -> _check_tensors' answer for a DATA message
        self._fits = functools.lru_cache(maxsize=_FITS_CACHE)(self._check_layer_inputs)
        # per segment, each input's dtype where the graph records it (a loaded artifact's may not)
        self._dtypes = [
            tuple(n.meta["val"].dtype if "val" in n.meta else None for n in segment_inputs(seg.graph))
            for seg in program.segments
        ]
        # per FFN layer that indexes with some of its inputs: their ranges (the others have no entry)
        self._indices = {
            layer: bounds for layer in range(len(program.layers)) if (bounds := program.dispatch(layer).index_bounds)
        }

    def serve(self) -> None:
        """Serve until :meth:`stop` (or SIGTERM or SIGINT, when running in the main thread).

        The store lives with its host (attention rank 0, or the launcher): a server waits up to
        ``join_timeout`` for it to come up, and when it goes away reconnects to a new one at the
        same address for as long (a restarted attention rank 0), then gives up with
        :class:`RendezvousError`. A stop asked for while it waits is done at once."""
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, self._asked)
        if self._connect():
            threading.Thread(target=self._keep_owner, daemon=True, name="afdc-owner").start()
            stop_logging = self.metrics.log_every(self.options.log_interval, self._publish)
            try:
                self._serve_until_stopped()
            finally:
                stop_logging.set()
                self._publish(self.metrics.snapshot())
        log.info("ffn rank %d: stopped%s", self.rank, f" (asked for by {self.asked})" if self.asked else "")

    def _serve_until_stopped(self) -> None:
        while not self.stopping.is_set():
            try:
                self._serve_store()
            except dist.DistError as err:
                if self.stopping.is_set():
                    return
                log.warning(
                    "ffn rank %d: lost the rendezvous store at %s (%s); waiting up to %g s for it to come back",
                    self.rank, self.options.rendezvous, str(err).splitlines()[0], self.options.join_timeout,
                )
                if not self._connect():
                    return

    def _asked(self, signum: int, _frame) -> None:
        self.asked = signal.Signals(signum).name
        self.stop()

    def _connect(self) -> bool:
        """Reach the store (its host may not be up yet) within ``join_timeout``, and check in;
        False when stopped while waiting."""
        log.info("ffn rank %d: reaching the rendezvous store at %s (waiting up to %g s for it)",
                 self.rank, self.options.rendezvous, self.options.join_timeout)
        if not wait_listening(self.options.rendezvous, self.options.join_timeout, self.stopping):
            return False
        self.rdv = Rendezvous(
            self.options.rendezvous,
            self.layout,
            self.deployment,
            self.options.token,
            connect_timeout=self.options.join_timeout,
            insecure_no_token=self.options.insecure_no_token,
        )
        if self._claim is not None:
            self.rdv.replacing.add(self.slot)
        self.rdv.check_slot(self.slot)  # refused (token, artifact, slot held): said now, before anyone regroups
        slots = Slots(self.rdv)
        # a started rank takes its slot; a spare has (a new store knows no owner: it takes it again)
        self.owner = self._claim
        if self._claim is None or slots.owner(self.slot)[0] is None:
            self.owner = slots.own(self.slot, self.rdv.generation())
        self.rdv.bump()  # a (re)started rank: everyone regroups with it
        return True

    def _keep_owner(self) -> None:
        """Say that this server is alive (:mod:`afdc.runtime.spare`), and leave once the slot is
        someone else's (a spare took it over while this server stalled), whatever the server is
        doing: serving, or waiting in a join it would never complete."""
        while not self.stopping.wait(self.options.poll_interval):
            with contextlib.suppress(dist.DistError):  # the store went away: the serving loop reconnects
                slots = Slots(self.rdv)
                slots.beat(self.slot, self.owner)
                other = slots.replaced_by(self.slot)
                if other is not None:
                    log.warning("ffn rank %d: replaced (the slot is served by %s); leaving", self.rank, other)
                    self.stop()

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
                pacing=self.options.pacing("ffn"),
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
        gathering = Gathering(self.program, self.layout.ffn_ranks, self.options.gather, self.layout.attention_ranks)
        self._refused.clear()
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
        with self.metrics.phases.timed(IDLE, per_message=True):
            return transport.collect(wait)

    # A served step's messages pass here one or two at a time, each after a wake-up that finds the
    # caches cold, where each step of this path costs several times what it does in a tight loop:
    # so every check is done once (a message's tensors against its layer remembered), and one
    # message is not grouped.
    @trace.phase("ffn.handle")
    def _handle(self, transport: Transport, gathering: Gathering, items: list[Incoming | Failure]) -> None:
        generation = transport.group.generation
        for item in items:
            if isinstance(item, Failure):  # the link ended (left, died, or dropped for what came on it)
                role, rank = self.layout.role_rank(item.peer)
                level = logging.INFO if item.reason == LEFT else logging.WARNING
                log.log(level, "ffn rank %d: %s rank %d: %s", self.rank, role, rank, item.reason)
                gathering.forget(item.peer)
                continue
            h = item.header
            reason = self._check(h, generation) or self._check_tensors(item)
            if reason:
                self._refuse(transport, h, reason)
            elif h.kind == wire.Kind.STEP:
                gathering.plan(h.sender, h.step, tuple(item.tensors[0].tolist()))
                if self.on_step is not None:
                    self.on_step(h.tokens)
            else:
                gathering.add(item)
        self._run(transport, gathering.ready())
        # counted once the replies are out: the senders wait for those, not for the count
        for item in items:
            if isinstance(item, Incoming):
                self.metrics.received(item.header.payload_bytes)

    def _run(self, transport: Transport, messages: list[Incoming]) -> None:
        """Run each FFN layer once over all of its messages (of one dtype: a batch must not cast
        one sender's tokens to another's) and reply to each sender."""
        if len(messages) == 1:  # the common case: nothing to group
            self._run_batch(transport, messages[0].header.layer, messages)
            return
        by_batch: dict[tuple, list[Incoming]] = defaultdict(list)
        for m in messages:
            by_batch[m.header.layer, tuple(t.dtype for t in m.tensors)].append(m)
        for (layer, _), group in by_batch.items():
            self._run_batch(transport, layer, group)

    @trace.phase("ffn.run_batch")
    def _run_batch(self, transport: Transport, layer: int, group: list[Incoming]) -> None:
        phases = self.metrics.phases
        tokens = [m.header.tokens for m in group]
        try:
            with phases.timed("run", per_message=True):
                outputs = self.program.run_batch(layer, [m.tensors for m in group], tokens)
        except Exception as err:  # the program rejected these inputs: tell the senders why
            if len(group) > 1:  # one message's fault must not fail the others' tokens: each runs alone
                for m in group:
                    self._run_batch(transport, layer, [m])
                return
            self._refuse(transport, group[0].header, f"FFN layer {layer} failed: {type(err).__name__}: {err}")
            return
        with phases.timed("reply", per_message=True):
            for m, outs in zip(group, outputs):
                self._reply(transport, m.header, wire.Kind.RESULT, outs)
        self.metrics.batch_tokens.observe(sum(tokens))

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

    @trace.phase("ffn.check")
    def _check_tensors(self, m: Incoming) -> str:
        """Why ``m``'s tensors cannot be taken ("" when they can): a step plan is each micro-batch's
        token count, adding up to its header's; a DATA message carries its layer's inputs, each of
        the dtype the layer takes (where known) and of ``tokens`` tokens' elements (the answer
        depends on nothing else, and a deployment sends few distinct ones: remembered), and the
        inputs the layer indexes with hold values in their ranges (read for those layers only)."""
        h = m.header
        if h.kind == wire.Kind.STEP:
            return _check_plan(h, m.tensors)
        reason = self._fits(h.layer, h.tokens, h.tensors)
        if reason or h.layer not in self._indices:
            return reason
        return _check_indices(h.layer, self._indices[h.layer], m.tensors)

    def _check_layer_inputs(self, layer: int, tokens: int, specs: tuple[wire.TensorSpec, ...]) -> str:
        segment = self.program.layers[layer].segment
        layouts, dtypes = self.program.dispatch(layer).inputs, self._dtypes[segment]
        if len(specs) != len(layouts):
            return f"FFN layer {layer} takes {len(layouts)} inputs, the message carries {len(specs)}"
        for i, (t, layout, dtype) in enumerate(zip(specs, layouts, dtypes)):
            if dtype is not None and t.dtype != dtype:
                return f"input {i} of FFN layer {layer} is {dtype}, the message's is {t.dtype}"
            per_token = math.prod(abs(d) for d in layout) if layout is not None else None
            if per_token is not None and math.prod(t.shape) != tokens * per_token:
                return (f"input {i} of FFN layer {layer} is {per_token} elements per token: {tokens} tokens "
                        f"are {tokens * per_token}, the message's tensor holds {math.prod(t.shape)}")
        return ""

    def _refuse(self, transport: Transport, h: wire.Header, reason: str) -> None:
        """Answer ERROR with ``reason``; logged once per peer and generation (a peer sending
        nothing but malformed messages must not flood the log), counted in the metrics."""
        role, rank = self.layout.role_rank(h.sender)  # the transport checked the sender is its link's peer
        level = logging.DEBUG if h.sender in self._refused else logging.WARNING
        self._refused.add(h.sender)
        log.log(level, "ffn rank %d: refused a message from %s rank %s: %s%s", self.rank, role, rank, reason,
                "" if level == logging.DEBUG else " (its further refusals this generation are counted, not logged)")
        self.metrics.errors += 1
        self._reply(transport, h, wire.Kind.ERROR, [torch.frombuffer(bytearray(reason.encode()), dtype=torch.uint8)])

    @trace.phase("ffn.reply")
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
        except (RuntimeError, OSError, KeyError, wire.WireError) as err:
            # a link that ended was said once, as its Failure; anything else is said here
            level = logging.DEBUG if isinstance(err, OSError) else logging.WARNING
            log.log(level, "ffn rank %d: could not reply to slot %d: %s", self.rank, h.sender, err)


def _check_plan(h: wire.Header, tensors: list[torch.Tensor]) -> str:
    """Why a STEP message cannot be taken ("" when it can): it carries each micro-batch's token
    count, adding up to its header's."""
    counts = tensors[0] if len(tensors) == 1 else None
    if counts is None or counts.dtype != torch.int64 or counts.dim() != 1:
        return "a STEP message carries one 1-D int64 tensor: each micro-batch's token count"
    if not 0 < counts.numel() <= MAX_MICRO_BATCHES or counts.numel() != h.micro_batch:
        return (f"a STEP message names {counts.numel()} micro-batches (its header {h.micro_batch}); "
                f"a step has 1 to {MAX_MICRO_BATCHES}")
    values = counts.tolist()  # a plan is a few numbers: Python reads them faster than torch ops would
    if min(values) < 0 or sum(values) != h.tokens:
        return f"a STEP message's counts {values} do not add up to its header's {h.tokens} tokens"
    return ""


def _check_indices(layer: int, bounds: tuple[IndexBound, ...], tensors: list[torch.Tensor]) -> str:
    """Why a DATA message's index inputs cannot be taken ("" when they can): each holds integers
    in its range. An index out of range would fail the layer, and on a GPU, as a device-side
    assert, the server's CUDA context with it: one min and max per such input instead."""
    for b in bounds:
        t = tensors[b.input]
        if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
            return f"input {b.input} of FFN layer {layer} is indices into {b.size} rows, the message's is {t.dtype}"
        if not t.numel():
            continue
        low, high = (int(v) for v in torch.aminmax(t))
        if low < 0 or high >= b.size:
            return (f"input {b.input} of FFN layer {layer} is indices into {b.size} rows, in [0, {b.size}): "
                    f"the message's holds {low if low < 0 else high}")
    return ""


def serve_program(program: FFNProgram, layout: Layout, deployment: bytes, options: RuntimeOptions,
                  on_step: Callable[[int], None] | None = None, claim: Owner | None = None) -> NoReturn:
    """Entry point of an FFN server process (``afdc serve`` and ``dm.launch()``); exits the process."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    torch.set_grad_enabled(False)
    if options.threads:
        torch.set_num_threads(options.threads)
    # what lowering a segment at its first step imports (Dynamo's compile lock, a second or more
    # of CPU), paid before the server joins: its first reply is not later than its others
    source_lock()
    code = 0
    try:
        FFNServer(program, layout, deployment, options, on_step, claim).serve()
    except AfdcError as err:
        print(f"error: {err}", file=sys.stderr)
        code = 2
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        trace.dump()  # os._exit below runs no atexit hook
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        # Skip interpreter and C++ static teardown: with daemon threads still parked in torch code
        # it can abort ("terminate called without an active exception") after a clean stop.
        os._exit(code)


def serve_spare(load_rank: Callable[[int], FFNProgram], layout: Layout, deployment: bytes,
                options: RuntimeOptions) -> NoReturn:
    """Entry point of a spare's process: reach the store, wait for a lost FFN rank, claim it,
    ``load_rank(rank)`` and serve it (:func:`serve_program`, which exits the process). SIGTERM or
    SIGINT stops the wait (in the main thread)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    stop, asked = threading.Event(), []

    def ask(signum: int, _frame) -> None:
        asked.append(signal.Signals(signum).name)
        stop.set()

    if threading.current_thread() is threading.main_thread():  # a Ray actor runs it in a thread
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, ask)
    claimed = None
    while claimed is None and wait_listening(options.rendezvous, options.join_timeout, stop):
        rdv = Rendezvous(options.rendezvous, layout, deployment, options.token,
                         connect_timeout=options.join_timeout, insecure_no_token=options.insecure_no_token)
        rdv.check_host()  # another token or artifact than the store's: said now, not by never claiming
        log.info("spare: waiting for a lost FFN rank of the deployment at %s", options.rendezvous)
        try:
            claimed = wait_for_a_lost_slot(rdv, stop, options.poll_interval, options.timeout)
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
    # alive while loading too, or another spare takes the slot after options.timeout
    threading.Thread(target=keep_beating, args=(rdv, slot, owner, threading.Event(), options.poll_interval),
                     daemon=True, name="afdc-beat").start()
    serve_program(load_rank(rank), layout, deployment, options, claim=owner)
