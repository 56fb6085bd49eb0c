"""Published AFD results, each with the setup its source states, to check the planner against.

A :class:`Scenario` holds what its source says it ran (model, chips, deployments, context,
quantization, micro-batches, expert balance, latency target) and the figure it published; its
:meth:`~Scenario.predict` sizes the same deployments with the planner and returns the predicted
figure. The published figure is only compared with, never read by the prediction. What a source
does not state the scenario sets, and says so in its ``assumed``.

The model's cost comes from its graph like any other plan (:func:`afdc.planner.model_facts`), so
a scenario takes a function from context length to :class:`~afdc.planner.facts.ModelFacts`.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from dataclasses import dataclass, field

from transformers import AutoConfig

from afdc.errors import PlanError
from afdc.planner.compare import Point, factors
from afdc.planner.deployment import Deployment, afd_deployment, mono_deployment, tp_deployment
from afdc.planner.facts import ModelFacts, model_facts, split_for_planning
from afdc.planner.hardware import HardwareProfile
from afdc.planner.roofline import Assumptions, ffn_gpus_needed
from afdc.planner.search import pool_sizes
from afdc.source import empty_model

# A throughput run with no latency target: every deployment decodes all its memory holds
NO_TARGET_MS = 1e6


@dataclass(frozen=True)
class Deploy:
    """One side of a comparison on one chip: AFD ``xAyF`` (ffn > 0), ``EPn`` (ffn == 0), ``TPn``
    (``tensor_parallel``), or, with ``search_within`` GPUs, the best AFD deployment the planner
    finds on at most that many (the source's own planner chose its node counts; likewise
    ``ep_search_within`` for the EP baseline)."""

    hw: HardwareProfile
    attention: int = 0
    ffn: int = 0
    ffn_hw: HardwareProfile | None = None
    tensor_parallel: bool = False
    search_within: int = 0
    ep_search_within: int = 0  # the best EPn for n a multiple of the scale-up domain up to this

    def size(self, facts: ModelFacts, tpot_ms: float, a: Assumptions) -> Deployment | None:
        target = tpot_ms / 1e3
        if self.search_within:
            return best_afd_within(facts, self.hw, self.search_within, target, a)
        if self.ep_search_within:
            sizes = range(self.hw.scale_up_domain, self.ep_search_within + 1, self.hw.scale_up_domain)
            found = [d for n in sizes if (d := mono_deployment(facts, self.hw, n, target, a)) is not None]
            return max(found, key=lambda d: d.tokens_per_gpu_s, default=None)
        if self.ffn:
            return afd_deployment(facts, self.hw, self.ffn_hw or self.hw, self.attention, self.ffn, target, a)
        if self.tensor_parallel:
            return tp_deployment(facts, self.hw, self.attention, target, a)
        return mono_deployment(facts, self.hw, self.attention, target, a)


def best_afd_within(facts: ModelFacts, hw: HardwareProfile, gpus: int, target: float, a: Assumptions):
    """The AFD deployment with the most tokens per GPU on at most ``gpus`` GPUs of ``hw``: every
    FFN pool the plan search tries, every attention pool that fits beside it."""
    least = ffn_gpus_needed(facts, hw, a)
    best = None
    for y in pool_sizes(least or gpus, a.ffn_pool_multiples):
        for x in range(1, gpus - y + 1):
            d = afd_deployment(facts, hw, hw, x, y, target, a)
            if d is not None and (best is None or d.tokens_per_gpu_s > best.tokens_per_gpu_s):
                best = d
    return best


@dataclass(frozen=True)
class Scenario:
    """One published figure: AFD's tokens per GPU (or die) per second over its baseline's, as a ratio."""

    name: str
    source: str
    context: int
    afd: Deploy
    baseline: Deploy
    published: float  # AFD / baseline tokens per GPU per second
    assumptions: Assumptions = field(default_factory=Assumptions)
    tpot_ms: float = NO_TARGET_MS
    stated: str = ""  # the setup as the source gives it
    assumed: str = ""  # what the source leaves out and the scenario sets

    def deployments(self, facts: ModelFacts) -> tuple[Deployment | None, Deployment | None]:
        return (
            self.afd.size(facts, self.tpot_ms, self.assumptions),
            self.baseline.size(facts, self.tpot_ms, self.assumptions),
        )

    def predict(self, facts_at: Callable[[int], ModelFacts]) -> float:
        """AFD's predicted tokens per GPU per second over the baseline's (0 when AFD cannot run)."""
        afd, base = self.deployments(facts_at(self.context))
        if base is None:
            raise PlanError(f"{self.name}: the baseline meets the target at no batch")
        return afd.tokens_per_gpu_s / base.tokens_per_gpu_s if afd else 0.0

    def gap(self, facts_at: Callable[[int], ModelFacts]) -> Gap | None:
        """The prediction split into :func:`~afdc.planner.compare.factors`, and the step-time ratio
        the published figure implies at the same batches and GPU shares (None when AFD cannot run)."""
        afd, base = self.deployments(facts_at(self.context))
        if afd is None or base is None:
            return None
        batch, step, share = factors(Point(self.context, afd.attention_gpus / afd.ffn_gpus, afd, base))
        return Gap(batch, step, share, self.published / (batch * share))


@dataclass(frozen=True)
class Gap:
    """Where a prediction parts from its published figure. Both are batch x step x share; the
    batches and shares are the model's (memory and GPU counts), so the published figure says what
    the step-time ratio must have been: a published step ratio far from the modelled one names the
    step's terms (kernels, overheads, exchange) as what the model misses, not the memory."""

    batch: float  # sequences per AFD attention GPU over per baseline GPU
    step: float  # the baseline's modelled TPOT over AFD's
    share: float  # AFD GPUs that decode: x / (x + y)
    implied_step: float  # the baseline's TPOT over AFD's that the published figure needs


@functools.cache
def _captured(path: str, overrides: str):
    """The split model of config file ``path`` with ``overrides`` (JSON), captured once however
    many dtypes the scenarios price it at (the weight dtype enters only the facts)."""
    with open(path) as f:
        values = {**json.load(f), **json.loads(overrides)}
    model_type = values.pop("model_type")
    values.pop("quantization_config", None)  # the scenario's weight dtype says how it ran
    return split_for_planning(empty_model(AutoConfig.for_model(model_type, **values)))


def config_facts(
    path: str, overrides: dict, weight_dtype: str, kv_dtype: str = "bf16"
) -> Callable[..., ModelFacts]:
    """``facts_at(context, kv_dtype=kv_dtype)``: :class:`ModelFacts` of the model in config file
    ``path`` (with ``overrides``), captured once on the meta device like any ``afdc plan``."""
    built, layers = _captured(path, json.dumps(overrides, sort_keys=True))
    cache: dict[tuple[int, str], ModelFacts] = {}
    default_kv = kv_dtype

    def facts_at(context: int, kv_dtype: str = default_kv) -> ModelFacts:
        if (context, kv_dtype) not in cache:
            cache[context, kv_dtype] = model_facts(built, context, weight_dtype, kv_dtype, name=path, layers=layers)
        return cache[context, kv_dtype]

    return facts_at


@dataclass(frozen=True)
class Model:
    """A model as a source ran it: a config file (of ``benchmarks/configs``), changes to it, dtypes."""

    config: str
    overrides: dict = field(default_factory=dict)
    weight_dtype: str = "bf16"
    kv_dtype: str = "bf16"
    note: str = ""

    @property
    def key(self) -> tuple:
        """What its captured facts depend on (two models may share a config file)."""
        return self.config, tuple(sorted(self.overrides.items())), self.weight_dtype


# DeepSeek-V3.2 (its config.json): DeepSeek-V3's architecture plus DeepSeek Sparse Attention, whose
# lightning indexer the capture sees (afdc/planner/cost.py: a step reads the indexer's keys at the
# whole context and the MLA latent at the top-2048 keys only; both are held at the whole context)
DEEPSEEK_V32_W8A8 = Model(
    "deepseek-v3.2.json",
    weight_dtype="int8",
    note="DeepSeek-V3.2 (DSA: indexer over every key, MLA over its top 2048), W8A8: int8 weights and activations",
)
# Mixtral-8x22B's config.json on the hub: the 8x7B architecture at these sizes
MIXTRAL_8X22B = Model(
    "mixtral-8x7b.json",
    {
        "hidden_size": 6144,
        "intermediate_size": 16384,
        "num_hidden_layers": 56,
        "num_attention_heads": 48,
        "vocab_size": 32768,
        "max_position_embeddings": 65536,
    },
    note="Mixtral-8x22B (its config.json), bf16",
)
DBRX = Model("dbrx.json", note="DBRX (its config.json), bf16")
DEEPSEEK_V3_FP8 = Model("deepseek-v3.json", weight_dtype="fp8", note="DeepSeek-V3, fp8 weights (its checkpoint's)")
DEEPSEEK_V3_INT8 = Model("deepseek-v3.json", weight_dtype="int8", note="DeepSeek-V3, W8A8")
# MegaScale-Infer's workload: median input 571 tokens, output 159; a decode step sees on average
# the input plus half the output
MEGASCALE_CONTEXT = 571 + 159 // 2
ERNIE_45_300B_FP8 = Model("ernie-4.5-300b-a47b.json", weight_dtype="fp8", note="ERNIE-4.5-300B-A47B, fp8 weights")


def scenarios(profiles: Callable[[str], HardwareProfile]) -> list[tuple[Model, Scenario]]:
    """Every published figure the planner is checked against, with the model each ran."""
    die = profiles("Ascend910C")
    ascend = Assumptions(micro_batches=2, expert_skew=1.0, dispatch_dtype="int8")
    blog = "vLLM blog 2026-07-23 (afd-plugin on Ascend 910C)"
    stated = (
        "Ascend 910C dies, DeepSeek-V3.2 W8A8, forced synthetic expert balance, afd-plugin (exactly two"
        " micro-batches), tokens/s per die against EP64"
    )
    assumed = (
        "a throughput run (no TPOT target: every deployment decodes what its memory holds), decode at the"
        " input length, KV cache (MLA latent and DSA indexer keys) in bf16, int8 dispatch for AFD and EP alike"
        " (DeepEP-Ascend dispatches in int8), the CloudMatrix384 UB fabric"
    )
    out = []
    for context, gain_64, gain_48 in ((16384, 1.113, 0.947), (32768, 1.090, 0.900)):
        for x, published in ((64, gain_64), (48, gain_48)):
            out.append(
                (
                    DEEPSEEK_V32_W8A8,
                    Scenario(
                        f"910C {x}A16F vs EP64 at {context // 1024}K",
                        blog,
                        context,
                        Deploy(die, x, 16),
                        Deploy(die, 64),
                        published,
                        ascend,
                        stated=stated,
                        assumed=assumed,
                    ),
                )
            )
    a800 = profiles("A800")
    msi = "MegaScale-Infer (arXiv 2504.02263), section 7"
    for model, name in ((MIXTRAL_8X22B, "Mixtral-8x22B"), (DBRX, "DBRX")):
        out.append(
            (
                model,
                Scenario(
                    f"MegaScale-Infer {name} vs TensorRT-LLM",
                    msi,
                    MEGASCALE_CONTEXT,
                    Deploy(a800, search_within=64),
                    Deploy(a800, 8, tensor_parallel=True),
                    1.28,
                    Assumptions(max_micro_batches=4),
                    tpot_ms=150.0,
                    stated=(
                        "up to 1.28x per-GPU decode throughput over TensorRT-LLM on Mixtral-8x22B and DBRX (the larger"
                        " of the two); 8 nodes of 8 80GB Ampere GPUs, NVLink 400 GB/s, 8x 200 Gbps NICs a node;"
                        " bf16 weights, activations and KV; production traces, median input 571 and output 159"
                        " tokens; TBT SLO 150 ms; its planner picks node counts and 3-4 micro-batches; TensorRT-LLM"
                        " with tensor parallelism"
                    ),
                    assumed=(
                        "decode at the median request's mean context (571 + 159/2 tokens); the baseline TP8 on one"
                        " node (both models fit one); AFD the best the planner finds on at most the 64 GPUs"
                    ),
                ),
            )
        )
    h800 = profiles("H800")
    out.append(
        (
            DEEPSEEK_V3_FP8,
            Scenario(
                "Baidu production AFD at 100 ms",
                "Baidu Baige, 'AE disaggregation for DeepSeek V3 models' (SGLang Meetup Beijing, 2025-12-14; InfoQ)",
                4096,
                Deploy(h800, search_within=64),
                Deploy(h800, ep_search_within=64),
                1.19,
                Assumptions(micro_batches=3, dispatch_dtype="fp8", two_stage_exchange=True),
                tpot_ms=100.0,
                stated=(
                    "DeepSeek-V3 series in Baidu's online service; baseline DP attention + EP; AFD with three"
                    " micro-batches (3BO) and a two-stage cross-node exchange that cuts RDMA traffic 4-8x; up to"
                    " +19% throughput at a 100 ms SLO"
                ),
                assumed=(
                    "H800 (8 per NVLink node, 400 Gb/s RDMA: the standard cluster arXiv 2602.09721 analyses), fp8"
                    " weights and dispatch as DeepSeek-V3's checkpoint, 4K context, the best AFD and EP deployments"
                    " the planner finds on at most 64 GPUs"
                ),
            ),
        )
    )
    return out
