"""Deployment planner: from one decoded token's cost to an AFD plan ``xAyF`` and its rival.

The inputs are what the graph says a token costs (:func:`afdc.passes.cost.decode_cost`), the
weights each side holds (the split report's parameter counts times the weight dtype) and two
hardware profiles. The model of a decode step is a roofline per layer and per micro-batch:

- attention (data-parallel: every attention GPU holds all attention weights and whole
  requests) takes max(bytes read / HBM bandwidth, FLOPs / peak);
- the FFN side (expert-parallel across y GPUs, dense FFNs tensor-parallel) takes
  max(FLOPs / peak, bytes of the experts the micro-batch activates / HBM bandwidth);
- the hidden states cross the cut both ways once per layer and micro-batch;
- with m micro-batches ping-ponging, a layer takes max(a + f + c, m * max(a, f))
  (light-llm-simulator; the links count among the stages: m * max(a, f, c_out, c_back)), and m is
  the least with m >= 2(1 + Tc/Tf) (MegaScale-Infer).

The monolithic rival runs attention data-parallel and the FFN expert-parallel on the same GPUs
(DeepSeek-style), so its GPUs do both halves in turn and overlap only communication.

Dtypes: weights and KV are counted at the chosen dtypes (the graph is captured in the config's
dtype, so parameter counts are multiplied by the weight dtype's bytes and the KV walk is asked
for the KV dtype's); matmuls run at the weight dtype's peak where the chip has it, else at bf16
(weight-only quantization); the hidden states crossing the cut stay in the model's dtype.

Left out on purpose: kernel-launch and synchronization overheads, router skew and the load
imbalance it causes (routing is taken as uniform), prefill sharing the GPUs, and tensor
parallelism inside an attention rank. Every figure is an estimate at datasheet rates scaled by
:class:`Assumptions`; it ranks deployments and names what binds them, it does not replace a
measurement.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import asdict, dataclass, field, replace

import torch

import afdc
from afdc.errors import PlanError
from afdc.hardware import HardwareProfile, dtype_bytes
from afdc.passes import graph_facts as gf
from afdc.passes.cost import DecodeCost, LayerCost, decode_cost
from afdc.passes.layers import LayerPattern, captured_prefix, layer_pattern
from afdc.runtime.model import DisaggregatedModel

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
    # largest A:F ratio and FFN pool multiple searched
    max_attention_per_ffn_gpu: int = 64
    ffn_pool_multiples: tuple[int, ...] = (1, 2, 4, 8)
    # how the FFN GPUs hold a dense FFN layer (the plan's --dense-ffn): "tp" splits its weights
    # and sends every token to every GPU; "replicate" keeps it whole on each GPU and sends each
    # token to one of them
    dense_ffn: str = "tp"


# --------------------------------------------------------------------------- model facts


@dataclass(frozen=True)
class LayerFacts:
    """One decoder layer (an attention call and the FFN layer after it), per decoded token.

    ``count`` identical layers share one entry. Bytes are at the chosen KV and weight dtypes.
    """

    count: int
    kv_bytes: float  # KV read (and held) per sequence at the context
    attention_flops: float
    linear_flops: float  # this layer's share of the attention side's matmuls (LM head included)
    attention_weight_bytes: float  # this layer's share of the attention weights read per forward
    ffn_flops: float  # activated: top-k routed experts + shared experts + router, or the dense FFN
    ffn_fixed_bytes: float  # FFN weights every token reads: dense FFN, or shared experts + router
    expert_bytes: float  # one routed expert (0 for a dense FFN)
    experts: int  # routed experts (0 for a dense FFN)
    top_k: int
    to_ffn_bytes: float
    to_attn_bytes: float

    @property
    def moe(self) -> bool:
        return self.experts > 0


@dataclass(frozen=True)
class ModelFacts:
    """What the planner knows of a model at one context length and dtype choice."""

    name: str
    context: int
    weight_dtype: str
    kv_dtype: str
    cost: DecodeCost
    layers: tuple[LayerFacts, ...]
    attention_weight_bytes: float  # held by every attention GPU
    ffn_weight_bytes: float  # all FFN layers
    ffn_activated_bytes: float  # FFN weights one token reads

    @property
    def layer_count(self) -> int:
        return sum(layer.count for layer in self.layers)

    @property
    def kv_bytes(self) -> float:
        return sum(layer.count * layer.kv_bytes for layer in self.layers)

    @property
    def attention_read_bytes(self) -> float:
        return sum(layer.count * layer.attention_weight_bytes for layer in self.layers)


# Context at which a prefix capture is checked against itself: past every sliding window, so
# that layers differing only in their window cost differently
_CHECK_CONTEXT = 1 << 20


def split_for_planning(model) -> tuple[DisaggregatedModel, LayerPattern | None]:
    """``(dm, pattern)``: ``model`` split for :func:`model_facts`. Capture time grows with the
    layers captured and most models repeat one or two, so ``dm`` holds only the prefix of the
    layers that :func:`afdc.passes.layers.layer_pattern` picks, when there is one and it stands
    for the whole model; else ``dm`` is the whole model and ``pattern`` None."""
    try:
        short = _split_prefix(model)
    except Exception:  # whatever fails on the short path, the full capture gives the answer, only slower
        short = None
    return short or (afdc.disaggregate(model), None)


def _split_prefix(model) -> tuple[DisaggregatedModel, LayerPattern] | None:
    pattern = layer_pattern(model)
    if pattern is None:
        return None
    with captured_prefix(model, pattern):
        dm = afdc.disaggregate(model)
    model_facts(dm, _CHECK_CONTEXT, layers=pattern)  # raises LayerMismatch where the prefix cannot stand in
    return dm, pattern


def _embedding_only_parameters(dm) -> list[tuple[str, int]]:
    """Parameters the attention program only gathers rows from: a decode step reads a row each,
    not the table (a table tied to the LM head is read in full by the head, so it stays)."""
    graph = dm.attention.module.graph
    params = set(dm.attention.parameter_names())
    return [
        (n.target, n.meta["val"].numel())
        for n in graph.nodes
        if gf.is_parameter(n, params) and n.users and all(gf.is_op(u, torch.ops.aten.embedding) for u in n.users)
    ]


@dataclass(frozen=True)
class _Weights:
    """Parameter counts and FFN layers of the model a split stands for."""

    ffn_layers: list  # the report's LayerReport per FFN layer
    attention: float  # held by the attention side
    attention_read: float  # what the attention side reads per step: all but row-gathered tables
    ffn: float


def _weights(dm, layers: LayerPattern | None) -> _Weights:
    report = dm.report()
    embedding_only = _embedding_only_parameters(dm)
    embedding = sum(size for _, size in embedding_only)
    if layers is None:
        attention = report.attention_parameters
        return _Weights(report.layers, attention, attention - embedding, report.ffn_parameters)
    owners = [layers.layer_of(r.module) for r in report.layers]
    attention_sizes = [(layers.layer_of(k), p.numel()) for k, p in dm.attention.module.named_parameters()]
    attention = layers.total(report.attention_parameters, attention_sizes)
    return _Weights(
        layers.expand(report.layers, owners, lambda r: (r.kind, r.experts, r.top_k, r.ffn_parameters)),
        attention,
        attention - layers.total(embedding, [(layers.layer_of(k), size) for k, size in embedding_only]),
        layers.total(report.ffn_parameters, [(o, r.ffn_parameters) for o, r in zip(owners, report.layers)]),
    )


def _split_moe_parameters(params: float, activated: float, experts: int, top_k: int) -> tuple[float, float]:
    """(fixed, per expert) parameters of an MoE layer from its total and its activated count.

    total = E * e + fixed and activated = k * e + fixed (router and shared experts are read by
    every token), so e = (total - activated) / (E - k): no model-specific names needed.
    """
    if experts <= top_k:
        return 0.0, params / experts
    per_expert = max(params - activated, 0.0) / (experts - top_k)
    return max(params - experts * per_expert, 0.0), per_expert


def _paired_attention(cost: DecodeCost) -> list[LayerCost]:
    """The attention call before each FFN layer; where the counts differ (layers without an FFN,
    or without attention) each FFN layer gets the mean, which keeps the totals right."""
    n = len(cost.ffn_layers)
    if len(cost.attention_layers) == n:
        return cost.attention_layers
    return [LayerCost(kv_bytes=cost.kv_bytes / n, attention_flops=cost.attention_flops / n)] * n


def model_facts(
    dm,
    context: int,
    weight_dtype: str = "bf16",
    kv_dtype: str = "bf16",
    name: str | None = None,
    layers: LayerPattern | None = None,
) -> ModelFacts:
    """Per-token cost and per-side weights of a :class:`DisaggregatedModel` at ``context``; with
    ``layers``, of the whole model ``dm``'s prefix capture stands for (:func:`split_for_planning`)."""
    wb, report = dtype_bytes(weight_dtype), dm.report()
    cost = decode_cost(dm, context, kv_dtype_bytes=dtype_bytes(kv_dtype), layers=layers)
    if not cost.ffn_layers:
        raise PlanError("the model has no FFN layers to disaggregate; there is nothing to plan")
    n = len(cost.ffn_layers)
    weights = _weights(dm, layers)
    rows = []
    for ffn, layer, attn in zip(cost.ffn_layers, weights.ffn_layers, _paired_attention(cost)):
        activated = ffn.ffn_flops / 2  # every FFN weight a token touches does one multiply-add
        if layer.kind == "moe" and layer.experts and layer.top_k:
            fixed, per_expert = _split_moe_parameters(layer.ffn_parameters, activated, layer.experts, layer.top_k)
            experts, top_k = layer.experts, layer.top_k
        else:
            fixed, per_expert, experts, top_k = float(layer.ffn_parameters), 0.0, 0, 0
        rows.append(
            LayerFacts(
                count=1,
                kv_bytes=attn.kv_bytes,
                attention_flops=float(attn.attention_flops),
                linear_flops=cost.linear_flops / n,
                attention_weight_bytes=weights.attention_read * wb / n,
                ffn_flops=ffn.ffn_flops,
                ffn_fixed_bytes=fixed * wb,
                expert_bytes=per_expert * wb,
                experts=experts,
                top_k=top_k,
                to_ffn_bytes=ffn.cut_bytes_to_ffn,
                to_attn_bytes=ffn.cut_bytes_to_attn,
            )
        )
    groups = Counter(replace(r, count=1) for r in rows)
    return ModelFacts(
        name=name or report.model,
        context=context,
        weight_dtype=weight_dtype,
        kv_dtype=kv_dtype,
        cost=cost,
        layers=tuple(replace(r, count=c) for r, c in groups.items()),
        attention_weight_bytes=weights.attention * wb,
        ffn_weight_bytes=weights.ffn * wb,
        ffn_activated_bytes=cost.ffn_flops / 2 * wb,
    )


# --------------------------------------------------------------------------- roofline pieces


def usable_memory(hw: HardwareProfile, a: Assumptions) -> float:
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


def attention_time(layer: LayerFacts, hw: HardwareProfile, weight_dtype: str, batch: float, a: Assumptions) -> float:
    """One layer's attention side for ``batch`` sequences: memory-bound on KV and weights at
    decode batch sizes, compute-bound only at very large batches."""
    read = layer.attention_weight_bytes + batch * layer.kv_bytes
    memory = read / (hw.hbm_bandwidth * a.hbm_efficiency)
    # QK and PV run in bf16 (fp8/int8 KV is widened in the kernel); projections at the weight dtype
    flops = batch * (layer.attention_flops / hw.flops("bf16") + layer.linear_flops / hw.flops(weight_dtype))
    return max(memory, flops / a.compute_efficiency)


def ffn_time(
    layer: LayerFacts, hw: HardwareProfile, weight_dtype: str, gpus: int, tokens: float, a: Assumptions
) -> float:
    """One layer's FFN on one of ``gpus`` GPUs for a micro-batch of ``tokens`` tokens in all,
    assuming the tokens spread evenly over the GPUs."""
    compute = tokens * layer.ffn_flops / gpus / (hw.flops(weight_dtype) * a.compute_efficiency)
    memory = ffn_read_per_gpu(layer, gpus, tokens, a.dense_ffn) / (hw.hbm_bandwidth * a.hbm_efficiency)
    return max(compute, memory)


# --------------------------------------------------------------------------- deployments


@dataclass(frozen=True)
class LayerTimes:
    """One micro-batch's times, summed over the model's layers: seconds inside the step model,
    milliseconds in a :class:`Deployment`."""

    attention: float
    ffn: float
    to_ffn: float
    to_attn: float

    @property
    def comm(self) -> float:
        return self.to_ffn + self.to_attn


@dataclass(frozen=True)
class Deployment:
    """A sized deployment and what the model predicts for it."""

    kind: str  # "afd" or "monolithic"
    attention_hw: str
    ffn_hw: str
    attention_gpus: int  # afd: x; monolithic: every GPU (each runs attention and FFN)
    ffn_gpus: int  # afd: y; monolithic: 0
    batch_per_gpu: int  # sequences decoding on each attention GPU
    max_batch_memory: int  # sequences that fit in an attention GPU's memory
    batch_limit: str  # "memory" or "tpot": what stops the batch growing
    micro_batches: int
    micro_batches_needed: float | None  # AFD: MegaScale-Infer's 2(1 + Tc/Tf) at this batch
    tpot_ms: float
    tokens_per_gpu_s: float
    cost_per_million_tokens: float | None  # USD, at the profiles' indicative prices
    link: str  # what carries the hidden states: "NIC" or "interconnect"
    times_ms: LayerTimes  # per micro-batch, summed over layers
    attention_memory_gb: float  # weights + KV on one attention GPU
    ffn_memory_gb: float  # FFN weights on one FFN GPU (monolithic: included in attention_memory_gb)

    @property
    def gpus(self) -> int:
        return self.attention_gpus + self.ffn_gpus

    @property
    def name(self) -> str:
        if self.kind == "afd":
            return f"{self.attention_gpus}A{self.ffn_gpus}F"
        return f"EP{self.attention_gpus}"

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_gpu_s * self.gpus


@dataclass(frozen=True)
class _Point:
    tpot: float
    micro_batches: int
    needed: float | None
    times: LayerTimes


def _link(hw_a: HardwareProfile, hw_f: HardwareProfile, gpus: int) -> tuple[str, float, float]:
    """Same chip within one scale-up domain: the interconnect; otherwise the NIC."""
    if hw_a.name == hw_f.name and gpus <= hw_a.scale_up_domain:
        return "interconnect", hw_a.interconnect_bandwidth, hw_f.interconnect_bandwidth
    return "NIC", hw_a.nic_bandwidth, hw_f.nic_bandwidth


def _afd_layer(facts, hw_a, hw_f, x, y, b, a: Assumptions) -> tuple[list[tuple[int, float, float, float, float]], str]:
    """Per layer class (count, attention, ffn, to ffn, to attention) for micro-batches of ``b``."""
    link, bw_a, bw_f = _link(hw_a, hw_f, x + y)
    rows = []
    for layer in facts.layers:
        t_a = attention_time(layer, hw_a, facts.weight_dtype, b, a)
        t_f = ffn_time(layer, hw_f, facts.weight_dtype, y, x * b, a)
        copies = b * fan_out(layer, y, a.dense_ffn)  # hidden states one attention GPU sends per micro-batch
        to_ffn = _m2n_time(copies * layer.to_ffn_bytes, x / y, bw_a, bw_f, a)
        to_attn = _m2n_time(copies * layer.to_attn_bytes, x / y, bw_a, bw_f, a)
        rows.append((layer.count, t_a, t_f, to_ffn, to_attn))
    return rows, link


def _m2n_time(per_attention_gpu: float, ratio: float, bw_a: float, bw_f: float, a: Assumptions) -> float:
    """Both ends of the many-to-many: an attention GPU's link, and an FFN GPU's link carrying
    ``ratio`` attention GPUs' worth (the Baidu roofline's scale-out cap on the FFN batch)."""
    return max(per_attention_gpu / bw_a, ratio * per_attention_gpu / bw_f) / a.network_efficiency


def _sum_times(rows) -> LayerTimes:
    return LayerTimes(*(sum(r[0] * r[i] for r in rows) for i in range(1, 5)))


def afd_step(facts: ModelFacts, hw_a, hw_f, x: int, y: int, batch: int, a: Assumptions) -> _Point:
    """TPOT of ``xAyF`` at ``batch`` sequences per attention GPU, micro-batches chosen by
    MegaScale-Infer's rule m >= 2(1 + Tc/Tf), Tc the one-way transfer, Tf the FFN time."""
    m_max = max(1, min(a.max_micro_batches, batch))
    chosen = None
    for m in range(min(2, m_max), m_max + 1):
        rows, _ = _afd_layer(facts, hw_a, hw_f, x, y, batch / m, a)
        t = _sum_times(rows)
        needed = 2 * (1 + (t.comm / 2) / t.ffn) if t.ffn > 0 else 2.0
        chosen = (m, needed, rows, t)
        if m >= needed:
            break
    m, needed, rows, t = chosen
    # light-llm-simulator: a micro-batch's round trip, or m turns of the slowest stage; the links
    # are stages too (m transfers each way share them), or bandwidth would pass for latency only
    tpot = sum(c * max(ta + tf + c1 + c2, m * max(ta, tf, c1, c2)) for c, ta, tf, c1, c2 in rows)
    return _Point(tpot, m, needed, t)


def mono_step(facts: ModelFacts, hw: HardwareProfile, gpus: int, batch: int, a: Assumptions) -> _Point:
    """TPOT of DP attention + EP FFN on ``gpus`` GPUs: attention and FFN share each GPU, so only
    the dispatch and combine overlap with compute (two-batch overlap when it pays)."""
    link = hw.interconnect_bandwidth if gpus <= hw.scale_up_domain else hw.nic_bandwidth
    best = None
    for m in range(1, min(2, batch) + 1):
        b, rows = batch / m, []
        for layer in facts.layers:
            t_a = attention_time(layer, hw, facts.weight_dtype, b, a)
            t_f = ffn_time(layer, hw, facts.weight_dtype, gpus, gpus * b, a)
            remote = fan_out(layer, gpus, a.dense_ffn) * (gpus - 1) / gpus  # the local rank costs no transfer
            bw = link * a.network_efficiency
            rows.append(
                (layer.count, t_a, t_f, b * layer.to_ffn_bytes * remote / bw, b * layer.to_attn_bytes * remote / bw)
            )
        tpot = sum(c * max(m * (ta + tf), m * (c1 + c2), ta + tf + c1 + c2) for c, ta, tf, c1, c2 in rows)
        if best is None or tpot < best.tpot:
            best = _Point(tpot, m, None, _sum_times(rows))
    return best


def largest(ok, hi: int) -> int:
    """The largest n in [1, hi] with ok(n), for ok true up to some n and false after (0: none)."""
    lo, best = 1, 0
    while lo <= hi:
        mid = (lo + hi) // 2
        if ok(mid):
            best, lo = mid, mid + 1
        else:
            hi = mid - 1
    return best


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
    return sum(layer.count * ffn_bytes_per_gpu(layer, gpus, a.dense_ffn) for layer in facts.layers)


def _cost(tokens_per_s: float, dollars_per_hour: float | None) -> float | None:
    if dollars_per_hour is None or tokens_per_s <= 0:
        return None
    return dollars_per_hour / 3600 / tokens_per_s * 1e6


def _deployment(kind, hw_a, hw_f, x, y, batch, cap, point: _Point, link, facts, fmem) -> Deployment:
    tokens_per_s = x * batch / point.tpot
    prices = (hw_a.price_per_hour, hw_f.price_per_hour)
    dollars = None if None in prices else x * prices[0] + y * prices[1]
    t = point.times
    return Deployment(
        kind=kind,
        attention_hw=hw_a.name,
        ffn_hw=hw_f.name,
        attention_gpus=x,
        ffn_gpus=y,
        batch_per_gpu=batch,
        max_batch_memory=cap,
        batch_limit="memory" if batch >= cap else "tpot",
        micro_batches=point.micro_batches,
        micro_batches_needed=point.needed,
        tpot_ms=point.tpot * 1e3,
        tokens_per_gpu_s=tokens_per_s / (x + y),
        cost_per_million_tokens=_cost(tokens_per_s, dollars),
        link=link,
        times_ms=LayerTimes(t.attention * 1e3, t.ffn * 1e3, t.to_ffn * 1e3, t.to_attn * 1e3),
        attention_memory_gb=(facts.attention_weight_bytes + batch * facts.kv_bytes + (fmem if kind != "afd" else 0))
        / GB,
        ffn_memory_gb=fmem / GB,
    )


def afd_deployment(facts, hw_a, hw_f, x: int, y: int, target: float, a: Assumptions) -> Deployment | None:
    """``xAyF`` with the largest attention batch meeting the TPOT target (None: none does)."""
    cap = attention_batch_memory(facts, hw_a, a)
    batch = largest(lambda b: afd_step(facts, hw_a, hw_f, x, y, b, a).tpot <= target, cap)
    if batch == 0:
        return None
    point = afd_step(facts, hw_a, hw_f, x, y, batch, a)
    link = _link(hw_a, hw_f, x + y)[0]
    return _deployment("afd", hw_a, hw_f, x, y, batch, cap, point, link, facts, ffn_memory(facts, y, a))


def mono_deployment(facts, hw, gpus: int, target: float, a: Assumptions) -> Deployment | None:
    fmem = ffn_memory(facts, gpus, a)
    cap = attention_batch_memory(facts, hw, a, fmem)
    batch = largest(lambda b: mono_step(facts, hw, gpus, b, a).tpot <= target, cap)
    if batch == 0:
        return None
    point = mono_step(facts, hw, gpus, batch, a)
    link = "interconnect" if gpus <= hw.scale_up_domain else "NIC"
    return _deployment("monolithic", hw, hw, gpus, 0, batch, cap, point, link, facts, fmem)


def _better(d: Deployment | None, best: Deployment | None) -> bool:
    """Lower cost per token wins; without prices, more tokens per GPU."""
    if d is None:
        return False
    if best is None:
        return True
    if d.cost_per_million_tokens is not None and best.cost_per_million_tokens is not None:
        return d.cost_per_million_tokens < best.cost_per_million_tokens
    return d.tokens_per_gpu_s > best.tokens_per_gpu_s


def _pool_sizes(least: int, multiples: tuple[int, ...]) -> list[int]:
    return sorted({least * k for k in multiples})


def best_afd(facts, hw_a, hw_f, target: float, a: Assumptions) -> Deployment | None:
    least = ffn_gpus_needed(facts, hw_f, a)
    if least is None or attention_batch_memory(facts, hw_a, a) < 1:
        return None
    best = None
    for y in _pool_sizes(least, a.ffn_pool_multiples):
        d = _best_x(facts, hw_a, hw_f, y, target, a)
        if _better(d, best):
            best = d
    return best


def _best_x(facts, hw_a, hw_f, y: int, target: float, a: Assumptions) -> Deployment | None:
    """The best attention pool for ``y`` FFN GPUs: a coarse scan of x that stops once more
    attention GPUs stop paying, then every x around the best one."""
    step = max(1, y // 4)
    best, misses = None, 0
    for x in range(1, a.max_attention_per_ffn_gpu * y + 1, step):
        d = afd_deployment(facts, hw_a, hw_f, x, y, target, a)
        if d is None and x > 1:
            break  # more attention GPUs only add FFN load and traffic: the target stays lost
        if _better(d, best):
            best, misses = d, 0
        else:
            misses += 1
            if misses >= 6:
                break
    if best is None or step == 1:
        return best
    for x in range(max(1, best.attention_gpus - step + 1), best.attention_gpus + step):
        d = afd_deployment(facts, hw_a, hw_f, x, y, target, a)
        if _better(d, best):
            best = d
    return best


def best_mono(facts, hw, target: float, a: Assumptions) -> Deployment | None:
    # KV room for at least one sequence beside the weights
    least = ffn_gpus_needed(facts, hw, a, spare=facts.attention_weight_bytes + facts.kv_bytes)
    if least is None:
        return None
    sizes = sorted({*_pool_sizes(least, a.ffn_pool_multiples), *(n for n in (8, 16, 32, 64, 128) if n >= least)})
    best = None
    for gpus in sizes:
        d = mono_deployment(facts, hw, gpus, target, a)
        if _better(d, best):
            best = d
    return best


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


def balance(facts, hw_a, hw_f, y: int, batch: float, a: Assumptions) -> Balance:
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


# --------------------------------------------------------------------------- the plan


@dataclass(frozen=True)
class Shortfall:
    """Why a deployment cannot meet the target, and by how much."""

    deployment: str
    reason: str


@dataclass(frozen=True)
class PlanResult:
    facts: ModelFacts
    attention_hw: HardwareProfile
    ffn_hw: HardwareProfile
    tpot_target_ms: float
    afd: Deployment | None
    monolithic: tuple[Deployment, ...]
    balance: Balance | None
    explanation: tuple[str, ...]
    shortfalls: tuple[Shortfall, ...] = ()
    assumptions: Assumptions = field(default_factory=Assumptions)

    @property
    def best_monolithic(self) -> Deployment | None:
        best = None
        for d in self.monolithic:
            if _better(d, best):
                best = d
        return best

    def to_dict(self) -> dict:
        c = self.facts.cost
        return {
            "model": self.facts.name,
            "context": self.facts.context,
            "kv_dtype": self.facts.kv_dtype,
            "weight_dtype": self.facts.weight_dtype,
            "formulation": c.formulation,
            "kv_bytes": c.kv_bytes,
            "attention_flops": c.attention_flops,
            "linear_flops": c.linear_flops,
            "ffn_flops": c.ffn_flops,
            "cut_bytes_to_ffn": c.cut_bytes_to_ffn,
            "cut_bytes_to_attn": c.cut_bytes_to_attn,
            "attention_weight_bytes": self.facts.attention_weight_bytes,
            "ffn_weight_bytes": self.facts.ffn_weight_bytes,
            "plan": {
                "attention_hw": self.attention_hw.name,
                "ffn_hw": self.ffn_hw.name,
                "tpot_target_ms": self.tpot_target_ms,
                "afd": _deployment_dict(self.afd),
                "balance": asdict(self.balance) if self.balance else None,
                "monolithic": [_deployment_dict(d) for d in self.monolithic],
                "explanation": list(self.explanation),
                "shortfalls": [asdict(s) for s in self.shortfalls],
                "assumptions": asdict(self.assumptions),
            },
        }

    def __str__(self) -> str:
        return render(self)


def _deployment_dict(d: Deployment | None) -> dict | None:
    if d is None:
        return None
    out = asdict(d)
    out["name"] = d.name
    out["gpus"] = d.gpus
    return out


def _min_tpot_afd(facts, hw_a, hw_f, a) -> float | None:
    least = ffn_gpus_needed(facts, hw_f, a)
    if least is None:
        return None
    return min(afd_step(facts, hw_a, hw_f, 1, y, 1, a).tpot for y in _pool_sizes(least, a.ffn_pool_multiples))


def _min_tpot_mono(facts, hw, a) -> float | None:
    least = ffn_gpus_needed(facts, hw, a, spare=facts.attention_weight_bytes + facts.kv_bytes)
    if least is None:
        return None
    return min(mono_step(facts, hw, n, 1, a).tpot for n in _pool_sizes(least, a.ffn_pool_multiples))


def _over(need: float, target: float) -> str:
    return f"even batch 1 needs {need * 1e3:.1f} ms ({(need / target - 1) * 100:.0f}% over)"


def _afd_shortfall(facts, hw_a, hw_f, target, a) -> Shortfall:
    what = f"AFD ({hw_a.name} attention, {hw_f.name} FFN)"
    spare = usable_memory(hw_a, a) - facts.attention_weight_bytes
    if spare < facts.kv_bytes:
        return Shortfall(
            what,
            (
                f"context {facts.context} does not fit on {hw_a.name}: attention weights"
                f" {facts.attention_weight_bytes / GB:.1f} GB plus one sequence's KV cache"
                f" {facts.kv_bytes / GB:.2f} GB exceed its usable {usable_memory(hw_a, a) / GB:.1f} GB"
            ),
        )
    if ffn_gpus_needed(facts, hw_f, a) is None:
        return Shortfall(
            what, f"the FFN weights ({facts.ffn_weight_bytes / GB:.0f} GB) fit on no number of {hw_f.name}"
        )
    need = _min_tpot_afd(facts, hw_a, hw_f, a)
    return Shortfall(what, f"TPOT {target * 1e3:g} ms cannot be met: {_over(need, target)}")


def _mono_shortfall(facts, hw, target, a) -> Shortfall:
    what = f"monolithic on {hw.name}"
    need = _min_tpot_mono(facts, hw, a)
    if need is None:
        return Shortfall(what, f"the weights and one sequence's KV cache fit on no number of {hw.name}")
    return Shortfall(what, f"TPOT {target * 1e3:g} ms cannot be met: {_over(need, target)}")


def plan(
    facts: ModelFacts,
    attention_hw: HardwareProfile,
    ffn_hw: HardwareProfile,
    tpot_ms: float,
    assumptions: Assumptions | None = None,
) -> PlanResult:
    """The cheapest AFD deployment meeting ``tpot_ms`` and the monolithic one to beat.

    Raises :class:`afdc.PlanError` when neither can meet the target, saying by how much.
    """
    a = assumptions or Assumptions()
    if tpot_ms <= 0:
        raise PlanError(f"TPOT target must be positive, got {tpot_ms} ms")
    target = tpot_ms / 1e3
    afd = best_afd(facts, attention_hw, ffn_hw, target, a)
    hws = [ffn_hw] if attention_hw.name == ffn_hw.name else [ffn_hw, attention_hw]
    monos = tuple(d for d in (best_mono(facts, hw, target, a) for hw in hws) if d is not None)
    shortfalls = [] if afd else [_afd_shortfall(facts, attention_hw, ffn_hw, target, a)]
    shortfalls += [
        _mono_shortfall(facts, hw, target, a) for hw in hws if hw.name not in {d.attention_hw for d in monos}
    ]
    if afd is None and not monos:
        raise PlanError("; ".join(f"{s.deployment}: {s.reason}" for s in shortfalls))
    bal = None
    if afd is not None:
        bal = balance(facts, attention_hw, ffn_hw, afd.ffn_gpus, afd.batch_per_gpu / afd.micro_batches, a)
    result = PlanResult(facts, attention_hw, ffn_hw, tpot_ms, afd, monos, bal, (), tuple(shortfalls), a)
    return replace(result, explanation=tuple(explain(result)))


# --------------------------------------------------------------------------- words


def _gb(x: float) -> str:
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6)):
        if x >= scale:
            return f"{x / scale:.3g} {unit}"
    return f"{x / 1e3:.3g} kB"


def _batch_reason(d: Deployment, facts: ModelFacts, hw: HardwareProfile, a: Assumptions) -> str:
    where = f"{d.batch_per_gpu} sequences per {hw.name}"
    if d.batch_limit == "memory":
        weights = facts.attention_weight_bytes + (d.ffn_memory_gb * GB if d.kind != "afd" else 0)
        return (
            f"Memory capacity binds the batch: {where} is all that fits (weights {_gb(weights)} + "
            f"{d.batch_per_gpu} x {_gb(facts.kv_bytes)} KV at {facts.context} tokens within {_gb(usable_memory(hw, a))}"
            f" usable = {hw.hbm_capacity / GB:.0f} GB less {a.activation_reserve:.0%} reserve); the TPOT target has"
            f" slack ({d.tpot_ms:.1f} ms)."
        )
    return (
        f"TPOT binds the batch: {where} decode in {d.tpot_ms:.1f} ms; one more would pass the target"
        f" (memory would allow {d.max_batch_memory})."
    )


def _ffn_utilization(r: PlanResult, d: Deployment) -> tuple[float, float]:
    """(tokens per micro-batch across the FFN pool, share of FFN time spent computing)."""
    tokens = d.attention_gpus * d.batch_per_gpu / d.micro_batches
    compute = total = 0.0
    for layer in r.facts.layers:
        peak = r.ffn_hw.flops(r.facts.weight_dtype) * r.assumptions.compute_efficiency
        compute += layer.count * tokens * layer.ffn_flops / d.ffn_gpus / peak
        total += layer.count * ffn_time(layer, r.ffn_hw, r.facts.weight_dtype, d.ffn_gpus, tokens, r.assumptions)
    return tokens, compute / total if total else 1.0


def _side_reason(r: PlanResult, d: Deployment) -> str:
    b = d.batch_per_gpu / d.micro_batches
    kv = b * r.facts.kv_bytes
    w = r.facts.attention_read_bytes
    attn = f"attention is memory-bound ({kv / (kv + w):.0%} of its reads are KV, the rest weights)"
    tokens, used = _ffn_utilization(r, d)
    if used > 0.99:
        ffn = f"the FFN is compute-bound ({tokens:.0f} tokens per micro-batch across {d.ffn_gpus} GPUs)"
    else:
        ffn = (
            f"the FFN is weight-read bound: {tokens:.0f} tokens per micro-batch across {d.ffn_gpus} FFN GPUs"
            f" keep {used:.0%} of their time computing"
        )
    return f"Per layer and micro-batch, {attn}; {ffn}."


def _links(r: PlanResult, d: Deployment) -> tuple[float, float]:
    _, bw_a, bw_f = _link(r.attention_hw, r.ffn_hw, d.gpus)
    return bw_a, bw_f


def _ratio_limit(r: PlanResult, d: Deployment) -> str:
    """What stops the plan adding attention GPUs to its FFN pool."""
    t = d.times_ms
    bw_a, bw_f = _links(r, d)
    load = d.attention_gpus / d.ffn_gpus * bw_a / bw_f  # FFN end's transfer time over the attention end's
    if load > 1 and t.comm >= 0.25 * (t.attention + t.ffn + t.comm):
        return (
            f"each FFN GPU's {d.link} carries {load:.1f}x an attention GPU's traffic ({t.comm:.1f} ms round trip"
            f" per micro-batch, all layers), which caps the ratio"
        )
    if d.batch_limit == "tpot":
        return "a larger ratio would push TPOT past the target"
    return "a larger ratio slows every layer's FFN more than it adds tokens"


def _balance_reason(r: PlanResult, d: Deployment) -> str:
    bal = r.balance
    here = f"{d.name} ({d.attention_gpus / d.ffn_gpus:.2f}:1)"
    weights = "its experts' weights" if any(layer.moe for layer in r.facts.layers) else "its weights"
    on = f"on {d.ffn_gpus} {r.ffn_hw.name}"
    if bal.ratio is None and bal.ffn_read_ms > bal.attention_ms:
        return (
            f"Balance: {on} reading {weights} alone takes {bal.ffn_read_ms:.2f} ms per micro-batch, more than"
            f" attention's {bal.attention_ms:.2f} ms at any A:F; {here} is set by cost instead, where"
            f" {_ratio_limit(r, d)}."
        )
    if bal.ratio is None:
        return (
            f"Balance: the FFN would keep up with attention ({bal.attention_ms:.2f} ms per micro-batch) up to"
            f" {bal.compute_ratio:.0f}:1; {here} stops where {_ratio_limit(r, d)}."
        )
    if bal.read_bound:
        return (
            f"Balance: {on} the FFN reads {weights} in about {bal.ffn_read_ms:.2f} ms per micro-batch whatever"
            f" the token count, which matches attention's {bal.attention_ms:.2f} ms from A:F {bal.ratio:.2f}:1 up;"
            f" FFN compute alone would balance attention only at {bal.compute_ratio:.1f}:1. {here} stops where"
            f" {_ratio_limit(r, d)}."
        )
    chosen = d.attention_gpus / d.ffn_gpus
    head = (
        f"Balance: A:F = {bal.ratio:.2f}:1 makes the FFN take as long as attention ({bal.attention_ms:.2f} ms per"
        f" micro-batch)"
    )
    if abs(chosen / bal.ratio - 1) <= 0.25:
        return f"{head}; {here} is the cheapest whole-GPU plan near it."
    if chosen < bal.ratio:
        return f"{head}; {here} stops short of it: {_ratio_limit(r, d)}."
    return f"{head}; {here} goes beyond it: the cost per token is lower with the FFN as the slower side."


def _ffn_pool_reason(d: Deployment, facts: ModelFacts, hw_f, a: Assumptions) -> str:
    least = ffn_gpus_needed(facts, hw_f, a)
    base = f"The FFN weights ({_gb(facts.ffn_weight_bytes)}) need at least {least} {hw_f.name}"
    if d.ffn_gpus == least:
        return base + f", and that is what the plan uses ({_gb(d.ffn_memory_gb * GB)} each)."
    return (
        base + f"; {d.ffn_gpus} are used because spreading the weights means fewer bytes read per GPU"
        f" per micro-batch ({_gb(d.ffn_memory_gb * GB)} held each)."
    )


def _comm_reason(d: Deployment, link_bw: float) -> str:
    t = d.times_ms
    round_trip = f"the round trip ({t.comm:.2f} ms over the {d.link} at {link_bw / GB:.0f} GB/s)"
    if d.micro_batches == 1:
        return f"Communication: a batch of one cannot be split into micro-batches, so {round_trip} adds to every step."
    if d.micro_batches >= d.micro_batches_needed:
        return (
            f"Communication: m = {d.micro_batches} micro-batches >= 2(1 + Tc/Tf) = {d.micro_batches_needed:.2f}"
            f" (Tc {t.comm / 2:.2f} ms, Tf {t.ffn:.2f} ms per micro-batch, all layers) hide {round_trip}."
        )
    return (
        f"Communication binds: 2(1 + Tc/Tf) = {d.micro_batches_needed:.1f} micro-batches would be needed to hide"
        f" {round_trip}, but at most {d.micro_batches} are used, so part of it adds to the step."
    )


def _verdict(r: PlanResult) -> str:
    afd, mono = r.afd, r.best_monolithic
    if afd is None:
        reason = r.shortfalls[0].reason if r.shortfalls else "no AFD deployment meets the target"
        return f"AFD loses here because {reason}; run monolithic {mono.name} on {mono.attention_hw}."
    if mono is None:
        return "AFD is the only deployment that meets the target: " + "; ".join(s.reason for s in r.shortfalls) + "."
    if afd.cost_per_million_tokens is not None and mono.cost_per_million_tokens is not None:
        ours, theirs = afd.cost_per_million_tokens, mono.cost_per_million_tokens
        wins, figure = ours < theirs, f"${ours:.3g} vs ${theirs:.3g} per million tokens"
    else:
        ours, theirs = afd.tokens_per_gpu_s, mono.tokens_per_gpu_s
        wins, figure = ours > theirs, f"{ours:.0f} vs {theirs:.0f} tokens/GPU/s"
    vs = f"monolithic {mono.name} on {mono.attention_hw}"
    per_attention_gpu = afd.batch_per_gpu / afd.tpot_ms * 1e3
    pool = (
        f"each attention GPU decodes {per_attention_gpu:.0f} tokens/s against the monolith's"
        f" {mono.tokens_per_gpu_s:.0f} per GPU, and the FFN pool adds {afd.ffn_gpus / afd.attention_gpus:.0%}"
        f" more GPUs"
    )
    if wins:
        return f"AFD wins: {figure} against {vs}: {pool}."
    return f"AFD loses here because {_loss_reason(r, afd, pool)} ({figure} against {vs})."


def _loss_reason(r: PlanResult, afd: Deployment, pool: str) -> str:
    t = afd.times_ms
    if afd.micro_batches < afd.micro_batches_needed and t.comm > 0.3 * (t.attention + t.ffn):
        return (
            f"the attention-FFN round trip over the {afd.link} ({t.comm:.2f} ms per micro-batch) cannot be hidden"
            f" behind {t.ffn:.2f} ms of FFN work; {pool}"
        )
    tokens, used = _ffn_utilization(r, afd)
    if used < 0.5:
        held = "all its memory holds" if afd.batch_limit == "memory" else "all the TPOT target allows"
        weights = "expert weights" if any(layer.moe for layer in r.facts.layers) else "weights"
        return (
            f"the FFN GPUs spend their time reading {weights}, not computing ({used:.0%} of it computing):"
            f" {afd.batch_per_gpu} sequences per {afd.attention_hw} ({held}) on {afd.attention_gpus} attention GPUs"
            f" give only {tokens:.0f} tokens per micro-batch, and {_ratio_limit(r, afd)}; {pool}"
        )
    idle = 1 - min(t.attention, t.ffn) / max(t.attention, t.ffn) if max(t.attention, t.ffn) else 0
    if idle > 0.25:
        side = "FFN" if t.ffn < t.attention else "attention"
        return f"at {afd.name} the {side} side idles {idle:.0%} of each layer, and {_ratio_limit(r, afd)}; {pool}"
    return pool


def explain(r: PlanResult) -> list[str]:
    lines = []
    if r.afd is not None:
        d = r.afd
        lines.append(_batch_reason(d, r.facts, r.attention_hw, r.assumptions))
        lines.append(_side_reason(r, d))
        lines.append(_balance_reason(r, d))
        lines.append(_ffn_pool_reason(d, r.facts, r.ffn_hw, r.assumptions))
        lines.append(_comm_reason(d, _links(r, d)[0]))
        dtype = r.facts.weight_dtype
        if not (r.ffn_hw.runs_natively(dtype) and r.attention_hw.runs_natively(dtype)):
            lines.append(f"{dtype} weights run as weight-only quantization (bf16 math) where the chip lacks {dtype}.")
    lines.append(_verdict(r))
    return lines


def render(r: PlanResult) -> str:
    f, c = r.facts, r.facts.cost
    lines = [
        f"model {f.name}  context {f.context}  weights {f.weight_dtype}  KV {f.kv_dtype}"
        f"  TPOT target {r.tpot_target_ms:g} ms",
        "",
        f"what one decoded token costs ({f.layer_count} layers, whole model)",
        f"  {'':<30}{'attention side':>18}{'FFN side':>18}",
        f"  {'KV cache read':<30}{_gb(c.kv_bytes):>18}{'':>18}",
        f"  {'attention FLOPs (QK, PV)':<30}{_flops(c.attention_flops):>18}{'':>18}",
        f"  {'linear FLOPs (projections, head)':<30}{_flops(c.linear_flops):>18}{'':>18}",
        f"  {'FFN FLOPs (activated)':<30}{'':>18}{_flops(c.ffn_flops):>18}",
        f"  {'weights held':<30}{_gb(f.attention_weight_bytes):>18}{_gb(f.ffn_weight_bytes):>18}",
        f"  {'weights one token reads':<30}{_gb(f.attention_read_bytes):>18}{_gb(f.ffn_activated_bytes):>18}",
        f"  {'sent across the cut':<30}{_gb(c.cut_bytes_to_ffn) + ' out':>18}{_gb(c.cut_bytes_to_attn) + ' back':>18}",
        f"  attention formulation: {c.formulation}",
        "",
    ]
    if r.afd is not None:
        lines += _deployment_lines("recommended AFD", r.afd, r.attention_hw, r.ffn_hw)
    for d in r.monolithic:
        lines += _deployment_lines("monolithic", d, None, None)
    lines += [f"{s.deployment}: {s.reason}" for s in r.shortfalls]
    if lines[-1]:
        lines.append("")
    lines += ["why:"] + [f"- {line}" for line in r.explanation]
    lines.append("(prices are indicative; edit them with --hw-file)")
    return "\n".join(line.rstrip() for line in lines)


def _flops(x: float) -> str:
    return f"{x / 1e9:.3g} GFLOP" if x >= 1e8 else f"{x / 1e6:.3g} MFLOP" if x >= 1e5 else f"{x:.0f} FLOP"


def _deployment_lines(title: str, d: Deployment, hw_a, hw_f) -> list[str]:
    if d.kind == "afd":
        head = f"{title}: {d.name} = {d.attention_gpus} x {hw_a.name} attention + {d.ffn_gpus} x {hw_f.name} FFN"
    else:
        head = f"{title}: {d.name} on {d.gpus} x {d.attention_hw} (DP attention + EP FFN on every GPU)"
    cost = f"${d.cost_per_million_tokens:.3g} per million output tokens" if d.cost_per_million_tokens else "no price"
    t = d.times_ms
    return [
        head,
        f"  batch per attention GPU   {d.batch_per_gpu} (memory allows {d.max_batch_memory}; bound by {d.batch_limit})",
        f"  micro-batches             {d.micro_batches}"
        + (f" (needs >= 2(1 + Tc/Tf) = {d.micro_batches_needed:.2f})" if d.kind == "afd" else ""),
        f"  per micro-batch, all layers: attention {t.attention:.2f} ms, FFN {t.ffn:.2f} ms,"
        f" transfer {t.to_ffn:.2f} + {t.to_attn:.2f} ms ({d.link})",
        f"  predicted TPOT            {d.tpot_ms:.1f} ms",
        f"  throughput                {d.tokens_per_gpu_s:.0f} tokens/GPU/s"
        f" ({d.tokens_per_s:.0f} tokens/s on {d.gpus} GPUs)",
        f"  cost                      {cost}",
        f"  memory per GPU            attention {d.attention_memory_gb:.1f} GB"
        + (f", FFN {d.ffn_memory_gb:.1f} GB" if d.kind == "afd" else ""),
        "",
    ]


# --------------------------------------------------------------------------- plot


def require_matplotlib():
    """pyplot on a file-only backend, or a PlanError saying how to install it."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:
        raise PlanError("--plot needs matplotlib: pip install 'afdc[plot]' (or pip install matplotlib)") from err
    return plt


def plot(
    result: PlanResult, points_by_context: dict[int, PlanResult], ratio_curve: list[tuple[float, float]], path: str
) -> None:
    """Throughput against context length (AFD and monolithic) and, at ``result``'s context and
    FFN pool, against the A:F ratio."""
    plt = require_matplotlib()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    contexts = sorted(points_by_context)
    afd = [points_by_context[c].afd.tokens_per_gpu_s if points_by_context[c].afd else float("nan") for c in contexts]
    left.plot(contexts, afd, "o-", label="AFD (best xAyF)")
    names = sorted({d.attention_hw for r in points_by_context.values() for d in r.monolithic})
    for hw in names:
        ys = [
            next((d.tokens_per_gpu_s for d in points_by_context[c].monolithic if d.attention_hw == hw), float("nan"))
            for c in contexts
        ]
        left.plot(contexts, ys, "s--", label=f"monolithic on {hw}")
    left.set_xscale("log", base=2)
    left.set_yscale("log")
    left.set_xlabel("context length (tokens)")
    left.set_ylabel("tokens / GPU / s")
    left.legend()
    left.grid(alpha=0.3)
    chosen = result.afd
    if ratio_curve:
        xs, ys = zip(*ratio_curve)
        right.plot(xs, ys, "o-" if len(xs) < 40 else "-", label="best batch at each ratio")
    if chosen is not None:
        right.axvline(chosen.attention_gpus / chosen.ffn_gpus, color="gray", ls=":", label=f"plan {chosen.name}")
        right.legend()
    right.set_xlabel(f"A:F ratio (attention GPUs per FFN GPU) at context {result.facts.context}")
    right.set_ylabel("tokens / GPU / s")
    right.grid(alpha=0.3)
    fig.suptitle(
        f"{result.facts.name}: {result.attention_hw.name} attention, {result.ffn_hw.name} FFN,"
        f" TPOT {result.tpot_target_ms:g} ms"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def ratio_curve(facts, hw_a, hw_f, y: int, tpot_ms: float, a: Assumptions | None = None) -> list[tuple[float, float]]:
    """(x / y, tokens/GPU/s) for x = 1 .. the largest x that still meets the target."""
    a = a or Assumptions()
    out = []
    for x in range(1, a.max_attention_per_ffn_gpu * y + 1):
        d = afd_deployment(facts, hw_a, hw_f, x, y, tpot_ms / 1e3, a)
        if d is None:
            break
        out.append((x / y, d.tokens_per_gpu_s))
    return out
