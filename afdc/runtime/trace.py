"""An opt-in trace of where an exchange's time goes: wall and CPU nanoseconds per named phase.

Set ``AFDC_TRACE`` to a directory before the processes start (FFN servers inherit it) and each
process writes ``trace-<pid>.json`` there when it ends (:func:`dump`): per phase, every call's
wall and thread-CPU nanoseconds. ``benchmarks/bench_runtime.py --only g`` reads them into a table.
Unset, :func:`phase` returns the function it decorates unchanged: the traced path costs nothing.

Phases are functions, decorated where they are defined; a phase's time includes the phases it
calls (a wait includes the message it takes out of its slot).
"""

from __future__ import annotations

import atexit
import functools
import json
import os
import threading
import time
from collections.abc import Callable
from typing import TypeVar

DIRECTORY = os.environ.get("AFDC_TRACE", "")
_records: dict[str, list[tuple[int, int]]] = {}  # phase -> (wall ns, CPU ns) of each call
_lock = threading.Lock()

F = TypeVar("F", bound=Callable)


def phase(name: str) -> Callable[[F], F]:
    """Time every call of the decorated function as phase ``name`` where ``AFDC_TRACE`` is set."""

    def decorate(fn: F) -> F:
        if not DIRECTORY:
            return fn

        @functools.wraps(fn)
        def timed(*args, **kwargs):
            wall, cpu = time.perf_counter_ns(), time.thread_time_ns()
            try:
                return fn(*args, **kwargs)
            finally:
                took = (time.perf_counter_ns() - wall, time.thread_time_ns() - cpu)
                with _lock:
                    _records.setdefault(name, []).append(took)

        return timed  # type: ignore[return-value]

    return decorate


def dump() -> None:
    """Write this process's records to ``$AFDC_TRACE/trace-<pid>.json`` (nothing where unset). A
    process that leaves through ``os._exit`` (an FFN server) calls it itself; others at exit."""
    if not DIRECTORY:
        return
    with _lock:
        records = {name: list(calls) for name, calls in _records.items()}
    path = os.path.join(DIRECTORY, f"trace-{os.getpid()}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(records, f)
    os.replace(path + ".tmp", path)


if DIRECTORY:
    atexit.register(dump)
