"""The adaptive wait's decisions (afdc.runtime.transport.spin_budget) on a fake clock."""

from __future__ import annotations

import math
import os
import time

import pytest

from afdc.runtime.options import RuntimeOptions, share_of_cores
from afdc.runtime.transport import base
from afdc.runtime.transport.base import Pacing, Waiter, WaitPolicy, default_spin
from afdc.runtime.transport.spin_budget import BudgetSettings, SpinBudget

US = 1e-6


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _budget(**settings) -> tuple[SpinBudget, FakeClock]:
    clock = FakeClock()
    return SpinBudget(BudgetSettings(**settings), clock), clock


def _answers(budget: SpinBudget, clock: FakeClock, key, seconds: list[float]) -> None:
    for s in seconds:
        clock.now += s  # the answer comes that long after the post
        budget.answered(key, s)
        clock.now += 1e-4  # the work until the next post


def test_nothing_known_sleeps_and_a_fast_peer_is_spun_for():
    budget, clock = _budget(cap=1e-3, margin=2.0)
    assert budget.budget("link") == 0.0  # no answer seen yet: sleep from the start
    _answers(budget, clock, "link", [100 * US, 120 * US, 90 * US, 110 * US, 100 * US])
    spin = budget.budget("link")
    assert 100 * US < spin < 250 * US  # long enough to catch a typical answer, far below the cap


def test_a_slow_peer_is_slept_for():
    budget, clock = _budget(cap=1e-3)
    _answers(budget, clock, "link", [5e-3, 6e-3, 4e-3])
    assert budget.budget("link") == 0.0  # its answers come later than any spin worth its core


def test_a_typical_answer_within_the_cap_but_a_wide_spread_spins_no_longer_than_the_cap():
    budget, clock = _budget(cap=1e-3, margin=2.0)
    _answers(budget, clock, "link", [200 * US, 900 * US, 200 * US, 900 * US])
    e = budget.estimate("link")
    assert e is not None and e.mean < 1e-3 < e.budget(2.0)  # typically within the cap, often not
    assert budget.budget("link") == 1e-3


def test_keys_are_learned_apart():
    """A layer's FFN work and a step's attention work on one link, and two links, each learn their own."""
    budget, clock = _budget(cap=1e-3)
    _answers(budget, clock, (0, 3), [80 * US] * 4)  # a layer: answered in microseconds
    _answers(budget, clock, (0, 7), [8e-3] * 4)  # the last layer: the next step comes milliseconds later
    _answers(budget, clock, (1, 3), [3e-3] * 4)  # another link's peer is slow
    assert 0 < budget.budget((0, 3)) < 1e-3
    assert budget.budget((0, 7)) == 0.0 and budget.budget((1, 3)) == 0.0


def test_it_adapts_when_the_load_changes():
    budget, clock = _budget(cap=1e-3, weight=0.25)
    _answers(budget, clock, "link", [100 * US] * 8)
    assert budget.budget("link") > 0
    # the peer slows down (a bigger batch, a busier host): within a few answers it is slept for
    slowed = 0
    while budget.budget("link") > 0:
        _answers(budget, clock, "link", [4e-3])
        slowed += 1
    assert slowed <= 3
    # and back: it is spun for again once its answers are fast again for a while
    recovered = 0
    while budget.budget("link") == 0:
        _answers(budget, clock, "link", [100 * US])
        recovered += 1
    assert recovered <= 20
    _answers(budget, clock, "link", [100 * US] * 12)  # and its spin shrinks back to what the answers take
    assert budget.budget("link") < 500 * US


def test_old_answers_decay_and_an_idle_key_is_forgotten():
    budget, clock = _budget(cap=1e-3, weight=0.5, forget=1.0)
    _answers(budget, clock, "link", [600 * US] * 6)
    first = budget.estimate("link").mean
    _answers(budget, clock, "link", [100 * US] * 6)  # each older answer weighs half as much as the next
    assert budget.estimate("link").mean < first / 4
    clock.now += 0.9
    assert budget.budget("link") > 0  # still recent
    clock.now += 0.2
    assert budget.budget("link") == 0.0 and budget.estimate("link") is None  # idle: its next wait sleeps
    _answers(budget, clock, "link", [3e-3])  # relearned from scratch, the stale answers not mixed in
    assert budget.estimate("link").mean == pytest.approx(3e-3)


def test_the_spin_never_exceeds_the_cap_and_the_keys_are_bounded():
    budget, clock = _budget(cap=300 * US, max_keys=4)
    for cap_check in ([250 * US] * 5, [290 * US] * 5):
        _answers(budget, clock, "k", cap_check)
        assert budget.budget("k") <= 300 * US
    for k in range(10):
        _answers(budget, clock, k, [50 * US])
    assert len(budget._estimates) == 4 and budget.estimate(0) is None and budget.estimate(9) is not None


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="weight"):
        BudgetSettings(weight=0)


def test_a_waiter_spins_for_what_its_budget_has_left_since_the_post():
    waiter = Waiter(Pacing(spin=None))
    assert waiter.spin_left("k", since=10.0, now=10.0) == 0.0  # nothing learned: sleep
    for _ in range(4):
        waiter.answered("k", 200 * US)
    left = waiter.spin_left("k", since=10.0, now=10.0)
    assert 200 * US < left <= waiter.pacing.budget.cap
    assert waiter.spin_left("k", since=10.0, now=10.0 + left / 2) == pytest.approx(left / 2)
    assert waiter.spin_left("k", since=10.0, now=11.0) == 0.0  # past its budget: sleep
    fixed = Waiter(Pacing(spin=2e-3))  # --spin: the pacing decides, nothing is learned
    fixed.answered("k", 200 * US)
    assert fixed.budget is None and fixed.spin_left("k", 10.0, 10.0) == 0.0


def test_answers_are_learned_by_the_next_wait_and_never_pile_up():
    """An answer is only noted on the exchange's path; the next wait that asks for its spin learns
    it, and a party whose waits never ask (its answers always there at once) learns them anyway
    before many pile up."""
    waiter = Waiter(Pacing(spin=None))
    waiter.answered("k", 200 * US)
    assert waiter.budget.estimate("k") is None  # noted, not learned yet
    assert waiter.spin_left("k", since=10.0, now=10.0) > 200 * US
    assert waiter.budget.estimate("k").mean == pytest.approx(200 * US)
    for _ in range(1000):
        waiter.answered("quick", 50 * US)
    assert waiter.budget.estimate("quick").mean == pytest.approx(50 * US)


def test_spin_overrides_the_policy_and_the_earlier_one_stays_selectable():
    for role in ("attn", "ffn"):
        assert RuntimeOptions().pacing(role).spin is None  # learned by default (see options)
        assert RuntimeOptions(wait="adaptive").pacing(role).spin is None  # learned
        assert RuntimeOptions(spin=0.0).pacing(role).spin == 0.0  # --spin sets every role's
        assert RuntimeOptions(spin=0.5, wait="cores").pacing(role).spin == 0.5
        assert RuntimeOptions(wait="cores").pacing(role).spin == default_spin(role)
    assert RuntimeOptions().wait is WaitPolicy.ADAPTIVE and RuntimeOptions().pacing("ffn").budget.cap == 20e-3
    assert RuntimeOptions(spin_cap=2e-3).pacing("ffn").budget.cap == 2e-3  # --spin-cap
    assert RuntimeOptions(yield_late=1e-3).pacing("attn").yield_late == 1e-3  # --yield-late
    assert RuntimeOptions(yield_late=0).pacing("attn").yield_late == math.inf  # 0: a late yield never ends a spin
    with pytest.raises(ValueError, match="yield_late"):
        RuntimeOptions(yield_late=-1.0)
    with pytest.raises(ValueError, match="spin_cap"):
        RuntimeOptions(spin_cap=-1.0)
    with pytest.raises(Exception, match="adaptive, cores"):
        RuntimeOptions(wait="fast")


def _yields_away(monkeypatch, queued: bool | None) -> None:
    """Every yield comes back 2 ms later; this thread spent that time waiting for a core (True:
    another task had it), or not (False: the core itself was away), or the system does not say (None)."""
    waited = [0.0]

    def away() -> None:
        time.sleep(2e-3)
        waited[0] += 2e-3 if queued else 0.0

    monkeypatch.setattr(os, "sched_yield", away)
    monkeypatch.setattr(base, "queued_seconds", lambda: None if queued is None else waited[0])


def _blocks(waiter: Waiter, pauses: int) -> int:
    blocks: list[float] = []
    pause = waiter.pauses(block=blocks.append, wakes=True, spin_for=10.0)
    for _ in range(pauses):
        pause()
    return len(blocks)


@pytest.mark.parametrize("queued", [True, None])
def test_a_learned_spin_ends_once_another_task_takes_the_core_and_waits_block_for_a_while(monkeypatch, queued):
    """A poll that comes back late from its yield, having waited for the core, means another task
    wanted it: the wait blocks from then on; the second time within the backoff, so do this
    party's next waits until the backoff has passed (each yield to that task would cost a slice
    of its). Where the system does not say what the time went to, the same. A fixed spin (--spin)
    keeps spinning."""
    _yields_away(monkeypatch, queued)
    waiter = Waiter(Pacing(spin=None, yield_late=5e-4, backoff=0.2))
    waiter.busy()
    assert _blocks(waiter, 2) == 1  # the first pause spins (nothing said the core is wanted yet), the next blocks
    assert _blocks(waiter, 2) == 1  # once may be a passing task: the next wait spins, and finds it again
    assert _blocks(waiter, 1) == 1  # twice within the backoff: the next waits block at once
    time.sleep(0.25)
    waiter.busy()
    assert _blocks(waiter, 1) == 0  # past it: spins again
    fixed = Waiter(Pacing(spin=10.0, yield_late=5e-4))
    fixed.busy()
    assert _blocks(fixed, 3) == 0


def test_a_learned_spin_goes_on_when_the_core_itself_was_away(monkeypatch):
    """A yield that comes back late without this thread having waited for a core: the vCPU was
    taken by its host, with nothing else to run here. Sleeping would only add a wake-up."""
    _yields_away(monkeypatch, queued=False)
    waiter = Waiter(Pacing(spin=None, yield_late=5e-4))
    waiter.busy()
    assert _blocks(waiter, 4) == 0
    assert waiter.contended_until == -math.inf


def test_this_thread_s_wait_for_a_core_is_read_where_linux_says():
    queued = base.queued_seconds()
    if not os.path.exists("/proc/thread-self/schedstat"):
        assert queued is None
        return
    assert queued is not None and queued >= 0.0
    assert base.queued_seconds() >= queued  # a count since the thread started


def test_each_process_of_a_host_gets_its_share_of_the_cores():
    """dm.launch()'s servers and afdc up's roles: a share of the cores each, never torch's thread per core."""
    assert share_of_cores(2, cores=2) == 1  # 1A1F beside its caller on this host
    assert share_of_cores(2, cores=16) == 8
    assert share_of_cores(3, reserved=1, cores=16) == 5  # afdc up keeps a core for vLLM's API server
    assert share_of_cores(9, cores=4) == 1  # more processes than cores: one thread each, not zero
    assert share_of_cores(2) == max(1, len(os.sched_getaffinity(0)) // 2)
    with pytest.raises(ValueError, match="at least one torch thread"):
        RuntimeOptions(threads=0)
