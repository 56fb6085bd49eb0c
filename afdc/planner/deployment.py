"""A deployment, ``xAyF`` (AFD) or ``EPn`` (monolithic), and its decode step at a batch.

A step pipelines micro-batches through each layer's attention, FFN and the two transfers between
them (:mod:`afdc.planner` gives the model); a deployment decodes the largest batch whose step meets
the TPOT target.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from afdc.planner.facts import LayerFacts, ModelFacts
from afdc.planner.hardware import HardwareProfile, dtype_bytes
from afdc.planner.interconnect import link_name, local_share, round_time, shared_domain, two_stage_round_time
from afdc.planner.roofline import (
    GB,
    Assumptions,
    attention_batch_memory,
    attention_time,
    busiest,
    expected_distinct,
    fan_out,
    ffn_memory,
    ffn_time,
    usable_memory,
)


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

    kind: str  # "afd", "monolithic" (DP attention + EP) or "tp" (the whole model tensor-parallel)
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
        return f"{'TP' if self.kind == 'tp' else 'EP'}{self.attention_gpus}"

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_gpu_s * self.gpus


@dataclass(frozen=True)
class Step:
    """One decode step of a deployment at one batch: its TPOT (s), micro-batches, MegaScale-Infer's
    2(1 + Tc/Tf) (AFD only) and its per-micro-batch times."""

    tpot: float
    micro_batches: int
    needed: float | None
    times: LayerTimes


def afd_local_share(hw_a: HardwareProfile, hw_f: HardwareProfile, gpus: int) -> float:
    """Share of an attention GPU's FFN peers inside its scale-up domain (0 for two chips)."""
    return local_share(gpus, hw_a.scale_up_domain) if shared_domain(hw_a, hw_f) else 0.0


def cut_link(hw_a: HardwareProfile, hw_f: HardwareProfile, gpus: int) -> tuple[str, float, float]:
    """What carries the AFD exchange among ``gpus`` GPUs, and the bandwidth of each end's main
    fabric: the interconnect within one scale-up domain, else (mostly) the NIC."""
    local = afd_local_share(hw_a, hw_f, gpus)
    if local >= 1:
        return link_name(local), hw_a.interconnect_bandwidth, hw_f.interconnect_bandwidth
    return link_name(local), hw_a.nic_bandwidth, hw_f.nic_bandwidth


def dispatch_bytes(facts: ModelFacts, layer: LayerFacts, a: Assumptions) -> float:
    """Bytes of one token's hidden state on its way to the FFN, at the dispatch dtype."""
    if a.dispatch_dtype is None:
        return layer.to_ffn_bytes
    return layer.to_ffn_bytes * dtype_bytes(a.dispatch_dtype) / facts.cut_element_bytes


def _afd_layer(facts, hw_a, hw_f, x, y, b, a: Assumptions) -> list[tuple[int, float, float, float, float]]:
    """Per layer class (count, attention, ffn, to ffn, to attention) for micro-batches of ``b``."""
    local = afd_local_share(hw_a, hw_f, x + y)
    rows = []
    for layer in facts.layers:
        t_a = attention_time(layer, hw_a, facts.weight_dtype, b, a)
        t_f = ffn_time(layer, hw_f, facts.weight_dtype, y, busiest(layer, x * b, a), a)
        copies = b * fan_out(layer, y, a.dense_ffn)  # hidden states one attention GPU sends per micro-batch
        load = busiest(layer, x / y, a)  # attention GPUs' worth of traffic the busiest FFN GPU carries
        if a.two_stage_exchange and local < 1:
            domains = math.ceil(y / hw_f.scale_up_domain)
            # one copy per FFN domain holding any of the token's experts (all of them for a dense FFN)
            nodes = b * (expected_distinct(domains, 1 / domains, layer.top_k) if layer.moe else domains)
            to_ffn = _two_stage_time(copies, nodes, dispatch_bytes(facts, layer, a), load, local, hw_a, hw_f, a)
            to_attn = _two_stage_time(copies, nodes, layer.to_attn_bytes, load, local, hw_a, hw_f, a)
        else:
            to_ffn = _m2n_time(copies * dispatch_bytes(facts, layer, a), load, local, hw_a, hw_f, a)
            to_attn = _m2n_time(copies * layer.to_attn_bytes, load, local, hw_a, hw_f, a)
        rows.append((layer.count, t_a, t_f, to_ffn, to_attn))
    return rows


def _m2n_time(per_attention_gpu: float, load: float, local: float, hw_a, hw_f, a: Assumptions) -> float:
    """Both ends of the many-to-many: an attention GPU's links, and an FFN GPU's carrying
    ``load`` attention GPUs' worth (the Baidu roofline's scale-out cap on the FFN batch)."""
    eff = a.network_efficiency
    return max(round_time(per_attention_gpu, local, hw_a, eff), round_time(load * per_attention_gpu, local, hw_f, eff))


def _two_stage_time(copies, nodes, nbytes, load, local, hw_a, hw_f, a: Assumptions) -> float:
    """:func:`_m2n_time` with the exchange in two stages: ``nodes`` copies cross the NIC,
    ``copies`` the receiving domain's interconnect (the attention GPU's own interconnect carries
    nothing: it sends each domain's copy once)."""
    eff = a.network_efficiency
    sender = round_time(nodes * nbytes, local, hw_a, eff)
    receiver = two_stage_round_time(load * copies * nbytes, load * nodes * nbytes, local, hw_f, eff)
    return max(sender, receiver)


def _sum_times(rows) -> LayerTimes:
    return LayerTimes(*(sum(r[0] * r[i] for r in rows) for i in range(1, 5)))


def afd_step(
    facts: ModelFacts, hw_a: HardwareProfile, hw_f: HardwareProfile, x: int, y: int, batch: int, a: Assumptions
) -> Step:
    """TPOT of ``xAyF`` at ``batch`` sequences per attention GPU, micro-batches chosen by
    MegaScale-Infer's rule m >= 2(1 + Tc/Tf), Tc the one-way transfer, Tf the FFN time (or
    fixed by :attr:`Assumptions.micro_batches`)."""
    m_max = max(1, min(a.max_micro_batches, batch))
    first = min(2, m_max)
    if a.micro_batches is not None:
        first = m_max = max(1, min(a.micro_batches, batch))
    chosen = None
    for m in range(first, m_max + 1):
        rows = _afd_layer(facts, hw_a, hw_f, x, y, batch / m, a)
        t = _sum_times(rows)
        needed = 2 * (1 + (t.comm / 2) / t.ffn) if t.ffn > 0 else 2.0
        chosen = (m, needed, rows, t)
        if m >= needed:
            break
    m, needed, rows, t = chosen
    # light-llm-simulator: a micro-batch's round trip, or m turns of the slowest stage; the links
    # are stages too (m transfers each way share them), or bandwidth would pass for latency only
    tpot = sum(c * max(ta + tf + c1 + c2, m * max(ta, tf, c1, c2)) for c, ta, tf, c1, c2 in rows)
    return Step(tpot, m, needed, t)


def mono_step(facts: ModelFacts, hw: HardwareProfile, gpus: int, batch: int, a: Assumptions) -> Step:
    """TPOT of DP attention + EP FFN on ``gpus`` GPUs: attention and FFN share each GPU, so only
    the dispatch and combine overlap with compute (two-batch overlap when it pays). The all-to-all
    runs over the same fabrics as AFD's exchange: the scale-up domain, and the NIC beyond it."""
    local = local_share(gpus, hw.scale_up_domain)
    eff = a.network_efficiency
    best = None
    for m in range(1, min(2, batch) + 1):
        b, rows = batch / m, []
        for layer in facts.layers:
            t_a = attention_time(layer, hw, facts.weight_dtype, b, a)
            t_f = ffn_time(layer, hw, facts.weight_dtype, gpus, busiest(layer, gpus * b, a), a)
            # copies that leave the GPU (the local rank costs no transfer); the busiest GPU
            # receives the skew's share more
            remote = b * fan_out(layer, gpus, a.dense_ffn) * (gpus - 1) / gpus * busiest(layer, 1.0, a)
            c1 = round_time(remote * dispatch_bytes(facts, layer, a), local, hw, eff)
            c2 = round_time(remote * layer.to_attn_bytes, local, hw, eff)
            rows.append((layer.count, t_a, t_f, c1, c2))
        tpot = sum(c * max(m * (ta + tf), m * (c1 + c2), ta + tf + c1 + c2) for c, ta, tf, c1, c2 in rows)
        if best is None or tpot < best.tpot:
            best = Step(tpot, m, None, _sum_times(rows))
    return best


def tp_step(facts: ModelFacts, hw: HardwareProfile, gpus: int, batch: int, a: Assumptions) -> Step:
    """TPOT of the whole model tensor-parallel over ``gpus`` GPUs of one scale-up domain
    (TensorRT-LLM's or vLLM's TP, the baseline MegaScale-Infer measured against), ``batch``
    sequences per GPU: every GPU reads its 1/n of each weight the batch touches and of the KV
    cache (KV heads sharded, no copies), and each layer all-reduces its attention and FFN outputs
    over the interconnect (a ring: 2(n - 1)/n of the bytes each way, one message latency each).
    Nothing overlaps: the two all-reduces sit between the halves."""
    total = gpus * batch
    eff = a.network_efficiency
    rows = []
    for layer in facts.layers:
        read = layer.attention_weight_bytes / gpus + batch * layer.kv_read
        flops = total * (layer.attention_flops / hw.flops("bf16") + layer.linear_flops / hw.flops(facts.weight_dtype))
        t_a = max(read / (hw.hbm_bandwidth * a.hbm_efficiency), flops / gpus / a.compute_efficiency)
        t_f = ffn_time(layer, hw, facts.weight_dtype, gpus, busiest(layer, total, a), a, tensor_parallel=True)
        ring = 2 * (gpus - 1) / gpus * total * layer.to_attn_bytes if gpus > 1 else 0.0
        reduce = ring / (hw.interconnect_bandwidth * eff) + hw.scale_up_latency if ring else 0.0
        rows.append((layer.count, t_a, t_f, reduce, reduce))
    tpot = sum(c * (ta + tf + c1 + c2) for c, ta, tf, c1, c2 in rows)
    return Step(tpot, 1, None, _sum_times(rows))


def largest(ok: Callable[[int], bool], hi: int) -> int:
    """The largest n in [1, hi] with ok(n), for ok true up to some n and false after (0: none)."""
    lo, best = 1, 0
    while lo <= hi:
        mid = (lo + hi) // 2
        if ok(mid):
            best, lo = mid, mid + 1
        else:
            hi = mid - 1
    return best


def _cost(tokens_per_s: float, dollars_per_hour: float | None) -> float | None:
    if dollars_per_hour is None or tokens_per_s <= 0:
        return None
    return dollars_per_hour / 3600 / tokens_per_s * 1e6


def _deployment(kind, hw_a, hw_f, x, y, batch, cap, point: Step, link, facts, fmem) -> Deployment:
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
        attention_memory_gb=(
            facts.attention_weight_bytes / (x if kind == "tp" else 1)
            + batch * facts.kv_bytes
            + (fmem if kind != "afd" else 0)
        )
        / GB,
        ffn_memory_gb=fmem / GB,
    )


def afd_deployment(
    facts: ModelFacts, hw_a: HardwareProfile, hw_f: HardwareProfile, x: int, y: int, target: float, a: Assumptions
) -> Deployment | None:
    """``xAyF`` with the largest attention batch meeting the TPOT target (None: none does)."""
    cap = attention_batch_memory(facts, hw_a, a)
    batch = largest(lambda b: afd_step(facts, hw_a, hw_f, x, y, b, a).tpot <= target, cap)
    if batch == 0:
        return None
    point = afd_step(facts, hw_a, hw_f, x, y, batch, a)
    link = cut_link(hw_a, hw_f, x + y)[0]
    return _deployment("afd", hw_a, hw_f, x, y, batch, cap, point, link, facts, ffn_memory(facts, y, a))


def mono_deployment(
    facts: ModelFacts, hw: HardwareProfile, gpus: int, target: float, a: Assumptions
) -> Deployment | None:
    """``EPn`` on ``gpus`` GPUs with the largest batch meeting the TPOT target (None: none does)."""
    fmem = ffn_memory(facts, gpus, a)
    cap = attention_batch_memory(facts, hw, a, fmem)
    batch = largest(lambda b: mono_step(facts, hw, gpus, b, a).tpot <= target, cap)
    if batch == 0:
        return None
    point = mono_step(facts, hw, gpus, batch, a)
    link = link_name(local_share(gpus, hw.scale_up_domain))
    return _deployment("monolithic", hw, hw, gpus, 0, batch, cap, point, link, facts, fmem)


def tp_deployment(
    facts: ModelFacts, hw: HardwareProfile, gpus: int, target: float, a: Assumptions
) -> Deployment | None:
    """``TPn``: the whole model split over ``gpus`` GPUs of one scale-up domain, with the largest
    batch meeting the target (None: none does, or the GPUs span more than one domain)."""
    if gpus > hw.scale_up_domain:
        return None
    weights = (facts.attention_weight_bytes + facts.ffn_weight_bytes) / gpus
    free = usable_memory(hw, a) - weights
    cap = max(int(free // facts.kv_bytes), 0) if facts.kv_bytes > 0 else 0
    batch = largest(lambda b: tp_step(facts, hw, gpus, b, a).tpot <= target, cap)
    if batch == 0:
        return None
    point = tp_step(facts, hw, gpus, batch, a)
    return _deployment("tp", hw, hw, gpus, 0, batch, cap, point, "interconnect", facts, facts.ffn_weight_bytes / gpus)


def better(d: Deployment | None, best: Deployment | None) -> bool:
    """Lower cost per token wins; without prices, more tokens per GPU."""
    if d is None:
        return False
    if best is None:
        return True
    if d.cost_per_million_tokens is not None and best.cost_per_million_tokens is not None:
        return d.cost_per_million_tokens < best.cost_per_million_tokens
    return d.tokens_per_gpu_s > best.tokens_per_gpu_s
