"""afdc served under vLLM on one GPU: the same artifact as AFD and as the monolith, in one run.

A Qwen3-30B-A3B-shaped model (``benchmarks/configs/qwen3-30b-a3b.json``) cut to ``--layers`` layers,
its vocabulary cut to the demo tokenizer's 512 ids, random weights built here in bf16, is compiled
1A1F and served by ``afdc up``'s own :class:`Deployment` twice, one after the other:
- ``monolithic``: ``--connector loopback``, the FFN programs run in vLLM's engine process;
- ``afd``: the FFN rank in its own ``afdc serve --role ffn`` process over ``--connector`` (cuda-ipc on
  a GPU: both processes share the one GPU, so their kernels take turns unless MPS runs).
- ``afd_graphs`` (on a GPU): ``afd`` again with ``--attention-graphs`` (the attention rank's decode
  steps padded to buckets, each piece between two exchanges a CUDA graph: afdc.runtime.decode_graphs),
  at ``--graphs-concurrency`` only, to fit the session's time.
For each: greedy token ids of ``--probes`` prompts sent one at a time through the OpenAI API (one
request in flight, so every step has the same shape in both setups), then ``vllm bench serve``
(random ``--input-len`` in, ``--output-len`` out, ignore-eos, greedy) at each ``--concurrency``.
Checks: AFD's served token ids (with and without graphs) equal the monolith's; each equals
``dm.generate``'s (the artifact loaded in this process) on the same prompts. Figures: output
tok/s, TPOT and TTFT p50, AFD's as ratios to the monolith's of the same run.

``--dry-run``: the demo model on the CPU over shm, short prompts, so that this section cannot rot
where no GPU is lent (tests/test_gpu_session.py); its ``afd`` setup runs with
``--attention-graphs`` (padded decode steps, no graphs on a CPU), no third deployment.

Run:  python benchmarks/bench_gpu_serve.py [--layers 4] [--concurrency 1,16,64] [--json out.json] [--dry-run]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import time
import traceback
import urllib.request
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

import afdc
from afdc.demo import demo_tokenizer, save_demo
from afdc.runtime.options import RuntimeOptions
from afdc.runtime.rendezvous import free_port
from afdc.serve.settings import WorkerSettings
from afdc.serve.up import Deployment

sys.path.insert(0, str(Path(__file__).parent))
from bench_serve import bench_client
from gpu_summary import ratio_table

CONFIG = Path(__file__).with_name("configs") / "qwen3-30b-a3b.json"
VOCAB = 512  # the demo tokenizer's
LOG_CHARS = 200_000  # of each role's log kept in the JSON when a setup fails
CAUSE = re.compile(r"Error|Exception|Traceback|error:|failed|Failed")


def build_model(root: Path, layers: int, device: str) -> Path:
    """Qwen3-30B-A3B's shapes, ``layers`` layers, random bf16 weights, saved with a tokenizer."""
    config = AutoConfig.for_model(**json.loads(CONFIG.read_text()))
    config.num_hidden_layers, config.vocab_size, config.max_position_embeddings = layers, VOCAB, 4096
    config.tie_word_embeddings = False
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(root / "model")
    demo_tokenizer(VOCAB).save_pretrained(root / "model")
    return root / "model"


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())


def served_ids(url: str, model: str, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """Greedy token ids of each prompt through /v1/completions, one request at a time."""
    out = []
    for p in prompts:
        body = {"model": model, "prompt": p, "max_tokens": new_tokens, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True}
        choice = _post(f"{url}/v1/completions", body)["choices"][0]
        out.append(list(choice["token_ids"]))
    return out


def reference_ids(artifact: Path, prompts: list[list[int]], new_tokens: int, device: str) -> list[list[int]]:
    """``dm.generate``'s greedy ids of each prompt, the artifact loaded in this process."""
    dm = afdc.load_deployment(artifact, device=device, backend="eager")
    out = []
    for p in prompts:
        ids = torch.tensor([p], device=device)
        gen = dm.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                          min_new_tokens=new_tokens, do_sample=False)
        out.append(gen[0, len(p):].tolist())
    del dm
    return out


def causes(log: str, context: int = 2, most: int = 120) -> str:
    """The lines of a role's log that say why it failed: each error, exception and traceback line
    with ``context`` lines around it, vLLM's route table left out. A failed engine core's own
    exception comes before the API server's traceback that reports it, so a log's tail alone can
    miss it."""
    lines = [line for line in log.splitlines() if "Route:" not in line]
    keep: set[int] = set()
    for i, line in enumerate(lines):
        if CAUSE.search(line):
            keep.update(range(max(0, i - context), min(len(lines), i + context + 1)))
    return "\n".join(lines[i] for i in sorted(keep)[:most])


def serve_and_measure(artifact: Path, connector: str, args, logs: Path, prompts: list[list[int]],
                      graphs: int = 0, concurrency: list[int] | None = None) -> dict:
    options = RuntimeOptions(connector=connector, rendezvous=f"127.0.0.1:{free_port()}", log_interval=0)
    settings = WorkerSettings(str(artifact), options, device=args.device, backend=args.backend,
                              attention_graphs=graphs)
    vllm_args = ["--max-model-len", str(args.input_len + args.output_len + 64),
                 "--max-num-seqs", str(max(args.concurrency))]
    if args.device == "cuda":
        vllm_args += ["--gpu-memory-utilization", str(args.gpu_memory)]
    d = Deployment(artifact, settings, port=free_port(), log_dir=logs, vllm_args=vllm_args)
    out: dict = {"connector": connector, "attention_graphs": graphs}
    t0 = time.perf_counter()
    try:
        url = d.start(args.startup_timeout, lambda msg: print(f"  [{connector}] {msg}", flush=True))
        out["startup_s"] = time.perf_counter() - t0
        name = artifact.resolve().name
        out["ids"] = served_ids(url, name, prompts, args.probe_tokens)
        tokenizer = artifact / "model"
        for c in concurrency or args.concurrency:
            prompts_n = max(args.min_prompts, 2 * c)
            figures, _ = bench_client(url, name, tokenizer, c, prompts_n, args, logs / f"{connector}-c{c}.json")
            out[f"c{c}"] = {k: figures[k] for k in
                            ("output_throughput", "median_tpot_ms", "p99_tpot_ms", "median_ttft_ms", "completed")}
            print(f"  [{connector}] {c} in flight: {json.dumps(out[f'c{c}'])}", flush=True)
    except Exception as err:
        out["error"] = f"{type(err).__name__}: {err}"
        out["traceback"] = traceback.format_exc()
        for log in sorted(logs.glob("*.log")):
            text = log.read_text(errors="replace")
            out[f"log_{log.stem}"] = text[-LOG_CHARS:]
            out[f"causes_{log.stem}"] = causes(text)
    finally:
        d.stop()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--concurrency", default="1,16,64")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--min-prompts", type=int, default=8)
    ap.add_argument("--probes", type=int, default=4, help="prompts whose greedy ids are compared")
    ap.add_argument("--probe-tokens", type=int, default=16)
    ap.add_argument("--connector", default=None, help="AFD's connector (default: cuda-ipc on a GPU, else shm)")
    ap.add_argument("--backend", default="eager", help="what runs the programs in both setups")
    ap.add_argument("--attention-graphs", type=int, default=64,
                    help="largest decode bucket of the afd_graphs setup (the dry run's afd setup)")
    ap.add_argument("--graphs-concurrency", default="1,64", help="where the afd_graphs setup is measured")
    ap.add_argument("--gpu-memory", type=float, default=0.4, help="vLLM's --gpu-memory-utilization")
    ap.add_argument("--startup-timeout", type=float, default=240.0)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--dry-run", action="store_true", help="the demo model on the CPU, short prompts")
    args = ap.parse_args(argv)
    args.device = "cpu" if args.dry_run else "cuda"
    if args.dry_run:
        # one client run per setup: each starts a Python process that imports vLLM
        args.concurrency, args.input_len, args.output_len, args.min_prompts = "1", 16, 8, 4
    args.concurrency = [int(c) for c in str(args.concurrency).split(",")]
    graphs_at = [int(c) for c in str(args.graphs_concurrency).split(",")]
    connector = args.connector or ("cuda-ipc" if args.device == "cuda" else "shm")
    root = Path(tempfile.mkdtemp(prefix="afdc-gpu-serve-"))
    t0 = time.perf_counter()
    if args.dry_run:
        save_demo(root / "model")
        src = root / "model"
    else:
        src = build_model(root, args.layers, args.device)
    artifact = root / "afdc-served-1a1f"
    afdc.compile_model(str(src), "1A1F", artifact, progress=False)
    results: dict = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
                     "layers": None if args.dry_run else args.layers, "build_and_compile_s": time.perf_counter() - t0}
    print(f"built and compiled in {results['build_and_compile_s']:.1f} s", flush=True)
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, VOCAB, (n,), generator=generator).tolist() for n in (24, 9, 40, 17)[: args.probes]]
    results["reference_ids"] = reference_ids(artifact, prompts, args.probe_tokens, args.device)
    padded = args.attention_graphs if args.dry_run else 0  # the dry run's AFD setup: padded, no third deployment
    setups = [("monolithic", "loopback", 0, None), ("afd", connector, padded, None)]
    if not args.dry_run:
        setups.append(("afd_graphs", connector, args.attention_graphs, graphs_at))
    for name, conn, graphs, at in setups:
        logs = root / f"logs-{name}"
        logs.mkdir()
        results[name] = serve_and_measure(artifact, conn, args, logs, prompts, graphs, at)
        if args.json:
            args.json.write_text(json.dumps(results, indent=1))
    return report(results, args)


def report(results: dict, args) -> int:
    setups = [n for n in ("monolithic", "afd", "afd_graphs") if n in results]
    failed = [f"{name}: {results[name]['error']}" for name in setups if "error" in results[name]]
    mono, afd, ref = results["monolithic"], results["afd"], results["reference_ids"]
    if not failed:
        results["afd_ids_equal_monolithic"] = afd["ids"] == mono["ids"]
        results["ids_equal_dm_generate"] = {n: sum(a == b for a, b in zip(results[n]["ids"], ref)) for n in setups}
        if not results["afd_ids_equal_monolithic"]:
            failed.append("AFD's served token ids differ from the monolith's")
        print(f"\nserved {results['device']}: AFD ids == monolith ids: {results['afd_ids_equal_monolithic']}; "
              f"prompts whose ids equal dm.generate's (of {len(ref)}): {results['ids_equal_dm_generate']}")
        print("\n".join(ratio_table(mono, afd)))
        if "afd_graphs" in results:
            results["afd_graphs_ids_equal_monolithic"] = results["afd_graphs"]["ids"] == mono["ids"]
            if not results["afd_graphs_ids_equal_monolithic"]:
                failed.append("AFD's served token ids with attention graphs differ from the monolith's")
            print("with attention graphs (AFD), against the monolith without:")
            print("\n".join(ratio_table(mono, results["afd_graphs"])))
    results["failed"] = failed
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    for f in failed:
        print(f"FAILED {f}")
    for name in setups:
        for key, text in results[name].items():
            if key.startswith("causes_") or key == "traceback":
                print(f"--- {name} {key}:\n{text}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
