"""A hot spare's takeover on a real model's FFN-rank weight file (issue 56).

The soak (``soak_faults.py``) measures takeovers on the demo, whose FFN rank is a few hundred
kilobytes: there a takeover is the claim, a generation bump and a join. On a real model a spare
must first load the rank's weight file (read, its SHA-256 checked against the manifest, the
program built). This builds a model of a real config (default Qwen3-30B-A3B) cut to ``--layers``
of its decoder layers, with random weights and a small vocabulary (the attention side's
embeddings are not what a spare loads), compiles it for ``--plan`` with its weights, and serves
it: this process is the attention rank (the Python API), ``afdc serve`` processes the FFN ranks
and one spare. Rank 1's process is SIGKILLed; reported from one run: the takeover (the kill to
the first step served again, a step's own time taken off), the spare's part of it from its log
(its claim to its first generation served: the load and the join), the rank's weight file's
size, and the load rate. A full model's FFN rank file is the per-layer size times the config's
layer count (its MoE layers are alike); its takeover is extrapolated at the measured load rate
and said to be that.

Run:  python benchmarks/bench_takeover.py [--config /work/shared/configs/qwen3-30b-a3b.json]
      [--layers 2] [--plan 1A2F] [--connector shm]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

import afdc
from afdc.compile import compile_model
from afdc.runtime.options import RuntimeOptions
from afdc.runtime.rendezvous import PeerLost, free_port

TOKEN = "takeover"
_STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")


def build(config_path: Path, layers: int, vocab: int, plan: str, root: Path) -> Path:
    """The config cut to ``layers`` layers and ``vocab`` tokens, random bf16 weights, compiled for ``plan``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(config_path)
    config.num_hidden_layers, config.vocab_size = layers, vocab
    config.bos_token_id = config.eos_token_id = config.pad_token_id = 0
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(root / "model")
    del model
    artifact = root / "artifact"
    compile_model(str(root / "model"), plan, artifact, progress=False)
    return artifact


def _logged_at(log: str, text: str) -> float:
    """When the first line holding ``text`` was logged (seconds since the epoch)."""
    for line in log.splitlines():
        match = _STAMP.match(line)
        if match and text in line:
            stamp = datetime.datetime.strptime(match.group(1), "%Y-%m-%d %H:%M:%S,%f")
            return stamp.timestamp()
    raise RuntimeError(f"no line holding {text!r} in the log:\n{log[-2000:]}")


@dataclass(frozen=True)
class Takeover:
    seconds: float  # the kill to a step served again, a step's own time taken off
    claim: float  # the kill to the spare's claim
    load_and_join: float  # the spare's claim to its first generation served
    step: float  # a served step's own time
    rank_file_bytes: int


def measure(artifact: Path, connector: str, logs: Path) -> Takeover:
    dm = afdc.load_deployment(artifact)
    ids = torch.randint(3, 200, (2, 6), generator=torch.Generator().manual_seed(3))
    ref = dm.generate(ids, max_new_tokens=2, pad_token_id=0)  # the FFN layers in process
    address = f"127.0.0.1:{free_port()}"
    dm.connect(RuntimeOptions(connector=connector, rendezvous=address, token=TOKEN, timeout=60, join_timeout=600),
               host=True)
    cmd = [sys.executable, "-m", "afdc.cli", "serve", str(artifact), "--role", "ffn", "--rendezvous", address,
           "--token", TOKEN, "--connector", connector, "--join-timeout", "600"]
    ffn_ranks = dm.layout.ffn_ranks
    names = [f"ffn-{r}" for r in range(ffn_ranks)] + ["spare"]
    files = {n: open(logs / f"{n}.log", "w") for n in names}  # noqa: SIM115 (closed below)
    procs = {f"ffn-{r}": subprocess.Popen([*cmd, "--rank", str(r)], stderr=files[f"ffn-{r}"])
             for r in range(ffn_ranks)}
    procs["spare"] = subprocess.Popen([*cmd, "--spare"], stderr=files["spare"])
    try:
        if not torch.equal(dm.generate(ids, max_new_tokens=2, pad_token_id=0), ref):
            raise RuntimeError("the served tokens differ from the in-process ones")
        while "waiting for a lost FFN rank" not in (logs / "spare.log").read_text():
            if procs["spare"].poll() is not None:
                raise RuntimeError((logs / "spare.log").read_text())
            time.sleep(0.1)
        started = time.monotonic()
        dm.generate(ids, max_new_tokens=2, pad_token_id=0)
        step = (time.monotonic() - started) / 2  # a served step's own time (two per generate)
        victim = f"ffn-{ffn_ranks - 1}"
        killed, killed_wall = time.monotonic(), time.time()
        os.kill(procs[victim].pid, signal.SIGKILL)
        got = None
        while got is None:  # a step lost mid-step raises; the next one regroups with whoever serves the rank
            with contextlib.suppress(PeerLost):
                got = dm.generate(ids, max_new_tokens=1, pad_token_id=0)
        served = time.monotonic() - killed - step
        if not torch.equal(got, ref[:, : got.shape[1]]):
            raise RuntimeError("the tokens after the takeover differ from the in-process ones")
        spare_log = (logs / "spare.log").read_text()
        claimed = _logged_at(spare_log, "spare: claimed ffn rank")
        serving = _logged_at(spare_log, "serving generation")
    finally:
        dm.disconnect()
        for p in procs.values():
            p.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=60)
            if p.poll() is None:
                p.kill()
        for f in files.values():
            f.close()
    rank_file = artifact / "weights" / f"ffn-{ffn_ranks - 1}.safetensors"
    return Takeover(served, claimed - killed_wall, serving - claimed, step, rank_file.stat().st_size)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, default=Path("/work/shared/configs/qwen3-30b-a3b.json"))
    parser.add_argument("--layers", type=int, default=2, help="decoder layers kept (the host's memory bounds it)")
    parser.add_argument("--vocab", type=int, default=4096, help="vocabulary kept (the attention side's size only)")
    parser.add_argument("--plan", default="1A2F")
    parser.add_argument("--connector", default="shm")
    args = parser.parse_args()
    full_layers = json.loads(args.config.read_text())["num_hidden_layers"]
    with tempfile.TemporaryDirectory(prefix="afdc-takeover-") as tmp:
        root = Path(tmp)
        started = time.monotonic()
        artifact = build(args.config, args.layers, args.vocab, args.plan, root)
        print(f"built and compiled {args.config.name} cut to {args.layers} layers for {args.plan} "
              f"in {time.monotonic() - started:.0f} s")
        (root / "logs").mkdir()
        m = measure(artifact, args.connector, root / "logs")
    gib = m.rank_file_bytes / 2**30
    rate = gib / m.load_and_join
    full = gib / args.layers * full_layers
    print(f"FFN rank file: {gib:.2f} GiB ({args.layers} of {full_layers} layers); a served step {m.step:.2f} s")
    print(f"takeover, the kill to a step served again: {m.seconds:.1f} s")
    print(f"  the spare's claim, after the kill: {m.claim:.1f} s")
    print(f"  the spare's load and join (claim to its first generation): {m.load_and_join:.1f} s "
          f"({rate:.2f} GiB/s of weight file)")
    print(f"the full model's FFN rank at {args.plan}: {full:.1f} GiB; at that rate its load and join would take "
          f"about {full / rate:.0f} s (extrapolated, not measured)")
    print(f"load average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
