"""Experts modules that loop over the experts hit (DBRX, LongCat-Flash): captured as grouped matmuls
over their own stacked weights, split at every plan like any MoE, checked against the monolith on a
left-padded batch. 2A2F is ``test_models_supported``'s; an artifact of each is in ``test_compile``,
LongCat-Flash served under vLLM in ``test_serve_mixers``."""

from __future__ import annotations

import pytest
import torch

import afdc
from afdc.capture.expert_loops import check_against_own_forward, stacks_of
from afdc.ops import AttentionCall, RecvCall, SendCall
from models_supported import catalog

NEW_TOKENS = 8


@pytest.mark.parametrize("model_type", ["dbrx", "longcat_flash"])
def test_loop_experts_split_at_1a1f_and_1a2f_and_decode_incrementally(model_type):
    model = catalog.greedy(model_type)
    ids, mask = catalog.left_padded(model.config.vocab_size)
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=mask).logits
    expected = model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS)
    valid = mask.bool()
    for plan in ("1A1F", "1A2F"):
        dm = afdc.disaggregate(model, plan)
        report = dm.report()
        assert dm.incremental and not report.decode_recomputes, report.decode_recomputes
        if plan == "1A2F":
            assert {layer.ffn_split for layer in report.layers if layer.kind == "moe"} == {"ep"}
        elif model_type == "longcat_flash":
            _check_shortcut_and_identity_experts(model, dm)
        out = dm(ids, attention_mask=mask).logits
        assert (out[valid] - ref[valid]).abs().max() <= 1e-4 * ref[valid].abs().max(), plan
        assert torch.equal(dm.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS), expected), plan


def _check_shortcut_and_identity_experts(model, dm) -> None:
    """LongCat-Flash's shortcut-connected MoE reads the stream after the first attention and is
    added after the second attention and MLP: it is sent before that attention and received after
    it, so the FFN side computes it meanwhile. Its zero-computation experts take no FFN weights:
    the stacked gate/up rows the checkpoint keeps for them are not held, and only the hidden state
    crosses."""
    report = dm.report()
    moe = next(layer for layer in report.layers if layer.kind == "moe")
    graph = dm.attention.module.graph
    order = {n: i for i, n in enumerate(graph.nodes)}
    send = next(c.node for c in SendCall.all_in(graph) if c.layer == moe.index)
    recv = next(c.node for c in RecvCall.all_in(graph) if c.layer == moe.index)
    second = AttentionCall.all_in(graph)[1].node
    assert order[send] < order[second] < order[recv]

    config = model.config
    hidden, inner, zero = config.hidden_size, config.expert_ffn_hidden_size, config.zero_expert_num
    ffn = set(dm.ffn.parameter_names())
    stored = sum(p.numel() for n, p in model.named_parameters() if n in ffn)
    assert report.ffn_parameters == stored - zero * 2 * inner * hidden
    assert [c.shape_per_token for c in moe.to_ffn] == [[hidden]]


class _Experts(torch.nn.Module):
    """The experts contract in a Python loop, its stacks registered up, gate, down."""

    def __init__(self, experts=3, hidden=8, inner=4):
        super().__init__()
        self.num_experts = experts
        self.up = torch.nn.Parameter(torch.randn(experts * inner, hidden))
        self.gate = torch.nn.Parameter(torch.randn(experts * inner, hidden))
        self.down = torch.nn.Parameter(torch.randn(experts * inner, hidden))
        self.act = torch.nn.SiLU()

    def forward(self, hidden_states, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden_states)
        shape = (self.num_experts, -1, hidden_states.shape[-1])
        for e in top_k_index.unique().tolist():
            token, choice = torch.where(top_k_index == e)
            x = hidden_states[token]
            h = self.act(x @ self.gate.view(shape)[e].T) * (x @ self.up.view(shape)[e].T)
            out.index_add_(0, token, (h @ self.down.view(shape)[e]) * top_k_weights[token, choice, None])
        return out


def test_a_loop_read_in_the_wrong_layout_is_refused_not_miscaptured():
    """The stacks are read in registration order (gate, up, down); a module that registers them
    otherwise computes something else, which the check against its own forward catches."""
    module = _Experts()
    with pytest.raises(afdc.UnsupportedModelError, match="differs from its own forward"):
        check_against_own_forward("experts", module, stacks_of("experts", module), 8)
    module.num_experts = 5  # 12 rows are no whole blocks of 5 experts
    with pytest.raises(afdc.UnsupportedModelError, match="cannot read as stacked experts"):
        stacks_of("experts", module)
