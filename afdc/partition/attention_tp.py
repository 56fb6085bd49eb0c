"""Tensor parallelism inside an attention rank (``--attn-tp``): the attention program sharded
over the rank's TP ranks by heads.

The same layout propagation as the FFN's (:class:`afdc.partition.shard.Propagation`) runs over
the attention program, with partial sums all-reduced where they are made, so that every value
the rest of the program reads is whole again; the attention op's own rule (by heads) is in
:mod:`afdc.partition.op_rules`. Weights are the program's ``get_attr`` nodes, named by their
targets. Every TP rank runs the same rewritten program, on its own share of the weights.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch.fx as fx

from afdc.errors import PlanError
from afdc.partition.layout import Conflict
from afdc.partition.propagation import FFNParallel
from afdc.partition.shard import Propagation, rewrite
from afdc.segment import Split


@dataclass
class ShardedAttention:
    """The attention program as each of an attention rank's TP ranks runs it, and how they hold
    the weights (by name; a weight not in ``splits`` is whole on every TP rank). ``replicated``
    says why weights that could not be split were kept whole."""

    graph: fx.Graph
    splits: dict[str, Split]
    replicated: list[str]


def shard_attention(graph: fx.Graph, ranks: int) -> ShardedAttention:
    """Tensor parallelism inside an attention rank, found by the same layout propagation as the
    FFN's: projections that read the residual stream are split by output column (q, k, v by
    heads), the attention op runs on each rank's heads, and the projection that reads the split
    heads back (o) is split by input row and its partial sums are all-reduced at once
    (``afdc::tp_all_reduce``), so the residual stream, norms, router and LM head stay whole.
    What cannot follow a split (a norm over all heads, an embedding, a weight whose size the ranks
    do not divide) keeps its weights whole, which is correct, only not parallel.
    """
    nodes = graph.find_nodes(op="get_attr")
    names = sorted({n.target for n in nodes})
    index = {n: names.index(n.target) for n in nodes}
    shapes = {index[n]: tuple(n.meta["val"].shape) for n in nodes}
    # All-reducing a mean over split heads (a norm over all of q) lets OLMo 2 split its heads,
    # but makes MLA split its small q latent instead of its heads: keep whichever splits more.
    tried = [_settle_attention(graph, ranks, index, names, shapes, average=False)]
    if tried[0][0].mean_refused:
        tried.append(_settle_attention(graph, ranks, index, names, shapes, average=True))
    prop, reasons = max(tried, key=lambda t: sum(math.prod(shapes[w]) for w, s in t[0].decided.items() if s.dim))
    splits = {names[w]: s for w, s in sorted(prop.decided.items()) if s.dim is not None}
    if not splits:
        raise PlanError(
            f"--attn-tp {ranks} (attention_tp={ranks}): no attention weight can be split over {ranks} ranks "
            f"({'; then '.join(reasons) or 'none is a projection'}); use --attn-tp 1 and more attention ranks"
        )
    sharded = rewrite(graph, prop, ranks)
    for node in sharded.nodes:  # sizes changed: values are propagated again where needed
        node.meta.pop("val", None)
    return ShardedAttention(sharded, splits, reasons)


def _settle_attention(
    graph: fx.Graph, ranks: int, index: dict[fx.Node, int], names: list[str], shapes: dict[int, tuple], average: bool
) -> tuple[Propagation, list[str]]:
    """Settle, then keep whole the weights the ranks do not divide and settle again."""
    prop = Propagation(graph, FFNParallel.TP, ranks, {}, weights=index, reduce_partials=True, average_means=average)

    def refuse(conflict: Conflict) -> None:
        if not conflict.blame:
            raise PlanError(f"--attn-tp {ranks}: cannot shard the attention program: {conflict.reason}") from None

    reasons: list[str] = []
    while True:  # each round keeps more weights whole, so it ends
        reasons += prop.settle(refuse)[1]
        undivided = {w for w, s in prop.decided.items() if s.dim is not None and not s.divides(shapes[w][s.dim], ranks)}
        if not undivided:
            return prop, list(dict.fromkeys(reasons))
        prop.rewind({w: Split() for w in undivided})
        reasons.append(f"{ranks} ranks do not divide {', '.join(names[w] for w in sorted(undivided))}")
