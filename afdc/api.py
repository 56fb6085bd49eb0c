"""The whole pipeline, capture -> passes -> partition -> (shard) -> runtime.

:func:`build` turns a model (real or on the meta device) into graphs and weight bindings;
:func:`disaggregate` binds them to the model's own weights and returns a runnable model;
``afdc compile`` (:mod:`afdc.compile`) writes them out as an artifact instead.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from transformers import PreTrainedModel

from afdc import capture as capture_mod
from afdc.capture import CapturedGraph
from afdc.errors import PlanError, UnsupportedModelError
from afdc.lowering.quantized import quantize_graphs
from afdc.mixer_site import MixerSite
from afdc.ops import AttentionCall
from afdc.partition.attention_tp import shard_attention
from afdc.partition.policy import Placement, check_attention_tp, initial_cuts, place_ffn
from afdc.passes.aliasing import split_writes
from afdc.passes.classify import Classification, classify
from afdc.passes.cleanup import drop_sentinel_masks, strip_assertions
from afdc.passes.matching import copy_graph
from afdc.passes.portable import portable
from afdc.plan import TORCH_DTYPES, Plan
from afdc.quant.scheme import QuantScheme
from afdc.quant.stored import QuantizedTensors
from afdc.report import LayerReport, Report, kv_bytes_per_token
from afdc.runtime.exchange import deployment_id
from afdc.runtime.mixer_modules import Mixers
from afdc.runtime.model import DefaultPositions, DisaggregatedModel, ModelTraits
from afdc.runtime.programs import AttentionProgram, FFNProgram
from afdc.runtime.quantized_linears import quantized_linear
from afdc.runtime.tensor_parallel import TensorParallelAttention
from afdc.runtime.transport import ConnectorKind
from afdc.segment import RowView, Segment, SegmentBinding, Split


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
    quant: QuantizedTensors | None = None  # the checkpoint's quantized parameters as the programs take them
    # the attrs the checkpoint stores: parameters and persistent buffers (DeepSeek's e_score_correction_bias)
    stored_names: frozenset[str] = frozenset()
    views: dict[str, RowView] = field(default_factory=dict)  # weights read as views of stored rows (capture's)

    def weight_bytes(self, name: str) -> int:
        """The bytes of weight ``name`` as the checkpoint stores it (:func:`stored_size`)."""
        return stored_size(self.attrs, self.quant)(name)

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


def build(model: PreTrainedModel, plan: Plan, quant: QuantScheme | None = None, *, rewrite: bool = True) -> Built:
    """Capture, classify, cut, partition and shard ``model`` for ``plan``; with ``quant`` (the
    checkpoint's scheme), the report prices each weight at its stored bytes and, unless ``rewrite``
    is False (the planner, whose cost model reads the bf16 graphs), each matmul by a weight the
    checkpoint stores quantized is put on its quantized op.

    Raises :class:`afdc.UnsupportedModelError` when the model cannot be split and
    :class:`afdc.PlanError` when the plan does not fit it.
    """
    if plan.attention_tp > 1:
        check_attention_tp(model.config.get_text_config(), plan)
    captured = capture_mod.capture(model)
    mixers = mixer_table(model, captured.mixers).probe() if captured.mixers else []
    classification = _classify(captured)
    cuts = initial_cuts(captured.graph, classification, set(captured.parameter_names), plan)
    if split_writes(captured.graph, (n for c in cuts for n in c.ffn_nodes)):
        captured = capture_mod.capture(model, functional=True)
        classification = _classify(captured)
        cuts = initial_cuts(captured.graph, classification, set(captured.parameter_names), plan)
    placed = place_ffn(captured.graph, classification, set(captured.parameter_names), plan, cuts)
    attention_graph, attention_splits = placed.partition.attention_graph, {}
    if plan.attention_tp > 1:
        sharded = shard_attention(attention_graph, plan.attention_tp)
        attention_graph, attention_splits = sharded.graph, sharded.splits
    recompute = _recompute(captured, classification)
    stored = QuantizedTensors.of(quant) if quant is not None else None
    stored_names = checkpoint_names(model, captured)
    segments, layers, attrs = placed.segments, placed.partition.layers, captured.attrs
    if stored is not None and rewrite:
        if plan.attention_tp > 1:
            _check_attention_unquantized(attention_graph, quant, plan.attention_tp)
        graphs = quantize_graphs(segments, layers, attention_graph, attrs, stored, plan.ffn_ranks, mixers)
        segments, layers, attention_graph, attrs = graphs.segments, graphs.layers, graphs.attention_graph, graphs.attrs
        mixers = graphs.mixers
        for site in mixers:  # refused now, not when the artifact is loaded
            for linear in site.linears:
                quantized_linear(model.get_submodule(site.module), linear)
    return Built(
        plan=plan,
        attention_graph=attention_graph,
        out_spec=captured.out_spec,
        segments=segments,
        layers=layers,
        attrs=attrs,
        recompute=recompute,
        report=_report(model, plan, captured, placed, attention_splits, recompute, mixers, stored, stored_names),
        attention_splits=attention_splits,
        max_positions=captured.max_positions,
        mixers=mixers,
        quant=stored,
        views=captured.views,
        stored_names=stored_names,
    )


def checkpoint_names(model: PreTrainedModel, captured: CapturedGraph) -> frozenset[str]:
    """The captured attrs a checkpoint of ``model`` stores: its parameters and persistent buffers
    (a router's score bias is a buffer, saved and loaded like a weight); non-persistent buffers
    (rotary tables) and export's constants are computed, not stored."""
    persistent = model.state_dict(keep_vars=True).keys()
    return frozenset(captured.parameter_names) | {n for n in captured.attrs if n in persistent}


def _check_attention_unquantized(attention_graph: fx.Graph, quant: QuantScheme, tp: int) -> None:
    """``--attn-tp`` shards bf16 attention weights only: a checkpoint that quantizes attention-side
    linears (their scales would have to split with them) is refused naming the first one."""
    reads = {n.target for n in attention_graph.find_nodes(op="get_attr")}
    quantized = sorted(reads & {p.name for p in quant.parameters})
    if quantized:
        raise PlanError(
            f"--attn-tp {tp} on a checkpoint that quantizes attention-side weights ({quantized[0]} is "
            f"{quant.parameter(quantized[0]).format.value}; {quant.describe()}) is not supported: compile it with "
            "--attn-tp 1 (checkpoints that keep attention in bf16, as gpt-oss and the int4 MoE releases do, shard it)"
        )


def _recompute(captured: CapturedGraph, classification: Classification) -> str:
    """Why decode recomputes the prefix ("": it decodes against the KV cache, which lives in
    afdc's attention op: state computed inline cannot be cached)."""
    if classification.inline_mixers:
        return (
            "token mixers run inline, outside afdc's cached attention op "
            "(attention hard-coded in the model, or recurrent or convolutional mixers)"
        )
    return captured.recompute


def _report(
    model: PreTrainedModel,
    plan: Plan,
    captured: CapturedGraph,
    placed: Placement,
    attention_splits: dict[str, Split],
    recompute: str,
    mixers: list[MixerSite],
    stored: QuantizedTensors | None,
    stored_names: frozenset[str],
) -> Report:
    """The split's report; parameters counted as the model has them, bytes over every tensor the
    checkpoint stores (persistent buffers too), each as stored."""
    params = set(captured.parameter_names)
    attention_reads = {n.target for n in placed.partition.attention_graph.nodes if n.op == "get_attr"}
    attention_params = attention_reads & params
    ffn_weights = {w for b in placed.partition.layers for w in b.weights}
    size = stored_size(captured.attrs, stored)
    layers = [
        _priced(report, set(binding.weights) & stored_names, captured.attrs, size)
        for report, binding in zip(placed.layers, placed.partition.layers)
    ]
    return Report(
        model=getattr(model.config, "_name_or_path", "") or type(model).__name__,
        plan=str(plan),
        router=plan.router,
        decode_recomputes=recompute,
        attention_calls=len(AttentionCall.all_in(captured.graph)),
        attention_parameters=sum(captured.attrs[n].numel() for n in attention_params),
        ffn_parameters=sum(captured.attrs[n].numel() for n in ffn_weights & params),
        attention_weight_bytes=sum(size(n) for n in attention_reads & stored_names),
        ffn_weight_bytes=sum(size(n) for n in ffn_weights & stored_names),
        segment_graphs=len(placed.partition.segments),
        layers=layers,
        attention_tp=plan.attention_tp,
        attention_tp_split=sum(captured.attrs[n].numel() for n in attention_splits),
        max_positions=captured.max_positions,
        kv_bytes_per_token=kv_bytes_per_token(captured.graph),
        mixers=mixers,
    )


def stored_size(attrs: dict[str, torch.Tensor], stored: QuantizedTensors | None) -> Callable[[str], int]:
    """The bytes of a weight as the checkpoint stores it: a quantized parameter's data and scales
    (fp8, MXFP4), any other tensor at its dtype."""

    def size(name: str) -> int:
        quantized = stored.stored_bytes(name) if stored is not None else None
        return quantized if quantized is not None else attrs[name].numel() * attrs[name].element_size()

    return size


def _priced(
    layer: LayerReport, names: set[str], attrs: dict[str, torch.Tensor], size: Callable[[str], int]
) -> LayerReport:
    """``layer`` with its FFN weights' stored bytes, and those of its stacked routed experts (the
    tensors holding a matrix per expert, ``[E, ...]``)."""
    experts = [n for n in names if layer.experts and attrs[n].dim() >= 3 and attrs[n].shape[0] == layer.experts]
    return replace(layer, ffn_weight_bytes=sum(map(size, names)), expert_weight_bytes=sum(map(size, experts)))


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
    connector = ConnectorKind.parse(options.pop("connector", ConnectorKind.GLOO))
    plan = Plan.parse(plan, **options)
    if plan.dtype is not None and TORCH_DTYPES[plan.dtype] != model.dtype:
        raise PlanError(
            f"afdc.disaggregate splits the model in the dtype it is in ({model.dtype}), not {plan.dtype}: cast it "
            f"first (model.to({TORCH_DTYPES[plan.dtype]}) and leave dtype out), or give dtype to afdc compile, "
            "which converts the weights as it writes them"
        )
    _refuse_stored_quantized(model)
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
    traits = ModelTraits(
        incremental=not built.recompute,
        report=built.report,
        config=model.config,
        generation_config=getattr(model, "generation_config", None),
        max_positions=built.max_positions,
        default_positions=default_positions(model),
    )
    return DisaggregatedModel(
        attention=[attention] * built.plan.attention_ranks,
        ffn=ffn,
        traits=traits,
        micro_batches=built.plan.micro_batches,
        deployment=deployment_id(str(built.plan), attention.module.code, *(s.code for s in ffn[0].segments)),
        connector=connector,
    )


def _refuse_stored_quantized(model: PreTrainedModel) -> None:
    """A model transformers loaded with its weights still quantized (compressed-tensors keeps fp8
    weights and quantizes activations in its own forward hooks) cannot be captured as bf16 math;
    say how to get one that can, or how to run the quantized weights as stored."""
    stored = [(n, p.dtype) for n, p in model.named_parameters() if p.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)]
    if stored:
        name, dtype = stored[0]
        raise UnsupportedModelError(
            f"the model holds {len(stored)} weights still quantized ({name}: {dtype}), as transformers loads a "
            "compressed-tensors checkpoint by default. Either load it dequantized, "
            "from_pretrained(path, quantization_config=CompressedTensorsConfig(run_compressed=False)), "
            "or compile the checkpoint with `afdc compile PATH --plan ...`, which runs its fp8 weights as stored"
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
