"""FFN segments at static shapes: token counts padded to buckets, on a GPU each bucket a CUDA graph.

An FFN server sees ever new token counts (a layer's batch is the tokens of every attention rank
and micro-batch in the step), while an FFN segment's tokens are independent rows (an MLP, or a
MoE routing each token on its own). So a batch of T tokens can run as the next bucket B >= T, a
power of two, with B - T zero rows added and the first T rows of each output kept: the segment
sees a few shapes only. On a GPU each (segment, bucket) is then captured once in a CUDA graph and
replayed, one launch instead of the segment's dozens of kernels, which in decode cost more than
their math. On a CPU the batches are padded the same way without graphs (the tests check that
the padded rows change no real row).

A segment whose inputs are not all one row per token (a layout that is not token-major) is not
padded; nor is a batch above the largest bucket. A bucket whose capture fails (an op that cannot
be captured, such as a host sync) runs padded without a graph, said once in the log.

The graphs are captured on first use of a bucket, replayed under a lock (their input and output
buffers are shared), and their outputs copied out before the next replay can overwrite them.
A graph replays the weights it was captured with, and one segment runs every layer of its shape,
so a graph is kept per bucket *and* layer's weights. Run on one H200: greedy tokens equal to the
monolith's (``benchmarks/bench_gpu.py``); the CPU tests cover the padding, not the graphs.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable

import torch

from afdc.segment import TokenLayout, as_rows, at_tokens, token_major

log = logging.getLogger("afdc.static_shapes")

Run = Callable[..., tuple | list]  # (weights..., inputs..., rank) -> outputs


def bucket(tokens: int, largest: int) -> int | None:
    """The bucket a batch of ``tokens`` runs as: the next power of two, None above ``largest``."""
    if tokens > largest:
        return None
    return 1 << max(tokens - 1, 0).bit_length()


def paddable(layouts: list[TokenLayout | None]) -> bool:
    """Whether a segment with these input layouts can run at a padded token count."""
    return bool(layouts) and all(token_major(lay) for lay in layouts)


class CapturedGraph:
    """``run`` over static input buffers captured in one CUDA graph (warmed up first, off the
    capturing stream: lowering, the allocator); called, it copies its inputs into the buffers
    (unless they are them already), replays, and returns the graph's own output tensors, which
    the next replay overwrites. An input that is not a tensor (a size) is a constant of the graph."""

    def __init__(self, run: Callable[..., tuple | list], shaped: list, pool):
        self.inputs = [torch.zeros_like(x) if isinstance(x, torch.Tensor) else x for x in shaped]
        device = next(x.device for x in shaped if isinstance(x, torch.Tensor))
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                run(*self.inputs)
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.outputs = list(run(*self.inputs))

    def __call__(self, shaped: list) -> list[torch.Tensor]:
        for buffer, x in zip(self.inputs, shaped, strict=True):
            if isinstance(x, torch.Tensor) and x.data_ptr() != buffer.data_ptr():
                buffer.copy_(x)
        self.graph.replay()
        return self.outputs


class StaticShapes:
    """Runs one segment at bucketed token counts (:func:`bucket`), with CUDA graphs where ``graphs``."""

    def __init__(self, run: Run, layouts: list[TokenLayout], largest: int, graphs: bool, name: str):
        self.run = run
        self.layouts = layouts
        self.largest = largest
        self.graphs = graphs
        self.name = name
        # (bucket, the weights' addresses) -> its graph (None: its capture failed). A graph replays the
        # addresses it was captured with, and one segment serves every layer of its shape.
        self._captured: dict[tuple[int, tuple[int, ...]], CapturedGraph | None] = {}
        self._pool = None
        self._lock = threading.Lock()

    def __getstate__(self):  # a program is sent to its server process before it runs
        return {"run": self.run, "layouts": self.layouts, "largest": self.largest, "graphs": self.graphs,
                "name": self.name}

    def __setstate__(self, state):
        self.__init__(**state)

    def rows(self, weights: list[torch.Tensor], inputs: list[torch.Tensor], rank: int, tokens: int):
        """The segment's outputs for ``inputs`` of ``tokens`` tokens, each as ``[tokens, per-token]``."""
        size = bucket(tokens, self.largest)
        if size is None:
            return [as_rows(o, tokens) for o in self.run(*weights, *inputs, rank)]
        shaped = [self._padded(x, lay, tokens, size) for x, lay in zip(inputs, self.layouts, strict=True)]
        if not self.graphs:
            return [as_rows(o, size)[:tokens] for o in self.run(*weights, *shaped, rank)]
        with self._lock:
            graph = self._graph(size, weights, shaped, rank)
            outputs = graph(shaped) if graph is not None else self.run(*weights, *shaped, rank)
            return [as_rows(o, size)[:tokens].clone() for o in outputs]  # the next replay overwrites them

    @staticmethod
    def _padded(x: torch.Tensor, layout: TokenLayout, tokens: int, size: int) -> torch.Tensor:
        if size == tokens:
            return x
        per_token = math.prod(abs(d) for d in layout)
        padded = x.new_zeros(size, per_token)
        padded[:tokens] = x.reshape(tokens, per_token)
        return padded.reshape(at_tokens(layout, size))

    def _graph(
        self, size: int, weights: list[torch.Tensor], shaped: list[torch.Tensor], rank: int
    ) -> CapturedGraph | None:
        key = (size, tuple(w.data_ptr() for w in weights))
        if key not in self._captured:
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            try:
                self._captured[key] = CapturedGraph(lambda *xs: self.run(*weights, *xs, rank), shaped, self._pool)
            except RuntimeError as err:
                if all(k[0] != size for k in self._captured):  # said once per bucket, not per layer
                    log.warning("%s: %d-token batches run without a CUDA graph, its capture failed: %s",
                                self.name, size, str(err).splitlines()[0])  # fmt: skip
                self._captured[key] = None
        return self._captured[key]
