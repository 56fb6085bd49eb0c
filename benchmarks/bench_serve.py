"""Serving benchmark on this CPU, measured in one run: the demo model behind vLLM's OpenAI server.

The same afdc worker serves the demo model (random Qwen3-MoE, 4 layers of 8 experts) three
ways: monolithic (``--connector loopback``: the FFN programs run in the attention process), and
AFD 1A1F with its FFN rank in a server process over shared memory, with m = 1 and m = 2
micro-batches. For each, ``--requests`` streamed completions of ``--tokens`` output tokens
each, ``--concurrency`` in flight, give output tokens/s and the p50/p99 time per output token
(TPOT: the gap between a request's first and last token over its tokens); the AFD rows are
printed as ratios to the monolithic one.

Both roles share this machine's cores, so this measures afdc's serving overhead, not the
per-GPU gain a separate FFN pool gives. Every process (vLLM's API server and engine core, the FFN
server) runs one torch thread by default (``--threads``): three processes whose thread pools
each span both cores stalled each other (the monolithic row fell from about 1900 to 800 tok/s).

``--model`` serves a tiny catalog architecture instead (``models_supported.catalog``, its vocabulary
widened to the demo tokenizer's 512): e.g. ``qwen3_next`` (a hybrid, its mixers' state in vLLM's
state blocks) against ``qwen3_moe`` of the same size, to see what the mixers cost per token.

Each setup runs once per round (``--rounds``), the setups taking turns; the table gives medians.

Run:  python benchmarks/bench_serve.py [--requests 64] [--concurrency 16] [--tokens 32] [--threads 1] [--model demo]
      [--rounds 3] [--backend inductor]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import torch

from afdc.compile import compile_model
from afdc.demo import demo_tokenizer, save_demo
from afdc.runtime.rendezvous import free_port
from afdc.serve.settings import WorkerSettings
from afdc.serve.up import Deployment

CONFIGS = [("monolithic", "loopback", 1), ("AFD 1A1F m=1", "shm", 1), ("AFD 1A1F m=2", "shm", 2)]


def _one(client, model: str, prompt: list[int], tokens: int) -> tuple[float, int]:
    """(TPOT in seconds, output tokens) of one streamed completion."""
    stamps = []
    stream = client.completions.create(model=model, prompt=prompt, max_tokens=tokens, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    for chunk in stream:
        if chunk.choices and chunk.choices[0].text is not None:
            stamps.append(time.perf_counter())
    return (stamps[-1] - stamps[0]) / max(len(stamps) - 1, 1), len(stamps)


def measure(artifact: Path, connector: str, micro_batches: int, args) -> dict:
    settings = WorkerSettings(str(artifact), connector=connector, rendezvous=f"127.0.0.1:{free_port()}",
                              micro_batches=micro_batches, backend=args.backend)
    logs = Path(tempfile.mkdtemp(prefix="afdc-bench-serve-"))
    d = Deployment(artifact, settings, port=free_port(), log_dir=logs,
                   vllm_args=("--max-model-len", "256", "--max-num-seqs", str(args.concurrency)))
    try:
        url = d.start(300, lambda _: None)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", timeout=300)
        model = client.models.list().data[0].id
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(3, 500, (args.prompt,), generator=g).tolist() for _ in range(args.requests)]
        with ThreadPoolExecutor(args.concurrency) as pool:  # warm-up: one wave
            list(pool.map(lambda p: _one(client, model, p, 4), prompts[: args.concurrency]))
            start = time.perf_counter()
            results = list(pool.map(lambda p: _one(client, model, p, args.tokens), prompts))
            wall = time.perf_counter() - start
    finally:
        d.stop()
    tpots = sorted(t for t, _ in results)
    return {
        "tokens_per_s": sum(n for _, n in results) / wall,
        "tpot_p50_ms": statistics.median(tpots) * 1e3,
        "tpot_p99_ms": tpots[min(len(tpots) - 1, int(0.99 * len(tpots)))] * 1e3,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=16, help="prompt tokens per request")
    ap.add_argument("--threads", type=int, default=1, help="torch threads of every process (via OMP_NUM_THREADS)")
    ap.add_argument("--model", default="demo", help="'demo', or a model_type of models_supported.catalog")
    ap.add_argument("--rounds", type=int, default=3, help="rounds in which every setup runs once; medians reported")
    ap.add_argument("--backend", default=None, help="what runs the programs (default: the artifact's, auto)")
    args = ap.parse_args()
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # read by the spawned processes' torch
    torch.set_num_threads(args.threads)
    root = Path(tempfile.mkdtemp(prefix="afdc-bench-serve-"))
    if args.model == "demo":
        save_demo(root / "model")
    else:
        from models_supported import catalog

        vocab = 512
        overrides = {"vocab_size": vocab, "max_position_embeddings": 512}  # the demo tokenizer; 256 positions served
        model = catalog.build_type(args.model, {**catalog.entry(args.model).config_kwargs, **overrides})
        model.save_pretrained(root / "model")
        demo_tokenizer(vocab).save_pretrained(root / "model")
    artifact = root / f"afdc-{args.model}"
    compile_model(str(root / "model"), "1A1F", artifact, progress=False)

    runs: dict[str, list[dict]] = {name: [] for name, _, _ in CONFIGS}
    for _ in range(args.rounds):  # the setups take turns, so a slow minute of the VM hits each alike
        for name, connector, m in CONFIGS:
            runs[name].append(measure(artifact, connector, m, args))
    rows = {name: {key: statistics.median(r[key] for r in rs) for key in rs[0]} for name, rs in runs.items()}
    base = rows["monolithic"]
    print(f"{args.model} model, {args.requests} requests x {args.tokens} tokens, {args.concurrency} in flight, "
          f"prompt {args.prompt} tokens, backend {args.backend or 'auto'}, CPU ({args.threads} torch thread(s) per "
          f"process, load average {os.getloadavg()[0]:.2f}), medians of {args.rounds} round(s)")
    if args.rounds > 1:
        for name, rs in runs.items():
            p50 = ", ".join(f"{r['tpot_p50_ms']:.1f}" for r in rs)
            ratio = ", ".join(f"{r['tpot_p50_ms'] / b['tpot_p50_ms']:.2f}" for r, b in zip(rs, runs["monolithic"]))
            print(f"  {name}: p50 TPOT per round {p50} ms; / monolithic's of the same round {ratio}")
    print(f"{'':14} {'tok/s':>8} {'p50 TPOT ms':>12} {'p99 TPOT ms':>12}   ratios to monolithic (tok/s, p50, p99)")
    for name, r in rows.items():
        ratios = "" if r is base else (
            f"   {r['tokens_per_s'] / base['tokens_per_s']:.2f}  {r['tpot_p50_ms'] / base['tpot_p50_ms']:.2f}"
            f"  {r['tpot_p99_ms'] / base['tpot_p99_ms']:.2f}"
        )
        print(f"{name:14} {r['tokens_per_s']:8.1f} {r['tpot_p50_ms']:12.1f} {r['tpot_p99_ms']:12.1f}{ratios}")


if __name__ == "__main__":
    main()
