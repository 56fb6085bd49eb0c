"""Settings of the distributed runtime, shared by the attention side and the FFN servers."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from afdc.errors import AfdcError


class ConnectorKind(str, Enum):
    """What carries activations between the attention and the FFN side: the one list of them,
    from the CLI's choices to the transport registry (:mod:`afdc.runtime.transport`)."""

    GLOO = "gloo"  # torch.distributed over TCP: any hosts
    NCCL = "nccl"  # GPU to GPU, any hosts
    SHM = "shm"  # shared memory, same host
    CUDA_IPC = "cuda-ipc"  # GPU memory shared between processes, same host
    LOOPBACK = "loopback"  # no link: the FFN programs run in the attention rank's process (monolithic)

    @property
    def in_process(self) -> bool:
        """Whether the FFN side runs in the attention rank's own process (no servers, no store)."""
        return self is ConnectorKind.LOOPBACK

    @classmethod
    def parse(cls, value: str | ConnectorKind) -> ConnectorKind:
        """``value`` as a kind, or an error naming the kinds there are."""
        try:
            return cls(value)
        except ValueError:
            names = ", ".join(k.value for k in cls)
            raise AfdcError(f"unknown connector {value!r}; choose one of {names}") from None

    def __str__(self) -> str:
        return self.value


class WaitPolicy(str, Enum):
    """How a rank's wait for its peer over shm chooses between polling and sleeping, unless
    ``spin`` fixes it (see :class:`afdc.runtime.transport.base.Waiter`)."""

    ADAPTIVE = "adaptive"  # poll only while the peer's answer is likely soon, learned per link and phase
    CORES = "cores"  # the earlier fixed policy: attention ranks poll 2 ms, FFN servers only on 8 cores or more

    @classmethod
    def parse(cls, value: str | WaitPolicy) -> WaitPolicy:
        try:
            return cls(value)
        except ValueError:
            raise AfdcError(f"unknown wait policy {value!r}; choose one of {', '.join(k.value for k in cls)}") from None

    def __str__(self) -> str:
        return self.value


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
    wait: WaitPolicy = WaitPolicy.ADAPTIVE  # shm: how a wait chooses between polling and sleeping (a name is parsed)
    max_sleep: float = 2e-4  # shm without futexes: the longest sleep between two polls of a busy rank
    idle_sleep: float = 2e-3  # shm without futexes: ... of a rank idle for 50 ms (its wake-up rate)
    # FFN: pad each layer's batch to a power of two up to this many tokens, a CUDA graph each on a GPU (0: off)
    token_buckets: int = 0
    gather: float = 2e-3  # FFN: seconds a layer's message waits for the other attention ranks' (one FFN run)
    log_interval: float = 30.0  # seconds between metrics log lines (0: never)

    def __post_init__(self) -> None:
        object.__setattr__(self, "connector", ConnectorKind.parse(self.connector))
        object.__setattr__(self, "wait", WaitPolicy.parse(self.wait))
