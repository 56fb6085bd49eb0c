"""Starting the roles of a compiled artifact: one attention server, or every role on this machine.

``afdc serve --role attn`` becomes vLLM's own OpenAI server (``vllm serve``) on the artifact's
``model/`` directory, with afdc's platform plugin switched on by :class:`WorkerSettings` in the
environment; the plan's attention ranks are its data-parallel ranks (:mod:`afdc.serve.data_parallel`).
``afdc up`` starts the FFN ranks and that one attention server as child processes, waits until
it answers ``/health``, and stops them all on SIGINT/SIGTERM.
"""

from __future__ import annotations

import contextlib
import http.client
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from afdc.artifact.manifest import VOCABULARY_FILES, Manifest, read_manifest
from afdc.errors import AfdcError, UnsupportedModelError
from afdc.runtime.options import share_of_cores
from afdc.serve.cores import PAIR_TOKENS, shared_core
from afdc.serve.data_parallel import DataParallel
from afdc.serve.health import MIDDLEWARE
from afdc.serve.settings import WorkerSettings
from afdc.serve.speculative_config import artifact_refusal, config_in_args

if TYPE_CHECKING:
    from afdc.plan import Plan

_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def check_serving_environment() -> None:
    """vLLM importable, and none of the CUDA-only packages its requirements pull in on a CPU machine."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        raise AfdcError('serving needs vLLM: pip install -e ".[serve]" (see the README for a CPU-only machine)')
    for name in ("torchvision", "torchcodec"):
        if importlib.util.find_spec(name) is None:
            continue
        try:
            __import__(name)
        except Exception as err:  # a CUDA build on a CPU machine fails in many ways
            raise AfdcError(
                f"{name} is installed but does not import ({str(err).splitlines()[0]}); vLLM imports it when present. "
                f"afdc does not need it: pip uninstall -y {name}"
            ) from err


def check_tokenizer(manifest: Manifest, vllm_args: Sequence[str]) -> None:
    """Refuse an artifact without a tokenizer where vLLM would load one (it fails late, and less clearly)."""
    if manifest.model_files and not manifest.has_tokenizer and "--skip-tokenizer-init" not in vllm_args:
        raise AfdcError(
            f"the artifact has no tokenizer (its source directory held none of {', '.join(VOCABULARY_FILES)}): "
            "compile it from a directory with the model's tokenizer, or serve token ids only (-- --skip-tokenizer-init)"
        )


def check_speculation(manifest: Manifest, vllm_args: Sequence[str]) -> None:
    """Refuse a ``--speculative-config`` afdc's worker cannot run with this artifact, before vLLM starts."""
    try:
        config = config_in_args(vllm_args)
    except ValueError as err:
        raise AfdcError(str(err)) from None
    if config is None:
        return
    why = artifact_refusal(config, manifest)
    if why:
        raise AfdcError(why)


def check_servable(manifest: Manifest) -> None:
    """Refuse an artifact that vLLM's paged KV cache cannot run, before vLLM's engine starts."""
    if manifest.unpageable:
        raise UnsupportedModelError(
            f"{manifest.unpageable}: it cannot run on a paged KV cache; use afdc.disaggregate / dm.generate instead"
        )
    if manifest.max_positions is not None:
        raise UnsupportedModelError(
            f"this model's graph is valid for at most {manifest.max_positions} positions, and a serving step "
            "runs all its scheduled tokens in one call, which can exceed that; use afdc.disaggregate instead"
        )


def attention_command(settings: WorkerSettings, host: str, port: int, vllm_args: Sequence[str] = ()) -> list[str]:
    """The ``vllm serve`` command line of the plan's attention ranks (vLLM's DP ranks), or of those
    that ``vllm_args`` place on this host (its environment adds :func:`attention_env`)."""
    from afdc.artifact.load import model_dir

    directory = Path(settings.artifact)
    manifest = read_manifest(directory)
    check_servable(manifest)
    check_tokenizer(manifest, vllm_args)
    check_speculation(manifest, vllm_args)
    dp = DataParallel.of(vllm_args).checked(manifest.plan.attention_ranks)
    model = model_dir(directory)
    argv = [
        sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", str(model),
        "--host", host, "--port", str(port),
        "--served-model-name", directory.resolve().name,
        "--dtype", _DTYPES.get(manifest.plan.dtype or "", "auto"),
        "--middleware", MIDDLEWARE,
        *dp.args(vllm_args),
    ]
    return argv


def ffn_command(settings: WorkerSettings, rank: int | None, token_buckets: int = 0) -> list[str]:
    """The command that runs FFN rank ``rank`` of ``settings``' deployment (``afdc serve --role
    ffn``), or a spare for its FFN ranks where ``rank`` is None."""
    s, r = settings, settings.runtime
    return [
        sys.executable, "-m", "afdc.cli", "serve", s.artifact, "--role", "ffn",
        *(["--rank", str(rank)] if rank is not None else ["--spare"]),
        "--rendezvous", r.rendezvous, "--connector", r.connector.value, "--timeout", str(r.timeout),
        "--join-timeout", str(r.join_timeout), "--device", s.device, "--log-interval", str(r.log_interval),
        "--token-buckets", str(token_buckets), *(["--backend", s.backend] if s.backend else []),
        *(["--spin", str(r.spin)] if r.spin is not None else []), "--wait", r.wait.value,
        "--spin-cap", str(r.spin_cap), "--yield-late", str(r.yield_late),
        *(["--threads", str(s.threads)] if s.threads else []),
        *(["--cpus", ",".join(map(str, s.cpus))] if s.cpus else []),
        *(["--pin-tokens", str(s.pin_tokens)] if s.cpus and s.pin_tokens else []),
    ]


def threads_per_role(plan: Plan, settings: WorkerSettings, cores: int | None = None) -> int | None:
    """Torch threads for each process when every role of ``plan`` runs on this host: on a CPU
    device, the ``cores`` this process may use (default: all of them) less one, kept for vLLM's
    API server, its scheduler and the clients, shared among the processes that compute (the
    attention engines, and the FFN servers unless monolithic); None on a GPU (torch's default).
    Each process left to torch's default takes a thread per core, and the processes' thread pools
    then stall each other: on 2 cores, under 16 streams of ``vllm bench serve``, the demo served
    1A1F took 3.5x the monolith's time per token with 2 threads a process and 1.4x with one, and
    the monolith itself 1.34x its time with one thread."""
    if settings.device.split(":")[0] != "cpu":
        return None
    computing = plan.attention_ranks + (0 if settings.runtime.connector.in_process else plan.ffn_ranks)
    return share_of_cores(computing, reserved=1, cores=cores)


def attention_env(settings: WorkerSettings) -> dict[str, str]:
    """What the attention server's environment adds to this process's: the settings, and on a CPU
    device vLLM's engine cores started by fork unless the user chose. vLLM's CLI otherwise picks
    spawn, and each engine core then imports vLLM, torch and afdc again: 18 of a demo deployment's
    55 CPU-seconds to ready on a 2-core host, 2 with fork. On a GPU vLLM's choice stands (a forked
    CUDA runtime is unsafe; vLLM itself switches to spawn once CUDA is initialized)."""
    env = settings.to_env()
    if settings.device.split(":")[0] == "cpu" and "VLLM_WORKER_MULTIPROC_METHOD" not in os.environ:
        env["VLLM_WORKER_MULTIPROC_METHOD"] = "fork"
    return env


def serve_attention(settings: WorkerSettings, host: str, port: int, vllm_args: Sequence[str] = ()) -> NoReturn:
    """Become the OpenAI server of the plan's attention ranks, or of those ``vllm_args`` place on
    this host (this process is replaced)."""
    check_serving_environment()
    argv = attention_command(settings, host, port, vllm_args)
    if not settings.runtime.connector.in_process and not DataParallel.of(vllm_args).hosts_rank_zero:
        # reach the store here (TCPStore retries with backoff), rather than fail as a trace from vLLM's engine
        settings.open_rendezvous()
    os.execve(argv[0], argv, {**os.environ, **attention_env(settings)})


class StopAsked(AfdcError):
    """A stop was asked for (a signal) while the deployment started."""


def wait_healthy(url: str, deadline: float, alive: Callable[[], bool],
                 asked: Callable[[], str] = lambda: "") -> None:
    """Poll ``url``/health until it answers 200; ``alive`` says whether the server process still
    runs, ``asked`` what asked for a stop ("" while none did: then :class:`StopAsked`)."""
    while True:
        if asked():  # before ``alive``: a Ctrl-C also ends the server, and that is no failure
            raise StopAsked(f"stopped while starting (asked for by {asked()})")
        # HTTPException: before the server listens, a probe from a port in the ephemeral range
        # can connect to itself (TCP self-connect) and read its own request as a bad status line
        with (
            contextlib.suppress(urllib.error.URLError, ConnectionError, TimeoutError, http.client.HTTPException),
            urllib.request.urlopen(f"{url}/health", timeout=1) as r,
        ):
            if r.status == 200:
                return
        if not alive():
            raise AfdcError(f"the server behind {url} exited before it became healthy; its log says why")
        if time.monotonic() > deadline:
            raise AfdcError(f"{url} was not healthy within the start-up deadline; raise --startup-timeout")
        time.sleep(0.5)


@dataclass
class Deployment:
    """Every role of one artifact's plan as child processes of this one."""

    artifact: Path
    settings: WorkerSettings  # the attention ranks' settings
    host: str = "127.0.0.1"
    port: int = 8000  # the OpenAI API of every attention rank (vLLM balances requests over its DP ranks)
    vllm_args: Sequence[str] = ()
    log_dir: Path | None = None  # each role's output goes to a file there; None: this terminal
    token_buckets: int = 0  # the FFN ranks' (afdc serve --token-buckets)
    pin: bool | None = None  # 1A1F's engine and FFN server on one core (None: on a small CPU host; see cores)
    spares: int = 0  # standby FFN processes that take a lost rank over (afdc.runtime.spare)

    def __post_init__(self) -> None:
        self.processes: dict[str, subprocess.Popen] = {}
        self._commands: dict[str, tuple[list[str], dict[str, str]]] = {}

    def _spawn(self, name: str, argv: list[str], env: dict[str, str]) -> None:
        out = open(self.log_dir / f"{name}.log", "a") if self.log_dir else None  # noqa: SIM115 (lives with the child)
        self.processes[name] = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT if out else None)
        self._commands[name] = (argv, env)

    def restart(self, name: str) -> None:
        """Start role ``name`` (e.g. ``ffn-0``) again after it exited; the attention ranks regroup
        with it. With spares, an FFN process comes back as a spare: a spare has taken its rank
        over, or will."""
        if self.processes[name].poll() is None:
            raise AfdcError(f"{name} is still running")
        argv, env = self._commands[name]
        if self.spares and name.startswith(("ffn", "spare")):
            self._release(self.processes[name].pid)
            argv = ffn_command(self._ffn_settings, None, self.token_buckets)
        self._spawn(name, argv, env)

    def _release(self, pid: int) -> None:
        """Record as lost any FFN slot whose owner was process ``pid`` (it exited): a spare that
        claimed a slot and died before it joined was never lost by an attention rank, which
        waits for it to join; another spare then claims the slot."""
        from afdc.runtime.spare import Slots

        ffn = self._ffn_settings
        rdv = replace(ffn, runtime=replace(ffn.runtime, token=self._token)).open_rendezvous()
        slots = Slots(rdv)
        for slot in rdv.layout.peers("attn"):
            owner, _ = slots.owner(slot)
            if owner is not None and owner.pid == pid and owner.host == socket.gethostname():
                slots.lost(slot, max(rdv.generation(), owner.generation + 1))

    def start(self, startup_timeout: float, say: Callable[[str], None], asked: Callable[[], str] = lambda: "") -> str:
        """Start every role and wait until the OpenAI API answers; returns its URL. ``asked`` says
        what asked for a stop meanwhile ("" while nothing did): then :class:`StopAsked` at once."""
        plan = read_manifest(self.artifact).plan
        s, r = self.settings, self.settings.runtime
        env = {**os.environ, "AFDC_TOKEN": r.token or os.environ.get("AFDC_TOKEN") or secrets.token_hex(16)}
        self._token = env["AFDC_TOKEN"]
        settings = replace(s, runtime=replace(r, token=None), threads=s.threads or self._default_threads(plan, s))
        core = self._shared_core(plan, settings)
        if core is not None:
            by_load = self.pin is None  # a host of few cores: shared while steps are big (see cores.Placement)
            settings = replace(settings, cpus=(core,), pin_tokens=PAIR_TOKENS if by_load else 0)
            say(f"the attention engine's step thread and the FFN rank share core {core}"
                + (f" while steps hold {PAIR_TOKENS} tokens or more (a host of few cores; --pin: always, "
                   "--no-pin: never)" if by_load else "")
                + "; they take turns")
        argv = attention_command(settings, self.host, self.port, self.vllm_args)  # refused before any role starts
        if not r.connector.in_process:
            # the FFN ranks wait for the store that attention rank 0 hosts once its vLLM engine is up
            waiting = replace(settings.runtime, join_timeout=max(r.join_timeout, startup_timeout))
            self._start_ffn_ranks(plan.ffn_ranks, replace(settings, runtime=waiting), env, say)
        say(f"starting {plan.attention_ranks} attention ranks (vLLM data-parallel engines) on port {self.port}")
        self._spawn("attn", argv, {**env, **attention_env(settings), **self._attention_env()})
        proc = self.processes["attn"]
        url = f"http://{self.host}:{self.port}"
        wait_healthy(url, time.monotonic() + startup_timeout, lambda: proc.poll() is None, asked)
        say("the attention ranks are ready")
        return url

    def _start_ffn_ranks(self, ranks: int, settings: WorkerSettings, env: dict[str, str],
                         say: Callable[[str], None]) -> None:
        """Start FFN ranks ``0 .. ranks - 1`` and the spares (here: child processes)."""
        self._ffn_settings = settings
        for r in range(ranks):
            say(f"starting FFN rank {r} of {ranks}")
            self._spawn(f"ffn-{r}", ffn_command(settings, r, self.token_buckets), env)
        for i in range(self.spares):
            say(f"starting spare {i} (it takes over an FFN rank that is lost)")
            self._spawn(f"spare-{i}", ffn_command(settings, None, self.token_buckets), env)

    def _attention_env(self) -> dict[str, str]:
        """What the attention server's environment needs beyond the settings (here: nothing)."""
        return {}

    def _default_threads(self, plan: Plan, settings: WorkerSettings) -> int | None:
        """Torch threads per process unless given (here: every role shares this host's cores)."""
        return threads_per_role(plan, settings)

    def _shared_core(self, plan: Plan, settings: WorkerSettings) -> int | None:
        """The core 1A1F's pair shares, if any (here: every role is on this host)."""
        micro_batches = settings.micro_batches or plan.micro_batches
        return shared_core(plan, micro_batches, settings.device, not settings.runtime.connector.in_process, self.pin)

    def failed(self) -> str | None:
        """The first role whose process has exited, if any (an FFN process or spare: ``ffn-R``, ``spare-I``)."""
        return next((name for name, p in self.processes.items() if p.poll() is not None), None)

    def stop(self, grace: float = 10.0) -> None:
        """SIGTERM the attention server first, then the FFN ranks; a role still running ``grace``
        seconds after its SIGTERM is killed."""
        attention = [n for n in self.processes if n.startswith("attn")]
        for names in (attention, [n for n in self.processes if n not in attention]):
            deadline = time.monotonic() + grace
            for name in names:
                if self.processes[name].poll() is None:
                    self.processes[name].send_signal(signal.SIGTERM)
            for name in names:
                proc = self.processes[name]
                try:
                    proc.wait(max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
