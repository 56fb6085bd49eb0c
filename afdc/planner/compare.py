"""``afdc plan --compare``: AFD ``xAyF`` against the EP baseline over A:F ratios and context lengths.

For each context and ratio r, ``xAyF`` has x = round(r * y) for the FFN pool ``ffn_gpus``, or
for the best of the pools the plan search tries (the fewest GPUs that hold the FFN weights times
:attr:`Assumptions.ffn_pool_multiples`: more FFN GPUs each read fewer experts); the EP baseline (DP attention and
expert-parallel FFN on the same chips) is ``EPn`` for a given n, or the best n the search finds.
Each deployment decodes the largest batch its memory and the TPOT target allow, and the two are
set side by side in tokens per GPU per second: the metric the published AFD results use.

The margin splits exactly into three factors, which are the reasons printed:
``AFD / EP = (batch ratio) x (step-time ratio) x x / (x + y)``: how many more sequences an
attention GPU holds (it keeps no experts), how much faster or slower its step is (attention and
FFN overlap, but the exchange may not hide), and the share of GPUs that decode no sequence at all.
"""

from __future__ import annotations

from dataclasses import dataclass

from afdc.errors import PlanError
from afdc.planner.deployment import Deployment, afd_deployment, mono_deployment
from afdc.planner.facts import ModelFacts
from afdc.planner.hardware import HardwareProfile
from afdc.planner.result import format_ms
from afdc.planner.roofline import Assumptions, ffn_gpus_needed
from afdc.planner.search import best_mono, pool_sizes


@dataclass(frozen=True)
class Point:
    """One ``xAyF`` against the EP baseline at one context."""

    context: int
    ratio: float  # the A:F asked for; afd's own x / y may round it
    afd: Deployment | None  # None: meets the target at no batch
    ep: Deployment | None

    @property
    def margin(self) -> float | None:
        """AFD's tokens/GPU/s over EP's, less 1 (None when either cannot run)."""
        if self.afd is None or self.ep is None:
            return None
        return self.afd.tokens_per_gpu_s / self.ep.tokens_per_gpu_s - 1

    @property
    def winner(self) -> str:
        m = self.margin
        if m is None:
            return "EP" if self.afd is None and self.ep is not None else "AFD" if self.afd is not None else "none"
        return "AFD" if m > 0 else "EP"


@dataclass(frozen=True)
class Comparison:
    """Every point of the sweep, by context then ratio."""

    model: str
    attention_hw: HardwareProfile
    ffn_hw: HardwareProfile
    tpot_target_ms: float
    points: tuple[Point, ...]
    assumptions: Assumptions

    @property
    def contexts(self) -> list[int]:
        return sorted({p.context for p in self.points})

    def at(self, context: int) -> list[Point]:
        return [p for p in self.points if p.context == context]

    def best(self, context: int) -> Point | None:
        """The ratio at which AFD does best against EP at ``context``."""
        scored = [p for p in self.at(context) if p.margin is not None]
        return max(scored, key=lambda p: p.margin) if scored else None

    def dead_zone(self, context: int) -> list[float]:
        """Ratios at which AFD loses to EP (or cannot run) at ``context``."""
        return [p.ratio for p in self.at(context) if p.winner != "AFD"]

    def to_dict(self) -> dict:
        return {
            "model": self.model,
            "attention_hw": self.attention_hw.name,
            "ffn_hw": self.ffn_hw.name,
            "tpot_target_ms": self.tpot_target_ms,
            "points": [
                {
                    "context": p.context,
                    "ratio": p.ratio,
                    "afd": p.afd.name if p.afd else None,
                    "afd_tokens_per_gpu_s": p.afd.tokens_per_gpu_s if p.afd else None,
                    "ep": p.ep.name if p.ep else None,
                    "ep_tokens_per_gpu_s": p.ep.tokens_per_gpu_s if p.ep else None,
                    "margin": p.margin,
                    "winner": p.winner,
                }
                for p in self.points
            ],
            "verdicts": [verdict(self, c) for c in self.contexts],
        }

    def __str__(self) -> str:
        return render(self)


def compare(
    facts_by_context: dict[int, ModelFacts],
    hw_a: HardwareProfile,
    hw_f: HardwareProfile,
    ratios: list[float],
    tpot_ms: float,
    a: Assumptions | None = None,
    ffn_gpus: int | None = None,
    ep_gpus: int | None = None,
) -> Comparison:
    """AFD at each ratio against the EP baseline, at each context of ``facts_by_context``."""
    a = a or Assumptions()
    if tpot_ms <= 0:
        raise PlanError(f"TPOT target must be positive, got {tpot_ms} ms")
    if not ratios or min(ratios) <= 0:
        raise PlanError(f"A:F ratios must be positive numbers, got {ratios}")
    target = tpot_ms / 1e3
    points = []
    name = ""
    for context in sorted(facts_by_context):
        facts = facts_by_context[context]
        name = facts.name
        least = ffn_gpus_needed(facts, hw_f, a)
        if least is None:
            raise PlanError(f"the FFN weights ({facts.ffn_weight_bytes / 1e9:.0f} GB) fit on no number of {hw_f.name}")
        pools = [ffn_gpus] if ffn_gpus else pool_sizes(least, a.ffn_pool_multiples)
        ep = mono_deployment(facts, hw_f, ep_gpus, target, a) if ep_gpus else best_mono(facts, hw_f, target, a)
        for r in sorted(set(ratios)):
            best = None
            for y in pools:
                d = afd_deployment(facts, hw_a, hw_f, max(1, round(r * y)), y, target, a)
                if d is not None and (best is None or d.tokens_per_gpu_s > best.tokens_per_gpu_s):
                    best = d
            points.append(Point(context, r, best, ep))
    return Comparison(name, hw_a, hw_f, tpot_ms, tuple(points), a)


def factors(p: Point) -> tuple[float, float, float]:
    """(batch ratio, step-time ratio, share of GPUs decoding): their product is 1 + margin."""
    afd, ep = p.afd, p.ep
    return afd.batch_per_gpu / ep.batch_per_gpu, ep.tpot_ms / afd.tpot_ms, afd.attention_gpus / afd.gpus


def _stage(d: Deployment) -> str:
    """The slowest stage of a deployment's step, per micro-batch over all layers."""
    t = d.times_ms
    stages = {"attention": t.attention, "FFN": t.ffn, f"exchange ({d.link})": max(t.to_ffn, t.to_attn)}
    if d.kind != "afd":
        stages = {"attention + FFN": t.attention + t.ffn, f"all-to-all ({d.link})": t.to_ffn + t.to_attn}
    slow = max(stages, key=stages.get)
    return f"{slow} {format_ms(stages[slow])}"


def reasons(p: Point) -> list[str]:
    """Why AFD wins or loses at one point, as the three factors of the margin and what binds each side."""
    if p.afd is None:
        return [f"no {p.ratio:g}:1 deployment meets the TPOT target at any batch"]
    if p.ep is None:
        return ["the EP baseline meets the TPOT target at no batch"]
    afd, ep = p.afd, p.ep
    batch, step, share = factors(p)
    return [
        f"batch x{batch:.2f}: {afd.batch_per_gpu} sequences per attention GPU (bound by {afd.batch_limit})"
        f" against {ep.batch_per_gpu} per EP GPU (bound by {ep.batch_limit}; its memory also holds"
        f" {ep.ffn_memory_gb:.1f} GB of FFN weights)",
        f"step x{step:.2f}: AFD {afd.tpot_ms:.1f} ms ({afd.micro_batches} micro-batches, slowest stage"
        f" {_stage(afd)}) against EP {ep.tpot_ms:.1f} ms ({_stage(ep)})",
        f"GPUs decoding x{share:.2f}: {afd.ffn_gpus} of {afd.gpus} GPUs hold the FFN and decode no sequence",
    ]


def verdict(c: Comparison, context: int) -> str:
    best = c.best(context)
    if best is None:
        return f"context {context}: no AFD ratio meets the target beside EP"
    lost = c.dead_zone(context)
    zone = f"; AFD loses at {', '.join(f'{r:g}:1' for r in lost)}" if lost else ""
    if best.winner == "AFD":
        head = (
            f"context {context}: AFD wins at {best.afd.name} ({best.ratio:g}:1), {best.margin:+.1%} tokens/GPU/s"
            f" against {best.ep.name}"
        )
    else:
        head = (
            f"context {context}: AFD loses at every ratio; its best, {best.afd.name} ({best.ratio:g}:1), is"
            f" {best.margin:+.1%} against {best.ep.name}"
        )
    return head + zone


def render(c: Comparison) -> str:
    lines = [
        f"model {c.model}  attention {c.attention_hw.name}  FFN {c.ffn_hw.name}  TPOT target {c.tpot_target_ms:g} ms",
        f"micro-batches {c.assumptions.micro_batches or 'by 2(1 + Tc/Tf)'}  expert skew {c.assumptions.expert_skew:g}"
        f"  dispatch dtype {c.assumptions.dispatch_dtype or 'model dtype'}"
        f"  exchange {'two-stage' if c.assumptions.two_stage_exchange else 'one copy per FFN GPU'}",
        "",
        f"{'context':>8} {'A:F':>5} {'AFD':>9} {'tok/GPU/s':>10} {'EP':>6} {'tok/GPU/s':>10} {'margin':>8}  winner",
    ]
    for p in c.points:
        afd = f"{p.afd.name:>9} {p.afd.tokens_per_gpu_s:>10.1f}" if p.afd else f"{'-':>9} {'-':>10}"
        ep = f"{p.ep.name:>6} {p.ep.tokens_per_gpu_s:>10.1f}" if p.ep else f"{'-':>6} {'-':>10}"
        margin = f"{p.margin:>+8.1%}" if p.margin is not None else f"{'-':>8}"
        lines.append(f"{p.context:>8} {p.ratio:>4g}: {afd} {ep} {margin}  {p.winner}")
    lines.append("")
    for context in c.contexts:
        lines.append(verdict(c, context))
        best = c.best(context)
        if best is not None:
            lines += [f"  - {r}" for r in reasons(best)]
    return "\n".join(lines)
