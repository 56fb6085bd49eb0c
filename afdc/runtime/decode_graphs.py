"""The attention program's decode steps at static shapes: request counts padded to buckets, on a
GPU each piece between two exchanges with the FFN side a CUDA graph per bucket.

A decode step of a serving engine is one token per request, a few dozen to hundreds of kernels
per layer on the attention side, each launched from Python: on a GPU, launch-bound. vLLM's answer
is piecewise CUDA graphs, and this is it for afdc's cut: a micro-batch of R decoding requests runs
as the next bucket B >= R (:func:`afdc.runtime.static_shapes.bucket`), its inputs and the paged
attention metadata its ops read (block table, context and sequence lengths, positions, slot
mapping, logit rows) copied into static buffers of that micro-batch and bucket. B - R padding
rows follow the real ones: token 0 at position 0 in the null block (block 0, which vLLM never
hands a request), so they write and read only that block and change no real row. The body runs
as pieces cut around each send and receive (:func:`afdc.lowering.piecewise.split_at_exchange`):
the exchange pieces talk to the connector on the host, at the real count (:class:`_RealRows`
sends the first R rows only and pads each reply back into a static buffer), so padding rows never
reach the FFN side nor cost it work; each computing piece is, on a GPU, a
:class:`~afdc.runtime.static_shapes.CapturedGraph` per (micro-batch, input shapes), captured at
first use (the worker captures every bucket at start) and then replayed; each micro-batch's
graphs share a memory pool of their own, since micro-batches replay on CUDA streams of their own.
On a CPU the same buffers, padding, pieces and dispatch run without graphs (what the tests check).

Only plain decode steps are padded: a step with prefill or draft tokens, stateful mixers, an MTP
drafter's hidden states, rows of a padded batch (indexers) or attention TP runs as it is, as does
a micro-batch above the largest bucket (said once in the log). On a GPU the graphs are used only
where decode attention runs in afdc's Triton kernel, which reads the buffers only (the PyTorch
path builds tensors sized by the step's longest sequence, which a graph would freeze); a piece
whose capture fails runs without a graph, said once.

Not yet run on a GPU: the capture and replay themselves are unchecked until then.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import threading
from collections.abc import Callable, Generator
from dataclasses import dataclass, field

import torch

from afdc.codegen.paged_attention import decode_kernel_runs
from afdc.lowering.straight_line import StraightLine
from afdc.runtime import kv_cache
from afdc.runtime.attention_rank import MicroBatch
from afdc.runtime.link import Connector
from afdc.runtime.paged import PagedBatch, kernel_paged_attention
from afdc.runtime.static_shapes import CapturedGraph, bucket
from afdc.segment import Dispatch, as_rows, at_tokens, token_major

log = logging.getLogger("afdc.decode_graphs")

# which micro-batch's buffers the pieces run on (a graph replays the addresses it captured)
_CHAIN: contextvars.ContextVar[int] = contextvars.ContextVar("afdc_decode_chain", default=0)
# the step metadata a padded PagedBatch's ops read, each a buffer of its micro-batch and bucket
_METADATA = ("block_table", "context_lens", "seq_lens", "slot_mapping", "logit_rows", "positions")


def decoding(batch: MicroBatch) -> bool:
    """Whether ``batch`` is a plain decode step over a paged cache: one token per request, no
    mixer state, no hidden states kept, every request's logits."""
    c = batch.cache
    return (
        type(c) is PagedBatch and c.max_query_len == 1 and not c.state_blocks and not c.keep_hidden
        and c.logit_rows.numel() == c.num_tokens
    )  # fmt: skip


@dataclass
class _Buffers:
    """One (micro-batch, bucket)'s static step: inputs, paged metadata, and each FFN reply."""

    input_ids: torch.Tensor  # [1, B]
    attention_mask: torch.Tensor  # [1, B] ones
    query_lens: torch.Tensor  # [B] ones
    block_table: torch.Tensor  # [B, width]
    context_lens: torch.Tensor
    seq_lens: torch.Tensor
    slot_mapping: torch.Tensor
    logit_rows: torch.Tensor
    positions: torch.Tensor  # [1, B]
    received: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)  # (layer, output) -> padded

    @classmethod
    def new(cls, size: int, width: int, device: torch.device) -> _Buffers:
        def zeros(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=torch.long, device=device)

        ones = torch.ones(size, dtype=torch.long, device=device)
        return cls(zeros(1, size), ones[None].clone(), ones, zeros(size, width), zeros(size), zeros(size),
                   zeros(size), zeros(size), zeros(1, size))  # fmt: skip

    def fill(self, batch: MicroBatch) -> MicroBatch:
        """``batch`` padded into these buffers: a PagedBatch over the same store whose metadata
        are the buffers, refilled."""
        real = batch.cache
        requests, width = real.block_table.shape
        table = torch.zeros_like(self.block_table)
        table[:requests, :width] = real.block_table
        context = torch.zeros_like(self.context_lens)
        context[:requests] = real.context_lens
        padded = PagedBatch(real.store, table, context, self.query_lens)
        for name in _METADATA:
            buffer = getattr(self, name)
            buffer.copy_(getattr(padded, name))
            setattr(padded, name, buffer)
        self.input_ids.zero_()
        self.input_ids[:, :requests] = batch.input_ids
        return MicroBatch(self.input_ids, self.attention_mask, self.positions, padded)


class _RealRows(Connector):
    """A padded micro-batch's link: sends the first ``tokens`` rows of each FFN input only, and
    pads each reply back to the bucket in the micro-batch's static reply buffer."""

    def __init__(self, inner: Connector, tokens: int, size: int, dispatch: list[Dispatch], buffers: _Buffers):
        super().__init__()
        self.traffic = inner.traffic  # what crossed is what the inner link carried
        self.inner, self.tokens, self.size, self.dispatch, self.buffers = inner, tokens, size, dispatch, buffers

    def send(self, layer: int, tensors: list[torch.Tensor]) -> None:
        layouts = self.dispatch[layer].inputs
        self.inner.send(layer, [
            as_rows(x, self.size)[:self.tokens].reshape(at_tokens(lay, self.tokens))
            for x, lay in zip(tensors, layouts, strict=True)
        ])  # fmt: skip

    def recv(self, layer: int, index: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        out = self.inner.recv(layer, index, _at_tokens(shape, self.size, self.tokens), dtype)
        key = (layer, index)
        held = self.buffers.received.get(key)
        if held is None or tuple(held.shape) != tuple(shape) or held.dtype != dtype:
            held = self.buffers.received[key] = torch.zeros(shape, dtype=dtype, device=self.buffers.input_ids.device)
        as_rows(held, self.size)[:self.tokens].copy_(as_rows(out, self.tokens))
        return held


def _at_tokens(shape: tuple[int, ...], size: int, tokens: int) -> tuple[int, ...]:
    """A reply's ``shape`` at ``size`` tokens (token-major: its first dim that is not 1 holds
    them) at ``tokens`` instead."""
    dims = list(shape)
    i = next((i for i, d in enumerate(dims) if d != 1), None)
    if size == tokens or i is None:
        return tuple(dims)
    if dims[i] % size:
        raise ValueError(f"an FFN reply of shape {tuple(shape)} is not token-major at {size} tokens")
    dims[i] = dims[i] // size * tokens
    return tuple(dims)


@dataclass
class StaticStep:
    """One step's micro-batches padded to their buckets; what :class:`AttentionRank` runs instead."""

    batches: list[MicroBatch]  # padded
    tokens: list[int]  # real tokens (requests) per micro-batch
    sizes: list[int]  # their buckets
    buffers: list[_Buffers]
    dispatch: list[Dispatch]
    runs: list[Generator]  # each micro-batch's body in pieces, pausing after each send

    def link(self, mb: int, inner: Connector) -> Connector:
        return _RealRows(inner, self.tokens[mb], self.sizes[mb], self.dispatch, self.buffers[mb])

    @contextlib.contextmanager
    def active(self, mb: int):
        token = _CHAIN.set(mb)
        try:
            yield
        finally:
            _CHAIN.reset(token)

    def real(self, mb: int, body: list) -> list:
        """A micro-batch's body outputs at its real rows (each per-token output ``[1, B, ...]``)."""
        size, tokens = self.sizes[mb], self.tokens[mb]
        if size == tokens:
            return body
        return [x[:, :tokens] if isinstance(x, torch.Tensor) and x.dim() > 1 and x.shape[:2] == (1, size) else x
                for x in body]  # fmt: skip


class DecodeGraphs:
    """An attention rank's decode steps at bucketed request counts up to ``largest`` per
    micro-batch, over block tables of at most ``width`` blocks; each piece a CUDA graph per
    bucket where ``graphs``. One per program (its pieces are its body's)."""

    def __init__(self, program, dispatch: list[Dispatch], largest: int, width: int, graphs: bool,
                 name: str = "attention decode step"):  # fmt: skip
        self.program, self.dispatch = program, dispatch
        self.largest, self.width, self.graphs, self.name = largest, width, graphs, name
        self.paddable = all(token_major(lay) for d in dispatch for lay in d.inputs)
        if not self.paddable:
            log.warning("%s: an FFN input is not one row per token; decode steps run unpadded", name)
        self._body: StraightLine | None = None
        self._buffers: dict[tuple[int, int], _Buffers] = {}  # (micro-batch, bucket)
        self._captured: dict[tuple, CapturedGraph | None] = {}
        self._pools: dict[int, tuple] = {}  # micro-batch -> its graphs' memory pool
        self._said: set[str] = set()
        self._lock = threading.Lock()

    def step(self, program, batches: list[MicroBatch]) -> StaticStep | None:
        """The step padded to its buckets, or None: it runs as it is (not a plain decode step of
        this program, a micro-batch above ``largest``, a table wider than ``width``)."""
        if not self.paddable or program is not self.program or not all(decoding(b) for b in batches):
            return None
        tokens = [b.input_ids.numel() for b in batches]
        sizes = [bucket(t, self.largest) for t in tokens]
        if None in sizes or any(b.cache.block_table.shape[1] > self.width for b in batches):
            self._say("above", "%s: micro-batches of more than %d requests (or block tables wider than %d blocks) "
                      "run unpadded, without graphs", self.name, self.largest, self.width)
            return None
        buffers = [self._buffers_for(mb, size, b.input_ids.device) for mb, (size, b) in enumerate(zip(sizes, batches))]
        padded = [buf.fill(b) for buf, b in zip(buffers, batches)]
        body = self._lowered(padded[0])
        runs = [body.steps(b.input_ids, b.attention_mask, b.position_ids) for b in padded] if body else [None]
        if None in runs:
            self._say("pieces", "%s: the program sends nothing or takes inputs of other dtypes than captured; "
                      "decode steps run unpadded", self.name)
            return None
        return StaticStep(padded, tokens, sizes, buffers, self.dispatch, runs)

    def _buffers_for(self, mb: int, size: int, device: torch.device) -> _Buffers:
        key = (mb, size)
        if key not in self._buffers:
            self._buffers[key] = _Buffers.new(size, self.width, device)
        return self._buffers[key]

    def _lowered(self, batch: MicroBatch) -> StraightLine | None:
        if self._body is None:
            with self._lock:
                if self._body is None:
                    args = (batch.input_ids, batch.attention_mask, batch.position_ids)
                    self._body = self.program.body_at_exchange(args, self._piece) or False
        return self._body or None

    def _piece(self, piece, run: Callable) -> Callable:
        if not self.graphs:
            return run

        def replayed(*args):
            graph = self._graph(piece.name, run, args)
            return graph(list(args)) if graph is not None else run(*args)

        return replayed

    def _graph(self, name: str, run: Callable, args: tuple) -> CapturedGraph | None:
        """The piece's graph for the current micro-batch and these shapes, captured at first use
        where decode attention runs in afdc's kernel (see the module's docstring)."""
        key = (name, _CHAIN.get(), tuple((tuple(a.shape), a.dtype) if isinstance(a, torch.Tensor) else a for a in args))
        if key not in self._captured:
            if not _kernel_attends(_current_paged()):
                self._say("kernel", "%s: decode attention is not afdc's kernel here; steps run padded, "
                          "without graphs", self.name)  # fmt: skip
                self._captured[key] = None
            else:
                # a memory pool per micro-batch: their pieces replay on streams of their own, at once
                chain = _CHAIN.get()
                if chain not in self._pools:
                    self._pools[chain] = torch.cuda.graph_pool_handle()
                pool = self._pools[chain]
                try:
                    self._captured[key] = CapturedGraph(run, list(args), pool)
                except RuntimeError as err:
                    self._say(name, "%s: %s runs without a CUDA graph, its capture failed: %s",
                              self.name, name, str(err).splitlines()[0])  # fmt: skip
                    self._captured[key] = None
        return self._captured[key]

    def _say(self, what: str, *message) -> None:
        if what not in self._said:
            self._said.add(what)
            log.warning(*message)


def _current_paged() -> PagedBatch | None:
    cache = kv_cache.current()
    return cache if isinstance(cache, PagedBatch) else None


def _kernel_attends(batch: PagedBatch | None) -> bool:
    """Whether ``batch``'s decode attention runs in afdc's kernel (its device, the cache's
    dtype), which reads the step's buffers only: the PyTorch path sizes tensors by the step's
    longest sequence, which a graph would freeze."""
    if batch is None or batch._kernel is not kernel_paged_attention:
        return False
    keys, values = batch.store.keys[0], batch.store.values[0]
    return decode_kernel_runs(keys, keys, values, batch.block_table, batch.seq_lens, None)
