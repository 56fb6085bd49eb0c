"""Each graph pass's rules, one decision at a time, on small graphs exported from tiny modules.

The model catalogue tests the passes end to end; these tests call one pass directly on a graph of
a few nodes and assert the decision one rule makes, so a failure names the rule that broke.
Layer graphs are captured as afdc captures a model (parameters as ``get_attr`` nodes, symbolic
batch and sequence sizes); segment graphs as the partition writes them (weights, then inputs,
every input's first dim a symbolic token count).
"""

from __future__ import annotations

import pytest
import sympy
import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn
from transformers import Qwen3MoeConfig
from transformers.models.llama.modeling_llama import LlamaRMSNorm
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

import afdc.ops  # noqa: F401 (registers afdc::attention)
from afdc import segment
from afdc.errors import PlanError, UnsupportedModelError
from afdc.lowering.fuse_moe import fuse_moe
from afdc.lowering.fuse_norms import fuse_norms
from afdc.partition.cut import RouterPlacement, select_cuts
from afdc.partition.mincut import INF, FlowGraph
from afdc.partition.shard import FFNParallel, PartialSumsMeetNonLinearOps, shard_segment
from afdc.passes.classify import classify
from afdc.passes.cleanup import drop_sentinel_masks, strip_assertions
from afdc.passes.expert_routing import expert_routing
from afdc.passes.graph_facts import op_name
from afdc.segment import ExpertRouting, Split

VOCAB, H, INTER, HEADS, EXPERTS, TOP_K = 16, 8, 16, 2, 4, 2


# -- tiny modules ----------------------------------------------------------------------------------


class MLP(nn.Module):
    def __init__(self, inter: int = INTER):
        super().__init__()
        self.up = nn.Linear(H, inter, bias=False)
        self.down = nn.Linear(inter, H, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.up(x)))


class InlineAttention(nn.Module):
    """Attention written out: ``softmax(q k^T) x``, a product of two activations."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.o = (nn.Linear(H, H, bias=False) for _ in range(3))

    def forward(self, x):
        return self.o(torch.softmax(self.q(x) @ self.k(x).transpose(-1, -2), dim=-1) @ x)


class OpAttention(InlineAttention):
    """Attention through afdc's opaque op, as capture routes a model's attention."""

    def forward(self, x):
        b, s, _ = x.shape
        q, k = (p(x).view(b, s, HEADS, H // HEADS).transpose(1, 2) for p in (self.q, self.k))
        out = torch.ops.afdc.attention(q, k, k, None, 0, 0.5, 0.0, None, 0)
        return self.o(out.reshape(b, s, H))


class Body(nn.Module):
    """``body(self, *inputs)`` over the weights of ``parts``, its submodules."""

    def __init__(self, body, **parts: nn.Module):
        super().__init__()
        self.body = body
        for name, part in parts.items():
            self.add_module(name, part)

    def forward(self, *inputs):
        return self.body(self, *inputs)


def experts(act: str = "silu") -> Qwen3MoeExperts:
    """transformers' stacked experts, computed as capture has them: grouped matmuls."""
    config = Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=6, num_experts=EXPERTS, hidden_act=act)
    config._experts_implementation = "grouped_mm"
    torch.manual_seed(0)
    module = Qwen3MoeExperts(config)
    nn.init.normal_(module.gate_up_proj, std=H**-0.5)
    nn.init.normal_(module.down_proj, std=0.5)
    return module


def routed(m, x, scores):
    """The experts over the top-k of the router scores the attention side sends."""
    weights, ids = scores.topk(TOP_K, dim=-1)
    return m.experts(x, ids, weights.softmax(-1))


# -- graphs ----------------------------------------------------------------------------------------


def _rebuild(ep: torch.export.ExportedProgram, weight, value) -> fx.Graph:
    """``ep``'s graph with parameter ``i`` (named ``fqn``) made by ``weight(graph, i, fqn)`` and user
    input ``i`` (named ``name``) by ``value(graph, i, name)``, cleaned up as capture's graph is."""
    params = ep.graph_signature.inputs_to_parameters
    graph, env, counts = fx.Graph(), {}, [0, 0]
    for node in ep.graph.nodes:
        if node.op == "placeholder":
            is_param = node.name in params
            make, key = (weight, params[node.name]) if is_param else (value, node.name)
            env[node] = make(graph, counts[not is_param], key)
            env[node].meta = dict(node.meta)
            counts[not is_param] += 1
        else:
            env[node] = graph.node_copy(node, env.__getitem__)
    return drop_sentinel_masks(strip_assertions(graph))


def layer_graph(body, **parts: nn.Module) -> tuple[fx.Graph, set[str]]:
    """A captured graph of ``input_ids`` -> an embedding -> ``body(m, hidden)`` over a symbolic batch
    and sequence, and its parameter names."""
    module = Body(lambda m, ids: body(m, m.embed(ids)), embed=nn.Embedding(VOCAB, H), **parts).eval()
    dims = (({0: torch.export.Dim("batch"), 1: torch.export.Dim("seq")},),)
    ep = torch.export.export(module, (torch.randint(0, VOCAB, (2, 5)),), dynamic_shapes=dims, strict=False)
    graph = _rebuild(ep, lambda g, i, fqn: g.get_attr(fqn), lambda g, i, name: g.placeholder("input_ids"))
    return graph, set(ep.graph_signature.inputs_to_parameters.values())


def segment_graph(module: nn.Module, *inputs: torch.Tensor) -> tuple[fx.Graph, list[str], tuple]:
    """``module`` as an FFN segment ``(w0.., x0..) -> outputs`` over a symbolic token count, with
    its weights' names and the token symbols ``(batch, tokens)`` (here one sequence of T rows)."""
    tokens = torch.export.Dim("tokens")
    ep = torch.export.export(module.eval(), inputs, dynamic_shapes=(({0: tokens},) * len(inputs),), strict=False)
    graph = _rebuild(ep, lambda g, i, fqn: segment.add_weight(g, i), lambda g, i, name: segment.add_input(g, i))
    count = segment.inputs(graph)[0].meta["val"].shape[0].node.expr
    return graph, list(ep.graph_signature.inputs_to_parameters.values()), (sympy.Integer(1), count)


def program(module: nn.Module, *inputs: torch.Tensor) -> fx.GraphModule:
    """``module`` exported to a runnable graph module, cleaned up as the passes receive it."""
    gm = torch.export.export(module.eval(), inputs, strict=False).module()
    drop_sentinel_masks(strip_assertions(gm.graph))
    gm.recompile()
    return gm


def nodes(graph: fx.Graph, name: str) -> list[fx.Node]:
    """The nodes calling the aten op ``name``."""
    return [n for n in graph.nodes if op_name(n) == name]


def reading(graph: fx.Graph, weight: str) -> fx.Node:
    """The op that reads parameter ``weight``."""
    (attr,) = [n for n in graph.nodes if n.op == "get_attr" and n.target == weight]
    (user,) = attr.users
    return user


def region_weights(classification) -> list[list[str]]:
    """Each FFN region's parameters, by name."""
    return [sorted(n.target for n in r.nodes if n.op == "get_attr") for r in classification.regions]


MLP_WEIGHTS = ["mlp.down.weight", "mlp.up.weight"]


def stream(graph: fx.Graph) -> fx.Node:
    """The residual stream's first value: the embedding's output."""
    (embedding,) = nodes(graph, "embedding")
    return embedding


# -- classify ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("body", [
    lambda m, x: x * 0.5 + m.mlp(x),  # the stream scaled before the add (``residual * alpha + branch``)
    lambda m, x: x + 0.5 * m.mlp(x),  # the branch scaled
], ids=["stream-scaled", "branch-scaled"])
def test_a_residual_add_is_found_through_a_scale(body):
    graph, params = layer_graph(body, mlp=MLP())
    classification = classify(graph, params)
    assert region_weights(classification) == [MLP_WEIGHTS]
    (region,) = classification.regions
    assert region.stream is stream(graph)
    assert not any(op_name(n) == "mul" and stream(graph) in n.args for n in region.nodes)  # the scaled stream


class Shift(nn.Module):
    """A learned shift and scale per channel, as ZAYA1's residual adds apply to stream and branch."""

    def __init__(self):
        super().__init__()
        self.bias, self.scale = nn.Parameter(torch.randn(H)), nn.Parameter(torch.randn(H))

    def forward(self, x):
        return (x + self.bias) * self.scale


def test_a_stream_shifted_and_scaled_by_weights_is_found_two_ops_deep():
    """``(h + b) * s + (x + c) * r``: the stream ``x`` is found under its shift and scale, and the
    branch's region is the MLP with its own shift and scale."""
    graph, params = layer_graph(lambda m, x: m.out(m.mlp(x)) + m.res(x), mlp=MLP(), out=Shift(), res=Shift())
    classification = classify(graph, params)
    assert region_weights(classification) == [sorted([*MLP_WEIGHTS, "out.bias", "out.scale"])]
    assert classification.regions[0].stream is stream(graph)


def test_a_parallel_branch_is_split_into_terms_and_only_the_mlp_term_is_ffn():
    graph, params = layer_graph(lambda m, x: x + (m.attn(x) + m.mlp(x)), attn=InlineAttention(), mlp=MLP())
    classification = classify(graph, params)
    assert region_weights(classification) == [MLP_WEIGHTS]
    (region,) = classification.regions
    assert region.stream is stream(graph)
    assert region.nodes[-1] is reading(graph, "mlp.down.weight")  # the MLP term, not the sum of the two
    products = nodes(graph, "matmul")
    assert len(products) == 2 and set(products) <= set(classification.inline_mixers)
    assert not set(products) & set(region.nodes)


@pytest.mark.parametrize("mixer", [InlineAttention, OpAttention], ids=["activation-product", "afdc-attention"])
def test_a_branch_that_mixes_tokens_is_not_an_ffn_region(mixer):
    graph, params = layer_graph(lambda m, x: (h := x + m.attn(x)) + m.mlp(h), attn=mixer(), mlp=MLP())
    classification = classify(graph, params)
    assert region_weights(classification) == [MLP_WEIGHTS]  # the attention branch holds weight matrices too
    (after_attention,) = reading(graph, "attn.o.weight").users  # the residual add of the attention branch
    assert classification.regions[0].stream is after_attention


class LowRank(nn.Module):
    """A low-rank branch added to its own input (Gemma 3n's LAuReL): ``x + B(A(x))``."""

    def __init__(self, rank: int):
        super().__init__()
        self.a = nn.Linear(H, rank, bias=False)
        self.b = nn.Linear(rank, H, bias=False)

    def forward(self, x):
        return x + self.b(self.a(x))


@pytest.mark.parametrize("rank", [1, H // 2 - 1])
def test_a_branch_smaller_than_a_square_matrix_stays_with_attention(rank):
    """Low-rank weights (fewer elements than one H x H matrix) are not worth a round trip: their
    branch is no FFN region, whether added to its own input or to the stream; the MLP's is."""
    graph, params = layer_graph(lambda m, x: (h := x + m.low(x)) + m.mlp(h), low=LowRank(rank), mlp=MLP())
    assert region_weights(classify(graph, params)) == [MLP_WEIGHTS]
    graph, params = layer_graph(lambda m, x: m.low(x), low=LowRank(H // 2))  # 2 x H x H/2: a square's worth
    assert region_weights(classify(graph, params)) == [["low.a.weight", "low.b.weight"]]


def test_a_model_whose_only_branch_mixes_tokens_has_no_ffn_region():
    graph, params = layer_graph(lambda m, x: x + m.attn(x), attn=InlineAttention())
    with pytest.raises(UnsupportedModelError, match="no FFN region found"):
        classify(graph, params)


# -- cut ---------------------------------------------------------------------------------------------


def pre_norm(m, x):
    return x + m.mlp(m.norm(x))


def cut_of(graph: fx.Graph, params: set[str]):
    (cut,) = select_cuts(graph, classify(graph, params), params, RouterPlacement.FFN)
    return cut


def test_a_tie_in_bytes_goes_to_the_smaller_ffn_side():
    """float32 throughout: the stream, the normed value and every value between cost the same, so
    the norm stays with the stream and the attention side sends the normed hidden state."""
    graph, params = layer_graph(pre_norm, norm=LlamaRMSNorm(H), mlp=MLP())
    cut = cut_of(graph, params)
    assert cut.to_ffn == [reading(graph, "norm.weight")]  # weight * normed: the norm's last op
    assert not set(nodes(graph, "rsqrt")) & set(cut.ffn_nodes)
    assert cut.to_attn == [reading(graph, "mlp.down.weight")]


def test_the_cut_sends_the_fewest_bytes_even_when_the_ffn_side_grows():
    """A bf16 stream whose norm weight is float32, so ``weight * normed`` widens to 4 bytes: the
    2-byte normalized value crosses and the widening multiply moves to the FFN side."""
    graph, params = layer_graph(
        lambda m, x: (h := x.to(torch.bfloat16)) + m.mlp(m.norm(h)), norm=LlamaRMSNorm(H), mlp=MLP()
    )
    cut = cut_of(graph, params)
    weighted = reading(graph, "norm.weight")
    (normed,) = [a for a in weighted.args if a.op != "get_attr"]
    assert cut.to_ffn == [normed] and normed.meta["val"].dtype == torch.bfloat16
    assert weighted in cut.ffn_nodes and weighted.meta["val"].dtype == torch.float32
    assert not set(nodes(graph, "rsqrt")) & set(cut.ffn_nodes)


def test_max_flow_and_the_smallest_sink_side():
    flow = FlowGraph()
    for u, v, cap in [("s", "a", 3), ("a", "t", 1), ("s", "b", 1), ("b", "t", 3), ("a", "b", 1)]:
        flow.add_edge(u, v, cap)
    assert flow.max_flow("s", "t") == 3
    assert flow.sink_side("t") == {"t", "b"}  # a's edges saturate: a stays with the source
    tie = FlowGraph()
    tie.add_edge("s", "a", 1)
    tie.add_edge("a", "t", 1)  # the same cost either side of a
    assert tie.max_flow("s", "t") == 1 and tie.sink_side("t") == {"t"}
    pinned = FlowGraph()
    pinned.add_edge("s", "t", INF)
    assert pinned.max_flow("s", "t") == INF


# -- shard -------------------------------------------------------------------------------------------


def mlp_segment(after=None, inter: int = INTER, **parts: nn.Module):
    """A two-linear MLP segment over ``[T, H]`` rows, with ``after(m, out)`` applied to its output."""
    body = (lambda m, x: m.mlp(x)) if after is None else (lambda m, x: after(m, m.mlp(x)))
    return segment_graph(Body(body, mlp=MLP(inter), **parts), torch.randn(5, H))


def test_a_two_linear_mlp_is_split_column_then_row():
    graph, names, _ = mlp_segment()
    sharded = shard_segment(graph, FFNParallel.TP, 2, "layer", names)
    assert names == ["mlp.up.weight", "mlp.down.weight"]
    assert sharded.splits == [Split(dim=0), Split(dim=1)]  # up by output column, down by input row
    assert sharded.reduce == ["sum"]
    assert segment.rank(sharded.graph) is not None


@pytest.mark.parametrize("after, op", [
    (lambda m, out: m.norm(out), "pow"),  # a norm of the summed output: its square is the first non-linear op
    (lambda m, out: F.silu(out), "silu"),
], ids=["norm", "silu"])
def test_a_partial_sum_meeting_a_non_linear_op_is_refused(after, op):
    graph, names, _ = mlp_segment(after, norm=LlamaRMSNorm(H))
    with pytest.raises(PartialSumsMeetNonLinearOps) as raised:
        shard_segment(graph, FFNParallel.TP, 2, "layer", names)
    assert raised.value.nodes == [nodes(graph, op)[-1].name]  # the op after the down projection


def test_a_weight_dim_the_ranks_do_not_divide_is_refused_by_name():
    graph, names, _ = mlp_segment(inter=6)
    with pytest.raises(PlanError, match=r"4 FFN ranks do not divide dimension 0 \(6\) of mlp\.up\.weight") as raised:
        shard_segment(graph, FFNParallel.TP, 4, "layer", names)
    assert not isinstance(raised.value, PartialSumsMeetNonLinearOps)


# -- expert routing ----------------------------------------------------------------------------------


def routing_of(body, **parts: nn.Module) -> ExpertRouting | None:
    """The expert routing proven for ``body(m, x, scores)`` split over two expert-parallel ranks."""
    module = Body(body, experts=experts(), **parts)
    graph, names, tokens = segment_graph(module, torch.randn(5, H), torch.randn(5, EXPERTS))
    sharded = shard_segment(graph, FFNParallel.EP, 2, "layer", names)
    split = {name: s for name, s in zip(names, sharded.splits)}
    assert split["experts.gate_up_proj"] == split["experts.down_proj"] == Split(dim=0, experts=True)
    return expert_routing(sharded.graph, tokens)


def test_rows_zeroed_by_a_mask_stay_an_expert_ranks_own():
    """Sentinel masks of ids that are not shown to be a top-k (here an input) stay in the graph:
    ``masked_fill(rows, mask, 0)`` keeps the rows another rank owns zero, whatever the mask's own
    layout, so the experts still split over expert-parallel ranks."""
    module = Body(lambda m, x, ids, weights: m.experts(x, ids, weights), experts=experts())
    module.experts._is_expert_parallel = True  # transformers 5.17's form
    ids = torch.randint(0, EXPERTS, (5, TOP_K))
    graph, names, _ = segment_graph(module, torch.randn(5, H), ids, torch.rand(5, TOP_K))
    assert nodes(graph, "masked_fill")
    sharded = shard_segment(graph, FFNParallel.EP, 2, "layer", names)
    split = {name: s for name, s in zip(names, sharded.splits)}
    assert split["experts.gate_up_proj"] == split["experts.down_proj"] == Split(dim=0, experts=True)


def test_experts_over_the_top_k_of_an_input_are_routed_by_it():
    assert routing_of(routed) == ExpertRouting(input=1, per_rank=EXPERTS // 2, top_k=TOP_K)


def _router_on_the_ffn_side(m, x, scores):
    weights, ids = m.router(x).topk(TOP_K, dim=-1)
    return m.experts(x, ids, weights.softmax(-1))


def _weights_normalized_over_tokens(m, x, scores):
    weights, ids = scores.topk(TOP_K, dim=-1)
    return m.experts(x, ids, weights.softmax(0))


def test_expert_ids_not_the_top_k_of_an_input_are_not_routed():
    assert routing_of(_router_on_the_ffn_side, router=nn.Linear(H, EXPERTS, bias=False)) is None


@pytest.mark.parametrize("body", [
    _weights_normalized_over_tokens,
    lambda m, x, scores: routed(m, x, scores) + x.mean(0),
], ids=["routing-weights", "added-term"])
def test_experts_whose_output_mixes_tokens_are_not_routed(body):
    assert routing_of(body) is None


# -- kernel substitution -----------------------------------------------------------------------------


# transformers zeroes the rows of out-of-range expert ids around each grouped matmul: under its own
# expert parallelism (5.24), always (5.17)
@pytest.mark.parametrize("sentinel_masks", [False, True], ids=["plain", "sentinel-masks"])
def test_transformers_experts_and_router_become_fused_moe_with_the_same_result(sentinel_masks):
    def body(m, x, logits):
        weights, ids = logits.softmax(-1).topk(TOP_K, dim=-1)
        return m.experts(x, ids, weights / weights.sum(-1, keepdim=True))

    module = Body(body, experts=experts())
    module.experts._is_expert_parallel = sentinel_masks
    x, logits = torch.randn(5, H), torch.randn(5, EXPERTS)
    gm = program(module, x, logits)
    with torch.no_grad():
        before = gm(x, logits)
    report = fuse_moe(gm.graph)
    gm.recompile()
    assert report.fused == {"fused_moe": 1, "moe_route": 1}
    assert not any("grouped_mm" in str(n.target) or op_name(n).startswith(("masked_fill", "clamp"))
                   for n in gm.graph.nodes)
    with torch.no_grad():
        torch.testing.assert_close(gm(x, logits), before, atol=1e-5, rtol=1e-5)


def test_experts_with_an_activation_the_kernel_lacks_are_left_alone():
    gm = program(Body(routed, experts=experts("relu")), torch.randn(5, H), torch.randn(5, EXPERTS))
    report = fuse_moe(gm.graph)
    assert "fused_moe" not in report.fused
    assert any("activation relu" in why for why in report.skipped)
    assert len([n for n in gm.graph.nodes if "grouped_mm" in str(n.target)]) == 2


def _norm():
    torch.manual_seed(0)
    norm = LlamaRMSNorm(H)
    nn.init.normal_(norm.weight)
    return norm


def test_a_written_out_rms_norm_becomes_the_norm_op_with_the_same_result():
    x = torch.randn(2, 5, H)
    gm = program(Body(lambda m, x: m.norm(x), norm=_norm()), x)
    before = gm(x)
    report = fuse_norms(gm.graph)
    gm.recompile()
    assert report.fused == {"rms_norm": 1}
    (op,) = [n for n in gm.graph.nodes if n.target is torch.ops.afdc.rms_norm.default]
    assert op.args[1].op == "get_attr" and op.args[1].target == "norm.weight"  # the weight goes in too
    assert not nodes(gm.graph, "rsqrt") and not nodes(gm.graph, "mean")
    torch.testing.assert_close(gm(x), before, atol=1e-5, rtol=1e-5)


def test_a_residual_add_before_the_norm_goes_into_the_kernel():
    x, residual = torch.randn(2, 5, H), torch.randn(2, 5, H)
    gm = program(Body(lambda m, x, r: (m.norm(h := x + r), h), norm=_norm()), x, residual)
    before = gm(x, residual)
    assert fuse_norms(gm.graph).fused == {"rms_norm": 1}
    gm.recompile()
    assert len(nodes(gm.graph, "add_rms_norm")) == 1
    assert not nodes(gm.graph, "add") and not nodes(gm.graph, "rsqrt")
    for got, want in zip(gm(x, residual), before):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_a_norm_over_the_wrong_dim_is_left_alone():
    def over_tokens(m, x):  # RMSNorm written out, but the mean is over dim 0
        h = x.float()
        return m.norm.weight * (h * torch.rsqrt(h.pow(2).mean(0, keepdim=True) + 1e-6))

    x = torch.randn(5, H)
    gm = program(Body(over_tokens, norm=_norm()), x)
    before = gm(x)
    report = fuse_norms(gm.graph)
    gm.recompile()
    assert report.fused == {}
    assert any("not over the last dim" in why for why in report.skipped)
    assert len(nodes(gm.graph, "rsqrt")) == 1
    torch.testing.assert_close(gm(x), before)
