"""What the attention role's vLLM worker needs to know, handed to it through the environment.

vLLM starts the worker in its own engine-core process; the settings travel as one JSON
environment variable, whose presence is also what turns afdc's vLLM platform plugin on.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass

from afdc.runtime.options import ConnectorKind

ENV = "AFDC_SERVE_SETTINGS"


@dataclass(frozen=True)
class WorkerSettings:
    artifact: str  # the compiled artifact directory
    connector: ConnectorKind = ConnectorKind.GLOO  # loopback: the FFN layers run in this process (monolithic)
    rendezvous: str | None = None  # HOST:PORT of the deployment's store (hosted by attention rank 0)
    token: str | None = None  # the deployment secret; None: $AFDC_TOKEN
    insecure_no_token: bool = False  # run without a token (afdc serve --insecure-no-token)
    timeout: float = 30.0  # seconds an FFN reply may take
    join_timeout: float = 60.0  # seconds to wait for every FFN rank to join
    # seconds a step is held for a lost FFN rank to come back; past them its requests get a 503 (see health)
    recovery_timeout: float = 300.0
    micro_batches: int | None = None  # None: the artifact's plan
    kv_cache_bytes: int = 256 << 20  # KV pool on a CPU device (on a GPU: what vLLM's memory profile allows)
    device: str = "cpu"
    backend: str | None = None  # what runs the programs (afdc.lowering.backends); None: the artifact's plan
    log_interval: float = 30.0  # seconds between metrics log lines (0: never)
    spin: float | None = None  # seconds a wait for a peer polls before blocking (None: default_spin)
    threads: int | None = None  # torch threads of the process (None: torch's default)
    cpus: tuple[int, ...] | None = None  # the cores each attention rank's step thread runs on (None: any)
    pin_tokens: int = 0  # with cpus: on them only for steps of this many tokens or more (0: every step; see cores)
    # the Ray resource vLLM's DP placement gives each attention rank (--data-parallel-backend ray,
    # afdc up --ray); None: one GPU on a GPU device, else one CPU
    ray_resource: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "connector", ConnectorKind.parse(self.connector))
        if self.cpus is not None:  # a list after a trip through JSON
            object.__setattr__(self, "cpus", tuple(self.cpus))

    def to_env(self) -> dict[str, str]:
        return {ENV: json.dumps({**asdict(self), "connector": self.connector.value})}

    def open_rendezvous(self, host: bool = False):
        """This deployment's rendezvous store, reached (or hosted) within ``join_timeout``."""
        from afdc.artifact.load import deployment_of
        from afdc.runtime.rendezvous import Rendezvous

        layout, deployment = deployment_of(self.artifact)
        return Rendezvous(self.rendezvous, layout, deployment, self.token, host=host,
                          connect_timeout=self.join_timeout, insecure_no_token=self.insecure_no_token)

    @classmethod
    def from_env(cls) -> WorkerSettings:
        raw = os.environ.get(ENV)
        if raw is None:
            raise RuntimeError(f"${ENV} is not set: the afdc worker runs only under `afdc serve --role attn`")
        return cls(**json.loads(raw))


def active() -> bool:
    return ENV in os.environ
