"""The roofline of one decoder layer on one GPU: its attention and FFN times, and what fits in memory.

Each side takes the longer of its reads over HBM bandwidth and its FLOPs over peak, at the rates
:class:`Assumptions` scales the datasheet's by (the model as a whole: :mod:`afdc.planner`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from afdc.planner.facts import LayerFacts, ModelFacts
from afdc.planner.hardware import HardwareProfile

GB = 1e9


@dataclass(frozen=True)
class Assumptions:
    """The knobs of the model; the defaults are typical of tuned decode engines on Hopper."""

    # HBM kept free of weights and KV for activations, CUDA graphs, NCCL buffers, fragmentation
    activation_reserve: float = 0.10
    # streaming reads (KV pages, weights) reach about 80% of datasheet HBM bandwidth
    hbm_efficiency: float = 0.80
    # decode GEMMs and grouped expert GEMMs reach about 60% of dense peak
    compute_efficiency: float = 0.60
    # many-to-many messages of a few hundred kB reach about 70% of link rate
    network_efficiency: float = 0.70
    # beyond 8 micro-batches the weights re-read per micro-batch cost more than the overlap saves
    max_micro_batches: int = 8
    # AFD micro-batches: None picks the least m >= 2(1 + Tc/Tf) (MegaScale-Infer); a number fixes
    # it (afd-plugin runs exactly 2)
    micro_batches: int | None = None
    # tokens the busiest expert GPU gets over the mean: 1.0 is perfect balance (the forced balance
    # afd-plugin measured with); natural routing is skewed, which slows the busiest GPU's experts
    # and its link, in AFD's FFN pool and in the EP baseline alike
    expert_skew: float = 1.0
    # dtype the hidden states travel to the FFN in (quantized before sending, as W8A8 and DeepEP's
    # fp8 dispatch do); None keeps the model's dtype. Results come back in the model's dtype.
    dispatch_dtype: str | None = None
    # largest A:F ratio and FFN pool multiple searched
    max_attention_per_ffn_gpu: int = 64
    ffn_pool_multiples: tuple[int, ...] = (1, 2, 4, 8)
    # how the FFN GPUs hold a dense FFN layer (the plan's --dense-ffn): "tp" splits its weights
    # and sends every token to every GPU; "replicate" keeps it whole on each GPU and sends each
    # token to one of them
    dense_ffn: str = "tp"
    # AFD exchange in two stages (Baidu's production AFD): a token crosses the NIC once per FFN
    # scale-up domain that holds any of its experts, and that domain's interconnect fans it out
    # to the GPUs (and sums their results before the way back); False: one copy per FFN GPU
    two_stage_exchange: bool = False


def usable_memory(hw: HardwareProfile, a: Assumptions) -> float:
    """HBM left for weights and KV once the activation reserve is set aside."""
    return hw.hbm_capacity * (1 - a.activation_reserve)


def expected_distinct(n: float, p: float, draws: float) -> float:
    """Expected number of the ``n`` items hit at least once when each of ``draws`` draws hits a
    given item with probability ``p`` (uniform routing: real routers are skewed, which only
    makes the FFN side's weight reads smaller and its load imbalance larger)."""
    return n * (1 - (1 - p) ** draws) if draws > 0 else 0.0


def local_experts(layer: LayerFacts, gpus: int) -> float:
    """Routed experts per FFN GPU; past one expert per GPU, experts are replicated."""
    return max(layer.experts / gpus, 1.0)


def ffn_bytes_per_gpu(layer: LayerFacts, gpus: int, dense: str = "tp") -> float:
    """FFN weights one of ``gpus`` GPUs holds: experts split (EP), shared experts and router
    replicated on every GPU, a dense FFN split (TP) or whole (``dense="replicate"``)."""
    if not layer.moe:
        return layer.ffn_fixed_bytes if dense == "replicate" else layer.ffn_fixed_bytes / gpus
    return layer.ffn_fixed_bytes + math.ceil(local_experts(layer, gpus)) * layer.expert_bytes


def ffn_read_per_gpu(layer: LayerFacts, gpus: int, tokens: float, dense: str = "tp") -> float:
    """FFN weight bytes one GPU reads for a micro-batch of ``tokens`` tokens (all attention GPUs)."""
    if not layer.moe:
        return ffn_bytes_per_gpu(layer, gpus, dense)
    # a replicated expert sees only its share of the tokens
    share = min(1.0, layer.experts / gpus)
    hit = expected_distinct(local_experts(layer, gpus), layer.top_k / layer.experts, tokens * share)
    return layer.ffn_fixed_bytes + hit * layer.expert_bytes


def fan_out(layer: LayerFacts, gpus: int, dense: str = "tp") -> float:
    """FFN GPUs one token's hidden state goes to: the distinct ranks holding its top-k experts
    (the gate's choice travels with the token, as in MegaScale-Infer's M2N), every rank of a
    tensor-parallel dense FFN, or one rank of a replicated one."""
    if not layer.moe:
        return 1.0 if dense == "replicate" else float(gpus)
    return expected_distinct(gpus, 1 / gpus, layer.top_k)


def busiest(layer: LayerFacts, tokens: float, a: Assumptions) -> float:
    """Tokens the busiest FFN GPU's experts see when ``tokens`` would spread evenly."""
    return tokens * a.expert_skew if layer.moe else tokens


def attention_time(layer: LayerFacts, hw: HardwareProfile, weight_dtype: str, batch: float, a: Assumptions) -> float:
    """One layer's attention side for ``batch`` sequences: memory-bound on KV and weights at
    decode batch sizes, compute-bound only at very large batches."""
    read = layer.attention_weight_bytes + batch * layer.kv_read
    memory = read / (hw.hbm_bandwidth * a.hbm_efficiency)
    # QK and PV run in bf16 (fp8/int8 KV is widened in the kernel); projections at the weight dtype
    flops = batch * (layer.attention_flops / hw.flops("bf16") + layer.linear_flops / hw.flops(weight_dtype))
    return max(memory, flops / a.compute_efficiency)


def ffn_time(
    layer: LayerFacts,
    hw: HardwareProfile,
    weight_dtype: str,
    gpus: int,
    tokens: float,
    a: Assumptions,
    tensor_parallel: bool = False,
) -> float:
    """One layer's FFN on one of ``gpus`` GPUs for a micro-batch of ``tokens`` tokens in all,
    assuming the tokens spread evenly over the GPUs. ``tensor_parallel``: every GPU holds 1/n of
    every expert and reads that share of each expert the tokens touch (TP instead of EP)."""
    compute = tokens * layer.ffn_flops / gpus / (hw.flops(weight_dtype) * a.compute_efficiency)
    if tensor_parallel:
        read = ffn_read_per_gpu(layer, 1, tokens, "replicate") / gpus
    else:
        read = ffn_read_per_gpu(layer, gpus, tokens, a.dense_ffn)
    return max(compute, read / (hw.hbm_bandwidth * a.hbm_efficiency))


def attention_batch_memory(facts: ModelFacts, hw: HardwareProfile, a: Assumptions, ffn_bytes: float = 0.0) -> int:
    """Sequences whose KV cache fits beside the weights (and ``ffn_bytes`` of FFN weights)."""
    free = usable_memory(hw, a) - facts.attention_weight_bytes - ffn_bytes
    if facts.kv_bytes <= 0:
        return 1 << 16 if free > 0 else 0
    return max(int(free // facts.kv_bytes), 0)


def ffn_gpus_needed(facts: ModelFacts, hw: HardwareProfile, a: Assumptions, spare: float = 0.0) -> int | None:
    """Fewest GPUs that hold the FFN weights (with ``spare`` bytes left on each); None if none do."""
    room = usable_memory(hw, a) - spare
    for gpus in range(1, 4097):
        if ffn_memory(facts, gpus, a) <= room:
            return gpus
        if gpus > 2 * max((layer.experts for layer in facts.layers), default=1) and gpus > 64:
            break  # replicated experts and shared experts no longer shrink
    return None


def ffn_memory(facts: ModelFacts, gpus: int, a: Assumptions) -> float:
    """FFN weight bytes one of ``gpus`` FFN GPUs holds, all layers."""
    return sum(layer.count * ffn_bytes_per_gpu(layer, gpus, a.dense_ffn) for layer in facts.layers)


@dataclass(frozen=True)
class Balance:
    """Attention time against FFN time per micro-batch (all layers) at the plan's batch and FFN pool."""

    ffn_gpus: int
    attention_ms: float  # one attention GPU's micro-batch
    ffn_read_ms: float  # an FFN GPU reading every expert it holds: its time whatever the token count
    ratio: float | None  # A:F at which the FFN (compute or weight reads) takes as long as attention
    compute_ratio: float  # A:F at which FFN compute alone takes as long as attention

    @property
    def read_bound(self) -> bool:
        """The FFN reaches attention's time by reading weights long before its compute would."""
        return self.ratio is None or self.ratio < 0.5 * self.compute_ratio


def balance(
    facts: ModelFacts, hw_a: HardwareProfile, hw_f: HardwareProfile, y: int, batch: float, a: Assumptions
) -> Balance:
    """Where A:F = r balances an attention GPU's micro-batch of ``batch`` sequences against an
    FFN GPU (of ``y``) serving r attention GPUs' micro-batches."""
    t_a = sum(layer.count * attention_time(layer, hw_a, facts.weight_dtype, batch, a) for layer in facts.layers)

    def t_f(r: float) -> float:
        return sum(
            layer.count * ffn_time(layer, hw_f, facts.weight_dtype, y, r * y * batch, a) for layer in facts.layers
        )

    per_token = sum(layer.count * layer.ffn_flops for layer in facts.layers)
    compute_ratio = t_a * hw_f.flops(facts.weight_dtype) * a.compute_efficiency / (batch * per_token)
    read = sum(layer.count * ffn_read_per_gpu(layer, y, 1e12, a.dense_ffn) for layer in facts.layers)
    read_ms = read / (hw_f.hbm_bandwidth * a.hbm_efficiency) * 1e3
    lo, hi = 1 / 64, 1024.0
    ratio = None
    if t_f(lo) <= t_a <= t_f(hi):
        for _ in range(60):
            mid = math.sqrt(lo * hi)
            lo, hi = (mid, hi) if t_f(mid) < t_a else (lo, mid)
        ratio = math.sqrt(lo * hi)
    return Balance(y, t_a * 1e3, read_ms, ratio, compute_ratio)
