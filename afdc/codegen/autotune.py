"""Block sizes measured per device, dtype and shape, and kept on disk.

A kernel's best tile sizes depend on the device and the problem's shape. The first launch of a
new (kernel, device, dtype, shape) times each candidate on the real inputs, keeps the fastest,
and writes it to a JSON cache (``$AFDC_AUTOTUNE_CACHE``, default ``~/.cache/afdc/autotune.json``)
that later processes read instead of tuning again. Token counts vary every step, so callers key
them by power-of-2 bucket.

Tuning is on by default on CUDA and off elsewhere (``AFDC_AUTOTUNE=1`` or ``0`` overrides):
interpreter timings on a CPU say nothing about a GPU.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

logger = logging.getLogger("afdc.autotune")

Config = tuple[int, ...]


@dataclass(frozen=True)
class TuneKey:
    kernel: str
    device: str  # the device's name, e.g. "NVIDIA H100 80GB HBM3"
    dtype: str
    shape: tuple[int, ...]

    def __str__(self) -> str:
        return f"{self.kernel}|{self.device}|{self.dtype}|{','.join(map(str, self.shape))}"

    @classmethod
    def of(cls, kernel: str, like: torch.Tensor, shape: Sequence[int]) -> TuneKey:
        device = _cuda_name(like.device.index or 0) if like.is_cuda else like.device.type
        return cls(kernel, device, str(like.dtype).removeprefix("torch."), tuple(int(s) for s in shape))


@functools.cache
def _cuda_name(index: int) -> str:
    return torch.cuda.get_device_name(index)  # asked once: the key is built at every launch


def enabled(like: torch.Tensor) -> bool:
    setting = os.environ.get("AFDC_AUTOTUNE")
    return like.is_cuda if setting is None else setting == "1"


def measure(run: Callable[[], object], like: torch.Tensor) -> float:
    """Seconds one ``run()`` takes: Triton's ``do_bench`` on CUDA, else the median of 3 after a warmup."""
    if like.is_cuda:
        from triton.testing import do_bench

        return do_bench(run) / 1e3
    run()
    times = []
    for _ in range(3):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


class Autotuner:
    """The on-disk cache of best configs, and the tuning that fills it."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._lock = threading.Lock()
        self._best: dict[str, list[int]] = self._read()

    def _read(self) -> dict[str, list[int]]:
        try:
            data = json.loads(self.path.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as err:
            logger.warning("afdc autotune: ignoring unreadable cache %s (%s); tuning again", self.path, err)
            return {}
        if not isinstance(data, dict):
            logger.warning("afdc autotune: ignoring cache %s (not a JSON object); tuning again", self.path)
            return {}
        return data

    def _write(self) -> None:
        """Atomically: a concurrent reader sees the old file or the new one, never half of one."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=self.path.parent, delete=False, suffix=".tmp") as f:
            json.dump(self._best, f, indent=1, sort_keys=True)
        os.replace(f.name, self.path)

    def cached(self, key: TuneKey) -> Config | None:
        found = self._best.get(str(key))
        return tuple(found) if found is not None else None

    def best(self, key: TuneKey, candidates: Sequence[Config], run: Callable[[Config], object],
             like: torch.Tensor) -> Config:
        """The fastest of ``candidates`` for ``key``: from the cache, or timed now with ``run``."""
        found = self.cached(key)
        if found is not None:
            return found
        with self._lock:
            found = self.cached(key)
            if found is not None:
                return found
            timings = {}
            for config in dict.fromkeys(candidates):
                try:
                    timings[config] = measure(functools.partial(run, config), like)
                except Exception as err:  # e.g. a tile that exceeds the device's shared memory
                    logger.info("afdc autotune: %s: config %s failed (%s)", key, config, err)
            if not timings:
                raise RuntimeError(f"afdc autotune: every candidate config failed for {key}")
            best = min(timings, key=timings.__getitem__)
            logger.info("afdc autotune: %s -> %s (%.1f us)", key, best, timings[best] * 1e6)
            self._best[str(key)] = list(best)
            self._write()
            return best


@functools.cache
def tuner() -> Autotuner:
    default = Path.home() / ".cache" / "afdc" / "autotune.json"
    return Autotuner(os.environ.get("AFDC_AUTOTUNE_CACHE", default))
