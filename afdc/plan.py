"""Deployment plans: ``xAyF`` is x attention ranks and y FFN ranks."""

from __future__ import annotations

import re
from dataclasses import dataclass

from afdc.errors import PlanError

_PLAN = re.compile(r"^\s*(\d+)\s*[aA]\s*(\d+)\s*[fF]\s*$")


@dataclass(frozen=True)
class Plan:
    attention_ranks: int
    ffn_ranks: int

    @classmethod
    def parse(cls, text: str | Plan) -> Plan:
        if isinstance(text, Plan):
            return text
        m = _PLAN.match(str(text))
        if not m:
            raise PlanError(f"plan {text!r} is not of the form xAyF (e.g. 1A1F, 2A2F, 4A2F)")
        x, y = int(m.group(1)), int(m.group(2))
        if x < 1 or y < 1:
            raise PlanError(f"plan {text!r} needs at least one attention and one FFN rank")
        return cls(x, y)

    def __str__(self) -> str:
        return f"{self.attention_ranks}A{self.ffn_ranks}F"
