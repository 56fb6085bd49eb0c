"""Stream a checkpoint into per-rank safetensors files, each holding only its rank's slices.

Each output file's header (names, dtypes, shapes, offsets) is known before any weight is read: the
shapes come from the model built on the meta device. Its data regions are then filled in place as
the source regions arrive: a fused target tensor is assembled from many checkpoint tensors, and each
one's contiguous runs are written straight at their offsets, so no full tensor, let alone the model,
is ever held in memory. Files are written in parallel, one per worker thread (the heavy parts,
copies into the page cache and hashing, run outside the GIL).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import os
import struct
import threading
from collections.abc import Collection, Iterator, Mapping, Sequence
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel

from afdc.artifact.checkpoint import DTYPES, Checkpoint, Layout, Piece, SourceReader, resolve
from afdc.quant.stored import StoredTensor
from afdc.segment import RowView, ShardSlice

DTYPE_CODES = {dtype: code for code, dtype in DTYPES.items()}
WORKERS = min(4, os.cpu_count() or 1)  # file writes are memory-bound: more threads than this only contend
_READBACK_CHUNK = 16 << 20


@dataclass(frozen=True)
class TargetTensor:
    """One tensor of a rank file: a model state_dict name and the rank's slice of it."""

    name: str
    slice: ShardSlice = field(default_factory=ShardSlice)
    view: RowView | None = None  # the programs read the stored tensor's rows as this view (slice is of it)


@dataclass
class TargetFile:
    """One rank's safetensors file. ``metadata`` goes into the header's ``__metadata__`` map."""

    path: Path
    tensors: list[TargetTensor]
    metadata: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class FileDigest:
    sha256: str
    size: int  # bytes


# -- the safetensors format ------------------------------------------------------------------------


@dataclass(frozen=True)
class Placement:
    """Where one tensor's bytes go in a safetensors file (``offset`` counts from the file's start)."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int


def encode_header(
    tensors: Sequence[tuple[str, torch.dtype, tuple[int, ...]]], metadata: Mapping[str, str]
) -> tuple[bytes, list[Placement]]:
    """A safetensors file's leading bytes for these tensors, and where each one's data goes after them.

    Data is laid out by decreasing element size, as safetensors itself does: with the header padded to
    a multiple of 8 bytes, every tensor then starts aligned to its element size.
    """
    header: dict[str, object] = {"__metadata__": {"format": "pt", **metadata}}
    spans = []
    begin = 0
    for name, dtype, shape in sorted(tensors, key=lambda tensor: -tensor[1].itemsize):
        nbytes = math.prod(shape) * dtype.itemsize
        header[name] = {"dtype": DTYPE_CODES[dtype], "shape": list(shape), "data_offsets": [begin, begin + nbytes]}
        spans.append((name, dtype, shape, begin, nbytes))
        begin += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    prefix = struct.pack("<Q", len(text)) + text
    return prefix, [Placement(name, dtype, shape, len(prefix) + start, n) for name, dtype, shape, start, n in spans]


class _HashingWriter:
    """Writes a file at arbitrary offsets while hashing it front to back.

    Bytes that land at the hashed frontier are hashed from memory as they are written; bytes that land
    beyond it are hashed once the gap before them is filled, read back from the file (the page cache).
    """

    def __init__(self, fd: int, size: int):
        self._fd, self._size = fd, size
        self._sha = hashlib.sha256()
        self._hashed = 0
        self._ahead: dict[int, int] = {}  # start -> end of written runs beyond the frontier

    def write(self, offset: int, data: bytes | memoryview) -> None:
        view = memoryview(data)
        if not view.nbytes:
            return
        done = 0
        while done < view.nbytes:  # a regular file takes it all at once short of errors, but pwrite may not
            done += os.pwrite(self._fd, view[done:], offset + done)
        if offset != self._hashed:
            self._ahead[offset] = offset + view.nbytes
            return
        self._sha.update(view)
        self._hashed += view.nbytes
        while (end := self._ahead.pop(self._hashed, None)) is not None:
            for start in range(self._hashed, end, _READBACK_CHUNK):
                self._sha.update(os.pread(self._fd, min(_READBACK_CHUNK, end - start), start))
            self._hashed = end

    def digest(self) -> FileDigest:
        if self._hashed != self._size or self._ahead:
            raise RuntimeError(f"only {self._hashed} of {self._size} bytes were written in sequence")
        return FileDigest(self._sha.hexdigest(), self._size)


# -- planning --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Entry:
    placement: Placement
    layout: Layout  # of the rank's local tensor: its elements those of placement.shape, in row-major order


@dataclass(frozen=True)
class _FilePlan:
    path: Path
    header: bytes
    entries: tuple[_Entry, ...]  # in file order
    size: int

    @property
    def data_bytes(self) -> int:
        return self.size - len(self.header)


def _output_dtype(source: torch.dtype, requested: torch.dtype | None) -> torch.dtype:
    # Only 16-bit and wider floats are cast. Integer and boolean buffers keep their values exactly, and
    # float8 weights mean something only with their scales, which a cast would silently drop.
    castable = source.is_floating_point and source.itemsize >= 2
    return requested if requested is not None and castable else source


def _plan_file(
    file: TargetFile, layouts: dict[str, Layout], checkpoint: Checkpoint, dtype: torch.dtype | None,
    keep: Collection[str] = (),
) -> _FilePlan:
    names = [tensor.name for tensor in file.tensors]
    if len(set(names)) != len(names):
        raise ValueError(f"{file.path}: a tensor name appears twice")
    local: dict[str, Layout] = {}
    specs = []
    for tensor in file.tensors:
        full = layouts[tensor.name]
        if tensor.view is not None:  # the view's rows: the same bytes, read as the view's shape
            rank = full.take(0, tensor.view.stored_ranges(tensor.slice))
            shape = (rank.shape[0] // tensor.view.block, *tensor.view.shape[1:])
        else:
            rank = full if tensor.slice.dim is None else full.take(tensor.slice.dim, tensor.slice.index(full.shape))
            shape = rank.shape
        local[tensor.name] = rank
        source_dtype = checkpoint.tensors[full.pieces[0].key].dtype
        # a quantized parameter's tensors (scales included) mean something only as stored
        specs.append((tensor.name, source_dtype if tensor.name in keep else _output_dtype(source_dtype, dtype), shape))
    header, placements = encode_header(specs, file.metadata)
    entries = tuple(_Entry(placement, local[placement.name]) for placement in placements)
    size = placements[-1].offset + placements[-1].nbytes if placements else len(header)
    return _FilePlan(Path(file.path), header, entries, size)


# -- writing ---------------------------------------------------------------------------------------


def _runs(shape: tuple[int, ...], piece: Piece) -> Iterator[tuple[int, int]]:
    """(element offset, element count) of each contiguous run of ``piece``'s box in a row-major tensor.

    The runs come in order, so they match consecutive stretches of the box's own contiguous data.
    """
    inner = len(shape) - 1  # the innermost axis along which the box does not span the whole tensor
    while inner >= 0 and piece.dst_start[inner] == 0 and piece.shape[inner] == shape[inner]:
        inner -= 1
    if inner < 0:
        yield 0, math.prod(shape)
        return
    strides = [math.prod(shape[axis + 1 :]) for axis in range(len(shape))]
    length = piece.shape[inner] * strides[inner]
    base = piece.dst_start[inner] * strides[inner]
    outer = [range(start, start + size) for start, size in zip(piece.dst_start[:inner], piece.shape[:inner])]
    for index in itertools.product(*outer):
        yield base + sum(i * stride for i, stride in zip(index, strides)), length


class _Progress:
    """A byte counter shared by the worker threads."""

    def __init__(self, total: int, enabled: bool):
        self._bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="reshard", disable=not enabled)
        self._lock = threading.Lock()

    def advance(self, nbytes: int) -> None:
        with self._lock:
            self._bar.update(nbytes)

    def close(self) -> None:
        self._bar.close()


def _write_entry(writer: _HashingWriter, reader: SourceReader, entry: _Entry, progress: _Progress) -> None:
    placement, itemsize = entry.placement, entry.placement.dtype.itemsize
    # Pieces in box order, so that in the usual layouts every run lands at the hashed frontier.
    for piece in sorted(entry.layout.pieces, key=lambda piece: piece.dst_start):
        box = piece.arrange(reader.read(piece.key, piece.source_index()))
        data = memoryview(box.to(placement.dtype).contiguous().reshape(-1).view(torch.uint8).numpy())
        position = 0
        for start, count in _runs(entry.layout.shape, piece):
            writer.write(placement.offset + start * itemsize, data[position : position + count * itemsize])
            position += count * itemsize
        progress.advance(data.nbytes)


def _write_file(
    plan: _FilePlan, checkpoint: Checkpoint, progress: _Progress, stop: threading.Event
) -> FileDigest | None:
    # No O_TRUNC: truncating an existing file to 0 makes ext4 flush it on close (its replace-via-truncate
    # heuristic). Setting the final size is enough, as every byte is then rewritten (digest() checks).
    fd = os.open(plan.path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        os.ftruncate(fd, plan.size)
        writer = _HashingWriter(fd, plan.size)
        writer.write(0, plan.header)
        with SourceReader(checkpoint) as reader:
            for entry in plan.entries:
                if stop.is_set():  # another file failed: its error is what the caller sees
                    return None
                _write_entry(writer, reader, entry, progress)
        return writer.digest()
    finally:
        os.close(fd)


def reshard(
    checkpoint: str | Path,
    model: PreTrainedModel,
    files: list[TargetFile],
    dtype: torch.dtype | None = None,
    progress: bool = True,
    stored: Mapping[str, StoredTensor] | None = None,
) -> dict[Path, FileDigest]:
    """Stream the checkpoint into the target files; returns sha256 + byte size per written file.

    ``model`` (on the meta device) gives the target names' full shapes and transformers' conversion
    mapping from checkpoint names. Tensors keep the checkpoint's dtype unless ``dtype`` is given: it
    casts 16-bit and wider floats as they are written (float8 and integer tensors stay as they are).
    ``stored`` are a quantized checkpoint's tensors (data, scales) by artifact name: read through
    the parameter's own conversion and never cast.
    Raises CheckpointError (an AfdcError) when the checkpoint is absent or corrupt, lacks target
    tensors, or converts them in a way that cannot be streamed. Files are written at the given paths;
    on error, some may be left partly written.
    """
    paths = [Path(file.path) for file in files]
    if len(set(paths)) != len(paths):
        raise ValueError("two target files share a path")
    source = Checkpoint.discover(checkpoint)
    stored = stored or {}
    layouts = resolve(source, model, [tensor.name for file in files for tensor in file.tensors], stored)
    plans = [_plan_file(file, layouts, source, dtype, stored.keys()) for file in files]
    counter = _Progress(sum(plan.data_bytes for plan in plans), progress)
    stop = threading.Event()
    try:
        with ThreadPoolExecutor(max(1, min(WORKERS, len(plans)))) as pool:
            try:
                # Largest files first, so that the last one to finish is a small one.
                futures = {
                    plan.path: pool.submit(_write_file, plan, source, counter, stop)
                    for plan in sorted(plans, key=lambda plan: -plan.size)
                }
                wait(futures.values(), return_when=FIRST_EXCEPTION)
                failed = next((future for future in futures.values() if future.done() and future.exception()), None)
                if failed is not None:
                    raise failed.exception()
                return {plan.path: futures[plan.path].result() for plan in plans}
            except BaseException:
                stop.set()  # the running writers stop at their next tensor, the queued ones never start
                pool.shutdown(cancel_futures=True)
                raise
    finally:
        counter.close()
