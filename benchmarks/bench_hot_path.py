"""The attention program's fixed per-layer cost: tiny models, where that cost is all there is.

An 8-layer, 64-wide Qwen3-MoE (8 experts, top-2) and an 8-layer, 64-wide Llama, fp32 on one CPU
thread: greedy decode time per new token of ``dm.generate`` (plan 1A1F, in-process loopback
connector, default backend) against the model's own ``model.generate``, and one decode step
against a KV cache of the prompt (``model(..., past_key_values=)`` against ``dm._run`` with
afdc's cache), measured in one run, interleaved. At this size the matmuls cost next to nothing,
so the ratio is afdc's own Python and dispatch per layer and per step (target <= 1.15).

Per token = ``(generate(1 + N) - generate(1)) / N`` from medians (prefill excluded).

Run:  python benchmarks/bench_hot_path.py [--batch 1] [--prompt 16] [--new-tokens 32] [--repeats 15]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
from bench_core import decode_step, interleaved
from transformers import AutoConfig, AutoModelForCausalLM

import afdc

TARGET = 1.15


def moe_config():
    return AutoConfig.for_model(
        "qwen3_moe", vocab_size=1024, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_experts=8, num_experts_per_tok=2, tie_word_embeddings=True,
    )


def llama_config():
    return AutoConfig.for_model(
        "llama", vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=8,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True,
    )


def line(label: str, mono: float, dm: float, unit: str = "us") -> float:
    ratio = dm / mono
    verdict = "ok" if ratio <= TARGET else "MISSED"
    print(f"  {label:<24} mono {mono * 1e6:8.0f} dm {dm * 1e6:8.0f} {unit}  ratio {ratio:.3f} ({verdict})")
    return ratio


def bench(name: str, config, args) -> dict[str, float]:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # decode exactly N tokens on both sides
    model.generation_config.pad_token_id = 0
    dm = afdc.disaggregate(model, plan="1A1F")
    print(f"\n[{name}] {type(model).__name__}, backend {dm.attention.backend}, batch {args.batch}, "
          f"prompt {args.prompt}, N = {args.new_tokens}")
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, config.vocab_size, (args.batch, args.prompt), generator=g)
    mask = torch.ones_like(ids)
    n = args.new_tokens

    def mono(k):
        return lambda: model.generate(ids, attention_mask=mask, max_new_tokens=k, do_sample=False)

    def disagg(k):
        return lambda: dm.generate(ids, attention_mask=mask, max_new_tokens=k)

    with torch.inference_mode():
        same = torch.equal(mono(n + 1)(), disagg(n + 1)())
        print(f"  greedy {n + 1} tokens identical to model.generate: {same}")
        g1 = interleaved(mono(1), disagg(1), args.warmup, args.repeats)
        gn = interleaved(mono(n + 1), disagg(n + 1), args.warmup, args.repeats)
        per_token = gn.minus(g1, n)
        ratios = {"generate per token": line("generate: per new token", *per_token.median("wall"))}
        ratios["generate cpu"] = line("  (process CPU time)", *per_token.median("cpu"))
        step = decode_step(model, dm, ids, mask, args)
        ratios["decode step"] = line("decode step", *step.median("wall"))
        print(f"  {'':<24} [decode step wall pairwise {step.pairwise():.3f}, min/min {step.min_ratio():.3f}]")
    if not same:
        ratios["tokens differ"] = float("inf")
    return ratios


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--prompt", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=15, help="timed runs per side (median); the decode step runs 3x")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--only", choices=["moe", "llama"])
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"afdc bench_hot_path  torch {torch.__version__}, {torch.get_num_threads()} thread(s), "
          f"load average {os.getloadavg()[0]:.2f}")
    results = {}
    for name, make in (("moe", moe_config), ("llama", llama_config)):
        if args.only in (None, name):
            results[name] = bench(name, make(), args)
    print(f"\n== dm / model, wall (target <= {TARGET:.2f}); load average now {os.getloadavg()[0]:.2f}")
    for name, ratios in results.items():
        print(f"  {name:<6} " + ", ".join(f"{k} {v:.3f}" for k, v in ratios.items()))
    return 0 if all(v <= TARGET for r in results.values() for v in r.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
