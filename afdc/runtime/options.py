"""Settings of the distributed runtime, shared by the attention side and the FFN servers."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

from afdc.runtime.transport import ConnectorKind
from afdc.runtime.transport.base import Pacing, WaitPolicy, default_spin
from afdc.runtime.transport.spin_budget import BudgetSettings


@dataclass(frozen=True)
class RuntimeOptions:
    connector: ConnectorKind = ConnectorKind.GLOO  # what carries the activations (a name is parsed)
    rendezvous: str | None = None  # HOST:PORT of the store; None: the launcher picks a free local port
    token: str | None = None  # shared deployment secret; None: $AFDC_TOKEN
    insecure_no_token: bool = False  # run without a token (anyone reaching the store can join); else refused
    timeout: float = 30.0  # seconds an FFN reply may take before afdc.PeerLost
    join_timeout: float = 60.0  # seconds the attention side waits for every FFN rank to (re)join
    poll_interval: float = 0.2  # how often an idle FFN server or an attention rank looks for a regrouping
    spin: float | None = None  # shm: seconds a waiting rank polls before blocking, every role (None: as ``wait`` says)
    # shm: how a wait chooses between polling and sleeping (a name is parsed): learned from the
    # peer's answers, or ``cores``, the earlier fixed policy
    wait: WaitPolicy = WaitPolicy.ADAPTIVE
    spin_cap: float = BudgetSettings.cap  # shm, adaptive wait: the longest a learned spin lasts (and answer spun for)
    # shm, adaptive wait: a poll back this late from its yield ends the spin (the core was wanted; 0: never)
    yield_late: float = Pacing.yield_late
    max_sleep: float = 2e-4  # shm without futexes: the longest sleep between two polls of a busy rank
    idle_sleep: float = 2e-3  # shm without futexes: ... of a rank idle for 50 ms (its wake-up rate)
    # FFN: pad each layer's batch to a power of two up to this many tokens, a CUDA graph each on a GPU (0: off)
    token_buckets: int = 0
    gather: float = 2e-3  # FFN: seconds a layer's message waits for the other attention ranks' (one FFN run)
    log_interval: float = 30.0  # seconds between metrics log lines (0: never)
    # torch threads of each FFN server process the runtime starts (None: torch's default, a thread
    # per core; dm.launch() gives each server its share of the host's cores instead)
    threads: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "connector", ConnectorKind.parse(self.connector))
        object.__setattr__(self, "wait", WaitPolicy.parse(self.wait))
        if self.yield_late < 0:
            raise ValueError(f"yield_late={self.yield_late}: seconds, 0 or more (0: a late yield never ends a spin)")
        if self.spin_cap < 0:
            raise ValueError(f"spin_cap={self.spin_cap}: a wait spins for zero seconds or more")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads={self.threads}: an FFN server computes with at least one torch thread")

    def pacing(self, role: str) -> Pacing:
        """A ``role`` rank's pacing: ``spin`` where set (every role's), else as ``wait`` says:
        learned from the peer's answers (None), or by role and cores (:func:`default_spin`)."""
        spin = self.spin
        if spin is None and self.wait is WaitPolicy.CORES:
            spin = default_spin(role)
        return Pacing(spin, self.max_sleep, self.idle_sleep, budget=BudgetSettings(cap=self.spin_cap),
                      yield_late=self.yield_late or math.inf)


def share_of_cores(processes: int, reserved: int = 0, cores: int | None = None) -> int:
    """Torch threads for each of ``processes`` computing processes that share this host's ``cores``
    (default: those this process may run on), ``reserved`` of them kept for other work; at least one.
    Processes left to torch's default take a thread per core each, and their thread pools then
    stall each other: on a busy 2-core host a tiny MoE's layer round trip under ``dm.launch()``
    took 30-60 ms with a 2-thread FFN server, 1-4 ms with a 1-thread one."""
    cores = cores or len(os.sched_getaffinity(0))
    return max(1, (cores - reserved) // max(1, processes))
