"""One attention rank: its program, its micro-batches, and its way to the FFN side.

Both drivers of the attention side use it: :class:`afdc.runtime.model.DisaggregatedModel`
(a batch of rows, Hugging Face style) and the vLLM worker (a flat batch of scheduled tokens
over a paged KV cache). A step's micro-batches run concurrently, each with its own connector
and KV-cache context, so that while one waits for an FFN layer's result the next computes its
attention (ping-pong): in turns in one thread where the program's code can pause after a send
(:func:`_interleave`), else in threads.
"""

from __future__ import annotations

import collections
import contextlib
import functools
from collections.abc import Callable, Generator
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

import torch

from afdc.runtime import kv_cache, trace
from afdc.runtime import link as connectors
from afdc.runtime.exchange import AttentionEndpoint, RemoteConnector
from afdc.runtime.metrics import Phases
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


def _interleave(runs: list[Generator], active: Callable[[int], contextlib.AbstractContextManager]) -> list:
    """Run micro-batch generators in turns, each to its next send (:meth:`AttentionRank.run`):
    micro-batch 1 computes while micro-batch 0's layer is on the FFN side, then 0 takes its reply
    and computes its next layer while 1's is there (ping-pong). ``active(mb)`` is entered around
    each turn. As with threads, every micro-batch runs to its end or its error before the first
    error is raised (a failed exchange fails the others' next wait at once)."""
    results: list = [None] * len(runs)
    errors: list[Exception] = []
    turns = collections.deque(range(len(runs)))
    while turns:
        mb = turns.popleft()
        try:
            with active(mb):
                done, value = _resume(runs[mb])
        except Exception as err:  # raised below, once the others are done
            errors.append(err)
            continue
        if done:
            results[mb] = list(value)
        else:
            turns.append(mb)
    if errors:
        raise errors[0]
    return results


def _resume(run: Generator) -> tuple[bool, object]:
    """Run ``run`` to its next pause: (False, None), or to its end: (True, its return value)."""
    try:
        next(run)
    except StopIteration as stop:
        return True, stop.value
    return False, None


class AttentionRank:
    """``ffn``: the FFN ranks' programs, run in-process until :attr:`endpoint` is set; those runs
    are timed as phase ``ffn`` of :attr:`phases` where it is set (a served monolith's step taken
    apart like a disaggregated one's)."""

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
        self.phases: Phases | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._streams: list[torch.cuda.Stream] = []

    def begin_step(self, join_timeout: float | None = None) -> int:
        return self.endpoint.begin_step(join_timeout) if self.endpoint is not None else 0

    @trace.phase("attn.step")
    def run(self, step: int, batches: list[MicroBatch],
            program: AttentionProgram | None = None) -> tuple[list, connectors.Traffic]:
        """The program's outputs for each micro-batch of step ``step`` (from :meth:`begin_step`),
        and what crossed the cut. ``program``: another of this rank's programs whose FFN layers the
        FFN ranks serve too (a drafter's), instead of :attr:`program`.

        With FFN servers and several micro-batches, one thread interleaves them where the
        program's code can pause after each send (:meth:`AttentionProgram.body_steps`): no two
        threads take turns at the GIL for every op. Otherwise each micro-batch runs in a thread
        (in-process, that lets the FFN layers of two micro-batches compute on two cores)."""
        if self.endpoint is not None:
            self.endpoint.announce(step, [b.input_ids.numel() for b in batches])
        program = program or self.program
        runs = self._stepwise(program, batches)
        # the waits of the only thread of the process that computes may poll without sleeping
        alone = not self.beside and not isinstance(program, TensorParallelAttention)
        alone = alone and (runs is not None or len(batches) == 1)
        links = [self._link(step, mb, batch, alone) for mb, batch in enumerate(batches)]
        streams = self._streams_for(batches)

        def active(mb: int) -> contextlib.ExitStack:
            stack = contextlib.ExitStack()
            if streams:
                stack.enter_context(torch.cuda.stream(streams[mb]))
            stack.enter_context(connectors.active(links[mb]))
            stack.enter_context(kv_cache.active(batches[mb].cache))
            return stack

        if runs is not None:
            with torch.no_grad(), program.active():
                bodies = _interleave(runs, active)
        else:

            def one(mb: int, batch: MicroBatch):
                with torch.no_grad(), active(mb):
                    return program.body(batch.input_ids, batch.attention_mask, batch.position_ids)

            bodies, self._pool = run_concurrently(
                self._pool, [functools.partial(one, *b) for b in enumerate(batches)]
            )
        for s in streams:  # the head reads every micro-batch's rows
            torch.cuda.current_stream(s.device).wait_stream(s)
        with torch.no_grad():  # the LM head once over every micro-batch's rows: it reads its weight once
            outputs = program.finish(bodies)
        return outputs, connectors.Traffic.total([link.traffic for link in links])

    def _link(self, step: int, mb: int, batch: MicroBatch, spin: bool) -> connectors.Connector:
        if self.endpoint is None:
            run = self._ffn if self.phases is not None else functools.partial(combine, self.ffn)
            return connectors.LoopbackConnector(run)
        return RemoteConnector(self.endpoint, step, mb, batch.input_ids.numel(), self.dispatch, spin=spin)

    def _ffn(self, layer: int, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        with self.phases.timed("ffn"):
            return combine(self.ffn, layer, inputs)

    def _stepwise(self, program, batches: list[MicroBatch]) -> list[Generator] | None:
        """Each micro-batch's body as a generator (see :meth:`run`), or None: threads run them."""
        if self.endpoint is None or len(batches) == 1 or not isinstance(program, AttentionProgram):
            return None
        runs = [program.body_steps(b.input_ids, b.attention_mask, b.position_ids) for b in batches]
        return None if any(r is None for r in runs) else runs  # an unstarted generator needs no closing

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
