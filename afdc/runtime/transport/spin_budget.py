"""How long a rank's wait for its peer may spin before it sleeps, learned from the peer's answers.

Spinning (polling, yielding the core between polls) catches an answer microseconds after it is
posted; sleeping on a futex costs a wake-up (tens to hundreds of microseconds on a busy VM) but
leaves the core to whatever else runs there. Which is right depends on how soon the answer comes,
and nothing about the host says that: the same FFN server waits 100 us for a tiny model's next
layer under ``dm.launch()`` and milliseconds for a served step under load. So each side learns it
from its own round trips: per *key* (a link and a phase: which layer it just answered or asked
for), how long the peer took to answer, as a smoothed time and a smoothed deviation (the
estimator TCP uses for its retransmission timeout). A wait then spins for ``mean + margin *
deviation`` (the answer is likely by then), at most ``cap``, and sleeps from the start where the
typical answer comes later than ``cap`` (a spin would burn the core the peer may need). Old answers
weigh less with each new one, and a key unanswered for ``forget`` seconds is forgotten: an idle
link's first wait sleeps, so an idle deployment spins not at all.

Pure logic with an injectable clock: the transports measure and ask, this decides.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass


@dataclass(frozen=True)
class BudgetSettings:
    # s: the longest a wait spins, and the longest typical answer worth spinning for. Not 2 ms: a
    # tiny model's layer under dm.launch() and a served step's layer on a loaded 2-core host are
    # answered in 1-3 ms, and a sleep then costs each of them a futex wake-up (RESULTS, issue 54);
    # a spin the host needs the core for ends at its first late yield anyway
    cap: float = 20e-3
    margin: float = 2.0  # deviations beyond the typical answer a spin lasts
    weight: float = 0.25  # of the newest answer in a key's moving averages (older ones decay by 1 - weight each)
    forget: float = 1.0  # s: a key unanswered this long is forgotten (its next wait sleeps from the start)
    max_keys: int = 4096  # keys remembered at most (the least recently answered go first)

    def __post_init__(self) -> None:
        if self.cap < 0 or self.margin < 0 or not 0 < self.weight <= 1 or self.forget <= 0 or self.max_keys < 1:
            raise ValueError(f"invalid spin budget settings {self}: cap, margin >= 0, 0 < weight <= 1, forget > 0, "
                             "max_keys >= 1")


@dataclass
class Estimate:
    """A key's answers so far: their smoothed time and deviation (seconds), and when the last came."""

    mean: float
    deviation: float
    at: float

    def budget(self, margin: float) -> float:
        return self.mean + margin * self.deviation


class SpinBudget:
    """One side's spin budgets, per key (see the module's docstring). Not thread-safe: the caller
    serializes :meth:`answered` (a dict update per answer)."""

    def __init__(self, settings: BudgetSettings = BudgetSettings(), clock: Callable[[], float] = time.monotonic):
        self.settings = settings
        self.clock = clock
        self._estimates: OrderedDict[Hashable, Estimate] = OrderedDict()

    def answered(self, key: Hashable, seconds: float) -> None:
        """The peer answered ``key`` after ``seconds`` (from this side's post to its seeing the answer)."""
        s, now = self.settings, self.clock()
        seconds = max(0.0, seconds)
        e = self._estimates.pop(key, None)
        if e is None or now - e.at > s.forget:
            e = Estimate(seconds, seconds / 2, now)  # TCP's first sample: half of it as the deviation
        else:
            e.deviation += s.weight * (abs(seconds - e.mean) - e.deviation)
            e.mean += s.weight * (seconds - e.mean)
            e.at = now
        self._estimates[key] = e
        if len(self._estimates) > s.max_keys:
            self._estimates.popitem(last=False)

    def budget(self, key: Hashable) -> float:
        """Seconds a wait for ``key``'s answer spins, counted from the post, before it sleeps: up
        to ``margin`` deviations past the typical answer, at most ``cap``; 0 where the typical
        answer comes later than ``cap`` or nothing recent is known."""
        s = self.settings
        e = self._estimates.get(key)
        if e is None or self.clock() - e.at > s.forget:
            return 0.0
        return min(e.budget(s.margin), s.cap) if e.mean <= s.cap else 0.0

    def estimate(self, key: Hashable) -> Estimate | None:
        """What is known of ``key`` (None: nothing, or forgotten)."""
        e = self._estimates.get(key)
        return e if e is not None and self.clock() - e.at <= self.settings.forget else None
