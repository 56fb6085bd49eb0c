"""A hostile peer holding the token cannot stop an FFN server: a fuzz test of the wire protocol.

A live FFN server (a real process, ``dm.launch()``) serves a 2A1F tiny llama over shm and over
gloo. Attention rank 1 is real and keeps decoding a one-row batch (so rank 0 gets no rows and
its slot is free); slot 0 is taken by a hostile rank of this process that joins the deployment
with the token and then sends what hypothesis draws: valid DATA and STEP messages mutated field by
field (kind, sender, layer, generation, deployment, tokens, micro-batch, tensor descriptions,
claimed payload size), flipped header bytes, random headers, truncated and oversized payloads,
into the mailbox slots and over the socket (shm) or as gloo sends. After each message the hostile
rank probes its link (a message the server must refuse with ERROR) and expects the refusal or
the link's end, never silence; it then reconnects where the link was dropped. Throughout, the
real rank's tokens equal the monolith's, the server process never exits, and its resident memory
stays within a bound of where it started.

Bounded in count and time (``EXAMPLES`` per transport, ``BUDGET_S`` each), loopback only.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import pytest
import torch

import afdc
from afdc.runtime import wire
from afdc.runtime.rendezvous import PeerLost, Rendezvous
from afdc.runtime.transport import shm, transport_class
from afdc.runtime.transport.base import Failure, Incoming
from afdc.segment import at_tokens
from afdc.segment import inputs as segment_inputs
from models_supported import catalog

hypothesis = pytest.importorskip("hypothesis", reason="the fuzz test needs hypothesis (pip install -e '.[test]')")
st = pytest.importorskip("hypothesis.strategies")

EXAMPLES = {"shm": 150, "gloo": 40}  # messages per transport (a dropped gloo link costs a regroup)
BUDGET_S = 40.0  # per transport, from its start (model, launch): hypothesis draws nothing more after this
RSS_BOUND = 256 << 20  # bytes the server's resident memory may grow by over the run
PROBE_S = 10.0  # how long a probe waits for the refusal or the link's end
SOCKET_BUDGET = 4 << 20  # a claimed payload beyond this is sent in part, then the link closed
NEW_TOKENS = 4
HOSTILE = 0  # the hostile rank's slot: attention rank 0 (a one-row batch goes to rank 1)


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        kb = next((line for line in status if line.startswith("VmRSS:")), "VmRSS: 0 kB").split()[1]  # 0: exited
    return int(kb) << 10


def _raw_header(fields: dict, specs: list[tuple[int, int, list[int]]]) -> bytes:
    """A header as bytes, with any values (``Header.encode`` refuses what is not well-formed)."""
    fixed = wire._FIXED.pack(
        wire.MAGIC, fields["version"], fields["kind"], 0, fields["deployment"], fields["generation"], fields["step"],
        fields["layer"], fields["micro_batch"], fields["tokens"], fields["sender"], fields["payload"],
        fields.get("count", len(specs)),
    )  # fmt: skip
    body = b"".join(wire._TENSOR.pack(code, ndim, *dims) for code, ndim, dims in specs[: wire.MAX_TENSORS])
    header = bytearray((fixed + body).ljust(wire.HEADER_BYTES, b"\0"))
    if fields.get("magic") is not None:
        header[:4] = fields["magic"]
    return bytes(header)


@dataclass
class Message:
    header: bytes
    payload: bytes
    slotted: bool  # shm: into a mailbox slot (else over the socket)
    micro_batch: int
    close_after: bool = False  # the stream ends mid-message: the hostile rank then closes its link


@dataclass
class Context:
    deployment: bytes
    generation: int
    layouts: list[list[int]]  # FFN layer 0's input token layouts
    dtype: torch.dtype
    layers: int


U32, U64 = 2**32 - 1, 2**64 - 1
I64 = st.integers(-(2**63), 2**63 - 1)


@st.composite
def messages(draw, ctx: Context) -> Message:
    """A valid DATA or STEP message, then up to four mutations of it."""
    tokens = draw(st.integers(0, 6))
    if draw(st.booleans()):  # DATA for an FFN layer
        tensors = [torch.randn(at_tokens(lay, tokens)).to(ctx.dtype) for lay in ctx.layouts]
        kind, layer, mb = wire.Kind.DATA, draw(st.integers(0, ctx.layers - 1)), draw(st.integers(0, 3))
    else:  # a step plan
        counts = draw(st.lists(st.integers(0, 6), min_size=1, max_size=4))
        tensors = [torch.tensor(counts, dtype=torch.int64)]
        kind, layer, mb, tokens = wire.Kind.STEP, 0, len(counts), sum(counts)
    specs = [(wire._CODE[t.dtype], t.dim(), [*t.shape, *[0] * (wire.MAX_DIMS - t.dim())]) for t in tensors]
    payload = b"".join(t.numpy().tobytes() for t in tensors)
    fields = dict(version=wire.VERSION, kind=int(kind), deployment=ctx.deployment, generation=ctx.generation,
                  step=draw(st.integers(0, 50)), layer=layer, micro_batch=mb, tokens=tokens, sender=HOSTILE,
                  payload=len(payload))
    close_after = False
    for mutation in draw(st.lists(st.sampled_from(MUTATIONS), max_size=4)):
        if mutation == "kind":
            fields["kind"] = draw(st.integers(0, 255))
        elif mutation == "sender":
            fields["sender"] = draw(st.sampled_from([1, 2, 3, 255, U32]))
        elif mutation == "layer":
            fields["layer"] = draw(st.sampled_from([ctx.layers, 2**31, U32]) | st.integers(0, ctx.layers))
        elif mutation == "generation":
            fields["generation"] = draw(st.sampled_from([ctx.generation + 1, max(ctx.generation - 1, 0), U32]))
        elif mutation == "deployment":
            fields["deployment"] = draw(st.binary(min_size=8, max_size=8))
        elif mutation == "tokens":
            fields["tokens"] = draw(st.integers(0, 64) | st.just(U32))
        elif mutation == "micro_batch":
            fields["micro_batch"] = draw(st.integers(0, 64) | st.just(U32))
        elif mutation == "no tensors":  # a STEP without its counts crashed the server
            specs, payload, fields["payload"] = [], b"", 0
        elif mutation == "specs":  # tensor descriptions of any dtype code, rank and dims
            dims = st.lists(st.integers(0, 9) | I64, min_size=wire.MAX_DIMS, max_size=wire.MAX_DIMS)
            specs = draw(st.lists(st.tuples(st.integers(0, 255), st.integers(0, 8), dims), max_size=9))
            fields["count"] = len(specs)
        elif mutation == "consistent specs":  # well-formed descriptions that do not fit the layer
            shapes = st.lists(st.integers(0, 5), max_size=3)
            drawn = draw(st.lists(st.tuples(st.integers(0, len(wire.DTYPES) - 1), shapes), max_size=3))
            specs = [(code, len(s), [*s, *[0] * (wire.MAX_DIMS - len(s))]) for code, s in drawn]
            size = sum(wire.DTYPES[c].itemsize * int(torch.tensor(s).prod()) for c, s in drawn)
            payload, fields["payload"] = draw(st.binary(min_size=size, max_size=size)), size
        elif mutation == "claim":  # a payload size the header claims, with one uint8 tensor that agrees
            claim = draw(st.sampled_from([(8 << 20) + 1, 1 << 30, 1 << 40, 2**62]))
            specs, fields["payload"], fields["count"] = [(wire._CODE[torch.uint8], 1, [claim, 0, 0, 0, 0, 0])], claim, 1
        elif mutation == "payload size":  # a claim that disagrees with the tensors
            fields["payload"] = draw(st.integers(0, 1 << 20) | st.just(U64))
        elif mutation == "truncate":
            payload = payload[: draw(st.integers(0, max(len(payload) - 1, 0)))]
            close_after = True
        elif mutation == "extend":
            payload += draw(st.binary(min_size=1, max_size=64))
        elif mutation == "magic":
            fields["magic"] = draw(st.binary(min_size=4, max_size=4))
        elif mutation == "version":
            fields["version"] = draw(st.integers(0, 255))
    header = _raw_header(fields, specs)
    if draw(st.booleans()) and draw(st.booleans()):  # flipped header bytes
        flipped = bytearray(header)
        for at in draw(st.lists(st.integers(0, wire.HEADER_BYTES - 1), min_size=1, max_size=6)):
            flipped[at] ^= draw(st.integers(1, 255))
        header = bytes(flipped)
    if draw(st.integers(0, 19)) == 0:  # no structure at all
        header = draw(st.binary(min_size=wire.HEADER_BYTES, max_size=wire.HEADER_BYTES))
    return Message(header, payload, draw(st.booleans()), fields["micro_batch"], close_after)


MUTATIONS = ["kind", "sender", "layer", "generation", "deployment", "tokens", "micro_batch", "no tensors", "specs",
             "consistent specs", "claim", "payload size", "truncate", "extend", "magic", "version"]


def known_cases(ctx: Context) -> dict[str, list[Message]]:
    """The crashes issue 40 lists, sent before hypothesis's draws."""
    base = dict(version=wire.VERSION, kind=int(wire.Kind.DATA), deployment=ctx.deployment, generation=ctx.generation,
                step=1, layer=0, micro_batch=0, tokens=1, sender=HOSTILE, payload=0)
    hidden = [torch.randn(at_tokens(lay, 1)).to(ctx.dtype) for lay in ctx.layouts]
    specs = [(wire._CODE[t.dtype], t.dim(), [*t.shape, *[0] * (wire.MAX_DIMS - t.dim())]) for t in hidden]
    data = b"".join(t.numpy().tobytes() for t in hidden)

    def claim(n: int) -> Message:
        fields = {**base, "payload": n}
        return Message(_raw_header(fields, [(wire._CODE[torch.uint8], 1, [n, 0, 0, 0, 0, 0])]), b"", False, 0)

    return {
        "a bad slot header": [Message(_raw_header({**base, "magic": b"JUNK"}, []), b"", True, 0)],
        "a STEP without tensors": [Message(_raw_header({**base, "kind": int(wire.Kind.STEP)}, []), b"", True, 0)],
        "a socket message claiming 1 TiB": [claim(1 << 40)],
        "a socket message claiming 1 GiB": [claim(1 << 30)],
        "DATA sent as the real rank": [
            Message(_raw_header({**base, "sender": 1, "step": step, "payload": len(data)}, specs), data, True, 0)
            for step in range(1, 9)
        ],
    }


class HostileRank:
    """Attention rank 0 of the deployment, token and all, sending what it is given."""

    def __init__(self, dm, options, connector: str):
        self.rdv = Rendezvous(options.rendezvous, dm.layout, dm.deployment, options.token)
        self.cls = transport_class(connector)
        self.connector = connector
        self.server = dm.layout.slot("ffn", 0)
        self.transport = None
        self.regroups = 0
        self.lock = threading.Lock()
        self._gloo_sends: list[tuple[torch.Tensor, object]] = []  # (buffer, its send), kept

    def join(self, bump: bool = False) -> None:
        if self.transport is not None and bump:  # its link was dropped: nothing to say goodbye on
            self.transport._closed = True
        elif self.transport is not None:
            self.transport.close()
        if bump:
            self.rdv.bump()
            self.regroups += 1
        group = self.rdv.join(HOSTILE, self.cls.address(self.rdv, HOSTILE), timeout=60)
        self.transport = self.cls(self.rdv, group, HOSTILE, "attn", timeout=30)

    def follow(self, stop: threading.Event) -> None:
        """Join every generation the others form (the real rank regroups after a lost step)."""
        while not stop.wait(0.05):
            with self.lock:
                if self.transport is None or self.rdv.generation() != self.transport.group.generation:
                    self.join()

    @property
    def generation(self) -> int:
        return self.transport.group.generation

    def send(self, m: Message) -> bool:
        """Put ``m`` on the wire as it is; never raises for a link the server closed. True where
        this left the link stalled: over gloo a payload announced and never sent (a stream of its
        own has no end to hear), which the server waits for on that link alone, until its timeout
        (tests/test_distributed.py checks that it then drops the link)."""
        try:
            if self.connector == "gloo":
                return self._send_gloo(m)
            if m.slotted and len(m.payload) <= self.transport.slot_bytes:
                self._send_slot(m)
            else:
                self._send_socket(m)
        except (OSError, RuntimeError):
            pass
        return False

    def link(self):
        """The shm link to the server, connected again where the server dropped it."""
        if self.server not in self.transport._links:
            self.transport._connect(self.server, self.transport.group.members[self.server].address)
        return self.transport._links[self.server]

    def _send_slot(self, m: Message) -> None:
        try:
            kind = wire.Header.decode(m.header).kind
        except wire.WireError:
            kind = None
        link = self.link()
        k = link.outbound.slots - 1 if kind == wire.Kind.STEP else m.micro_batch % (link.outbound.slots - 1)
        deadline = time.monotonic() + PROBE_S
        while not link.outbound.free(k) and time.monotonic() < deadline:  # taken, or the link dropped for it
            if link.dropped:
                link = self.link()
            time.sleep(1e-3)
        box = link.outbound
        start = box._start(k)
        box._mm[start : start + wire.HEADER_BYTES] = m.header
        box._mm[start + shm._PAYLOAD : start + shm._PAYLOAD + len(m.payload)] = m.payload
        box._mm[(2 + k) * shm._LINE : (2 + k) * shm._LINE + 8] = (box._seq(k) + 1).to_bytes(8, "little")
        box._mm[shm._LINE : shm._LINE + 8] = (box.posted + 1).to_bytes(8, "little")
        if link.bell is not None:  # as a sender's post rings the server
            link.bell.ring()

    def _claimed(self, m: Message) -> int | None:
        """The payload bytes a reader of ``m``'s header expects (None: the header does not parse)."""
        try:
            return wire.Header.decode(m.header).payload_bytes
        except wire.WireError:
            return None

    def _send_socket(self, m: Message) -> None:
        link = self.link()
        claim = self._claimed(m)
        if claim is None:  # the server cannot parse it: what follows is irrelevant
            link.sock.sendall(m.header)
            return
        body = (m.payload + bytes(max(0, min(claim, SOCKET_BUDGET) - len(m.payload))))[:claim]
        link.sock.sendall(m.header + body)
        if m.close_after or len(body) < claim:  # the stream ends mid-message
            link.close()

    def _send_gloo(self, m: Message) -> bool:
        """A gloo send completes once the server posts its receive, which a dropped link's never
        does: sends are not waited for, their buffers kept."""
        self._gloo_send(m.header, 1)
        claim = self._claimed(m)
        if not claim:
            return False
        if claim > SOCKET_BUDGET or m.close_after:
            return claim <= self.transport.max_message_bytes  # a bigger claim drops the link at once
        self._gloo_send((m.payload + bytes(claim))[:claim], 2)
        return False

    def _gloo_send(self, data: bytes, tag: int) -> None:
        """Headers (tag 1) on the group of all ranks, payloads (tag 2) on the link's group of two."""
        buffer = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        group, peer = (self.transport.pg, self.server) if tag == 1 else self.transport._links[self.server]
        self._gloo_sends.append((buffer, group.send([buffer], peer, tag)))

    def probe(self) -> str:
        """Ask something the server must refuse (a DATA for a layer that does not exist, no
        tensors, over the socket or gloo) and return what came back: the refusal or the link's end."""
        if any(isinstance(item, Failure) for item in self.transport._drain()):
            return "link ended"
        probe = wire.Header(wire.Kind.DATA, self.rdv.deployment, self.generation, 0, 2**31, 0, 0, HOSTILE)
        try:
            self.send(Message(probe.encode(), b"", slotted=False, micro_batch=0))
        except (OSError, RuntimeError) as err:
            return f"link ended ({err})"
        deadline = time.monotonic() + PROBE_S
        while time.monotonic() < deadline:
            for item in self.transport.collect(0.05) if self.connector != "shm" else self._socket_items():
                if isinstance(item, Failure):
                    return "link ended"
                if item.header.kind == wire.Kind.ERROR and item.header.layer == 2**31:
                    return "refused"
        return "silence"

    def _socket_items(self):
        time.sleep(0.01)
        return self.transport._drain()  # the socket's receiver thread files ERRORs and the link's end


def _tokens_stay(dm, ids, ref, stop: threading.Event, record: dict) -> None:
    """The real attention rank: decode again and again; every result is the monolith's."""
    while not stop.is_set():
        try:
            got = dm.generate(ids, max_new_tokens=NEW_TOKENS, pad_token_id=0)
        except PeerLost as err:  # a regroup the hostile rank started by rejoining ends a step in flight
            record["lost"].append(str(err))
            continue
        except Exception as err:  # recorded and asserted on
            record["errors"].append(f"{type(err).__name__}: {err}")
            return
        record["runs"] += 1
        if not torch.equal(got, ref):
            record["errors"].append(f"tokens {got.tolist()} differ from the monolith's {ref.tolist()}")
            return


@pytest.mark.parametrize("connector", ["shm", "gloo"])
def test_hostile_peer_cannot_stop_the_ffn_server(connector):
    started = time.monotonic()
    model = catalog.build(next(e for e in catalog.ENTRIES if e.model_type == "llama"))
    ids = torch.randint(3, model.config.vocab_size, (1, 6), generator=torch.Generator().manual_seed(5))
    ref = model.generate(input_ids=ids, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
    dm = afdc.disaggregate(model, "2A1F", connector=connector)
    layouts = list(dm.ffn.dispatch(0).inputs)
    with dm.launch(timeout=30, join_timeout=60) as cluster:
        server = cluster.processes[0]
        hostile = HostileRank(dm, cluster.options, connector)
        joined = threading.Thread(target=hostile.join, daemon=True)
        joined.start()
        assert torch.equal(dm.generate(ids, max_new_tokens=NEW_TOKENS, pad_token_id=0), ref)  # joins with it
        joined.join(60)
        baseline = _rss(server.pid)
        record = {"runs": 0, "lost": [], "errors": []}
        stop = threading.Event()
        real = threading.Thread(target=_tokens_stay, args=(dm, ids, ref, stop, record), daemon=True)
        follower = threading.Thread(target=hostile.follow, args=(stop,), daemon=True)
        real.start()
        follower.start()
        ctx = Context(dm.deployment, hostile.generation, layouts, torch.float32, len(dm.ffn.layers))
        seen: list[str] = []

        def exchange(build) -> None:
            """Send what ``build(ctx)`` makes (in the hostile rank's current generation), probe the
            link, and check the server and the real rank."""
            with hostile.lock:
                ctx.generation = hostile.generation
                stalled = any([hostile.send(m) for m in build(ctx)])
                answer = "stalled" if stalled else hostile.probe()
                seen.append(answer)
                assert answer != "silence", "the server neither refused the probe nor dropped the link"
                if answer in ("link ended", "stalled") and connector == "gloo":  # rejoin (a regroup); shm reconnects
                    hostile.join(bump=True)
            assert _rss(server.pid) - baseline < RSS_BOUND, "the server's memory grew without bound"
            assert server.is_alive(), f"the FFN server exited with code {server.exitcode}"
            assert not record["errors"], record["errors"]

        @hypothesis.settings(max_examples=EXAMPLES[connector], deadline=None, database=None, derandomize=True,
                             phases=[hypothesis.Phase.generate], suppress_health_check=list(hypothesis.HealthCheck))
        @hypothesis.given(st.data())
        def survives(data):
            ctx.generation = hostile.generation
            m = data.draw(messages(ctx))  # drawn whatever the time: hypothesis wants the same draws each run
            if time.monotonic() - started < BUDGET_S:
                exchange(lambda ctx: [m])

        try:
            for name in known_cases(ctx):
                exchange(lambda ctx, name=name: known_cases(ctx)[name])
            survives()
        finally:
            stop.set()
            real.join(120)
            follower.join(10)
        assert server.is_alive() and server.pid == cluster.processes[0].pid
        assert not record["errors"], record["errors"]
        assert record["runs"] >= 3, record
        # over shm a dropped link reconnects in its generation: the real rank never loses a step
        assert len(record["lost"]) <= (hostile.regroups if connector == "gloo" else 0), record["lost"]
        assert "refused" in seen and "link ended" in seen, seen  # both answers were exercised
        growth = (_rss(server.pid) - baseline) / 2**20
        print(f"{connector}: {len(seen)} hostile messages, {record['runs']} decodes, {hostile.regroups} regroups, "
              f"server RSS {growth:+.1f} MiB, {time.monotonic() - started:.1f} s")


def _reply(hostile: HostileRank, layer: int) -> Incoming:
    """The server's answer to the hostile rank's DATA message for ``layer``: over shm a RESULT comes
    in the micro-batch's slot, an ERROR over the socket."""
    deadline = time.monotonic() + PROBE_S
    while time.monotonic() < deadline:
        for item in hostile.transport.receive([hostile.server], 0) + hostile._socket_items():
            assert not isinstance(item, Failure), f"the server dropped the link: {item.reason}"
            if item.header.layer == layer:
                return item
    raise AssertionError(f"no answer to the DATA message for FFN layer {layer} in {PROBE_S:g} s")


def test_an_index_out_of_its_range_is_refused_and_the_server_keeps_serving():
    """An input the FFN side indexes with (here expert ids, the router on the attention side: the
    tiny DeepSeek-V3's cross as ids, where a tiny Qwen3-MoE's router scores cost fewer bytes) is
    checked against its range before the layer runs: a DATA message with an expert id past the
    experts is refused with an ERROR naming the input, the layer, the value and the range (on a GPU
    it would have been a device-side assert ending the server's CUDA context), and the server
    answers the next valid message and keeps serving the other attention rank."""
    model = catalog.build(catalog.entry("deepseek_v3"))
    ids = torch.randint(3, model.config.vocab_size, (1, 6), generator=torch.Generator().manual_seed(5))
    ref = model.generate(input_ids=ids, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
    dm = afdc.disaggregate(model, "2A1F", router="attn", connector="shm")
    layer = next(i for i in range(len(dm.ffn.layers)) if dm.ffn.dispatch(i).index_bounds)
    dispatch = dm.ffn.dispatch(layer)
    (bound,) = dispatch.index_bounds
    assert bound.size == model.config.n_routed_experts
    graph = dm.ffn.segments[dm.ffn.layers[layer].segment].graph
    dtypes = [n.meta["val"].dtype for n in segment_inputs(graph)]

    def data(step: int, expert: int) -> tuple[wire.Header, list[torch.Tensor]]:
        tokens = 3
        tensors = [torch.full(at_tokens(lay, tokens), 0.5).to(dt) for lay, dt in zip(dispatch.inputs, dtypes)]
        chosen = tensors[bound.input]
        chosen.view(-1).copy_(torch.arange(chosen.numel()) % bound.size)  # every expert id valid ...
        chosen.view(-1)[-1] = expert  # ... but the last
        header = wire.Header.carrying(wire.Kind.DATA, tensors, deployment=dm.deployment, generation=hostile.generation,
                                      step=step, layer=layer, micro_batch=0, tokens=tokens, sender=HOSTILE)
        return header, tensors

    with dm.launch(timeout=30, join_timeout=60) as cluster:
        hostile = HostileRank(dm, cluster.options, "shm")
        joined = threading.Thread(target=hostile.join, daemon=True)
        joined.start()
        assert torch.equal(dm.generate(ids, max_new_tokens=NEW_TOKENS, pad_token_id=0), ref)  # joins with it
        joined.join(60)
        for step, expert in ((1, bound.size), (2, -1)):
            hostile.transport.send(hostile.server, *data(step, expert))
            answer = _reply(hostile, layer)
            assert answer.header.kind == wire.Kind.ERROR
            reason = bytes(answer.tensors[0].tolist()).decode()
            assert reason == (f"input {bound.input} of FFN layer {layer} is indices into {bound.size} rows, in "
                              f"[0, {bound.size}): the message's holds {expert}")
        hostile.transport.send(hostile.server, *data(3, bound.size - 1))
        assert _reply(hostile, layer).header.kind == wire.Kind.RESULT  # the valid message runs
        assert torch.equal(dm.generate(ids, max_new_tokens=NEW_TOKENS, pad_token_id=0), ref)
        assert cluster.processes[0].is_alive()
