"""Per-rank counters and histograms: exchange latency, FFN batch size, bytes, idle time."""

from __future__ import annotations

import bisect
import json
import logging
import threading
import time
from dataclasses import dataclass, field

log = logging.getLogger("afdc.metrics")


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


class Metrics:
    """What one rank did since it started; ``snapshot()`` is a plain dict for logs and the store."""

    def __init__(self, role: str, rank: int):
        self.role, self.rank = role, rank
        self.started = time.monotonic()
        self.messages_sent = self.messages_received = 0
        self.bytes_sent = self.bytes_received = 0
        self.errors = 0
        self.idle_seconds = 0.0
        self.exchange_ms = Histogram(_log_buckets(0.01, 60_000))  # attention: send -> all results back
        self.batch_tokens = Histogram(_log_buckets(1, 1 << 20, per_decade=3))  # FFN: tokens per segment run
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
                "idle_fraction": round(self.idle_seconds / elapsed, 4) if elapsed else 0.0,
                "exchange_ms": self.exchange_ms.to_dict(),
                "batch_tokens": self.batch_tokens.to_dict(),
            }

    def log_every(self, interval: float, publish=None) -> threading.Event:
        """Log (and hand to ``publish``) a snapshot every ``interval`` s until the returned event is set."""
        stop = threading.Event()

        def loop() -> None:
            while not stop.wait(interval):
                snap = self.snapshot()
                log.info("%s rank %d: %s", self.role, self.rank, json.dumps(snap))
                if publish is not None:
                    publish(snap)

        if interval > 0:
            threading.Thread(target=loop, daemon=True, name="afdc-metrics").start()
        return stop
