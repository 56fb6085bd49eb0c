"""Per-rank counters and histograms: exchange latency, FFN batch size, bytes, idle time, and
where a rank's time goes (:class:`Phases`), beside the CPU time its process used."""

from __future__ import annotations

import bisect
import collections
import json
import logging
import random
import threading
import time
from dataclasses import dataclass, field

import torch

log = logging.getLogger("afdc.metrics")
SNAPSHOT = "metrics "  # a logged snapshot's JSON follows this on its line
IDLE = "idle"  # the phase of a server waiting for messages
# A phase timed per message reads the thread's CPU clock on its first EXACT_USES uses, then on one
# use in CPU_SAMPLED, chosen at random, which stand for the others: the clock is a system call,
# which on a 2-core VM cost about what a futex wake-up did, and a layer's exchange read it nine
# times (issue 54). The first uses, read whole, hold the outliers (a segment lowered at its first run)
EXACT_USES = 64
CPU_SAMPLED = 8


def _log_buckets(lo: float, hi: float, per_decade: int = 4) -> list[float]:
    out, v = [], lo
    while v <= hi:
        out.append(round(v, 6))
        v *= 10 ** (1 / per_decade)
    return out


@dataclass
class Histogram:
    """Counts per bucket upper bound (log-spaced), plus count/sum/max for the mean."""

    bounds: list[float]
    counts: list[int] = field(default_factory=list)
    count: int = 0
    total: float = 0.0
    maximum: float = 0.0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.count += 1
        self.total += value
        self.maximum = max(self.maximum, value)

    def quantile(self, q: float) -> float:
        """Upper bound of the bucket holding the q-quantile (the maximum for the overflow bucket)."""
        if not self.count:
            return 0.0
        rank, seen = q * self.count, 0
        for i, c in enumerate(self.counts):
            seen += c
            if seen >= rank and c:
                return self.bounds[i] if i < len(self.bounds) else self.maximum
        return self.maximum

    def to_dict(self) -> dict:
        return {
            "count": self.count,
            "mean": self.total / self.count if self.count else 0.0,
            "p50": self.quantile(0.5),
            "p99": self.quantile(0.99),
            "max": self.maximum,
        }


@dataclass
class Phase:
    count: int = 0
    seconds: float = 0.0
    cpu: float = 0.0  # the timing thread's CPU seconds (a timed phase): wall less preemption and sleep,
    # of its first EXACT_USES uses and, after those, of the sampled ones
    sampled_cpu: float = 0.0
    sampled: int = 0

    @property
    def cpu_estimate(self) -> float:
        """CPU seconds of every use: the first ones' read whole, the later ones' estimated from
        those sampled."""
        later = self.count - EXACT_USES
        return self.cpu + (self.sampled_cpu * later / self.sampled if later > 0 and self.sampled else 0.0)


class Phases:
    """Wall time per named phase of a rank's work (an attention step's program, its sends, its
    waits for replies; an FFN server's runs), summed since the rank started: a served step's
    time, taken apart (``benchmarks/bench_serve.py`` prints it per step). A timed phase reads the
    wall clock twice each use, the thread's CPU clock too (a phase timed per message: on a sample
    of its uses, :data:`CPU_SAMPLED`)."""

    def __init__(self) -> None:
        self._phases: dict[str, Phase] = {}

    def add(self, name: str, seconds: float, cpu: float | None = None) -> None:
        """One use of phase ``name``: its wall seconds and, where read, its CPU seconds."""
        phase = self._phases.get(name)
        if phase is None:
            phase = self._phases[name] = Phase()
        if phase.count < EXACT_USES:
            phase.cpu += cpu or 0.0
        elif cpu is not None:
            phase.sampled_cpu += cpu
            phase.sampled += 1
        phase.count += 1
        phase.seconds += seconds

    def reads_cpu(self, name: str, per_message: bool) -> bool:
        """Whether this use of phase ``name`` reads the CPU clock (see :data:`CPU_SAMPLED`)."""
        if not per_message:
            return True
        phase = self._phases.get(name)
        return phase is None or phase.count < EXACT_USES or random.random() * CPU_SAMPLED < 1

    def timed(self, name: str, per_message: bool = False) -> _Timed:
        """Wall and CPU time of the block: on cores shared with busier processes a phase's wall
        time includes the time it waited for a core, its CPU time does not. ``per_message``: CPU
        sampled after the first uses (:data:`CPU_SAMPLED`)."""
        return _Timed(self, name, per_message)

    def seconds(self, name: str) -> float:
        phase = self._phases.get(name)
        return phase.seconds if phase is not None else 0.0

    def to_dict(self) -> dict:
        return {
            name: {"count": p.count, "seconds": round(p.seconds, 6), "cpu": round(p.cpu_estimate, 6)}
            for name, p in self._phases.items()
        }


class _Timed:
    """One use of :meth:`Phases.timed`. A class, not a generator-based context manager: an FFN
    server times three phases a message, and the generator's machinery cost about 2 us a use."""

    __slots__ = ("_cpu", "_name", "_phases", "_sampled", "_start")

    def __init__(self, phases: Phases, name: str, per_message: bool = False):
        self._phases, self._name = phases, name
        self._sampled = phases.reads_cpu(name, per_message)

    def __enter__(self) -> None:
        self._start = time.perf_counter()
        self._cpu = time.thread_time() if self._sampled else 0.0

    def __exit__(self, *exc: object) -> None:
        cpu = time.thread_time() - self._cpu if self._sampled else None
        self._phases.add(self._name, time.perf_counter() - self._start, cpu)


class Metrics:
    """What one rank did since it started; ``snapshot()`` is a plain dict for logs and the store."""

    def __init__(self, role: str, rank: int):
        self.role, self.rank = role, rank
        self.started = time.monotonic()
        self.messages_sent = self.messages_received = 0
        self.bytes_sent = self.bytes_received = 0
        self.errors = 0
        self.exchange_ms = Histogram(_log_buckets(0.01, 60_000))  # attention: send -> all results back
        self.batch_tokens = Histogram(_log_buckets(1, 1 << 20, per_decade=3))  # FFN: tokens per segment run
        self.phases = Phases()
        self._lock = threading.Lock()
        self._exchanges: collections.deque[float] = collections.deque()  # noted, not yet in exchange_ms

    def exchanged(self, seconds: float) -> None:
        """An attention rank's exchange took ``seconds``; noted only, and put into ``exchange_ms``
        by :meth:`settle`: it ends on the way back to the attention program, where a histogram's
        few operations with the caches cold cost microseconds, and a send has the FFN rank's
        computation to hide them."""
        self._exchanges.append(seconds)

    def settle(self) -> None:
        """Put the exchanges noted so far into ``exchange_ms`` (any thread; a snapshot does too)."""
        with self._lock:
            while self._exchanges:
                self.exchange_ms.observe(self._exchanges.popleft() * 1e3)

    def sent(self, nbytes: int) -> None:
        with self._lock:
            self.messages_sent += 1
            self.bytes_sent += nbytes

    def received(self, nbytes: int) -> None:
        with self._lock:
            self.messages_received += 1
            self.bytes_received += nbytes

    def snapshot(self) -> dict:
        self.settle()
        with self._lock:
            elapsed = time.monotonic() - self.started
            return {
                "role": self.role,
                "rank": self.rank,
                "uptime_s": round(elapsed, 3),
                "messages_sent": self.messages_sent,
                "messages_received": self.messages_received,
                "bytes_sent": self.bytes_sent,
                "bytes_received": self.bytes_received,
                "errors": self.errors,
                "idle_fraction": round(self.phases.seconds(IDLE) / elapsed, 4) if elapsed else 0.0,
                "exchange_ms": self.exchange_ms.to_dict(),
                "batch_tokens": self.batch_tokens.to_dict(),
                "phases": self.phases.to_dict(),
                # this process's CPU time (all its threads): against its phases, what waiting costs
                "cpu_seconds": round(time.process_time(), 3),
                "torch_threads": torch.get_num_threads(),  # what its computation may spread over
            }

    def log_every(self, interval: float, publish=None, logger: logging.Logger = log) -> threading.Event:
        """Log on ``logger`` (and hand to ``publish``) a snapshot every ``interval`` s until the
        returned event is set."""
        stop = threading.Event()

        def loop() -> None:
            while not stop.wait(interval):
                snap = self.snapshot()
                logger.info("%s rank %d: %s%s", self.role, self.rank, SNAPSHOT, json.dumps(snap))
                if publish is not None:
                    publish(snap)

        if interval > 0:
            threading.Thread(target=loop, daemon=True, name="afdc-metrics").start()
        return stop
