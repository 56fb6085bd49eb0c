"""The planner against published AFD results, each scenario built from its source's stated setup
(:mod:`afdc.planner.published`; the models are captured from ``benchmarks/configs`` on the meta
device, once per module).

What the roofline reproduces is asserted; the quantitative targets of issue 57 that it misses are
strict expected failures, each saying by how much and why (docs/planner.md): a model change that
meets one turns its mark into a failure, and the mark goes.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from afdc.planner.hardware import get_profile
from afdc.planner.published import config_facts, scenarios

pytestmark = pytest.mark.slow  # three real-size captures, tens of seconds each

CONFIGS = Path(__file__).resolve().parent.parent / "benchmarks" / "configs"
SCENARIOS = scenarios(get_profile)
_FACTS: dict[str, object] = {}


def _facts(model):
    if model.config not in _FACTS:
        _FACTS[model.config] = config_facts(str(CONFIGS / model.config), model.overrides, model.weight_dtype)
    return _FACTS[model.config]


def _scenario(name: str):
    return next((m, s) for m, s in SCENARIOS if s.name == name)


def _predict(name: str) -> tuple[float, float]:
    model, s = _scenario(name)
    return s.predict(_facts(model)), s.published


def test_every_scenario_states_its_source_and_what_it_assumes():
    assert len(SCENARIOS) == 6
    for model, s in SCENARIOS:
        assert s.source and s.stated and s.assumed and model.note
        assert (CONFIGS / model.config).is_file()


@pytest.mark.parametrize("context", [16, 32])
def test_910c_64a16f_beats_48a16f_per_die_as_published(context):
    wide, published_wide = _predict(f"910C 64A16F vs EP64 at {context}K")
    narrow, published_narrow = _predict(f"910C 48A16F vs EP64 at {context}K")
    assert published_wide > published_narrow and wide > narrow


@pytest.mark.parametrize("ratio", [64, 48])
def test_910c_margin_shrinks_from_16k_to_32k_as_published(ratio):
    at_16k, published_16k = _predict(f"910C {ratio}A16F vs EP64 at 16K")
    at_32k, published_32k = _predict(f"910C {ratio}A16F vs EP64 at 32K")
    assert published_32k < published_16k and at_32k < at_16k


# Step-3 (arXiv 2507.19427) Table 2 as quoted: attention per decoded token at 32K context with an
# 8-bit KV cache, all layers: KV bytes read and attention FLOPs (QK and PV)
STEP3_TABLE2_32K = {
    "deepseek-v3.json": (1.15e9, 5.89e11),  # MLA
    "ernie-4.5-300b-a47b.json": (3.60e9, 5.80e10),  # GQA-8
}


@pytest.mark.parametrize("config", sorted(STEP3_TABLE2_32K))
def test_step3_table2_attention_cost_at_32k_within_10_percent(config):
    model = next(m for m, _ in SCENARIOS if m.config == config)
    facts = _facts(model)(32768, kv_dtype="fp8")
    kv, flops = STEP3_TABLE2_32K[config]
    assert facts.kv_bytes == pytest.approx(kv, rel=0.10)
    # MLA: the table counts the value side at the cached width (576), the absorbed form at the
    # latent's (512): 5.6e11 against 5.9e11
    assert facts.cost.attention_flops == pytest.approx(flops, rel=0.10)


def test_megascale_infer_afd_beats_its_baseline():
    predicted, published = _predict("MegaScale-Infer vs TensorRT-LLM")
    assert published > 1 and predicted > 1


_MISS = (
    "the roofline predicts AFD 15-30 points below the published 910C figures: it has no term for "
    "the losses that make the measured EP64 2.3x slower than its roofline and AFD only 1.7x "
    "(docs/planner.md, 'Predicted against published'; benchmarks/bench_planner.py prints each gap)"
)


@pytest.mark.xfail(strict=True, reason=_MISS)
@pytest.mark.parametrize(
    "name", [f"910C {x}A16F vs EP64 at {c}K" for c in (16, 32) for x in (64, 48)]
)
def test_910c_within_5_points_with_the_right_sign(name):
    predicted, published = _predict(name)
    assert abs(predicted - published) <= 0.05 and (predicted > 1) == (published > 1)


@pytest.mark.xfail(strict=True, reason="predicted 1.13x against 1.90x: " + _MISS)
def test_megascale_infer_headline_within_15_percent():
    predicted, published = _predict("MegaScale-Infer vs TensorRT-LLM")
    assert abs(predicted / published - 1) <= 0.15


@pytest.mark.xfail(strict=True, reason="predicted 0.79x against 1.19x: " + _MISS)
def test_baidu_gain_within_15_percent():
    predicted, published = _predict("Baidu production AFD at 100 ms")
    assert abs(predicted / published - 1) <= 0.15
