"""The whole pipeline, capture -> passes -> partition -> (shard) -> runtime.

:func:`build` turns a model (real or on the meta device) into graphs and weight bindings;
:func:`disaggregate` binds them to the model's own weights and returns a runnable model;
``afdc compile`` (:mod:`afdc.compile`) writes them out as an artifact instead.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from transformers import PreTrainedModel

from afdc import capture as capture_mod
from afdc import segment
from afdc.capture import CapturedGraph
from afdc.errors import PlanError, UnsupportedModelError
from afdc.mixer import MixerSite
from afdc.ops import AttentionCall
from afdc.partition.attention_tp import shard_attention
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
from afdc.passes.aliasing import split_writes
from afdc.passes.classify import Classification, classify
from afdc.passes.cleanup import drop_sentinel_masks, strip_assertions
from afdc.passes.expert_routing import expert_routing, owner_mask
from afdc.passes.fusion import copy_graph
from afdc.passes.portable import portable
from afdc.plan import TORCH_DTYPES, Plan
from afdc.report import LayerReport, Report, kv_bytes_per_token, layer_report
from afdc.runtime.exchange import deployment_id
from afdc.runtime.mixers import Mixers
from afdc.runtime.model import DefaultPositions, DisaggregatedModel
from afdc.runtime.programs import AttentionProgram, FFNProgram
from afdc.runtime.tensor_parallel import TensorParallelAttention
from afdc.segment import ExpertRouting, Segment, SegmentBinding, Split, row_major


@dataclass(kw_only=True)
class Built:
    """A partitioned model before weights are bound: what disaggregate runs and compile writes."""

    plan: Plan
    attention_graph: fx.Graph
    out_spec: pytree.TreeSpec
    segments: list[Segment]  # graphs take (weights..., inputs..., rank)
    layers: list[SegmentBinding]  # per FFN layer: its segment and weight names
    attrs: dict[str, torch.Tensor]  # every weight, buffer and constant a program reads, by name
    recompute: str  # why decode recomputes the prefix ("": it decodes against the KV cache)
    report: Report
    attention_splits: dict[str, Split]  # --attn-tp: how the TP ranks hold attention weights (absent: whole)
    max_positions: int | None  # the longest key length the captured graph is valid for (None: any)
    mixers: list[MixerSite]  # the attention graph's stateful-mixer call sites, with their state

    def attention_names(self) -> list[str]:
        return sorted({n.target for n in self.attention_graph.nodes if n.op == "get_attr"})

    def attention_weights(self, tp_rank: int) -> dict[str, torch.Tensor]:
        """The attention-side tensors TP rank ``tp_rank`` holds (all of them at ``--attn-tp 1``)."""
        tp = self.plan.attention_tp
        return {n: _local(self.attrs[n], self.attention_splits.get(n, Split()), tp_rank, tp)
                for n in self.attention_names()}

    def attention_program(self, mixers: Mixers | None = None) -> AttentionProgram | TensorParallelAttention:
        """One attention rank bound to the model's weights: under ``--attn-tp N``, N shards.
        ``mixers`` runs the stateful mixers (needed when :attr:`mixers` lists any)."""
        shards = [
            AttentionProgram.from_graph(
                copy_graph(self.attention_graph), self.attention_weights(t), self.out_spec, mixers
            )
            for t in range(self.plan.attention_tp)
        ]
        return shards[0] if len(shards) == 1 else TensorParallelAttention(shards)

    def ffn_splits(self) -> dict[str, Split]:
        """How the FFN ranks hold each FFN weight."""
        splits: dict[str, Split] = {}
        for binding in self.layers:
            for name, split in zip(binding.weights, self.segments[binding.segment].splits):
                if splits.setdefault(name, split) != split:
                    raise UnsupportedModelError(f"weight {name} is shared by FFN layers that split it differently")
        return splits


def _classify(captured: CapturedGraph) -> Classification:
    graph = portable(drop_sentinel_masks(strip_assertions(captured.graph)))
    classification = classify(graph, set(captured.parameter_names))
    if captured.state_outside_cache:
        raise UnsupportedModelError(
            "the forward keeps per-sequence state outside transformers' per-layer cache API "
            f"({captured.state_outside_cache}): afdc finds no stateful mixer there to keep it per sequence, and "
            "captured inline the graph holds for one token count only"
        )
    if captured.specialized:
        raise UnsupportedModelError(
            "the forward specializes the batch size or sequence length (torch.export could not keep them symbolic): "
            + captured.specialized
        )
    return classification


def _split(
    captured: CapturedGraph, classification: Classification, plan: Plan, cuts: list[Cut]
) -> tuple[list[Cut], list[LayerReport], Partition, list[tuple[ShardedSegment, ExpertRouting | None]]]:
    """Cut, partition and shard. Where the plan's partial sums (experts' or row-split outputs)
    meet an op that is not linear in them (Gemma 4 norms each branch's output before adding
    them), the FFN ranks cannot finish the layer: that op goes to the attention side, which
    receives the reduced sums, and the cut is made again."""
    graph, params = captured.graph, set(captured.parameter_names)
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
    mode = FFNParallel.TP if plan.ffn_parallel == "tp" else FFNParallel.EP
    first = {b.segment: (labels[i], b.weights) for i, b in reversed(list(enumerate(part.layers)))}
    sharded = []
    for i, g in enumerate(part.segments):
        try:
            sharded.append(_shard_one(g, mode, plan, tokens, *first[i]))
        except PartialSumsMeetNonLinearOps as err:
            err.segment = i
            raise
    if plan.ffn_parallel == "ep" and not any(s.experts for seg, _ in sharded for s in seg.splits):
        raise PlanError("--ffn-parallel ep: the model has no expert weights to partition (a dense model); use tp")
    return sharded


def _shard_one(
    graph: fx.Graph, mode: FFNParallel, plan: Plan, tokens, label: str, names: list[str]
) -> tuple[ShardedSegment, ExpertRouting | None]:
    """One segment over the plan's FFN ranks; under ``--dense-ffn replicate`` a segment without
    experts is kept whole and its tokens are shared out, when its rows can be split by token.
    Under ``--router attn`` a MoE segment's shared experts are kept whole where that lets its
    tokens go only to their experts' ranks."""
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


def _check_heads(config, tp: int) -> None:
    """Attention TP splits whole heads: query heads, and key/value heads unless there is one."""
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


def build(model: PreTrainedModel, plan: str | Plan = "1A1F") -> Built:
    """Capture, classify, cut, partition and shard ``model`` for ``plan``.

    Raises :class:`afdc.UnsupportedModelError` when the model cannot be split and
    :class:`afdc.PlanError` when the plan does not fit it.
    """
    plan = Plan.parse(plan)
    if plan.attention_tp > 1:
        _check_heads(model.config.get_text_config(), plan.attention_tp)
    placement = RouterPlacement(plan.router)
    captured = capture_mod.capture(model)
    mixers = mixer_table(model, captured.mixers).probe() if captured.mixers else []
    classification = _classify(captured)
    cuts = select_cuts(captured.graph, classification, set(captured.parameter_names), placement)
    if split_writes(captured.graph, (n for c in cuts for n in c.ffn_nodes)):
        captured = capture_mod.capture(model, functional=True)
        classification = _classify(captured)
        cuts = select_cuts(captured.graph, classification, set(captured.parameter_names), placement)
    cuts, layers_report, part, shards = _split(captured, classification, plan, cuts)
    graph, params = captured.graph, set(captured.parameter_names)
    # The KV cache lives in afdc's attention op; state computed inline cannot be cached
    recompute = captured.recompute
    if classification.inline_mixers:
        recompute = (
            "token mixers run inline, outside afdc's cached attention op "
            "(attention hard-coded in the model, or recurrent or convolutional mixers)"
        )
    tokens = gf.token_symbols(graph)
    for lr, binding in zip(layers_report, part.layers):
        lr.segment = binding.segment
    segments = [
        Segment(
            graph=seg.graph,
            splits=tuple(seg.splits),
            reduce=tuple(seg.reduce),
            inputs=tuple(gf.token_layout(n, tokens) for n in segment.inputs(seg.graph)),
            routing=routing,
        )
        for seg, routing in shards
    ]
    for lr, binding in zip(layers_report, part.layers):
        lr.ffn_split = segments[binding.segment].describe()
        lr.ranks_per_token = segments[binding.segment].dispatch().ranks_per_token(plan.ffn_ranks)
        lr.routed = segments[binding.segment].routing is not None

    attention_params = {n.target for n in part.attention_graph.nodes if n.op == "get_attr"} & params
    attention_graph, attention_splits = part.attention_graph, {}
    if plan.attention_tp > 1:
        sharded = shard_attention(part.attention_graph, plan.attention_tp)
        attention_graph, attention_splits = sharded.graph, sharded.splits
    ffn_weights = {w for b in part.layers for w in b.weights}
    report = Report(
        model=getattr(model.config, "_name_or_path", "") or type(model).__name__,
        plan=str(plan),
        router=plan.router,
        decode_recomputes=recompute,
        attention_calls=len(AttentionCall.all_in(graph)),
        attention_parameters=sum(captured.attrs[n].numel() for n in attention_params),
        ffn_parameters=sum(captured.attrs[n].numel() for n in ffn_weights & params),
        segment_graphs=len(part.segments),
        layers=layers_report,
        attention_tp=plan.attention_tp,
        attention_tp_split=sum(captured.attrs[n].numel() for n in attention_splits),
        max_positions=captured.max_positions,
        kv_bytes_per_token=kv_bytes_per_token(graph),
        mixers=mixers,
    )
    return Built(
        plan=plan,
        attention_graph=attention_graph,
        out_spec=captured.out_spec,
        segments=segments,
        layers=part.layers,
        attrs=captured.attrs,
        recompute=recompute,
        report=report,
        attention_splits=attention_splits,
        max_positions=captured.max_positions,
        mixers=mixers,
    )


def mixer_table(model: PreTrainedModel, sites: list[MixerSite]) -> Mixers | None:
    """What runs ``sites`` in-process: ``model``'s own modules (None: no sites)."""
    return Mixers(sites, {s.slot: model.get_submodule(s.module) for s in sites}, model.config) if sites else None


def ffn_program(built: Built, weights: dict[str, torch.Tensor], rank: int) -> FFNProgram:
    """FFN rank ``rank`` of ``built``; ``weights`` holds that rank's (already local) tensors."""
    return FFNProgram(segments=built.segments, layers=built.layers, weights=weights, rank=rank)


def _local(weight: torch.Tensor, split: Split, rank: int, ranks: int) -> torch.Tensor:
    """Rank ``rank``'s part of ``weight``: the tensor itself when whole; a shard is a parameter of
    its own (detached, so launched FFN processes can share it)."""
    local = split.local(weight, rank, ranks)
    if local is weight or not isinstance(weight, torch.nn.Parameter):
        return local
    return torch.nn.Parameter(local.detach(), requires_grad=False)


def disaggregate(
    model: PreTrainedModel, plan: str | Plan = "1A1F", router: str | None = None, **options
) -> DisaggregatedModel:
    """Split ``model`` into attention and FFN programs for ``plan`` joined by a connector.

    ``plan`` is ``"xAyF"`` or a :class:`Plan`; keyword options (``ffn_parallel``,
    ``micro_batches``, ``backend``, ...) refine it. Every rank runs in this process until ``dm.launch()``
    moves the FFN ranks to processes (``connector`` picks the transport, ``"gloo"`` or
    ``"shm"``). The result is a drop-in for the model's own call.
    Raises :class:`afdc.UnsupportedModelError` when the model cannot be split; it never returns
    an unsplit or half-split model.
    """
    if router is not None:
        options["router"] = router
    connector = options.pop("connector", "gloo")
    plan = Plan.parse(plan, **options)
    if plan.dtype is not None and TORCH_DTYPES[plan.dtype] != model.dtype:
        raise PlanError(
            f"afdc.disaggregate splits the model in the dtype it is in ({model.dtype}), not {plan.dtype}: cast it "
            f"first (model.to({TORCH_DTYPES[plan.dtype]}) and leave dtype out), or give dtype to afdc compile, "
            "which converts the weights as it writes them"
        )
    built = build(model, plan)
    attention = built.attention_program(mixer_table(model, built.mixers))
    splits = built.ffn_splits()
    ffn = [
        ffn_program(
            built, {w: _local(built.attrs[w], split, r, built.plan.ffn_ranks) for w, split in splits.items()}, r
        )
        for r in range(built.plan.ffn_ranks)
    ]
    attention.use_backend(built.plan.backend)
    for program in ffn:
        program.use_backend(built.plan.backend)
    return DisaggregatedModel(
        attention=[attention] * built.plan.attention_ranks,
        ffn=ffn,
        incremental=not built.recompute,
        report=built.report,
        generation_config=getattr(model, "generation_config", None),
        config=model.config,
        micro_batches=built.plan.micro_batches,
        deployment=deployment_id(str(built.plan), attention.module.code, *(s.code for s in ffn[0].segments)),
        connector=connector,
        max_positions=built.max_positions,
        default_positions=default_positions(model),
    )


@torch.no_grad()
def default_positions(model: PreTrainedModel) -> DefaultPositions:
    """The positions ``model`` uses when called without ``position_ids``, found by calling it on a
    left-padded batch with each rule's positions. A model on the meta device cannot be called:
    it is taken to follow transformers' default."""
    weights = next(model.parameters())
    if not capture_mod.takes_positions(model) or weights.is_meta:
        return DefaultPositions.COUNT_PADDING
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, model.config.get_text_config().vocab_size, (2, 6), generator=g).to(weights.device)
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    real = mask.bool()
    ref = model(input_ids=ids, attention_mask=mask).logits[real]
    pad = model.config.get_text_config().pad_token_id
    rules = [DefaultPositions.COUNT_PADDING, DefaultPositions.SKIP_PADDING]
    rules += [DefaultPositions.FROM_PAD_TOKEN] if pad is not None else []
    for rule in rules:
        got = model(input_ids=ids, attention_mask=mask, position_ids=rule.position_ids(ids, mask, pad)).logits[real]
        if torch.allclose(got, ref, rtol=0, atol=1e-3 * ref.abs().max().item()):
            return rule
    return DefaultPositions.OWN
