"""The Triton paged decode-attention kernel against torch_paged_attention, on the same batches
(in Triton's interpreter on CPU), and a tiny llama served through it."""

from __future__ import annotations

import functools

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import afdc
from afdc.codegen import paged_attention
from afdc.lowering.attention_slots import attention_slots
from afdc.ops import SlotSpec
from afdc.runtime import kv_cache, paged
from afdc.runtime import link as connectors
from afdc.runtime.paged import (
    PagedBatch,
    PagedKVStore,
    kernel_paged_attention,
    register_paged_attention,
    torch_paged_attention,
)
from afdc.runtime.programs import combine

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
D, DV = 8, 6  # values narrower than keys, neither a power of two for DV
CONTEXTS = [0, 4, 11, 40]  # cached tokens before each request's decode token: 1 to 41 keys


def _decode_batch(
    spec: SlotSpec, contexts: list[int], block_size: int, dtype: torch.dtype, gen: torch.Generator, device=DEVICE
) -> PagedBatch:
    """A decode step over a store of random keys and values in shuffled blocks; block 0 and every
    position past a request's length hold NaN, which the kernel must never read."""
    lengths = [c + 1 for c in contexts]
    counts = [-(-n // block_size) for n in lengths]
    num_blocks = sum(counts) + 1
    kv = [
        (torch.randn(num_blocks, block_size, spec.kv_heads, dim, generator=gen) * 2).to(dtype)
        for dim in (spec.head_dim, spec.value_dim)
    ]
    store = PagedKVStore([spec], num_blocks, block_size, kv=[tuple(t.to(device) for t in kv)])
    ids = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    width = max(counts) + 1  # one spare column, padded with an invalid id
    table = torch.full((len(contexts), width), -1, dtype=torch.long)
    for r, (n, count) in enumerate(zip(lengths, counts)):
        blocks = [ids.pop() for _ in range(count)]
        table[r, :count] = torch.tensor(blocks)
        for t in (*store.keys, *store.values):
            t[blocks[-1], n - (count - 1) * block_size :] = float("nan")
    for t in (*store.keys, *store.values):
        t[0] = float("nan")
    return PagedBatch(store, table, torch.tensor(contexts), torch.ones(len(contexts), dtype=torch.long))


def _no_fallback(*args):
    raise AssertionError("the torch path ran instead of the kernel")


def _check(
    monkeypatch, spec, contexts, heads=4, block_size=4, dtype=torch.float32, softcap=0.0, sinks=False, atol=1e-5
):
    gen = torch.Generator().manual_seed(0)
    batch = _decode_batch(spec, contexts, block_size, dtype, gen)
    q = (torch.randn(1, heads, len(contexts), spec.head_dim, generator=gen) * 2).to(DEVICE, dtype)
    sink = torch.randn(heads, generator=gen).to(DEVICE, dtype) if sinks else None
    scale = spec.head_dim**-0.5
    want = torch_paged_attention(batch, 0, q, scale, softcap, sink)
    with monkeypatch.context() as patch:
        patch.setattr(paged, "torch_paged_attention", _no_fallback)
        got = kernel_paged_attention(batch, 0, q, scale, softcap, sink)
    assert got.shape == want.shape == (1, len(contexts), heads, spec.value_dim)
    assert got.dtype == dtype
    assert want.float().abs().amax() > 0.1  # a real output, not zeros on both sides
    torch.testing.assert_close(got, want, atol=atol, rtol=atol)


@pytest.mark.parametrize(
    ("spec", "softcap", "sinks"),
    [
        (SlotSpec(2, D, DV), 0.0, False),
        (SlotSpec(2, D, DV, window=5), 0.0, False),  # a window smaller than most contexts
        (SlotSpec(2, D, DV, window=8, chunked=True), 0.0, False),
        (SlotSpec(2, D, DV), 3.0, False),
        (SlotSpec(2, D, DV, window=5), 0.0, True),
        (SlotSpec(2, D, DV, window=8, chunked=True), 3.0, True),
    ],
    ids=["causal", "window", "chunked", "softcap", "window-sinks", "chunked-softcap-sinks"],
)
def test_gqa_fp32(triton_interpret, monkeypatch, spec, softcap, sinks):
    _check(monkeypatch, spec, CONTEXTS, softcap=softcap, sinks=sinks)


@pytest.mark.parametrize("spec", [SlotSpec(2, D, DV), SlotSpec(2, D, DV, window=5)], ids=["causal", "window"])
def test_gqa_bf16(triton_interpret, monkeypatch, spec):
    _check(monkeypatch, spec, CONTEXTS, dtype=torch.bfloat16, softcap=3.0, sinks=True, atol=2e-2)


def test_mqa_odd_block_size(triton_interpret, monkeypatch):
    """One key head for all query heads, and cache blocks of 3 (not a power of two)."""
    _check(monkeypatch, SlotSpec(1, D, D, window=7), CONTEXTS, block_size=3, sinks=True)


def test_single_request_of_one_token(triton_interpret, monkeypatch):
    _check(monkeypatch, SlotSpec(2, D, DV, window=5), [0], softcap=3.0, sinks=True)


def test_other_steps_fall_back(triton_interpret, monkeypatch):
    """A step with a prefill chunk, and a decode step where no kernel launches (a CPU tensor
    outside the interpreter), run the torch path."""
    gen = torch.Generator().manual_seed(0)
    decode = _decode_batch(SlotSpec(2, D, DV), CONTEXTS, 4, torch.float32, gen, device="cpu")
    mixed = PagedBatch(decode.store, decode.block_table, torch.tensor([0, 2, 11, 40]), torch.tensor([1, 3, 1, 1]))

    def no_launch(fn):
        raise AssertionError("the kernel launched")

    monkeypatch.setattr(paged_attention, "jit", no_launch)
    for batch in (mixed, decode):
        q = torch.randn(1, 4, batch.num_tokens, D, generator=gen)
        if batch is decode:
            monkeypatch.delenv("TRITON_INTERPRET", raising=False)
        want = torch_paged_attention(batch, 0, q, 0.5, 0.0, None)
        assert torch.equal(kernel_paged_attention(batch, 0, q, 0.5, 0.0, None), want)


def test_register(monkeypatch):
    monkeypatch.setattr(paged, "_KERNELS", {})
    register_paged_attention("cuda", kernel_paged_attention)
    assert paged.paged_attention_impl("cuda") is kernel_paged_attention
    assert paged.paged_attention_impl("cpu") is torch_paged_attention


# -- a tiny llama served through the kernel -------------------------------------------------------


@functools.cache
def _llama():
    torch.manual_seed(0)
    cfg = AutoConfig.for_model(
        "llama", vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=128,
    )  # fmt: skip
    return afdc.disaggregate(AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval(), plan="1A1F")


def _generate(dm, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """Greedy tokens: one prefill step for all prompts, then decode steps of one token each."""
    store = PagedKVStore(attention_slots(dm.attention.module.graph), 6 * len(prompts), 4)
    table = torch.arange(6 * len(prompts)).reshape(len(prompts), -1).flip(1)  # each request's blocks, in reverse
    tokens = [list(p) for p in prompts]
    done = [0] * len(prompts)
    link = connectors.LoopbackConnector(functools.partial(combine, dm.ffn_ranks))
    for _ in range(new_tokens):
        lens = torch.tensor([len(t) - n for t, n in zip(tokens, done)])
        batch = PagedBatch(store, table, torch.tensor(done), lens)
        ids = torch.tensor([x for t, n in zip(tokens, done) for x in t[n:]])[None]
        with torch.no_grad(), connectors.active(link), kv_cache.active(batch):
            logits = dm.attention_ranks[0](ids, torch.ones_like(ids), batch.positions).logits[0]
        for r, row in enumerate(batch.logit_rows.tolist()):
            done[r] = len(tokens[r])
            tokens[r].append(int(logits[row].argmax()))
    return tokens


@pytest.mark.skipif(torch.cuda.is_available(), reason="serves the CPU model through the interpreter")
def test_llama_decodes_through_kernel(triton_interpret, monkeypatch):
    """Greedy tokens served with the kernel registered are those without it; only the prefill
    step falls back."""
    dm = _llama()
    prompts = [[5, 17, 99, 3, 41, 8, 70], [12, 64], [90, 33, 7, 7]]
    want = _generate(dm, prompts, 6)
    fallbacks = []

    def fallback(batch, *args):
        fallbacks.append(batch.max_query_len)
        return torch_paged_attention(batch, *args)

    monkeypatch.setattr(paged, "torch_paged_attention", fallback)
    monkeypatch.setitem(paged._KERNELS, "cpu", kernel_paged_attention)
    assert _generate(dm, prompts, 6) == want
    assert fallbacks == [7, 7]  # the prefill step, in both layers
