"""afdc on one GPU, end to end: is the disaggregated model still the monolith, and what does it cost?

Models built here (random weights, no downloads): a Llama-shaped dense model (``dense``), a
Qwen3-MoE-shaped model (``moe``), a DeepSeek-V3-shaped model (``deepseek``: MLA, shared expert,
grouped sigmoid routing) and a gpt-oss-shaped model (``gpt-oss``: its own expert format).
Sections (``--only``), the first two in the order ``benchmarks/gpu_session.sh`` runs them:

model       Each model under the default backend (``auto``: on a GPU ``afdc``, its fused-MoE and
            routing kernels inside the programs and the rest compiled by Inductor), 1A1F: the afdc
            kernels it substituted (a MoE model must get its fused MoE and routing kernels), logits
            on a left-padded batch and greedy tokens against the monolith, then the prefill forward
            and the time per new token of greedy decode as ratios to the monolith's.
interleave  A compiled artifact of ``moe`` loaded under a compiling backend (``afdc``), its FFN rank
            served by ``afdc serve`` in its own process (cuda-ipc): logits, greedy tokens and time
            per token with one micro-batch and with two, which take turns in one thread, each on a
            CUDA stream of its own, the attention program run as Inductor's pieces cut at its sends.
correct     Models x dtypes x backends x plans (1A1F with m = 1, 2A2F with m = 2): logits and greedy
            tokens against the monolith.
graph       One FFN segment of ``moe`` under ``torch.cuda.graphs``: replayed, compared with the eager
            call and timed against it.
artifact    The artifact of ``moe`` loaded per backend and against its FFN rank served over shm, over
            cuda-ipc and over cuda-ipc with ``--token-buckets 256`` (segments replayed from CUDA graphs).

Correct means: in fp32, logits within 1e-4 of the monolith's (relative to its largest logit) and
the same greedy tokens. In bf16, a random model's top-k routing turns rounding into other experts,
so the monolith's own bf16 logits are far from its fp32 ones: the disaggregated model must be no
further from the fp32 model than the monolith (x1.5, or 1e-2); its greedy tokens are reported.
Times: CUDA-synchronized wall clock, medians; per new token = (generate(1 + n) - generate(1)) / n.

Every check reports its error and goes on, so one run says everything that breaks; the exit status
is 1 when any failed (an error, a result outside its tolerance, a kernel not substituted), and the
failures are listed last. ``--dry-run`` runs the sections on the CPU at tiny sizes in fp32 with few
repeats (there ``auto`` is ``eager`` and the connector shm), so that the session cannot rot where
no GPU is lent; ``graph`` and ``artifact`` need CUDA and are refused there.

Run:  python benchmarks/bench_gpu.py [--json out.json] [--only model interleave] [--models moe dense] [--dry-run]
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
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

import afdc
from afdc.equivalence import check
from afdc.lowering import backends

BACKENDS = ("auto", "eager", "inductor", "afdc")
SECTIONS = ("model", "interleave", "correct", "graph", "artifact")
CUDA_ONLY = ("graph", "artifact")  # on the GPU alone: CUDA graphs, cuda-ipc
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
FP32_RTOL = 1e-4


@dataclass(frozen=True)
class Model:
    model_type: str
    sizes: dict
    tiny: dict  # what --dry-run overrides in ``sizes``
    kernels: tuple[str, ...] = ()  # the afdc kernels the afdc backend must substitute in it


MODELS = {
    "dense": Model("llama", dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                                 num_attention_heads=12, num_key_value_heads=4, vocab_size=32000),
                   dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, vocab_size=256)),
    "moe": Model("qwen3_moe", dict(hidden_size=512, intermediate_size=1536, moe_intermediate_size=768,
                                   num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
                                   head_dim=64, num_experts=8, num_experts_per_tok=2, vocab_size=32000,
                                   decoder_sparse_step=1, mlp_only_layers=[]),
                 dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4, vocab_size=256),
                 kernels=("fused_moe", "moe_route")),
    "deepseek": Model("deepseek_v3", dict(hidden_size=512, intermediate_size=1024, moe_intermediate_size=256,
                                          num_hidden_layers=4, first_k_dense_replace=1, num_attention_heads=8,
                                          num_key_value_heads=8, n_routed_experts=16, n_shared_experts=1,
                                          num_experts_per_tok=4, n_group=4, topk_group=2, q_lora_rank=128,
                                          kv_lora_rank=64, qk_rope_head_dim=32, qk_nope_head_dim=64,
                                          v_head_dim=64, vocab_size=32000),
                      dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2,
                           q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16,
                           v_head_dim=16, vocab_size=256),
                      kernels=("fused_moe", "moe_route")),
    "gpt-oss": Model("gpt_oss", dict(hidden_size=512, intermediate_size=512, num_hidden_layers=4,
                                     num_attention_heads=8, num_key_value_heads=4, head_dim=64,
                                     num_local_experts=8, num_experts_per_tok=2, vocab_size=32000,
                                     layer_types=["sliding_attention", "full_attention"] * 2, sliding_window=16),
                     dict(hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=16, num_local_experts=4, vocab_size=256,
                          layer_types=["sliding_attention", "full_attention"]),
                     kernels=("fused_moe",)),  # its softmax(topk) router stays (afdc.passes.fuse_moe)
}


@dataclass(frozen=True)
class Setup:
    """Where and how big: the GPU run's, or --dry-run's (CPU, tiny models, few repeats)."""

    device: str
    tiny: bool
    repeats: int  # timed calls per median (prefill); per-token times take a quarter, at least 3
    new_tokens: int  # greedy tokens per-token times are taken over

    @classmethod
    def of(cls, args: argparse.Namespace) -> Setup:
        if args.dry_run:
            return cls("cpu", True, args.repeats or 1, args.new_tokens or 2)
        return cls("cuda", False, args.repeats or 10, args.new_tokens or 16)

    @property
    def warmup(self) -> int:
        return 0 if self.tiny else 2

    @property
    def decode_repeats(self) -> int:
        return self.repeats if self.tiny else max(3, self.repeats // 4)

    def call_ms(self, fn: Callable) -> float:
        return timed(fn, self.repeats, self.warmup)

    def per_token_ms(self, generate: Callable[[int], torch.Tensor]) -> float:
        return per_token(generate, self.new_tokens, self.decode_repeats, self.warmup)


def build(name: str, dtype: torch.dtype, device: str, tiny: bool):
    spec = MODELS[name]
    torch.manual_seed(0)
    config = AutoConfig.for_model(spec.model_type, **{**spec.sizes, **(spec.tiny if tiny else {})})
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


def per_token(generate: Callable, n: int, repeats: int, warmup: int = 2) -> float:
    """ms per new token of greedy decode: (generate(1 + n) - generate(1)) / n."""
    return (timed(lambda: generate(1 + n), repeats, warmup) - timed(lambda: generate(1), repeats, warmup)) / n


def greedy(model, ids: torch.Tensor, mask: torch.Tensor) -> Callable[[int], torch.Tensor]:
    """``model``'s (or a disaggregated model's) greedy ``generate``, by the number of new tokens."""
    return lambda k: model.generate(ids, attention_mask=mask, max_new_tokens=k, do_sample=False)


def section(results: dict, key: str, fn: Callable, *args) -> None:
    """``results[key] = fn(*args)``: a dict whose ``ok`` says whether the check passed, or the error."""
    t0 = time.perf_counter()
    try:
        results[key] = fn(*args)
    except Exception as exc:  # a GPU check reports what broke and goes on to the next one
        results[key] = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
    results[key]["seconds"] = round(time.perf_counter() - t0, 1)
    print(f"== {key} ({results[key]['seconds']} s): {'ok' if results[key]['ok'] else 'FAILED'}")
    print(json.dumps({k: v for k, v in results[key].items() if k != "traceback"}, indent=1, default=str))
    if "traceback" in results[key]:
        print(results[key]["traceback"])
    sys.stdout.flush()


def report(results: dict) -> int:
    """Say which checks of ``results`` failed, and why; the exit status: 1 if any did, else 0."""
    checks = {key: row for key, row in results.items() if isinstance(row, dict)}
    failed = [f"{key}: {row.get('error') or ', '.join(row['failed'])}" for key, row in checks.items() if not row["ok"]]
    print(f"== {len(failed)} of {len(checks)} checks failed" + "".join(f"\n  {f}" for f in failed))
    return 1 if failed else 0


@dataclass
class Judge:
    """Whether logits are the monolith's (see the module docstring): ``reference`` is the monolith's
    logits in the dtype under test; in bf16 ``exact`` is the fp32 model's."""

    reference: torch.Tensor
    valid: torch.Tensor
    exact: torch.Tensor | None = None
    failed: list[str] = field(default_factory=list)  # the checks that did not hold, named

    @classmethod
    def of(cls, name: str, model, setup: Setup, ids: torch.Tensor, mask: torch.Tensor) -> Judge:
        reference = model(input_ids=ids, attention_mask=mask).logits
        exact = None
        if reference.dtype != torch.float32:
            exact = build(name, torch.float32, setup.device, setup.tiny)(input_ids=ids, attention_mask=mask).logits
        return cls(reference, mask.bool(), exact)

    def _distance(self, logits: torch.Tensor, to: torch.Tensor) -> float:
        return ((logits.float() - to.float()).abs()[self.valid].max() / to.float().abs()[self.valid].max()).item()

    def logits(self, what: str, logits: torch.Tensor) -> dict:
        """The distances of ``what``'s logits, and whether they pass (noted in ``failed`` if not)."""
        row = {f"{what}_rel_diff": self._distance(logits, self.reference)}
        if self.exact is None:
            ok = row[f"{what}_rel_diff"] <= FP32_RTOL
        else:
            row["mono_vs_fp32"] = self._distance(self.reference, self.exact)
            row[f"{what}_vs_fp32"] = self._distance(logits, self.exact)
            ok = row[f"{what}_vs_fp32"] <= max(1.5 * row["mono_vs_fp32"], 1e-2)
        if not ok:
            self.failed.append(f"{what} logits")
        return row

    def tokens(self, what: str, equal: bool) -> dict:
        """Whether ``what``'s greedy tokens were the monolith's; required in fp32 only."""
        if not equal and self.exact is None:
            self.failed.append(f"{what} greedy tokens")
        return {f"{what}_greedy_equal": equal}

    def require(self, what: str, holds: bool) -> None:
        if not holds:
            self.failed.append(what)

    def verdict(self) -> dict:
        return {"ok": not self.failed, "failed": self.failed}


@contextlib.contextmanager
def _logged(name: str) -> Iterator[list[logging.LogRecord]]:
    """The INFO records logger ``name`` gives within the block."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = records.append
    logger = logging.getLogger(name)
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield records
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


# afdc.lowering logs one INFO record per program it lowers; their arguments are read here (its
# "afdc backend: <program>: <kernels by kind> ..." and "<program>: cut at its sends into <n> pieces").
def substituted(records: list[logging.LogRecord]) -> dict[str, int]:
    """The afdc kernels the afdc backend put in, by kind, summed over the programs."""
    counts: dict[str, int] = {}
    for r in records:
        if r.msg.startswith("afdc backend:") and isinstance(r.args[1], dict):
            for kind, n in r.args[1].items():
                counts[kind] = counts.get(kind, 0) + n
    return counts


def pieces(records: list[logging.LogRecord]) -> int:
    """How many pieces the programs were cut into at their sends (0: none was)."""
    return sum(r.args[1] for r in records if "cut at its sends" in r.msg)


def _resolved(backend: str, setup: Setup) -> str:
    return backends.resolve(backend, torch.device(setup.device))


@torch.no_grad()
def in_model(name: str, backend: str, dtype: torch.dtype, setup: Setup) -> dict:
    """Section ``model``: kernels substituted, correctness and speed of ``name`` under ``backend``, 1A1F."""
    model = build(name, dtype, setup.device, setup.tiny)
    ids, mask = inputs(model.config.vocab_size, setup.device)
    judge = Judge.of(name, model, setup, ids, mask)
    resolved = _resolved(backend, setup)
    with _logged("afdc.backend") as records:
        t0 = time.perf_counter()
        dm = afdc.disaggregate(model, plan="1A1F", backend=backend)
        eq = check(model, dm, ids, mask, new_tokens=16)
        out: dict = {"backend": resolved, "split_and_first_calls_s": round(time.perf_counter() - t0, 1)}
    out["kernels"] = substituted(records)
    if resolved == "afdc":
        missing = [k for k in MODELS[name].kernels if not out["kernels"].get(k)]
        judge.require(f"afdc kernels not substituted: {', '.join(missing)}", not missing)
    out |= judge.logits("dm", dm(input_ids=ids, attention_mask=mask).logits)
    out |= judge.tokens("dm", eq.greedy_equal)
    for who, runs in (("mono", model), (resolved, dm)):
        out[who] = {
            "prefill_ms": setup.call_ms(lambda runs=runs: runs(input_ids=ids, attention_mask=mask)),
            "per_token_ms": setup.per_token_ms(greedy(runs, ids, mask)),
        }
    for what in ("prefill", "per_token"):
        out[resolved][f"{what}_ratio"] = out[resolved][f"{what}_ms"] / out["mono"][f"{what}_ms"]
    return out | judge.verdict()


@torch.no_grad()
def correctness(name: str, dtype: torch.dtype, plan: str, backend: str, micro_batches: int, setup: Setup) -> dict:
    """Section ``correct``: logits and greedy tokens of one (model, dtype, backend, plan)."""
    model = build(name, dtype, setup.device, setup.tiny)
    ids, mask = inputs(model.config.vocab_size, setup.device)
    judge = Judge.of(name, model, setup, ids, mask)
    t0 = time.perf_counter()
    dm = afdc.disaggregate(model, plan=plan, backend=backend, micro_batches=micro_batches)
    out: dict = {"split_s": round(time.perf_counter() - t0, 1)}
    t0 = time.perf_counter()
    out |= judge.tokens("dm", check(model, dm, ids, mask, new_tokens=16).greedy_equal)
    out["first_calls_s"] = round(time.perf_counter() - t0, 1)
    out |= judge.logits("dm", dm(input_ids=ids, attention_mask=mask).logits)
    return out | judge.verdict()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _artifact(name: str, dtype: torch.dtype, setup: Setup, backend: str) -> Iterator[tuple[torch.nn.Module, Path]]:
    """``name`` on ``setup.device`` and its 1A1F artifact compiled for ``backend``, in a temporary folder."""
    model = build(name, dtype, "cpu", setup.tiny)
    with tempfile.TemporaryDirectory() as tmp:
        src, art = Path(tmp) / "model", Path(tmp) / "art"
        model.save_pretrained(src)
        afdc.compile_model(str(src), afdc.Plan.parse("1A1F", backend=backend), art, progress=False)
        yield model.to(setup.device), art


@torch.no_grad()
def interleave(backend: str, dtype: torch.dtype, connector: str, setup: Setup) -> dict:
    """Section ``interleave``: an artifact of ``moe`` against its FFN rank served over ``connector``,
    with one micro-batch and with two (interleaved in one thread, on a CUDA stream each on a GPU)."""
    with _artifact("moe", dtype, setup, backend) as (model, art):
        ids, mask = inputs(model.config.vocab_size, setup.device)
        judge = Judge.of("moe", model, setup, ids, mask)
        expected = greedy(model, ids, mask)(16)
        out: dict = {"backend": _resolved(backend, setup), "connector": connector,
                     "mono_per_token_ms": setup.per_token_ms(greedy(model, ids, mask))}
        dm = afdc.load_deployment(art, device=setup.device, backend=backend)
        with _logged("afdc.backend") as records:
            out |= _served(art, dm, connector, 0, backend, ids, mask, expected, judge, setup)
        out["pieces"] = pieces(records)
        if out["backend"] != "eager":  # a compiling backend interleaves Inductor's pieces of the program
            judge.require("the attention program was not cut into pieces for m = 2", out["pieces"] > 0)
    return out | judge.verdict()


@torch.no_grad()
def artifact(backend: str, setup: Setup) -> dict:
    """Section ``artifact``: the artifact of ``moe`` loaded under ``backend``, then against its FFN rank
    served over shm, cuda-ipc and cuda-ipc with its segments in CUDA graphs."""
    with _artifact("moe", torch.bfloat16, setup, backend) as (model, art), _logged("afdc.backend") as records:
        ids, mask = inputs(model.config.vocab_size, setup.device)
        judge = Judge.of("moe", model, setup, ids, mask)
        expected = greedy(model, ids, mask)(16)
        dm = afdc.load_deployment(art, device=setup.device, backend=backend)
        out = judge.logits("loaded", dm(input_ids=ids, attention_mask=mask).logits)
        out |= judge.tokens("loaded", torch.equal(greedy(dm, ids, mask)(16), expected))
        # the served rows' yardsticks: the monolith and the loaded program in-process (loopback)
        out["mono_per_token_ms"] = setup.per_token_ms(greedy(model, ids, mask))
        out["loaded_per_token_ms"] = setup.per_token_ms(greedy(dm, ids, mask))
        out["afdc_kernels"] = substituted(records)
        for connector, buckets in (("shm", 0), ("cuda-ipc", 0), ("cuda-ipc", 256)):
            key = connector + (f"+buckets{buckets}" if buckets else "")
            try:
                out[key] = _served(art, dm, connector, buckets, backend, ids, mask, expected, judge, setup)
            except Exception as err:  # one setup failing must not hide the others' numbers
                judge.require(f"{key}: {type(err).__name__}: {err}", False)
                out[key] = {"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()}
    return out | judge.verdict()


def _served(art: Path, dm, connector: str, buckets: int, backend: str, ids, mask, expected, judge: Judge,
            setup: Setup) -> dict:
    """``dm`` against its FFN rank served by ``afdc serve`` over ``connector`` (with ``--token-buckets
    buckets``: its segments replayed from CUDA graphs), with one micro-batch and with two, which take
    turns in one thread, each on a CUDA stream of its own (docs/runtime.md)."""
    out: dict = {}
    port, token = _free_port(), secrets.token_hex(8)
    server = subprocess.Popen(
        [sys.executable, "-m", "afdc.cli", "serve", str(art), "--role", "ffn", "--rank", "0", "--connector",
         connector, "--rendezvous", f"127.0.0.1:{port}", "--device", setup.device, "--backend", backend,
         "--token-buckets", str(buckets)],
        env={**os.environ, "AFDC_TOKEN": token}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    before = dm.micro_batches
    try:
        dm.connect(afdc.RuntimeOptions(connector=connector, rendezvous=f"127.0.0.1:{port}", token=token), host=True)
        for m in (1, 2):
            dm.micro_batches = m
            what = f"served_m{m}"
            out |= judge.logits(what, dm(input_ids=ids, attention_mask=mask).logits)
            out |= judge.tokens(what, torch.equal(greedy(dm, ids, mask)(16), expected))
            out[f"{what}_per_token_ms"] = setup.per_token_ms(greedy(dm, ids, mask))
        out["metrics"] = dm.metrics()
    finally:
        dm.micro_batches = before
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
def cuda_graph_segment(setup: Setup) -> dict:
    """Section ``graph``: one FFN segment of ``moe`` captured at a fixed token count and replayed."""
    model = build("moe", torch.bfloat16, "cuda", setup.tiny)
    dm = afdc.disaggregate(model, plan="1A1F", backend="eager")
    ffn = dm.ffn
    segment = ffn.segments[0]
    out: dict = {"segment": type(segment).__name__}
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
    failed = [f"{t} tokens: replay differs" for t in (1, 16, 256) if not out[t]["replay_equal"]]
    return out | {"ok": not failed, "failed": failed}


def _flat(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    return [t for v in value for t in _flat(v)]


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--repeats", type=int, help="timed calls per median (default 10; --dry-run 1)")
    p.add_argument("--new-tokens", type=int, help="tokens per-token times are taken over (default 16; --dry-run 2)")
    p.add_argument("--only", nargs="+", choices=SECTIONS,
                   help="sections to run (default: all; --dry-run: those a CPU runs)")
    p.add_argument("--backends", nargs="+", default=["auto"], choices=BACKENDS,
                   help="model, correct, artifact: each of these (auto: the default)")
    p.add_argument("--interleave-backend", default="afdc", choices=BACKENDS,
                   help="interleave: a compiling backend, whose pieces of the attention program interleave")
    p.add_argument("--dtypes", nargs="+", default=["bf16"], choices=list(DTYPES), help="model, correct, interleave")
    p.add_argument("--plans", nargs="+", default=["1A1F", "2A2F"], help="correct: m = 1 at 1A1F, else m = 2")
    p.add_argument("--connector", help="interleave: the FFN rank's connector (default cuda-ipc; --dry-run shm)")
    p.add_argument("--dry-run", action="store_true",
                   help="the sections on the CPU at tiny sizes, fp32, connector shm, few repeats")
    p.add_argument("--json", type=Path, help="the results, rewritten after each check")
    args = p.parse_args(argv)
    args.only = args.only or [s for s in SECTIONS if not (args.dry_run and s in CUDA_ONLY)]
    args.connector = args.connector or ("shm" if args.dry_run else "cuda-ipc")
    if args.dry_run:
        # Inductor's builds take minutes on a small CPU: the dry run interleaves eager straight-line code
        args.dtypes, args.interleave_backend = ["fp32"], "eager"
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    setup = Setup.of(args)
    if setup.device == "cuda" and not torch.cuda.is_available():
        print("bench_gpu.py needs a CUDA device (--dry-run: the same sections on the CPU at tiny sizes)")
        return 2
    if setup.device == "cpu" and set(args.only) & set(CUDA_ONLY):
        print(f"bench_gpu.py --dry-run: {', '.join(CUDA_ONLY)} needs CUDA; leave it out of --only")
        return 2
    import transformers
    results: dict = {"device": torch.cuda.get_device_name() if setup.device == "cuda" else "cpu (dry run)",
                     "torch": torch.__version__, "transformers": transformers.__version__}
    try:
        import triton
        results["triton"] = triton.__version__
    except ImportError:
        results["triton"] = None
    print(json.dumps(results))

    def run(key: str, fn: Callable, *fn_args) -> None:
        section(results, key, fn, *fn_args)
        if args.json:
            args.json.write_text(json.dumps(results, indent=1, default=str))

    for name in args.models if "model" in args.only else []:
        for dtype in args.dtypes:
            for backend in args.backends:
                run(f"model/{name}/{dtype}/{backend}", in_model, name, backend, DTYPES[dtype], setup)
    for dtype in args.dtypes if "interleave" in args.only else []:
        run(f"interleave/moe/{dtype}/{args.interleave_backend}/{args.connector}", interleave,
            args.interleave_backend, DTYPES[dtype], args.connector, setup)
    for name in args.models if "correct" in args.only else []:
        for dtype in args.dtypes:
            for backend in args.backends:
                for plan in args.plans:
                    m = 1 if plan == "1A1F" else 2
                    run(f"correct/{name}/{dtype}/{backend}/{plan}/m{m}", correctness, name, DTYPES[dtype], plan,
                        backend, m, setup)
    if "graph" in args.only:
        run("graph/moe/ffn_segment", cuda_graph_segment, setup)
    for backend in args.backends if "artifact" in args.only else []:
        run(f"artifact/moe/{backend}", artifact, backend, setup)
    return report(results)


if __name__ == "__main__":
    sys.exit(main())
