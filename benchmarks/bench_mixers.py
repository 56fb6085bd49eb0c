"""Decode of stateful-mixer hybrids is incremental: time per new token with a long prompt over a short one.

Every hybrid in ``models_supported.catalog`` (Gated DeltaNet, KDA, Mamba, Mamba-2 and short-conv
hybrids) and every sparse-attention model (an indexer with a key cache of its own: DeepSeek-V3.2,
GLM-MoE-DSA, HY-V4), tiny and fp32 on one CPU thread, plan 1A1F in-process: greedy ``dm.generate`` time per
new token after a prompt of ``--long`` tokens over the same after ``--short`` tokens, measured in
one run. Incremental decode (each step feeds one token; the mixers carry their state, attention
its KV cache) stays near 1: only attention's reads grow with the prefix. The same model decoding
by prefix recompute (``dm.incremental = False``, what afdc did before mixer ops) is measured
beside it: its ratio grows with the prefix.

Per token = ``(generate(1 + N) - generate(1)) / N`` from medians (prefill excluded).

Run:  python benchmarks/bench_mixers.py [--short 16] [--long 512] [--new-tokens 16] [--repeats 5] [--only TYPE ...]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

import afdc
from models_supported import catalog

TARGET = 1.5  # "near 1": the long prompt may cost attention reads, not a recompute of the prefix


def per_token(dm, ids: torch.Tensor, new: int, repeats: int) -> float:
    def run(n: int) -> float:
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            dm.generate(ids, max_new_tokens=n)
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    run(2)  # warm-up
    return (run(1 + new) - run(1)) / new


def bench(entry: catalog.ModelEntry, args) -> tuple[float, float]:
    model = catalog.build_type(entry.model_type, {**entry.config_kwargs, "max_position_embeddings": 4 * args.long})
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    dm = afdc.disaggregate(model, "1A1F")
    assert dm.incremental, dm.report().decode_recomputes
    g = torch.Generator().manual_seed(0)
    short, long = (torch.randint(3, 128, (1, n), generator=g) for n in (args.short, args.long))
    incremental = per_token(dm, long, args.new_tokens, args.repeats) / per_token(
        dm, short, args.new_tokens, args.repeats
    )
    dm.incremental = False
    recompute = per_token(dm, long, args.new_tokens, args.repeats) / per_token(
        dm, short, args.new_tokens, args.repeats
    )
    return incremental, recompute


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--short", type=int, default=16)
    ap.add_argument("--long", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--only", nargs="*", help="model_types to run (default: every hybrid and sparse-attention model)")
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    print(f"time per new token, prompt {args.long} over prompt {args.short} (N = {args.new_tokens}, 1 thread)")
    print(f"  {'model':<24} {'incremental':>12} {'recompute':>10}")
    stateful = [e for e in catalog.ENTRIES if e.family == "hybrid" or "index_topk" in e.config_kwargs]
    for entry in (e for e in stateful if not args.only or e.model_type in args.only):
        incremental, recompute = bench(entry, args)
        verdict = "ok" if incremental <= TARGET else "MISSED"
        print(f"  {entry.name:<24} {incremental:>12.2f} {recompute:>10.2f}  ({verdict}: target <= {TARGET})")


if __name__ == "__main__":
    main()
