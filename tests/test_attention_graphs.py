"""The attention decode step at static shapes (afdc.runtime.decode_graphs) on a CPU: the same
buckets, buffers, padding, pieces and dispatch as on a GPU, without the CUDA graphs."""

from __future__ import annotations

import copy
import functools
import itertools
import logging

import torch
import torch.fx as fx
from quant_checkpoints import qwen3_moe_fp8
from transformers import LlamaConfig, LlamaForCausalLM, LogitsProcessorList

import afdc
from afdc.lowering.piecewise import split_at_exchange
from afdc.ops import RecvCall, SendCall, SlotSpec
from afdc.runtime import link as connectors
from afdc.runtime.attention_rank import AttentionRank, MicroBatch
from afdc.runtime.decode_graphs import DecodeGraphs, _at_tokens, _Buffers, _RealRows, decoding
from afdc.runtime.flat_batches import prepare_for_flat_batches
from afdc.runtime.paged import PagedBatch, PagedKVStore
from afdc.runtime.programs import AttentionProgram
from afdc.segment import Dispatch

BLOCK, WIDTH = 4, 6  # a request holds up to 24 tokens


def test_buffers_pad_every_input_into_the_null_block():
    store = PagedKVStore([SlotSpec(1, 2, 8)], 8, BLOCK)
    one = torch.ones(3, dtype=torch.long)
    real = PagedBatch(store, torch.tensor([[3, 5], [6, 0], [2, 7]]), torch.tensor([5, 2, 7]), one)
    batch = MicroBatch(torch.tensor([[11, 12, 13]]), torch.ones(1, 3, dtype=torch.long), real.positions, real)
    assert decoding(batch)
    buffers = _Buffers.new(4, WIDTH, torch.device("cpu"))
    padded = buffers.fill(batch)
    c = padded.cache
    assert padded.input_ids.tolist() == [[11, 12, 13, 0]] and padded.input_ids is buffers.input_ids
    assert c.block_table[:3, :2].tolist() == [[3, 5], [6, 0], [2, 7]] and c.block_table.shape == (4, WIDTH)
    assert c.block_table[3].tolist() == [0] * WIDTH  # the padding row: the null block only
    assert c.context_lens.tolist() == [5, 2, 7, 0] and c.seq_lens.tolist() == [6, 3, 8, 1]
    assert padded.position_ids.tolist() == [[5, 2, 7, 0]]
    assert c.slot_mapping.tolist() == [*real.slot_mapping.tolist(), 0]  # the padding row writes slot 0 of block 0
    assert c.logit_rows.tolist() == [0, 1, 2, 3]
    for name in ("block_table", "context_lens", "seq_lens", "slot_mapping", "logit_rows"):
        assert getattr(c, name) is getattr(buffers, name)  # what a captured graph reads
    # prefill, a chunk and a step holding drafts run as they are
    prefill = PagedBatch(store, torch.tensor([[1, 2]]), torch.tensor([0]), torch.tensor([3]))
    assert not decoding(MicroBatch(torch.zeros(1, 3, dtype=torch.long), None, prefill.positions, prefill))


def test_real_rows_reach_the_ffn_side_and_replies_are_padded():
    sent = {}

    def ffn(layer, tensors):
        sent[layer] = tensors
        return [tensors[0] * 2]

    dispatch = [Dispatch(("sum",), ([1, -1, 8],))]
    buffers = _Buffers.new(4, WIDTH, torch.device("cpu"))
    link = _RealRows(connectors.LoopbackConnector(ffn), 3, 4, dispatch, buffers)
    x = torch.arange(32.0).reshape(1, 4, 8)
    link.send(0, [x])
    out = link.recv(0, 0, (1, 4, 8), torch.float32)
    assert sent[0][0].shape == (1, 3, 8) and torch.equal(sent[0][0], x[:, :3])  # the padding row never goes
    assert out is buffers.received[0, 0] and torch.equal(out[:, :3], 2 * x[:, :3])
    assert link.traffic.to_ffn_bytes == 3 * 8 * 4  # what crossed: the real rows
    assert _at_tokens((1, 8, 16), 8, 5) == (1, 5, 16) and _at_tokens((16, 4), 16, 16) == (16, 4)


@functools.cache
def _model():
    """A tiny Llama and its 1A1F split (shared by the tests: none changes it for the next)."""
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = LlamaForCausalLM(cfg).eval()
    return model, afdc.disaggregate(model, plan="1A1F")


def _rank(dm, largest: int | None, graphs: bool = False) -> tuple[AttentionRank, list[SlotSpec]]:
    """Attention rank 0 with its program prepared as the vLLM worker prepares it, and its cache slots."""
    program = copy.deepcopy(dm.attention)
    slots = prepare_for_flat_batches(program, "eager", torch.device("cpu"), mixers=[]).slots
    dispatch = [dm.ffn.dispatch(i) for i in range(len(dm.ffn.layers))]
    rank = AttentionRank(0, program, dm.ffn_ranks, dispatch)
    if largest:
        rank.decode = DecodeGraphs(program, dispatch, largest, WIDTH, graphs)
    return rank, slots


def _batch(store, tokens, blocks, computed) -> MicroBatch:
    q = torch.tensor([len(t) for t in tokens])
    width = max(len(b) for b in blocks)
    table = torch.tensor([b + [0] * (width - len(b)) for b in blocks])
    paged = PagedBatch(store, table, torch.tensor(computed), q)
    ids = torch.tensor([t for row in tokens for t in row])[None]
    return MicroBatch(ids, torch.ones_like(ids), paged.positions, paged)


def _generate(rank: tuple[AttentionRank, list[SlotSpec]], prompts: list[list[int]], new: int, parts: int):
    """Greedy decoding of ``prompts`` as vLLM's worker steps it: one prefill step, then decode
    steps of every request, split into ``parts`` micro-batches. Returns the tokens, each step's
    logits of every request and the bytes sent to the FFN side."""
    rank, slots = rank
    store = PagedKVStore(slots, 1 + len(prompts) * WIDTH, BLOCK)
    blocks = [list(range(1 + i * WIDTH, 1 + (i + 1) * WIDTH)) for i in range(len(prompts))]  # block 0: null
    tokens, logits, sent = [list(p) for p in prompts], [], 0
    step = [list(p) for p in prompts]
    for i in range(new):
        computed = [len(t) - len(s) for t, s in zip(tokens, step)]
        cut = [0, *(len(prompts) * (k + 1) // parts for k in range(parts))] if i else [0, len(prompts)]
        batches = [_batch(store, step[a:b], blocks[a:b], computed[a:b]) for a, b in itertools.pairwise(cut) if b > a]
        outs, traffic = rank.run(0, batches)
        sent += traffic.to_ffn_bytes
        rows = torch.cat([o.logits[0] for o in outs])  # the LM head ran on each request's last token only
        assert rows.shape[0] == len(prompts)
        logits.append(rows)
        step = [[int(r.argmax())] for r in rows]
        for t, s in zip(tokens, step):
            t.extend(s)
    return tokens, logits, sent


def test_padded_decode_matches_the_monolith_and_sends_only_real_rows(caplog):
    """3 requests (not a bucket) decode as 4 in one micro-batch, then 2 + 1 in two: greedy
    tokens equal to transformers', logits equal to the unpadded step's; the FFN side hears the
    real rows only. 5 requests are above the largest bucket: unpadded, said once."""
    model, dm = _model()
    prompts = [[5, 9, 14, 3, 7], [22, 8, 41], [17, 2, 30, 11, 6, 19, 4]]
    padded, eager = _rank(dm, largest=4), _rank(dm, largest=None)
    for parts in (1, 2):
        tokens, logits, sent = _generate(padded, prompts, new=4, parts=parts)
        want_tokens, want_logits, want_sent = _generate(eager, prompts, new=4, parts=parts)
        assert tokens == want_tokens and sent == want_sent
        torch.testing.assert_close(torch.stack(logits), torch.stack(want_logits), atol=1e-5, rtol=1e-5)
    # the pieces a graph holds compute only; each send and receive is a piece of its own
    _, pieces = split_at_exchange(padded[0].program._staged().body.module)
    for piece in pieces:
        exchanged = [n for n in piece.module.graph.nodes if n.target in (SendCall.OP, RecvCall.OP)]
        assert (piece.exchange, len(exchanged)) in ((True, 1), (False, 0))
    assert sum(p.sends for p in pieces) == len(dm.ffn.layers) and not pieces[-1].exchange
    buckets = set(padded[0].decode._buffers)
    assert buckets == {(0, 4), (0, 1), (1, 2)}  # (micro-batch, bucket): 3 -> 4; 1 -> 1, 2 -> 2
    for prompt, row in zip(prompts, tokens):
        with torch.no_grad():
            want = model.generate(torch.tensor([prompt]), max_new_tokens=4, do_sample=False)[0].tolist()
        assert row == want
    with caplog.at_level(logging.WARNING, logger="afdc.decode_graphs"):
        _generate(padded, [*prompts, [1, 2], [3, 4]], new=3, parts=1)  # 2 decode steps of 5
        # graphs asked for where decode attention is not afdc's kernel (on a CPU): padded, no graph
        assert _generate(_rank(dm, largest=4, graphs=True), prompts, new=4, parts=2)[0] == tokens
    said = [r.getMessage() for r in caplog.records]
    assert sum("more than 4 requests" in m for m in said) == 1
    assert sum("is not afdc's kernel here" in m for m in said) == 1


def test_dm_generate_with_attention_graphs_equals_the_monolith():
    """dm.generate over the paged cache, 3 left-padded rows decoding as a bucket of 4: the
    monolith's greedy tokens; prefill is not padded, and use_attention_graphs(0) goes back."""
    model, dm = _model()
    ids = torch.tensor([[0, 0, 5, 9, 14, 3], [22, 8, 41, 7, 1, 2], [0, 0, 0, 17, 2, 30]])
    mask = (torch.arange(6) >= torch.tensor([2, 0, 3])[:, None]).long()
    with torch.no_grad():
        want = model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False)
    dm.use_attention_graphs(4, max_length=16, block_size=BLOCK)
    assert torch.equal(dm.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False), want)
    assert set(dm.ranks[0].decode._buffers) == {(0, 4)}  # decode only, 3 rows as 4
    dm.use_attention_graphs(0)
    assert dm.ranks[0].decode is None
    assert torch.equal(dm.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False), want)


def test_fp8_checkpoint_decodes_over_a_cache_in_its_activations_dtype(tmp_path):
    """Qwen3-MoE-shaped, attention fp8 in blocks (bf16 activations), its attention program's tensors
    held in another order, an fp8 weight first (the order its graph reads them in, which means
    nothing): the paged cache is bf16, not that weight's float8, and dm.generate over it has the
    monolith's (the dequantized checkpoint's) greedy tokens, each step's logits within 2% of the
    largest, on a left-padded batch."""
    ck = qwen3_moe_fp8(tmp_path / "qwen")
    afdc.compile_model(str(ck.directory), "1A1F", tmp_path / "art", progress=False)
    dm = afdc.load_deployment(tmp_path / "art")
    rank = dm.ranks[0]
    rank.program = _fp8_weight_first(rank.program)
    assert next(rank.program.parameters()).dtype == torch.float8_e4m3fn
    dm.use_attention_graphs(2, max_length=16, block_size=BLOCK)
    ids = torch.randint(3, 128, (2, 7), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    got, want = [], []
    kw = dict(attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0)
    tokens = dm.generate(ids, logits_processor=LogitsProcessorList([_Recorder(got)]), **kw)
    monolith = ck.reference.generate(ids, logits_processor=LogitsProcessorList([_Recorder(want)]), **kw)
    assert torch.equal(tokens, monolith)
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        torch.testing.assert_close(g, w, atol=0.02 * w.abs().max().item(), rtol=0, msg=f"step {step}")
    assert dm._paged.dtypes == [torch.bfloat16]


def _fp8_weight_first(program: AttentionProgram) -> AttentionProgram:
    """``program`` with its first float8 weight read first: a graph module holds its tensors in
    the order its graph reads them."""
    graph = program.module.graph
    fp8 = next(n for n in graph.find_nodes(op="get_attr")
               if program.module.get_parameter(n.target).dtype == torch.float8_e4m3fn)  # fmt: skip
    graph.find_nodes(op="placeholder")[-1].append(fp8)
    reordered = AttentionProgram(fx.GraphModule(program.module, graph), program.out_spec, program.mixers)
    reordered.use_backend(program.backend)
    return reordered


class _Recorder:
    """A logits processor that keeps each step's scores, changing nothing."""

    def __init__(self, steps: list[torch.Tensor]):
        self.steps = steps

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.steps.append(scores.float().clone())
        return scores
