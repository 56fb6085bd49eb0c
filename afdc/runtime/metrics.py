"""Per-rank counters and histograms: exchange latency, FFN batch size, bytes, idle time, and
where a rank's time goes (:class:`Phases`), beside the CPU time its process used."""

from __future__ import annotations

import bisect
import json
import logging
import threading
import time
from dataclasses import dataclass, field

log = logging.getLogger("afdc.metrics")
SNAPSHOT = "metrics "  # a logged snapshot's JSON follows this on its line
IDLE = "idle"  # the phase of a server waiting for messages


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
    cpu: float = 0.0  # the timing thread's CPU seconds (a timed phase): wall less preemption and sleep


class Phases:
    """Wall time per named phase of a rank's work (an attention step's program, its sends, its
    waits for replies; an FFN server's runs), summed since the rank started: a served step's
    time, taken apart (``benchmarks/bench_serve.py`` prints it per step). A timed phase reads the
    wall clock and the thread's CPU clock twice each."""

    def __init__(self) -> None:
        self._phases: dict[str, Phase] = {}

    def add(self, name: str, seconds: float, cpu: float = 0.0) -> None:
        phase = self._phases.get(name)
        if phase is None:
            phase = self._phases[name] = Phase()
        phase.count += 1
        phase.seconds += seconds
        phase.cpu += cpu

    def timed(self, name: str) -> _Timed:
        """Wall and CPU time of the block: on cores shared with busier processes a phase's wall
        time includes the time it waited for a core, its CPU time does not."""
        return _Timed(self, name)

    def seconds(self, name: str) -> float:
        phase = self._phases.get(name)
        return phase.seconds if phase is not None else 0.0

    def to_dict(self) -> dict:
        return {
            name: {"count": p.count, "seconds": round(p.seconds, 6), "cpu": round(p.cpu, 6)}
            for name, p in self._phases.items()
        }


class _Timed:
    """One use of :meth:`Phases.timed`. A class, not a generator-based context manager: an FFN
    server times three phases a message, and the generator's machinery cost about 2 us a use."""

    __slots__ = ("_cpu", "_name", "_phases", "_start")

    def __init__(self, phases: Phases, name: str):
        self._phases, self._name = phases, name

    def __enter__(self) -> None:
        self._start, self._cpu = time.perf_counter(), time.thread_time()

    def __exit__(self, *exc: object) -> None:
        self._phases.add(self._name, time.perf_counter() - self._start, time.thread_time() - self._cpu)


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

    def sent(self, nbytes: int) -> None:
        with self._lock:
            self.messages_sent += 1
            self.bytes_sent += nbytes

    def received(self, nbytes: int) -> None:
        with self._lock:
            self.messages_received += 1
            self.bytes_received += nbytes

    def snapshot(self) -> dict:
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
