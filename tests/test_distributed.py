"""The distributed runtime with real processes, real gloo, real shared memory and a real TCPStore:
greedy generation across processes equals the monolith for M:N plans, micro-batches and both
router placements; a killed FFN rank is reported and, once restarted, rejoins; strangers are refused.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import multiprocessing as mp
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch

import afdc
from afdc.api import build
from afdc.runtime import link as connectors
from afdc.runtime import wire
from afdc.runtime.options import RuntimeOptions, share_of_cores
from afdc.runtime.rendezvous import JoinError, Layout, PeerLost, Rendezvous, free_port
from afdc.runtime.server import FFNServer, serve_program
from afdc.runtime.transport.base import Incoming, Pacing
from afdc.segment import Dispatch, ExpertRouting
from models_supported import catalog
from tests.tiers import sweep

NEW_TOKENS = 5


def _entry(model_type: str) -> catalog.ModelEntry:
    return next(e for e in catalog.ENTRIES if e.model_type == model_type)


@pytest.fixture(scope="module")
def reference():
    """model_type -> (monolith, ids, mask, its greedy tokens), built once."""
    cache: dict[str, tuple] = {}

    def get(model_type: str):
        if model_type not in cache:
            model = catalog.build(_entry(model_type))
            g = torch.Generator().manual_seed(3)
            ids = torch.randint(3, model.config.vocab_size, (4, 7), generator=g)
            mask = torch.ones_like(ids)
            mask[0, :3] = mask[2, :1] = 0  # left padding
            ids[mask == 0] = 0
            ref = model.generate(
                input_ids=ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0
            )
            cache[model_type] = (model, ids, mask, ref)
        return cache[model_type]

    return get


# (model, plan, options): a dense model and three MoE models (routed only; shared experts and a dense
# first layer; a gated shared expert), M:N plans with EP and TP, the router on either side, both
# transports; dense layers replicated with each FFN rank serving its share of the tokens (3 ranks
# need not divide any size). The default run has each of these once; --sweep the other pairings.
CASES = [
    sweep("llama", "1A1F", {}, "gloo"),
    pytest.param("llama", "2A1F", {}, "gloo"),
    sweep("llama", "1A2F", {}, "gloo"),
    pytest.param("llama", "3A2F", {"dense_ffn": "replicate"}, "shm"),
    sweep("llama", "1A3F", {"dense_ffn": "replicate"}, "gloo"),
    pytest.param("qwen3_moe", "1A1F", {}, "shm"),
    sweep("qwen3_moe", "2A1F", {"router": "attn"}, "gloo"),
    sweep("qwen3_moe", "1A2F", {"ffn_parallel": "ep"}, "gloo"),
    pytest.param("qwen3_moe", "1A2F", {"ffn_parallel": "tp"}, "gloo"),
    pytest.param("qwen3_moe", "2A2F", {"router": "attn"}, "shm"),
    pytest.param("deepseek_v3", "2A2F", {"router": "attn", "dense_ffn": "replicate"}, "gloo"),  # shared experts whole
    sweep("qwen3_moe", "3A2F", {}, "gloo"),
    pytest.param("qwen2_moe", "2A2F", {}, "shm"),  # a gated shared expert, TP-sharded
    sweep("deepseek_v3", "1A2F", {"router": "attn"}, "gloo"),
    sweep("deepseek_v3", "2A2F", {"ffn_parallel": "tp"}, "shm"),
    pytest.param("deepseek_v3", "3A2F", {"ffn_parallel": "ep"}, "gloo"),
]


@pytest.mark.parametrize(("model_type", "plan", "options", "connector"), CASES)
def test_generation_across_processes_matches_monolith(reference, model_type, plan, options, connector):
    model, ids, mask, ref = reference(model_type)
    dm = afdc.disaggregate(model, plan, connector=connector, **options)
    with dm.launch(timeout=60) as cluster:
        for m in (1, 2, 3):  # with 3 rows per rank or fewer, some micro-batches are empty
            dm.micro_batches = m
            got = dm.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, pad_token_id=0)
            assert torch.equal(got, ref), f"m={m}"
        # each attention rank exchanged with the FFN side and timed it, phase by phase
        for snap in dm.metrics():
            assert snap["exchange_ms"]["count"] > 0 and snap["errors"] == 0
            phases = snap["phases"]
            assert phases["send"]["count"] == snap["messages_sent"] and phases["plan"]["count"] > 0
            assert phases["wait"]["count"] == snap["exchange_ms"]["count"]
            assert 0 < phases["wait"]["seconds"] < snap["uptime_s"]
            assert 0 < phases["send"]["cpu"] < snap["uptime_s"]  # a send's own CPU, beside its wall time
    served = cluster.metrics()  # published by each server as it stopped
    assert sorted(served) == list(range(dm.layout.ffn_ranks))
    assert all(s["batch_tokens"]["count"] > 0 and s["bytes_received"] > 0 for s in served.values())
    for s in served.values():  # a server's runs are its batches; its CPU time covers at least theirs
        run = s["phases"]["run"]
        assert run["count"] == s["batch_tokens"]["count"] == s["phases"]["reply"]["count"]
        # wall time includes waits for a core (a busy CI host): only the runs' CPU is bounded by the process's
        assert 0 < run["cpu"] <= s["cpu_seconds"] and 0 < run["seconds"] < s["uptime_s"]
    assert all(p.exitcode == 0 for p in cluster.processes)  # SIGTERM: drained and exited cleanly
    # each server computes with its share of the host's cores, beside this process: not a thread per core
    assert {s["torch_threads"] for s in served.values()} == {share_of_cores(dm.layout.ffn_ranks + 1)}


def test_replicated_dense_layers_send_each_token_once(reference):
    """Under --dense-ffn tp every FFN rank gets every token and returns a partial sum; replicated,
    each rank gets its own share of the tokens: F times fewer bytes each way, the same tokens."""
    model, ids, mask, ref = reference("llama")
    moved = {}
    for dense in ("tp", "replicate"):
        dm = afdc.disaggregate(model, "1A2F", connector="shm", dense_ffn=dense)
        with dm.launch(timeout=60):
            assert torch.equal(dm.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, pad_token_id=0), ref)
            (snap,) = dm.metrics()
        moved[dense] = (snap["bytes_sent"], snap["bytes_received"])
    assert moved["tp"][0] == 2 * moved["replicate"][0] and moved["tp"][1] == 2 * moved["replicate"][1], moved


def test_tokens_go_only_to_their_experts_ranks(reference):
    """Router on the attention side, 1A4F, one expert per rank: a token chose 2 of the 4 experts,
    so it is sent to exactly 2 ranks (with its hidden state and router scores) instead of all 4,
    and 2 partial results come back instead of 4; the tokens are the monolith's."""
    model, ids, mask, ref = reference("qwen3_moe")
    hidden, experts = model.config.hidden_size, model.config.num_experts
    moved = {}
    for router in ("ffn", "attn"):
        dm = afdc.disaggregate(model, "1A4F", connector="shm", router=router, micro_batches=2)
        assert [r is not None for r in dm.ffn.routing] == [router == "attn"]
        with dm.launch(timeout=60):
            assert torch.equal(dm.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, pad_token_id=0), ref)
            (snap,) = dm.metrics()
        moved[router] = (snap["bytes_sent"], snap["bytes_received"])
    # per token and layer: broadcast sends hidden to 4 ranks; routed sends hidden + scores to 2
    assert moved["attn"][0] * 4 * hidden == moved["ffn"][0] * 2 * (hidden + experts), moved
    assert moved["attn"][1] * 2 == moved["ffn"][1], moved


def test_expert_routing_keeps_every_tied_choice():
    """Scores tied at the k-th place: every tied expert's rank gets the token (a superset of any
    tie-break the FFN side's top-k makes), and replies add back into the rows they came from."""
    routing = ExpertRouting(input=1, per_rank=1, top_k=1)
    scores = torch.tensor([[0.5, 0.5, 0.0], [0.1, 0.2, 0.7], [0.0, 0.0, 0.0]])
    assert routing.ranks_of(scores, 3).tolist() == [[True, True, False], [False, False, True], [True, True, True]]
    dispatch = Dispatch(("sum",), ([-1, 2], [-1, 3]), routing)
    hidden = torch.arange(6.0).reshape(3, 2)
    shares = dispatch.shares([hidden, scores], 3, 3)
    assert [(s.rank, s.rows.tolist()) for s in shares] == [(0, [0, 2]), (1, [0, 2]), (2, [1, 2])]
    replies = [dispatch.take([hidden, scores], s, 3)[0] * (s.rank + 1) for s in shares]
    assert torch.equal(dispatch.combine(0, replies, shares), hidden * torch.tensor([[3.0], [3.0], [6.0]]))


def test_shared_experts_go_with_the_routed_tokens(reference):
    """A gated shared expert (Qwen2-MoE), held whole on every FFN rank: with the router on the
    attention side a token still goes only to the 2 ranks of its 2 experts (hidden state, router
    scores and a one-byte mark telling exactly one of them to add the shared expert) instead of
    all 4; the tokens are the monolith's."""
    model, ids, mask, ref = reference("qwen2_moe")
    hidden, experts = model.config.hidden_size, model.config.num_experts
    assert experts == 4 and model.config.num_experts_per_tok == 2
    shared = "model.layers.0.mlp.shared_expert.down_proj.weight"
    moved = {}
    for router in ("ffn", "attn"):
        built = build(model, afdc.Plan.parse("1A4F", router=router))
        split = dict(zip(built.layers[0].weights, built.segments[0].splits))
        # broadcast: the shared expert row-split (its one-column gate whole); routed: whole
        assert split[shared].dim == (1 if router == "ffn" else None)
        assert split["model.layers.0.mlp.shared_expert_gate.weight"].dim is None
        dm = afdc.disaggregate(model, "1A4F", connector="shm", router=router)
        (routing,) = dm.ffn.routing
        assert routing is None if router == "ffn" else routing.owner is not None
        with dm.launch(timeout=60):
            assert torch.equal(dm.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, pad_token_id=0), ref)
            (snap,) = dm.metrics()
        moved[router] = snap["bytes_sent"]
    assert moved["attn"] * 4 * 4 * hidden == moved["ffn"] * 2 * (4 * hidden + 4 * experts + 1), moved


def test_each_token_adds_the_shared_term_on_one_of_its_ranks():
    """The owner mark: every token is owned by exactly one rank it is sent to, the ranks taking
    turns (an even share of the shared expert's rows), and an empty message stays empty."""
    routing = ExpertRouting(input=1, per_rank=1, owner=2)
    ids = torch.tensor([[0, 1], [1, 2], [0, 2], [2, 2], [0, 1], [1, 0]])
    dispatch = Dispatch(("sum",), ([-1, 4], [-1, 2], [-1, 1]), routing)
    hidden = torch.randn(6, 4)
    owned = torch.zeros(6, dtype=torch.long)
    for share in dispatch.shares([hidden, ids], 6, 3):
        part = dispatch.take([hidden, ids], share, 6)
        assert part[2].dtype == torch.bool and part[2].shape == (share.count, 1)
        assert torch.equal(part[0], hidden[share.rows])
        owned[share.rows[part[2].flatten()]] += 1
        assert (ids[share.rows[part[2].flatten()]] == share.rank).any(-1).all()  # owns only what it was sent
    assert owned.tolist() == [1] * 6
    owners = ExpertRouting.owners(routing.ranks_of(ids, 3))
    assert owners.tolist() == [0, 2, 0, 2, 0, 1] and sorted(set(owners.tolist())) == [0, 1, 2]
    (empty,) = dispatch.shares([hidden[:0], ids[:0]], 0, 3)
    assert dispatch.take([hidden[:0], ids[:0]], empty, 0)[2].shape == (0, 1)


# gpt_oss: expert biases gathered by the rank's ids; afmoe: its shared expert's output viewed back
# to [batch, seq, hidden] (sizes read from the input); laguna: the MoE output times a routed scaling
@pytest.mark.parametrize("model_type", ["gpt_oss", "afmoe", "laguna"])
def test_expert_routing_is_proven_through_other_expert_layouts(reference, model_type):
    model, ids, mask, ref = reference(model_type)
    dm = afdc.disaggregate(model, "2A4F", router="attn")
    assert any(r is not None for r in dm.ffn.routing)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits
        got = dm(ids, attention_mask=mask, position_ids=pos).logits
    torch.testing.assert_close(got[mask.bool()], want[mask.bool()], atol=1e-5, rtol=1e-5)
    assert torch.equal(dm.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, pad_token_id=0), ref)


def test_transports_give_the_same_logits(reference):
    model, ids, mask, _ = reference("qwen3_moe")
    dm = afdc.disaggregate(model, "2A2F")
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    local = dm(ids, attention_mask=mask, position_ids=pos).logits
    for connector in ("gloo", "shm"):
        with dm.launch(connector):
            dm.micro_batches = 2
            remote = dm(ids, attention_mask=mask, position_ids=pos).logits
        torch.testing.assert_close(remote[mask.bool()], local[mask.bool()], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    ("model_type", "options", "fan_out"),
    [
        ("qwen3_moe", {}, "2"),  # expert-parallel, router on the FFN side: every token to both ranks
        sweep("llama", {}, "2"),  # dense TP: every token to both ranks, partial sums back
        ("llama", {"dense_ffn": "replicate"}, "1"),  # each rank serves its share of the tokens
        ("qwen3_moe", {"router": "attn"}, "<=2"),  # each token only to its experts' ranks
    ],
)
def test_wire_bytes_in_the_report_are_what_crosses(reference, model_type, options, fan_out):
    """The report's bytes on the wire per token (each copy to and from every FFN rank a token goes
    to) are what the exchange moves over shm, within the bound where the router decides."""
    model, ids, mask, _ = reference(model_type)
    dm = afdc.disaggregate(model, "1A2F", connector="shm", **options)
    report = dm.report()
    assert {f"{'<=' if r.routed else ''}{r.fan_out}" for r in report.layers} == {fan_out}
    with dm.launch(timeout=60):
        dm(ids, attention_mask=mask)
    crossed = dm.last_traffic.to_ffn_bytes + dm.last_traffic.to_attn_bytes
    if fan_out.startswith("<="):
        assert (report.bytes_to_ffn + report.bytes_to_attn) * ids.numel() <= crossed <= report.wire_bytes * ids.numel()
    else:
        assert crossed == report.wire_bytes * ids.numel()


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_micro_batches_ping_pong_in_one_thread(reference, backend):
    """Over FFN servers, a step's micro-batches take turns in the caller's thread: micro-batch 1
    sends each layer before micro-batch 0 waits for that layer's reply, then 0 computes its next
    layer while 1's is on the FFN side. A compiled program does it too, compiled in pieces cut
    at its sends (:mod:`afdc.lowering.piecewise`)."""
    model, ids, mask, ref = reference("qwen3_moe")
    dm = afdc.disaggregate(model, "1A1F", connector="shm", backend=backend)
    dm.micro_batches = 2
    events = []
    with dm.launch(timeout=60):
        endpoint = dm.endpoints[0]
        send, wait = endpoint.send, endpoint.wait

        def recorded_send(step, layer, micro_batch, *args):
            events.append(("send", layer, micro_batch, threading.current_thread()))
            return send(step, layer, micro_batch, *args)

        def recorded_wait(step, layer, micro_batch, *args):
            events.append(("wait", layer, micro_batch, threading.current_thread()))
            return wait(step, layer, micro_batch, *args)

        endpoint.send, endpoint.wait = recorded_send, recorded_wait
        got = dm.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, pad_token_id=0)
    assert torch.equal(got, ref)
    assert {thread for *_, thread in events} == {threading.current_thread()}
    layers = len(dm.ffn.layers)
    turns = [("send", 0, 0), ("send", 0, 1)]
    for layer in range(layers - 1):
        turns += [("wait", layer, 0), ("send", layer + 1, 0), ("wait", layer, 1), ("send", layer + 1, 1)]
    turns += [("wait", layers - 1, 0), ("wait", layers - 1, 1)]
    assert [e[:3] for e in events] == turns * NEW_TOKENS  # every step, prefill and decode


@pytest.mark.parametrize(("connector", "micro_batches"), [("gloo", 1), sweep("shm", 1), ("shm", 2)])
def test_killed_ffn_rank_is_reported_then_rejoins(reference, connector, micro_batches):
    model, ids, mask, ref = reference("qwen3_moe")
    dm = afdc.disaggregate(model, "1A2F", connector=connector)
    dm.micro_batches = micro_batches
    timeout = 5.0
    with dm.launch(timeout=timeout, join_timeout=60) as cluster:
        assert torch.equal(dm.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, pad_token_id=0), ref)
        killer = threading.Timer(0.3, cluster.kill, (1,))
        killer.start()
        started = time.monotonic()
        with pytest.raises(PeerLost, match=r"ffn rank 1 lost at FFN layer \d+") as err:
            dm.generate(ids, attention_mask=mask, max_new_tokens=10_000, pad_token_id=0)
        killer.join()
        assert time.monotonic() - started < 0.3 + timeout + 5
        assert err.value.rank == 1 and err.value.layer is not None

        cluster.start(1)  # the attention side is not restarted: it regroups at the next step
        got = dm.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, pad_token_id=0)
        assert torch.equal(got, ref)


@pytest.mark.parametrize("connector", ["gloo", "shm"])
def test_an_idle_attention_side_rejoins_a_restarted_ffn_rank_in_a_new_generation(reference, connector):
    """An FFN rank dies between steps and is restarted at once: the attention side's next step does
    not rejoin the generation the dead rank's hello is still up in (it would dial the dead address
    until the connect timeout); it starts a new one and waits there for the restarted rank."""
    model, ids, mask, ref = reference("qwen3_moe")
    dm = afdc.disaggregate(model, "1A2F", connector=connector)
    with dm.launch(timeout=5.0, join_timeout=60) as cluster:
        assert torch.equal(dm.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, pad_token_id=0), ref)
        endpoint = dm.endpoints[0]
        first = endpoint.transport.group.generation
        cluster.kill(1)
        deadline = time.monotonic() + 10
        while dm.layout.slot("ffn", 1) not in endpoint._lost:
            assert time.monotonic() < deadline, "the attention side never heard that its link ended"
            time.sleep(0.01)
        cluster.start(1)  # its process takes seconds to start: the step below comes first
        got = dm.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, pad_token_id=0)
        assert torch.equal(got, ref)
        assert endpoint.transport.group.generation > first


def _attention_rank_alone(program, dispatch, layout, deployment, options, ids, stepping) -> None:
    """Attention rank 0 of a 2A deployment in a process of its own: full-prefix steps until killed."""
    from afdc.runtime.attention_rank import AttentionRank, MicroBatch
    from afdc.runtime.exchange import AttentionEndpoint

    torch.set_grad_enabled(False)
    rank = AttentionRank(0, program, [], dispatch)
    rank.endpoint = AttentionEndpoint.connect(0, layout, deployment, options)
    batch = MicroBatch(ids, torch.ones_like(ids), torch.arange(ids.shape[1]).expand_as(ids))
    while True:
        rank.run(rank.begin_step(), [batch])
        stepping.set()


def test_a_dead_or_stalled_attention_rank_costs_the_others_at_most_one_gather_window(reference):
    """Attention rank 0 steps in a process of its own beside rank 1 (this process) and is stopped
    (SIGSTOP) mid-step, then killed. The FFN server keeps serving rank 1: its tokens stay the
    monolith's, and the stalled rank costs its steps one gather window in all (before: a window
    at every FFN layer of every step, as the stalled rank's plan still said it would send them);
    the killed one nothing (its link ends, the server forgets it)."""
    from afdc.runtime.exchange import AttentionEndpoint
    from afdc.runtime.local_cluster import LocalCluster

    model, ids, mask, _ = reference("qwen3_moe")
    row = (ids[:1], mask[:1])  # a batch of one row goes to attention rank 1 (dm's row split)
    ref = model.generate(input_ids=row[0], attention_mask=row[1], max_new_tokens=NEW_TOKENS, do_sample=False,
                         pad_token_id=0)
    dm = afdc.disaggregate(model, "2A1F", connector="shm")
    window = 2.0  # long beside a step's own time on a loaded host: a window more or less shows
    cluster = LocalCluster(dm, RuntimeOptions(connector="shm", timeout=60, join_timeout=60, gather=window))
    ctx = mp.get_context("spawn")
    stepping = ctx.Event()
    dispatch = [dm.ffn.dispatch(layer) for layer in range(len(dm.ffn.layers))]
    other = ctx.Process(target=_attention_rank_alone, daemon=True, args=(
        dm.attention_ranks[0], dispatch, dm.layout, dm.deployment, cluster.options, ids[1:], stepping))
    try:
        other.start()
        dm.ranks[1].endpoint = AttentionEndpoint.connect(1, dm.layout, dm.deployment, cluster.options)
        assert torch.equal(dm.generate(*row, max_new_tokens=NEW_TOKENS, pad_token_id=0), ref)
        assert stepping.wait(60)
        os.kill(other.pid, signal.SIGSTOP)
        started = time.monotonic()
        assert torch.equal(dm.generate(*row, max_new_tokens=NEW_TOKENS, pad_token_id=0), ref)
        stalled = time.monotonic() - started
        os.kill(other.pid, signal.SIGKILL)
        other.join(30)
        started = time.monotonic()
        assert torch.equal(dm.generate(*row, max_new_tokens=NEW_TOKENS, pad_token_id=0), ref)
        killed = time.monotonic() - started
    finally:
        dm.disconnect()
        cluster.stop()
        if other.is_alive():
            other.kill()
    assert stalled < 2 * window, (stalled, killed)  # before: 7.4 s of a 1 s window, one at most FFN layers
    assert killed < window, (stalled, killed)


def test_ffn_server_from_the_cli(reference, tmp_path):
    """``afdc serve ART --role ffn`` as a real subprocess; this process is attention rank 0 and hosts the store."""
    model, ids, mask, ref = reference("qwen3_moe")
    src = tmp_path / "src"
    model.save_pretrained(src)
    afdc.compile_model(str(src), "1A1F", tmp_path / "art", progress=False)
    dm = afdc.load_deployment(tmp_path / "art")
    address = f"127.0.0.1:{free_port()}"
    options = RuntimeOptions(connector="gloo", rendezvous=address, token="s3cret", timeout=60)
    dm.connect(options, host=True)
    cmd = [sys.executable, "-m", "afdc.cli", "serve", str(tmp_path / "art"), "--role", "ffn", "--rank", "0",
           "--rendezvous", address, "--token", "s3cret"]
    server = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    try:
        got = dm.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, pad_token_id=0)
        assert torch.equal(got, ref)
    finally:
        dm.disconnect()
        server.terminate()
        _, log = server.communicate(timeout=60)
    assert server.returncode == 0, log
    assert "serving generation" in log and "stopped" in log


def test_ffn_server_outlives_its_store_host(reference):
    """The store lives with attention rank 0: when that process leaves and comes back at the same
    address, a running FFN server reconnects and serves it, without a restart."""
    model, ids, mask, ref = reference("qwen3_moe")
    dm = afdc.disaggregate(model, "1A1F")
    options = RuntimeOptions(connector="gloo", rendezvous=f"127.0.0.1:{free_port()}", token="t", timeout=60,
                             join_timeout=60)
    server = mp.get_context("spawn").Process(
        target=serve_program, args=(dm.ffn_ranks[0], dm.layout, dm.deployment, options), daemon=True
    )
    dm.connect(options, host=True)
    server.start()
    try:
        for _ in range(2):  # the second time against a new store
            assert torch.equal(dm.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, pad_token_id=0), ref)
            dm.disconnect()  # closes the store
            dm.connect(options, host=True)
    finally:
        dm.disconnect()
        server.terminate()
        server.join(60)
    assert server.exitcode == 0


def test_cli_serve_errors(tmp_path):
    from click.testing import CliRunner

    from afdc.cli import main

    result = CliRunner().invoke(
        main, ["serve", str(tmp_path / "nothing"), "--role", "ffn", "--rendezvous", "127.0.0.1:1", "--token", "t"]
    )
    assert result.exit_code == 2 and "give the output directory of `afdc compile`" in result.output


@pytest.mark.parametrize(
    "connector, instead", [("nccl", "the gloo or shm connector"), ("cuda-ipc", "the shm connector")]
)
def test_gpu_connectors_refuse_a_rank_without_a_gpu(connector, instead):
    """NCCL and CUDA IPC move GPU memory: a CPU rank is told what to run instead, before any link forms."""
    from afdc.errors import AfdcError
    from afdc.runtime.transport import transport_class

    layout = Layout(1, 0)  # one slot: its gloo header group forms without peers
    rdv = Rendezvous(f"127.0.0.1:{free_port()}", layout, b"\x03" * 8, "t", host=True)
    group = rdv.join(0, timeout=5.0)
    with pytest.raises(AfdcError, match=f"moves GPU memory.*run it with --device cuda, or use {instead}"):
        transport_class(connector)(rdv, group, 0, "attn", timeout=5.0, device="cpu")


def test_a_mailbox_of_another_connector_or_geometry_or_unsealed_is_refused_by_name():
    """Payloads in the file (shm) or in device memory (cuda-ipc): a rank that maps a mailbox of
    the other kind is told the peer runs another connector, instead of reading bytes that are not
    there. A mailbox of other sizes, or one its creator could shrink under the reader (a SIGBUS
    would kill the reader for the peer's fault), is refused before it is mapped; the descriptor is
    closed either way. Sealed, it cannot be shrunk."""
    from afdc.runtime.transport.cuda_ipc import DeviceMailbox
    from afdc.runtime.transport.shm import Mailbox

    cpu = torch.device("cpu")
    host = Mailbox.create(2, 64, cpu)
    device = DeviceMailbox.create(2, 64, cpu)  # on the CPU: its control file is what is checked here
    for kind, box in ((DeviceMailbox, host), (Mailbox, device)):
        with pytest.raises(ConnectionError, match="the peer runs another connector"):
            kind.open({}, os.dup(box.fd), cpu, 2, 64)
    assert Mailbox.open({}, os.dup(host.fd), cpu, 2, 64).slot_bytes == 64
    with pytest.raises(ConnectionError, match="no device buffer: it runs another connector"):
        DeviceMailbox.open({}, os.dup(device.fd), cpu, 2, 64)
    with pytest.raises(ConnectionError, match=r"not the 3 of 64 \(\d+ bytes\) agreed"):
        Mailbox.open({}, os.dup(host.fd), cpu, 3, 64)
    loose = os.memfd_create("loose")
    os.ftruncate(loose, Mailbox.file_size(2, 64))
    with pytest.raises(ConnectionError, match="not a shared file sealed against resizing"):
        Mailbox.open({}, loose, cpu, 2, 64)
    with pytest.raises(OSError):
        os.fstat(loose)  # closed with the refusal
    with pytest.raises(PermissionError):
        os.ftruncate(host.fd, 64)  # what a hostile creator would do to its readers
    host.close_fd()
    device.close_fd()


def test_wrong_token_is_refused_at_rendezvous(caplog):
    layout, dep = Layout(1, 1), b"\x01" * 8
    address = f"127.0.0.1:{free_port()}"
    host = Rendezvous(address, layout, dep, "right", host=True)
    stranger = Rendezvous(address, layout, dep, "wrong")
    other_artifact = Rendezvous(address, layout, b"\x02" * 8, "right")
    def intrude(rdv: Rendezvous) -> None:
        with contextlib.suppress(PeerLost, JoinError):  # the intruder never forms a group either
            rdv.join(1, "", 1.0)

    for intruder in (stranger, other_artifact):
        threading.Thread(target=intrude, args=(intruder,), daemon=True).start()
        with caplog.at_level(logging.WARNING), pytest.raises(PeerLost, match="ffn rank 0 lost: did not join") as lost:
            host.join(0, timeout=1.0)
        assert "refused ffn rank 0" in caplog.text
        # the member that waited in vain hears why: the process that came for the slot was refused
        assert f"a process that came for it was refused (pid {os.getpid()} on " in str(lost.value)
        assert "wrong deployment token or another artifact" in str(lost.value)
        caplog.clear()


@pytest.mark.parametrize(("plan", "connector"), [("2A1F", "shm"), ("2A2F", "gloo")])
def test_ffn_server_runs_each_layer_once_for_every_attention_rank(reference, plan, connector):
    """The step plans tell each FFN server which attention ranks send a layer: it runs the layer
    once over both ranks' tokens. Only the first step may run alone (a rank still joining
    announces it late). The window is long, so no lag on a loaded machine
    splits a run, and a wrong expectation would stall the test rather than pass."""
    model, ids, mask, ref = reference("qwen3_moe")
    dm = afdc.disaggregate(model, plan, connector=connector)
    with dm.launch(timeout=60, gather=30.0) as cluster:
        assert torch.equal(dm.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, pad_token_id=0), ref)
        exchanges = [snap["exchange_ms"]["count"] for snap in dm.metrics()]
    assert exchanges[0] == exchanges[1] > 0
    layers = len(dm.ffn.layers)
    steps = exchanges[0] // layers  # the prefill, then one token per row a step
    tokens = layers * ids.numel() + layers * (steps - 1) * ids.shape[0]
    for snap in cluster.metrics().values():
        runs = snap["batch_tokens"]["count"]
        assert exchanges[0] <= runs <= exchanges[0] + layers  # without the plans: up to twice as many
        assert round(snap["batch_tokens"]["mean"] * runs) == tokens


def test_shm_server_refuses_strangers_and_keeps_serving(reference, caplog):
    model, ids, mask, ref = reference("qwen3_moe")
    dm = afdc.disaggregate(model, "1A1F", connector="shm")
    with dm.launch(timeout=30) as cluster:
        assert torch.equal(dm.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, pad_token_id=0), ref)
        store = cluster.rendezvous
        gen = store.generation()
        member = json.loads(store.store.get(f"g{gen}/hello/1"))  # FFN rank 0's hello: its socket
        for hello in (b'{"slot": 0, "generation": %d, "proof": "forged", "ring": "/dev/shm/x"}\n' % gen, b"junk\n"):
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                sock.settimeout(10)
                sock.connect(member["address"])
                sock.sendall(hello)
                reply = sock.recv(4096)
            assert b"error" in reply or reply == b""  # refused with a reason, or dropped when unparseable
        # the deployment is untouched
        assert torch.equal(dm.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, pad_token_id=0), ref)


def test_server_checks_every_message():
    """Messages for another artifact, another generation, an unknown layer or of the wrong kind
    are refused with a reason (the server answers ERROR and keeps serving)."""
    program = afdc.disaggregate(catalog.build(_entry("llama")), "1A1F").ffn
    server = FFNServer(program, Layout(1, 1), b"\x07" * 8, RuntimeOptions(rendezvous="127.0.0.1:1"))

    def header(**kw):
        base = dict(kind=wire.Kind.DATA, deployment=b"\x07" * 8, generation=3, step=1, layer=0, micro_batch=0,
                    tokens=1, sender=0)
        return wire.Header(**{**base, **kw})

    assert server._check(header(), 3) == ""
    assert "another artifact" in server._check(header(deployment=b"\x08" * 8), 3)
    assert "generation 2" in server._check(header(generation=2), 3)
    assert "does not exist" in server._check(header(layer=99), 3)
    assert "DATA" in server._check(header(kind=wire.Kind.RESULT), 3)

    # a DATA message's tensors against its layer; the answer is remembered per layer, token count
    # and tensor layout, and a remembered answer is the one a fresh check gives
    (layout,) = program.dispatch(0).inputs
    width = math.prod(abs(d) for d in layout)

    def data(tokens, *tensors):
        return Incoming(wire.Header.carrying(wire.Kind.DATA, list(tensors), deployment=b"\x07" * 8, generation=3,
                                             step=1, layer=0, micro_batch=0, tokens=tokens, sender=0), list(tensors))

    good, short = data(3, torch.randn(3, width)), data(3, torch.randn(2, width))
    wrong_dtype, two = data(3, torch.randn(3, width).double()), data(3, torch.randn(3, width), torch.randn(3, width))
    for _ in range(2):
        assert server._check_tensors(good) == ""
        assert "3 tokens are" in server._check_tensors(short)
        assert "torch.float64" in server._check_tensors(wrong_dtype)
        assert "takes 1 inputs, the message carries 2" in server._check_tensors(two)
    assert server._fits.cache_info().currsize == 4

    # a step plan: each micro-batch's token count, adding up to its header's
    def plan(counts, micro_batches=None, tokens=None, dtype=torch.int64):
        t = torch.tensor(counts, dtype=dtype)
        h = header(kind=wire.Kind.STEP, micro_batch=len(counts) if micro_batches is None else micro_batches,
                   tokens=sum(counts) if tokens is None else tokens)
        return Incoming(h, [t])

    assert server._check_tensors(plan([3, 5])) == ""
    assert "do not add up" in server._check_tensors(plan([3, 5], tokens=9))
    assert "do not add up" in server._check_tensors(plan([-1, 9]))
    assert "names 2 micro-batches (its header 3)" in server._check_tensors(plan([3, 5], micro_batches=3))
    assert "1-D int64" in server._check_tensors(plan([3, 5], dtype=torch.int32))


def test_wire_header_round_trip_and_malformed_input():
    specs = (wire.TensorSpec(torch.bfloat16, (3, 4096)), wire.TensorSpec(torch.int64, (6,)))
    h = wire.Header(wire.Kind.DATA, b"abcdefgh", 2, 10, 5, 1, 3, 0, specs, sum(s.nbytes for s in specs))
    data = h.encode()
    assert len(data) == wire.HEADER_BYTES and wire.Header.decode(data) == h
    with pytest.raises(wire.WireError, match="not an afdc message"):
        wire.Header.decode(b"XXXX" + data[4:])
    with pytest.raises(wire.WireError, match="wire version"):
        wire.Header.decode(data[:4] + bytes([99]) + data[5:])
    with pytest.raises(wire.WireError, match="does not match"):
        wire.Header.decode(wire.Header(wire.Kind.DATA, b"abcdefgh", 2, 10, 5, 1, 3, 0, specs, 7).encode())
    with pytest.raises(wire.WireError, match="header of 3 bytes"):
        wire.Header.decode(b"abc")
    # in place, as a shared-memory slot holds it: a header of fewer tensors over a longer one's
    # bytes reads back as itself (its count says how many are described)
    slot = bytearray(b"\xff" * (7 + wire.HEADER_BYTES))
    h.encode_into(slot, 7)
    one = wire.Header(wire.Kind.RESULT, b"abcdefgh", 2, 11, 5, 1, 3, 1, specs[:1], specs[0].nbytes)
    one.encode_into(slot, 7)
    assert wire.Header.decode_from(slot, 7) == one and wire.Header.decode(bytes(slot[7:])) == one
    tensors = [torch.randn(3, 5, dtype=torch.bfloat16), torch.arange(7)]  # an int64 at an odd offset
    back = wire.unpack(wire.pack(tensors), wire.specs(tensors))
    assert all(torch.equal(a, b) for a, b in zip(tensors, back))


@pytest.mark.parametrize("model_type", ["qwen3_moe", "deepseek_v3", "gpt2"])
def test_one_ffn_run_for_several_senders(model_type):
    """The FFN server's batching: one segment run over the concatenated tokens of several messages
    equals separate runs (router on the attention side too: top-k ids cross as inputs)."""
    model = catalog.build(_entry(model_type))
    dm = afdc.disaggregate(model, "1A1F", router="attn")
    ffn = dm.ffn
    captured_inputs = []

    def record(layer, inputs):
        captured_inputs.append((layer, [t.clone() for t in inputs]))
        return ffn.run(layer, inputs)

    messages = []
    for rows, cols in ((2, 5), (1, 3), (3, 1)):
        captured_inputs.clear()
        ids = torch.randint(3, model.config.vocab_size, (rows, cols))
        with torch.no_grad(), connectors.active(connectors.LoopbackConnector(record)):
            dm.attention(ids, torch.ones_like(ids), torch.arange(cols).expand(rows, cols))
        messages.append((rows * cols, dict(captured_inputs)))
    for layer in messages[0][1]:
        batch = [m[1][layer] for m in messages]
        tokens = [m[0] for m in messages]
        together = ffn.run_batch(layer, batch, tokens)
        for inputs, t, outs in zip(batch, tokens, together):
            alone = ffn.run(layer, inputs)
            for a, o in zip(alone, outs):
                torch.testing.assert_close(o, a.reshape(t, -1), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("model_type", "router"), [("qwen3_moe", "ffn"), ("qwen3_moe", "attn"),
                                                    ("deepseek_v3", "attn"), ("gpt2", "ffn")])
def test_token_buckets_pad_batches_without_changing_a_real_row(model_type, router):
    """With token buckets a segment only ever runs at a power-of-two token count (a few shapes, a
    CUDA graph each on a GPU): the zero rows added change no real token's output, and a batch
    above the largest bucket runs at its own count."""
    from afdc.runtime.static_shapes import bucket

    assert [bucket(t, 8) for t in (0, 1, 2, 3, 5, 8, 9)] == [1, 1, 2, 4, 8, 8, None]
    model = catalog.build(_entry(model_type))
    dm = afdc.disaggregate(model, "1A1F", router=router)
    ffn = dm.ffn
    messages: dict[int, list] = {}

    def record(layer, inputs):
        messages.setdefault(layer, []).append([t.clone() for t in inputs])
        return ffn.run(layer, inputs)

    for rows, cols in ((1, 1), (2, 1), (1, 3), (3, 3)):  # 1, 2, 3 and 9 tokens
        ids = torch.randint(3, model.config.vocab_size, (rows, cols))
        with torch.no_grad(), connectors.active(connectors.LoopbackConnector(record)):
            dm.attention(ids, torch.ones_like(ids), torch.arange(cols).expand(rows, cols))
    tokens = [1, 2, 3, 9]
    expected = {layer: ffn.run_batch(layer, batch, tokens) for layer, batch in messages.items()}
    seen = set()  # the token counts segments ran at
    ffn.use_buckets(8)
    for static in ffn._static:
        run, per_token = static.run, math.prod(abs(d) for d in static.layouts[-1])
        static.run = lambda *args, run=run, n=per_token: (seen.add(args[-2].numel() // n), run(*args))[1]
    for layer, batch in messages.items():
        for group in ([0], [1], [2], [0, 2], [1, 2], [3], [0, 1, 2]):  # batches of 1, 2, 3, 4, 5, 9 and 6 tokens
            got = ffn.run_batch(layer, [batch[i] for i in group], [tokens[i] for i in group])
            for i, outs in zip(group, got):
                for want, out in zip(expected[layer][i], outs):
                    torch.testing.assert_close(out, want.reshape(out.shape), atol=1e-5, rtol=1e-5)
    assert sorted(seen) == [1, 2, 4, 8, 9]
    ffn.use_buckets(0)
    assert ffn._static is None


def test_ffn_server_with_token_buckets_matches_monolith(reference):
    model, ids, mask, ref = reference("qwen3_moe")
    dm = afdc.disaggregate(model, "1A1F", connector="shm")
    with dm.launch(timeout=60, token_buckets=8):
        for m in (1, 2):  # prefill batches above the largest bucket, decode steps padded
            dm.micro_batches = m
            assert torch.equal(dm.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, pad_token_id=0), ref)


def test_a_waiter_idle_across_waits_sleeps_at_once_and_one_expecting_a_reply_polls():
    """Idle is counted from the last wait that ended with something, not from the start of each
    wait (a server's wait returns every poll_interval); a rank that just sent polls again."""
    from afdc.runtime.transport.base import Pacing, Waiter

    waiter = Waiter(Pacing(spin=1.0, max_sleep=1e-3, idle_sleep=0.3, idle_after=0.05))
    time.sleep(0.06)
    start = time.monotonic()
    waiter.pauses()()
    assert time.monotonic() - start >= 0.3  # the first pause of an idle waiter: idle_sleep
    waiter.busy()
    start = time.monotonic()
    waiter.pauses()()
    assert time.monotonic() - start < 0.3  # within the spin: a yield, no sleep


def test_a_waiter_that_can_be_woken_blocks_once_past_its_spin_and_never_past_its_deadline():
    """Past the spin, a pause blocks on the wake-up for up to ``block`` seconds at a time
    (the message or the transport ends it), not in short sleeps; no pause outlasts ``until``."""
    from afdc.runtime.transport.base import Pacing, Waiter

    blocks: list[float] = []
    waiter = Waiter(Pacing(spin=0.0, block=0.05))
    waiter.pauses(block=blocks.append, wakes=True)()
    assert blocks == [0.05]
    waiter.pauses(block=blocks.append, wakes=True, until=time.monotonic() + 0.01)()
    assert 0 <= blocks[-1] <= 0.01
    waiter.busy()  # not idle (however long this test stalled): the first sleep is the shortest
    waiter.pauses(block=blocks.append)()  # nothing wakes it: a short sleep, doubled at the next pause
    assert blocks[-1] == pytest.approx(2e-5)


def test_an_attention_rank_polls_for_its_reply_and_an_ffn_server_only_with_cores_to_spare():
    from afdc.runtime.options import RuntimeOptions
    from afdc.runtime.transport.base import SPIN_CORES, default_spin

    assert default_spin("attn", 2) > 0  # its polls yield the core: it waits for a reply it asked for
    assert default_spin("ffn", 2) == 0.0 and default_spin("ffn", SPIN_CORES - 1) == 0.0
    assert default_spin("ffn", SPIN_CORES) > 0
    for role in ("attn", "ffn"):  # --spin sets every role's
        assert RuntimeOptions(spin=0.0).pacing(role).spin == 0.0
        assert RuntimeOptions(spin=0.5).pacing(role).spin == 0.5


def _later(action, seconds: float = 0.1) -> threading.Thread:
    """``action`` run by a thread after ``seconds``."""
    def run():
        time.sleep(seconds)
        action()
    thread = threading.Thread(target=run)
    thread.start()
    return thread


def test_a_slot_reader_woken_without_a_post_and_a_post_that_wakes_no_one():
    """``wake_readers`` ends a reader's sleep on its slot at once (a message came over the
    socket); a post with ``wake=False`` (a sender to a server, which rings the server's bell
    instead) leaves it asleep, and the reader finds it at its next look."""
    from afdc.runtime.transport import futex
    from afdc.runtime.transport.shm import Mailbox

    if not futex.AVAILABLE:
        pytest.skip("no futex on this platform: readers sleep in steps")
    writer = Mailbox.create(2, 64, torch.device("cpu"))
    reader = Mailbox.open({}, os.dup(writer.fd), torch.device("cpu"), 2, 64)
    header = wire.Header(wire.Kind.DATA, b"12345678", 1, 1, 0, 0, 1, 0)

    start = time.monotonic()  # before the thread's sleep starts: the wait lasts at least that sleep
    thread = _later(reader.wake_readers)
    reader.wait_ready(1, 30.0)
    assert 0.1 <= time.monotonic() - start < 10.0
    thread.join()
    thread = _later(lambda: writer.put(1, header, [], Pacing(), 1.0, "reader", wake=False))
    start = time.monotonic()
    reader.wait_ready(1, 0.5)
    assert time.monotonic() - start >= 0.45  # posted meanwhile, but slept through: nothing woke it
    thread.join()
    assert reader.ready(1) and reader.pending() == [1]


def test_a_slot_reader_sleeps_until_its_message_is_posted():
    """A micro-batch thread's sleep on its slot ends at the post (a futex on the slot's sequence
    number, woken by the writer), not at its timeout; with nothing posted it lasts the timeout;
    a message already there ends it at once."""
    from afdc.runtime.transport import futex
    from afdc.runtime.transport.shm import Mailbox

    writer = Mailbox.create(1, 64, torch.device("cpu"))
    reader = Mailbox.open({}, os.dup(writer.fd), torch.device("cpu"), 1, 64)  # with the geometry agreed
    start = time.monotonic()
    reader.wait_ready(0, 0.2)
    assert time.monotonic() - start >= 0.2
    header = wire.Header(wire.Kind.DATA, b"12345678", 1, 1, 0, 0, 1, 0)
    long = 30.0 if futex.AVAILABLE else 0.5  # without a futex the sleep lasts its timeout
    start = time.monotonic()
    poster = _later(lambda: writer.put(0, header, [], Pacing(), 1.0, "reader"), 0.2)
    reader.wait_ready(0, long)
    took = time.monotonic() - start
    poster.join()
    assert reader.ready(0)
    assert 0.2 <= took < (10.0 if futex.AVAILABLE else 1.0)
    start = time.monotonic()
    reader.wait_ready(0, long)  # a message is there: no sleep
    assert time.monotonic() - start < (10.0 if futex.AVAILABLE else 1.0)


def _ring(fd: int, times: int) -> None:
    from afdc.runtime.transport.shm import Bell

    bell = Bell.received(fd)
    for _ in range(times):
        bell.ring()


def test_a_bell_counts_every_ring_of_several_processes_and_wakes_its_sleeper():
    """An FFN server sleeps on one bell for all of its links: a ring from any process ends the
    sleep, a ring since the value it last saw means no sleep at all, and two processes ringing
    at once both count (the kernel's atomic add; a read-modify-write from Python loses some)."""
    from afdc.runtime.transport import futex
    from afdc.runtime.transport.shm import Bell

    if not futex.AVAILABLE:
        pytest.skip("no futex on this platform: a server sleeps in steps")
    bell = Bell.create()
    ctx = mp.get_context("fork")  # the children inherit the bell's descriptor
    ringers = [ctx.Process(target=_ring, args=(bell.fd, 20000)) for _ in range(2)]
    for p in ringers:
        p.start()
    for p in ringers:
        p.join(60)
    assert [p.exitcode for p in ringers] == [0, 0]
    assert bell.value == 40000

    seen = bell.value
    start = time.monotonic()
    ringer = ctx.Process(target=_ring, args=(bell.fd, 1))
    thread = _later(ringer.start)
    bell.wait(seen, 30.0)
    assert 0.1 <= time.monotonic() - start < 10.0 and bell.value == seen + 1
    thread.join()
    ringer.join(10)
    start = time.monotonic()
    bell.wait(seen, 30.0)  # rung since ``seen``: no sleep
    assert time.monotonic() - start < 10.0
    bell.close_fd()


def test_a_bell_that_is_not_a_sealed_word_is_refused(tmp_path):
    """An attention rank maps the bell its FFN rank passes: a descriptor that could shrink under
    it (SIGBUS) or is not one word's line is refused with a clear error, and closed."""
    from afdc.runtime.transport.shm import Bell, Mailbox

    loose = os.memfd_create("loose")  # unsealed: its owner could truncate it under the mapping
    os.ftruncate(loose, 64)
    with pytest.raises(ConnectionError, match="not a shared file sealed against resizing"):
        Bell.received(loose)
    with pytest.raises(OSError):
        os.fstat(loose)  # closed with the refusal
    path = tmp_path / "file"
    path.write_bytes(bytes(64))
    with pytest.raises(ConnectionError, match="not a shared file sealed against resizing"):
        Bell.received(os.open(path, os.O_RDWR))
    with pytest.raises(ConnectionError, match="not one shared word"):
        Bell.received(os.dup(Mailbox.create(1, 64, torch.device("cpu")).fd))  # sealed, but a mailbox's size


def test_shared_memory_mailbox_completes_messages_by_sequence_and_never_overwrites_an_untaken_one():
    """A slot holds one message: the reader sees it only once its sequence number is written, the
    writer waits (up to its deadline) until the reader has taken the last one, and slots are
    independent (micro-batches do not wait for each other)."""
    from afdc.runtime.transport.shm import Mailbox

    writer = Mailbox.create(2, 64, torch.device("cpu"))
    reader = Mailbox.open({}, os.dup(writer.fd), torch.device("cpu"), 2, 64)
    assert (reader.slots, reader.slot_bytes) == (2, 64) and not reader.ready(0) and reader.posted == 0

    def header(micro_batch, tensors):
        return wire.Header.carrying(wire.Kind.DATA, tensors, deployment=b"12345678", generation=1, step=1, layer=3,
                                    micro_batch=micro_batch, tokens=1, sender=0)

    def post(slot, tensors, timeout=1.0):
        writer.put(slot, header(slot, tensors), tensors, Pacing(), timeout, "reader")

    x, y = torch.arange(16, dtype=torch.int32), torch.arange(8, dtype=torch.int64)
    post(0, [x])
    assert reader.ready(0) and not reader.ready(1) and reader.posted == 1 and reader.pending() == [0]
    with pytest.raises(ConnectionError, match="reader has not taken its last message for slot 0"):
        post(0, [x], timeout=0.05)
    post(1, [y])  # another slot is free
    assert reader.pending() == [0, 1]
    got, (taken,) = reader.take(0)
    assert got == header(0, [x]) and torch.equal(taken, x)
    assert not reader.ready(0) and reader.ready(1) and reader.pending() == [1]
    post(0, [x[:3] + 1, y[:4].view(2, 2)])  # two tensors back to back, the second at an unaligned offset
    got, (first, second) = reader.take(0)
    assert torch.equal(first, x[:3] + 1) and torch.equal(second, y[:4].view(2, 2)) and second.dtype == torch.int64
    got, (taken,) = reader.take(1)
    assert torch.equal(taken, y) and reader.pending() == []
    assert not writer.fits(65) and writer.fits(64)


def test_a_gloo_peer_that_announces_a_payload_and_never_sends_it_loses_its_link_alone():
    """Over gloo a message is a header, then its payload: a peer that sends the header of a
    payload and never the payload loses its link within the transport's timeout, and only that
    link. The other attention rank's messages are taken meanwhile and after (before, the stalled
    link's receive waited until the next generation; gloo's own deadline would have closed
    every link of the rank)."""
    from afdc.runtime.transport.base import LEFT, Failure
    from afdc.runtime.transport.gloo import GlooTransport

    layout, deployment, timeout = Layout(2, 1), b"\x06" * 8, 2.0
    address = f"127.0.0.1:{free_port()}"
    rdvs = [Rendezvous(address, layout, deployment, "t", host=True)]
    rdvs += [Rendezvous(address, layout, deployment, "t") for _ in range(2)]
    transports: dict[int, GlooTransport] = {}

    def form(slot: int) -> None:
        group = rdvs[slot].join(slot, timeout=30)
        transports[slot] = GlooTransport(rdvs[slot], group, slot, layout.role_rank(slot)[0], timeout=timeout)

    threads = [threading.Thread(target=form, args=(s,)) for s in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    ffn = transports[2]
    x = [torch.arange(25, dtype=torch.float32)]

    def header(sender: int) -> wire.Header:
        return wire.Header.carrying(wire.Kind.DATA, x, deployment=deployment, generation=ffn.group.generation,
                                    step=1, layer=0, micro_batch=0, tokens=1, sender=sender)

    stalled = torch.frombuffer(bytearray(header(0).encode()), dtype=torch.uint8)
    header_only = transports[0].pg.send([stalled], 2, 1)  # on the headers' tag; its buffer must live on
    started = time.monotonic()
    transports[1].send(2, header(1), x)
    first = ffn.collect(10)
    assert [type(i) for i in first] == [Incoming] and first[0].header.sender == 1
    assert torch.equal(first[0].tensors[0], x[0])
    lost = ffn.collect(3 * timeout)
    waited = time.monotonic() - started
    assert [(type(i), i.peer) for i in lost] == [(Failure, 0)], lost
    assert "announced a payload of 100 bytes and did not send it within 2 s" in lost[0].reason
    assert timeout * 0.9 <= waited < 2 * timeout, waited
    transports[1].send(2, header(1), x)  # the other link is whole
    after = ffn.collect(10)
    assert [type(i) for i in after] == [Incoming] and torch.equal(after[0].tensors[0], x[0])
    told = transports[0].collect(10)  # the stalled peer is told its link was dropped
    assert [(type(i), i.peer, i.reason) for i in told] == [(Failure, 2, LEFT)], told
    for s in (1, 2):
        transports[s].close()
    del header_only


_SILENT_PEER = """
import sys, time
from afdc.runtime.rendezvous import Layout, Rendezvous
from afdc.runtime.transport.gloo import GlooTransport
rdv = Rendezvous(sys.argv[1], Layout(1, 1), bytes.fromhex(sys.argv[2]), "t")
kept = []  # never closed: this peer says no BYE, as one stalled or gone silent
while True:
    group = rdv.join(1, timeout=60)
    kept.append(GlooTransport(rdv, group, 1, "ffn", timeout=5))
    print(group.generation, flush=True)
    while rdv.generation() == group.generation:
        time.sleep(0.02)
"""


def test_gloo_regroups_close_the_left_generations_links_though_a_peer_never_says_bye():
    """Each regrouping leaves its generation's gloo groups: their links close and the receiver
    threads parked on them end, whether or not the peer said BYE. Before, a peer that never did
    (stalled, or silent) kept this process's receiver thread and the group's sockets of every
    generation open: about ten more open files per regrouping."""
    from afdc.runtime.transport.gloo import GlooTransport

    layout, deployment = Layout(1, 1), b"\x05" * 8
    address = f"127.0.0.1:{free_port()}"
    rdv = Rendezvous(address, layout, deployment, "t", host=True)
    peer = subprocess.Popen([sys.executable, "-c", _SILENT_PEER, address, deployment.hex()], stdout=subprocess.PIPE)
    counts = []
    try:
        for _ in range(5):
            transport = GlooTransport(rdv, rdv.join(0, timeout=60), 0, "attn", timeout=5)
            assert int(peer.stdout.readline()) == transport.group.generation
            transport.close()
            del transport
            rdv.bump()
            receivers = [t for t in threading.enumerate() if t.name.startswith("afdc-recv-")]
            deadline = time.monotonic() + 5
            while receivers and time.monotonic() < deadline:
                time.sleep(0.01)
                receivers = [t for t in receivers if t.is_alive()]
            counts.append((len(os.listdir("/proc/self/fd")), len(receivers)))
    finally:
        peer.kill()
        peer.wait()
    assert counts == [counts[0]] * len(counts) and counts[0][1] == 0, counts


def test_a_spare_claims_the_slot_of_an_owner_that_stopped_saying_it_is_alive():
    """An owner that beats keeps its slot however long a spare watches; once its beats stop for
    ``silent_after``, a spare claims the slot though no attention rank recorded a loss (before, it
    never did: a claimer that died while loading, where no launcher watches its process as ``afdc
    up`` does, left its slot unserved)."""
    from afdc.runtime.spare import Slots, keep_beating, wait_for_a_lost_slot

    layout, deployment, silent_after = Layout(1, 1), b"\x04" * 8, 0.5
    address = f"127.0.0.1:{free_port()}"
    rdv = Rendezvous(address, layout, deployment, "t", host=True)
    slot = layout.slot("ffn", 0)
    owner = Slots(rdv).own(slot, rdv.generation())
    rdv.bump()  # the generation a spare claims in: its record differs from the owner's
    beating, stop = threading.Event(), threading.Event()
    threading.Thread(target=keep_beating, args=(rdv, slot, owner, beating, 0.02), daemon=True).start()
    claimed: list = []
    spare = Rendezvous(address, layout, deployment, "t")
    waiter = threading.Thread(target=lambda: claimed.append(wait_for_a_lost_slot(spare, stop, 0.02, silent_after)))
    waiter.start()
    try:
        time.sleep(3 * silent_after)
        assert claimed == []  # alive: not claimed
        beating.set()
        silenced = time.monotonic()
        waiter.join(10)
        waited = time.monotonic() - silenced
    finally:
        stop.set()
    assert claimed and claimed[0] is not None and claimed[0][0] == slot, claimed
    assert Slots(rdv).owner(slot)[0] == claimed[0][1] != owner
    # The silence starts at the owner's last beat, which is up to a beat (0.02 s, more where the
    # thread was late to a core) before the test stops the beats, so the claim may come that much
    # before ``silent_after`` measured from here (CI saw 0.4995).
    assert silent_after - 0.1 <= waited < silent_after + 2, waited


def test_a_health_record_is_read_as_bounded_data():
    """The store is writable by whoever reaches it: a health record is JSON of a known state and a
    problem, at most 4 KiB; anything else reads as an unavailable rank that says why."""
    from afdc.runtime.rendezvous import DEGRADED, SERVING, UNAVAILABLE, Health

    held = Health(DEGRADED, "ffn rank 1 lost")
    assert Health.decode(held.encode().encode()) == held and Health().state == SERVING
    for raw, why in [(b"not json", "Expecting value"), (b'{"state": "fine", "problem": ""}', "state 'fine'"),
                     (b'{"problem": ""}', "state"), (b"[" * 5000, "5000 bytes")]:
        health = Health.decode(raw)
        assert health.state == UNAVAILABLE and "malformed health record" in health.problem and why in health.problem
