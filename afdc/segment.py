"""The FFN segment: the contract between the partition and everything after it.

An FFN segment is one FFN region of the captured graph as a graph of its own,
``(w0, w1, ..., x0, x1, ..., rank) -> outputs``: weights, then the inputs the attention side
sends, then (once sharded) the FFN rank it runs as. The partition writes these placeholders
(:func:`add_weight`, :func:`add_input`, :func:`add_rank`); sharding, expert routing, lowering,
the artifact and the runtime read them through :func:`weights`, :func:`inputs` and
:func:`rank`, never by parsing names. :class:`Segment` is a segment ready to deploy: its graph,
how the FFN ranks hold each weight (:class:`Split`), how the attention side combines their
outputs, each input's token layout and, under expert parallelism, how tokens reach the experts'
ranks (:class:`ExpertRouting`), and the range of each input it indexes with (:class:`IndexBound`).
:class:`Dispatch` is what the attention side does with that for one message, and what the FFN
side takes of one. Torch only: every stage imports this module, it imports none of them.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.fx as fx

# -- placeholders ----------------------------------------------------------------------------------

_WEIGHT, _INPUT, _RANK = "w", "x", "rank"


def add_weight(graph: fx.Graph, index: int) -> fx.Node:
    return graph.placeholder(f"{_WEIGHT}{index}")


def add_input(graph: fx.Graph, index: int) -> fx.Node:
    return graph.placeholder(f"{_INPUT}{index}")


def add_rank(graph: fx.Graph) -> fx.Node:
    """The FFN rank input, after every weight and input."""
    return graph.placeholder(_RANK)


def _role(node: fx.Node) -> str | None:
    if node.op != "placeholder":
        return None
    if node.name == _RANK:
        return _RANK
    head, index = node.name[:1], node.name[1:]
    return head if head in (_WEIGHT, _INPUT) and index.isdigit() else None


def is_weight(node: fx.Node) -> bool:
    return _role(node) == _WEIGHT


def weights(graph: fx.Graph) -> list[fx.Node]:
    """The segment's weight placeholders, in binding order."""
    return [n for n in graph.find_nodes(op="placeholder") if _role(n) == _WEIGHT]


def inputs(graph: fx.Graph) -> list[fx.Node]:
    """The values the attention side sends, in send order."""
    return [n for n in graph.find_nodes(op="placeholder") if _role(n) == _INPUT]


def rank(graph: fx.Graph) -> fx.Node | None:
    """The FFN rank input of a sharded segment (None before sharding, or when it needs none)."""
    return next((n for n in graph.find_nodes(op="placeholder") if _role(n) == _RANK), None)


def outputs(graph: fx.Graph) -> list:
    (out,) = graph.find_nodes(op="output")
    return list(out.args[0])


# -- token layouts ---------------------------------------------------------------------------------

# An input's shape at batch 1 and T tokens: an int is a fixed size, -k stands for k * T.
TokenLayout = list[int]


def at_tokens(layout: TokenLayout, tokens: int) -> list[int]:
    return [d if d >= 0 else -d * tokens for d in layout]


def row_major(layout: TokenLayout | None) -> bool:
    """Whether a tensor of this layout is one row per token ([1, T, ...] or [T, ...]), so that a
    contiguous range of tokens is a contiguous range of rows."""
    return layout is not None and next((d for d in layout if d != 1), None) == -1


def token_major(layout: TokenLayout | None) -> bool:
    """Whether a tensor of this layout holds each token's elements together (``[T, ...]``, or a
    flat ``[k*T]`` run of k per token), so that its ``[tokens, per-token]`` view splits by token."""
    return layout is not None and next((d for d in layout if d != 1), 0) < 0


def as_rows(tensor: torch.Tensor, tokens: int) -> torch.Tensor:
    """``tensor`` as ``[tokens, per-token elements]``."""
    return tensor.reshape(tokens, tensor.numel() // max(tokens, 1))


# -- how the FFN ranks hold the weights ------------------------------------------------------------


@dataclass(frozen=True)
class RowView:
    """A weight the programs read as a view of the tensor the checkpoint stores: its first ``rows``
    rows along dim 0 read as ``shape``, whose dim 0 counts blocks of ``rows // shape[0]`` rows
    (stacked experts a module keeps flat as ``[E*I, H]``, or past the experts that compute). A
    rank's slice is taken of ``shape``; its bytes are the same rows of the stored tensor."""

    rows: int
    shape: tuple[int, ...]

    def __post_init__(self):
        object.__setattr__(self, "shape", tuple(self.shape))
        if not self.shape or self.rows % self.shape[0]:
            raise ValueError(f"{self}: rows must be whole blocks of dim 0 of shape")

    @property
    def block(self) -> int:
        return self.rows // self.shape[0]

    def stored_ranges(self, part: ShardSlice) -> list[tuple[int, int]]:
        """The stored tensor's dim-0 row ranges that hold ``part`` of the view."""
        if part.dim is None:
            return [(0, self.rows)]
        if part.dim != 0:
            raise ValueError(f"{part} splits dim {part.dim} of a view of stored rows (only dim 0 can be split)")
        return [(lo * self.block, hi * self.block) for lo, hi in part.index(self.shape)]


@dataclass(frozen=True)
class ShardSlice:
    """Which part of a full tensor one rank holds.

    Along ``dim``, the tensor is ``blocks`` equal consecutive blocks (e.g. a fused [gate; up]), or
    the consecutive ``sections`` of the given sizes (a fused [q; k; v] with fewer key/value heads),
    and each is split into ``parts`` near-equal ranges: rank ``part`` holds, of each block or
    section of size n starting at o, rows [o + part*n//parts, o + (part+1)*n//parts), concatenated
    in order. ``dim=None`` is the whole tensor (replicated). Expert parallelism is dim 0 of a
    stacked [E, ...] expert weight; tensor parallelism of a fused gate_up is ``blocks=2``.
    """

    dim: int | None = None
    blocks: int = 1
    part: int = 0
    parts: int = 1
    sections: tuple[int, ...] = ()

    def __post_init__(self):
        object.__setattr__(self, "sections", tuple(self.sections))
        if self.parts < 1 or self.blocks < 1 or not 0 <= self.part < self.parts:
            raise ValueError(f"{self}: needs parts >= 1, blocks >= 1 and 0 <= part < parts")
        if self.dim is None and (self.blocks, self.parts, self.sections) != (1, 1, ()):
            raise ValueError(f"{self}: a replicated slice (dim=None) has blocks=1, parts=1 and no sections")
        if self.sections and self.blocks != 1:
            raise ValueError(f"{self}: sections or blocks, not both")
        if self.dim is not None and self.dim < 0:
            raise ValueError(f"{self}: dim counts from 0")

    def index(self, full: Sequence[int]) -> list[tuple[int, int]]:
        """The [start, stop) row ranges along ``dim`` this rank holds, in order ([] when replicated)."""
        if self.dim is None:
            return []
        if self.dim >= len(full) or sum(self.sizes(full[self.dim])) != full[self.dim]:
            raise ValueError(f"{self} does not fit a tensor of shape {list(full)}")
        ranges, start = [], 0
        for n in self.sizes(full[self.dim]):
            ranges.append((start + self.part * n // self.parts, start + (self.part + 1) * n // self.parts))
            start += n
        return ranges

    def sizes(self, size: int) -> tuple[int, ...]:
        """The blocks or sections a dim of ``size`` is made of."""
        return self.sections or (size // self.blocks,) * self.blocks

    def local_shape(self, full: Sequence[int]) -> tuple[int, ...]:
        if self.dim is None:
            return tuple(full)
        rows = sum(hi - lo for lo, hi in self.index(full))
        return (*full[: self.dim], rows, *full[self.dim + 1 :])

    def take(self, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's part of a full in-memory tensor (what the written file holds for it)."""
        if self.dim is None:
            return tensor
        return torch.cat([tensor.narrow(self.dim, lo, hi - lo) for lo, hi in self.index(tensor.shape)], self.dim)


@dataclass(frozen=True)
class Split:
    """How the F ranks hold one weight: replicated (``dim`` None) or split along ``dim``."""

    dim: int | None = None
    blocks: int = 1  # the dim is this many equal blocks (a fused [gate; up]), each split evenly
    experts: bool = False  # ``dim`` is the expert dimension (expert parallel)
    sections: tuple[int, ...] = ()  # or these unequal sections (a fused [q; k; v]), each split evenly

    def __post_init__(self):
        object.__setattr__(self, "sections", tuple(self.sections))  # read back from JSON as a list

    def slice(self, rank: int, ranks: int) -> ShardSlice:
        """The part of the full weight that rank ``rank`` of ``ranks`` holds."""
        if self.dim is None or ranks == 1:
            return ShardSlice()
        return ShardSlice(self.dim, self.blocks, rank, ranks, self.sections)

    def divides(self, size: int, ranks: int) -> bool:
        """Whether ``ranks`` split each block or section of a dim of ``size`` evenly."""
        parts = ShardSlice(0, self.blocks, 0, 1, self.sections).sizes(size)
        return sum(parts) == size and all(n % ranks == 0 for n in parts)

    def local(self, tensor: torch.Tensor, rank: int, ranks: int) -> torch.Tensor:
        """Rank ``rank``'s part of the full ``tensor``."""
        return self.slice(rank, ranks).take(tensor).contiguous()


# -- the deployable segment ------------------------------------------------------------------------


@dataclass
class SegmentBinding:
    """Which segment graph an FFN layer runs and the attribute names of its weights, in order."""

    segment: int
    weights: list[str]


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
class IndexBound:
    """Input ``input`` holds indices into ``size`` rows (expert ids, token ids): each value lies
    in ``[0, size)``, which the FFN side checks before it runs a peer's message
    (:mod:`afdc.passes.index_bounds` finds them)."""

    input: int
    size: int

    def __post_init__(self):
        for name in ("input", "size"):
            if type(getattr(self, name)) is not int:
                raise ValueError(f"{self}: {name} is an integer, not {type(getattr(self, name)).__name__}")
        if self.input < 0 or self.size < 1:
            raise ValueError(f"{self}: needs input >= 0 and size >= 1")


def check_index_bounds(bounds: Sequence[IndexBound], inputs: int) -> None:
    """Refuse bounds that do not name distinct inputs among ``inputs``."""
    named = [b.input for b in bounds]
    if len(set(named)) != len(named) or any(i >= inputs for i in named):
        raise ValueError(f"index bounds {list(bounds)} must name distinct inputs of the {inputs} the segment takes")


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
    results are added into the rows it was sent. ``index_bounds``: the inputs the FFN side
    indexes with, whose values it takes only in their range.
    """

    reduce: tuple[str, ...]
    inputs: tuple[TokenLayout | None, ...]
    experts: ExpertRouting | None = None
    index_bounds: tuple[IndexBound, ...] = ()

    # asked several times a layer on the exchange's path: each answer is worked out once
    @functools.cached_property
    def by_rows(self) -> bool:
        return bool(self.reduce) and all(how == "rows" for how in self.reduce)

    @functools.cached_property
    def partial_rows(self) -> bool:
        """Whether replies hold some of the message's tokens, as ``[tokens, per-token...]``."""
        return self.by_rows or self.experts is not None

    def shares(self, inputs: list[torch.Tensor], tokens: int, ranks: int) -> Sequence[Share]:
        if self.experts is not None:
            key = as_rows(inputs[self.experts.input], tokens)
            needed = self.experts.ranks_of(key, ranks)
            owner = self.experts.owners(needed) if self.experts.owner is not None else None
            shares = []
            for r in range(ranks):
                rows = needed[:, r].nonzero().flatten()
                if rows.numel():
                    shares.append(Share(r, 0, tokens, rows, None if owner is None else owner[rows] == r))
            empty = needed.new_zeros(0, dtype=torch.long)
            return shares or [Share(0, 0, 0, empty, None if owner is None else empty.bool())]
        how = "rows" if self.by_rows else "first" if all(how == "first" for how in self.reduce) else "every"
        return _token_shares(how, tokens, ranks)

    def ranks_per_token(self, ranks: int) -> int:
        """How many of ``ranks`` FFN ranks a token goes to and gets a reply from, as
        :meth:`shares` sends it (with ``experts``: the most it can, every rank)."""
        if self.experts is None and (self.by_rows or all(how == "first" for how in self.reduce)):
            return 1
        return ranks

    def take(self, inputs: list[torch.Tensor], share: Share, tokens: int) -> list[torch.Tensor]:
        """The inputs ``share`` gets out of a message of ``tokens`` tokens."""
        if not self.partial_rows:
            return inputs
        rows = slice(share.start, share.stop) if share.rows is None else share.rows
        parts = [as_rows(x, tokens)[rows].reshape(at_tokens(lay, share.count)) for x, lay in zip(inputs, self.inputs)]
        if share.owned is not None:  # the segment's last input, filled here rather than by the attention program
            parts.append(share.owned.reshape(at_tokens(self.inputs[self.experts.owner], share.count)))
        return parts

    def tokens(self, inputs: list[torch.Tensor]) -> int:
        """The token count of a message (only dispatch by rows needs it; others answer 0)."""
        if not self.partial_rows:
            return 0
        return inputs[0].numel() // math.prod(abs(d) for d in self.inputs[0])

    def combine(self, index: int, replies: list[torch.Tensor], shares: Sequence[Share]) -> torch.Tensor:
        """Output ``index`` from each share's reply (in ``shares`` order); ``rows`` come back as
        ``[tokens, per-token elements]`` for the receiver to reshape."""
        how = self.reduce[index]
        if self.experts is not None:
            tokens = shares[0].stop  # every expert share spans the whole message
            parts = [as_rows(r, s.count) for r, s in zip(replies, shares)]
            out = parts[0].new_zeros(tokens, parts[0].shape[1])
            for part, share in zip(parts, shares):  # in rank order, as the sum of whole replies would
                out.index_add_(0, share.rows, part)
            return out
        if how == "rows":
            return torch.cat([as_rows(r, s.stop - s.start) for r, s in zip(replies, shares)])
        if how == "first":
            return replies[0]
        return functools.reduce(torch.add, replies)  # partial results, added in rank order


# Asked for every message an attention rank sends, and a deployment sees few token counts: the
# shares that depend on nothing else are made once (they are frozen).
@functools.lru_cache(maxsize=4096)
def _token_shares(how: str, tokens: int, ranks: int) -> tuple[Share, ...]:
    """The shares of a message of ``tokens`` tokens over ``ranks`` FFN ranks where every output
    reduces by ``rows`` (a contiguous share each), by ``first`` (rank 0 alone), or otherwise
    (``every`` rank gets every token)."""
    if how == "rows":
        bounds = [r * tokens // ranks for r in range(ranks + 1)]
        shares = tuple(Share(r, lo, hi) for r, (lo, hi) in enumerate(itertools.pairwise(bounds)) if hi > lo)
        return shares or (Share(0, 0, 0),)  # an empty micro-batch still gets its (empty) reply
    if how == "first":
        return (Share(0, 0, tokens),)
    return tuple(Share(r, 0, tokens) for r in range(ranks))


@dataclass(frozen=True, kw_only=True)
class Segment:
    """A segment graph taking ``(weights..., inputs..., rank)`` and how it is deployed.

    ``splits[i]`` is how the FFN ranks hold weight ``i``; ``reduce[i]`` how the attention side
    combines output ``i`` over the ranks (``sum`` of partial results, the ``first`` rank's copy,
    or ``rows``: every rank holds the whole segment and serves its own share of the tokens);
    ``inputs[i]`` is input ``i``'s token layout (None when it is not token-major), which lets one
    run serve several senders' tokens; ``routing`` sends each token only to its experts' ranks;
    ``index_bounds`` is the range of each input the segment indexes with.
    """

    graph: fx.Graph
    splits: tuple[Split, ...]
    reduce: tuple[str, ...]
    inputs: tuple[TokenLayout | None, ...]
    routing: ExpertRouting | None = None
    index_bounds: tuple[IndexBound, ...] = ()

    def __post_init__(self):
        object.__setattr__(self, "index_bounds", tuple(self.index_bounds))
        check_index_bounds(self.index_bounds, len(self.inputs))

    def describe(self) -> str:
        """``ep``, ``tp``, ``dp`` or ``replicated``: how the FFN ranks share this segment's work."""
        return describe(self.splits, self.reduce)

    def dispatch(self) -> Dispatch:
        return Dispatch(tuple(self.reduce), tuple(self.inputs), self.routing, self.index_bounds)


def describe(splits: Sequence[Split], reduce: Sequence[str]) -> str:
    """``ep``, ``tp``, ``dp`` or ``replicated``: how FFN ranks holding weights by ``splits`` and
    combined by ``reduce`` share a segment's work."""
    if reduce and all(how == "rows" for how in reduce):
        return "dp"
    if any(s.experts for s in splits):
        return "ep"
    return "tp" if any(s.dim is not None for s in splits) else "replicated"
