"""The partition policy: how a plan places each FFN region on the FFN ranks.

Given the capture's graph, its classification and a :class:`~afdc.plan.Plan`, :func:`place_ffn`
cuts every FFN region, partitions the graph into the attention graph and the FFN segments, and
shards each segment over the plan's FFN ranks: experts partitioned (EP) or weights split (TP),
dense layers sharded or replicated with their tokens shared out, and, under ``router="attn"``,
each token sent only to the ranks holding its experts where the segment proves that exact.
Where the plan's partial sums meet an op that is not linear in them, that op goes back to the
attention side and the regions are cut again. Each segment records the inputs it indexes with and
their ranges, which the FFN side checks a peer's messages against.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch.fx as fx

from afdc import segment
from afdc.errors import PlanError, UnsupportedModelError
from afdc.partition.cut import Cut, RouterPlacement, select_cuts
from afdc.partition.shard import (
    FFNParallel,
    PartialSumsMeetNonLinearOps,
    ShardedSegment,
    data_parallel,
    shard_segment,
    single_rank,
)
from afdc.partition.split import Partition, partition
from afdc.passes import graph_facts as gf
from afdc.passes.classify import Classification
from afdc.passes.expert_routing import expert_routing, owner_mask
from afdc.passes.index_bounds import index_bounds
from afdc.plan import Plan
from afdc.report import LayerReport, layer_report
from afdc.segment import ExpertRouting, Segment, row_major


@dataclass
class Placement:
    """The FFN regions as the plan places them: the cuts, the partition (attention graph and
    bindings), one sharded :class:`~afdc.segment.Segment` per distinct FFN graph, and a report
    row per FFN layer."""

    cuts: list[Cut]
    partition: Partition
    segments: list[Segment]
    layers: list[LayerReport]


def initial_cuts(graph: fx.Graph, classification: Classification, params: set[str], plan: Plan) -> list[Cut]:
    """Each FFN region's cut before the plan has been tried on it."""
    return select_cuts(graph, classification, params, RouterPlacement(plan.router))


def place_ffn(
    graph: fx.Graph, classification: Classification, params: set[str], plan: Plan, cuts: list[Cut]
) -> Placement:
    """Cut, partition and shard ``graph``'s FFN regions for ``plan``, starting from ``cuts``."""
    cuts, layers, part, shards = _split(graph, classification, params, plan, cuts)
    tokens = gf.token_symbols(graph)
    segments = [
        Segment(
            graph=seg.graph,
            splits=tuple(seg.splits),
            reduce=tuple(seg.reduce),
            inputs=tuple(gf.token_layout(n, tokens) for n in segment.inputs(seg.graph)),
            routing=routing,
            index_bounds=index_bounds(seg.graph),
        )
        for seg, routing in shards
    ]
    for row, binding in zip(layers, part.layers):
        placed = segments[binding.segment]
        row.segment = binding.segment
        row.ffn_split = placed.describe()
        row.ranks_per_token = placed.dispatch().ranks_per_token(plan.ffn_ranks)
        row.routed = placed.routing is not None
    return Placement(cuts=cuts, partition=part, segments=segments, layers=layers)


def check_attention_tp(config, plan: Plan) -> None:
    """Attention TP splits whole heads: query heads, and key/value heads unless there is one."""
    tp = plan.attention_tp
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if isinstance(heads, int) and heads % tp:
        raise PlanError(
            f"--attn-tp {tp} does not divide the model's {heads} attention heads; use a TP size dividing it"
        )
    if isinstance(kv_heads, int) and kv_heads > 1 and kv_heads % tp:
        raise PlanError(
            f"--attn-tp {tp} does not divide the model's {kv_heads} key/value heads; use a TP size dividing it"
        )


def _split(
    graph: fx.Graph, classification: Classification, params: set[str], plan: Plan, cuts: list[Cut]
) -> tuple[list[Cut], list[LayerReport], Partition, list[tuple[ShardedSegment, ExpertRouting | None]]]:
    """Cut, partition and shard. Where the plan's partial sums (experts' or row-split outputs)
    meet an op that is not linear in them (Gemma 4 norms each branch's output before adding
    them), the FFN ranks cannot finish the layer: that op goes to the attention side, which
    receives the reduced sums, and the cut is made again."""
    placement, tokens = RouterPlacement(plan.router), gf.token_symbols(graph)
    kept: set[fx.Node] = set()
    while True:
        layers_report = [layer_report(c, 0, tokens, params) for c in cuts]
        part = partition(graph, cuts)
        try:
            return cuts, layers_report, part, _shard(part, [lr.module for lr in layers_report], plan, tokens)
        except PartialSumsMeetNonLinearOps as err:
            readers = {
                part.origins[layer][int(name.removeprefix("v"))]
                for layer, binding in enumerate(part.layers)
                if binding.segment == err.segment
                for name in err.nodes
            }
            if readers <= kept:
                raise
            kept |= readers
            try:
                cuts = select_cuts(graph, classification, params, placement, kept)
            except UnsupportedModelError:
                raise err from None


def _shard(part: Partition, labels: list[str], plan: Plan, tokens):
    """Each segment over the plan's FFN ranks, with how its tokens go to experts' ranks (or None)."""
    if plan.ffn_ranks == 1:
        return [(single_rank(g), None) for g in part.segments]
    first = {b.segment: (labels[i], b.weights) for i, b in reversed(list(enumerate(part.layers)))}
    sharded = []
    for i, g in enumerate(part.segments):
        try:
            sharded.append(_shard_one(g, plan, tokens, *first[i]))
        except PartialSumsMeetNonLinearOps as err:
            err.segment = i
            raise
    if plan.ffn_parallel == "ep" and not any(s.experts for seg, _ in sharded for s in seg.splits):
        raise PlanError("--ffn-parallel ep: the model has no expert weights to partition (a dense model); use tp")
    return sharded


def _shard_one(
    graph: fx.Graph, plan: Plan, tokens, label: str, names: list[str]
) -> tuple[ShardedSegment, ExpertRouting | None]:
    """One segment over the plan's FFN ranks; under ``--dense-ffn replicate`` a segment without
    experts is kept whole and its tokens are shared out, when its rows can be split by token.
    Under ``--router attn`` a MoE segment's shared experts are kept whole where that lets its
    tokens go only to their experts' ranks."""
    mode = FFNParallel.TP if plan.ffn_parallel == "tp" else FFNParallel.EP  # auto: EP where there are experts
    replicate = plan.dense_ffn == "replicate" and _rows_split(graph, tokens)
    if replicate and mode is FFNParallel.TP:
        return data_parallel(graph), None
    try:
        sharded = shard_segment(graph, mode, plan.ffn_ranks, label, names)
    except PlanError as err:
        replicable = _rows_split(graph, tokens) and not _stacked_weights(graph)
        if replicable and replicate:  # a dense layer need not split to be replicated
            return data_parallel(graph), None
        if replicable and not isinstance(err, PartialSumsMeetNonLinearOps):  # (that one a re-cut may mend)
            raise PlanError(
                f"{err}, or --dense-ffn replicate (dense_ffn='replicate'): every FFN rank holds the whole layer "
                "and serves a share of the tokens"
            ) from None
        raise
    if sharded.describe() != "ep":
        return (data_parallel(graph) if replicate else sharded), None
    if plan.router != "attn":  # every rank sees every token: nothing to route
        return sharded, None
    routed = _routed(sharded, tokens)
    shared = [i for i, s in enumerate(sharded.splits) if not s.experts and s.dim is not None]
    if routed[1] is None and shared:  # whole on every rank, a token's shared expert runs on one of its ranks
        whole = _routed(shard_segment(graph, mode, plan.ffn_ranks, label, names, whole=shared), tokens)
        if whole[1] is not None:
            return whole
    return routed


def _routed(sharded: ShardedSegment, tokens) -> tuple[ShardedSegment, ExpertRouting | None]:
    """An expert-parallel segment with proven routing: as it is, or with its rank-0-only terms
    moved to rows the attention side marks; else the segment unchanged, broadcast to every rank."""
    whole = [i for i, split in enumerate(sharded.splits) if split.dim is None]
    if (routing := expert_routing(sharded.graph, tokens, whole)) is not None:
        return sharded, routing
    masked = owner_mask(sharded.graph, tokens)
    if masked is not None and (routing := expert_routing(masked, tokens, whole)) is not None:
        return replace(sharded, graph=masked), routing
    return sharded, None


def _stacked_weights(graph: fx.Graph) -> bool:
    """Whether the segment has weights of rank 3 or more (stacked experts)."""
    return any(w.meta["val"].dim() >= 3 for w in segment.weights(graph))


def _rows_split(graph: fx.Graph, tokens) -> bool:
    """Whether every input and output of the segment is token-major ([b, s, ...] or [b*s, ...]),
    so that each FFN rank can take a contiguous range of the tokens."""
    values = segment.inputs(graph) + segment.outputs(graph)
    return all(row_major(gf.token_layout(v, tokens)) for v in values if isinstance(v, fx.Node))
