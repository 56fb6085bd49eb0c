"""A deployment, ``xAyF`` (AFD) or ``EPn`` (monolithic), and its decode step at a batch.

A step pipelines micro-batches through each layer's attention, FFN and the two transfers between
them (:mod:`afdc.planner` gives the model); a deployment decodes the largest batch whose step meets
the TPOT target.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from afdc.planner.facts import ModelFacts
from afdc.planner.hardware import HardwareProfile
from afdc.planner.roofline import (
    GB,
    Assumptions,
    attention_batch_memory,
    attention_time,
    fan_out,
    ffn_memory,
    ffn_time,
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
class Step:
    """One decode step of a deployment at one batch: its TPOT (s), micro-batches, MegaScale-Infer's
    2(1 + Tc/Tf) (AFD only) and its per-micro-batch times."""

    tpot: float
    micro_batches: int
    needed: float | None
    times: LayerTimes


def cut_link(hw_a: HardwareProfile, hw_f: HardwareProfile, gpus: int) -> tuple[str, float, float]:
    """Same chip within one scale-up domain: the interconnect; otherwise the NIC."""
    if hw_a.name == hw_f.name and gpus <= hw_a.scale_up_domain:
        return "interconnect", hw_a.interconnect_bandwidth, hw_f.interconnect_bandwidth
    return "NIC", hw_a.nic_bandwidth, hw_f.nic_bandwidth


def _afd_layer(facts, hw_a, hw_f, x, y, b, a: Assumptions) -> tuple[list[tuple[int, float, float, float, float]], str]:
    """Per layer class (count, attention, ffn, to ffn, to attention) for micro-batches of ``b``."""
    link, bw_a, bw_f = cut_link(hw_a, hw_f, x + y)
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


def afd_step(
    facts: ModelFacts, hw_a: HardwareProfile, hw_f: HardwareProfile, x: int, y: int, batch: int, a: Assumptions
) -> Step:
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
    return Step(tpot, m, needed, t)


def mono_step(facts: ModelFacts, hw: HardwareProfile, gpus: int, batch: int, a: Assumptions) -> Step:
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
            best = Step(tpot, m, None, _sum_times(rows))
    return best


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
        attention_memory_gb=(facts.attention_weight_bytes + batch * facts.kv_bytes + (fmem if kind != "afd" else 0))
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
    link = "interconnect" if gpus <= hw.scale_up_domain else "NIC"
    return _deployment("monolithic", hw, hw, gpus, 0, batch, cap, point, link, facts, fmem)


def better(d: Deployment | None, best: Deployment | None) -> bool:
    """Lower cost per token wins; without prices, more tokens per GPU."""
    if d is None:
        return False
    if best is None:
        return True
    if d.cost_per_million_tokens is not None and best.cost_per_million_tokens is not None:
        return d.cost_per_million_tokens < best.cost_per_million_tokens
    return d.tokens_per_gpu_s > best.tokens_per_gpu_s
