"""The ``afdc`` backend: kernel substitution on captured programs, checked against the monolith.

The kernels run in Triton's interpreter here (tests/conftest.py), so these tests run the real
Triton code paths, on tiny models.
"""

from __future__ import annotations

import collections
import dataclasses

import pytest
import torch

import afdc
from afdc.demo import demo_batch
from afdc.errors import PlanError
from afdc.lowering import backends
from afdc.runtime.model import positions_from_mask
from models_supported import catalog
from models_supported.kernels import substitute_eagerly
from tests.tiers import sweep

pytestmark = pytest.mark.usefixtures("triton_interpret")


def _batch(vocab: int):
    return demo_batch(vocab, seed=0, shape=(3, 7), pads=(3,))

# What each model's programs must end up with: the residual add fused into every norm but the
# first, the gated MLP's activation, the MoE block and its softmax router.
EXPECTED = {
    "llama": {"add_rms_norm": 4, "rms_norm": 1, "act_mul": 1},
    "gemma2": {"add_rms_norm": 4, "rms_norm": 5, "act_mul": 1},  # Gemma's (1 + w) norms
    "gpt2": {"add_layer_norm": 4, "layer_norm": 1},
    "cohere": {"add_layer_norm": 2, "layer_norm": 1, "act_mul": 1},  # LayerNorm written out, no bias
    "qwen3_moe": {"add_rms_norm": 4, "rms_norm": 5, "fused_moe": 1, "moe_route": 1},  # + q/k norms
    # grouped router; the shared expert inside fused_moe, the dense first layer's act_mul
    "deepseek_v3": {"add_rms_norm": 6, "rms_norm": 7, "fused_moe": 1, "moe_route": 1, "act_mul": 1},
    "qwen2_moe": {"add_rms_norm": 4, "rms_norm": 1, "fused_moe": 1, "moe_route": 1},  # + its gated shared expert
    # input-major interleaved experts with biases and clamped SwiGLU; its softmax-of-top-k router stays
    "gpt_oss": {"add_rms_norm": 4, "rms_norm": 1, "fused_moe": 1},
}


@pytest.mark.parametrize("model_type", list(EXPECTED))
def test_substituted_kernels_match_the_monolith(model_type):
    model = catalog.build(catalog.entry(model_type))
    dm = afdc.disaggregate(model, "1A1F")
    assert substitute_eagerly(dm) == collections.Counter(EXPECTED[model_type])

    ids, mask = _batch(model.config.vocab_size)
    pos = positions_from_mask(mask)
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits
        got = dm(ids, attention_mask=mask, position_ids=pos).logits
        valid = mask.bool()
        torch.testing.assert_close(got[valid], ref[valid], atol=1e-4, rtol=1e-4)
        want = model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False)
    assert torch.equal(dm.generate(ids, attention_mask=mask, max_new_tokens=3), want)


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral", "gpt_oss"])
def test_a_bf16_model_gets_the_same_kernels(model_type):
    """In a model loaded in bf16, transformers' ``x.to(weight.dtype)`` casts values to the dtype
    they already have, and float32 routing weights widen the MoE sum, cast back after it; the
    patterns see through both, so the kernels are those of fp32 (EXPECTED's, which
    test_substituted_kernels_match_the_monolith finds in fp32; a model without an entry is captured
    in fp32 here)."""
    model = catalog.build(catalog.entry(model_type)).to(torch.bfloat16)
    if model_type in EXPECTED:
        fp32 = collections.Counter(EXPECTED[model_type])
    else:
        fp32 = substitute_eagerly(afdc.disaggregate(catalog.build(catalog.entry(model_type)), "1A1F"))
    dm = afdc.disaggregate(model, "1A1F")
    assert substitute_eagerly(dm) == fp32 and fp32["fused_moe"] == 1
    ids, mask = _batch(model.config.vocab_size)
    pos = positions_from_mask(mask)
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits.float()
        got = dm(ids, attention_mask=mask, position_ids=pos).logits.float()
    valid = mask.bool()
    torch.testing.assert_close(got[valid], ref[valid], atol=2e-2, rtol=2e-2)  # bf16 rounding


# qwen2_moe: a shared expert under the owner mark; minimax_m2: its rank's gate/up cut by split(n);
# gpt_oss: its rank's expert biases gathered by gather_local
@pytest.mark.parametrize(
    ("model_type", "router"),
    [("qwen3_moe", "ffn"), sweep("qwen2_moe", "attn"), sweep("minimax_m2", "attn"), ("gpt_oss", "attn")],
)
def test_afdc_backend_expert_parallel_with_micro_batches(model_type, router):
    """``--backend afdc`` end to end: kernels in, Inductor for the rest, 1A2F expert-parallel
    (each rank's fused MoE computes only its experts), two micro-batches on two threads; with the
    router on the attention side, a shared expert added on the rows the owner mark picks."""
    model = catalog.build(catalog.entry(model_type))
    dm = afdc.disaggregate(model, "1A2F", ffn_parallel="ep", micro_batches=2, backend="afdc", router=router)
    assert [r is not None for r in dm.ffn.routing] == [router == "attn"]
    ids, mask = _batch(model.config.vocab_size)
    pos = positions_from_mask(mask)
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits
        got = dm(ids, attention_mask=mask, position_ids=pos).logits
        want = model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False)
    valid = mask.bool()
    torch.testing.assert_close(got[valid], ref[valid], atol=1e-4, rtol=1e-4)
    assert torch.equal(dm.generate(ids, attention_mask=mask, max_new_tokens=3), want)
    for program in dm.ffn_ranks:
        assert all(type(s._run.module).__name__ == "OptimizedModule" for s in program._lowered)  # Inductor ran them


def test_a_routed_scaling_moves_into_the_routing_weights_beside_a_shared_expert():
    """Laguna scales the routed experts' sum by a constant before adding its shared expert: with the
    shared expert inside fused_moe the constant scales the routing weights, not the shared expert."""
    entry = catalog.entry("laguna")
    model = catalog.build(dataclasses.replace(entry, overrides={**entry.overrides, "moe_routed_scaling_factor": 2.5}))
    dm = afdc.disaggregate(model, "1A1F")
    moe = backends.copy_module(dm.ffn_ranks[0].segments[1])
    assert backends.substitute_kernels(moe.graph).fused["shared_expert"] == 1
    assert substitute_eagerly(dm)["act_mul"] == 1  # the dense layer's; the shared expert's is in fused_moe
    ids, mask = _batch(model.config.vocab_size)
    pos = positions_from_mask(mask)
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits
        got = dm(ids, attention_mask=mask, position_ids=pos).logits
    torch.testing.assert_close(got[mask.bool()], ref[mask.bool()], atol=1e-4, rtol=1e-4)


def test_near_misses_are_left_alone():
    """A norm over the wrong dim, an activation that is not multiplied, gpt-oss's experts with the
    up projection clamped to other bounds than the gate, a shared expert with another activation
    than the routed experts': nothing is substituted and the reason is kept."""

    class NearMiss(torch.nn.Module):
        def forward(self, x):
            h = x * torch.rsqrt(x.pow(2).mean(0, keepdim=True) + 1e-6)  # over tokens, not features
            return torch.nn.functional.silu(h) + x

    graph = torch.export.export(NearMiss(), (torch.randn(4, 8),)).graph
    report = backends.substitute_kernels(graph)
    assert report.fused == {}
    assert any("not over the last dim" in s for s in report.skipped)
    assert any("not multiplied" in s for s in report.skipped)

    model = catalog.build(catalog.entry("gpt_oss"))
    dm = afdc.disaggregate(model, "1A1F")
    segment = backends.copy_module(dm.ffn_ranks[0].segments[0])
    (up_clamp,) = [n for n in segment.graph.nodes if n.target == torch.ops.aten.clamp.default and n.args[1] is not None]
    up_clamp.args = (up_clamp.args[0], -6.0, 7.0)
    report = backends.substitute_kernels(segment.graph)
    assert "fused_moe" not in report.fused and any("up not clamped to ±limit" in s for s in report.skipped)

    dm = afdc.disaggregate(catalog.build(catalog.entry("deepseek_v3")), "1A1F")
    segment = backends.copy_module(dm.ffn_ranks[0].segments[1])
    (act,) = [n for n in segment.graph.nodes  # the shared expert's, of its gate projection
              if n.target == torch.ops.aten.silu.default and n.args[0].target == torch.ops.aten.linear.default]
    act.target = torch.ops.aten.gelu.default
    report = backends.substitute_kernels(segment.graph)
    assert report.fused["fused_moe"] == 1 and "shared_expert" not in report.fused
    assert any("activation gelu is not the routed experts' silu" in s for s in report.skipped)


def test_a_layer_norm_written_out_becomes_the_kernel():
    """Cohere's LayerNorm (no ATen op: mean, centered square mean, rsqrt, the centered value again,
    a weight) becomes ``layer_norm`` with the same output; the same chain scaling the centered value
    by the RMS of the uncentered one is not a LayerNorm and is left alone."""
    from transformers.models.cohere.modeling_cohere import CohereLayerNorm

    class NotLayerNorm(torch.nn.Module):
        def forward(self, x):
            x = x.float()
            return (x - x.mean(-1, keepdim=True)) * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)

    norm = CohereLayerNorm(48, eps=1e-5)
    torch.nn.init.normal_(norm.weight)
    x = torch.randn(2, 5, 48).to(torch.bfloat16)
    for module, fused in ((norm, {"layer_norm": 1}), (NotLayerNorm(), {})):
        program = torch.export.export(module, (x,)).module()
        report = backends.substitute_kernels(program.graph)
        program.recompile()
        assert report.fused == fused
        with torch.no_grad():
            torch.testing.assert_close(program(x), module(x), atol=1e-2, rtol=1e-2)
    assert any("not multiplied by rsqrt" in s for s in report.skipped)


def test_backend_option():
    assert backends.resolve("auto", torch.device("cpu")) == "eager"
    assert backends.resolve("auto", torch.device("cuda")) == "afdc"
    with pytest.raises(PlanError, match="--backend 'tensorrt' is not one of auto, afdc, inductor, eager"):
        afdc.Plan.parse("1A1F", backend="tensorrt")


def test_artifact_records_the_backend_and_load_overrides_it(tmp_path):
    model = catalog.build(catalog.entry("llama"))
    model.save_pretrained(tmp_path / "src")
    out = tmp_path / "art"
    manifest = afdc.compile_model(str(tmp_path / "src"), afdc.Plan.parse("1A1F", backend="inductor"), out,
                                  progress=False)
    assert manifest.plan.backend == "inductor"
    assert afdc.load(out, "ffn", 0).backend == "inductor"
    assert afdc.load(out, "ffn", 0, backend="eager").backend == "eager"
