"""The two runnable programs a partition produces, each owning only its own weights."""

from __future__ import annotations

import functools
import itertools
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from afdc.codegen import backend as backends


class _Lowered:
    """A graph module and what runs it under a backend, lowered at first use (in the process
    that runs it: FFN programs are sent to server processes before they run) and once, though
    the micro-batches' threads may all call at the same time."""

    def __init__(self, module: fx.GraphModule, name: str):
        self.module = module
        self.name = name
        self.backend = "eager"
        self._run: Callable | None = module
        self._lock = threading.Lock()

    def use(self, backend: str, device: torch.device) -> None:
        self.backend = backends.resolve(backend, device)
        self._run = self.module if self.backend == "eager" else None

    def __call__(self, *args):
        if self._run is None:
            with self._lock:
                if self._run is None:
                    self._run = backends.lower(self.module, self.backend, self.name, args)
        return self._run(*args)

    def __getstate__(self):
        return {"module": self.module, "name": self.name, "backend": self.backend}

    def __setstate__(self, state):
        self.__init__(state["module"], state["name"])
        self.backend = state["backend"]
        self._run = self.module if self.backend == "eager" else None


def device_of(module: torch.nn.Module) -> torch.device:
    """Where a module's weights are, so where it computes."""
    tensors = itertools.chain(module.parameters(), module.buffers())
    return next((t.device for t in tensors), torch.device("cpu"))


class AttentionProgram(torch.nn.Module):
    """Embeddings, attention and other mixers, the residual stream, norms and the LM head.

    Its graph sends each FFN layer's inputs and receives its outputs through the active
    connector; attention ops read and extend the active KV cache.
    """

    def __init__(self, module: fx.GraphModule, out_spec: pytree.TreeSpec):
        super().__init__()
        self.module = module
        self.out_spec = out_spec
        self._lowered = _Lowered(module, "attention program")

    @classmethod
    def from_graph(cls, graph: fx.Graph, attrs: dict[str, torch.Tensor], out_spec: pytree.TreeSpec):
        used = {n.target for n in graph.nodes if n.op == "get_attr"}
        return cls(fx.GraphModule({name: attrs[name] for name in used}, graph), out_spec)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor):
        flat = self._lowered(input_ids, attention_mask, position_ids)
        return pytree.tree_unflatten(list(flat), self.out_spec)

    def use_backend(self, backend: str) -> None:
        """Run under ``backend`` (:mod:`afdc.codegen.backend`) from the next call on; rewrite
        ``module``'s graph (as the serving passes do) before this, not after."""
        self._lowered = _Lowered(self.module, "attention program")
        self._lowered.use(backend, device_of(self.module))

    @property
    def backend(self) -> str:
        """What runs it, resolved for its device (``eager``, ``inductor`` or ``afdc``)."""
        return self._lowered.backend

    def parameter_names(self) -> list[str]:
        return [name for name, _ in self.module.named_parameters()]


@dataclass
class FFNLayer:
    segment: int
    weights: list[str]


# An input's shape at batch 1 and T tokens: an int is a fixed size, -k stands for k * T.
TokenLayout = list[int]


def _at_tokens(layout: TokenLayout, tokens: int) -> list[int]:
    return [d if d >= 0 else -d * tokens for d in layout]


def row_major(layout: TokenLayout | None) -> bool:
    """Whether a tensor of this layout is one row per token ([1, T, ...] or [T, ...]), so that a
    contiguous range of tokens is a contiguous range of rows."""
    return layout is not None and next((d for d in layout if d != 1), None) == -1


def token_major(layout: TokenLayout | None) -> bool:
    """Whether a tensor of this layout holds each token's elements together (``[T, ...]``, or a
    flat ``[k*T]`` run of k per token), so that its ``[tokens, per-token]`` view splits by token."""
    return layout is not None and next((d for d in layout if d != 1), 0) < 0


def _rows(tensor: torch.Tensor, tokens: int) -> torch.Tensor:
    """``tensor`` as ``[tokens, per-token elements]``."""
    return tensor.reshape(tokens, tensor.numel() // max(tokens, 1))


class FFNProgram(torch.nn.Module):
    """One FFN rank: the segment graphs of every FFN layer, bound to this rank's weights.

    Segment graphs take ``(weights..., inputs..., rank)``; ``reduce[segment][i]`` says how the
    attention side combines output ``i`` over the FFN ranks (``sum`` of partial results, or the
    ``first`` rank's copy of a replicated one). ``inputs[segment][i]`` is input ``i``'s token
    layout (None when it is not token-major), which lets one run serve several senders' tokens.
    """

    def __init__(
        self,
        segments: list[fx.Graph],
        layers: list[FFNLayer],
        weights: dict[str, torch.Tensor],
        reduce: list[list[str]],
        rank: int = 0,
        inputs: list[list[TokenLayout | None]] | None = None,
        routing: list[ExpertRouting | None] | None = None,
    ):
        super().__init__()
        self.segments = torch.nn.ModuleList(fx.GraphModule(torch.nn.Module(), g) for g in segments)
        self._lowered = [_Lowered(s, f"FFN segment {i}") for i, s in enumerate(self.segments)]
        self.backend = "eager"  # what use_backend asked for
        self.layers = layers
        self.reduce = reduce
        self.rank = rank
        self.inputs = inputs if inputs is not None else [[None] for _ in segments]
        self.routing = routing if routing is not None else [None for _ in segments]
        self._weights = weights
        self._parameters_owned = {n for n, w in weights.items() if isinstance(w, torch.nn.Parameter)}

    def run(self, layer: int, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        binding = self.layers[layer]
        outputs = self._lowered[binding.segment](*(self._weights[w] for w in binding.weights), *inputs, self.rank)
        return list(outputs)

    def use_backend(self, backend: str) -> None:
        """Run every segment under ``backend`` (:mod:`afdc.codegen.backend`); segments are lowered
        at their first run, on the device of this rank's weights."""
        self.backend = backend
        self._lowered = [_Lowered(s, f"FFN segment {i}") for i, s in enumerate(self.segments)]
        for lowered in self._lowered:
            lowered.use(backend, self.device)

    @property
    def device(self) -> torch.device:
        """Where this rank's weights are, so where it computes."""
        return next((w.device for w in self._weights.values()), torch.device("cpu"))

    def run_batch(self, layer: int, messages: list[list[torch.Tensor]], tokens: list[int]) -> list[list[torch.Tensor]]:
        """Run FFN layer ``layer`` once over the tokens of several messages, then split the outputs.

        This is what makes AFD pay: one FFN batch from every attention rank and micro-batch.
        Each output comes back per message as ``[tokens, per-token...]``.
        """
        layouts = self.inputs[self.layers[layer].segment]
        if len(messages) == 1 or any(lay is None for lay in layouts):
            return [self.run(layer, m) for m in messages]
        total = sum(tokens)
        batched = [
            torch.cat([m[i].reshape(t, math.prod(abs(d) for d in lay)) for m, t in zip(messages, tokens)]).reshape(
                _at_tokens(lay, total)
            )
            for i, lay in enumerate(layouts)
        ]
        outputs = [_rows(o, total) for o in self.run(layer, batched)]
        return [list(parts) for parts in zip(*(o.split(tokens) for o in outputs))]

    def dispatch(self, layer: int) -> Dispatch:
        segment = self.layers[layer].segment
        return Dispatch(tuple(self.reduce[segment]), tuple(self.inputs[segment]), self.routing[segment])

    def parameter_names(self) -> list[str]:
        return sorted(self._parameters_owned)

    def parameters_of(self, names: list[str]) -> list[torch.Tensor]:
        return [self._weights[n] for n in names]


@dataclass(frozen=True)
class ExpertRouting:
    """Which tokens an expert-parallel FFN rank needs: those choosing one of its experts.

    Set for a segment that is, output for output, one fused MoE over rows of its inputs (checked
    on its graph, :mod:`afdc.passes.expert_routing`), so a rank's result for a token that chose
    none of its experts is exactly zero and the token need not be sent. Input ``input`` holds each
    token's expert ids, or with ``top_k`` its router scores, whose ``top_k`` largest are chosen;
    rank r holds experts ``[r * per_rank, (r + 1) * per_rank)``. With ``owner``, the segment also
    adds a term every rank can compute (a shared expert held whole) on the rows its input
    ``owner`` marks: the attention side marks each token on exactly one rank it is sent to.
    """

    input: int
    per_rank: int
    top_k: int | None = None
    owner: int | None = None

    def ranks_of(self, key: torch.Tensor, ranks: int) -> torch.Tensor:
        """``[tokens, ranks]``: whether each token needs each rank. With scores, every expert
        scoring at least the k-th largest counts as chosen: a superset of any tie-break the FFN
        side's own top-k makes, and a rank sent a token it does not use adds zero for it."""
        if self.top_k is None:
            hit = torch.zeros(key.shape[0], ranks, dtype=torch.bool, device=key.device)
            return hit.scatter_(1, (key.long() // self.per_rank).clamp(0, ranks - 1), True)
        kth = key.topk(self.top_k, dim=-1).values[:, -1:]
        return (key >= kth).view(key.shape[0], ranks, self.per_rank).any(-1)

    @staticmethod
    def owners(needed: torch.Tensor) -> torch.Tensor:
        """For each token, one of the ranks it needs, taken in turn by token index so that the
        ranks share the owned rows evenly: ``[tokens]`` rank ids."""
        count = needed.sum(1).clamp(min=1)
        turn = torch.arange(needed.shape[0], device=needed.device) % count
        return ((needed.cumsum(1) == (turn + 1)[:, None]) & needed).int().argmax(1)


@dataclass(frozen=True)
class Share:
    """The tokens a message sends FFN rank ``rank``: ``[start, stop)``, or the rows ``rows``,
    of which ``owned`` marks those whose rank-shared term this rank adds."""

    rank: int
    start: int
    stop: int
    rows: torch.Tensor | None = field(default=None, compare=False)
    owned: torch.Tensor | None = field(default=None, compare=False)

    @property
    def count(self) -> int:
        return self.stop - self.start if self.rows is None else self.rows.numel()


@dataclass(frozen=True)
class Dispatch:
    """How one FFN layer's inputs go out to the FFN ranks and how their replies combine.

    ``reduce`` (per output) is ``sum`` (each rank returns a partial result for every token),
    ``first`` (rank 0's copy is the result, so only rank 0 is asked) or ``rows`` (each rank holds
    the whole layer and serves a contiguous share of the tokens). With ``experts``, a ``sum``
    layer's tokens go only to the ranks holding experts they chose, and each rank's partial
    results are added into the rows it was sent.
    """

    reduce: tuple[str, ...]
    inputs: tuple[TokenLayout | None, ...]
    experts: ExpertRouting | None = None

    @property
    def by_rows(self) -> bool:
        return bool(self.reduce) and all(how == "rows" for how in self.reduce)

    @property
    def partial_rows(self) -> bool:
        """Whether replies hold some of the message's tokens, as ``[tokens, per-token...]``."""
        return self.by_rows or self.experts is not None

    def shares(self, inputs: list[torch.Tensor], tokens: int, ranks: int) -> list[Share]:
        if self.experts is not None:
            key = _rows(inputs[self.experts.input], tokens)
            needed = self.experts.ranks_of(key, ranks)
            owner = self.experts.owners(needed) if self.experts.owner is not None else None
            shares = []
            for r in range(ranks):
                rows = needed[:, r].nonzero().flatten()
                if rows.numel():
                    shares.append(Share(r, 0, tokens, rows, None if owner is None else owner[rows] == r))
            empty = needed.new_zeros(0, dtype=torch.long)
            return shares or [Share(0, 0, 0, empty, None if owner is None else empty.bool())]
        if self.by_rows:
            bounds = [r * tokens // ranks for r in range(ranks + 1)]
            shares = [Share(r, lo, hi) for r, (lo, hi) in enumerate(itertools.pairwise(bounds)) if hi > lo]
            return shares or [Share(0, 0, 0)]  # an empty micro-batch still gets its (empty) reply
        if all(how == "first" for how in self.reduce):
            return [Share(0, 0, tokens)]
        return [Share(r, 0, tokens) for r in range(ranks)]

    def take(self, inputs: list[torch.Tensor], share: Share, tokens: int) -> list[torch.Tensor]:
        """The inputs ``share`` gets out of a message of ``tokens`` tokens."""
        if not self.partial_rows:
            return inputs
        rows = slice(share.start, share.stop) if share.rows is None else share.rows
        parts = [_rows(x, tokens)[rows].reshape(_at_tokens(lay, share.count)) for x, lay in zip(inputs, self.inputs)]
        if share.owned is not None:  # the segment's last input, filled here rather than by the attention program
            parts.append(share.owned.reshape(_at_tokens(self.inputs[self.experts.owner], share.count)))
        return parts

    def tokens(self, inputs: list[torch.Tensor]) -> int:
        """The token count of a message (only dispatch by rows needs it; others answer 0)."""
        if not self.partial_rows:
            return 0
        return inputs[0].numel() // math.prod(abs(d) for d in self.inputs[0])

    def combine(self, index: int, replies: list[torch.Tensor], shares: list[Share]) -> torch.Tensor:
        """Output ``index`` from each share's reply (in ``shares`` order); ``rows`` come back as
        ``[tokens, per-token elements]`` for the receiver to reshape."""
        how = self.reduce[index]
        if self.experts is not None:
            tokens = shares[0].stop  # every expert share spans the whole message
            parts = [_rows(r, s.count) for r, s in zip(replies, shares)]
            out = parts[0].new_zeros(tokens, parts[0].shape[1])
            for part, share in zip(parts, shares):  # in rank order, as the sum of whole replies would
                out.index_add_(0, share.rows, part)
            return out
        if how == "rows":
            return torch.cat([_rows(r, s.stop - s.start) for r, s in zip(replies, shares)])
        if how == "first":
            return replies[0]
        return functools.reduce(torch.add, replies)  # partial results, added in rank order


def combine(programs: list[FFNProgram], layer: int, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Run FFN layer ``layer`` in-process on the FFN ranks it goes to and combine their outputs."""
    dispatch = programs[0].dispatch(layer)
    tokens = dispatch.tokens(inputs)
    shares = dispatch.shares(inputs, tokens, len(programs))
    replies = [programs[s.rank].run(layer, dispatch.take(inputs, s, tokens)) for s in shares]
    return [dispatch.combine(i, [r[i] for r in replies], shares) for i in range(len(replies[0]))]
