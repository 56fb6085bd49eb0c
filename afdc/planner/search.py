"""Plan search: the cheapest ``xAyF`` meeting a TPOT target, the monolithic deployment to beat, and
why a deployment falls short.

For each FFN pool (the fewest GPUs that hold the FFN weights, times :attr:`Assumptions.ffn_pool_multiples`)
the search scans the attention pool x; each ``xAyF`` decodes the largest batch that meets the target.
Cheaper per token wins; without prices, more tokens per GPU.
"""

from __future__ import annotations

from dataclasses import replace

from afdc.errors import PlanError
from afdc.planner.deployment import Deployment, afd_deployment, afd_step, better, mono_deployment, mono_step
from afdc.planner.explain import explain
from afdc.planner.facts import ModelFacts
from afdc.planner.hardware import HardwareProfile
from afdc.planner.result import PlanResult, Shortfall
from afdc.planner.roofline import GB, Assumptions, attention_batch_memory, balance, ffn_gpus_needed, usable_memory


def pool_sizes(least: int, multiples: tuple[int, ...]) -> list[int]:
    return sorted({least * k for k in multiples})


def best_afd(
    facts: ModelFacts, hw_a: HardwareProfile, hw_f: HardwareProfile, target: float, a: Assumptions
) -> Deployment | None:
    """The best ``xAyF`` over the FFN pools searched (None: no pool meets the target in ``target`` seconds)."""
    least = ffn_gpus_needed(facts, hw_f, a)
    if least is None or attention_batch_memory(facts, hw_a, a) < 1:
        return None
    best = None
    for y in pool_sizes(least, a.ffn_pool_multiples):
        d = _best_x(facts, hw_a, hw_f, y, target, a)
        if better(d, best):
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
        if better(d, best):
            best, misses = d, 0
        else:
            misses += 1
            if misses >= 6:
                break
    if best is None or step == 1:
        return best
    for x in range(max(1, best.attention_gpus - step + 1), best.attention_gpus + step):
        d = afd_deployment(facts, hw_a, hw_f, x, y, target, a)
        if better(d, best):
            best = d
    return best


def best_mono(facts: ModelFacts, hw: HardwareProfile, target: float, a: Assumptions) -> Deployment | None:
    """The best ``EPn`` on ``hw`` (None: no GPU count meets the target in ``target`` seconds)."""
    # KV room for at least one sequence beside the weights
    least = ffn_gpus_needed(facts, hw, a, spare=facts.attention_weight_bytes + facts.kv_bytes)
    if least is None:
        return None
    sizes = sorted({*pool_sizes(least, a.ffn_pool_multiples), *(n for n in (8, 16, 32, 64, 128) if n >= least)})
    best = None
    for gpus in sizes:
        d = mono_deployment(facts, hw, gpus, target, a)
        if better(d, best):
            best = d
    return best


def _min_tpot_afd(facts, hw_a, hw_f, a) -> float | None:
    least = ffn_gpus_needed(facts, hw_f, a)
    if least is None:
        return None
    return min(afd_step(facts, hw_a, hw_f, 1, y, 1, a).tpot for y in pool_sizes(least, a.ffn_pool_multiples))


def _min_tpot_mono(facts, hw, a) -> float | None:
    least = ffn_gpus_needed(facts, hw, a, spare=facts.attention_weight_bytes + facts.kv_bytes)
    if least is None:
        return None
    return min(mono_step(facts, hw, n, 1, a).tpot for n in pool_sizes(least, a.ffn_pool_multiples))


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

    Raises :class:`afdc.errors.PlanError` when neither can meet the target, saying by how much.
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


def ratio_curve(
    facts: ModelFacts,
    hw_a: HardwareProfile,
    hw_f: HardwareProfile,
    y: int,
    tpot_ms: float,
    a: Assumptions | None = None,
) -> list[tuple[float, float]]:
    """(x / y, tokens/GPU/s) for x = 1 .. the largest x that still meets the target."""
    a = a or Assumptions()
    out = []
    for x in range(1, a.max_attention_per_ffn_gpu * y + 1):
        d = afd_deployment(facts, hw_a, hw_f, x, y, tpot_ms / 1e3, a)
        if d is None:
            break
        out.append((x / y, d.tokens_per_gpu_s))
    return out
