"""A soak under faults: `afdc up` of the demo at 2A2F with hot spares, FFN ranks SIGKILLed while
requests are served through the official ``openai`` client.

One deployment serves the same requests twice, ``--concurrency`` in flight: a clean run, then a run
during which the process serving FFN rank 0 is SIGKILLed, then the one serving FFN rank 1, then
(``--kills 3``) the spare that claims rank 1 while it is still loading the rank's weights. Every
request must complete with the token ids of ``dm.generate`` for its prompt, and none may error.
Reported, from one run: p50/p99 request latency of both runs, each takeover (a kill to the end of
the held step: ``/health`` back from "degraded" to serving), and the resident memory and open
file descriptors of every process that lived through the faulted run, at its start and end.

Run:  python benchmarks/soak_faults.py [--requests 200] [--concurrency 32] [--tokens 16] [--kills 3]
      [--spares 1]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import torch

import afdc
from afdc.compile import compile_model
from afdc.demo import save_demo
from afdc.runtime.options import RuntimeOptions
from afdc.runtime.rendezvous import free_port
from afdc.runtime.spare import Slots
from afdc.serve.settings import WorkerSettings

TOKEN = "soak"


@dataclass
class Run:
    latencies: list[float] = field(default_factory=list)
    mismatches: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def percentile(self, q: float) -> float:
        return statistics.quantiles(self.latencies, n=100, method="inclusive")[q - 1] if self.latencies else 0.0


@dataclass
class Soak:
    clean: Run
    faulted: Run
    takeovers: list[float]  # seconds from each kill to the end of the held step
    resources: dict[str, tuple[int, int, int, int]]  # process -> RSS and open fds, start and end of the faulted run
    kills: list[str]  # what was killed, in order


def build(root: Path, plan: str = "2A2F") -> Path:
    save_demo(root / "model")
    artifact = root / f"afdc-demo-{plan.lower()}"
    compile_model(str(root / "model"), plan, artifact, progress=False)
    return artifact


def prompts(count: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 500, (int(torch.randint(2, 24, (1,), generator=g)),), generator=g).tolist()
            for _ in range(count)]


def references(artifact: Path, ids: list[list[int]], tokens: int) -> list[list[int]]:
    dm = afdc.load_deployment(artifact)
    return [dm.generate(torch.tensor([p]), max_new_tokens=tokens, eos_token_id=[])[0, len(p):].tolist() for p in ids]


def _health(url: str) -> str:
    """"serving", "degraded" or "unavailable", as a probe reading the body sees it."""
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=5) as r:
            return "degraded" if r.headers.get("x-afdc-health") == "degraded" else "serving"
    except (urllib.error.URLError, OSError):
        return "unavailable"


def _serve(client, ids: list[list[int]], ref: list[list[int]], tokens: int, concurrency: int,
           on_done=lambda n: None) -> Run:
    run, done, lock = Run(), [0], threading.Lock()
    model = client.models.list().data[0].id

    def one(i: int) -> None:
        started = time.monotonic()
        try:
            r = client.completions.create(model=model, prompt=ids[i], max_tokens=tokens, temperature=0, logprobs=0,
                                          extra_body={"ignore_eos": True})
            got = [int(t.removeprefix("token_id:")) for t in r.choices[0].logprobs.tokens]
        except Exception as err:  # recorded: the soak's verdict
            run.errors.append(f"request {i}: {type(err).__name__}: {err}")
            return
        run.latencies.append(time.monotonic() - started)
        if got != ref[i]:
            run.mismatches.append(f"request {i}: {got} != {ref[i]}")
        with lock:
            done[0] += 1
            on_done(done[0])

    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(one, range(len(ids))))
    return run


class Faults:
    """Kills the process serving an FFN rank (found through the store's owner records) and times
    each takeover from the kill to ``/health`` serving again."""

    def __init__(self, up: psutil.Process, artifact: Path, url: str):
        ffn = next(p for p in up.children(recursive=True) if "--role" in p.cmdline() and "ffn" in p.cmdline())
        argv = ffn.cmdline()
        options = RuntimeOptions(rendezvous=argv[argv.index("--rendezvous") + 1], token=TOKEN)
        settings = WorkerSettings(str(artifact), options)
        self.rdv = settings.open_rendezvous()
        self.slots = Slots(self.rdv)
        self.url = url
        self.takeovers: list[float] = []
        self.kills: list[str] = []
        self._threads: list[threading.Thread] = []

    def serving(self, rank: int) -> int:
        owner, _ = self.slots.owner(self.rdv.layout.slot("ffn", rank))
        return owner.pid

    def kill(self, rank: int, what: str = "") -> None:
        pid = self.serving(rank)
        os.kill(pid, signal.SIGKILL)
        self.kills.append(f"pid {pid}, serving ffn rank {rank}{what}")
        killed = time.monotonic()
        thread = threading.Thread(target=self._time_takeover, args=(killed,), daemon=True)
        thread.start()
        self._threads.append(thread)

    def kill_while_loading(self, rank: int, before: int, timeout: float = 600.0) -> None:
        """Wait for a spare to claim ``rank`` (its owner is no longer ``before``), and kill it at once."""
        deadline = time.monotonic() + timeout
        while self.serving(rank) == before:
            if time.monotonic() > deadline:
                raise TimeoutError(f"no spare claimed ffn rank {rank} within {timeout:g} s")
            time.sleep(0.01)
        self.kill(rank, ", a spare loading its weights")

    def _time_takeover(self, killed: float) -> None:
        """Until ``/health`` was degraded and serves again (a takeover quicker than the polls is not timed)."""
        seen = False
        while not seen and time.monotonic() - killed < 10:
            seen = _health(self.url) != "serving"
            time.sleep(0.02)
        while seen and _health(self.url) != "serving":
            time.sleep(0.02)
        if seen:
            self.takeovers.append(time.monotonic() - killed)

    def join(self) -> None:
        for t in self._threads:
            t.join(900)


def _resources(up: psutil.Process) -> dict[str, tuple[int, int]]:
    out = {}
    for p in [up, *up.children(recursive=True)]:
        with contextlib.suppress(psutil.NoSuchProcess):
            argv = p.cmdline()
            role = "spare" if "--spare" in argv else " ".join(argv[1:6])[-48:]  # a spare's grows once it serves
            out[f"{p.pid} {role}"] = (p.memory_info().rss, p.num_fds())
    return out


def soak(artifact: Path, log_dir: Path, requests: int, concurrency: int, tokens: int, kills: int,
         spares: int = 1, startup: float = 600.0, say=print) -> Soak:
    import openai

    ids = prompts(requests)
    ref = references(artifact, ids, tokens)
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "afdc.cli", "up", str(artifact), "--port", str(port), "--log-dir", str(log_dir),
         "--ffn-spares", str(spares), "--startup-timeout", str(startup), "--", "--max-model-len", "128",
         "--api-server-count", "1", "--return-tokens-as-token-ids", "--max-num-seqs", str(concurrency)],
        env={**os.environ, "AFDC_TOKEN": TOKEN}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        for line in proc.stdout:
            say(line.rstrip())
            if line.startswith("ready:") or proc.poll() is not None:
                break
        url = f"http://127.0.0.1:{port}"
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", timeout=900, max_retries=0)
        up = psutil.Process(proc.pid)
        deadline = time.monotonic() + startup
        logs = [log_dir / f"spare-{i}.log" for i in range(spares)]
        while sum("waiting for a lost FFN rank" in log.read_text() for log in logs) < spares:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the spares were not waiting within {startup:g} s; see {log_dir}")
            time.sleep(0.2)
        clean = _serve(client, ids, ref, tokens, concurrency)
        say(f"clean run: {len(clean.latencies)}/{requests} done")
        faults = Faults(up, artifact, url)
        at = sorted({max(1, requests * k // (kills + 1)) for k in range(1, kills + 1)})[:2]
        first = faults.serving(1)

        def on_done(n: int) -> None:  # the kills, from a client thread as requests complete
            if n == at[0]:
                faults.kill(0)
            elif len(at) > 1 and n == at[1]:
                faults.kill(1)
                if kills > 2:
                    threading.Thread(target=faults.kill_while_loading, args=(1, first), daemon=True).start()

        before = _resources(up)
        faulted = _serve(client, ids, ref, tokens, concurrency, on_done)
        faults.join()
        after = _resources(up)
        resources = {name: (*before[name], *after[name]) for name in before if name in after}
        return Soak(clean, faulted, faults.takeovers, resources, faults.kills)
    finally:
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=120)
        say(out[-2000:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--kills", type=int, default=3, help="2: each FFN rank once; 3: and a spare while it loads")
    ap.add_argument("--spares", type=int, default=1)
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="afdc-soak-"))
    artifact = build(root)
    s = soak(artifact, root / "logs", args.requests, args.concurrency, args.tokens, args.kills, args.spares)
    for name, run in (("clean", s.clean), ("with faults", s.faulted)):
        print(f"{name}: {len(run.latencies)}/{args.requests} complete, {len(run.mismatches)} differ from dm.generate, "
              f"{len(run.errors)} errors; latency p50 {run.percentile(50):.2f} s, p99 {run.percentile(99):.2f} s")
        for problem in run.errors[:5] + run.mismatches[:5]:
            print("  ", problem)
    print("kills:", *s.kills, sep="\n  ")
    print("takeovers (kill to serving again):", ", ".join(f"{t:.1f} s" for t in s.takeovers))
    print("process: RSS MiB start -> end, open fds start -> end")
    for name, (rss0, fd0, rss1, fd1) in s.resources.items():
        print(f"  {name}: {rss0 / 2**20:.0f} -> {rss1 / 2**20:.0f}, {fd0} -> {fd1}")
    print(json.dumps({"takeovers_s": s.takeovers, "p50_clean": s.clean.percentile(50),
                      "p99_clean": s.clean.percentile(99), "p50_faults": s.faulted.percentile(50),
                      "p99_faults": s.faulted.percentile(99)}))


if __name__ == "__main__":
    main()
