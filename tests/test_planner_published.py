"""The planner against published AFD results, each scenario built from its source's stated setup
(:mod:`afdc.planner.published`; the models are captured from ``benchmarks/configs`` on the meta
device, once per module).

What the roofline reproduces is asserted; the quantitative targets of issue 57 that it misses are
strict expected failures, each saying by how much and why (docs/planner.md): a model change that
meets one turns its mark into a failure, and the mark goes.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from afdc.planner.compare import compare
from afdc.planner.hardware import get_profile
from afdc.planner.published import (
    DEEPSEEK_V3_FP8,
    DEEPSEEK_V3_INT8,
    DEEPSEEK_V32_W8A8,
    ERNIE_45_300B_FP8,
    config_facts,
    scenarios,
)
from afdc.planner.roofline import Assumptions

pytestmark = pytest.mark.slow  # four real-size captures, tens of seconds each

CONFIGS = Path(__file__).resolve().parent.parent / "benchmarks" / "configs"
SCENARIOS = scenarios(get_profile)
_FACTS: dict[str, object] = {}


def _facts(model):
    if model.key not in _FACTS:
        _FACTS[model.key] = config_facts(str(CONFIGS / model.config), model.overrides, model.weight_dtype)
    return _FACTS[model.key]


def _scenario(name: str):
    return next((m, s) for m, s in SCENARIOS if s.name == name)


def _predict(name: str) -> tuple[float, float]:
    model, s = _scenario(name)
    return s.predict(_facts(model)), s.published


def test_every_scenario_states_its_source_and_what_it_assumes():
    assert len(SCENARIOS) == 7
    for model, s in SCENARIOS:
        assert s.source and s.stated and s.assumed and model.note
        assert (CONFIGS / model.config).is_file()


@pytest.mark.parametrize("name", ["910C 64A16F vs EP64 at 16K", "MegaScale-Infer DBRX vs TensorRT-LLM"])
def test_gap_splits_the_prediction_and_says_what_step_ratio_the_published_figure_needs(name):
    model, s = _scenario(name)
    g = s.gap(_facts(model))
    assert g.batch * g.step * g.share == pytest.approx(s.predict(_facts(model)), rel=1e-9)
    assert g.batch * g.implied_step * g.share == pytest.approx(s.published, rel=1e-9)


@pytest.mark.parametrize("context", [16, 32])
def test_910c_64a16f_beats_48a16f_per_die_as_published(context):
    wide, published_wide = _predict(f"910C 64A16F vs EP64 at {context}K")
    narrow, published_narrow = _predict(f"910C 48A16F vs EP64 at {context}K")
    assert published_wide > published_narrow and wide > narrow


# With DSA modelled (the indexer reads every key, MLA only the top 2048), a step's attention grows
# with the context by the indexer's keys alone: the published trend (the margin shrinking from 16K to
# 32K) holds in the model, where dense MLA over the whole context had turned it (a strict xfail before)
@pytest.mark.parametrize("ratio", [64, 48])
def test_910c_margin_shrinks_from_16k_to_32k_as_published(ratio):
    at_16k, published_16k = _predict(f"910C {ratio}A16F vs EP64 at 16K")
    at_32k, published_32k = _predict(f"910C {ratio}A16F vs EP64 at 32K")
    assert published_32k < published_16k and at_32k < at_16k


def test_deepseek_v32_holds_every_key_and_reads_the_indexer_top_2048():
    # DeepSeek-V3.2 (its config.json): 61 layers, MLA latent 512 + rotary key 64, DSA's lightning
    # indexer keys of 128 at every position, its top 2048 keys read by the attention (bf16 KV)
    v32 = _facts(DEEPSEEK_V32_W8A8)(32768)
    v3 = _facts(DEEPSEEK_V3_FP8)(32768)
    layers, latent, index, top_k, context = 61, 512 + 64, 128, 2048, 32768
    assert v3.kv_bytes == v3.cost.kv_read_bytes == layers * context * latent * 2
    assert v32.kv_bytes == pytest.approx(layers * context * (latent + index) * 2)
    assert v32.cost.kv_read_bytes == pytest.approx(layers * (top_k * latent + context * index) * 2)
    # the indexer's scoring (64 heads of 128 against every key) against MLA over 2048 keys
    assert v32.cost.attention_flops == pytest.approx(
        layers * (2 * 128 * top_k * (latent + 512) + 2 * 64 * 128 * context + 2 * 64 * context)
    )


# Step-3 (arXiv 2507.19427) Table 2 as quoted: attention per decoded token at 32K context with an
# 8-bit KV cache, all layers: KV bytes read and attention FLOPs (QK and PV)
STEP3_TABLE2_32K = {
    "deepseek-v3.json": (1.15e9, 5.89e11),  # MLA
    "ernie-4.5-300b-a47b.json": (3.60e9, 5.80e10),  # GQA-8
}


@pytest.mark.parametrize("config", sorted(STEP3_TABLE2_32K))
def test_step3_table2_attention_cost_at_32k_within_10_percent(config):
    model = {"deepseek-v3.json": DEEPSEEK_V3_FP8, "ernie-4.5-300b-a47b.json": ERNIE_45_300B_FP8}[config]
    facts = _facts(model)(32768, kv_dtype="fp8")
    kv, flops = STEP3_TABLE2_32K[config]
    assert facts.kv_bytes == pytest.approx(kv, rel=0.10)
    # MLA: the table counts the value side at the cached width (576), the absorbed form at the
    # latent's (512): 5.6e11 against 5.9e11
    assert facts.cost.attention_flops == pytest.approx(flops, rel=0.10)


MEGASCALE = ("MegaScale-Infer Mixtral-8x22B vs TensorRT-LLM", "MegaScale-Infer DBRX vs TensorRT-LLM")


def test_megascale_infer_against_tensorrt_llm_tp_within_15_percent():
    # "up to 1.28x" over TensorRT-LLM on Mixtral-8x22B and DBRX: the larger of the two predictions
    predicted = [_predict(name) for name in MEGASCALE]
    assert all(p > 1 for p, _ in predicted)
    best = max(p for p, _ in predicted)
    assert abs(best / predicted[0][1] - 1) <= 0.15


# Each prediction is batch x step x share (Scenario.gap); the batches (KV capacity beside each
# side's weights) and shares are the model's, so a published figure says which step-time ratio
# (EP's TPOT over AFD's) it needs. The misses are all in the step: the terms it lacks are named.
_MISS = (
    "with DeepSeek-V3.2's sparse attention modelled (the lightning indexer over every key, MLA over its top"
    " 2048) the roofline's step-time ratio (EP64's TPOT over AFD's) is 0.59 at 16K and 0.56 at 32K where the"
    " published figures need 0.97 and 0.91 (64A16F) and 0.88 and 0.80 (48A16F): DSA shortens the attention"
    " that EP64 runs in series with its experts, while AFD's step is set by its 16 FFN dies re-reading 41 GB"
    " of int8 experts for each of the two micro-batches. EP64's all-to-all is priced as DeepEP-Ascend measured"
    " it on 910C (dispatch within 5%), so what slows the measured EP64 about 2x below its roofline is in terms"
    " no source quantifies (per-layer framework overheads, DP ranks in lockstep). 48A16F needs a slower step"
    " than 64A16F on the same FFN pool, which no model where fewer attention dies cannot slow the FFN side gives"
    " (benchmarks/bench_planner.py prints each factor)"
)


@pytest.mark.xfail(strict=True, reason=_MISS)
@pytest.mark.parametrize(
    "name", [f"910C {x}A16F vs EP64 at {c}K" for c in (16, 32) for x in (64, 48)]
)
def test_910c_within_5_points_with_the_right_sign(name):
    predicted, published = _predict(name)
    assert abs(predicted - published) <= 0.05 and (predicted > 1) == (published > 1)


@pytest.mark.xfail(
    strict=True,
    reason=(
        "the 1.90x headline is Scaled-MoE's (317B parameters, 32 experts, top-4, multi-node against"
        " TensorRT-LLM with pipeline parallelism across nodes): an in-house model whose architecture the"
        " paper does not publish, so no scenario can be built from its stated setup; Mixtral-8x22B and DBRX,"
        " whose configs are public, are checked against their 1.28x instead"
    ),
)
def test_megascale_infer_headline_within_15_percent():
    model, s = next((m, s) for m, s in SCENARIOS if "Scaled-MoE" in s.name)
    assert abs(s.predict(_facts(model)) / 1.90 - 1) <= 0.15


@pytest.mark.xfail(
    strict=True,
    reason=(
        "predicted 0.97x against 1.19x (18.7% under): at the model's batches the figure needs AFD's step"
        " 1.16x as fast as EP40's where the roofline, with Baidu's two-stage exchange, gives 0.94x; Baidu"
        " states no chip, GPU counts or context for the +19% (the scenario assumes H800, at most 64 GPUs,"
        " 4K) and the roofline has no term for its production EP baseline's losses"
    ),
)
def test_baidu_gain_within_15_percent():
    predicted, published = _predict("Baidu production AFD at 100 ms")
    assert abs(predicted / published - 1) <= 0.15


def test_compare_deepseek_v3_on_h100_names_the_winner_and_a_72_gpu_domain_narrows_the_dead_zone():
    # issue 57: the shipped DeepSeek-V3 config (W8A8) on H100s, 8 per NVLink node (a scale-out
    # cluster) against the same chips in one 72-GPU scale-up domain
    facts = _facts(DEEPSEEK_V3_INT8)(4096)
    h100 = get_profile("H100")
    a = Assumptions(dispatch_dtype="int8")
    margins = {}
    for domain in (8, 72):
        hw = dataclasses.replace(h100, scale_up_domain=domain)
        c = compare({4096: facts}, hw, hw, [2, 3, 4], 50.0, a, ffn_gpus=20, ep_gpus=64)
        best = c.best(4096)
        text = str(c)
        # the verdict names the winner and the ratio, and the three factors of the margin follow it
        assert f"{best.afd.name} ({best.ratio:g}:1)" in text and ("AFD wins" in text or "AFD loses" in text)
        assert all(f in text for f in ("batch x", "step x", "GPUs decoding x"))
        margins[domain] = best.margin
    # Baidu's roofline (arXiv 2602.09721): the NIC caps the FFN batch off a superpod; in one
    # scale-up domain AFD's exchange stops paying the NIC, so its best margin rises
    assert margins[72] > margins[8]
