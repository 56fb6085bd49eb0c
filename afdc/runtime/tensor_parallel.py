"""Tensor parallelism inside an attention rank (``--attn-tp N``).

An attention rank of such a plan is N TP ranks, each running the TP-sharded attention program
(:func:`afdc.partition.attention_tp.shard_attention`) on the same tokens with its own share of the heads,
of the weights and of the KV cache. They meet in ``afdc::tp_all_reduce`` after each row-split
projection, over a gloo group of their own. Only TP rank 0 talks to the FFN side: every TP rank
holds the same (whole) FFN inputs, so rank 0 sends them, and broadcasts each FFN result to the
others (:class:`TensorParallelConnector`). To the FFN side an attention rank looks the same at
any N.

Here the N TP ranks are threads of the attention rank's process (:class:`TensorParallelAttention`);
micro-batches run concurrently, so each running step takes a set of groups of its own from a pool,
which keeps every group's collectives in one order on all its ranks.
"""

from __future__ import annotations

import datetime
import itertools
import queue
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree

from afdc.errors import AfdcError
from afdc.ops.context import group_active
from afdc.runtime import kv_cache
from afdc.runtime import link as connectors


@dataclass(frozen=True)
class TPGroup:
    """One TP rank's membership in its attention rank's group."""

    rank: int
    size: int
    pg: dist.ProcessGroup
    timeout: float  # seconds a collective may wait for the other TP ranks

    def all_reduce(self, tensor: torch.Tensor) -> None:
        self.pg.allreduce([tensor]).wait(datetime.timedelta(seconds=self.timeout))

    def broadcast(self, tensor: torch.Tensor) -> None:
        """From TP rank 0, in place; any dtype (sent as bytes)."""
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        self.pg.broadcast([tensor.view(-1).view(torch.uint8)], opts).wait(datetime.timedelta(seconds=self.timeout))


class TensorParallelConnector(connectors.Connector):
    """A TP rank's connector: rank 0 forwards to the attention rank's real connector (``inner``)
    and broadcasts each result; the other ranks send nothing and take the broadcast.

    Before each result rank 0 broadcasts whether it has one, so that when the FFN side fails the
    other ranks raise at once instead of waiting out the group's timeout.
    """

    def __init__(self, group: TPGroup, inner: connectors.Connector | None):
        super().__init__()
        self.group, self.inner = group, inner
        self._error: BaseException | None = None

    def send(self, layer: int, tensors: list[torch.Tensor]) -> None:
        if self.inner is None or self._error is not None:
            return
        try:
            self.inner.send(layer, tensors)
        except Exception as err:  # reported at the matching recv, where the other ranks wait
            self._error = err

    def recv(self, layer: int, index: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        status = torch.zeros(1, dtype=torch.int64)
        out = None
        if self.inner is not None:
            if self._error is None:
                try:
                    out = self.inner.recv(layer, index, shape, dtype).contiguous()
                except Exception as err:
                    self._error = err
            status.fill_(self._error is not None)
        self.group.broadcast(status)
        if self._error is not None:
            raise self._error
        if status.item():
            raise AfdcError(f"TP rank 0 of this attention rank got no result for FFN layer {layer} (it raised why)")
        if out is None:
            out = torch.empty(shape, dtype=dtype)
        self.group.broadcast(out)
        return out


def shard_cache(cache, tp_rank: int):
    """TP rank ``tp_rank``'s own KV cache within an attention rank's ``cache`` (its heads only)."""
    if cache is None:
        return None
    shard = getattr(cache, "tp_shard", None)
    if shard is None:
        raise AfdcError(f"{type(cache).__name__} has no per-TP-rank caches; attention TP needs one (e.g. KVCache)")
    return shard(tp_rank)


class _GroupPool:
    """Sets of ``size`` in-process gloo groups (one group member per TP rank), reused across steps."""

    def __init__(self, size: int):
        self.size = size
        self._store = dist.HashStore()
        self._free: queue.SimpleQueue[list[TPGroup]] = queue.SimpleQueue()
        self._made = itertools.count()

    def take(self, timeout: float, pool: ThreadPoolExecutor) -> list[TPGroup]:
        try:
            return self._free.get_nowait()
        except queue.Empty:
            pass
        store = dist.PrefixStore(f"set{next(self._made)}", self._store)
        limit = datetime.timedelta(seconds=timeout)

        def member(rank: int) -> TPGroup:  # every member must join at once
            return TPGroup(rank, self.size, dist.ProcessGroupGloo(store, rank, self.size, limit), timeout)

        futures = [pool.submit(member, r) for r in range(1, self.size)]
        return [member(0), *(f.result() for f in futures)]

    def give_back(self, groups: list[TPGroup]) -> None:
        self._free.put(groups)


class TensorParallelAttention(torch.nn.Module):
    """An attention rank as ``len(shards)`` TP ranks (threads), each running its shard's program.

    A drop-in for :class:`~afdc.runtime.programs.AttentionProgram`: called under the attention
    rank's connector and KV cache, it returns TP rank 0's outputs (every TP rank's are the same).
    ``timeout`` bounds every collective, so it must cover rank 0's wait for an FFN result.
    """

    def __init__(self, shards: list, timeout: float = 120.0):
        super().__init__()
        if len(shards) < 2:
            raise ValueError("tensor parallelism needs at least two shards")
        self.shards = torch.nn.ModuleList(shards)
        self._pool = ThreadPoolExecutor(max_workers=1024, thread_name_prefix="afdc-tp")  # threads made on demand
        self.timeout = timeout

    @property
    def timeout(self) -> float:
        return self._timeout

    @timeout.setter
    def timeout(self, seconds: float) -> None:
        """Groups are made with their timeout: a new one takes new groups."""
        self._timeout = seconds
        self._groups = _GroupPool(len(self.shards))

    @property
    def module(self) -> torch.fx.GraphModule:
        """TP rank 0's graph module (every shard runs the same graph on its own weights)."""
        return self.shards[0].module

    @property
    def out_spec(self) -> pytree.TreeSpec:
        return self.shards[0].out_spec

    def use_backend(self, backend: str) -> None:
        for shard in self.shards:
            shard.use_backend(backend)

    def parameter_names(self) -> list[str]:
        return self.shards[0].parameter_names()

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor):
        return self.finish([self.body(input_ids, attention_mask, position_ids)])[0]

    def body(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor) -> list:
        """TP rank 0's :meth:`AttentionProgram.body` outputs, every TP rank having run its shard's."""
        link, cache = connectors.current(), kv_cache.current()
        groups = self._groups.take(self._timeout, self._pool)

        def run(rank: int):
            tp_link = TensorParallelConnector(groups[rank], link if rank == 0 else None)
            with connectors.active(tp_link), kv_cache.active(shard_cache(cache, rank)), group_active(groups[rank]):
                return self.shards[rank].body(input_ids, attention_mask, position_ids)

        others: list[Future] = [self._pool.submit(run, r) for r in range(1, len(self.shards))]
        try:
            out = run(0)
        except BaseException:
            for f in others:  # the others fail fast on rank 0's broadcast, or time out
                f.exception()
            raise  # the group set may be mid-collective: it is dropped, not reused
        for f in others:
            f.result()
        self._groups.give_back(groups)
        return out

    def finish(self, bodies: list[list]) -> list:
        """The LM head stays whole on every TP rank: rank 0 alone runs it."""
        return self.shards[0].finish(bodies)
