"""One attention rank: its program, its micro-batches, and its way to the FFN side.

Both drivers of the attention side use it: :class:`afdc.runtime.model.DisaggregatedModel`
(a batch of rows, Hugging Face style) and the vLLM worker (a flat batch of scheduled tokens
over a paged KV cache). A step's micro-batches run concurrently in threads, each with its own
connector and KV-cache context, so that while one waits for an FFN layer's result the next
computes its attention (ping-pong).
"""

from __future__ import annotations

import contextlib
import functools
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

import torch

from afdc.runtime import connector as connectors
from afdc.runtime import kv_cache
from afdc.runtime.exchange import AttentionEndpoint, RemoteConnector
from afdc.runtime.programs import AttentionProgram, FFNProgram, combine
from afdc.runtime.tensor_parallel import TensorParallelAttention
from afdc.segment import Dispatch


@dataclass
class MicroBatch:
    input_ids: torch.Tensor  # [b, s]
    attention_mask: torch.Tensor  # [b, kv]
    position_ids: torch.Tensor  # [b, s]
    cache: Any = None  # the KV-cache context its attention ops use (None: attend within the call)


def run_concurrently(pool: ThreadPoolExecutor | None, calls: list) -> tuple[list, ThreadPoolExecutor | None]:
    """Run ``calls`` in threads; every call is done (or failed) before any error is raised.

    Returns the results and the pool, grown if it had fewer workers than calls."""
    if len(calls) == 1:
        return [calls[0]()], pool
    if pool is None or pool._max_workers < len(calls):
        pool = ThreadPoolExecutor(len(calls), thread_name_prefix="afdc-mb")
    futures = [pool.submit(c) for c in calls]
    wait(futures)
    return [f.result() for f in futures], pool


class AttentionRank:
    """``ffn``: the FFN ranks' programs, run in-process until :attr:`endpoint` is set."""

    def __init__(
        self,
        rank: int,
        program: AttentionProgram | TensorParallelAttention,
        ffn: list[FFNProgram],
        dispatch: list[Dispatch],
        beside: bool = False,
    ):
        self.rank = rank
        self.beside = beside  # other attention ranks run in threads of this process
        self.program = program
        self.ffn = ffn
        self.dispatch = dispatch  # per FFN layer
        self.endpoint: AttentionEndpoint | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._streams: list[torch.cuda.Stream] = []

    def begin_step(self) -> int:
        return self.endpoint.begin_step() if self.endpoint is not None else 0

    def run(self, step: int, batches: list[MicroBatch]) -> tuple[list, connectors.Traffic]:
        """The program's outputs for each micro-batch of step ``step`` (from :meth:`begin_step`),
        and what crossed the cut."""

        # the only thread of the process that computes: its waits may poll without sleeping
        alone = len(batches) == 1 and not self.beside and not isinstance(self.program, TensorParallelAttention)
        if self.endpoint is not None:
            self.endpoint.announce(step, [b.input_ids.numel() for b in batches])
        streams = self._streams_for(batches)

        def one(mb: int, batch: MicroBatch):
            if self.endpoint is None:
                link = connectors.LoopbackConnector(functools.partial(combine, self.ffn))
            else:
                link = RemoteConnector(self.endpoint, step, mb, batch.input_ids.numel(), self.dispatch, spin=alone)
            on_stream = torch.cuda.stream(streams[mb]) if streams else contextlib.nullcontext()
            with torch.no_grad(), on_stream, connectors.active(link), kv_cache.active(batch.cache):
                out = self.program.body(batch.input_ids, batch.attention_mask, batch.position_ids)
            return out, link.traffic

        results, self._pool = run_concurrently(self._pool, [functools.partial(one, *b) for b in enumerate(batches)])
        for s in streams:  # the head reads every micro-batch's rows
            torch.cuda.current_stream(s.device).wait_stream(s)
        with torch.no_grad():  # the LM head once over every micro-batch's rows: it reads its weight once
            outputs = self.program.finish([out for out, _ in results])
        return outputs, connectors.Traffic.total([t for _, t in results])

    def _streams_for(self, batches: list[MicroBatch]) -> list[torch.cuda.Stream]:
        """On a GPU, a CUDA stream per micro-batch, each after the work queued so far: a transport
        waits for its own copies on the current stream, which must not make one micro-batch wait
        for the other's kernels (their overlap is the point). On a CPU or for one micro-batch, none."""
        device = batches[0].input_ids.device
        if device.type != "cuda" or len(batches) == 1:
            return []
        while len(self._streams) < len(batches):
            self._streams.append(torch.cuda.Stream(device))
        streams = self._streams[: len(batches)]
        for s in streams:
            s.wait_stream(torch.cuda.current_stream(device))
        return streams

    def close(self) -> None:
        if self.endpoint is not None:
            self.endpoint.close()
            self.endpoint = None
