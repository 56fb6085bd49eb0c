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


def test_a_learned_spin_ends_once_a_yield_gives_the_core_away(monkeypatch):
    """A poll that comes back late from its yield means another task wanted this core: the wait
    blocks from then on. A fixed spin (--spin) keeps spinning."""
    monkeypatch.setattr(os, "sched_yield", lambda: time.sleep(2e-3))  # every yield: 2 ms away
    for spin, blocked_after in ((None, 1), (10.0, 0)):
        waiter = Waiter(Pacing(spin=spin, yield_late=5e-4))
        waiter.busy()
        blocks: list[float] = []
        pause = waiter.pauses(block=blocks.append, wakes=True, spin_for=10.0)
        pause()
        assert blocks == []  # the first pause spins: nothing said the core is wanted yet
        pause()
        assert len(blocks) == blocked_after


def test_a_learned_spin_waits_asleep_where_the_host_has_more_to_run_than_cores(monkeypatch):
    """A learned wait spins only where a core would otherwise idle: as long as the host's runnable
    tasks besides it, on average over its spins, are fewer than the cores. It adapts as the load
    comes and goes; a fixed spin (--spin) and a host that does not say are as before."""
    running = [2]
    monkeypatch.setattr(base, "runnable_tasks", lambda: running[0])
    monkeypatch.setattr(os, "cpu_count", lambda: 2)

    def spins(waiter: Waiter) -> bool:
        waiter.busy()
        blocks: list[float] = []
        waiter.pauses(block=blocks.append, wakes=True, spin_for=10.0)()
        return not blocks

    waiter = Waiter(Pacing(spin=None))
    assert spins(waiter)  # this wait and its peer on two cores: spun for
    running[0] = 4  # a server, an engine, an API server and a client
    assert spins(waiter)  # one count is not yet the load
    while spins(waiter):
        pass
    assert not any(spins(waiter) for _ in range(100)) and waiter.crowd > 3.9  # the load stays
    running[0] = 1
    waits = 0
    while not spins(waiter):
        waits += 1
    assert 0 < waits < 100 and waiter.crowd - 1 < 2  # the load gone: spun for again
    running[0] = 8
    fixed = Waiter(Pacing(spin=10.0))
    assert all(spins(fixed) for _ in range(100))
    monkeypatch.setattr(base, "runnable_tasks", lambda: None)
    assert all(spins(Waiter(Pacing(spin=None))) for _ in range(3))


def test_the_host_s_runnable_tasks_are_read_where_linux_says():
    running = base.runnable_tasks()
    assert running is None if not os.path.exists("/proc/loadavg") else running >= 1  # this test, at least


def test_each_process_of_a_host_gets_its_share_of_the_cores():
    """dm.launch()'s servers and afdc up's roles: a share of the cores each, never torch's thread per core."""
    assert share_of_cores(2, cores=2) == 1  # 1A1F beside its caller on this host
    assert share_of_cores(2, cores=16) == 8
    assert share_of_cores(3, reserved=1, cores=16) == 5  # afdc up keeps a core for vLLM's API server
    assert share_of_cores(9, cores=4) == 1  # more processes than cores: one thread each, not zero
    assert share_of_cores(2) == max(1, len(os.sched_getaffinity(0)) // 2)
    with pytest.raises(ValueError, match="at least one torch thread"):
        RuntimeOptions(threads=0)
