"""Every architecture in ``models_supported.catalog`` splits into an equivalent disaggregated model.

For each tiny model: (a) prefill logits match the monolith on a left-padded batch, (b) greedy
generation is token-identical, (c) the attention and FFN programs own disjoint parameter sets
that together are all of the model's parameters, and (d) the split found the expected number of
dense and MoE FFN layers, the MoE ones split over the FFN ranks as the support table says (EP or
TP); all under plan 2A2F (2 attention ranks, each FFN layer over 2 FFN ranks), or 1A1F where the
entry records why its FFN cannot be split (and 2A2F must say so).
Refused architectures must raise :class:`afdc.UnsupportedModelError` with the recorded message.

The default run (CI's) checks the ``CORE`` entries, one per structural variant, and every refusal
but those in ``REFUSED_SWEEP`` (whose cause another refusal shows); ``--sweep`` checks them all.
"""

from __future__ import annotations

import pytest
import torch

import afdc
from models_supported.catalog import (
    CORE,
    ENTRIES,
    FAMILIES,
    REFUSED,
    REFUSED_CAUSE,
    REFUSED_OVERRIDES,
    REFUSED_SWEEP,
    TINY_COMMON,
    ModelEntry,
    build,
    build_type,
    unavailable,
)

PAD = 0
SEQ_LEN = 10
LEFT_PAD = 3
NEW_TOKENS = 16
RTOL = 1e-4


def _available(e: ModelEntry):
    return pytest.mark.skipif(bool(unavailable(e)), reason=unavailable(e))


def _inputs(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two sequences of ``SEQ_LEN`` tokens; the first is left-padded with ``LEFT_PAD`` pads."""
    gen = torch.Generator().manual_seed(1234)
    ids = torch.randint(3, vocab, (2, SEQ_LEN), generator=gen)
    mask = torch.ones_like(ids)
    ids[0, :LEFT_PAD] = PAD
    mask[0, :LEFT_PAD] = 0
    return ids, mask


def _no_early_stop(model) -> None:
    gc = model.generation_config
    gc.eos_token_id = None
    gc.pad_token_id = PAD
    gc.do_sample = False


def check_entry(entry: ModelEntry):
    """Build, split and check one entry; returns the disaggregated model."""
    model = build(entry)
    _no_early_stop(model)  # dm.generate reads the same generation config
    ids, mask = _inputs(model.config.get_text_config().vocab_size)
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=mask).logits
    expected = model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False)

    # (e) over 2 attention and 2 FFN ranks (experts or weight shards split, partial sums added;
    # an unshardable dense FFN whole on both): one capture checks (a)-(d) and the split at once
    if not entry.unshardable:
        dm = afdc.disaggregate(model, plan="2A2F")
    else:
        dm = afdc.disaggregate(model, plan="1A1F" if entry.moe_layers else "2A2F", dense_ffn="replicate")

    # (a) prefill logits at the non-pad positions
    out = dm(ids, attention_mask=mask).logits
    valid = mask.bool()
    err = (out[valid] - ref[valid]).abs().max().item()
    scale = ref[valid].abs().max().item()
    assert err <= RTOL * scale, f"{entry.name}: logits differ by {err:.3g} (max |ref| {scale:.3g})"

    # (b) greedy generation
    got = dm.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS)
    assert got.shape == expected.shape, f"{entry.name}: generated {tuple(got.shape)} vs {tuple(expected.shape)}"
    assert torch.equal(got, expected), f"{entry.name}: generation differs\n{got}\n{expected}"

    # (c) the two programs partition the model's parameters
    attn, ffn = set(dm.attention.parameter_names()), set(dm.ffn.parameter_names())
    full = {n for n, _ in model.named_parameters()}
    assert ffn, f"{entry.name}: the FFN side owns no parameters"
    assert not attn & ffn, f"{entry.name}: parameters on both sides: {sorted(attn & ffn)}"
    assert attn | ffn == full, (
        f"{entry.name}: missing {sorted(full - (attn | ffn))}, unexpected {sorted((attn | ffn) - full)}"
    )

    # (d) the FFN layers found
    layers = dm.report().layers
    assert layers, f"{entry.name}: no FFN layer found"
    kinds = [layer.kind for layer in layers]
    found = (kinds.count("dense"), kinds.count("moe"))
    assert found == (entry.dense_layers, entry.moe_layers), (
        f"{entry.name}: found {found[0]} dense / {found[1]} MoE FFN layers, "
        f"expected {entry.dense_layers} / {entry.moe_layers}"
    )

    if entry.moe_layers and not entry.unshardable:  # as the support table says
        assert {layer.ffn_split for layer in layers if layer.kind == "moe"} == {entry.moe_split}, entry.name
    if entry.unshardable:
        with pytest.raises(afdc.PlanError, match="cannot be split"):
            afdc.disaggregate(model, plan="2A2F")
    return dm


@pytest.mark.parametrize(
    "entry",
    [
        pytest.param(e, marks=[_available(e)] + ([] if e.model_type in CORE else [pytest.mark.sweep]), id=e.model_type)
        for e in ENTRIES
    ],
)
def test_model_supported(entry: ModelEntry) -> None:
    check_entry(entry)


@pytest.mark.parametrize(
    "model_type", [pytest.param(t, marks=[pytest.mark.sweep] if t in REFUSED_SWEEP else [], id=t) for t in REFUSED]
)
def test_model_refused(model_type: str) -> None:
    model = build_type(model_type, {**TINY_COMMON, **REFUSED_OVERRIDES[model_type]})
    with pytest.raises(afdc.UnsupportedModelError) as info:
        afdc.disaggregate(model)
    assert str(info.value).startswith(REFUSED[model_type]), str(info.value)


def test_catalog_is_consistent() -> None:
    types = [e.model_type for e in ENTRIES]
    assert len(types) == len(set(types)), "a model_type is listed twice"
    assert not set(types) & set(REFUSED), "a model_type is both verified and refused"
    assert set(REFUSED) == set(REFUSED_CAUSE) == set(REFUSED_OVERRIDES)
    assert set(REFUSED) >= REFUSED_SWEEP, sorted(REFUSED_SWEEP - set(REFUSED))
    assert not CORE - set(types) - set(REFUSED), sorted(CORE - set(types) - set(REFUSED))
    for e in ENTRIES:
        assert e.family in FAMILIES, e.name
        assert e.moe_split in ("ep", "tp"), e.name
        assert e.dense_layers >= 0 and e.moe_layers >= 0 and e.dense_layers + e.moe_layers >= 1, e.name
