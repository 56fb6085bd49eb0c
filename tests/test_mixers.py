"""Stateful token mixers (Gated DeltaNet, Mamba-2, short convolutions): one ``afdc::mixer`` op per
call site, its state kept on the attention side, so decode is incremental; checked against the
monolith on left-padded batches, in-process, across processes and from a compiled artifact."""

from __future__ import annotations

import functools
from dataclasses import replace

import pytest
import torch
from transformers import AutoConfig, DynamicCache

import afdc
from afdc.artifact.manifest import read_manifest
from afdc.lowering.attention_slots import attention_slots, program_slots
from afdc.lowering.cache_positions import positions_as_cache_positions
from afdc.mixer_site import MixerSite
from afdc.ops import MixerCall
from afdc.runtime import kv_cache
from afdc.runtime import link as connectors
from afdc.runtime.bounded_state import BoundedState
from afdc.runtime.mixer_modules import Mixers
from afdc.runtime.paged import MixerStateStore, PagedBatch, PagedKVStore, PagedRows
from afdc.runtime.programs import combine
from afdc.segment import IndexBound
from afdc.serve.up import check_servable
from models_supported import catalog
from tests.tiers import sweep

NEW_TOKENS = 8


@pytest.mark.parametrize(
    ("model_type", "plan", "options"),
    [
        ("qwen3_next", "2A2F", {"micro_batches": 2}),
        ("granitemoehybrid", "2A2F", {"router": "attn"}),
        ("lfm2_moe", "1A2F", {"ffn_parallel": "tp"}),
        sweep("qwen3_next", "1A1F", {"attention_tp": 2}),
    ],
)
def test_mixers_decode_incrementally_and_match_the_monolith(model_type, plan, options):
    """FFN sharding (EP, TP, router on the attention side), micro-batches and attention TP (the
    mixer whole on each TP rank) work unchanged on hybrids."""
    model = catalog.greedy(model_type)
    ids, mask = catalog.left_padded(model.config.vocab_size)
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=mask).logits
    expected = model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS)
    dm = afdc.disaggregate(model, plan, **options)
    report = dm.report()
    assert not report.decode_recomputes and dm.incremental
    program = dm.attention.shards[0] if options.get("attention_tp") else dm.attention
    graph_sites = [c.slot for c in MixerCall.all_in(program.module.graph)]
    assert graph_sites == [m.slot for m in report.mixers] and graph_sites
    assert all(m.state and m.layer is not None for m in report.mixers)
    assert report.mixer_state_bytes == sum(t.bytes for m in report.mixers for t in m.state) > 0
    assert "stateful mixers" in str(report)
    if options.get("attention_tp"):
        assert "whole on every TP rank" in str(report)

    valid = mask.bool()
    out = dm(ids, attention_mask=mask).logits
    assert (out[valid] - ref[valid]).abs().max() <= 1e-4 * ref[valid].abs().max()
    assert torch.equal(dm.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS), expected)


def test_chunked_prefill_continues_from_the_state():
    """Prefill in two chunks against one cache gives the logits of one prefill: the second chunk
    reads the convolution window and recurrent state the first left."""
    model = catalog.greedy("qwen3_next")
    ids, mask = catalog.left_padded(model.config.vocab_size)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    dm = afdc.disaggregate(model, "1A1F")
    caches = {(0, 0): kv_cache.KVCache()}  # the one attention rank's one micro-batch, as dm.generate keeps it
    with torch.no_grad():
        whole = model(input_ids=ids, attention_mask=mask).logits
        first = dm._run(ids[:, :7], mask[:, :7], positions[:, :7], caches).logits
        second = dm._run(ids[:, 7:], mask, positions[:, 7:], caches).logits
    got = torch.cat([first, second], dim=1)
    valid = mask.bool()
    assert (got[valid] - whole[valid]).abs().max() <= 1e-4 * whole[valid].abs().max()


def test_mixers_across_processes_over_shm():
    model = catalog.greedy("bamba")
    ids, mask = catalog.left_padded(model.config.vocab_size, rows=2)
    expected = model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS)
    dm = afdc.disaggregate(model, "1A2F", connector="shm")
    with dm.launch(timeout=60):
        for m in (1, 2):  # m = 2: the micro-batches take turns in one thread, each with its own state
            dm.micro_batches = m
            assert torch.equal(dm.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS), expected), m


def test_artifact_records_mixer_state_and_decodes_incrementally(tmp_path):
    model = catalog.greedy("qwen3_next")
    src = tmp_path / "src"
    model.save_pretrained(src)
    ids, mask = catalog.left_padded(model.config.vocab_size, rows=2)
    expected = model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS)
    plan = afdc.Plan.parse("1A2F", micro_batches=2)  # two threads share the rebuilt mixer modules
    manifest = afdc.compile_model(str(src), plan, tmp_path / "art", progress=False)
    assert manifest.incremental_decode and manifest.mixers
    site = manifest.mixers[0]
    cfg = model.config
    keys = cfg.linear_num_key_heads * cfg.linear_key_head_dim
    values = cfg.linear_num_value_heads * cfg.linear_value_head_dim
    conv = 2 * keys + values  # q, k and v go through the short convolution
    by_name = {t.name: t for t in site.state}
    assert by_name["conv.0"].shape == (conv, cfg.linear_conv_kernel_dim)
    assert by_name["recurrent.0"].shape == (
        cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    )
    assert read_manifest(tmp_path / "art").mixers == manifest.mixers  # round trip through JSON
    dm = afdc.load_deployment(tmp_path / "art")
    assert torch.equal(dm.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS), expected)


def test_pure_state_space_models_stay_refused():
    model = catalog.build_type("mamba", {**catalog.TINY_COMMON, **catalog.REFUSED_OVERRIDES["mamba"]})
    with pytest.raises(afdc.UnsupportedModelError, match="pure sequence-mixer"):
        afdc.disaggregate(model)


@pytest.mark.parametrize(("model_type", "tp"), [("granitemoehybrid", 1), ("granitemoehybrid", 2), ("minimax", 1)])
def test_paged_steps_keep_each_requests_state(model_type, tp):
    """vLLM-style steps (prefill chunks, a new request joining, batched decodes) over a paged KV
    cache and one state block per request, as the serving worker runs them, against transformers;
    under --attn-tp 2 too (each TP rank runs the mixers whole, on its own view of the step), and
    for MiniMax, whose lightning attention keeps its state in a cache class of its own.
    A step run twice before its state is committed (an FFN rank lost mid-step) gives the same."""
    model = catalog.greedy(model_type)
    dm = afdc.disaggregate(model, "1A1F", attention_tp=tp)
    program = dm.attention
    shards = program.shards if tp > 1 else [program]
    slots = attention_slots(afdc.disaggregate(model, "1A1F").attention.module.graph)  # every TP rank's heads
    for shard in shards:
        positions_as_cache_positions(shard.module.graph)
        shard.module.recompile()
    program.use_backend("eager")  # lowered again from the rewritten graphs
    sites = dm.report().mixers
    store = PagedKVStore(slots, 16, 4, tp_ranks=tp)
    states = MixerStateStore(sites, 16)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 128, (n,), generator=gen).tolist() for n in (9, 6, 7)]
    requests = [{"tokens": list(p), "prompt": len(p), "blocks": [4 * i + j for j in range(4)], "state": 12 + i,
                 "done": 0} for i, p in enumerate(prompts)]  # fmt: skip
    link = connectors.LoopbackConnector(functools.partial(combine, dm.ffn_ranks))

    def step(schedule: dict[int, int], again: bool = False) -> None:
        reqs = [requests[i] for i in schedule]
        ids = torch.tensor([t for r, n in zip(reqs, schedule.values()) for t in r["tokens"][r["done"]:r["done"] + n]])
        blocks = {s.slot: torch.tensor([r["state"] for r in reqs]) for s in sites}
        lens, done = torch.tensor(list(schedule.values())), torch.tensor([r["done"] for r in reqs])
        batch = PagedBatch(store, torch.tensor([r["blocks"] for r in reqs]), done, lens, states, blocks)
        with torch.no_grad(), connectors.active(link), kv_cache.active(batch):
            logits = program(ids[None], torch.ones_like(ids)[None], batch.positions).logits[0]
            if again:
                repeated = program(ids[None], torch.ones_like(ids)[None], batch.positions).logits[0]
                torch.testing.assert_close(repeated, logits)
        batch.commit_states()
        for r, n, last in zip(reqs, schedule.values(), torch.tensor(list(schedule.values())).cumsum(0) - 1):
            r["done"] += n
            if r["done"] == len(r["tokens"]):
                r["tokens"].append(int(logits[last].argmax()))

    step({0: 5, 1: 6})  # A's prefill in two chunks
    step({0: 4, 1: 1, 2: 7}, again=True)
    for _ in range(3):
        step({0: 1, 1: 1, 2: 1})
    _assert_tokens_of_each_alone(model, requests)


@pytest.mark.parametrize("model_type", ["deepseek_v32", sweep("hy_v4")])
def test_sparse_attention_indexer_keys_are_cached(tmp_path, model_type):
    """DeepSeek-V3.2-style sparse attention: the indexer's keys are kept beside the KV cache
    (``afdc::cached_keys``), so decode feeds one token a step and still picks the same keys; the
    compiled artifact is servable (its paged steps: ``test_paged_rows_pick_each_requests_keys``)."""
    model = catalog.greedy(model_type)
    ids, mask = catalog.left_padded(model.config.vocab_size)
    expected = model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS)
    dm = afdc.disaggregate(model, "1A2F")
    assert dm.incremental, dm.report().decode_recomputes
    graph = dm.attention.module.graph
    assert graph.find_nodes(op="call_function", target=torch.ops.afdc.cached_keys.default)
    assert torch.equal(dm.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS), expected)

    model.save_pretrained(tmp_path / "src")
    manifest = afdc.compile_model(str(tmp_path / "src"), "1A1F", tmp_path / "art", progress=False)
    assert manifest.incremental_decode and not manifest.unpageable
    check_servable(manifest)


@pytest.mark.parametrize("tp", [sweep(1), 2])
def test_paged_rows_pick_each_requests_keys(tp):
    """vLLM-style steps of a DeepSeek-V3.2-style model as the serving worker runs them
    (:class:`PagedRows`): prefills alone, then decodes of requests with different context lengths
    as the rows of one left-padded batch, the indexer's keys in paged blocks beside K and V; under
    --attn-tp 2 too (each TP rank its heads, the indexer's one key head shared). Each request's
    tokens equal transformers' ``generate`` of it alone (the indexer picks 4 of up to 32 keys, so a
    key taken from another row or a padded slot would show)."""
    model = catalog.greedy("deepseek_v32")
    dm = afdc.disaggregate(model, "1A1F", attention_tp=tp)
    with pytest.raises(afdc.UnsupportedModelError, match="computed from the hidden states"):
        attention_slots(afdc.disaggregate(model).attention.module.graph)  # a flat batch cannot rebuild them
    slots, keys = program_slots(dm.attention.module)
    assert [k.head_dim for k in keys] == [model.config.index_head_dim] * model.config.num_hidden_layers
    slots = [replace(s, kv_heads=s.kv_heads * tp) for s in slots]  # the TP ranks' heads side by side
    store, key_store = PagedKVStore(slots, 24, 8, tp_ranks=tp), PagedKVStore(keys, 24, 8)
    gen = torch.Generator().manual_seed(3)
    requests = [{"tokens": torch.randint(3, 128, (n,), generator=gen).tolist(), "prompt": n,
                 "blocks": [6 * i + j for j in range(6)], "done": 0} for i, n in enumerate((12, 9, 20))]  # fmt: skip
    link = connectors.LoopbackConnector(functools.partial(combine, dm.ffn_ranks))

    def step(which: list[int], tokens: int) -> None:
        reqs = [requests[i] for i in which]
        ids = torch.tensor([r["tokens"][r["done"]:r["done"] + tokens] for r in reqs])
        table, done = torch.tensor([r["blocks"] for r in reqs]), torch.tensor([r["done"] for r in reqs])
        rows = PagedRows(store, table, done, tokens, key_store)
        with torch.no_grad(), connectors.active(link), kv_cache.active(rows):
            logits = dm.attention(ids, rows.attention_mask, rows.positions).logits[:, -1]
        for r, row in zip(reqs, logits):
            r["done"] += tokens
            if r["done"] == len(r["tokens"]):
                r["tokens"].append(int(row.argmax()))

    step([0], 7)
    step([0], 5)  # a chunk continuing from the cached keys
    step([1], 9)
    for _ in range(4):
        step([0, 1], 1)
    step([2], 20)
    for _ in range(12):
        step([0, 1, 2], 1)
    _assert_tokens_of_each_alone(model, requests)


class _ScaledMixer(torch.nn.Module):
    """A mixer taking a tensor besides the hidden states (as Bailing's linear attention takes the
    RoPE tables through ``**kwargs``), its state in a linear-attention cache layer."""

    layer_idx = 0

    def forward(self, hidden, cache=None, scale=None):
        return hidden * scale


def test_a_mixer_given_tensors_but_no_mask_runs_on_a_linear_attention_cache_layer():
    """Only a 4-D mask among a mixer's inputs is cut to the keys its cache layer holds; other
    tensors pass as they are, whatever the layer (a linear-attention layer sizes no keys)."""
    entry = catalog.entry("qwen3_next")
    config = AutoConfig.for_model(entry.model_type, **entry.config_kwargs)
    site = MixerSite(slot=0, module="mixer", weights=(), cache_argument="cache", mask_argument=None, width=4,
                     layer=0, inputs=("scale",))
    mixers = Mixers([site], {0: _ScaledMixer()}, config)
    assert type(mixers.new_state().layers[0]).__name__ == "LinearAttentionLayer"
    hidden, scale = torch.randn(2, 3, 4), torch.randn(2, 3, 1)
    torch.testing.assert_close(mixers.mix(0, hidden, None, [scale]), hidden * scale)


@pytest.mark.parametrize("model_type", ["qwen3_next", "bamba", "minimax"])
def test_a_left_padded_row_keeps_the_state_of_the_unpadded_row(model_type):
    """Padding is masked as the model masks it: a left-padded row's logits and greedy tokens
    equal those of the same row run alone without padding."""
    dm = afdc.disaggregate(catalog.greedy(model_type), "1A1F")
    ids, mask = catalog.left_padded(dm.config.vocab_size)
    batch = dm.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS)
    with torch.no_grad():
        logits = dm(ids, attention_mask=mask).logits[:, -1]
    for i in range(ids.shape[0]):
        row = ids[i : i + 1, int((mask[i] == 0).sum()):]
        assert torch.equal(batch[i, -NEW_TOKENS:], dm.generate(row, max_new_tokens=NEW_TOKENS)[0, -NEW_TOKENS:])
        with torch.no_grad():
            torch.testing.assert_close(logits[i], dm(row).logits[0, -1], atol=1e-5, rtol=1e-5)


def test_deepseek_v4_attention_with_compressors_is_one_stateful_mixer(tmp_path):
    """DeepSeek-V4's compressors keep a buffer and their compressed entries in the model's own
    cache layer, read directly: each attention (sliding window, compressors, indexer, sinks) is
    one mixer op, given the position ids, RoPE tables and mask besides the hidden states, its keys
    kept in that cache. Its hyper-connections stay per position and its hash-routed layer routes
    by token id, the ids crossing with the hidden state. A 1A2F (EP) artifact gives the monolith's
    logits on a left-padded batch and its greedy tokens, decode incremental (the prefill outgrows
    the sliding window and closes several compressed windows), and is servable (its paged steps:
    ``test_deepseek_v4_paged_rows_keep_each_requests_bounded_state``; served:
    ``test_serve_mixers``). (2A2F in-process: ``test_models_supported``.)"""
    model = catalog.greedy("deepseek_v4")
    experts, k = model.config.n_routed_experts, model.config.num_experts_per_tok
    tables = [m.tid2eid for m in model.modules() if hasattr(m, "tid2eid")]
    assert tables
    gen = torch.Generator().manual_seed(3)
    for table in tables:  # as a checkpoint's: k distinct experts per token id (the tiny model's are all 0)
        table.copy_(torch.stack([torch.randperm(experts, generator=gen)[:k] for _ in range(table.shape[0])]))
    ids, mask = catalog.left_padded(model.config.vocab_size)
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=mask).logits
    expected = model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS)

    model.save_pretrained(tmp_path / "src")
    manifest = afdc.compile_model(str(tmp_path / "src"), "1A2F", tmp_path / "art", progress=False)
    assert manifest.incremental_decode
    assert [m.module for m in manifest.mixers] == [f"model.layers.{i}.self_attn" for i in range(2)]
    assert all(not m.fixed_state and "position_ids" in m.inputs for m in manifest.mixers)
    assert read_manifest(tmp_path / "art").mixers == manifest.mixers  # inputs round trip through JSON
    # the hash-routed layer sends its token ids with the hidden state; the lookup of their experts
    # and the sort and offsets of those run on the FFN side, with the experts
    hidden = model.config.hidden_size
    hashed, routed = manifest.layers
    assert [c.dtype for c in hashed.to_ffn] == ["float32", "int64"] and hashed.to_ffn[0].shape_per_token == [hidden]
    assert [c.shape_per_token for c in routed.to_ffn] == [[hidden]]
    # the FFN side indexes its token-id table with the ids it receives: it takes only ids of the
    # vocabulary (the server checks them), in the manifest and in the program loaded from it
    bounds = [manifest.segments[lay.segment].index_bounds for lay in manifest.layers]
    assert bounds == [[IndexBound(1, model.config.vocab_size)], []]
    assert [read_manifest(tmp_path / "art").segments[lay.segment].index_bounds for lay in manifest.layers] == bounds
    dm = afdc.load_deployment(tmp_path / "art")
    assert [list(ffn.dispatch(i).index_bounds) for ffn in dm.ffn_ranks for i in range(2)] == bounds * 2
    valid = mask.bool()
    out = dm(ids, attention_mask=mask).logits
    assert (out[valid] - ref[valid]).abs().max() <= 1e-4 * ref[valid].abs().max()
    assert torch.equal(dm.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS), expected)
    assert not manifest.unpageable
    check_servable(manifest)


def test_a_mixer_state_serving_cannot_bound_is_refused_at_compile(tmp_path):
    """ZAYA1's attention is a stateful mixer whose cache layer keeps every key and value (beside its
    convolution window): serving's fixed-size state blocks know no bound for it, so the artifact
    says why and ``afdc serve`` refuses it before vLLM starts; in process it decodes as its monolith."""
    model = catalog.greedy("zaya")
    ids, mask = catalog.left_padded(model.config.vocab_size)
    expected = model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS)
    model.save_pretrained(tmp_path / "src")
    manifest = afdc.compile_model(str(tmp_path / "src"), "1A2F", tmp_path / "art", progress=False)
    assert "ZayaAttention keeps state that grows with the sequence" in manifest.unpageable
    with pytest.raises(afdc.UnsupportedModelError, match=r"ZayaAttention .* cannot run on a paged KV cache"):
        check_servable(manifest)
    dm = afdc.load_deployment(tmp_path / "art")
    assert torch.equal(dm.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS), expected)


def test_deepseek_v4_paged_rows_keep_each_requests_bounded_state():
    """DeepSeek-V4 at 1A1F in-process: the monolith's logits on a left-padded batch and its greedy
    tokens. Then its growing attention state in fixed-size state blocks sized from the longest
    sequence (:mod:`afdc.runtime.bounded_state`), over vLLM-style steps as the serving worker runs
    them (:class:`PagedRows`): prefills in chunks, decodes of requests with different lengths
    (run together where they ran as many tokens), a step run twice before its state is committed,
    and a request recomputed from its tokens (vLLM's preemption). Each request's tokens equal
    transformers' ``generate`` of it alone."""
    model = catalog.greedy("deepseek_v4")
    ids, mask = catalog.left_padded(model.config.vocab_size)
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=mask).logits
    expected = model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS)
    dm = afdc.disaggregate(model, "1A1F")
    assert dm.incremental
    valid = mask.bool()
    out = dm(ids, attention_mask=mask).logits
    assert (out[valid] - ref[valid]).abs().max() <= 1e-4 * ref[valid].abs().max()
    assert torch.equal(dm.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS), expected)
    sites = dm.attention.mixers.bound(64, torch.float32)
    rates = model.config.compress_rates
    entries = {s.name: s.shape[0] for m in sites for s in m.state if s.name.startswith("compressed_kv")}
    assert entries == {"compressed_kv.compressor": 64 // rates["compressed_sparse_attention"],
                       "compressed_kv.indexer": 64 // rates["compressed_sparse_attention"]}
    assert all(s.shape == (1, model.config.sliding_window - 1, model.config.head_dim)
               for m in sites for s in m.state if s.name == "keys")
    store, states = PagedKVStore([], 1, 16), MixerStateStore(sites, 8)
    gen = torch.Generator().manual_seed(3)
    requests = [{"tokens": torch.randint(3, 128, (n,), generator=gen).tolist(), "prompt": n, "block": 2 + i,
                 "done": 0} for i, n in enumerate((13, 9, 9))]  # fmt: skip
    link = connectors.LoopbackConnector(functools.partial(combine, dm.ffn_ranks))

    def step(which: list[int], tokens: int, again: bool = False) -> None:
        reqs = [requests[i] for i in which]
        ids = torch.tensor([r["tokens"][r["done"]:r["done"] + tokens] for r in reqs])
        done, blocks = torch.tensor([r["done"] for r in reqs]), torch.tensor([r["block"] for r in reqs])
        rows = PagedRows(store, torch.zeros(len(reqs), 0), done, tokens, None, None, states,
                         {s.slot: blocks for s in sites})
        with torch.no_grad(), connectors.active(link), kv_cache.active(rows):
            logits = dm.attention(ids, rows.attention_mask, rows.positions).logits[:, -1]
            if again:
                torch.testing.assert_close(dm.attention(ids, rows.attention_mask, rows.positions).logits[:, -1], logits)
        rows.commit_states()
        for r, row in zip(reqs, logits):
            r["done"] += tokens
            if r["done"] == len(r["tokens"]):
                r["tokens"].append(int(row.argmax()))

    step([0], 6)
    step([0], 7, again=True)  # a chunk continuing from the state: a window closes across the chunks
    step([1], 9)
    step([2], 9)
    for _ in range(5):
        step([0, 1, 2], 1)  # rows 1 and 2 ran as many tokens: one group; row 0 another
    requests[2]["done"] = 0  # preempted: recomputed from its tokens, its state from empty
    step([2], len(requests[2]["tokens"]) - 1)
    for _ in range(6):
        step([0, 1, 2], 1)
    _assert_tokens_of_each_alone(model, requests)


def _assert_tokens_of_each_alone(model, requests: list[dict]) -> None:
    """Each request's tokens (its prompt, then what the steps sampled) equal transformers'
    ``generate`` of its prompt alone."""
    for r in requests:
        prompt = torch.tensor([r["tokens"][: r["prompt"]]])
        new = len(r["tokens"]) - r["prompt"]
        assert r["tokens"] == model.generate(prompt, max_new_tokens=new)[0].tolist()


def test_bounded_state_round_trips_every_deepseek_v4_cache_layer():
    """Each kind of DeepSeek-V4 cache layer (sliding window only, as the released configs' first
    layers; CSA with its indexer; HCA) packed into the fixed tensors serving holds, after prefills
    that end inside a window, on a window's edge and past the sliding window, and unpacked into a
    fresh cache: the model's next tokens' logits are those of the cache it came from."""
    kwargs = {**catalog.entry("deepseek_v4").config_kwargs, "mlp_layer_types": ["hash_moe", "moe", "moe"],
              "layer_types": ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"]}
    model = catalog.build_type("deepseek_v4", {**catalog.TINY_COMMON, **kwargs, "num_hidden_layers": 3})
    attentions = [layer.self_attn for layer in model.model.layers]
    ids = torch.randint(3, 128, (2, 30), generator=torch.Generator().manual_seed(5))
    for n in (6, 8, 21):
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            model(ids[:, :n], cache=cache)
        held = [BoundedState(a, layer, 64, torch.float32) for a, layer in zip(attentions, cache.layers)]
        assert [type(layer).__name__ for layer in cache.layers] == [
            "DynamicSlidingWindowLayer", "DeepseekV4CSACache", "DeepseekV4HCACache"]
        fresh = DynamicCache(config=model.config)
        for state, old, new in zip(held, cache.layers, fresh.layers):
            packed = state.pack(old)
            assert [tuple(t.shape[1:]) for t in packed] == [t.shape for t in state.tensors]
            state.unpack(new, packed, n)
        with torch.no_grad():
            expected = model(ids[:, n:n + 5], cache=cache).logits
            got = model(ids[:, n:n + 5], cache=fresh).logits
        torch.testing.assert_close(got, expected)
