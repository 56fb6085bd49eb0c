"""``afdc.disaggregate``: the whole pipeline, capture -> passes -> partition -> runtime."""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from afdc import capture as capture_mod
from afdc.capture import CapturedGraph
from afdc.errors import UnsupportedModelError
from afdc.partition.split import partition
from afdc.passes import graph_facts as gf
from afdc.passes.aliasing import split_writes
from afdc.passes.classify import Classification, classify
from afdc.passes.cleanup import strip_assertions
from afdc.passes.cut import Cut, RouterPlacement, select_cuts
from afdc.plan import Plan
from afdc.report import Report, layer_report
from afdc.runtime.model import DisaggregatedModel
from afdc.runtime.programs import AttentionProgram, FFNLayer, FFNProgram


def _cut(captured: CapturedGraph, placement: RouterPlacement) -> tuple[CapturedGraph, Classification, list[Cut]]:
    graph = strip_assertions(captured.graph)
    params = set(captured.parameter_names)
    classification = classify(graph, params)
    if not captured.token_dims_dynamic():
        raise UnsupportedModelError(
            "the forward specializes the batch size or sequence length (torch.export could not keep them symbolic)"
        )
    return captured, classification, select_cuts(graph, classification, params, placement)


def disaggregate(model: PreTrainedModel, plan: str | Plan = "1A1F", router: str = "ffn") -> DisaggregatedModel:
    """Split ``model`` into an attention program and an FFN program joined by a connector.

    Raises :class:`afdc.UnsupportedModelError` when the model cannot be split; it never returns
    an unsplit or half-split model.
    """
    plan = Plan.parse(plan)
    placement = RouterPlacement(router)
    captured, classification, cuts = _cut(capture_mod.capture(model), placement)
    if split_writes(captured.graph, (n for c in cuts for n in c.ffn_nodes)):
        captured, classification, cuts = _cut(capture_mod.capture(model, functional=True), placement)
    graph, params = captured.graph, set(captured.parameter_names)
    # The KV cache lives in afdc's attention op; state computed inline cannot be cached
    incremental = captured.incremental and not classification.inline_mixers
    tokens = gf.token_symbols(graph)
    layers_report = [layer_report(c, 0, tokens, params) for c in cuts]  # before partition moves nodes
    part = partition(graph, cuts)
    for lr, binding in zip(layers_report, part.layers):
        lr.segment = binding.segment

    attention = AttentionProgram(part.attention_graph, captured.attrs, captured.out_spec)
    ffn_weights = {w: captured.attrs[w] for b in part.layers for w in b.weights}
    ffn = FFNProgram(part.segments, [FFNLayer(b.segment, b.weights) for b in part.layers], ffn_weights)
    attention_params = attention.parameter_names()
    report = Report(
        model=getattr(model.config, "_name_or_path", "") or type(model).__name__,
        plan=str(plan),
        router=placement.value,
        incremental_decode=incremental,
        attention_calls=sum(1 for n in graph.nodes if n.target is torch.ops.afdc.attention.default),
        attention_parameters=sum(captured.attrs[n].numel() for n in attention_params),
        ffn_parameters=sum(ffn_weights[n].numel() for n in ffn.parameter_names()),
        segment_graphs=len(part.segments),
        layers=layers_report,
    )
    return DisaggregatedModel(attention, ffn, incremental, report, getattr(model, "generation_config", None))
