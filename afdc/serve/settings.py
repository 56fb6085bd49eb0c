"""What the attention role's vLLM worker needs to know, handed to it through the environment.

vLLM starts the worker in its own engine-core process; the settings travel as one JSON
environment variable, whose presence is also what turns afdc's vLLM platform plugin on.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field

from afdc.runtime.options import RuntimeOptions

ENV = "AFDC_SERVE_SETTINGS"


@dataclass(frozen=True)
class WorkerSettings:
    artifact: str  # the compiled artifact directory
    # how this attention rank reaches the FFN side: connector (loopback: the FFN layers run in this
    # process, monolithic), the store's HOST:PORT (hosted by attention rank 0), the token, the timeouts
    runtime: RuntimeOptions = field(default_factory=RuntimeOptions)
    # seconds a step is held for a lost FFN rank to come back; past them its requests get a 503 (see health)
    recovery_timeout: float = 300.0
    micro_batches: int | None = None  # None: the artifact's plan
    kv_cache_bytes: int = 256 << 20  # KV pool on a CPU device (on a GPU: what vLLM's memory profile allows)
    device: str = "cpu"
    backend: str | None = None  # what runs the programs (afdc.lowering.backends); None: the artifact's plan
    threads: int | None = None  # torch threads of the process (None: torch's default)
    # decode steps padded to a power of two up to this many requests per micro-batch, on a GPU
    # each piece between two exchanges a CUDA graph per bucket (afdc.runtime.decode_graphs; 0: off)
    attention_graphs: int = 0
    cpus: tuple[int, ...] | None = None  # the cores each attention rank's step thread runs on (None: any)
    pin_tokens: int = 0  # with cpus: on them only for steps of this many tokens or more (0: every step; see cores)
    # the Ray resource vLLM's DP placement gives each attention rank (--data-parallel-backend ray,
    # afdc up --ray); None: one GPU on a GPU device, else one CPU
    ray_resource: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.runtime, dict):  # after a trip through JSON
            object.__setattr__(self, "runtime", RuntimeOptions(**self.runtime))
        if self.cpus is not None:  # a list after a trip through JSON
            object.__setattr__(self, "cpus", tuple(self.cpus))

    def to_env(self) -> dict[str, str]:
        fields = asdict(self)
        fields["runtime"]["connector"] = self.runtime.connector.value
        fields["runtime"]["wait"] = self.runtime.wait.value
        return {ENV: json.dumps(fields)}

    def open_rendezvous(self, host: bool = False):
        """This deployment's rendezvous store, reached (or hosted) within ``join_timeout``."""
        from afdc.artifact.load import deployment_of
        from afdc.runtime.rendezvous import Rendezvous

        layout, deployment = deployment_of(self.artifact)
        r = self.runtime
        return Rendezvous(r.rendezvous, layout, deployment, r.token, host=host,
                          connect_timeout=r.join_timeout, insecure_no_token=r.insecure_no_token)

    @classmethod
    def from_env(cls) -> WorkerSettings:
        raw = os.environ.get(ENV)
        if raw is None:
            raise RuntimeError(f"${ENV} is not set: the afdc worker runs only under `afdc serve --role attn`")
        return cls(**json.loads(raw))


def active() -> bool:
    return ENV in os.environ
