"""Starting the roles of a compiled artifact: one attention server, or every role on this machine.

``afdc serve --role attn`` becomes vLLM's own OpenAI server (``vllm serve``) on the artifact's
``model/`` directory, with afdc's platform plugin switched on by :class:`WorkerSettings` in the
environment. ``afdc up`` starts the FFN ranks and the attention ranks of the plan as child
processes, waits until each attention server answers ``/health``, and stops them all on
SIGINT/SIGTERM.
"""

from __future__ import annotations

import contextlib
import http.client
import os
import secrets
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import NoReturn

from afdc.artifact.manifest import VOCABULARY_FILES, Manifest, read_manifest
from afdc.errors import AfdcError, UnsupportedModelError
from afdc.serve.health import MIDDLEWARE
from afdc.serve.settings import WorkerSettings

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
    """The ``vllm serve`` command line of one attention rank (its environment adds ``settings.to_env()``)."""
    from afdc.artifact.load import model_dir

    directory = Path(settings.artifact)
    manifest = read_manifest(directory)
    manifest.rank_files("attn", settings.rank)  # a clear error for a rank the plan does not have
    check_servable(manifest)
    check_tokenizer(manifest, vllm_args)
    model = model_dir(directory)
    argv = [
        sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", str(model),
        "--host", host, "--port", str(port),
        "--served-model-name", directory.resolve().name,
        "--dtype", _DTYPES.get(manifest.plan.dtype or "", "auto"),
        "--middleware", MIDDLEWARE,
        *vllm_args,
    ]
    return argv


def ffn_command(settings: WorkerSettings, rank: int, token_buckets: int = 0) -> list[str]:
    """The command that runs FFN rank ``rank`` of ``settings``' deployment (``afdc serve --role ffn``)."""
    s = settings
    return [
        sys.executable, "-m", "afdc.cli", "serve", s.artifact, "--role", "ffn", "--rank", str(rank),
        "--rendezvous", s.rendezvous, "--connector", s.connector.value, "--timeout", str(s.timeout),
        "--join-timeout", str(s.join_timeout), "--device", s.device,
        "--token-buckets", str(token_buckets), *(["--backend", s.backend] if s.backend else []),
    ]


def serve_attention(settings: WorkerSettings, host: str, port: int, vllm_args: Sequence[str] = ()) -> NoReturn:
    """Become attention rank ``settings.rank``'s OpenAI server (this process is replaced)."""
    check_serving_environment()
    argv = attention_command(settings, host, port, vllm_args)
    if not settings.connector.in_process and not settings.host_rendezvous:
        # reach the store here (TCPStore retries with backoff), rather than fail as a trace from vLLM's engine
        settings.open_rendezvous()
    os.execve(argv[0], argv, {**os.environ, **settings.to_env()})


def wait_healthy(url: str, deadline: float, alive: Callable[[], bool]) -> None:
    """Poll ``url``/health until it answers 200; ``alive`` says whether the server process still runs."""
    while True:
        # HTTPException: before the server listens, a probe from a port in the ephemeral range
        # can connect to itself (TCP self-connect) and read its own request as a bad status line
        with (
            contextlib.suppress(urllib.error.URLError, ConnectionError, TimeoutError, http.client.HTTPException),
            urllib.request.urlopen(f"{url}/health", timeout=5) as r,
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
    settings: WorkerSettings  # the attention ranks' settings (rank filled in per rank)
    host: str = "127.0.0.1"
    port: int = 8000  # the OpenAI API (with several attention ranks, rank i serves on port + 1 + i)
    vllm_args: Sequence[str] = ()
    log_dir: Path | None = None  # each role's output goes to a file there; None: this terminal
    token_buckets: int = 0  # the FFN ranks' (afdc serve --token-buckets)

    def __post_init__(self) -> None:
        self.processes: dict[str, subprocess.Popen] = {}
        self._commands: dict[str, tuple[list[str], dict[str, str]]] = {}

    def _spawn(self, name: str, argv: list[str], env: dict[str, str]) -> None:
        out = open(self.log_dir / f"{name}.log", "a") if self.log_dir else None  # noqa: SIM115 (lives with the child)
        self.processes[name] = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT if out else None)
        self._commands[name] = (argv, env)

    def restart(self, name: str) -> None:
        """Start role ``name`` (e.g. ``ffn-0``) again after it exited; the attention ranks regroup with it."""
        if self.processes[name].poll() is None:
            raise AfdcError(f"{name} is still running")
        self._spawn(name, *self._commands[name])

    def start(self, startup_timeout: float, say: Callable[[str], None]) -> str:
        """Start every role and wait until the OpenAI API answers; returns its URL."""
        manifest = read_manifest(self.artifact)
        check_servable(manifest)  # before any role starts
        check_tokenizer(manifest, self.vllm_args)
        plan = manifest.plan
        s = self.settings
        env = {**os.environ, "AFDC_TOKEN": s.token or os.environ.get("AFDC_TOKEN") or secrets.token_hex(16)}
        if not s.connector.in_process:
            for r in range(plan.ffn_ranks):
                say(f"starting FFN rank {r} of {plan.ffn_ranks}")
                self._spawn(f"ffn-{r}", ffn_command(s, r, self.token_buckets), env)
        # one rank serves on --port itself; several serve beside it, behind a router on --port
        ports = [self.port] if plan.attention_ranks == 1 else [self.port + 1 + a for a in range(plan.attention_ranks)]
        for a, port in enumerate(ports):
            say(f"starting attention rank {a} of {plan.attention_ranks} (vLLM engine) on port {port}")
            settings = replace(s, rank=a, host_rendezvous=a == 0 and not s.connector.in_process, token=None)
            argv = attention_command(settings, self.host, port, self.vllm_args)
            self._spawn(f"attn-{a}", argv, {**env, **settings.to_env()})
        deadline = time.monotonic() + startup_timeout
        for a, port in enumerate(ports):
            proc = self.processes[f"attn-{a}"]
            wait_healthy(f"http://{self.host}:{port}", deadline, lambda proc=proc: proc.poll() is None)
            say(f"attention rank {a} is ready")
        url = f"http://{self.host}:{self.port}"
        if len(ports) > 1:
            backends = [a for port in ports for a in ("--backend", f"http://{self.host}:{port}")]
            self._spawn("router", [sys.executable, "-m", "afdc.serve.router", "--host", self.host,
                                   "--port", str(self.port), *backends], env)
            router = self.processes["router"]
            wait_healthy(url, deadline, lambda: router.poll() is None)
            say(f"router on port {self.port} sends each request to the attention rank with the fewest in flight")
        return url

    def failed(self) -> str | None:
        """The first role whose process has exited, if any."""
        return next((name for name, p in self.processes.items() if p.poll() is not None), None)

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM the attention servers first (they finish their requests), then the FFN ranks."""
        order = sorted(self.processes, key=lambda n: not n.startswith("attn"))
        for name in order:
            proc = self.processes[name]
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
