"""Tune afdc's fused MoE on this GPU and ship the result in ``afdc/data/autotuned.json``.

For each model shape (``--models`` from ``--configs``: every expert on this GPU, weights in the
model's own layout) and each power-of-2 token count up to ``--max-tokens``, afdc's runtime
autotuner (:mod:`afdc.codegen.autotune`) times every candidate block size on the real kernel, in
bf16 and, with ``--formats``, in the format the model ships in (fp8 block-scaled for the
DeepSeek-V3 and Qwen3 shapes, MXFP4 for gpt-oss's). The winners are merged into the shipped
table under this device's name (as vLLM keeps a fused-MoE config file per device and shape); a
launch on the same device then takes the nearest entry instead of tuning at its first call.

Last, for bf16, each shape and token count is timed with the tuned block sizes against the
default ones (:func:`afdc.codegen.fused_moe.default_block_sizes`), as a ratio: what the table buys.
Commit the table it writes.

Run (on a GPU):  python benchmarks/tune_fused_moe.py [--models qwen3-30b-a3b deepseek-v3 mixtral-8x7b]
                 [--max-tokens 4096] [--formats] [--table afdc/data/autotuned.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_kernels import expert_weights, quant_moe_cases, read_moe_shape

from afdc.codegen import autotune
from afdc.codegen.fused_moe import fused_moe_triton

ROOT = Path(__file__).resolve().parents[1]


def token_counts(most: int) -> list[int]:
    return [1 << i for i in range(most.bit_length()) if 1 << i <= most]


def tune_shape(shape, counts: list[int], formats: bool, gen) -> list[tuple[int, float, float]]:
    """Tunes one shape at every token count; returns (tokens, default ms, tuned ms) of bf16."""
    from triton.testing import do_bench

    (w_gate_up, w_down), options = expert_weights(shape, "cuda", gen)
    rows = []
    for tokens in counts:
        x = torch.randn(tokens, shape.hidden, generator=gen, device="cuda", dtype=torch.bfloat16)
        weights = torch.rand(tokens, shape.top_k, generator=gen, device="cuda")
        ids = torch.rand(tokens, shape.experts, generator=gen, device="cuda").topk(shape.top_k, dim=-1).indices

        def run(x=x, weights=weights, ids=ids):
            return fused_moe_triton(x, w_gate_up, w_down, weights, ids, 0, shape.activation, **options)

        run()  # tunes this token bucket (the autotuner's cache records it)
        os.environ["AFDC_AUTOTUNE"] = "0"  # the default tiles: neither the table nor a tuning
        default_ms = do_bench(run)
        os.environ["AFDC_AUTOTUNE"] = "1"
        rows.append((tokens, default_ms, do_bench(run)))
        if formats:
            impls, _ = quant_moe_cases(shape, tokens, "cuda", gen, w8a8=False)
            for name, fn in impls:
                if name not in ("dequantize+bf16", "bf16 fused_moe"):
                    fn()  # tunes the quantized kernel at this bucket
        print(f"  {shape.model} T={tokens}: default {rows[-1][1]:.3f} ms, tuned {rows[-1][2]:.3f} ms", flush=True)
    return rows


def merge(cache: Path, table: Path, device: str) -> int:
    """This device's entries of the autotuner's ``cache`` merged into ``table``; returns how many."""
    tuned = {k: v for k, v in json.loads(cache.read_text()).items() if autotune.TuneKey.parse(k).device == device}
    shipped = json.loads(table.read_text()) if table.is_file() else {}
    shipped.update(tuned)
    autotune.TunedTable({autotune.TuneKey.parse(k): tuple(v) for k, v in shipped.items()})  # what a reader accepts
    table.write_text(json.dumps(dict(sorted(shipped.items())), indent=1) + "\n")
    return len(tuned)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", type=Path, default=ROOT / "benchmarks" / "configs")
    ap.add_argument("--models", nargs="+", default=["qwen3-30b-a3b", "deepseek-v3", "mixtral-8x7b"])
    ap.add_argument("--max-tokens", type=int, default=4096)
    ap.add_argument("--formats", action="store_true", help="also the format each model ships in (fp8, MXFP4)")
    ap.add_argument("--table", type=Path, default=ROOT / "afdc" / "data" / "autotuned.json")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("tune_fused_moe.py tunes for a GPU: no CUDA device here")
    device = torch.cuda.get_device_name()
    cache = Path(tempfile.mkdtemp(prefix="afdc-tune-")) / "autotune.json"
    # tune everything afresh: no earlier cache, no shipped entry in the way
    os.environ.update(AFDC_AUTOTUNE="1", AFDC_AUTOTUNE_CACHE=str(cache),
                      AFDC_TUNED_CONFIGS=str(cache.with_name("none")))
    autotune.tuner.cache_clear()
    autotune.shipped.cache_clear()
    gen = torch.Generator("cuda").manual_seed(0)
    print(f"{device}: tuning fused MoE up to {args.max_tokens} tokens", flush=True)
    summary = {}
    for model in args.models:
        shape = read_moe_shape(args.configs / f"{model}.json")
        summary[model] = tune_shape(shape, token_counts(args.max_tokens), args.formats, gen)
        torch.cuda.empty_cache()
    print(f"{merge(cache, args.table, device)} entries for {device} in {args.table}")
    print(f"\n{'model':<16}{'tokens':>7}{'default ms':>12}{'tuned ms':>10}{'default/tuned':>15}")
    for model, rows in summary.items():
        for tokens, default_ms, tuned_ms in rows:
            print(f"{model:<16}{tokens:>7}{default_ms:>12.3f}{tuned_ms:>10.3f}{default_ms / tuned_ms:>15.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
