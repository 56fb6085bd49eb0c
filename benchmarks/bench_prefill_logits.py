"""A serving prefill step with the LM head on every token against the LM head on the sampled rows.

One step of the serving worker's kind (a flat batch of R requests over a paged KV cache, the FFN
side in-process) for a Llama-shaped model with Llama 3's vocabulary (128,256): the attention
program as captured (logits for all T tokens), then with ``afdc::sampled_rows`` in front of the
LM head (``afdc/lowering/sampled_rows.py``, what the worker runs: logits for each request's last
token). Prints the median step time of each, the logits tensor's size, and the ratios; checks
the sampled rows' logits equal the full run's.

Run:  python benchmarks/bench_prefill_logits.py [--requests 4] [--prompt 512] [--repeats 3]
"""

from __future__ import annotations

import argparse
import copy
import functools
import statistics
import time

import torch

import afdc
from afdc.lowering.attention_slots import attention_slots
from afdc.lowering.sampled_rows import sample_rows_only
from afdc.runtime import kv_cache
from afdc.runtime import link as connectors
from afdc.runtime.paged import PagedBatch, PagedKVStore
from afdc.runtime.programs import combine


def llama_128k():
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(
        vocab_size=128256, hidden_size=512, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=2, head_dim=64, max_position_embeddings=4096, tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg).eval()


def step(program, dm, requests: int, prompt: int, block: int = 16):
    """One prefill step of ``requests`` prompts of ``prompt`` tokens; (seconds, logits)."""
    blocks = -(-prompt // block)
    store = PagedKVStore(attention_slots(dm.attention.module.graph), requests * blocks, block)
    table = torch.arange(requests * blocks).reshape(requests, blocks)
    batch = PagedBatch(store, table, torch.zeros(requests, dtype=torch.long), torch.full((requests,), prompt))
    ids = torch.randint(3, 128000, (1, requests * prompt), generator=torch.Generator().manual_seed(0))
    link = connectors.LoopbackConnector(functools.partial(combine, dm.ffn_ranks))
    start = time.perf_counter()
    with torch.no_grad(), connectors.active(link), kv_cache.active(batch):
        logits = program(ids, torch.ones_like(ids), batch.positions).logits[0]
    return time.perf_counter() - start, logits, batch.logit_rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    model = llama_128k()
    dm = afdc.disaggregate(model, "1A1F")
    full = dm.attention_ranks[0]
    rows = copy.deepcopy(full)
    assert sample_rows_only(rows.module, rows.out_spec), "no LM head found"
    print(f"Llama-shaped, hidden 512, 4 layers, vocab 128,256; one prefill step of {args.requests} x "
          f"{args.prompt} tokens, paged KV, FFN in-process; median of {args.repeats}")
    print(f"{'LM head on':<22}{'step s':>9}{'logits MB':>11}")
    measured = {}
    for label, program in (("every token", full), ("sampled rows", rows)):
        runs = [step(program, dm, args.requests, args.prompt) for _ in range(args.repeats + 1)][1:]
        seconds = statistics.median(t for t, _, _ in runs)
        logits, last = runs[-1][1], runs[-1][2]
        measured[label] = (seconds, logits, last)
        print(f"{label:<22}{seconds:>9.3f}{logits.numel() * logits.element_size() / 1e6:>11.1f}")
    (t_full, l_full, last), (t_rows, l_rows, _) = measured["every token"], measured["sampled rows"]
    torch.testing.assert_close(l_rows, l_full[last], atol=1e-4, rtol=1e-4)
    size = l_rows.numel() / l_full.numel()
    print(f"{'ratio rows / every':<22}{t_rows / t_full:>9.2f}{size:>11.4f}   (the sampled rows' logits match)")


if __name__ == "__main__":
    main()
