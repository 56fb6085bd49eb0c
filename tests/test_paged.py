"""The paged KV cache: per-request attention over a flat batch, against contiguous attention and
against the Hugging Face model, driven the way a vLLM worker drives the attention program."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.masking_utils import (
    causal_mask_function,
    chunked_causal_mask_function,
    sliding_window_causal_mask_function,
)

import afdc
from afdc.lowering.attention_slots import attention_slots
from afdc.lowering.cache_positions import positions_as_cache_positions
from afdc.lowering.sampled_rows import sample_rows_only
from afdc.ops import AttentionCall, SlotSpec, reference_attention
from afdc.runtime import kv_cache
from afdc.runtime import link as connectors
from afdc.runtime.paged import PagedBatch, PagedKVStore
from afdc.runtime.programs import combine

HQ, HK, D = 4, 2, 8
BLOCK = 4
SPECS = [SlotSpec(HK, D, 8), SlotSpec(HK, D, 6, window=3), SlotSpec(HK, D, 8, window=4, chunked=True)]


def _hf_mask(spec: SlotSpec, context: int, n: int) -> torch.Tensor:
    """The mask transformers builds for ``n`` queries after ``context`` cached tokens."""
    if spec.chunked:
        fn = chunked_causal_mask_function(spec.window, torch.zeros(1, dtype=torch.long))
    elif spec.window:
        fn = sliding_window_causal_mask_function(spec.window)
    else:
        fn = causal_mask_function
    return fn(0, 0, torch.arange(context, context + n)[:, None], torch.arange(context + n)[None, :])[None, None]


@pytest.mark.parametrize("softcap,sinks", [(0.0, False), (5.0, True)])
def test_paged_attention_matches_contiguous(softcap, sinks):
    """Chunked prefill, decodes, and a prefix-cache hit with copy-on-write of a partly shared block,
    over shuffled blocks of a store whose unwritten memory is NaN."""
    gen = torch.Generator().manual_seed(0)
    num_blocks = 20
    kv = [
        tuple(torch.full((num_blocks, BLOCK, s.kv_heads, dim), float("nan")) for dim in (s.head_dim, s.value_dim))
        for s in SPECS
    ]
    store = PagedKVStore(SPECS, num_blocks, BLOCK, kv=kv)
    free = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()  # block 0 stays NaN
    lengths = {"A": 14, "B": 10, "C": 12, "D": 14}
    blocks = {r: [free.pop() for _ in range(-(-n // BLOCK))] for r, n in lengths.items() if r != "D"}
    # D's first 10 tokens are A's: it shares A's first full blocks and copies A's third one
    blocks["D"] = [*blocks["A"][:2], free.pop(), free.pop()]
    truth = {  # per slot, per request: contiguous [1, HK, L, d] keys and values
        slot: {
            r: [torch.randn(1, HK, n, dim, generator=gen) for dim in (s.head_dim, s.value_dim)]
            for r, n in lengths.items()
        }
        for slot, s in enumerate(SPECS)
    }
    for slot in truth:
        for i in range(2):
            truth[slot]["D"][i][:, :, :10] = truth[slot]["A"][i][:, :, :10]
    scale = D**-0.5
    sink = torch.randn(HQ, generator=gen) if sinks else None
    done = dict.fromkeys(lengths, 0)

    def step(schedule: dict[str, int]):
        reqs = list(schedule)
        width = max(len(blocks[r]) for r in reqs)
        table = torch.tensor([blocks[r] + [-1] * (width - len(blocks[r])) for r in reqs])
        batch = PagedBatch(store, table, torch.tensor([done[r] for r in reqs]), torch.tensor(list(schedule.values())))
        t = batch.num_tokens
        assert batch.positions.tolist() == [[done[r] + i for r in reqs for i in range(schedule[r])]]
        flat_mask = torch.ones(1, 1, t, t, dtype=torch.bool).tril()  # what the graph passes: ignored
        for slot, spec in enumerate(SPECS):
            qs = {r: torch.randn(1, HQ, n, D, generator=gen) for r, n in schedule.items()}
            k, v = (
                torch.cat([truth[slot][r][i][:, :, done[r] : done[r] + n] for r, n in schedule.items()], 2)
                for i in (0, 1)
            )
            out = batch.attend(slot, torch.cat(list(qs.values()), dim=2), k, v, flat_mask, scale, softcap, sink, 0)
            assert out.shape == (1, t, HQ, spec.value_dim)
            start = 0
            for r, n in schedule.items():
                end = done[r] + n
                keys, values = (x[:, :, :end] for x in truth[slot][r])
                want = reference_attention(qs[r], keys, values, _hf_mask(spec, done[r], n), scale, softcap, sink)
                torch.testing.assert_close(out[:, start : start + n], want, atol=1e-5, rtol=1e-5)
                start += n
        for r, n in schedule.items():
            done[r] += n

    step({"A": 5, "B": 8})  # A's prefill in two chunks
    step({"A": 6, "B": 1, "C": 12})
    store.copy_blocks([(blocks["A"][2], blocks["D"][2])])
    done["D"] = 10  # the prefix-cache hit
    step({"D": 3, "A": 1, "B": 1})
    step({"A": 1, "D": 1})
    step({"A": 1})
    assert done == {"A": 14, "B": 10, "C": 12, "D": 14}


def test_store_blocks_and_checks():
    store = PagedKVStore(SPECS[:2], 6, BLOCK)
    for t in (*store.keys, *store.values):
        t.copy_(torch.randn(t.shape))
    before = [t.clone() for t in (*store.keys, *store.values)]
    store.copy_blocks(torch.tensor([[1, 4], [4, 2]]))  # sources are read before any write
    store.zero_blocks([0])
    for old, new in zip(before, (*store.keys, *store.values)):
        assert torch.equal(new[4], old[1]) and torch.equal(new[2], old[4])
        assert torch.equal(new[0], torch.zeros_like(new[0]))
        assert torch.equal(new[[1, 3, 5]], old[[1, 3, 5]])
    with pytest.raises(ValueError, match="expected"):
        PagedKVStore(SPECS[:1], 6, BLOCK, kv=[(torch.zeros(6, BLOCK, HK, D), torch.zeros(6, BLOCK, HK, 6))])
    with pytest.raises(ValueError, match="do not hold them"):
        PagedBatch(store, torch.tensor([[0]]), torch.tensor([3]), torch.tensor([2]))


# -- the whole model, served ----------------------------------------------------------------------

_TINY = dict(
    vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=8, max_position_embeddings=128, pad_token_id=0, bos_token_id=1, eos_token_id=2,
)  # fmt: skip
MODELS = {
    "llama": {},
    # sliding window 4 on alternate layers, attention and final logit soft-capping
    "gemma2": {"sliding_window": 4, "query_pre_attn_scalar": 8},
    # chunked attention (chunks of 4) on alternate layers, MoE; NoPE layers whose query temperature
    # grows with the cache position from floor_scale on
    "llama4_text": {"attention_chunk_size": 4, "num_local_experts": 4, "num_experts_per_tok": 1,
                    "intermediate_size_mlp": 64, "interleave_moe_layer_step": 2, "no_rope_layer_interval": 2,
                    "floor_scale": 3, "attn_scale": 1.0},
}  # fmt: skip


@functools.cache
def _served(model_type: str):
    torch.manual_seed(0)
    cfg = AutoConfig.for_model(model_type, **_TINY, **MODELS[model_type])
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    return model, afdc.disaggregate(model, plan="1A1F")


class _Request:
    def __init__(self, prompt: list[int], blocks: list[int]):
        self.tokens = list(prompt)
        self.prompt = len(prompt)
        self.blocks = blocks
        self.done = 0  # tokens in the cache
        self.logits: list[torch.Tensor] = []  # at each step that ended at its last known token


def _step(dm, program, store: PagedKVStore, schedule: dict[_Request, int]) -> None:
    """One engine step of ``program`` over the flat batch of ``schedule``'s tokens; greedy next
    tokens. A program with ``afdc::sampled_rows`` returns the requests' last rows only."""
    rows_only = bool(program.module.graph.find_nodes(op="call_function", target=torch.ops.afdc.sampled_rows.default))
    reqs = list(schedule)
    ids = torch.tensor([t for r, n in schedule.items() for t in r.tokens[r.done : r.done + n]])
    width = max(len(r.blocks) for r in reqs)
    table = torch.tensor([r.blocks + [0] * (width - len(r.blocks)) for r in reqs])
    lens = torch.tensor(list(schedule.values()))
    batch = PagedBatch(store, table, torch.tensor([r.done for r in reqs]), lens)
    link = connectors.LoopbackConnector(functools.partial(combine, dm.ffn_ranks))
    with torch.no_grad(), connectors.active(link), kv_cache.active(batch):
        logits = program(ids[None], torch.ones_like(ids)[None], batch.positions).logits[0]
    assert logits.shape[0] == (len(reqs) if rows_only else len(ids))
    for i, (r, last) in enumerate(zip(reqs, (lens.cumsum(0) - 1).tolist())):
        r.done += schedule[r]
        if r.done == len(r.tokens):
            row = logits[i if rows_only else last]
            r.logits.append(row)
            r.tokens.append(int(row.argmax()))


@pytest.mark.parametrize(("model_type", "rows_only"), [(m, m == "gemma2") for m in MODELS] + [("llama", True)])
def test_served_model_matches_transformers(model_type, rows_only):
    """vLLM-style steps (chunked prefill, prefix sharing, decode) against transformers; with
    ``rows_only`` the LM head runs on each request's last token only (the serving worker's
    program, gemma2's soft-capping after it included)."""
    model, dm = _served(model_type)
    program = copy.deepcopy(dm.attention_ranks[0])
    if rows_only:
        assert sample_rows_only(program.module, program.out_spec)
    # as the worker: each request's tokens at their own cache positions (llama4's NoPE temperature)
    positions_as_cache_positions(program.module.graph)
    program.module.recompile()
    slots = attention_slots(dm.attention.module.graph)
    window = {"llama": 0, "gemma2": 4, "llama4_text": 4}[model_type]
    assert [(s.window, s.chunked) for s in slots] == [(window, model_type == "llama4_text"), (0, False)]
    _check_steps(model, functools.partial(_step, dm, program), PagedKVStore(slots, 16, BLOCK))


def test_served_model_with_attention_tp():
    """The same steps with --attn-tp 2, as the worker runs them: each TP rank writes and reads its
    own heads of one paged store, and only its last rows reach the LM head."""
    model, whole = _served("llama")
    dm = afdc.disaggregate(model, plan="1A1F", attention_tp=2)
    program = dm.attention
    assert all(sample_rows_only(shard.module, shard.out_spec) for shard in program.shards)
    store = PagedKVStore(attention_slots(whole.attention.module.graph), 16, BLOCK, tp_ranks=2)
    assert [s.kv_heads for s in store.tp_shard(1).slots] == [s.kv_heads // 2 for s in store.slots]
    _check_steps(model, functools.partial(_step, dm, program), store)


def _check_steps(model, step, store: PagedKVStore) -> None:
    gen = torch.Generator().manual_seed(1)
    free = torch.randperm(16, generator=gen).tolist()
    prompts = {n: torch.randint(3, 128, (n,), generator=gen).tolist() for n in (9, 6, 7)}
    a, b, c = (_Request(p, [free.pop() for _ in range(4)]) for p in prompts.values())
    step(store, {a: 5, b: 6})  # A's prefill in two chunks
    step(store, {a: 4, b: 1, c: 7})
    # D shares A's first 6 tokens: A's first block, and a copy of its second (D overwrites its end)
    d = _Request([*a.tokens[:6], 7, 8, 9, 10], [a.blocks[0], free.pop(), free.pop(), free.pop()])
    store.copy_blocks([(a.blocks[1], d.blocks[1])])
    d.done = 6
    step(store, {a: 1, b: 1, c: 1, d: 4})
    for _ in range(2):
        step(store, {r: 1 for r in (a, b, c, d)})

    for r in (a, b, c, d):
        new = len(r.tokens) - r.prompt
        prompt = torch.tensor([r.tokens[: r.prompt]])
        assert r.tokens == model.generate(prompt, max_new_tokens=new, do_sample=False)[0].tolist()
        with torch.no_grad():
            want = [model(torch.tensor([r.tokens[: r.prompt + i]])).logits[0, -1] for i in range(new)]
        torch.testing.assert_close(torch.stack(r.logits), torch.stack(want), atol=1e-4, rtol=1e-4)


def test_refusals():
    _, dm = _served("gemma2")
    graph = dm.attention.module.graph
    call = AttentionCall.all_in(graph)[0]
    node, args = call.node, call.node.args

    def changed(name: str, value) -> tuple:
        i = AttentionCall.position(name)
        return (*args[:i], value, *args[i + 1 :])

    try:
        node.args = changed("slot", -1)
        with pytest.raises(afdc.UnsupportedModelError, match="no cache slot"):
            attention_slots(graph)
        node.args = changed("window", 3)  # a sliding window of 4 in the mask, 3 on the op
        with pytest.raises(afdc.UnsupportedModelError, match="cannot reproduce"):
            attention_slots(graph)
    finally:
        node.args = args
    # a mask computed from the tokens (as a sparse-attention indexer's is), even one whose probe
    # would look causal
    ids = next(n for n in graph.find_nodes(op="placeholder") if n.target == "input_ids")
    with graph.inserting_before(node):
        chosen = graph.call_function(torch.ops.aten.ne.Scalar, (ids, -1))
        picked = graph.call_function(torch.ops.aten.logical_and.default, (call.mask, chosen))
    node.args = changed("mask", picked)
    try:
        with pytest.raises(afdc.UnsupportedModelError, match="computed from the hidden states"):
            attention_slots(graph)
    finally:
        node.args = args
        graph.erase_node(picked)
        graph.erase_node(chosen)
    empty = torch.fx.Graph()
    empty.output(empty.placeholder("input_ids"))
    with pytest.raises(afdc.UnsupportedModelError, match="no afdc attention op"):
        attention_slots(empty)
