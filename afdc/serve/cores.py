"""Which cores a serving process computes on.

An attention rank and an FFN rank of 1A1F with one micro-batch take turns: the attention engine
waits while the FFN server runs a layer, and the server waits while attention runs the next.
On a host with fewer cores than the processes that want one (the engine, the FFN server, vLLM's
API server, the clients), letting the pair float puts each hand-off on whichever core is free
just then: the woken process often lands on the core the API server or a client is using, and
resumes cold. Putting the pair on one core makes each hand-off a switch on that core and leaves
the other cores to the front end. On this project's 2-core VM, under ``vllm bench serve``, the
pinned pair beat the floating one in 7 of 9 paired rounds at 16 in flight and 8 of 9 at 64 (TPOT
against the monolith's, medians 1.22x against 1.34x and 1.24x against 1.40x), and lost every
round at 1, 2 and 4 in flight (1.59x against 1.39x at one): a small step leaves a core idle, and
floating the attention side polls for its reply there while the FFN server runs on the other
(``benchmarks/RESULTS.md``). The cross-over was near 8 streams, so by default the pair shares its
core only while steps are big (:class:`Placement`): both ends see each step's size, the attention
rank from its scheduler, the FFN server from the step's plan, and both move by the same rule. The
monolith's engine gained nothing from being pinned, having no partner to take turns with. A pair
that does not take turns (more micro-batches, or an FFN rank serving several attention ranks) is
not placed.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Collection
from typing import TYPE_CHECKING

from afdc.errors import AfdcError

if TYPE_CHECKING:
    from afdc.plan import Plan

log = logging.getLogger("afdc.cores")

SMALL_HOST = 4  # fewer cores than this: the engine, the FFN server, the API server and a client cannot each have one
PAIR_TOKENS = 8  # steps of this many tokens or more: the pair takes turns on its core (fewer: it floats)
SETTLE_STEPS = 8  # steps in a row on the other side of the threshold before a thread moves


def parse_cpus(text: str) -> tuple[int, ...]:
    """Cores in taskset's list syntax (``1``, ``0-3,6``), sorted, each once."""
    cores: set[int] = set()
    for part in text.split(","):
        first, _, last = part.strip().partition("-")
        try:
            lo, hi = int(first), int(last or first)
        except ValueError:
            raise AfdcError(f"--cpus {text!r}: {part!r} is not a core or a range of cores (e.g. 1 or 0-3,6)") from None
        if lo < 0 or hi < lo:
            raise AfdcError(f"--cpus {text!r}: {part!r} is not a range of cores (low-high, low <= high)")
        cores.update(range(lo, hi + 1))
    return tuple(sorted(cores))


def check_usable(cpus: Collection[int]) -> None:
    """Refuse cores this process may not run on (said before a server starts, not in its engine)."""
    allowed = os.sched_getaffinity(0)
    outside = sorted(set(cpus) - allowed)
    if outside:
        raise AfdcError(f"cores {outside} are not available to this process (it may run on {sorted(allowed)}); "
                        "give --cpus from those")


def pin_thread(cpus: Collection[int]) -> None:
    """Run the calling thread, and the threads it starts from now on, on ``cpus`` only."""
    check_usable(cpus)
    os.sched_setaffinity(0, cpus)


def shared_core(plan: Plan, micro_batches: int, device: str, disaggregated: bool, pin: bool | None = None,
                cores: Collection[int] | None = None) -> int | None:
    """The core that 1A1F's attention engine (its step thread) and FFN server share when every role
    runs on this host, or None to let them float. ``pin`` None decides by itself: shared with one
    micro-batch on a CPU host of fewer than :data:`SMALL_HOST` cores; True asks for it on any host;
    False never. The last core is taken (the front end starts on the first ones)."""
    cores = sorted(cores if cores is not None else os.sched_getaffinity(0))
    pair = disaggregated and plan.attention_ranks == 1 and plan.ffn_ranks == 1
    if pin is None:
        pin = pair and micro_batches == 1 and device.split(":")[0] == "cpu" and len(cores) < SMALL_HOST
    elif pin and not pair:
        what = "is monolithic" if not disaggregated else f"is {plan}"
        raise AfdcError(f"--pin puts one attention rank and one FFN rank (1A1F) on one core; this deployment {what}")
    return cores[-1] if pin else None


class Placement:
    """Where one thread of a pair computes, step by step: on ``cpus`` while its steps hold
    ``from_tokens`` tokens or more, on the cores it started with while they hold fewer
    (``from_tokens`` 0: on ``cpus`` from the first step on). A thread moves after
    :data:`SETTLE_STEPS` steps in a row on the other side of the threshold, so a lone stream's
    prefill, or a batch's last steps, do not move it; both ends of a pair see the same steps and
    move together. Call :meth:`step` from the thread that computes, before each step."""

    def __init__(self, cpus: Collection[int], from_tokens: int = 0, who: str = "this rank",
                 logger: logging.Logger = log):
        check_usable(cpus)
        self.cpus = tuple(sorted(cpus))
        self.from_tokens = from_tokens
        self.who, self.log = who, logger
        self.home: tuple[int, ...] | None = None  # the thread's cores before its first step
        self.shared = False  # on ``cpus`` now
        self._against = 0  # steps in a row that asked for the other placement
        self._moves = 0
        self._broken = False  # a move failed (the host took cores away): the thread stays where it is

    def step(self, tokens: int) -> None:
        """Place the calling thread for a step of ``tokens`` tokens."""
        if self._broken:
            return
        if self.home is None:
            self.home = tuple(sorted(os.sched_getaffinity(0)))
            if self.from_tokens == 0:
                self._move(True)
                return
        if (tokens >= self.from_tokens) == self.shared:
            self._against = 0
            return
        self._against += 1
        if self._against >= SETTLE_STEPS:
            self._against = 0
            self._move(not self.shared)

    def _move(self, shared: bool) -> None:
        try:
            os.sched_setaffinity(0, self.cpus if shared else self.home)
        except OSError as err:  # a cpuset changed under the process: serving goes on unplaced
            self._broken = True
            self.log.warning("afdc: %s cannot move to cores %s (%s); it stays where it is", self.who,
                             list(self.cpus if shared else self.home), err)
            return
        self.shared = shared
        self._moves += 1  # said once; a load near the threshold may move it back and forth
        where = f"on cores {list(self.cpus)}" if shared else f"on its own cores {list(self.home)}"
        self.log.log(logging.INFO if self._moves == 1 else logging.DEBUG, "afdc: %s steps %s", self.who, where)
