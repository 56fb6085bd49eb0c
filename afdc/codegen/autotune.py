"""Block sizes measured per device, dtype and shape, and kept on disk.

A kernel's best tile sizes depend on the device and the problem's shape. The first launch of a
new (kernel, device, dtype, shape) times each candidate on the real inputs, keeps the fastest,
and writes it to a JSON cache (``$AFDC_AUTOTUNE_CACHE``, default ``~/.cache/afdc/autotune.json``)
that later processes read instead of tuning again. Token counts vary every step, so callers key
them by power-of-2 bucket.

Tuning is on by default on CUDA and off elsewhere (``AFDC_AUTOTUNE=1`` or ``0`` overrides):
interpreter timings on a CPU say nothing about a GPU.

Results tuned offline ship with afdc as data (``afdc/data/autotuned.json``, written by
``benchmarks/tune_fused_moe.py`` on each device, as vLLM keeps its fused-MoE configs): a launch
takes the nearest shipped entry of its kernel, device and dtype (:meth:`TunedTable.nearest`)
before it tunes anything itself.
"""

from __future__ import annotations

import functools
import json
import logging
import math
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
    def parse(cls, text: str) -> TuneKey:
        """The key :meth:`__str__` wrote, or ValueError."""
        kernel, device, dtype, shape = text.split("|")
        dims = tuple(int(d) for d in shape.split(","))
        if not kernel or not device or not dtype or not dims or min(dims) < 1:
            raise ValueError(f"not a tuning key: {text!r}")
        return cls(kernel, device, dtype, dims)

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


def _config(value: object) -> Config:
    """A stored config: a short list of positive ints (data from a file, so checked)."""
    if not isinstance(value, list) or not 0 < len(value) <= 8 or not all(
            type(v) is int and 0 < v <= 1 << 16 for v in value):
        raise ValueError(f"not a config of block sizes: {value!r}")
    return tuple(value)


class TunedTable:
    """Configs tuned offline for named devices, keyed as :class:`TuneKey` (the first dimension of a
    shape being the token-count bucket, the rest the problem's sizes)."""

    MAX_ENTRIES = 100_000
    # a shape further than this from every tuned one (sum over its sizes of |log2 ratio|) gets none
    MAX_SHAPE_DISTANCE = 1.0

    def __init__(self, entries: dict[TuneKey, Config]):
        self.entries = entries

    @classmethod
    def read(cls, path: str | Path) -> TunedTable:
        """The table in ``path``: a JSON object of key to config, validated entry by entry."""
        data = json.loads(Path(path).read_text())
        if not isinstance(data, dict) or len(data) > cls.MAX_ENTRIES:
            raise ValueError(f"{path}: not a table of tuned configs (a JSON object of at most {cls.MAX_ENTRIES})")
        return cls({TuneKey.parse(k): _config(v) for k, v in data.items()})

    def nearest(self, key: TuneKey) -> Config | None:
        """The config of the entry nearest ``key`` among those of its kernel, device and dtype: the
        nearest problem sizes first, then the nearest token bucket; None where none is near."""
        def distance(a: tuple[int, ...], b: tuple[int, ...]) -> float:
            return sum(abs(math.log2(x / y)) for x, y in zip(a, b))

        same = [k for k in self.entries if (k.kernel, k.device, k.dtype) == (key.kernel, key.device, key.dtype)
                and len(k.shape) == len(key.shape)]
        if not same:
            return None
        sizes = min(distance(k.shape[1:], key.shape[1:]) for k in same)
        if sizes > self.MAX_SHAPE_DISTANCE:
            return None
        closest = [k for k in same if distance(k.shape[1:], key.shape[1:]) == sizes]
        best = min(closest, key=lambda k: (distance(k.shape[:1], key.shape[:1]), k.shape[0]))
        return self.entries[best]


SHIPPED = Path(__file__).resolve().parents[1] / "data" / "autotuned.json"


@functools.cache
def shipped() -> TunedTable:
    """The configs tuned offline that ship with afdc (``$AFDC_TUNED_CONFIGS`` names another file)."""
    path = os.environ.get("AFDC_TUNED_CONFIGS", SHIPPED)
    try:
        return TunedTable.read(path)
    except FileNotFoundError:
        return TunedTable({})
    except (OSError, ValueError) as err:
        logger.warning("afdc autotune: ignoring the tuned configs in %s (%s)", path, err)
        return TunedTable({})
