"""Which messages an FFN server waits for before it runs a layer: the attention ranks' step plans.

At the start of each step an attention rank tells every FFN rank what the step holds (a ``STEP``
message: each micro-batch's token count). For FFN layer L and micro-batch k the server then knows
which attention ranks will send it a message, and runs the layer once over all of them (the bigger
FFN batch AFD is for) instead of over whichever arrived first. A rank late by more than the
``window`` is not waited for, and not expected again until it is heard from: a rank stalled
mid-step (or dead without its link ending yet) costs the others one window, not one at every
layer of every step its stale plan still names. A rank between two steps (its step's layers all served here) is
waited for while it was heard from within the window, since its next plan may still be on the way
(it sampled later than the others); one idle for longer is not. A layer whose tokens go only to
their experts' ranks (router on the attention side) is not waited on: whether a rank gets any of
them is known only once they are sent.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from afdc.runtime.programs import FFNProgram
from afdc.runtime.transport.base import Incoming

_CACHE_SIZE = 1 << 16


@dataclass
class StepPlan:
    """One attention rank's current step."""

    step: int
    tokens: tuple[int, ...]  # per micro-batch
    heard: float  # when its plan or its last message arrived
    late: bool = False  # a layer ran without it after the window: not waited for until heard from
    served: dict[int, int] = field(default_factory=dict)  # micro-batch -> last FFN layer served


@dataclass
class _Waiting:
    message: Incoming
    since: float


class Gathering:
    def __init__(self, program: FFNProgram, ffn_ranks: int, window: float, attention_ranks: int):
        self.program = program
        self.ffn_ranks = ffn_ranks
        self.attention_ranks = attention_ranks
        self.window = window
        self.plans: dict[int, StepPlan] = {}  # by sender slot
        self.waiting: list[_Waiting] = []
        self._last: dict[int, int] = {}  # micro-batch tokens -> the last layer this rank gets them at
        self._gets_cache: dict[tuple[int, int], bool] = {}

    def plan(self, sender: int, step: int, tokens: tuple[int, ...]) -> None:
        self.plans[sender] = StepPlan(step, tokens, time.monotonic())

    def forget(self, sender: int) -> None:
        """``sender`` left or broke: nothing more is expected from it (what it sent still runs)."""
        self.plans.pop(sender, None)

    def add(self, message: Incoming) -> None:
        now = time.monotonic()
        self.waiting.append(_Waiting(message, now))
        plan = self.plans.get(message.header.sender)
        if plan is not None:
            plan.heard, plan.late = now, False

    def deadline(self) -> float | None:
        """When the oldest waiting message runs regardless (None: nothing waits)."""
        return min(w.since for w in self.waiting) + self.window if self.waiting else None

    def ready(self) -> list[Incoming]:
        """Take out the messages whose (layer, micro-batch) has heard from every attention rank
        expected to send it, or has waited the window; they are marked served."""
        if self.attention_ranks == 1:  # nothing to gather: every message is all its layer gets
            out, self.waiting = [w.message for w in self.waiting], []
            return out
        now = time.monotonic()
        arrived: dict[tuple[int, int], set[int]] = {}
        for w in self.waiting:
            h = w.message.header
            arrived.setdefault((h.layer, h.micro_batch), set()).add(h.sender)
        done = set()
        for key, senders in arrived.items():
            missing = self._expected(*key) - senders
            if not missing:
                done.add(key)
            elif any(now - w.since >= self.window for w in self.waiting if _key(w) == key):
                done.add(key)
                for sender in missing:
                    self.plans[sender].late = True
        out = [w.message for w in self.waiting if _key(w) in done]
        self.waiting = [w for w in self.waiting if _key(w) not in done]
        for m in out:
            plan = self.plans.get(m.header.sender)
            if plan is not None and plan.step == m.header.step:
                plan.served[m.header.micro_batch] = m.header.layer
        return out

    def _expected(self, layer: int, micro_batch: int) -> set[int]:
        expected = set()
        now = time.monotonic()
        for sender, plan in self.plans.items():
            if plan.late or micro_batch >= len(plan.tokens) or not self._gets(layer, plan.tokens[micro_batch]):
                continue
            # a rank that had this layer in its step sends it again only in its next step: waited
            # for when it is between steps and was just heard (not mid-step: it may be waiting on us)
            if plan.served.get(micro_batch, -1) < layer or (
                now - plan.heard < self.window and self._between_steps(plan)
            ):
                expected.add(sender)
        return expected

    def _gets(self, layer: int, tokens: int) -> bool:
        """Whether this rank is known to get some of a micro-batch of ``tokens`` tokens at FFN ``layer``."""
        gets = self._gets_cache.get((layer, tokens))
        if gets is None:  # asked per message, and a deployment sees few distinct token counts
            dispatch = self.program.dispatch(layer)
            gets = dispatch.experts is None and any(
                s.rank == self.program.rank and s.count for s in dispatch.shares([], tokens, self.ffn_ranks)
            )
            _remember(self._gets_cache, (layer, tokens), gets)
        return gets

    def _between_steps(self, plan: StepPlan) -> bool:
        for k, tokens in enumerate(plan.tokens):
            if tokens not in self._last:
                mine = [i for i in range(len(self.program.layers)) if self._gets(i, tokens)]
                _remember(self._last, tokens, mine[-1] if mine else -1)
            if plan.served.get(k, -1) < self._last[tokens]:
                return False
        return True


def _remember(cache: dict, key, value) -> None:
    """Cache by token count, bounded: a serving deployment sees ever new counts."""
    if len(cache) >= _CACHE_SIZE:
        cache.clear()
    cache[key] = value


def _key(w: _Waiting) -> tuple[int, int]:
    return w.message.header.layer, w.message.header.micro_batch
