"""What the planner knows of a model: one decoded token's cost and each side's weights, per layer.

The inputs are what the graph says a token costs (:func:`afdc.planner.cost.decode_cost`) and the
weights each side holds (the split report's parameter counts times the weight dtype). Capturing a
long model is slow, so :func:`split_for_planning` captures only a prefix of its layers where that
prefix can stand for the whole (:mod:`afdc.planner.layers`).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, replace

import torch
from torch import nn

from afdc.api import Built, build
from afdc.errors import PlanError
from afdc.passes import graph_facts as gf
from afdc.plan import Plan
from afdc.planner.cost import DecodeCost, LayerCost, decode_cost
from afdc.planner.hardware import dtype_bytes
from afdc.planner.layers import LayerPattern, captured_prefix, layer_pattern
from afdc.quant.scheme import QuantScheme
from afdc.report import LayerReport


@dataclass(frozen=True)
class LayerFacts:
    """One decoder layer (an attention call and the FFN layer after it), per decoded token.

    ``count`` identical layers share one entry. Bytes are at the chosen KV and weight dtypes.
    """

    count: int
    kv_bytes: float  # KV held per sequence at the context
    attention_flops: float
    linear_flops: float  # this layer's share of the attention side's matmuls (LM head included)
    attention_weight_bytes: float  # this layer's share of the attention weights read per forward
    ffn_flops: float  # activated: top-k routed experts + shared experts + router, or the dense FFN
    ffn_fixed_bytes: float  # FFN weights every token reads: dense FFN, or shared experts + router
    expert_bytes: float  # one routed expert (0 for a dense FFN)
    experts: int  # routed experts (0 for a dense FFN)
    top_k: int
    to_ffn_bytes: float
    to_attn_bytes: float
    kv_read_bytes: float | None = None  # KV one step reads per sequence (None: all it holds)

    @property
    def kv_read(self) -> float:
        """KV bytes a step reads per sequence: less than it holds under sparse attention (DSA)."""
        return self.kv_bytes if self.kv_read_bytes is None else self.kv_read_bytes

    @property
    def moe(self) -> bool:
        return self.experts > 0


@dataclass(frozen=True)
class ModelFacts:
    """What the planner knows of a model at one context length and dtype choice."""

    name: str
    context: int
    weight_dtype: str
    kv_dtype: str
    cost: DecodeCost
    layers: tuple[LayerFacts, ...]
    attention_weight_bytes: float  # held by every attention GPU
    ffn_weight_bytes: float  # all FFN layers
    ffn_activated_bytes: float  # FFN weights one token reads
    cut_element_bytes: int = 2  # bytes per element of the hidden states as captured (the model's dtype)
    weights_as_stored: bool = False  # bytes as the checkpoint stores each weight; weight_dtype sets FLOPs only

    @property
    def layer_count(self) -> int:
        return sum(layer.count for layer in self.layers)

    @property
    def kv_bytes(self) -> float:
        return sum(layer.count * layer.kv_bytes for layer in self.layers)

    @property
    def attention_read_bytes(self) -> float:
        return sum(layer.count * layer.attention_weight_bytes for layer in self.layers)


# The split the planner reads graphs from: what a token costs does not depend on the plan, and
# one attention and one FFN rank keep every graph whole
_PLAN = Plan.parse("1A1F")

# Context at which a prefix capture is checked against itself: past every sliding window, so
# that layers differing only in their window cost differently
_CHECK_CONTEXT = 1 << 20


def split_for_planning(model: nn.Module, quant: QuantScheme | None = None) -> tuple[Built, LayerPattern | None]:
    """``(built, pattern)``: ``model``'s graphs for :func:`model_facts`, partitioned for one
    attention and one FFN GPU (what a token costs does not depend on the plan) and bound to no
    weights. Capture time grows with the layers captured and most models repeat one or two, so
    ``built`` holds only the prefix of the layers that :func:`afdc.planner.layers.layer_pattern`
    picks, when there is one and it stands for the whole model; else ``built`` is the whole model
    and ``pattern`` None. ``quant`` (the checkpoint's scheme) prices each weight at its stored bytes
    in ``built.report``; the graphs stay bf16."""
    try:
        short = _split_prefix(model, quant)
    except Exception:  # whatever fails on the short path, the full capture gives the answer, only slower
        short = None
    return short or (build(model, _PLAN, quant, rewrite=False), None)


def _split_prefix(model: nn.Module, quant: QuantScheme | None) -> tuple[Built, LayerPattern] | None:
    pattern = layer_pattern(model)
    if pattern is None:
        return None
    with captured_prefix(model, pattern):
        built = build(model, _PLAN, quant, rewrite=False)
    model_facts(built, _CHECK_CONTEXT, layers=pattern)  # raises LayerMismatch where the prefix cannot stand in
    return built, pattern


def _attention_parameters(built: Built) -> dict[str, torch.Tensor]:
    """The model parameters the attention graph reads (buffers and constants left out)."""
    attrs = built.attrs
    return {n: attrs[n] for n in built.attention_names() if isinstance(attrs[n], nn.Parameter)}


def _attention_stored(built: Built) -> list[str]:
    """The tensors the attention graph reads that the checkpoint stores (persistent buffers too)."""
    return [n for n in built.attention_names() if n in built.stored_names]


def _embedding_only_parameters(built: Built) -> list[str]:
    """Parameters the attention graph only gathers rows from: a decode step reads a row each,
    not the table (a table tied to the LM head is read in full by the head, so it stays)."""
    graph = built.attention_graph
    params = set(_attention_parameters(built))
    return [
        n.target
        for n in graph.nodes
        if gf.is_parameter(n, params) and n.users and all(gf.is_op(u, torch.ops.aten.embedding) for u in n.users)
    ]


@dataclass(frozen=True)
class _Side:
    """The attention side's weights by one measure (parameters, or bytes as stored)."""

    held: float  # by every attention GPU
    read: float  # per step: all but row-gathered tables


@dataclass(frozen=True)
class _Weights:
    """Parameter counts, stored bytes and FFN layers of the model a split stands for."""

    ffn_layers: list[LayerReport]  # the report's entry per FFN layer
    attention: _Side  # in parameters
    attention_bytes: _Side  # in bytes as the checkpoint stores them
    ffn: float
    ffn_bytes: float


def _weights(built: Built, layers: LayerPattern | None) -> _Weights:
    report = built.report
    embedding_only = _embedding_only_parameters(built)
    numel = {k: p.numel() for k, p in _attention_parameters(built).items()}
    measures = (
        (report.attention_parameters, numel.__getitem__, list(numel)),
        (report.attention_weight_bytes, built.weight_bytes, _attention_stored(built)),
    )
    if layers is None:
        sides = [_Side(total, total - sum(map(size, embedding_only))) for total, size, _ in measures]
        return _Weights(report.layers, *sides, report.ffn_parameters, report.ffn_weight_bytes)
    owners = [layers.layer_of(r.module) for r in report.layers]

    def whole(total: float, size, names) -> float:
        return layers.total(total, [(layers.layer_of(k), size(k)) for k in names])

    def side(total: float, size, names) -> _Side:
        held = whole(total, size, names)
        return _Side(held, held - whole(sum(map(size, embedding_only)), size, embedding_only))

    sides = [side(*measure) for measure in measures]
    ffn_layers = layers.expand(
        report.layers, owners,
        lambda r: (r.kind, r.experts, r.top_k, r.ffn_parameters, r.ffn_weight_bytes, r.expert_weight_bytes),
    )  # fmt: skip
    return _Weights(
        ffn_layers,
        *sides,
        layers.total(report.ffn_parameters, [(o, r.ffn_parameters) for o, r in zip(owners, report.layers)]),
        layers.total(report.ffn_weight_bytes, [(o, r.ffn_weight_bytes) for o, r in zip(owners, report.layers)]),
    )


def _split_moe_parameters(params: float, activated: float, experts: int, top_k: int) -> tuple[float, float]:
    """(fixed, per expert) parameters of an MoE layer from its total and its activated count.

    total = E * e + fixed and activated = k * e + fixed (router and shared experts are read by
    every token), so e = (total - activated) / (E - k): no model-specific names needed.
    """
    if experts <= top_k:
        return 0.0, params / experts
    per_expert = max(params - activated, 0.0) / (experts - top_k)
    return max(params - experts * per_expert, 0.0), per_expert


def _cut_element_bytes(built: Built) -> int:
    """Element size of the floating values crossing the cut, as captured (the model's dtype)."""
    for layer in built.report.layers:
        for crossing in layer.to_ffn:
            dtype = getattr(torch, crossing.dtype, None)
            if isinstance(dtype, torch.dtype) and dtype.is_floating_point:
                return dtype.itemsize
    return 2


def _paired_attention(cost: DecodeCost) -> list[LayerCost]:
    """The attention call before each FFN layer; where the counts differ (layers without an FFN,
    or without attention) each FFN layer gets the mean, which keeps the totals right."""
    n = len(cost.ffn_layers)
    if len(cost.attention_layers) == n:
        return cost.attention_layers
    mean = LayerCost(
        kv_bytes=cost.kv_bytes / n, kv_read_bytes=cost.kv_read_bytes / n, attention_flops=cost.attention_flops / n
    )
    return [mean] * n


def model_facts(
    built: Built,
    context: int,
    weight_dtype: str = "bf16",
    kv_dtype: str = "bf16",
    name: str | None = None,
    layers: LayerPattern | None = None,
    stored: bool = False,
) -> ModelFacts:
    """Per-token cost and per-side weights of a partitioned model (:func:`afdc.api.build`) at
    ``context``; with ``layers``, of the whole model ``built``'s prefix capture stands for
    (:func:`split_for_planning`). Weights are priced at ``weight_dtype`` or, ``stored``, each at the
    bytes the checkpoint stores it in (``built`` given its scheme: fp8 and MXFP4 data with their
    scales), ``weight_dtype`` then setting the FLOP rate only."""
    wb, report = dtype_bytes(weight_dtype), built.report
    cost = decode_cost(built, context, kv_dtype_bytes=dtype_bytes(kv_dtype), layers=layers)
    if not cost.ffn_layers:
        raise PlanError("the model has no FFN layers to disaggregate; there is nothing to plan")
    n = len(cost.ffn_layers)
    weights = _weights(built, layers)
    rows = []
    for ffn, layer, attn in zip(cost.ffn_layers, weights.ffn_layers, _paired_attention(cost)):
        activated = ffn.ffn_flops / 2  # every FFN weight a token touches does one multiply-add
        if layer.kind == "moe" and layer.experts and layer.top_k:
            fixed, per_expert = _split_moe_parameters(layer.ffn_parameters, activated, layer.experts, layer.top_k)
            experts, top_k = layer.experts, layer.top_k
        else:
            fixed, per_expert, experts, top_k = float(layer.ffn_parameters), 0.0, 0, 0
        fixed_bytes, expert_bytes = _stored_split(layer, fixed, per_expert) if stored else (fixed * wb, per_expert * wb)
        rows.append(
            LayerFacts(
                count=1,
                kv_bytes=attn.kv_bytes,
                kv_read_bytes=attn.kv_read_bytes,
                attention_flops=float(attn.attention_flops),
                linear_flops=cost.linear_flops / n,
                attention_weight_bytes=(weights.attention_bytes.read if stored else weights.attention.read * wb) / n,
                ffn_flops=ffn.ffn_flops,
                ffn_fixed_bytes=fixed_bytes,
                expert_bytes=expert_bytes,
                experts=experts,
                top_k=top_k,
                to_ffn_bytes=ffn.cut_bytes_to_ffn,
                to_attn_bytes=ffn.cut_bytes_to_attn,
            )
        )
    groups = Counter(replace(r, count=1) for r in rows)
    return ModelFacts(
        name=name or report.model,
        context=context,
        weight_dtype=weight_dtype,
        kv_dtype=kv_dtype,
        cost=cost,
        layers=tuple(replace(r, count=c) for r, c in groups.items()),
        attention_weight_bytes=weights.attention_bytes.held if stored else weights.attention.held * wb,
        ffn_weight_bytes=weights.ffn_bytes if stored else weights.ffn * wb,
        ffn_activated_bytes=(
            sum(r.ffn_fixed_bytes + r.top_k * r.expert_bytes for r in rows) if stored else cost.ffn_flops / 2 * wb
        ),
        weights_as_stored=stored,
        cut_element_bytes=_cut_element_bytes(built),
    )


def _stored_split(layer: LayerReport, fixed: float, per_expert: float) -> tuple[float, float]:
    """(fixed, per expert) stored bytes of an FFN layer: its stacked experts' bytes shared among
    them, the rest fixed; a layer without stacked experts at its mean bytes per parameter."""
    if layer.experts and layer.expert_weight_bytes:
        return layer.ffn_weight_bytes - layer.expert_weight_bytes, layer.expert_weight_bytes / layer.experts
    per_parameter = layer.ffn_weight_bytes / layer.ffn_parameters if layer.ffn_parameters else 0.0
    return fixed * per_parameter, per_expert * per_parameter
