"""Distributed runtime benchmarks on this CPU, measured in one run.

(a) Connector round trip: an attention endpoint sends one FFN layer's activations (T tokens of a
    4096-wide bf16 hidden state) to a real FFN server process and waits for the reply; the server
    runs an identity segment, so the time is the transport's (headers, copies, wake-ups, the
    server loop). For T = 1, 16, 256 and each connector: median round-trip latency, throughput
    (bytes both ways / round trip), each side's CPU per round trip (the attention thread's, all of
    the server's threads'), and the ratio to the floor: a plain copy of the same bytes
    into and out of a shared-memory buffer, both ways, in this process. Beside it the bare
    two-process ping-pong: the same copies between two processes polling a sequence number each,
    no protocol (what crossing between cores and processes costs on this host by itself). With a
    GPU, also ``cuda-ipc`` on device tensors (the FFN server on the same GPU), against a
    device-to-device copy of the same bytes there and back, and beside the bare ping-pong of two
    processes sharing that GPU (their kernels take turns on it).
(b) Greedy decode tokens/s of a ~100M-parameter Qwen3-MoE-shaped model: the FFN side in a server
    process under 1A1F with m = 1 and m = 2 micro-batches, for each connector, against the
    monolithic Hugging Face model in this process and against afdc in-process (loopback, m = 1),
    as ratios: medians over ``--rounds`` rounds in which the setups take turns.

(c) Dense FFN layers over 2 FFN ranks (shm, m = 1), a ~100M-parameter Llama-shaped model:
    ``--dense-ffn tp`` (every rank gets every token and returns a partial sum) against
    ``replicate`` (each rank serves its own share of the tokens): bytes exchanged per generated
    token and tokens/s, as ratios replicate / tp.

(d) A MoE with a shared expert over 4 FFN ranks (1A4F shm, m = 1), ~100M-parameter
    Qwen2-MoE-shaped (16 experts, top-2, a gated shared expert): the router on the FFN side (every
    token to every rank, shared expert TP-sharded) against the attention side (each token only to
    its experts' ranks, the shared expert whole on each rank and added by one of them): bytes
    exchanged per generated token and tokens/s, as ratios attn / ffn.

(e) An idle deployment (1A1F shm, after one generate): the CPU the FFN server and the attention
    process use over a few seconds of nothing to do, in percent of one core (the shm transport
    polls its slots; its pacing must not burn cores while idle).
(f) The shm waits against each other (issue 54): afdc's adaptive default (polls capped at 20 ms),
    the same capped at 2 ms (its cap before), the earlier fixed policy by role and cores
    (``wait="cores"``) and always spinning 2 ms (``spin=2e-3``), rounds taking
    turns: the bare round trip to an identity server, and a tiny Qwen3-MoE's (8 layers, hidden 64)
    greedy decode under ``dm.launch()`` against in process (per-layer round trip, rate), with
    each process's CPU, and the bare floor: the same FFN layers in another process behind the bare
    ping-pong (what two processes taking turns cost this host, with no protocol).
(g) Where one layer's exchange goes (issue 54): the decode of (f) in a child process with
    ``AFDC_TRACE`` set (:mod:`afdc.runtime.trace`), in process and over shm (the default wait, and
    always spinning), a fresh deployment each; per traced phase of either side (header, copies,
    signals, waits, the FFN run), the median wall and CPU microseconds of a call and their 10th to
    90th percentiles. A phase includes those it calls, and the trace's own cost per traced call
    (``trace overhead``, an empty traced function's) for each of them.

The processes share this machine's cores, so (b), (c) and (d) measure overhead, not the AFD
speed-up a separate FFN pool gives. Every process runs one torch thread by default (``--threads``):
on a small shared host, processes whose thread pools span every core stall each other's
barriers (an in-process decode fell from 250 to 36 tokens/s with one other busy process).

Run:  python benchmarks/bench_runtime.py [--repeats 200] [--new-tokens 32] [--batch 8] [--rounds 5] [--connectors shm]
                                          [--only a b e f g]
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import mmap
import multiprocessing as mp
import os
import statistics
import struct
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import torch
import torch.fx as fx

import afdc
from afdc.runtime import trace
from afdc.runtime.exchange import AttentionEndpoint
from afdc.runtime.local_cluster import LocalCluster
from afdc.runtime.options import RuntimeOptions
from afdc.runtime.programs import FFNProgram
from afdc.runtime.rendezvous import Layout, Rendezvous
from afdc.segment import Segment, SegmentBinding

HIDDEN = 4096
TOKENS = (1, 16, 256)
CONNECTORS = ["gloo", "shm"] + (["cuda-ipc"] if torch.cuda.is_available() else [])


def _device(connector: str) -> str:
    return "cuda" if connector == "cuda-ipc" else "cpu"


def identity_program(device: str = "cpu") -> FFNProgram:
    g = fx.Graph()
    x = g.placeholder("x")
    g.placeholder("rank")
    g.output((x,))
    segment = Segment(graph=g, splits=(), reduce=("first",), inputs=([-1, HIDDEN],))
    # a program computes where its weights are: an empty one places this weightless echo
    weights = {} if device == "cpu" else {"placed": torch.empty(0, device=device)}
    return FFNProgram(segments=[segment], layers=[SegmentBinding(0, [])], weights=weights, rank=0)


class _EchoDeployment:
    """What LocalCluster needs to start one identity FFN server."""

    def __init__(self, device: str = "cpu"):
        self.layout = Layout(1, 1)
        self.deployment = b"echo0001"
        self.ffn_source = None
        self.ffn_ranks = [identity_program(device)]


def _shm_mapping(nbytes: int, path: Path | None = None) -> tuple[Path, mmap.mmap]:
    """A ``/dev/shm`` file of ``nbytes`` (a new one unless ``path`` names one to open), mapped."""
    created = path is None
    path = path or Path("/dev/shm") / f"afdc-bench-{uuid.uuid4().hex}"
    fd = os.open(path, os.O_RDWR | (os.O_CREAT | os.O_EXCL if created else 0), 0o600)
    try:
        if created:
            os.ftruncate(fd, nbytes)
        return path, mmap.mmap(fd, 0)
    finally:
        os.close(fd)


def shm_copy_floor(nbytes: int, repeats: int) -> float:
    """Median seconds to copy ``nbytes`` into a /dev/shm mapping and out again, both ways."""
    path, mm = _shm_mapping(max(nbytes, 1))
    path.unlink()
    ring = torch.frombuffer(mm, dtype=torch.uint8, count=nbytes)
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(2):  # to the FFN side and back
            ring.copy_(src)
            ring.clone()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def cuda_copy_floor(nbytes: int, repeats: int) -> float:
    """Median seconds to copy ``nbytes`` from one GPU buffer to another and back, synchronized."""
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t = time.perf_counter()
        dst.copy_(src)
        src.copy_(dst)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


_WORD = struct.Struct("<Q")
_STOP = 1 << 63
ECHO_START_TIMEOUT = 120.0  # seconds a bare echo process may take to start (spawn, imports)
ECHO_TIMEOUT = 20.0  # seconds a started bare echo may take to answer one round trip


def _echo_loop(mm: mmap.mmap, echo: Callable[[int], None]) -> None:
    """The bare echo: say it is ready (the word at 72), then wait for the request's sequence
    number, ``echo`` its bytes (their count is in the second word) into the reply area, post the
    same number back."""
    _WORD.pack_into(mm, 72, 1)
    seen = 0
    while True:
        while _WORD.unpack_from(mm, 0)[0] == seen:
            os.sched_yield()
        seen = _WORD.unpack_from(mm, 0)[0]
        if seen == _STOP:
            return
        echo(_WORD.unpack_from(mm, 8)[0])
        _WORD.pack_into(mm, 64, seen)


def _echo(path: str, area: int) -> None:
    """Host memory: the request's bytes copied out into torch memory, then into the reply area."""
    _, mm = _shm_mapping(0, Path(path))
    base = ctypes.addressof(ctypes.c_char.from_buffer(mm))

    def echo(n: int) -> None:
        got = torch.empty(n, dtype=torch.uint8)
        ctypes.memmove(got.data_ptr(), base + 128, n)
        ctypes.memmove(base + 128 + area, got.data_ptr(), n)

    _echo_loop(mm, echo)


def _cuda_echo(path: str, shared: list) -> None:
    """One GPU: the request's bytes copied out of the peer's CUDA IPC buffer into torch memory and
    back into its reply half, then a stream sync before the number is posted."""
    from afdc.runtime.transport.cuda_ipc import _mapped

    _, mm = _shm_mapping(0, Path(path))
    region = _mapped(shared)
    half = region.numel() // 2

    def echo(n: int) -> None:
        region[half : half + n].copy_(region[:n].clone())
        torch.cuda.current_stream().synchronize()

    _echo_loop(mm, echo)


def _ping_pong(path: Path, mm: mmap.mmap, echo: mp.process.BaseProcess, make: Callable[[int], torch.Tensor],
               put: Callable[[torch.Tensor], int], take: Callable[[torch.Tensor, int], torch.Tensor],
               repeats: int) -> dict[int, float]:
    """Median round trip per T against ``echo`` (started here): ``put`` the request (its byte
    count returned), post the count and a sequence number, wait for the echo's, ``take`` the reply."""
    echo.start()
    out, seq = {}, 0
    started = time.perf_counter()
    while _WORD.unpack_from(mm, 72)[0] != 1:  # a spawned Python's imports, slow on a loaded host
        time.sleep(0.01)
        if not echo.is_alive() or time.perf_counter() - started > ECHO_START_TIMEOUT:
            _WORD.pack_into(mm, 0, _STOP)
            why = "exited" if not echo.is_alive() else f"was not ready within {ECHO_START_TIMEOUT:g} s"
            raise TimeoutError(f"the bare echo process {why}")
    try:
        for tokens in TOKENS:
            x = make(tokens)
            times = []
            for i in range(repeats + 10):
                seq += 1
                t = time.perf_counter()
                n = put(x)
                _WORD.pack_into(mm, 8, n)
                _WORD.pack_into(mm, 0, seq)
                while _WORD.unpack_from(mm, 64)[0] != seq:
                    os.sched_yield()
                    if time.perf_counter() - t > ECHO_TIMEOUT:
                        why = "exited" if not echo.is_alive() else f"did not answer within {ECHO_TIMEOUT:g} s"
                        raise TimeoutError(f"the bare echo process {why} (round trip {seq}, T = {tokens})")
                reply = take(x, n)
                if i >= 10:
                    times.append(time.perf_counter() - t)
            assert torch.equal(reply, x)
            out[tokens] = statistics.median(times)
    finally:
        _WORD.pack_into(mm, 0, _STOP)
        echo.join(10)
        path.unlink()
    return out


def bare_ping_pong(repeats: int) -> dict[int, float]:
    """Median round trip, per T, of the least any two processes on this host do to exchange the
    activations: the same four copies as the floor, the bytes crossing between cores, a sequence
    number each way and both sides polling. What afdc adds over it is its protocol's cost."""
    area = max(TOKENS) * HIDDEN * 2
    path, mm = _shm_mapping(128 + 2 * area)
    base = ctypes.addressof(ctypes.c_char.from_buffer(mm))

    def put(x: torch.Tensor) -> int:
        n = x.numel() * x.element_size()
        ctypes.memmove(base + 128, x.data_ptr(), n)
        return n

    def take(x: torch.Tensor, n: int) -> torch.Tensor:
        reply = torch.empty_like(x)
        ctypes.memmove(reply.data_ptr(), base + 128 + area, n)
        return reply

    echo = mp.get_context("spawn").Process(target=_echo, args=(str(path), area), daemon=True)
    make = lambda tokens: torch.randn(tokens, HIDDEN).to(torch.bfloat16)  # noqa: E731
    return _ping_pong(path, mm, echo, make, put, take, repeats)


def bare_cuda_ping_pong(repeats: int) -> dict[int, float]:
    """:func:`bare_ping_pong` for device tensors, both processes on this GPU: each side's copy and
    stream sync, a sequence number each way in host memory. Two processes' kernels on one GPU take
    turns (time-slicing, no MPS), which this measures with no protocol around it."""
    from afdc.runtime.transport.cuda_ipc import _share

    half = max(TOKENS) * HIDDEN * 2
    region = torch.empty(2 * half, dtype=torch.uint8, device="cuda")
    path, mm = _shm_mapping(128)

    def put(x: torch.Tensor) -> int:
        region[: x.numel()].copy_(x)
        torch.cuda.current_stream().synchronize()
        return x.numel()

    def take(x: torch.Tensor, n: int) -> torch.Tensor:
        reply = region[half : half + n].clone()
        torch.cuda.current_stream().synchronize()
        return reply

    echo = mp.get_context("spawn").Process(target=_cuda_echo, args=(str(path), _share(region)), daemon=True)
    make = lambda tokens: torch.randn(tokens, HIDDEN, device="cuda").to(torch.bfloat16).view(-1).view(torch.uint8)  # noqa: E731
    return _ping_pong(path, mm, echo, make, put, take, repeats)


_FLOOR_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _ffn_echo(path: str, area: int, program: FFNProgram) -> None:
    """The bare floor's server: each request is a layer's one input (its layer, shape and dtype in
    the words at 16..40), run by ``program`` and its one output copied into the reply area."""
    torch.set_grad_enabled(False)
    _, mm = _shm_mapping(0, Path(path))
    base = ctypes.addressof(ctypes.c_char.from_buffer(mm))

    def echo(n: int) -> None:
        layer, rows, cols, code = struct.unpack_from("<4Q", mm, 16)
        x = torch.empty(rows, cols, dtype=_FLOOR_DTYPES[code])
        ctypes.memmove(x.data_ptr(), base + 128, n)
        (y,) = program.run(layer, [x])
        y = y.contiguous()
        ctypes.memmove(base + 128 + area, y.data_ptr(), y.numel() * y.element_size())

    _echo_loop(mm, echo)


class BareFloor:
    """What any two processes pay to run a decode's FFN layers apart, on this host: the attention
    rank's FFN program (one input, one output of the same shape per layer) swapped for this
    stand-in, which sends each layer's input to a spawned process running the same program through
    the bare ping-pong (a sequence number each way, both sides polling with ``sched_yield``; no
    header, check, wait policy or metrics). Against afdc's shm exchange, the gap is afdc's protocol;
    against in process, what the host charges two processes taking turns (the FFN layer's cold
    caches in the other process included)."""

    def __init__(self, rank, area: int = 1 << 20):
        self.rank, self.area, self.seq = rank, area, 0
        self.program = rank.ffn[0]
        self.path, self.mm = _shm_mapping(128 + 2 * area)
        self.base = ctypes.addressof(ctypes.c_char.from_buffer(self.mm))
        self.echo = mp.get_context("spawn").Process(
            target=_ffn_echo, args=(str(self.path), area, self.program), daemon=True
        )

    def __enter__(self) -> BareFloor:
        self.echo.start()
        started = time.perf_counter()
        while _WORD.unpack_from(self.mm, 72)[0] != 1:
            time.sleep(0.01)
            if not self.echo.is_alive() or time.perf_counter() - started > ECHO_START_TIMEOUT:
                self.__exit__()
                raise TimeoutError("the bare floor's FFN process did not start")
        self.rank.ffn[0] = self
        return self

    def __exit__(self, *exc) -> None:
        self.rank.ffn[0] = self.program
        _WORD.pack_into(self.mm, 0, _STOP)
        self.echo.join(10)
        self.path.unlink(missing_ok=True)

    def dispatch(self, layer: int):
        return self.program.dispatch(layer)

    def run(self, layer: int, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        (x,) = inputs
        flat = x.reshape(-1, x.shape[-1]).contiguous()
        n = flat.numel() * flat.element_size()
        ctypes.memmove(self.base + 128, flat.data_ptr(), n)
        struct.pack_into("<5Q", self.mm, 8, n, layer, *flat.shape, _FLOOR_DTYPES.index(flat.dtype))
        self.seq += 1
        _WORD.pack_into(self.mm, 0, self.seq)  # after the rest: the echo sees the request whole
        started = time.perf_counter()
        while _WORD.unpack_from(self.mm, 64)[0] != self.seq:
            os.sched_yield()
            if time.perf_counter() - started > ECHO_TIMEOUT:
                raise TimeoutError(f"the bare floor's FFN process did not answer layer {layer}")
        y = torch.empty_like(x)
        ctypes.memmove(y.data_ptr(), self.base + 128 + self.area, n)
        return [y]


def _thread_cpu_seconds(pid: int) -> float:
    """CPU seconds of all of process ``pid``'s threads, at the scheduler's nanosecond resolution
    (``/proc``'s schedstat: a few hundred round trips take less CPU than one clock tick)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            total += int((task / "schedstat").read_text().split()[0])
    return total / 1e9


def round_trips(
    connector: str, repeats: int, tokens_list: tuple[int, ...] = TOKENS, **options
) -> list[tuple[int, float, float, float]]:
    """Per token count: the median round trip, and the CPU seconds a round trip took on each
    side (this process's thread, all of the FFN server's threads), averaged over ``repeats``;
    ``options``: further RuntimeOptions (the wait)."""
    device = _device(connector)
    dep = _EchoDeployment(device)
    cluster = LocalCluster(dep, RuntimeOptions(connector=connector, timeout=60, log_interval=0, **options))
    try:
        rdv = Rendezvous(cluster.options.rendezvous, dep.layout, dep.deployment, cluster.options.token)
        endpoint = AttentionEndpoint(0, rdv, cluster.options, device)
        server = cluster.processes[0].pid
        results = []
        for tokens in tokens_list:
            x = torch.randn(tokens, HIDDEN, device=device).to(torch.bfloat16)
            times = []
            for i in range(repeats + 10):
                if i == 10:  # warm-up done
                    cpu, server_cpu = time.thread_time(), _thread_cpu_seconds(server)
                step = endpoint.begin_step()
                t = time.perf_counter()
                endpoint.send(step, 0, 0, tokens, [x], 0)
                (reply,) = endpoint.wait(step, 0, 0, [0])
                if i >= 10:
                    times.append(time.perf_counter() - t)
                assert torch.equal(reply[0].reshape(x.shape), x)
            cpu, server_cpu = time.thread_time() - cpu, _thread_cpu_seconds(server) - server_cpu
            results.append((tokens, statistics.median(times), cpu / repeats, server_cpu / repeats))
        endpoint.close()
        return results
    finally:
        cluster.stop()


def demo_moe_100m() -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    cfg = Qwen3MoeConfig(
        vocab_size=16000, hidden_size=512, intermediate_size=1024, moe_intermediate_size=384,
        num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4, head_dim=64,
        num_experts=16, num_experts_per_tok=2, max_position_embeddings=1024, tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg).eval()


def decode_rates(batch: int, new_tokens: int, rounds: int) -> None:
    model = demo_moe_100m()
    params = sum(p.numel() for p in model.parameters()) / 1e6
    ids = torch.randint(1, model.config.vocab_size, (batch, 16))
    mask = torch.ones_like(ids)

    def monolith(n):
        with torch.no_grad():
            return model.generate(
                input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0
            )

    dm = afdc.disaggregate(model, "1A1F")

    def afdc_m(m: int):
        def generate(n):
            dm.micro_batches = m
            return dm.generate(ids, mask, max_new_tokens=n, eos_token_id=[], pad_token_id=0)

        return generate

    def medians(setups: dict) -> dict[str, float]:
        """Median tokens/s of each setup over the rounds, the setups taking turns in each round
        (this VM's speed drifts by 10% within a minute: one run each would compare drifts)."""
        for fn in setups.values():
            fn(2)  # warm-up
        rates: dict[str, list[float]] = {name: [] for name in setups}
        for _ in range(rounds):
            for name, fn in setups.items():
                t = time.perf_counter()
                fn(new_tokens)
                rates[name].append(batch * new_tokens / (time.perf_counter() - t))
        return {name: statistics.median(r) for name, r in rates.items()}

    ref = monolith(new_tokens)
    local = medians({"monolith (HF generate, in-process)": monolith, **{
        f"afdc in-process loopback, m={m}": afdc_m(m) for m in (1, 2)
    }})
    base, in_process = local["monolith (HF generate, in-process)"], local["afdc in-process loopback, m=1"]
    print(f"\n(b) greedy decode, Qwen3-MoE-shaped {params:.0f}M params, batch {batch}, {new_tokens} new tokens, "
          f"fp32, median of {rounds} rounds")
    print(f"{'setup':<34}{'tokens/s':>10}{'vs monolith':>13}{'vs in-process':>15}")
    for label, rate in local.items():
        print(f"{label:<34}{rate:>10.1f}{rate / base:>13.2f}")
    for connector in CONNECTORS:
        with dm.launch(connector, log_interval=0):
            for m in (1, 2):
                assert torch.equal(afdc_m(m)(new_tokens), ref), "remote decode differs from the monolith"
            remote = medians({f"afdc 1A1F {connector}, m={m}": afdc_m(m) for m in (1, 2)})
        for label, rate in remote.items():
            print(f"{label:<34}{rate:>10.1f}{rate / base:>13.2f}{rate / in_process:>15.2f}")
        rates = list(remote.values())
        print(f"{connector}: m=2 / m=1 {rates[1] / rates[0]:.2f}")


def _placements(title: str, model, plan: str, option: str, values: tuple[str, str], batch: int, new_tokens: int):
    """Bytes exchanged per generated token and tokens/s of ``model`` under ``plan`` over shm for
    two values of one plan option, and their ratios (second / first)."""
    torch.manual_seed(0)
    ids = torch.randint(1, model.config.vocab_size, (batch, 16))
    mask = torch.ones_like(ids)
    print(f"\n{title}, batch {batch}, {new_tokens} new tokens")
    print(f"{'--' + option.replace('_', '-'):<12}{'bytes/token':>13}{'tokens/s':>10}")
    measured = []
    for value in values:
        dm = afdc.disaggregate(model, plan, connector="shm", **{option: value})
        with dm.launch(log_interval=0):
            dm.generate(ids, mask, max_new_tokens=2, eos_token_id=[], pad_token_id=0)  # warm-up
            (before,) = dm.metrics()
            t = time.perf_counter()
            dm.generate(ids, mask, max_new_tokens=new_tokens, eos_token_id=[], pad_token_id=0)
            rate = batch * new_tokens / (time.perf_counter() - t)
            (after,) = dm.metrics()
        moved = sum(after[k] - before[k] for k in ("bytes_sent", "bytes_received")) / (batch * new_tokens)
        measured.append((moved, rate))
        print(f"{value:<12}{moved:>13,.0f}{rate:>10.1f}")
    (bytes0, rate0), (bytes1, rate1) = measured
    print(f"{'ratio':<12}{bytes1 / bytes0:>13.2f}{rate1 / rate0:>10.2f}   ({values[1]} / {values[0]})")


def dense_placement(batch: int, new_tokens: int) -> None:
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(
        vocab_size=16000, hidden_size=512, intermediate_size=2048, num_hidden_layers=8, num_attention_heads=8,
        num_key_value_heads=4, head_dim=64, max_position_embeddings=1024, tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    title = "(c) dense FFN layers over 2 FFN ranks (1A2F shm, m=1), Llama-shaped"
    _placements(title, model, "1A2F", "dense_ffn", ("tp", "replicate"), batch, new_tokens)


def shared_expert_routing(batch: int, new_tokens: int) -> None:
    from transformers import AutoModelForCausalLM, Qwen2MoeConfig

    cfg = Qwen2MoeConfig(
        vocab_size=16000, hidden_size=512, intermediate_size=1024, moe_intermediate_size=384,
        shared_expert_intermediate_size=768, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
        num_experts=16, num_experts_per_tok=2, max_position_embeddings=1024, tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    title = "(d) MoE with a shared expert over 4 FFN ranks (1A4F shm, m=1), Qwen2-MoE-shaped"
    _placements(title, model, "1A4F", "router", ("ffn", "attn"), batch, new_tokens)


def idle_cpu(seconds: float = 5.0) -> None:
    """Each plan's deployment after one generate, doing nothing: with one attention rank an FFN
    server sleeps on its one link's bell, with two on the bell both ring (issue 39: < 5% of a core)."""
    model = demo_moe_100m()
    ids = torch.randint(1, model.config.vocab_size, (2, 8))
    for plan in ("1A1F", "2A2F"):
        dm = afdc.disaggregate(model, plan, connector="shm")
        with dm.launch(log_interval=0) as cluster:
            dm.generate(ids, torch.ones_like(ids), max_new_tokens=2, eos_token_id=[], pad_token_id=0)
            servers = [p.pid for p in cluster.processes]
            before, here, t = [_cpu_seconds(s) for s in servers], time.process_time(), time.perf_counter()
            time.sleep(seconds)
            elapsed = time.perf_counter() - t
            ffn = [_cpu_seconds(s) - b for s, b in zip(servers, before)]
            attn = time.process_time() - here
        each = ", ".join(f"{100 * c / elapsed:.1f}%" for c in ffn)
        print(f"\n(e) idle deployment ({plan} shm) over {seconds:g} s: FFN servers {each} of a core, attention "
              f"process {100 * attn / elapsed:.1f}%, all {100 * (sum(ffn) + attn) / elapsed:.1f}%")


WAITS = {  # (f): the shm waits compared, as dm.launch() options
    "adaptive (default)": {},
    "adaptive, cap 2 ms": {"wait": "adaptive", "spin_cap": 2e-3},
    "cores (before)": {"wait": "cores"},
    "always spin 2 ms": {"spin": 2e-3},
}


def tiny_moe() -> torch.nn.Module:
    """Issue 54's model: Qwen3-MoE-shaped, 8 layers, hidden 64, 8 experts top-2 (a step's work is
    small, so the exchange's waits are most of what AFD adds)."""
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    cfg = Qwen3MoeConfig(
        vocab_size=1000, hidden_size=64, intermediate_size=128, moe_intermediate_size=64, num_hidden_layers=8,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
        max_position_embeddings=512, tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg).eval()


def wait_policies(batch: int, new_tokens: int, rounds: int, repeats: int) -> None:
    """(f) Each wait (:data:`WAITS`) against the others, rounds taking turns. First the bare
    exchange, every setup in a fresh deployment each round: the median shm round trip of one
    token's activations to an identity FFN server (as (a)) and each side's CPU per round trip.
    Then the Python API's greedy decode over shm, each wait's deployment up throughout, against
    the same model in process, and beside
    them the bare floor (:class:`BareFloor`: the same FFN layers in another process behind the
    bare ping-pong, no protocol): per setup the median time per token and its spread over the
    rounds, the per-layer round trip ((time per token over shm - in process of the same round) /
    layers), the rate against in process, and each process's CPU while it decoded (% of a core)."""
    trips: dict[str, list[tuple[int, float, float, float]]] = {name: [] for name in WAITS}
    for _ in range(rounds):
        for name, options in WAITS.items():
            trips[name] += round_trips("shm", repeats, (1,), **options)
    print(f"\n(f) by wait, {rounds} rounds taking turns; shm round trip of [1, {HIDDEN}] bf16, identity FFN server, "
          f"{repeats} a round (load average {os.getloadavg()[0]:.2f})")
    print(f"{'wait':<20}{'rtt us':>8}{'(rounds)':>28}{'attn CPU us':>13}{'FFN CPU us':>12}")
    for name, ts in trips.items():
        rtts = " ".join(f"{t[1] * 1e6:.0f}" for t in ts)
        print(f"{name:<20}{statistics.median(t[1] for t in ts) * 1e6:>8.0f}{f'({rtts})':>28}"
              f"{statistics.median(t[2] for t in ts) * 1e6:>13.0f}{statistics.median(t[3] for t in ts) * 1e6:>12.0f}")
    model = tiny_moe()
    layers = model.config.num_hidden_layers
    ids = torch.randint(1, model.config.vocab_size, (batch, 8))
    mask = torch.ones_like(ids)
    dm = afdc.disaggregate(model, "1A1F", connector="shm")

    def decode(d, n: int) -> torch.Tensor:
        return d.generate(ids, mask, max_new_tokens=n, eos_token_id=[], pad_token_id=0)

    def timed(d, server: int | None) -> tuple[float, float, float]:
        """Seconds per token, and the CPU of this process and of the server (% of a core)."""
        cpu, ffn, t = time.process_time(), _thread_cpu_seconds(server) if server else 0.0, time.perf_counter()
        decode(d, new_tokens)
        wall = time.perf_counter() - t
        ffn = _thread_cpu_seconds(server) - ffn if server else 0.0
        return wall / new_tokens, 100 * (time.process_time() - cpu) / wall, 100 * ffn / wall

    ref = decode(dm, new_tokens)
    runs: dict[str, list[tuple[float, float, float]]] = {name: [] for name in ["in process", "bare floor", *WAITS]}
    # Every wait's deployment stays up (an idle one sleeps), so a round takes seconds and each
    # setup's decode is compared with the in-process one of the same few seconds: this VM's speed
    # drifts by 2x over minutes, which swamped rounds that relaunched each deployment. The bare
    # floor's echo polls without ever sleeping, so it runs only for its own turn.
    dms = {name: afdc.disaggregate(model, "1A1F", connector="shm") for name in WAITS}
    with contextlib.ExitStack() as stack:
        servers = {name: stack.enter_context(dms[name].launch(log_interval=0, **options)).processes[0].pid
                   for name, options in WAITS.items()}
        for name in WAITS:
            assert torch.equal(decode(dms[name], new_tokens), ref), f"decode over shm ({name}) differs from in process"
        for _ in range(rounds):
            runs["in process"].append(timed(dm, None))
            for name in WAITS:
                runs[name].append(timed(dms[name], servers[name]))
            with BareFloor(dm.ranks[0]) as floor:
                assert torch.equal(decode(dm, new_tokens), ref), "decode behind the bare floor differs from in process"
                runs["bare floor"].append(timed(dm, floor.echo.pid))
    base = [r[0] for r in runs["in process"]]
    print(f"\n(f) greedy decode over shm by wait, dm.launch() 1A1F, Qwen3-MoE-shaped {layers} layers hidden "
          f"{model.config.hidden_size}, batch {batch}, {new_tokens} new tokens, {rounds} rounds taking turns "
          f"(load average {os.getloadavg()[0]:.2f} at the end)")
    print(f"{'setup':<20}{'ms/token':>9}{'(min-max)':>14}{'rt/layer us':>13}{'(min-max)':>14}{'vs in proc':>11}"
          f"{'(min-max)':>12}{'attn CPU %':>11}{'FFN CPU %':>10}")
    for name, rs in runs.items():
        per_token = [r[0] for r in rs]
        rtt = [(t - b) / layers * 1e6 for t, b in zip(per_token, base)]
        rate = [b / t for t, b in zip(per_token, base)]
        med = statistics.median
        print(f"{name:<20}{med(per_token) * 1e3:>9.2f}{f'({min(per_token) * 1e3:.2f}-{max(per_token) * 1e3:.2f})':>14}"
              + (f"{med(rtt):>13.0f}{f'({min(rtt):.0f}-{max(rtt):.0f})':>14}{med(rate):>11.2f}"
                 f"{f'({min(rate):.2f}-{max(rate):.2f})':>12}" if name != "in process" else f"{'':>50}")
              + f"{med(r[1] for r in rs):>11.0f}{med(r[2] for r in rs) if name != 'in process' else 0:>10.0f}")


TRACED = {  # (g): the setups traced, each in a child process; None: in process, else dm.launch() options
    "in process": None,
    "shm, default wait": {},
    "shm, always spin 2 ms": {"spin": 2e-3},
}


def traced_decode(setup: str, batch: int, new_tokens: int) -> None:
    """(g)'s child: one warm-up decode, then ``new_tokens`` traced (``AFDC_TRACE`` set by the parent)."""
    model = tiny_moe()
    ids = torch.randint(1, model.config.vocab_size, (batch, 8))
    dm = afdc.disaggregate(model, "1A1F", connector="shm")
    options = TRACED[setup]
    with contextlib.ExitStack() as stack:
        if options is not None:
            stack.enter_context(dm.launch(log_interval=0, **options))
        for n in (2, new_tokens):
            dm.generate(ids, torch.ones_like(ids), max_new_tokens=n, eos_token_id=[], pad_token_id=0)
    # what the trace itself adds to each traced call (its clock reads, a system call each for CPU):
    # a phase that calls k traced phases holds k + 1 of it
    empty = trace.phase("trace overhead")(lambda: None)
    for _ in range(1000):
        empty()


def exchange_phases(batch: int, new_tokens: int, threads: int) -> None:
    """(g) Each of :data:`TRACED` in a child process tracing its phases, and the table of them."""
    print(f"\n(g) phases of a layer's exchange, dm.launch() 1A1F decode as (f), batch {batch}, {new_tokens} new "
          "tokens: per call, median wall us (p10-p90) and median CPU us (p10-p90); n calls (warm-up included)")
    for setup in TRACED:
        with tempfile.TemporaryDirectory() as out:
            load = os.getloadavg()[0]
            subprocess.run([sys.executable, __file__, "--traced", setup, "--wait-batch", str(batch), "--new-tokens",
                            str(new_tokens), "--threads", str(threads)], env={**os.environ, "AFDC_TRACE": out},
                           check=True)
            print(f"\n{setup} (load average {load:.2f} before, {os.getloadavg()[0]:.2f} after)")
            print(f"{'side':<6}{'phase':<22}{'wall us':>9}{'(p10-p90)':>16}{'CPU us':>9}{'(p10-p90)':>16}{'n':>7}")
            for path in sorted(Path(out).glob("trace-*.json")):
                records = json.loads(path.read_text())
                side = "FFN" if "ffn.handle" in records else "attn"
                for name, calls in sorted(records.items()):
                    wall, cpu = _percentiles([c[0] for c in calls]), _percentiles([c[1] for c in calls])
                    print(f"{side:<6}{name:<22}{wall[1]:>9.1f}{f'({wall[0]:.1f}-{wall[2]:.1f})':>16}"
                          f"{cpu[1]:>9.1f}{f'({cpu[0]:.1f}-{cpu[2]:.1f})':>16}{len(calls):>7}")


def _percentiles(ns: list[int]) -> tuple[float, float, float]:
    """The 10th, 50th and 90th percentiles of ``ns`` nanoseconds, in microseconds."""
    if len(ns) < 2:
        return (ns[0] / 1e3,) * 3
    q = statistics.quantiles(ns, n=10)
    return q[0] / 1e3, statistics.median(ns) / 1e3, q[-1] / 1e3


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5, help="(b): rounds of every setup taking turns")
    parser.add_argument("--connectors", nargs="+", default=list(CONNECTORS), choices=CONNECTORS)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads of every process (this one and the FFN servers, via OMP_NUM_THREADS)")
    parser.add_argument("--only", nargs="+", default=list("abcdef"), choices=list("abcdefg"),
                        help="sections to run (g, the traced phases, only when named)")
    parser.add_argument("--wait-batch", type=int, default=2, help="(f), (g): the decode's batch")
    parser.add_argument("--traced", choices=list(TRACED), help=argparse.SUPPRESS)  # (g)'s child process
    args = parser.parse_args()
    CONNECTORS[:] = args.connectors
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # read by the spawned FFN servers' torch
    torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    if args.traced:
        traced_decode(args.traced, args.wait_batch, args.new_tokens)
        return
    print(f"afdc {afdc.__version__}, torch {torch.__version__}, {os.cpu_count()} CPUs, {args.threads} torch threads "
          f"per process, load average {os.getloadavg()[0]:.2f}, {time.strftime('%Y-%m-%d %H:%M')}")
    if "a" in args.only:
        round_trip_table(args.repeats)
    if "b" in args.only:
        decode_rates(args.batch, args.new_tokens, args.rounds)
    if "c" in args.only:
        dense_placement(args.batch, args.new_tokens)
    if "d" in args.only:
        shared_expert_routing(args.batch, args.new_tokens)
    if "e" in args.only:
        idle_cpu()
    if "f" in args.only:
        wait_policies(args.wait_batch, args.new_tokens, args.rounds, args.repeats)
    if "g" in args.only:
        exchange_phases(args.wait_batch, args.new_tokens, args.threads)


def round_trip_table(repeats: int) -> None:
    print(f"\n(a) round trip of one FFN layer's activations, [{'T'}, {HIDDEN}] bf16, identity FFN server")
    floors = {t: shm_copy_floor(t * HIDDEN * 2, repeats) for t in TOKENS}
    bare = {"host": bare_ping_pong(repeats)}
    if "cuda-ipc" in CONNECTORS:
        print("cuda-ipc: device tensors, the FFN server on the same GPU; its floor a device-to-device copy in one\n"
              "process, its bare ping-pong the same copies between two processes sharing the GPU")
        device_floors = {t: cuda_copy_floor(t * HIDDEN * 2, repeats) for t in TOKENS}
        try:
            bare["cuda"] = bare_cuda_ping_pong(repeats)
        except TimeoutError as err:  # the connectors' own round trips are still worth measuring
            print(f"bare cuda ping-pong: {err}")
            bare["cuda"] = dict.fromkeys(TOKENS, float("nan"))
    print(f"{'connector':<10}{'T':>5}{'bytes':>10}{'rtt us':>10}{'GB/s':>8}{'floor us':>10}{'rtt/floor':>11}"
          f"{'bare us':>9}{'rtt/bare':>10}{'attn CPU us':>13}{'FFN CPU us':>12}")
    for connector in CONNECTORS:
        for tokens, rtt, attn_cpu, ffn_cpu in round_trips(connector, repeats):
            nbytes = tokens * HIDDEN * 2
            floor = (device_floors if connector == "cuda-ipc" else floors)[tokens]
            least = bare["cuda" if connector == "cuda-ipc" else "host"][tokens]
            print(
                f"{connector:<10}{tokens:>5}{nbytes:>10}{rtt * 1e6:>10.0f}{2 * nbytes / rtt / 1e9:>8.2f}"
                f"{floor * 1e6:>10.1f}{rtt / floor:>11.1f}{least * 1e6:>9.1f}{rtt / least:>10.1f}"
                f"{attn_cpu * 1e6:>13.0f}{ffn_cpu * 1e6:>12.0f}"
            )


if __name__ == "__main__":
    main()
