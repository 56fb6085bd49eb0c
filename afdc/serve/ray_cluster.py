"""Deploying a plan onto an existing Ray cluster (``afdc up --ray [ADDRESS]``).

Each FFN rank is a Ray actor (:class:`FfnRank`) that takes one unit of the FFN pool's resource
(``afdc_ffn`` unless told otherwise), so Ray places it on a node of that pool, and restarts it
when its process dies; the restarted server rejoins the deployment as a restarted
``afdc serve --role ffn`` does. With ``--ffn-spares N``, N more actors of the pool wait as hot
spares (:mod:`afdc.runtime.spare`): one takes a lost rank over, and an actor that Ray restarts
(a rank's or a spare's) comes back as a spare, as ``afdc up`` restarts its processes. The
attention ranks are vLLM's DP engines under
``--data-parallel-backend ray``: the ``vllm serve`` process runs here (this node must be in the
cluster) and vLLM places one engine actor per DP rank on a node with one unit of the attention
pool's resource (afdc's platform names it as vLLM's ``ray_device_key``), local DP ranks on this
node. Attention rank 0 hosts the rendezvous store at this node's Ray address, which every FFN
actor is given.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from afdc.errors import AfdcError
from afdc.runtime.options import RuntimeOptions
from afdc.runtime.rendezvous import free_port
from afdc.serve.settings import ENV, WorkerSettings
from afdc.serve.up import Deployment

NAMESPACE = "afdc"  # the Ray namespace of afdc's named actors


@dataclass(frozen=True)
class RayPools:
    """Where a plan's roles go on a Ray cluster: each rank takes one unit of its pool's resource."""

    address: str = "auto"  # the cluster (ray.init's address; auto: $RAY_ADDRESS or this node's cluster)
    attention: str = "afdc_attn"  # each attention rank (vLLM DP engine); GPU or CPU are Ray's own
    ffn: str = "afdc_ffn"  # each FFN rank
    max_restarts: int = -1  # how often Ray restarts a lost FFN rank (-1: always)


def resource_demand(resource: str) -> dict:
    """Ray actor options taking one unit of ``resource`` (Ray's own GPU and CPU have their own options)."""
    if resource == "GPU":
        return {"num_gpus": 1}
    if resource == "CPU":
        return {"num_cpus": 1}
    return {"num_cpus": 0, "resources": {resource: 1}}  # the pool's resource alone decides where it runs


class FfnRank:
    """One FFN rank as a Ray actor, or a spare (``rank`` None): its server runs in a thread of the
    actor's process, and the process ends when the server does, so that Ray restarts it (a new
    server, which rejoins). ``spares``: the deployment has spares, so a restarted actor comes
    back as one (a spare has taken its rank over, or will)."""

    def __init__(self, artifact: str, rank: int | None, options: RuntimeOptions, device: str, backend: str | None,
                 spares: bool = False) -> None:
        import ray

        from afdc.serve.ffn import serve_ffn_rank, serve_ffn_spare

        if spares and ray.get_runtime_context().was_current_actor_reconstructed:
            rank = None
        self.rank = rank
        # both end this process when their server stops (os._exit), whatever stopped it
        if rank is None:
            target, args, name = serve_ffn_spare, (artifact, options, device, backend), "ffn-spare"
        else:
            target, args, name = serve_ffn_rank, (artifact, rank, options, device, backend), f"ffn-rank-{rank}"
        threading.Thread(target=target, args=args, daemon=True, name=name).start()

    def started_as(self) -> int | None:
        """The FFN rank this actor's process started as (None: a spare)."""
        return self.rank

    def where(self) -> tuple[str, int]:
        """The Ray node id and the pid of the process serving this rank."""
        import ray

        return ray.get_runtime_context().get_node_id(), os.getpid()


def actor_name(artifact: str | Path, rendezvous: str, role: str) -> str:
    """The actor name of ``role`` (``ffn-R``, ``spare-I``): its artifact and its deployment's store
    address, which no other live deployment on the cluster holds (two deployments of one artifact
    must not collide in Ray's namespace)."""
    return f"{Path(artifact).resolve().name}-{role}@{rendezvous}"


def _ray():
    try:
        import ray
    except ImportError as err:
        raise AfdcError('afdc up --ray needs Ray: pip install -e ".[ray]" (on every node of the cluster)') from err
    return ray


@dataclass
class RayDeployment(Deployment):
    """A plan's roles on a Ray cluster: FFN ranks as actors, attention ranks as vLLM's Ray DP engines."""

    pools: RayPools = RayPools()

    def __post_init__(self) -> None:
        super().__post_init__()
        self.actors: dict[str, object] = {}  # the FFN ranks' actor handles, by role name

    def start(self, startup_timeout: float, say: Callable[[str], None], asked: Callable[[], str] = lambda: "") -> str:
        ray = _ray()
        if not ray.is_initialized():
            ray.init(address=self.pools.address, namespace=NAMESPACE, log_to_driver=self.log_dir is None)
        self._gcs = ray.get_runtime_context().gcs_address
        node_ip = ray.util.get_node_ip_address()  # the address every node reaches this one at
        say(f"on the Ray cluster at {self._gcs}: attention ranks on '{self.pools.attention}', "
            f"FFN ranks on '{self.pools.ffn}'")
        store = replace(self.settings.runtime, rendezvous=f"{node_ip}:{free_port()}")
        self.settings = replace(self.settings, runtime=store, ray_resource=self.pools.attention)
        self.vllm_args = ["--data-parallel-backend", "ray", "--data-parallel-address", node_ip, *self.vllm_args]
        url = super().start(startup_timeout, say, asked)
        for name, actor in self.actors.items():
            node, pid = ray.get(actor.where.remote(), timeout=startup_timeout)
            say(f"{name}: Ray node {node}, pid {pid}")
        return url

    def _start_ffn_ranks(self, ranks: int, settings: WorkerSettings, env: dict[str, str],
                         say: Callable[[str], None]) -> None:
        ray = _ray()
        s = settings
        options = replace(s.runtime, token_buckets=self.token_buckets)  # the token travels in the environment
        actor = ray.remote(FfnRank)
        roles = [(f"ffn-{r}", r, f"FFN rank {r} of {ranks}") for r in range(ranks)]
        roles += [(f"spare-{i}", None, f"spare {i} (it takes over an FFN rank that is lost)")
                  for i in range(self.spares)]
        for role, rank, what in roles:
            name = actor_name(s.artifact, options.rendezvous, role)
            say(f"placing {what} (Ray actor '{name}', one '{self.pools.ffn}')")
            self.actors[role] = actor.options(
                name=name, max_restarts=self.pools.max_restarts, max_task_retries=0,
                runtime_env={"env_vars": {"AFDC_TOKEN": env["AFDC_TOKEN"]}},  # the token, not as an argument
                **resource_demand(self.pools.ffn),
            ).remote(s.artifact, rank, options, s.device, s.backend, self.spares > 0)

    def _default_threads(self, plan, settings: WorkerSettings) -> int | None:
        return None  # the roles are on the cluster's nodes, not sharing this one: torch's default

    def _shared_core(self, plan, settings: WorkerSettings) -> int | None:
        return None  # Ray places each rank on any node: no two share a host's core by design

    def _attention_env(self) -> dict[str, str]:
        # vLLM copies only its own variables into its engine actors: afdc's settings and token too
        extra = os.environ.get("VLLM_RAY_EXTRA_ENV_VARS_TO_COPY", "")
        return {"RAY_ADDRESS": self._gcs,
                "VLLM_RAY_EXTRA_ENV_VARS_TO_COPY": ",".join(filter(None, [extra, ENV, "AFDC_TOKEN"]))}

    def stop(self, grace: float = 10.0) -> None:
        """The attention server first (vLLM removes its engine actors), then the FFN actors."""
        super().stop(grace)
        ray = _ray()
        for actor in self.actors.values():
            ray.kill(actor, no_restart=True)
        self.actors.clear()
        if ray.is_initialized():
            ray.shutdown()
