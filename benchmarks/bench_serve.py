"""Served speed under vLLM's own benchmark client, and where a served step goes, measured in one run.

The same afdc worker serves one artifact several ways, behind vLLM's OpenAI server as
``afdc up`` starts it: monolithic (``--connector loopback``: the FFN programs run in the
attention engine's process), and AFD with its FFN ranks in server processes over shared memory,
with m = 1 and m = 2 micro-batches, m = 1 also with its two processes always on one core
(``--pin``) and always floating (``--no-pin``) where ``afdc up`` would place them by the
steps' size, and m = 1 under the earlier fixed wait (``--wait cores``), the adaptive wait capped
at 2 ms (``--spin-cap 0.002``, its cap before) and always spinning (``--spin 0.002``) against
afdc's default wait (adaptive, polls capped at 20 ms) (``--setups``;
``--plans 2A2F`` adds the same artifact's model compiled for two attention ranks: vLLM's data
parallelism, one API port), and m = 1 with speculative decoding: n-gram prompt lookup
(``afd-m1-ngram``) and, on ``--model demo-mtp`` (a tiny DeepSeek-V3 with one MTP layer), the
model's MTP layer as the drafter (``afd-m1-mtp1``, ``afd-m1-mtp2``: k = 1, 2; n-gram serves that
model too, so one run compares all three with the same model served without speculation). The load is
``vllm bench serve`` itself (random prompts of ``--input-len`` tokens, ``--output-len`` tokens
out, ``--ignore-eos``, greedy), at each ``--concurrency``, so this script's figures are the
ones a user gets from vLLM's client: output tokens/s, median and p99 time per output token
(TPOT) and median time to first token, the AFD rows also as ratios to the monolithic one of the
same round.

Beside each run, from the same run:
- with speculative decoding, the draft tokens accepted of those proposed (vLLM's counters), the
  output tokens per engine step (each step is one FFN round trip per layer of the model), the FFN
  round trips per output token (every layer's, an MTP drafter's passes included: FFN server 0's
  runs), the drafter's time per step, beside TPOT with and without speculation;
- the memory (RSS) of every process at the end of each run, and each setup's headline figures as
  soon as it has run (a run cut short still leaves them);
- the CPU seconds of every process (vLLM's API server, each engine core, each FFN server,
  the client), per 1000 output tokens;
- each rank's phases (``afdc.runtime.metrics.Phases``, logged by the ranks every
  ``--log-interval``), per engine step: vLLM's own work between steps (scheduler, output
  processing), the worker's preparation, the attention program (the step less its exchanges,
  or less its FFN runs in process), sends, waits for replies and the STEP plan, and sampling; and
  per FFN server its runs, its replies and its CPU time against its compute;
- the model's own work per step in CPU time, the attention program and the FFN runs, side by
  side for each setup: what the same layers cost in one process and split over two.

Both roles share this machine's cores, so this measures afdc's serving overhead, not the
per-GPU gain a separate FFN pool gives. Setups take turns within a round (``--rounds``), so a
slow minute of the VM hits each alike; the tables give medians over rounds.

Run:  python benchmarks/bench_serve.py [--concurrency 1,16,64] [--rounds 3] [--model demo]
      [--setups monolithic,afd-m1,afd-m1-float,afd-m2] [--plans 2A2F] [--spin S] [--threads N]
      python benchmarks/bench_serve.py --model demo-mtp \
          --setups monolithic,afd-m1,afd-m1-ngram,afd-m1-mtp1,afd-m1-mtp2
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from afdc.runtime.metrics import SNAPSHOT
from afdc.runtime.options import RuntimeOptions
from afdc.runtime.rendezvous import free_port
from afdc.serve.settings import WorkerSettings
from afdc.serve.up import Deployment


@dataclass(frozen=True)
class Setup:
    name: str
    connector: str
    micro_batches: int
    plan: str = "1A1F"
    pin: bool | None = None  # afdc up --pin/--no-pin (None: afdc's default)
    wait: str | None = None  # afdc up --wait (None: afdc's default, adaptive)
    spin: float | None = None  # afdc up --spin (None: --spin of this script)
    spin_cap: float | None = None  # afdc up --spin-cap (None: afdc's default)
    yield_late: float | None = None  # afdc up --yield-late (None: afdc's default; 0: never)
    speculative: str | None = None  # vLLM's --speculative-config (None: no speculation)


SETUPS = {
    "monolithic": Setup("monolithic", "loopback", 1),
    "afd-m1": Setup("AFD 1A1F m=1", "shm", 1),
    "afd-m1-pin": Setup("AFD 1A1F m=1 --pin", "shm", 1, pin=True),
    "afd-m1-float": Setup("AFD 1A1F m=1 --no-pin", "shm", 1, pin=False),
    "afd-m2": Setup("AFD 1A1F m=2", "shm", 2),
    # the shm waits against each other (issue 54): afd-m1 has afdc's default (adaptive, capped at 20 ms)
    "afd-m1-cores": Setup("AFD 1A1F m=1 --wait cores", "shm", 1, wait="cores"),
    "afd-m1-adaptive-2ms": Setup("AFD 1A1F m=1 --spin-cap 0.002", "shm", 1, spin_cap=2e-3),
    "afd-m1-no-late": Setup("AFD 1A1F m=1 --yield-late 0", "shm", 1, yield_late=0.0),
    "afd-m1-spin": Setup("AFD 1A1F m=1 --spin 0.002", "shm", 1, spin=2e-3),
    # speculative decoding (issue 55): n-gram prompt lookup, any model; the model's MTP layer, --model demo-mtp
    "afd-m1-ngram": Setup("AFD 1A1F m=1 ngram k=3", "shm", 1, speculative=json.dumps(
        {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3})),
    "afd-m1-mtp1": Setup("AFD 1A1F m=1 MTP k=1", "shm", 1,
                         speculative=json.dumps({"method": "mtp", "num_speculative_tokens": 1})),
    "afd-m1-mtp2": Setup("AFD 1A1F m=1 MTP k=2", "shm", 1,
                         speculative=json.dumps({"method": "mtp", "num_speculative_tokens": 2})),
}
BASE = "monolithic"


# -- what one run measured --------------------------------------------------------------------


def cpu_by_process(deployment: Deployment, memory: bool = False) -> dict[str, float]:
    """CPU seconds so far of each process of ``deployment``, named by what it is (``memory``:
    their resident memory now, in MB, instead)."""
    out: dict[str, float] = {}
    for role, popen in deployment.processes.items():
        try:
            root = psutil.Process(popen.pid)
            tree = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            continue
        for proc in tree:
            try:
                name, times, rss = proc.name(), proc.cpu_times(), proc.memory_info().rss
            except psutil.NoSuchProcess:
                continue
            if role.startswith("ffn"):
                label = f"FFN server {role.split('-')[1]}" if proc is root else "FFN other"
            elif "EngineCore" in name:
                label = "engine core" + (f" {name.rsplit('_DP', 1)[1]}" if "_DP" in name else "")
            elif "DPCoordinator" in name:
                label = "DP coordinator"
            else:
                label = "API server" if proc is root else "API other"
            out[label] = out.get(label, 0.0) + (rss / 2**20 if memory else times.user + times.system)
    return out


def last_snapshots(log_dir: Path) -> dict[str, dict]:
    """Each rank's last logged metrics snapshot, by ``role rank``."""
    out = {}
    for log in log_dir.glob("*.log"):
        for line in log.read_text(errors="replace").splitlines():
            at = line.find(": " + SNAPSHOT + "{")
            if at >= 0:
                snap = json.loads(line[at + 2 + len(SNAPSHOT):])
                out[f"{snap['role']} {snap['rank']}"] = snap
    return out


def phase_delta(before: dict, after: dict) -> dict[str, tuple[int, float, float]]:
    """(count, wall seconds, CPU seconds) of each phase between two snapshots of one rank."""
    b = before.get("phases", {})
    return {
        name: tuple(p.get(k, 0) - b.get(name, {}).get(k, 0) for k in ("count", "seconds", "cpu"))
        for name, p in after.get("phases", {}).items()
    }


@dataclass
class Run:
    """One setup at one concurrency: vLLM's client's figures, CPU and phases over the run."""

    figures: dict  # vllm bench serve's saved result (an idle run: {})
    cpu: dict[str, float]  # CPU seconds per process over the run, the client's too
    phases: dict[str, dict[str, tuple[int, float, float]]]  # rank -> phase -> (count, wall s, CPU s)
    cpu_seconds: dict[str, float] = field(default_factory=dict)  # rank -> its process's CPU over the run
    drafts: tuple[float, float] = (0.0, 0.0)  # speculative decoding: draft tokens proposed, accepted
    rss_mb: dict[str, float] = field(default_factory=dict)  # memory per process at the run's end

    @property
    def tokens(self) -> int:
        return self.figures["total_output_tokens"]


def spec_counts(url: str) -> tuple[float, float]:
    """vLLM's counts so far of draft tokens proposed and accepted (its ``/metrics``)."""
    text = urllib.request.urlopen(f"{url}/metrics").read().decode()

    def counter(name: str) -> float:
        return sum(float(v) for v in re.findall(rf"^{name}{{[^}}]*}} (\S+)$", text, re.M))

    return (counter("vllm:spec_decode_num_draft_tokens_total"), counter("vllm:spec_decode_num_accepted_tokens_total"))


def bench_client(url: str, model: str, tokenizer: Path, concurrency: int, prompts: int, args, out: Path) -> tuple:
    """``vllm bench serve`` against ``url``: its saved result and the client's CPU seconds."""
    argv = [
        sys.executable, "-m", "vllm.entrypoints.cli.main", "bench", "serve", "--backend", "vllm",
        "--base-url", url, "--model", model, "--tokenizer", str(tokenizer), "--dataset-name", "random",
        "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
        "--num-prompts", str(prompts), "--max-concurrency", str(concurrency), "--ignore-eos",
        "--temperature", "0", "--seed", "0", "--disable-tqdm",
        "--save-result", "--result-dir", str(out.parent), "--result-filename", out.name,
    ]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    err = proc.stderr.read()
    if proc.returncode != 0:
        raise RuntimeError(f"vllm bench serve failed ({proc.returncode}):\n{err[-3000:]}")
    return json.loads(out.read_text()), usage.ru_utime + usage.ru_stime


def measure(artifacts: dict[str, Path], setup: Setup, args) -> dict[int, Run]:
    artifact = artifacts[setup.plan]
    logs = Path(tempfile.mkdtemp(prefix="afdc-bench-serve-"))
    options = RuntimeOptions(connector=setup.connector, rendezvous=f"127.0.0.1:{free_port()}",
                             log_interval=args.log_interval, spin=args.spin if setup.spin is None else setup.spin,
                             wait=setup.wait or RuntimeOptions.wait,
                             spin_cap=RuntimeOptions.spin_cap if setup.spin_cap is None else setup.spin_cap,
                             yield_late=RuntimeOptions.yield_late if setup.yield_late is None else setup.yield_late)
    settings = WorkerSettings(str(artifact), options, micro_batches=setup.micro_batches, backend=args.backend,
                              threads=args.threads)
    max_seqs = str(max(args.concurrency))
    spec = ("--speculative-config", setup.speculative) if setup.speculative else ()
    d = Deployment(artifact, settings, port=free_port(), log_dir=logs,
                   vllm_args=("--max-model-len", "512", "--max-num-seqs", max_seqs, *spec), pin=setup.pin)
    runs = {}
    try:
        url = d.start(args.startup_timeout, lambda _: None)
        model = artifact.resolve().name
        tokenizer = artifact / "model"
        bench_client(url, model, tokenizer, 4, 8, args, logs / "warm-up.json")  # first requests, lazy set-ups
        time.sleep(2.0)  # the ranks notice they are idle
        cpu0 = cpu_by_process(d)
        time.sleep(args.idle_seconds)
        cpu1 = cpu_by_process(d)
        runs[0] = Run({}, {k: (cpu1[k] - cpu0.get(k, 0.0)) / args.idle_seconds for k in cpu1}, {})
        for c in args.concurrency:
            prompts = max(args.min_prompts, args.waves * c)
            time.sleep(args.log_interval + 0.5)  # a fresh snapshot from every rank
            cpu0, snaps0, drafts0 = cpu_by_process(d), last_snapshots(logs), spec_counts(url)
            figures, client_cpu = bench_client(url, model, tokenizer, c, prompts, args, logs / f"c{c}.json")
            time.sleep(args.log_interval + 0.5)
            cpu1, snaps1, drafts1 = cpu_by_process(d), last_snapshots(logs), spec_counts(url)
            cpu = {k: cpu1[k] - cpu0.get(k, 0.0) for k in cpu1}
            cpu["client (its start-up too)"] = client_cpu
            runs[c] = Run(
                figures, cpu, {rank: phase_delta(snaps0.get(rank, {}), s) for rank, s in snaps1.items()},
                {rank: s["cpu_seconds"] - snaps0.get(rank, {}).get("cpu_seconds", 0.0) for rank, s in snaps1.items()},
                (drafts1[0] - drafts0[0], drafts1[1] - drafts0[1]), cpu_by_process(d, memory=True),
            )
            print(f"[{setup.name}, {c} in flight] {headline(runs[c])}", file=sys.stderr, flush=True)
    finally:
        d.stop()
    return runs


# -- the tables -------------------------------------------------------------------------------


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def per_step(run: Run, rank: str, cpu: bool = False) -> dict[str, float]:
    """An attention rank's phases in ms per engine step, of wall time or (``cpu``) of the step
    thread's CPU time; its attention program is the step less its exchanges, or less its FFN runs
    where they run in process. Where a phase's wall time exceeds its CPU time, the thread waited:
    for a reply, or for a core that another process held."""
    p = run.phases.get(rank, {})
    steps = p.get("step", (0, 0.0, 0.0))[0]
    if not steps:
        return {}
    ms = {name: (cpu_s if cpu else wall) * 1e3 / steps for name, (_, wall, cpu_s) in p.items()}
    not_attention = sum(ms.get(k, 0.0) for k in ("send", "wait", "plan", "ffn"))
    # an MTP drafter's passes run within sampling (phase "draft"), each a step of its own through the
    # FFN ranks: their exchanges are in send / wait / plan, their programs beside the model's
    draft = ms.get("draft", 0.0)
    return {
        "vLLM between steps": ms.get("engine", 0.0),
        "prepare": ms.get("prepare", 0.0),
        "attention program (and drafter's)": ms["step"] + draft - not_attention,
        "FFN in process": ms.get("ffn", 0.0),
        "send": ms.get("send", 0.0),
        "wait for replies": ms.get("wait", 0.0),
        "STEP plan": ms.get("plan", 0.0),
        "sample": ms.get("sample", 0.0) - draft,
        "drafter (its exchanges too)": draft,
    }


def ffn_per_step(run: Run, rank: str = "attn 0") -> tuple[float, float]:
    """CPU ms per engine step of attention rank ``rank``: the FFN's runs (its own, in process, or
    every FFN server's, which serve every attention rank's steps), and the FFN servers' CPU
    outside their runs (their side of the exchange: waits, takes, checks, replies)."""
    phases = run.phases.get(rank, {})
    steps = phases.get("step", (0, 0.0, 0.0))[0]
    if not steps:
        return float("nan"), float("nan")
    if "ffn" in phases:
        return phases["ffn"][2] * 1e3 / steps, 0.0
    servers = [name for name in run.phases if name.startswith("ffn")]
    runs = sum(run.phases[name].get("run", (0, 0.0, 0.0))[2] for name in servers)
    total = sum(run.cpu_seconds.get(name, 0.0) for name in servers)
    return runs * 1e3 / steps, (total - runs) * 1e3 / steps


def model_work(runs: list[Run]) -> tuple[float, float, float, float]:
    """Medians over ``runs`` of CPU ms per engine step (attention rank 0): its attention program,
    the FFN runs, its side of the exchange (sends, waits, the STEP plan), the FFN servers' CPU
    outside their runs."""
    steps = [st for st in (per_step(r, "attn 0", True) for r in runs) if st]
    ffn = [ffn_per_step(r) for r in runs]
    exchange = [st["send"] + st["wait for replies"] + st["STEP plan"] for st in steps]
    return (_median([st["attention program (and drafter's)"] for st in steps]), _median([f[0] for f in ffn]),
            _median(exchange), _median([f[1] for f in ffn]))


def speculation(run: Run) -> tuple[float, float]:
    """Output tokens per engine step (each step is one FFN round trip per layer of the model) and
    FFN round trips per output token (FFN server 0's layer runs: an MTP drafter's passes too)."""
    steps = run.phases.get("attn 0", {}).get("step", (0, 0.0, 0.0))[0]
    trips = run.phases.get("ffn 0", {}).get("run", (0, 0.0, 0.0))[0]
    return (run.tokens / steps if steps else float("nan"), trips / run.tokens if trips else float("nan"))


def headline(run: Run) -> str:
    """One run's figures that matter most, printed as soon as it has run."""
    drafted, accepted = run.drafts
    per_step, trips = speculation(run)
    return (f"TPOT p50 {run.figures['median_tpot_ms']:.1f} ms, {run.figures['output_throughput']:.1f} tok/s; "
            f"drafts accepted {accepted:.0f} of {drafted:.0f}; {per_step:.2f} output tokens per engine step, "
            f"{trips:.2f} FFN round trips per output token; memory {sum(run.rss_mb.values()):.0f} MB in "
            f"{len(run.rss_mb)} processes")


def report(setups: list[Setup], results: dict[str, list[dict[int, Run]]], args) -> None:
    load = os.getloadavg()[0]
    print(f"{args.model} model; vllm bench serve: random {args.input_len} tokens in, {args.output_len} out, "
          f"ignore-eos, greedy; {args.rounds} round(s), medians; CPU, {os.cpu_count()} cores, load average "
          f"{load:.2f}; spin {args.spin if args.spin is not None else 'default'}, threads "
          f"{args.threads or 'default'}")
    print(f"\n== idle, {args.idle_seconds:g} s without requests: % of a core, by process")
    for s in setups:
        idle = [r[0].cpu for r in results[s.name]]
        names = sorted({k for r in idle for k in r})
        total = _median([sum(r.values()) * 100 for r in idle])
        cells = [f"{k} {_median([r.get(k, 0.0) * 100 for r in idle]):.2f}" for k in names]
        print(f"    {s.name:22} all {total:.2f}: " + "; ".join(cells))
    for c in args.concurrency:
        print(f"\n== {c} in flight ({max(args.min_prompts, args.waves * c)} requests)")
        print(f"{'':22} {'tok/s':>8} {'TPOT p50':>9} {'TPOT p99':>9} {'TTFT p50':>9}   / monolithic: "
              "tok/s, TPOT p50 (per round)")
        base = results[BASE]
        for s in setups:
            rs = [r[c] for r in results[s.name]]
            fig = {k: _median([r.figures[k] for r in rs]) for k in
                   ("output_throughput", "median_tpot_ms", "p99_tpot_ms", "median_ttft_ms")}
            line = (f"{s.name:22} {fig['output_throughput']:8.0f} {fig['median_tpot_ms']:9.2f} "
                    f"{fig['p99_tpot_ms']:9.2f} {fig['median_ttft_ms']:9.1f}")
            if s.name != BASE:
                pairs = [(r[c].figures, b[c].figures) for r, b in zip(results[s.name], base)]
                tput = [r["output_throughput"] / b["output_throughput"] for r, b in pairs]
                tpot = [r["median_tpot_ms"] / b["median_tpot_ms"] for r, b in pairs]
                line += (f"   {_median(tput):.2f}, {_median(tpot):.2f} "
                         f"({', '.join(f'{x:.2f}' for x in tpot)})")
            print(line)
        print("  speculative decoding: draft tokens accepted of proposed; output tokens per engine step (each step is "
              "one FFN round trip per layer of the model); FFN round trips per output token (every layer's, an MTP "
              "drafter's passes too); TPOT p50 and as a ratio to the same deployment without speculation")
        plain = [r[c].figures["median_tpot_ms"] for r in results.get(SETUPS["afd-m1"].name, [])]
        for s in setups:
            rs = [r[c] for r in results[s.name]]
            per_step_tokens, trips = (_median([speculation(r)[i] for r in rs]) for i in (0, 1))
            drafted, accepted = _median([r.drafts[0] for r in rs]), _median([r.drafts[1] for r in rs])
            rate = f"{accepted:.0f} of {drafted:.0f} ({accepted / drafted:.0%})" if drafted else "none"
            steps = [r.phases.get("attn 0", {}).get("step", (0, 0.0, 0.0))[0] for r in rs]
            draft_ms = _median([r.phases.get("attn 0", {}).get("draft", (0, 0.0, 0.0))[1] * 1e3 / n
                                for r, n in zip(rs, steps) if n])
            tpot = _median([r.figures["median_tpot_ms"] for r in rs])
            versus = f" ({tpot / _median(plain):.2f})" if plain and s.connector != "loopback" else ""
            print(f"    {s.name:22} accepted {rate}; {per_step_tokens:.2f} output tokens per engine step; "
                  f"{trips:.2f} FFN round trips per output token; drafter {draft_ms:.2f} ms per step; "
                  f"TPOT p50 {tpot:.1f} ms{versus}")
        print("  memory at the run's end, MB, by process:")
        for s in setups:
            rs = [r[c] for r in results[s.name]]
            names = sorted({k for r in rs for k in r.rss_mb})
            print(f"    {s.name:22} " + "; ".join(f"{k} {_median([r.rss_mb.get(k, 0.0) for r in rs]):.0f}"
                                                  for k in names))
        print("  CPU seconds per 1000 output tokens, by process:")
        for s in setups:
            rs = [r[c] for r in results[s.name]]
            names = sorted({k for r in rs for k in r.cpu})
            cells = [f"{k} {_median([r.cpu.get(k, 0.0) * 1e3 / r.tokens for r in rs]):.2f}" for k in names]
            print(f"    {s.name:22} " + "; ".join(cells))
        for clock, cpu in (("wall", False), ("CPU of the step's thread", True)):
            print(f"  per engine step, ms of {clock} (attention rank 0):")
            for s in setups:
                rs = [r[c] for r in results[s.name]]
                steps = [per_step(r, "attn 0", cpu) for r in rs]
                keys = steps[0].keys() if steps and steps[0] else []
                cells = [f"{k} {_median([st[k] for st in steps if st]):.2f}" for k in keys]
                print(f"    {s.name:22} " + "; ".join(cells))
        print("  the model's own work per engine step, ms of CPU: the attention program (its step thread's), "
              "the FFN runs (in process or in the FFN servers); and what AFD adds to the monolith's CPU a step")
        base_attn, base_ffn, _, _ = model_work([r[c] for r in results[BASE]])
        for s in setups:
            attn, ffn, exchange, server = model_work([r[c] for r in results[s.name]])
            line = f"    {s.name:22} attention program {attn:.2f}; FFN runs {ffn:.2f}"
            if s.name != BASE:
                line += (f"; adds: the same layers {attn + ffn - base_attn - base_ffn:+.2f}, the attention side's "
                         f"exchange {exchange:.2f}, the FFN servers' CPU outside their runs {server:.2f}")
            print(line)
        for s in setups:
            rs = [r[c] for r in results[s.name]]
            for rank in sorted({k for r in rs for k in r.phases if k.startswith("ffn")}):
                def per_token(phase: str, index: int, rank: str = rank, rs: list[Run] = rs) -> float:
                    return _median([r.phases[rank].get(phase, (0, 0.0, 0.0))[index] * 1e3 / r.tokens for r in rs])

                cpu_ms = _median([r.cpu_seconds[rank] * 1e3 / r.tokens for r in rs])
                run_cpu = per_token("run", 2)
                print(f"  {s.name} {rank}: per output token, CPU {cpu_ms:.3f} ms; FFN runs {per_token('run', 1):.3f} "
                      f"ms wall, {run_cpu:.3f} ms CPU; replies {per_token('reply', 1):.3f} ms wall, "
                      f"{per_token('reply', 2):.3f} CPU; waits {per_token('idle', 2):.3f} ms CPU: "
                      f"CPU / FFN compute (runs' CPU) {cpu_ms / run_cpu:.2f}")


def build(args) -> dict[str, Path]:
    """The model saved and compiled for each plan, in a child process: its memory (the model,
    its capture) is not held by this one through the whole run."""
    root = Path(tempfile.mkdtemp(prefix="afdc-bench-serve-"))
    plans = sorted({"1A1F", *args.plans})
    subprocess.run([sys.executable, __file__, "--prepare", str(root), "--model", args.model,
                    "--plans", ",".join(plans)], check=True)
    return {plan: root / f"afdc-{args.model}-{plan.lower()}" for plan in plans}


def prepare(root: Path, model: str, plans: list[str]) -> None:
    """``--prepare``: save ``model`` under ``root`` and compile it for each of ``plans``."""
    from afdc.compile import compile_model
    from afdc.demo import demo_tokenizer, save_demo, save_demo_mtp

    if model == "demo":
        save_demo(root / "model")
    elif model == "demo-mtp":  # a tiny DeepSeek-V3 with one MTP layer, for the MTP setups
        save_demo_mtp(root / "model")
    else:
        from models_supported import catalog

        vocab = 512
        overrides = {"vocab_size": vocab, "max_position_embeddings": 512}  # the demo tokenizer; 512 positions served
        built = catalog.build_type(model, {**catalog.entry(model).config_kwargs, **overrides})
        built.save_pretrained(root / "model")
        demo_tokenizer(vocab).save_pretrained(root / "model")
    for plan in plans:
        compile_model(str(root / "model"), plan, root / f"afdc-{model}-{plan.lower()}", progress=False)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", default="1,16,64", help="comma-separated: requests in flight")
    ap.add_argument("--waves", type=int, default=6, help="requests per run: this many times the concurrency")
    ap.add_argument("--min-prompts", type=int, default=32, help="... and at least this many")
    ap.add_argument("--input-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--model", default="demo",
                    help="'demo', 'demo-mtp' (with an MTP layer), or a model_type of models_supported.catalog")
    ap.add_argument("--setups", default="monolithic,afd-m1,afd-m1-float,afd-m2",
                    help=f"comma-separated, of {', '.join(SETUPS)}")
    ap.add_argument("--plans", default="", help="comma-separated further plans, served with shm and m = 1 (e.g. 2A2F)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds in which every setup runs once; medians reported")
    ap.add_argument("--backend", default=None, help="what runs the programs (default: the artifact's, auto)")
    ap.add_argument("--spin", type=float, default=None, help="afdc up --spin (default: afdc's)")
    ap.add_argument("--threads", type=int, default=None, help="afdc up --threads (default: afdc's)")
    ap.add_argument("--log-interval", type=float, default=1.0, help="seconds between the ranks' metrics snapshots")
    ap.add_argument("--idle-seconds", type=float, default=10.0, help="how long the idle deployment's CPU is measured")
    ap.add_argument("--startup-timeout", type=float, default=300.0,
                    help="seconds a deployment may take to serve (a busy shared host needs more)")
    ap.add_argument("--prepare", type=Path, help=argparse.SUPPRESS)  # build() runs this script with it
    args = ap.parse_args()
    if args.prepare:
        prepare(args.prepare, args.model, args.plans.split(","))
        return
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    args.plans = [p.upper() for p in args.plans.split(",") if p]
    setups = [SETUPS[name] for name in args.setups.split(",")]
    if setups[0].name != BASE:
        ap.error(f"the first setup must be {BASE}: the others are given as ratios to it")
    setups += [Setup(f"AFD {plan} m=1", "shm", 1, plan) for plan in args.plans]
    # a SIGTERM (a job stopped by its process group: every role hears it at once) ends the run through
    # its finally blocks, saying so, after the headlines printed so far; it used to end it silently
    signal.signal(signal.SIGTERM, lambda *_: sys.exit("bench_serve: stopped by SIGTERM; the figures so far are above"))
    artifacts = build(args)
    results: dict[str, list[dict[int, Run]]] = {s.name: [] for s in setups}
    for _ in range(args.rounds):
        for s in setups:
            results[s.name].append(measure(artifacts, s, args))
    report(setups, results, args)


if __name__ == "__main__":
    main()
