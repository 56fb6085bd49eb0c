"""Published AFD results, each with the setup its source states, to check the planner against.

A :class:`Scenario` holds what its source says it ran (model, chips, deployments, context,
quantization, micro-batches, expert balance, latency target) and the figure it published; its
:meth:`~Scenario.predict` sizes the same deployments with the planner and returns the predicted
figure. The published figure is only compared with, never read by the prediction. What a source
does not state is set by :class:`Unstated` and said so in the scenario's ``assumed``.

The model's cost comes from its graph like any other plan (:func:`afdc.planner.model_facts`), so
a scenario takes a function from context length to :class:`~afdc.planner.facts.ModelFacts`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from afdc.planner.deployment import Deployment, afd_deployment, mono_deployment
from afdc.planner.facts import ModelFacts
from afdc.planner.hardware import HardwareProfile
from afdc.planner.roofline import Assumptions

# A throughput run with no latency target: every deployment decodes all its memory holds
NO_TARGET_MS = 1e6


@dataclass(frozen=True)
class Deploy:
    """One side of a comparison: AFD ``xAyF`` (ffn > 0) or ``EPn`` (ffn == 0) on one chip."""

    hw: HardwareProfile
    attention: int
    ffn: int = 0
    ffn_hw: HardwareProfile | None = None

    def size(self, facts: ModelFacts, tpot_ms: float, a: Assumptions) -> Deployment | None:
        if self.ffn:
            return afd_deployment(
                facts, self.hw, self.ffn_hw or self.hw, self.attention, self.ffn, tpot_ms / 1e3, a
            )
        return mono_deployment(facts, self.hw, self.attention, tpot_ms / 1e3, a)


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
            raise ValueError(f"{self.name}: the baseline meets the target at no batch")
        return afd.tokens_per_gpu_s / base.tokens_per_gpu_s if afd else 0.0
