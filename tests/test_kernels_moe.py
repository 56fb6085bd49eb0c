"""The MoE kernels (routing, fused experts) against their PyTorch references, and the references
against transformers' routers and experts and a naive per-token loop. On CPU the kernels run in
Triton's interpreter, so the shapes are tiny; the hidden and intermediate sizes are multiples of
no block size."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import DeepseekV2Config, DeepseekV3Config, DeepseekV4Config, Qwen3MoeConfig
from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter
from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4Experts
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts, Qwen3MoeTopKRouter

from afdc.codegen import fused_moe as fused_moe_module
from afdc.codegen import moe_routing
from afdc.codegen.fused_moe import align_pairs, fused_moe, fused_moe_reference, fused_moe_triton
from afdc.codegen.moe_routing import moe_route, moe_route_reference, moe_route_triton

HIDDEN, INTER = 24, 20

# moe_route's arguments after the logits, as the routers of transformers' MoE models set them
ROUTERS = {
    "softmax_top1": (1, "softmax", False, 1, 1, "max", None, 1.0),
    "softmax_renorm": (2, "softmax", True, 1, 1, "max", None, 1.0),  # Mixtral, Qwen-MoE
    "v2_max_groups": (3, "softmax", False, 4, 2, "max", None, 16.0),  # DeepSeek-V2
    "v3_sigmoid_top2_sum": (3, "sigmoid", True, 4, 2, "top2_sum", "bias", 2.5),  # DeepSeek-V3
}
TOL = {torch.float32: {"atol": 1e-5, "rtol": 1e-5}, torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2}}


def _router_args(name: str, num_experts: int, gen: torch.Generator) -> tuple:
    args = ROUTERS[name]
    bias = torch.randn(num_experts, generator=gen) * 0.1 if args[6] == "bias" else None
    return (*args[:6], bias, args[7])


def _by_id(weights: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The k slots of each token in expert order, to compare with routers that return them unsorted."""
    order = ids.argsort(dim=-1)
    return weights.gather(1, order), ids.gather(1, order)


# -- routing -------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [0, 1, 5])
@pytest.mark.parametrize("router", list(ROUTERS))
def test_route_kernel_matches_reference(triton_interpret, router, tokens, dtype):
    gen = torch.Generator().manual_seed(tokens)
    logits = torch.randn(tokens, 16, generator=gen).to(dtype)
    args = _router_args(router, 16, gen)
    weights, ids = moe_route_triton(logits, *args)
    ref_weights, ref_ids = moe_route_reference(logits, *args)
    assert weights.shape == ids.shape == (tokens, args[0])
    assert weights.dtype == torch.float32 and ids.dtype == torch.int64
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_weights, atol=1e-6, rtol=1e-5)
    if tokens and args[2]:
        torch.testing.assert_close(weights.sum(-1), torch.full((tokens,), args[7]))


def _check_against_hf(router: torch.nn.Module, hidden: torch.Tensor, args: tuple, *without: tuple) -> None:
    """Both routes choose and weigh as ``router``; each of ``without`` (the arguments less one
    feature: bias, groups, ...) chooses otherwise, so the case exercises that feature."""
    logits, hf_weights, hf_ids = router(hidden)
    hf_weights, hf_ids = _by_id(hf_weights.float(), hf_ids)
    for route in (moe_route_reference, moe_route_triton):
        weights, ids = _by_id(*route(logits, *args))
        assert torch.equal(ids, hf_ids)
        torch.testing.assert_close(weights, hf_weights, atol=1e-6, rtol=1e-5)
    for other in without:
        assert not torch.equal(_by_id(*moe_route_reference(logits, *other))[1], hf_ids)


def test_route_matches_qwen3_moe_router(triton_interpret):
    torch.manual_seed(0)
    config = Qwen3MoeConfig(hidden_size=16, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True)
    router = Qwen3MoeTopKRouter(config)
    torch.nn.init.normal_(router.weight)
    _check_against_hf(router, torch.randn(5, 16), (2, "softmax", True, 1, 1, "max", None, 1.0))


def test_route_matches_deepseek_v2_router(triton_interpret):
    torch.manual_seed(1)
    config = DeepseekV2Config(
        hidden_size=16,
        num_attention_heads=2,
        n_routed_experts=16,
        num_experts_per_tok=3,
        topk_method="group_limited_greedy",
        n_group=4,
        topk_group=2,
        routed_scaling_factor=16.0,
    )
    router = DeepseekV2TopkRouter(config)
    torch.nn.init.normal_(router.weight)
    args = (3, "softmax", False, 4, 2, "max", None, 16.0)
    _check_against_hf(router, torch.randn(5, 16), args, (3, "softmax", False, 1, 1, "max", None, 16.0))


def test_route_matches_deepseek_v3_router(triton_interpret):
    torch.manual_seed(2)
    config = DeepseekV3Config(
        hidden_size=16,
        n_routed_experts=16,
        num_experts_per_tok=3,
        n_group=4,
        topk_group=2,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
    )
    router = DeepseekV3TopkRouter(config)
    torch.nn.init.normal_(router.weight)
    bias = router.e_score_correction_bias.copy_(torch.randn(16) * 0.2)
    args = (3, "sigmoid", True, 4, 2, "top2_sum", bias, 2.5)
    without = [
        (3, "sigmoid", True, 4, 2, "top2_sum", None, 2.5),
        (3, "sigmoid", True, 1, 1, "top2_sum", bias, 2.5),
        (3, "sigmoid", True, 4, 2, "max", bias, 2.5),
    ]
    _check_against_hf(router, torch.randn(5, 16), args, *without)


def test_route_bias_chooses_but_does_not_weigh(triton_interpret):
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    bias = torch.tensor([0.0, 0.0, 0.0, 10.0])
    weights, ids = moe_route_triton(logits, 1, "sigmoid", False, 1, 1, "max", bias, 1.0)
    assert ids.tolist() == [[3]]
    torch.testing.assert_close(weights, torch.sigmoid(torch.tensor([[-1.0]])))


def test_route_rejects_bad_arguments():
    logits = torch.randn(2, 8)
    with pytest.raises(ValueError, match="scoring"):
        moe_route(logits, 2, "relu", False, 1, 1, "max", None, 1.0)
    with pytest.raises(ValueError, match="group_score"):
        moe_route(logits, 2, "softmax", False, 4, 2, "mean", None, 1.0)
    with pytest.raises(ValueError, match="groups"):
        moe_route(logits, 2, "softmax", False, 3, 2, "max", None, 1.0)


def test_route_op_dispatch(triton_interpret, monkeypatch):
    launched = []
    monkeypatch.setattr(moe_routing, "moe_route_triton", lambda *a: launched.append(1) or moe_route_triton(*a))
    logits = torch.randn(3, 8)
    weights, ids = moe_route(logits, 2, "softmax", True, 1, 1, "max", None, 1.0)
    assert launched == [1]
    ref_weights, ref_ids = moe_route_reference(logits, 2, "softmax", True, 1, 1, "max", None, 1.0)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_weights)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    if not torch.cuda.is_available():  # on CPU without the interpreter the reference runs
        moe_route(logits, 2, "softmax", True, 1, 1, "max", None, 1.0)
        assert launched == [1]


def test_route_op_registration():
    args = (torch.randn(4, 8), 2, "sigmoid", True, 2, 1, "top2_sum", torch.randn(8), 2.5)
    torch.library.opcheck(moe_route, args)


# -- fused experts -------------------------------------------------------------------------------


def _experts(num_experts: int, dtype: torch.dtype, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    w_gate_up = torch.randn(num_experts, 2 * INTER, HIDDEN, generator=gen) / HIDDEN**0.5
    w_down = torch.randn(num_experts, HIDDEN, INTER, generator=gen) / INTER**0.5
    return w_gate_up.to(dtype), w_down.to(dtype)


def _routing(tokens: int, top_k: int, experts: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct random experts per token among ``experts`` ids, with random weights."""
    ids = torch.argsort(torch.rand(tokens, experts, generator=gen), dim=-1)[:, :top_k]
    return torch.rand(tokens, top_k, generator=gen), ids


def _naive(x, w_gate_up, w_down, weights, ids, first, activation):
    """Token by token, choice by choice, in float64."""
    act = {"silu": F.silu, "gelu": F.gelu, "gelu_tanh": lambda g: F.gelu(g, approximate="tanh")}[activation]
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k]) - first
            if 0 <= e < w_gate_up.shape[0]:
                gate, up = (w_gate_up[e].double() @ x[t].double()).chunk(2)
                out[t] += float(weights[t, k]) * (w_down[e].double() @ (act(gate) * up))
    return out


@pytest.mark.parametrize("activation", ["silu", "gelu", "gelu_tanh"])
@pytest.mark.parametrize("first", [0, 2])
def test_reference_matches_naive_loop(activation, first):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(6, HIDDEN, generator=gen)
    w_gate_up, w_down = _experts(2, torch.float32, gen)
    weights, ids = _routing(6, 2, 4, gen)
    out = fused_moe_reference(x, w_gate_up, w_down, weights, ids.int(), first, activation)
    expected = _naive(x, w_gate_up, w_down, weights, ids, first, activation)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)
    assert out.abs().max() > 0.1


def test_reference_matches_transformers_experts():
    torch.manual_seed(0)
    config = Qwen3MoeConfig(hidden_size=HIDDEN, moe_intermediate_size=INTER, num_experts=4, hidden_act="silu")
    experts = Qwen3MoeExperts(config)
    torch.nn.init.normal_(experts.gate_up_proj, std=HIDDEN**-0.5)
    torch.nn.init.normal_(experts.down_proj, std=INTER**-0.5)
    x = torch.randn(5, HIDDEN)
    weights, ids = _routing(5, 2, 4, torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = experts(x, ids, weights)
        out = fused_moe_reference(x, experts.gate_up_proj, experts.down_proj, weights, ids, 0, "silu")
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_limit_is_deepseek_v4s_experts(triton_interpret, dtype):
    """DeepSeek-V4's experts clamp a SwiGLU's gate from above and its up both ways: the reference
    against transformers' own expert loop, the kernel against the reference, with a limit that
    clamps about a third of the values."""
    torch.manual_seed(0)
    config = DeepseekV4Config(hidden_size=HIDDEN, moe_intermediate_size=INTER, n_routed_experts=4,
                              hidden_act="silu", swiglu_limit=0.5)  # fmt: skip
    experts = DeepseekV4Experts(config)
    torch.nn.init.normal_(experts.gate_up_proj, std=HIDDEN**-0.5)
    torch.nn.init.normal_(experts.down_proj, std=INTER**-0.5)
    x = torch.randn(5, HIDDEN)
    weights, ids = _routing(5, 2, 4, torch.Generator().manual_seed(1))
    gate_up = torch.einsum("th,eih->tei", x, experts.gate_up_proj)
    assert 0.2 < (gate_up.abs() > 0.5).float().mean() < 0.8  # the limit bites
    with torch.no_grad():
        expected = experts(x, ids, weights)
    out = fused_moe_reference(x, experts.gate_up_proj, experts.down_proj, weights, ids, 0, "swiglu_limit", limit=0.5)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="swiglu_limit activation needs limit"):
        fused_moe_reference(x, experts.gate_up_proj, experts.down_proj, weights, ids, 0, "swiglu_limit")
    args = (x.to(dtype), experts.gate_up_proj.detach().to(dtype), experts.down_proj.detach().to(dtype), weights, ids)
    out = fused_moe_triton(*args, 0, "swiglu_limit", limit=0.5)
    torch.testing.assert_close(out, fused_moe_reference(*args, 0, "swiglu_limit", limit=0.5), **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("top_k", [1, 2])
@pytest.mark.parametrize("tokens", [0, 1, 5])
def test_fused_moe_kernel_matches_reference(triton_interpret, tokens, top_k, dtype):
    gen = torch.Generator().manual_seed(tokens * 10 + top_k)
    x = torch.randn(tokens, HIDDEN, generator=gen).to(dtype)
    w_gate_up, w_down = _experts(4, dtype, gen)
    weights, ids = _routing(tokens, top_k, 3, gen)  # expert 3 receives no token
    out = fused_moe_triton(x, w_gate_up, w_down, weights, ids, 0, "silu")
    expected = fused_moe_reference(x, w_gate_up, w_down, weights, ids, 0, "silu")
    assert out.shape == (tokens, HIDDEN) and out.dtype == dtype
    torch.testing.assert_close(out, expected, **TOL[dtype])
    if tokens:
        assert out.float().abs().max() > 1e-2


@pytest.mark.parametrize("activation", ["gelu", "gelu_tanh"])
def test_fused_moe_kernel_activations(triton_interpret, activation):
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(5, HIDDEN, generator=gen)
    w_gate_up, w_down = _experts(4, torch.float32, gen)
    weights, ids = _routing(5, 2, 4, gen)
    out = fused_moe_triton(x, w_gate_up, w_down, weights, ids, 0, activation)
    torch.testing.assert_close(
        out.double(), _naive(x, w_gate_up, w_down, weights, ids, 0, activation), **TOL[torch.float32]
    )


def test_fused_moe_kernel_several_blocks_per_expert(triton_interpret):
    """Forced 16-row blocks over two experts of ~20 rows each, and 16-wide tiles over sizes 24 and 20."""
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(20, HIDDEN, generator=gen)
    w_gate_up, w_down = _experts(2, torch.float32, gen)
    weights, ids = _routing(20, 2, 2, gen)
    out = fused_moe_triton(x, w_gate_up, w_down, weights, ids, 0, "silu", block_m=16, block_n=16, block_k=16)
    torch.testing.assert_close(
        out.double(), _naive(x, w_gate_up, w_down, weights, ids, 0, "silu"), **TOL[torch.float32]
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_moe_expert_parallel_halves_sum_to_full(triton_interpret, dtype):
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(5, HIDDEN, generator=gen).to(dtype)
    w_gate_up, w_down = _experts(8, dtype, gen)
    weights, ids = _routing(5, 2, 8, gen)
    ids = ids.int()
    halves = [fused_moe_triton(x, w_gate_up[f : f + 4], w_down[f : f + 4], weights, ids, f, "silu") for f in (0, 4)]
    for f, half in zip((0, 4), halves, strict=True):
        torch.testing.assert_close(
            half, fused_moe_reference(x, w_gate_up[f : f + 4], w_down[f : f + 4], weights, ids, f, "silu"), **TOL[dtype]
        )
    full = fused_moe_reference(x, w_gate_up, w_down, weights, ids, 0, "silu")
    torch.testing.assert_close(halves[0].float() + halves[1].float(), full.float(), **TOL[dtype])


def test_fused_moe_rank_without_tokens_outputs_zeros(triton_interpret):
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(5, HIDDEN, generator=gen)
    w_gate_up, w_down = _experts(4, torch.float32, gen)
    weights, ids = _routing(5, 2, 4, gen)  # all choices among experts 0..3, this rank holds 4..7
    out = fused_moe_triton(x, w_gate_up, w_down, weights, ids, 4, "silu")
    assert torch.equal(out, torch.zeros(5, HIDDEN))


def test_align_pairs_pads_each_expert_to_a_block():
    # pairs 0..5 choose experts 1 3 1 0 2 1; this rank holds experts 1 and 2
    sorted_pairs, block_experts = align_pairs(torch.tensor([[1, 3], [1, 0], [2, 1]], dtype=torch.int32), 1, 2, 4)
    assert sorted_pairs.tolist() == [0, 2, 5, 6, 4, 6, 6, 6] + [6] * 8
    assert block_experts.tolist() == [0, 1, -1, -1]


def test_fused_moe_rejects_unknown_activation(triton_interpret):
    x, weights, ids = torch.randn(2, HIDDEN), torch.rand(2, 1), torch.zeros(2, 1, dtype=torch.long)
    w_gate_up, w_down = _experts(1, torch.float32, torch.Generator().manual_seed(0))
    for run in (fused_moe, fused_moe_triton, fused_moe_reference):
        with pytest.raises(ValueError, match="activation"):
            run(x, w_gate_up, w_down, weights, ids, 0, "relu")


def test_fused_moe_op_dispatch(triton_interpret, monkeypatch):
    launched = []
    monkeypatch.setattr(fused_moe_module, "fused_moe_triton", lambda *a: launched.append(1) or fused_moe_triton(*a))
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(3, HIDDEN, generator=gen)
    w_gate_up, w_down = _experts(4, torch.float32, gen)
    weights, ids = _routing(3, 2, 4, gen)
    out = fused_moe(x, w_gate_up, w_down, weights, ids, 0, "silu")
    assert launched == [1]
    torch.testing.assert_close(
        out, fused_moe_reference(x, w_gate_up, w_down, weights, ids, 0, "silu"), **TOL[torch.float32]
    )
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    if not torch.cuda.is_available():  # on CPU without the interpreter the reference runs
        fused_moe(x, w_gate_up, w_down, weights, ids, 0, "silu")
        assert launched == [1]


def test_fused_moe_op_registration():
    gen = torch.Generator().manual_seed(8)
    w_gate_up, w_down = _experts(2, torch.float32, gen)
    weights, ids = _routing(3, 2, 4, gen)
    torch.library.opcheck(
        fused_moe, (torch.randn(3, HIDDEN, generator=gen), w_gate_up, w_down, weights, ids, 2, "silu")
    )


# -- other expert formats: input-major weights, interleaved gate/up, biases, clamped SwiGLU ---------

# (transposed, interleaved, biases, activation); gpt-oss has them all
FORMATS = {
    "gpt_oss": (True, True, True, "swigluoai"),
    "input_major": (True, False, False, "silu"),
    "interleaved": (False, True, False, "gelu"),
    "biases": (False, False, True, "silu"),
}
ALPHA, LIMIT = 1.702, 1.5  # a limit the random projections cross, so that both clamps act


def _in_format(name: str, w_gate_up: torch.Tensor, w_down: torch.Tensor, gen: torch.Generator) -> tuple:
    """``fused_moe``'s arguments from ``w_gate_up`` on for experts ``w_gate_up, w_down`` (default
    format) rewritten in format ``name``, with random biases where it has them."""
    transposed, interleaved, biased, activation = FORMATS[name]
    experts, dtype = w_gate_up.shape[0], w_gate_up.dtype
    if interleaved:  # rows gate0, up0, gate1, up1, ...
        w_gate_up = torch.stack(w_gate_up.chunk(2, dim=1), dim=2).flatten(1, 2)
    b_gate_up = torch.randn(experts, 2 * INTER, generator=gen).to(dtype) if biased else None
    b_down = torch.randn(experts, HIDDEN, generator=gen).to(dtype) if biased else None
    if transposed:
        w_gate_up, w_down = w_gate_up.transpose(1, 2).contiguous(), w_down.transpose(1, 2).contiguous()
    alpha, limit = (ALPHA, LIMIT) if activation == "swigluoai" else (None, None)
    return w_gate_up, w_down, b_gate_up, b_down, transposed, interleaved, activation, alpha, limit


def _format_call(run, x, formatted, weights, ids, first):
    w_gate_up, w_down, b_gate_up, b_down, transposed, interleaved, activation, alpha, limit = formatted
    return run(x, w_gate_up, w_down, weights, ids, first, activation, b_gate_up, b_down, transposed, interleaved,
               alpha, limit)


def test_reference_matches_transformers_gpt_oss_experts():
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    torch.manual_seed(0)
    config = GptOssConfig(hidden_size=HIDDEN, intermediate_size=INTER, num_local_experts=4, num_experts_per_tok=2)
    experts = GptOssExperts(config)
    for param in experts.parameters():
        torch.nn.init.normal_(param, std=0.5)  # wide enough for both clamps at limit 7
    x = torch.randn(5, HIDDEN)
    weights, ids = _routing(5, 2, 4, torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = experts(x, ids, weights)
        out = fused_moe_reference(x, experts.gate_up_proj, experts.down_proj, weights, ids, 0, "swigluoai",
                                  experts.gate_up_proj_bias, experts.down_proj_bias, True, True,
                                  experts.alpha, experts.limit)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    assert expected.abs().max() > 1


@pytest.mark.parametrize("name", ["gpt_oss", "input_major", "interleaved"])
def test_formats_without_biases_are_the_same_experts(name):
    """Input-major and interleaved weights are a relayout: the same experts, the same outputs."""
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(5, HIDDEN, generator=gen)
    w_gate_up, w_down = _experts(4, torch.float32, gen)
    weights, ids = _routing(5, 2, 4, gen)
    formatted = list(_in_format(name, w_gate_up, w_down, gen))
    formatted[2:4] = None, None
    activation, alpha, limit = formatted[6:]
    expected = fused_moe_reference(x, w_gate_up, w_down, weights, ids, 0, activation, alpha=alpha, limit=limit)
    torch.testing.assert_close(_format_call(fused_moe_reference, x, formatted, weights, ids, 0), expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [0, 1, 5])
@pytest.mark.parametrize("name", list(FORMATS))
def test_fused_moe_kernel_expert_formats(triton_interpret, name, tokens, dtype):
    gen = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, HIDDEN, generator=gen).to(dtype)
    formatted = _in_format(name, *_experts(4, dtype, gen), gen)
    weights, ids = _routing(tokens, 1 if tokens == 1 else 2, 3, gen)  # expert 3 receives no token
    out = _format_call(fused_moe_triton, x, formatted, weights, ids, 0)
    assert out.shape == (tokens, HIDDEN) and out.dtype == dtype
    torch.testing.assert_close(out, _format_call(fused_moe_reference, x, formatted, weights, ids, 0), **TOL[dtype])


def test_gpt_oss_expert_parallel_halves_sum_to_full(triton_interpret):
    gen = torch.Generator().manual_seed(10)
    x = torch.randn(6, HIDDEN, generator=gen)
    full = _in_format("gpt_oss", *_experts(8, torch.float32, gen), gen)
    weights, ids = _routing(6, 2, 8, gen)
    halves = []
    for first in (0, 4):
        half = [t[first : first + 4] if isinstance(t, torch.Tensor) else t for t in full]
        halves.append(_format_call(fused_moe_triton, x, half, weights, ids, first))
    torch.testing.assert_close(halves[0] + halves[1], _format_call(fused_moe_reference, x, full, weights, ids, 0),
                               **TOL[torch.float32])


def test_fused_moe_rejects_malformed_options():
    gen = torch.Generator().manual_seed(11)
    x, (weights, ids) = torch.randn(2, HIDDEN, generator=gen), _routing(2, 1, 2, gen)
    w_gate_up, w_down = _experts(2, torch.float32, gen)
    with pytest.raises(ValueError, match="needs alpha and limit"):
        fused_moe(x, w_gate_up, w_down, weights, ids, 0, "swigluoai")
    with pytest.raises(ValueError, match=r"gate_up bias \(2, 20\) is not \(2, 40\)"):
        fused_moe(x, w_gate_up, w_down, weights, ids, 0, "silu", b_gate_up=torch.zeros(2, INTER))


def test_fused_moe_op_registration_with_options():
    gen = torch.Generator().manual_seed(12)
    formatted = _in_format("gpt_oss", *_experts(2, torch.float32, gen), gen)
    weights, ids = _routing(3, 2, 4, gen)
    w_gate_up, w_down, b_gate_up, b_down, transposed, interleaved, activation, alpha, limit = formatted
    torch.library.opcheck(
        fused_moe,
        (torch.randn(3, HIDDEN, generator=gen), w_gate_up, w_down, weights, ids, 2, activation),
        {"b_gate_up": b_gate_up, "b_down": b_down, "transposed": transposed, "interleaved": interleaved,
         "alpha": alpha, "limit": limit},
    )


# -- a shared expert in the same launches ------------------------------------------------------------

SHARED_INTER = 36  # not the routed experts' 20: the shared blocks cover more columns


def _shared(dtype: torch.dtype, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gate, up = (torch.randn(SHARED_INTER, HIDDEN, generator=gen) / HIDDEN**0.5 for _ in range(2))
    down = torch.randn(HIDDEN, SHARED_INTER, generator=gen) / SHARED_INTER**0.5
    return gate.to(dtype), up.to(dtype), down.to(dtype)


def test_reference_adds_the_shared_expert_times_its_scale():
    gen = torch.Generator().manual_seed(13)
    x = torch.randn(6, HIDDEN, generator=gen)
    w_gate_up, w_down = _experts(4, torch.float32, gen)
    weights, ids = _routing(6, 2, 4, gen)
    s_gate, s_up, s_down = _shared(torch.float32, gen)
    scale = torch.rand(6, 1, generator=gen)
    routed = fused_moe_reference(x, w_gate_up, w_down, weights, ids, 0, "silu")
    out = fused_moe_reference(x, w_gate_up, w_down, weights, ids, 0, "silu", s_gate=s_gate, s_up=s_up,
                              s_down=s_down, s_scale=scale)
    shared = F.linear(F.silu(F.linear(x, s_gate)) * F.linear(x, s_up), s_down)
    torch.testing.assert_close(out, routed + shared * scale, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("tokens", "top_k", "scale"), [(0, 2, "float"), (1, 1, None), (5, 2, "bool"), (40, 2, "float")]
)
def test_fused_moe_kernel_with_a_shared_expert(triton_interpret, tokens, top_k, scale, dtype):
    """40 tokens take three 16-row shared blocks; a bool scale is the owner mark of expert routing."""
    gen = torch.Generator().manual_seed(tokens + 20)
    x = torch.randn(tokens, HIDDEN, generator=gen).to(dtype)
    w_gate_up, w_down = _experts(4, dtype, gen)
    weights, ids = _routing(tokens, top_k, 3, gen)
    s_gate, s_up, s_down = _shared(dtype, gen)
    factor = {None: None, "float": torch.rand(tokens, 1, generator=gen),
              "bool": torch.rand(tokens, 1, generator=gen) > 0.5}[scale]
    args = (x, w_gate_up, w_down, weights, ids, 0, "silu")
    shared = {"s_gate": s_gate, "s_up": s_up, "s_down": s_down, "s_scale": factor}
    expected = fused_moe_reference(*args, **shared)
    for blocks in ({}, {"block_m": 16, "block_n": 16, "block_k": 16}):
        out = fused_moe_triton(*args, **shared, **blocks)
        assert out.shape == (tokens, HIDDEN) and out.dtype == dtype
        torch.testing.assert_close(out, expected, **TOL[dtype])
    if tokens:  # the shared expert is in the sum
        assert (expected.float() - fused_moe_reference(*args).float()).abs().max() > 1e-2


def test_expert_parallel_rank_with_a_shared_expert_adds_it_to_every_row(triton_interpret):
    """A rank holding experts 4..7 of tokens that chose none of them returns the shared expert alone."""
    gen = torch.Generator().manual_seed(14)
    x = torch.randn(5, HIDDEN, generator=gen)
    w_gate_up, w_down = _experts(4, torch.float32, gen)
    weights, ids = _routing(5, 2, 4, gen)
    s_gate, s_up, s_down = _shared(torch.float32, gen)
    out = fused_moe_triton(x, w_gate_up, w_down, weights, ids, 4, "silu", s_gate=s_gate, s_up=s_up, s_down=s_down)
    torch.testing.assert_close(out, F.linear(F.silu(F.linear(x, s_gate)) * F.linear(x, s_up), s_down),
                               **TOL[torch.float32])


def test_fused_moe_rejects_a_malformed_shared_expert():
    gen = torch.Generator().manual_seed(15)
    x, (weights, ids) = torch.randn(2, HIDDEN, generator=gen), _routing(2, 1, 2, gen)
    w_gate_up, w_down = _experts(2, torch.float32, gen)
    s_gate, s_up, s_down = _shared(torch.float32, gen)
    with pytest.raises(ValueError, match="needs all of s_gate, s_up and s_down"):
        fused_moe(x, w_gate_up, w_down, weights, ids, 0, "silu", s_gate=s_gate, s_up=s_up)
    with pytest.raises(ValueError, match=r"are not \[Is, H\], \[Is, H\], \[H, Is\]"):
        fused_moe(x, w_gate_up, w_down, weights, ids, 0, "silu", s_gate=s_gate, s_up=s_up, s_down=s_down.T)
    with pytest.raises(ValueError, match="not one value per token"):
        fused_moe(x, w_gate_up, w_down, weights, ids, 0, "silu", s_gate=s_gate, s_up=s_up, s_down=s_down,
                  s_scale=torch.ones(3))


def test_fused_moe_op_registration_with_a_shared_expert():
    gen = torch.Generator().manual_seed(16)
    w_gate_up, w_down = _experts(2, torch.float32, gen)
    weights, ids = _routing(3, 2, 4, gen)
    s_gate, s_up, s_down = _shared(torch.float32, gen)
    torch.library.opcheck(
        fused_moe,
        (torch.randn(3, HIDDEN, generator=gen), w_gate_up, w_down, weights, ids, 2, "silu"),
        {"s_gate": s_gate, "s_up": s_up, "s_down": s_down, "s_scale": torch.rand(3, 1, generator=gen)},
    )
