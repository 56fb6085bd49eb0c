"""Settings of the distributed runtime, shared by the attention side and the FFN servers."""

from __future__ import annotations

from dataclasses import dataclass

from afdc.runtime.transport import ConnectorKind
from afdc.runtime.transport.base import Pacing, WaitPolicy, default_spin


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
    # shm: how a wait chooses between polling and sleeping (a name is parsed); cores until the
    # adaptive wait is shown faster on a quiet host (it decoded at 0.47 of in process against 0.68)
    wait: WaitPolicy = WaitPolicy.CORES
    max_sleep: float = 2e-4  # shm without futexes: the longest sleep between two polls of a busy rank
    idle_sleep: float = 2e-3  # shm without futexes: ... of a rank idle for 50 ms (its wake-up rate)
    # FFN: pad each layer's batch to a power of two up to this many tokens, a CUDA graph each on a GPU (0: off)
    token_buckets: int = 0
    gather: float = 2e-3  # FFN: seconds a layer's message waits for the other attention ranks' (one FFN run)
    log_interval: float = 30.0  # seconds between metrics log lines (0: never)

    def __post_init__(self) -> None:
        object.__setattr__(self, "connector", ConnectorKind.parse(self.connector))
        object.__setattr__(self, "wait", WaitPolicy.parse(self.wait))

    def pacing(self, role: str) -> Pacing:
        """A ``role`` rank's pacing: ``spin`` where set (every role's), else as ``wait`` says:
        learned from the peer's answers (None), or by role and cores (:func:`default_spin`)."""
        spin = self.spin
        if spin is None and self.wait is WaitPolicy.CORES:
            spin = default_spin(role)
        return Pacing(spin, self.max_sleep, self.idle_sleep)
