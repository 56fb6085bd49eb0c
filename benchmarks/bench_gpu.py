"""afdc on one GPU, end to end: is the disaggregated model still the monolith, and what does it cost?

(1) For a few small models built here (random weights, no downloads): a Llama-shaped dense model,
    a Qwen3-MoE-shaped model, a DeepSeek-V3-shaped model (MLA, shared expert, grouped routing) and
    a gpt-oss-shaped model (its own expert format), on the GPU in fp32 and bf16, each backend
    (``eager``, ``inductor``, ``afdc``) under plans 1A1F and 2A2F (m = 2): logits on a
    left-padded batch against the monolith (relative to the largest logit) and greedy tokens; in
    bf16 also both against the fp32 model (a random model's routing amplifies rounding).
    Then per backend: the prefill forward and the time per new token of greedy decode, as a
    ratio to the model's own call and ``generate`` in the same run (CUDA-synchronized wall
    clock, medians).
(2) A compiled artifact of the MoE model, loaded on the GPU (``afdc.load_deployment``), against
    the monolith (logits, greedy tokens, time per new token of both, and the afdc kernels the
    backend substituted); then its FFN rank served by ``afdc serve --role ffn --device cuda`` in its
    own process over the shm connector (payloads staged through host memory), over cuda-ipc
    (device to device), and over cuda-ipc with ``--token-buckets 256`` (its FFN segments
    replayed from CUDA graphs), the attention side in this process.
(3) One FFN segment of the MoE model under ``torch.cuda.graphs``: captured at a fixed token
    count, replayed, compared with the eager call and timed against it.

Every section reports its error and goes on, so one run says everything that breaks.
Run:  python benchmarks/bench_gpu.py [--json out.json] [--only correct speed graph artifact] [--models moe dense]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import secrets
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

import afdc
from afdc.equivalence import check

BACKENDS = ("eager", "inductor", "afdc")
SECTIONS = ("correct", "speed", "graph", "artifact")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
CONFIGS = {
    "dense": ("llama", dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                            num_attention_heads=12, num_key_value_heads=4, vocab_size=32000)),
    "moe": ("qwen3_moe", dict(hidden_size=512, intermediate_size=1536, moe_intermediate_size=768,
                              num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
                              head_dim=64, num_experts=8, num_experts_per_tok=2, vocab_size=32000,
                              decoder_sparse_step=1, mlp_only_layers=[])),
    "deepseek": ("deepseek_v3", dict(hidden_size=512, intermediate_size=1024, moe_intermediate_size=256,
                                     num_hidden_layers=4, first_k_dense_replace=1, num_attention_heads=8,
                                     num_key_value_heads=8, n_routed_experts=16, n_shared_experts=1,
                                     num_experts_per_tok=4, n_group=4, topk_group=2, q_lora_rank=128,
                                     kv_lora_rank=64, qk_rope_head_dim=32, qk_nope_head_dim=64,
                                     v_head_dim=64, vocab_size=32000)),
    "gpt-oss": ("gpt_oss", dict(hidden_size=512, intermediate_size=512, num_hidden_layers=4,
                                num_attention_heads=8, num_key_value_heads=4, head_dim=64,
                                num_local_experts=8, num_experts_per_tok=2, vocab_size=32000,
                                layer_types=["sliding_attention", "full_attention"] * 2,
                                sliding_window=16)),
}


def build(name: str, dtype: torch.dtype, device: str):
    model_type, kwargs = CONFIGS[name]
    torch.manual_seed(0)
    config = AutoConfig.for_model(model_type, **kwargs)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype).to(device).eval()
    gc = model.generation_config
    gc.eos_token_id, gc.pad_token_id, gc.do_sample = None, 0, False
    return model


def inputs(vocab: int, device: str, lengths=(48, 31, 17, 48)) -> tuple[torch.Tensor, torch.Tensor]:
    """A left-padded batch: row i holds ``lengths[i]`` tokens."""
    gen = torch.Generator().manual_seed(1234)
    width = max(lengths)
    ids = torch.randint(3, vocab, (len(lengths), width), generator=gen)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        ids[row, : width - n] = 0
        mask[row, width - n:] = 1
    return ids.to(device), mask.to(device)


def timed(fn: Callable, repeats: int, warmup: int = 2) -> float:
    """Median wall time of ``fn`` in ms, the GPU synchronized around each call."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        _sync()
        t0 = time.perf_counter()
        fn()
        _sync()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def per_token(generate: Callable, n: int, repeats: int) -> float:
    """ms per new token of greedy decode: (generate(1 + n) - generate(1)) / n."""
    return (timed(lambda: generate(1 + n), repeats) - timed(lambda: generate(1), repeats)) / n


def section(results: dict, key: str, fn: Callable, *args) -> None:
    t0 = time.perf_counter()
    try:
        results[key] = fn(*args)
    except Exception as exc:  # a GPU check reports what broke and goes on to the next one
        results[key] = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
    results[key]["seconds"] = round(time.perf_counter() - t0, 1)
    print(f"== {key} ({results[key]['seconds']} s)")
    print(json.dumps({k: v for k, v in results[key].items() if k != "traceback"}, indent=1, default=str))
    if "traceback" in results[key]:
        print(results[key]["traceback"])
    sys.stdout.flush()


def _error_vs_fp32(name: str, device: str, ids: torch.Tensor, mask: torch.Tensor) -> Callable[[torch.Tensor], float]:
    """Logits' distance to the fp32 model's at the valid positions, relative to its largest: in
    bf16 a random model's routing turns rounding into other experts, so the disaggregated model
    is judged against the monolith's own distance."""
    exact = build(name, torch.float32, device)(input_ids=ids, attention_mask=mask).logits
    valid = mask.bool()
    return lambda logits: ((logits.float() - exact).abs()[valid].max() / exact.abs()[valid].max()).item()


@torch.no_grad()
def correctness(name: str, dtype: torch.dtype, plan: str, backend: str, micro_batches: int, device: str) -> dict:
    """fp32: logits within 1e-4 of the monolith's and the same greedy tokens. bf16: a random model's
    top-k routing turns rounding into different experts, so the monolith's own bf16 logits are far
    from its fp32 ones; the disaggregated model must be no further from fp32 than the monolith."""
    model = build(name, dtype, device)
    ids, mask = inputs(model.config.vocab_size, device)
    t0 = time.perf_counter()
    dm = afdc.disaggregate(model, plan=plan, backend=backend, micro_batches=micro_batches)
    split_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    eq = check(model, dm, ids, mask, new_tokens=16)
    row = {"rel_diff": eq.max_rel_diff, "greedy_equal": eq.greedy_equal, "first_calls_s": 0.0,
           "split_s": round(split_s, 1)}
    row["first_calls_s"] = round(time.perf_counter() - t0, 1)
    if dtype == torch.float32:
        row["ok"] = eq.ok(1e-4)
        return row
    error = _error_vs_fp32(name, device, ids, mask)
    row["mono_vs_fp32"] = error(model(input_ids=ids, attention_mask=mask).logits)
    row["dm_vs_fp32"] = error(dm(input_ids=ids, attention_mask=mask).logits)
    row["ok"] = row["dm_vs_fp32"] <= max(1.5 * row["mono_vs_fp32"], 1e-2)
    return row


@torch.no_grad()
def speed(name: str, dtype: torch.dtype, repeats: int, new_tokens: int, backends: list[str]) -> dict:
    model = build(name, dtype, "cuda")
    ids, mask = inputs(model.config.vocab_size, "cuda")
    out: dict = {"mono": {
        "prefill_ms": timed(lambda: model(input_ids=ids, attention_mask=mask), repeats),
        "per_token_ms": per_token(
            lambda k: model.generate(ids, attention_mask=mask, max_new_tokens=k, do_sample=False),
            new_tokens, max(3, repeats // 4)),
    }}
    for backend in backends:
        dm = afdc.disaggregate(model, plan="1A1F", backend=backend)
        row = {
            "prefill_ms": timed(lambda dm=dm: dm(input_ids=ids, attention_mask=mask), repeats),
            "per_token_ms": per_token(
                lambda k, dm=dm: dm.generate(ids, attention_mask=mask, max_new_tokens=k, do_sample=False),
                new_tokens, max(3, repeats // 4)),
        }
        row["prefill_ratio"] = row["prefill_ms"] / out["mono"]["prefill_ms"]
        row["per_token_ratio"] = row["per_token_ms"] / out["mono"]["per_token_ms"]
        out[backend] = row
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _logged(name: str) -> Iterator[list[str]]:
    """The INFO messages logger ``name`` gives within the block."""
    lines: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: lines.append(record.getMessage())
    logger = logging.getLogger(name)
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield lines
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


@torch.no_grad()
def artifact(backend: str) -> dict:
    model = build("moe", torch.bfloat16, "cpu")
    ids, mask = inputs(model.config.vocab_size, "cuda")
    out: dict = {}
    with tempfile.TemporaryDirectory() as tmp, _logged("afdc.backend") as kernels:
        src, art = Path(tmp) / "model", Path(tmp) / "art"
        model.save_pretrained(src)
        subprocess.run([sys.executable, "-m", "afdc.cli", "compile", str(src), "--plan", "1A1F", "-o", str(art),
                        "--quiet"], check=True)
        model = model.to("cuda")
        ref = model(input_ids=ids, attention_mask=mask).logits
        expected = model.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False)
        dm = afdc.load_deployment(art, device="cuda", backend=backend)
        valid = mask.bool()
        rel = lambda logits: ((logits - ref).abs()[valid].max() / ref.abs()[valid].max()).item()  # noqa: E731
        out["loaded_rel_diff"] = rel(dm(input_ids=ids, attention_mask=mask).logits)
        error = _error_vs_fp32("moe", "cuda", ids, mask)
        out["mono_vs_fp32"], out["loaded_vs_fp32"] = error(ref), error(dm(input_ids=ids, attention_mask=mask).logits)
        out["loaded_greedy_equal"] = torch.equal(
            dm.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False), expected)
        # the served rows' yardsticks: the monolith and the loaded program in-process (loopback)
        out["monolith_per_token_ms"] = per_token(
            lambda k: model.generate(ids, attention_mask=mask, max_new_tokens=k, do_sample=False), 16, 3)
        out["loaded_per_token_ms"] = per_token(
            lambda k: dm.generate(ids, attention_mask=mask, max_new_tokens=k, do_sample=False), 16, 3)
        out["afdc_kernels"] = list(kernels)  # what the afdc backend substituted, per program

        # the FFN rank in its own process, as a user deploys it: payloads staged through host
        # memory (shm), then device to device (cuda-ipc), then with its segments in CUDA graphs
        for connector, buckets in (("shm", 0), ("cuda-ipc", 0), ("cuda-ipc", 256)):
            key = connector + (f"+buckets{buckets}" if buckets else "")
            try:
                out[key] = _served(art, dm, connector, buckets, backend, ids, mask, expected, rel)
            except Exception as err:  # one setup failing must not hide the others' numbers
                out[key] = {"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()}
    return out


def _served(art: Path, dm, connector: str, buckets: int, backend: str, ids, mask, expected, rel) -> dict:
    """``dm`` against its FFN rank served by ``afdc serve`` over ``connector`` on this GPU
    (with ``--token-buckets buckets``: its segments replayed from CUDA graphs)."""
    out: dict = {}
    port, token = _free_port(), secrets.token_hex(8)
    env = {**os.environ, "AFDC_TOKEN": token}
    server = subprocess.Popen(
        [sys.executable, "-m", "afdc.cli", "serve", str(art), "--role", "ffn", "--rank", "0", "--connector",
         connector, "--rendezvous", f"127.0.0.1:{port}", "--device", "cuda", "--backend", backend,
         "--token-buckets", str(buckets)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        os.environ["AFDC_TOKEN"] = token
        dm.connect(afdc.RuntimeOptions(connector=connector, rendezvous=f"127.0.0.1:{port}", token=token), host=True)
        out["served_rel_diff"] = rel(dm(input_ids=ids, attention_mask=mask).logits)
        out["served_greedy_equal"] = torch.equal(
            dm.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False), expected)
        out["served_per_token_ms"] = per_token(
            lambda k: dm.generate(ids, attention_mask=mask, max_new_tokens=k, do_sample=False), 16, 3)
        # two micro-batches ping-pong, each on a CUDA stream of its own, in turns in one thread (the
        # compiled backends' attention program in pieces cut at its sends, docs/runtime.md)
        micro_batches, dm.micro_batches = dm.micro_batches, 2
        try:
            out["served_m2_greedy_equal"] = torch.equal(
                dm.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False), expected)
            out["served_m2_per_token_ms"] = per_token(
                lambda k: dm.generate(ids, attention_mask=mask, max_new_tokens=k, do_sample=False), 16, 3)
        except Exception as err:  # keep the m = 1 numbers above
            out["served_m2_error"] = f"{type(err).__name__}: {err}"
        finally:
            dm.micro_batches = micro_batches
        out["metrics"] = dm.metrics()
    finally:
        dm.disconnect()
        server.terminate()
        try:
            log, _ = server.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            log, _ = server.communicate()
        out["server_log_tail"] = log[-3000:]
    return out


@torch.no_grad()
def cuda_graph_segment() -> dict:
    model = build("moe", torch.bfloat16, "cuda")
    dm = afdc.disaggregate(model, plan="1A1F", backend="eager")
    ffn = dm.ffn
    segment = ffn.segments[0]
    out = {}
    for tokens in (1, 16, 256):
        x = torch.randn(tokens, model.config.hidden_size, device="cuda", dtype=torch.bfloat16)
        call = lambda x=x: ffn.run(0, [x])  # noqa: E731
        eager = call()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(3):
                call()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = call()
        graph.replay()
        torch.cuda.synchronize()
        same = all(torch.equal(a, b) for a, b in zip(_flat(eager), _flat(captured), strict=True))
        out[tokens] = {"replay_equal": same, "eager_ms": timed(call, 50), "replay_ms": timed(graph.replay, 50)}
    out["segment"] = type(segment).__name__
    return out


def _flat(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    return [t for v in value for t in _flat(v)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=list(CONFIGS))
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--only", nargs="+", default=list(SECTIONS), choices=SECTIONS, help="sections to run")
    p.add_argument("--backends", nargs="+", default=list(BACKENDS))
    p.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    p.add_argument("--plans", nargs="+", default=["1A1F", "2A2F"], help="m = 1 at 1A1F, else m = 2")
    p.add_argument("--device", default="cuda")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench_gpu.py needs a CUDA device (--device cpu: the correctness checks alone, as a dry run)")
        return 2
    import transformers
    device = torch.cuda.get_device_name() if args.device == "cuda" else args.device
    results: dict = {"device": device, "torch": torch.__version__, "transformers": transformers.__version__}
    try:
        import triton
        results["triton"] = triton.__version__
    except ImportError:
        results["triton"] = None
    print(json.dumps(results))

    def save():
        if args.json:
            args.json.write_text(json.dumps(results, indent=1, default=str))

    if "correct" in args.only:
        for name in args.models:
            for dtype in args.dtypes:
                for backend in args.backends:
                    for plan in args.plans:
                        m = 1 if plan == "1A1F" else 2
                        key = f"correct/{name}/{dtype}/{backend}/{plan}/m{m}"
                        section(results, key, correctness, name, DTYPES[dtype], plan, backend, m, args.device)
                save()
    if args.device != "cuda":
        return 0
    if "speed" in args.only:
        for name in args.models:
            section(results, f"speed/{name}/bf16", speed, name, torch.bfloat16, args.repeats, args.new_tokens,
                     args.backends)
            save()
    if "graph" in args.only:
        section(results, "cuda_graph/ffn_segment", cuda_graph_segment)
        save()
    if "artifact" in args.only:
        for backend in [b for b in args.backends if b != "inductor"]:
            section(results, f"artifact/{backend}", artifact, backend)
            save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
