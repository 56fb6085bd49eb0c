"""Why a plan came out as it did: what binds the batch, each side, the A:F balance, the FFN pool,
the communication, and whether AFD beats the monolithic rival."""

from __future__ import annotations

from afdc.planner.deployment import Deployment, cut_link
from afdc.planner.facts import ModelFacts
from afdc.planner.hardware import HardwareProfile
from afdc.planner.result import PlanResult, format_bytes, format_ms
from afdc.planner.roofline import GB, Assumptions, ffn_gpus_needed, ffn_time, usable_memory


def _batch_reason(d: Deployment, facts: ModelFacts, hw: HardwareProfile, a: Assumptions) -> str:
    where = f"{d.batch_per_gpu} sequences per {hw.name}"
    if d.batch_limit == "memory":
        weights = facts.attention_weight_bytes + (d.ffn_memory_gb * GB if d.kind != "afd" else 0)
        return (
            f"Memory capacity binds the batch: {where} is all that fits (weights {format_bytes(weights)} + "
            f"{d.batch_per_gpu} x {format_bytes(facts.kv_bytes)} KV at {facts.context} tokens within"
            f" {format_bytes(usable_memory(hw, a))} usable = {hw.hbm_capacity / GB:.0f} GB less"
            f" {a.activation_reserve:.0%} reserve); the TPOT target has slack ({d.tpot_ms:.1f} ms)."
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
    _, bw_a, bw_f = cut_link(r.attention_hw, r.ffn_hw, d.gpus)
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
            f"Balance: {on} reading {weights} alone takes {format_ms(bal.ffn_read_ms)} per micro-batch, more than"
            f" attention's {format_ms(bal.attention_ms)} at any A:F; {here} is set by cost instead, where"
            f" {_ratio_limit(r, d)}."
        )
    if bal.ratio is None:
        return (
            f"Balance: the FFN would keep up with attention ({format_ms(bal.attention_ms)} per micro-batch) up to"
            f" {bal.compute_ratio:.0f}:1; {here} stops where {_ratio_limit(r, d)}."
        )
    if bal.read_bound:
        return (
            f"Balance: {on} the FFN reads {weights} in about {format_ms(bal.ffn_read_ms)} per micro-batch whatever"
            f" the token count, which matches attention's {format_ms(bal.attention_ms)} from A:F {bal.ratio:.2f}:1 up;"
            f" FFN compute alone would balance attention only at {bal.compute_ratio:.1f}:1. {here} stops where"
            f" {_ratio_limit(r, d)}."
        )
    chosen = d.attention_gpus / d.ffn_gpus
    head = (
        f"Balance: A:F = {bal.ratio:.2f}:1 makes the FFN take as long as attention ({format_ms(bal.attention_ms)} per"
        f" micro-batch)"
    )
    if abs(chosen / bal.ratio - 1) <= 0.25:
        return f"{head}; {here} is the cheapest whole-GPU plan near it."
    if chosen < bal.ratio:
        return f"{head}; {here} stops short of it: {_ratio_limit(r, d)}."
    return f"{head}; {here} goes beyond it: the cost per token is lower with the FFN as the slower side."


def _ffn_pool_reason(d: Deployment, facts: ModelFacts, hw_f: HardwareProfile, a: Assumptions) -> str:
    least = ffn_gpus_needed(facts, hw_f, a)
    base = f"The FFN weights ({format_bytes(facts.ffn_weight_bytes)}) need at least {least} {hw_f.name}"
    if d.ffn_gpus == least:
        return base + f", and that is what the plan uses ({format_bytes(d.ffn_memory_gb * GB)} each)."
    return (
        base + f"; {d.ffn_gpus} are used because spreading the weights means fewer bytes read per GPU"
        f" per micro-batch ({format_bytes(d.ffn_memory_gb * GB)} held each)."
    )


def _comm_reason(d: Deployment, link_bw: float) -> str:
    t = d.times_ms
    round_trip = f"the round trip ({format_ms(t.comm)} over the {d.link} at {link_bw / GB:.0f} GB/s)"
    if d.micro_batches == 1:
        return f"Communication: a batch of one cannot be split into micro-batches, so {round_trip} adds to every step."
    if d.micro_batches >= d.micro_batches_needed:
        return (
            f"Communication: m = {d.micro_batches} micro-batches >= 2(1 + Tc/Tf) = {d.micro_batches_needed:.2f}"
            f" (Tc {format_ms(t.comm / 2)}, Tf {format_ms(t.ffn)} per micro-batch, all layers) hide {round_trip}."
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
            f"the attention-FFN round trip over the {afd.link} ({format_ms(t.comm)} per micro-batch) cannot be hidden"
            f" behind {format_ms(t.ffn)} of FFN work; {pool}"
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
    """One sentence per reason, the verdict last (AFD or monolithic, and why)."""
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
