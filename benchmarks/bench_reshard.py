"""Benchmark of the streaming resharder (afdc.artifact.reshard) on a synthetic multi-GB MoE checkpoint.

Writes a Qwen3-MoE-shaped bf16 checkpoint of at least ``--gb`` GB to a temporary directory, in the
layout transformers' ``save_pretrained`` produces (legacy per-expert keys, several shards plus
``model.safetensors.index.json``), one tensor at a time from a 64 MB random pool (never the whole
model). Then measures, in one run:

(a) a plain sequential read of every source byte (``readinto``, 16 MB chunks);
(b) resharding into a 2A2F layout: 2 attention files with every non-expert tensor (replicated) and
    2 FFN files with half the experts of every MoE layer each (EP, dim 0 of the stacked experts).

Targets: reshard GB/s (bytes written) >= 0.5 x read GB/s; peak RSS < 2 GB. Before each measurement
the source files are synced and evicted from the page cache (``posix_fadvise(DONTNEED)``, no root
needed), so (a) and (b) both read from disk; (b)'s writes land in the page cache (flushed in the
background, no fsync).
For scale, (c) prints the rate of a plain sequential write of as many bytes to new files, and of sha256
alone: the resharder does both (on every output byte) and so cannot beat either.

Run:  python benchmarks/bench_reshard.py [--gb 4] [--dir /some/tmp]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import resource
import shutil
import tempfile
import time
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import Qwen3MoeConfig
from transformers.core_model_loading import dot_natural_key, revert_weight_conversion

from afdc.artifact.checkpoint import INDEX_NAME
from afdc.artifact.reshard import TargetFile, TargetTensor, encode_header, reshard
from afdc.segment import ShardSlice
from afdc.source import empty_model

TARGET_RATIO = 0.5
TARGET_RSS_GB = 2.0
CHUNK = 16 << 20
POOL_BYTES = 64 << 20
SHARD_BYTES = 512 << 20
GB = 1e9


def moe_config(layers: int) -> Qwen3MoeConfig:
    return Qwen3MoeConfig(
        hidden_size=2048,
        num_attention_heads=16,
        num_key_value_heads=4,
        head_dim=128,
        intermediate_size=768,
        moe_intermediate_size=768,
        num_experts=32,
        num_experts_per_tok=4,
        num_hidden_layers=layers,
        vocab_size=32000,
        dtype="bfloat16",
    )


def checkpoint_layout(gb: float) -> tuple[Qwen3MoeConfig, dict[str, tuple[torch.dtype, tuple[int, ...]]]]:
    """The smallest config of at least ``gb`` GB, and its tensors as save_pretrained names them."""

    def layout(layers: int) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        model = empty_model(moe_config(layers))
        saved = revert_weight_conversion(model, model.state_dict())  # meta tensors: names and shapes only
        return {name: (t.dtype, tuple(t.shape)) for name, t in saved.items()}

    def nbytes(tensors: dict[str, tuple[torch.dtype, tuple[int, ...]]]) -> int:
        return sum(math.prod(shape) * dtype.itemsize for dtype, shape in tensors.values())

    one, two = nbytes(layout(1)), nbytes(layout(2))
    layers = max(1, math.ceil((gb * GB - (2 * one - two)) / (two - one)))
    return moe_config(layers), layout(layers)


def write_checkpoint(directory: Path, tensors: dict[str, tuple[torch.dtype, tuple[int, ...]]]) -> list[Path]:
    """Shards of about SHARD_BYTES plus the index, each tensor's bytes cut from a random pool in turn."""
    pool = memoryview(torch.randint(0, 256, (POOL_BYTES,), dtype=torch.uint8).numpy())
    shards: list[list[str]] = [[]]
    size = 0
    for name in sorted(tensors, key=dot_natural_key):
        dtype, shape = tensors[name]
        nbytes = math.prod(shape) * dtype.itemsize
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    files, weight_map, cursor = [], {}, 0
    for number, names in enumerate(shards, 1):
        path = directory / f"model-{number:05d}-of-{len(shards):05d}.safetensors"
        header, placements = encode_header([(name, *tensors[name]) for name in names], {})
        with path.open("wb") as out:
            out.write(header)
            for placement in placements:  # in file order
                left = placement.nbytes
                while left:
                    start = cursor % POOL_BYTES
                    piece = pool[start : start + min(left, POOL_BYTES - start)]
                    out.write(piece)
                    left -= len(piece)
                    cursor += len(piece) + 4099  # an odd stride, so that tensors differ
        weight_map.update(dict.fromkeys(names, path.name))
        files.append(path)
    (directory / INDEX_NAME).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return files


def read_all(files: list[Path]) -> int:
    buffer = memoryview(bytearray(CHUNK))
    total = 0
    for path in files:
        with path.open("rb", buffering=0) as source:
            while n := source.readinto(buffer):
                total += n
    return total


def write_ceiling(directory: Path, nbytes: int, files: int) -> float:
    """Seconds to write ``nbytes`` of fresh data to ``files`` new files, plainly and sequentially."""
    buffer = memoryview(bytearray(CHUNK))
    start = time.perf_counter()
    for number in range(files):
        with (directory / f"plain{number}.bin").open("wb", buffering=0) as out:
            left = nbytes // files
            while left:
                left -= out.write(buffer[: min(left, CHUNK)])
    seconds = time.perf_counter() - start
    for number in range(files):
        (directory / f"plain{number}.bin").unlink()
    return seconds


def sha256_rate() -> float:
    """GB/s of hashlib's sha256 on one core, over data already in memory."""
    buffer = memoryview(bytearray(CHUNK))
    digest = hashlib.sha256()
    start = time.perf_counter()
    for _ in range(32):
        digest.update(buffer)
    return 32 * CHUNK / GB / (time.perf_counter() - start)


def two_a_two_f(directory: Path, names: list[str]) -> list[TargetFile]:
    experts = [name for name in names if ".mlp.experts." in name]
    rest = [name for name in names if name not in experts]
    attention = [TargetFile(directory / f"attn{r}.safetensors", [TargetTensor(n) for n in rest]) for r in range(2)]
    ffn = [
        TargetFile(
            directory / f"ffn{r}.safetensors", [TargetTensor(n, ShardSlice(0, part=r, parts=2)) for n in experts]
        )
        for r in range(2)
    ]
    return attention + ffn


def spot_check(source: Path, files: list[TargetFile], experts: int, digest_of_attn0: str) -> None:
    """Compare a few written tensors with the checkpoint bytes, and one file's digest with a rehash."""
    index = json.loads((source / INDEX_NAME).read_text())["weight_map"]

    def original(name: str) -> torch.Tensor:
        with safe_open(source / index[name], framework="pt") as handle:
            return handle.get_tensor(name).view(torch.int16)

    half = experts // 2
    with safe_open(files[3].path, framework="pt") as ffn1:  # rank 1 holds experts half..experts-1
        gate_up = ffn1.get_tensor("model.layers.0.mlp.experts.gate_up_proj").view(torch.int16)
        rows = gate_up.shape[1] // 2
        assert torch.equal(gate_up[0, :rows], original(f"model.layers.0.mlp.experts.{half}.gate_proj.weight"))
        assert torch.equal(gate_up[-1, rows:], original(f"model.layers.0.mlp.experts.{experts - 1}.up_proj.weight"))
    with safe_open(files[0].path, framework="pt") as attn0:
        name = "model.layers.0.self_attn.o_proj.weight"
        assert torch.equal(attn0.get_tensor(name).view(torch.int16), original(name))
    assert hashlib.sha256(files[0].path.read_bytes()).hexdigest() == digest_of_attn0


def evict(files: list[Path]) -> None:
    """Drop the files' pages from the page cache, so that the next read comes from disk."""
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def peak_rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GB  # ru_maxrss is in KiB on Linux


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gb", type=float, default=4.0, help="source checkpoint size in GB (default 4)")
    parser.add_argument("--dir", type=Path, default=None, help="where to make the temporary directory")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="afdc-bench-reshard-", dir=args.dir))
    try:
        source, out = work / "source", work / "out"
        source.mkdir()
        out.mkdir()
        config, tensors = checkpoint_layout(args.gb)
        start = time.perf_counter()
        shards = write_checkpoint(source, tensors)
        source_bytes = sum(path.stat().st_size for path in shards)
        print(
            f"source: {source_bytes / GB:.2f} GB bf16, {len(tensors)} tensors in {len(shards)} shards "
            f"({config.num_hidden_layers} layers x {config.num_experts} experts), written in "
            f"{time.perf_counter() - start:.1f} s; peak RSS so far {peak_rss_gb():.2f} GB",
            flush=True,
        )

        os.sync()  # no phase pays for the previous one's writeback (dirty pages are throttled)
        evict(shards)
        start = time.perf_counter()
        read_bytes = read_all(shards)
        read_s = time.perf_counter() - start

        model = empty_model(config)
        files = two_a_two_f(out, list(model.state_dict()))
        evict(shards)
        start = time.perf_counter()
        digests = reshard(source, model, files)
        reshard_s = time.perf_counter() - start
        written = sum(digest.size for digest in digests.values())
        rss = peak_rss_gb()
        spot_check(source, files, config.num_experts, digests[files[0].path].sha256)
        for file in files:
            file.path.unlink()
        os.sync()
        plain_s = write_ceiling(out, written, len(files))

        read_rate, reshard_rate = read_bytes / GB / read_s, written / GB / reshard_s
        ratio = reshard_rate / read_rate
        print("page cache: source files evicted before (a) and before (b): both read from disk; (b) writes")
        print("            into the page cache (the kernel flushes it to disk in the background; no fsync)")
        print(f"(a) sequential read     {read_bytes / GB:6.2f} GB in {read_s:6.2f} s = {read_rate:5.2f} GB/s")
        print(
            f"(b) reshard 2A2F        {written / GB:6.2f} GB written in {reshard_s:6.2f} s = {reshard_rate:5.2f} GB/s"
            f" written ({source_bytes / GB / reshard_s:.2f} GB/s of source), 4 files, sha256 included"
        )
        print(
            f"(c) for scale: a plain write of {written / GB:.2f} GB to new files runs at {written / GB / plain_s:.2f}"
            f" GB/s, sha256 alone at {sha256_rate():.2f} GB/s per core ({os.cpu_count()} cores)"
        )
        verdict = "meets" if ratio >= TARGET_RATIO else "MISSES"
        print(f"ratio reshard/read      {ratio:.2f} ({verdict} target >= {TARGET_RATIO})")
        rss_verdict = "meets" if rss < TARGET_RSS_GB else "MISSES"
        print(f"peak RSS                {rss:.2f} GB ({rss_verdict} target < {TARGET_RSS_GB} GB)")
        print("spot check: expert slices, a replicated tensor and one file's sha256 match the checkpoint")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
