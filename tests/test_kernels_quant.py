"""The quantized formats and kernels: the format math against hand-built values and transformers'
own dequantization, each op's reference against an independent dequantize-then-matmul written
here, and each Triton kernel (in the interpreter on CPU) against its reference. Shapes are tiny
and ragged: no size is a multiple of its scale block."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from afdc.codegen.fp8_linear import Fp8LinearCall, fp8_linear, fp8_linear_reference, fp8_linear_triton
from afdc.codegen.fused_moe import fused_moe_reference
from afdc.codegen.fused_moe_quant import (
    FusedMoeFp8Call,
    fused_moe_fp8,
    fused_moe_fp8_reference,
    fused_moe_fp8_triton,
    fused_moe_int4,
    fused_moe_int4_reference,
    fused_moe_int4_triton,
    fused_moe_mxfp4,
    fused_moe_mxfp4_reference,
    fused_moe_mxfp4_triton,
    fused_moe_nvfp4,
    fused_moe_nvfp4_reference,
    fused_moe_nvfp4_triton,
)
from afdc.codegen.packed_linear import packed_linear, packed_linear_reference, packed_linear_triton
from afdc.codegen.quant_tiles import quantize_token_groups, quantize_token_groups_reference
from afdc.quant.formats import FP8_DTYPE, Fp8Block, Fp8Scaled, Int4Group, Mxfp4, Nvfp4, TokenGroupQuant

EXPERTS, HIDDEN, INTER, TOKENS, TOP_K = 4, 40, 24, 5, 2
BLOCK = (16, 16)  # neither 40 nor 24 is a multiple
TOL = {torch.float32: {"atol": 1e-5, "rtol": 1e-5}, torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2}}


# -- format math ---------------------------------------------------------------------------------


def test_mxfp4_decodes_hand_built_codes():
    # byte 0x2F: low nibble 0xF (-6, even k first), high nibble 0x2 (1.0); byte 0x91: 0.5, then -0.5
    blocks = torch.tensor([[[0x2F, 0x91] + [0] * 14]], dtype=torch.uint8)
    for exponent, factor in ((127, 1.0), (129, 4.0), (125, 0.25)):
        w = Mxfp4().dequantize(blocks, torch.tensor([[exponent]], dtype=torch.uint8))
        assert w.shape == (1, 32)
        assert w[0, :4].tolist() == [-6.0 * factor, 1.0 * factor, 0.5 * factor, -0.5 * factor]
        assert not w[0, 4:].any()


def test_mxfp4_matches_transformers_bit_for_bit():
    gen = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 6, 2, 16), dtype=torch.uint8, generator=gen)
    scales = torch.randint(0, 255, (3, 6, 2), dtype=torch.uint8, generator=gen)  # every finite e8m0
    for dtype in (torch.bfloat16, torch.float32):
        ours = Mxfp4().dequantize(blocks, scales, dtype)
        theirs = convert_moe_packed_tensors(blocks, scales, dtype=dtype)  # [E, K, N], gpt-oss's layout
        assert torch.equal(ours.transpose(1, 2), theirs)


def test_mxfp4_quantize_round_trips_within_a_step():
    w = torch.randn(2, 8, 64)
    blocks, scales = Mxfp4().quantize(w)
    assert blocks.shape == (2, 8, 2, 16) and scales.shape == (2, 8, 2)
    back = Mxfp4().dequantize(blocks, scales)
    step = torch.exp2(scales.float() - 127).repeat_interleave(32, -1)  # e2m1's widest step is 2 at scale 1
    assert ((back - w).abs() <= step).all()


def test_fp8_block_dequantizes_ragged_blocks_by_hand():
    fmt = Fp8Block(2, 3)
    weight = torch.full((3, 4), 1.5).to(FP8_DTYPE)
    scale_inv = torch.tensor([[1.0, 2.0], [4.0, 8.0]])
    assert fmt.scale_shape(3, 4) == (2, 2)
    expected = torch.tensor([[1.5, 1.5, 1.5, 3.0]] * 2 + [[6.0, 6.0, 6.0, 12.0]])
    assert torch.equal(fmt.dequantize(weight, scale_inv), expected)
    with pytest.raises(ValueError, match="needs float32 scales"):
        fmt.dequantize(weight, scale_inv[:1])


def test_fp8_quantizers_round_trip():
    w = torch.randn(20, 40)
    fmt = Fp8Block(*BLOCK)
    q, s = fmt.quantize(w)
    assert q.dtype == FP8_DTYPE and s.shape == (2, 3)
    torch.testing.assert_close(fmt.dequantize(q, s), w, atol=0.0, rtol=2**-3)  # e4m3 keeps 3 mantissa bits
    for strategy, shape in (("channel", (20, 1)), ("tensor", (1,))):
        scaled = Fp8Scaled(strategy)
        q, s = scaled.quantize(w)
        assert s.shape == shape
        torch.testing.assert_close(scaled.dequantize(q, s), w, atol=s.max().item() * 2**-6, rtol=2**-3)
        # as a block format: the same dequantization
        block = scaled.blocks(20, 40)
        assert torch.equal(block.dequantize(q, scaled.block_scale(s, 20, 40)), scaled.dequantize(q, s))


def test_token_groups_by_hand_and_kernel(triton_interpret):
    x = torch.zeros(2, 20)
    x[0, :16] = torch.linspace(-8, 8, 16)  # group 0: amax 8, scale 8 / 448
    x[0, 16:] = 0.0  # an all-zero (ragged) group keeps a finite scale
    x[1] = torch.randn(20) * 3
    q, s = TokenGroupQuant(16).quantize(x)
    assert s.shape == (2, 2)
    assert s[0, 0] == torch.tensor(8.0) / 448 and s[0, 1] == torch.tensor(1e-10) / 448
    assert q[0, 0].float() == -448 and q[0, 15].float() == 448 and not q[0, 16:].float().any()
    for input_scale in (None, torch.tensor([0.05])):
        kq, ks = quantize_token_groups(x, 16, input_scale)
        rq, rs = quantize_token_groups_reference(x, 16, input_scale)
        assert torch.equal(kq.float(), rq.float()) and torch.equal(ks, rs)
    # values that round up to the next power of 2 (the interpreter's own cast gets these wrong)
    y = torch.tensor([[125.2, -125.2, 0.99, 447.9] + [1.0] * 12]) * (448 / 447.9)
    assert torch.equal(quantize_token_groups(y, 16)[0].float(), TokenGroupQuant(16).quantize(y)[0].float())


# -- fp8 linear ------------------------------------------------------------------------------------


def _fp8_weight(n: int, k: int, block: tuple[int, int], seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return Fp8Block(*block).quantize(torch.randn(n, k, generator=gen) * 0.3)


@pytest.mark.parametrize("block", [(16, 16), (1, 40), (24, 40)], ids=["blocks", "per_channel", "per_tensor"])
def test_fp8_linear_reference_is_dequantize_then_matmul(block):
    weight, scale = _fp8_weight(24, 40, block)
    x, bias = torch.randn(2, 3, 40), torch.randn(24)
    w = Fp8Block(*block).dequantize(weight, scale)
    torch.testing.assert_close(fp8_linear_reference(x, weight, scale, *block, bias), x @ w.T + bias)
    groups = TokenGroupQuant(block[1])
    xq = groups.dequantize(*groups.quantize(x.reshape(6, 40))).reshape(2, 3, 40)
    torch.testing.assert_close(fp8_linear_reference(x, weight, scale, *block, bias, True), xq @ w.T + bias)
    static = torch.tensor([0.02])
    xs = (x / 0.02).clamp(-448, 448).to(FP8_DTYPE).float() * 0.02
    torch.testing.assert_close(fp8_linear_reference(x, weight, scale, *block, None, True, static), xs @ w.T)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("w8a8", [False, True])
@pytest.mark.parametrize("block", [(16, 16), (1, 40)], ids=["blocks", "per_channel"])
def test_fp8_linear_kernel_matches_reference(triton_interpret, block, w8a8, dtype):
    weight, scale = _fp8_weight(24, 40, block)
    x, bias = torch.randn(7, 40).to(dtype), torch.randn(24)
    args = (x, weight, scale, *block, bias, w8a8)
    out = fp8_linear_triton(*args)
    assert out.dtype == dtype and out.shape == (7, 24)
    torch.testing.assert_close(out, fp8_linear_reference(*args), **TOL[dtype])


def test_fp8_linear_op_and_its_call(triton_interpret):
    weight, scale = _fp8_weight(24, 40, (16, 16))
    x = torch.randn(3, 40)
    # the scales in any shape that holds the grid's values
    expected = fp8_linear_reference(x, weight, scale, 16, 16)
    torch.testing.assert_close(fp8_linear(x, weight, scale.reshape(-1), 16, 16), expected)
    graph = torch.fx.Graph()
    nodes = [graph.placeholder(n) for n in ("x", "w", "s")]
    node = Fp8LinearCall.emit(graph, x=nodes[0], weight=nodes[1], weight_scale=nodes[2], block_n=16, block_k=16,
                              bias=None, w8a8=True, input_scale=None)
    assert node.args == (*nodes, 16, 16) and node.kwargs == {"w8a8": True}
    assert Fp8LinearCall.of(node).w8a8 and Fp8LinearCall.of(node).block_k == 16
    with pytest.raises(ValueError, match="needs 2 x 3 scales"):
        fp8_linear(x, weight, scale[:1], 16, 16)


# -- fp8 experts -------------------------------------------------------------------------------------


def _fp8_experts(seed: int = 0):
    """gate_up [E, 2I, H] and down [E, H, I] quantized per projection, as per-expert checkpoints hold them."""
    gen = torch.Generator().manual_seed(seed)
    fmt = Fp8Block(*BLOCK)
    gate, up = (torch.randn(EXPERTS, INTER, HIDDEN, generator=gen) * 0.3 for _ in range(2))
    down = torch.randn(EXPERTS, HIDDEN, INTER, generator=gen) * 0.3
    (gq, gs), (uq, us), (dq, ds) = fmt.quantize(gate), fmt.quantize(up), fmt.quantize(down)
    return torch.cat([gq, uq], 1), dq, torch.cat([gs, us], 1), ds


def _routing(tokens: int = TOKENS, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(EXPERTS, generator=gen)[:TOP_K] for _ in range(tokens)])
    return torch.rand(tokens, TOP_K, generator=gen), ids


def test_fp8_experts_reference_is_dequantize_then_fused_moe():
    w_gate_up, w_down, s_gate_up, s_down = _fp8_experts()
    weights, ids = _routing()
    x = torch.randn(TOKENS, HIDDEN)
    fmt = Fp8Block(*BLOCK)
    gate_s, up_s = s_gate_up.chunk(2, dim=1)
    dense_gate_up = torch.cat([fmt.dequantize(w_gate_up[:, :INTER], gate_s),
                               fmt.dequantize(w_gate_up[:, INTER:], up_s)], 1)
    dense_down = fmt.dequantize(w_down, s_down)
    out = fused_moe_fp8_reference(x, w_gate_up, w_down, weights, ids, 0, "silu", s_gate_up, s_down, *BLOCK)
    # an independent loop over tokens and choices
    expected = torch.zeros(TOKENS, HIDDEN)
    for t in range(TOKENS):
        for k in range(TOP_K):
            e = ids[t, k]
            h = dense_gate_up[e] @ x[t]
            expected[t] += weights[t, k] * (dense_down[e] @ (F.silu(h[:INTER]) * h[INTER:]))
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(out, fused_moe_reference(x, dense_gate_up, dense_down, weights, ids, 0, "silu"))


@pytest.mark.parametrize("w8a8", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_experts_kernel_matches_reference(triton_interpret, dtype, w8a8):
    w_gate_up, w_down, s_gate_up, s_down = _fp8_experts()
    weights, ids = _routing()
    x = torch.randn(TOKENS, HIDDEN).to(dtype)
    args = (x, w_gate_up, w_down, weights, ids, 0, "silu", s_gate_up, s_down, *BLOCK, w8a8)
    torch.testing.assert_close(fused_moe_fp8_triton(*args), fused_moe_fp8_reference(*args), **TOL[dtype])


def test_fp8_experts_per_channel_bf16_scales(triton_interpret):
    """compressed-tensors' per-channel experts (FP8_DYNAMIC MoE): a bf16 ``weight_scale`` [out, 1]
    per projection, read as one block of a row as long as the longer of H and I, against the
    format's own dequantization (Fp8Scaled) and fused_moe's reference."""
    gen = torch.Generator().manual_seed(0)
    channel = Fp8Scaled("channel")
    gate, up = (torch.randn(EXPERTS, INTER, HIDDEN, generator=gen) * 0.3 for _ in range(2))
    down = torch.randn(EXPERTS, HIDDEN, INTER, generator=gen) * 0.3
    (gq, gs), (uq, us), (dq, ds) = (channel.quantize(w) for w in (gate, up, down))
    gs, us, ds = (scale.to(torch.bfloat16) for scale in (gs, us, ds))  # as llm-compressor ships them
    weights, ids = _routing()
    x = torch.randn(TOKENS, HIDDEN)
    args = (x, torch.cat([gq, uq], 1), dq, weights, ids, 0, "silu", torch.cat([gs, us], 1), ds, 1, HIDDEN)
    dense = [torch.stack([channel.dequantize(q[e], s[e]) for e in range(EXPERTS)]) for q, s in
             ((gq, gs), (uq, us), (dq, ds))]
    expected = fused_moe_reference(x, torch.cat(dense[:2], 1), dense[2], weights, ids, 0, "silu")
    torch.testing.assert_close(fused_moe_fp8_reference(*args), expected, **TOL[torch.float32])
    torch.testing.assert_close(fused_moe_fp8_triton(*args), expected, **TOL[torch.float32])


def test_fp8_experts_expert_parallel_halves_sum_to_the_whole(triton_interpret):
    w_gate_up, w_down, s_gate_up, s_down = _fp8_experts()
    weights, ids = _routing()
    x = torch.randn(TOKENS, HIDDEN)
    halves = [fused_moe_fp8(x, w_gate_up[f:f + 2], w_down[f:f + 2], weights, ids, f, "silu", s_gate_up[f:f + 2],
                            s_down[f:f + 2], *BLOCK) for f in (0, 2)]
    whole = fused_moe_fp8_reference(x, w_gate_up, w_down, weights, ids, 0, "silu", s_gate_up, s_down, *BLOCK)
    torch.testing.assert_close(halves[0] + halves[1], whole, **TOL[torch.float32])
    assert halves[0].abs().sum() > 0 and halves[1].abs().sum() > 0


def test_fp8_experts_call_and_checks():
    w_gate_up, w_down, s_gate_up, s_down = _fp8_experts()
    weights, ids = _routing()
    x = torch.randn(TOKENS, HIDDEN)
    graph = torch.fx.Graph()
    names = ("x", "w_gate_up", "w_down", "topk_weights", "topk_ids", "w_gate_up_scale", "w_down_scale")
    nodes = {n: graph.placeholder(n) for n in names}
    node = FusedMoeFp8Call.emit(graph, **nodes, first_expert=0, activation="silu", block_n=16, block_k=16,
                                w8a8=False, b_gate_up=None, b_down=None, alpha=None, limit=None)
    assert node.target is torch.ops.afdc.fused_moe_fp8.default and not node.kwargs
    assert FusedMoeFp8Call.of(node).w_gate_up_scale is nodes["w_gate_up_scale"]
    with pytest.raises(ValueError, match="the gate rows' blocks, then the up rows'"):
        fused_moe_fp8(x, w_gate_up, w_down, weights, ids, 0, "silu", s_gate_up[:, :2], s_down, *BLOCK)
    with pytest.raises(ValueError, match="w8a8 needs a weight block_k that is a multiple of 16"):
        fused_moe_fp8_triton(x, w_gate_up, w_down, weights, ids, 0, "silu", *_rescaled(w_gate_up, w_down, (8, 8)),
                             8, 8, True)


def _rescaled(w_gate_up, w_down, block):
    fmt = Fp8Block(*block)
    shape = fmt.scale_shape(INTER, HIDDEN)
    return torch.ones(EXPERTS, 2 * shape[0], shape[1]), torch.ones(EXPERTS, *fmt.scale_shape(HIDDEN, INTER))


# -- MXFP4 experts -----------------------------------------------------------------------------------

MX_HIDDEN, MX_INTER = 64, 32  # MXFP4 blocks are whole: multiples of 32


def _mxfp4_experts(seed: int = 0, hidden: int = MX_HIDDEN, inter: int = MX_INTER):
    gen = torch.Generator().manual_seed(seed)
    fmt = Mxfp4()
    gate_up, down = fmt.quantize(torch.randn(EXPERTS, 2 * inter, hidden, generator=gen)), \
        fmt.quantize(torch.randn(EXPERTS, hidden, inter, generator=gen))
    biases = torch.randn(EXPERTS, 2 * inter, generator=gen), torch.randn(EXPERTS, hidden, generator=gen)
    return gate_up, down, biases


def test_mxfp4_experts_reference_is_gpt_oss_dequantized():
    (gb, gs), (db, ds), (b1, b2) = _mxfp4_experts()
    weights, ids = _routing()
    x = torch.randn(TOKENS, MX_HIDDEN)
    out = fused_moe_mxfp4_reference(x, gb, db, weights, ids, 0, "swigluoai", gs, ds, b1, b2, True, 1.702, 7.0)
    # transformers' dequantization gives gpt-oss's input-major, interleaved parameters
    gate_up = convert_moe_packed_tensors(gb, gs, dtype=torch.float32)
    down = convert_moe_packed_tensors(db, ds, dtype=torch.float32)
    expected = torch.zeros(TOKENS, MX_HIDDEN)
    for t in range(TOKENS):
        for k in range(TOP_K):
            e = ids[t, k]
            h = x[t] @ gate_up[e] + b1[e]
            gate, up = h[0::2].clamp(max=7.0), h[1::2].clamp(-7.0, 7.0)
            expected[t] += weights[t, k] * (((up + 1) * gate * torch.sigmoid(1.702 * gate)) @ down[e] + b2[e])
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize(("dtype", "hidden", "inter"),
                         [(torch.float32, MX_HIDDEN, MX_INTER), (torch.bfloat16, MX_HIDDEN, MX_INTER),
                          (torch.bfloat16, 96, 160)])
def test_mxfp4_experts_kernel_matches_reference(triton_interpret, dtype, hidden, inter):
    """Also on odd numbers of 32-value groups (3 and 5, as gpt-oss's 2880 is 90): K tiles that end
    part-way."""
    (gb, gs), (db, ds), (b1, b2) = _mxfp4_experts(hidden=hidden, inter=inter)
    weights, ids = _routing()
    x = torch.randn(TOKENS, hidden).to(dtype)
    for args in ((x, gb, db, weights, ids, 0, "swigluoai", gs, ds, b1, b2, True, 1.702, 7.0),
                 (x, gb, db, weights, ids, 0, "silu", gs, ds)):
        out = fused_moe_mxfp4_triton(*args)
        expected = fused_moe_mxfp4_reference(*args)
        torch.testing.assert_close(out, expected, atol=TOL[dtype]["atol"] * expected.abs().max().item(),
                                   rtol=TOL[dtype]["rtol"])


def test_mxfp4_experts_expert_parallel_slice(triton_interpret):
    (gb, gs), (db, ds), (b1, b2) = _mxfp4_experts()
    weights, ids = _routing()
    x = torch.randn(TOKENS, MX_HIDDEN)
    out = fused_moe_mxfp4(x, gb[2:], db[2:], weights, ids, 2, "silu", gs[2:], ds[2:], b1[2:], b2[2:])
    held = (ids >= 2).float()
    expected = fused_moe_mxfp4_reference(x, gb, db, weights * held, ids, 0, "silu", gs, ds, b1, b2)
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-5)


def test_deepseek_v4_fp4_experts_are_mxfp4_bytes_in_other_containers(triton_interpret):
    """DeepSeek-V4's fp4 experts (int8 [E, N, K / 2] codes, float8_e8m0fnu [E, N, K / 32] exponents)
    give what the same bytes as MXFP4's uint8 blocks and scales give, reference and kernels."""
    (gb, gs), (db, ds), _ = _mxfp4_experts()
    weights, ids = _routing()
    x = torch.randn(TOKENS, MX_HIDDEN)
    v4 = [t.flatten(-2).view(torch.int8) for t in (gb, db)] + [t.view(torch.float8_e8m0fnu) for t in (gs, ds)]
    for op in (fused_moe_mxfp4_reference, fused_moe_mxfp4):
        torch.testing.assert_close(op(x, v4[0], v4[1], weights, ids, 0, "silu", v4[2], v4[3]),
                                   op(x, gb, db, weights, ids, 0, "silu", gs, ds), atol=0, rtol=0)


def test_ue8m0_scales_widen_exactly(triton_interpret):
    """fp8 block scales stored as float8_e8m0fnu (DeepSeek-V4's scale_fmt ue8m0) run as their float32
    values: the same output bit for bit, reference and kernel (the experts: test_quantized_checkpoints)."""
    weight, scale = _fp8_weight(24, 40, (16, 16))
    pow2 = torch.exp2(torch.ceil(torch.log2(scale)))
    x = torch.randn(3, 40)
    for op in (fp8_linear_reference, fp8_linear):
        torch.testing.assert_close(op(x, weight, pow2.to(torch.float8_e8m0fnu), 16, 16),
                                   op(x, weight, pow2, 16, 16), atol=0, rtol=0)


# -- int4 pack-quantized experts ------------------------------------------------------------------------


def test_int4_matches_compressed_tensors_bit_for_bit():
    """The format's definition against compressed-tensors' own unpacking and dequantization (which
    refuses a K that is no multiple of the group), every int4 value."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32
    from compressed_tensors.quantization.lifecycle.forward import dequantize

    gen = torch.Generator().manual_seed(0)
    for shape, group in (((3, 6, 64), 32), ((5, 96), 32), ((2, 4, 48), 16)):
        values = torch.randint(-8, 8, shape, dtype=torch.int8, generator=gen)
        packed = pack_to_int32(values, 4)
        scale = torch.rand(*shape[:-1], -(-shape[-1] // group), generator=gen).to(torch.bfloat16)
        assert torch.equal(Int4Group(group).unpack(packed), unpack_from_int32(packed, 4, torch.Size(shape)))
        for dtype in (torch.float32, torch.bfloat16):  # the library multiplies in the scale's dtype
            theirs = [dequantize(v, s.to(dtype), torch.zeros_like(s)) for v, s in
                      zip(values.reshape(-1, *shape[-2:]), scale.reshape(-1, *scale.shape[-2:]))]
            assert torch.equal(Int4Group(group).dequantize(packed, scale, dtype), torch.stack(theirs).reshape(shape))


I4_HIDDEN, I4_INTER = 64, 40  # the down projection's K (40) ends in a partial group of 8


def _int4_experts(inter: int = I4_INTER, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    fmt = Int4Group(32)
    return (fmt.quantize(torch.randn(EXPERTS, 2 * inter, I4_HIDDEN, generator=gen)),
            fmt.quantize(torch.randn(EXPERTS, I4_HIDDEN, inter, generator=gen)))


def test_int4_experts_reference_is_dequantize_then_fused_moe():
    (gp, gs), (dp, ds) = _int4_experts()
    weights, ids = _routing()
    x = torch.randn(TOKENS, I4_HIDDEN)
    fmt = Int4Group(32)
    out = fused_moe_int4_reference(x, gp, dp, weights, ids, 0, "silu", gs, ds, 32)
    expected = fused_moe_reference(x, fmt.dequantize(gp, gs), fmt.dequantize(dp, ds), weights, ids, 0, "silu")
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("inter", "dtype"), [(32, torch.float32), (I4_INTER, torch.bfloat16), (96, torch.bfloat16)],
                         ids=["smaller", "ragged", "larger"])
def test_int4_experts_kernel_matches_reference(triton_interpret, dtype, inter):
    (gp, gs), (dp, ds) = _int4_experts(inter)
    weights, ids = _routing()
    x = torch.randn(TOKENS, I4_HIDDEN).to(dtype)
    args = (x, gp, dp, weights, ids, 0, "silu", gs, ds, 32)
    out, expected = fused_moe_int4_triton(*args), fused_moe_int4_reference(*args)
    torch.testing.assert_close(out, expected, atol=TOL[dtype]["atol"] * expected.abs().max().item(),
                               rtol=TOL[dtype]["rtol"])


def test_int4_experts_expert_parallel_slice(triton_interpret):
    (gp, gs), (dp, ds) = _int4_experts()
    weights, ids = _routing()
    x = torch.randn(TOKENS, I4_HIDDEN)
    out = fused_moe_int4(x, gp[2:], dp[2:], weights, ids, 2, "silu", gs[2:], ds[2:], 32)
    held = (ids >= 2).float()
    expected = fused_moe_int4_reference(x, gp, dp, weights * held, ids, 0, "silu", gs, ds, 32)
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-5)


# -- NVFP4 ---------------------------------------------------------------------------------------------


def test_nvfp4_matches_vllm_bit_for_bit():
    """ModelOpt NVFP4 by the format's definition against vLLM's own dequantization (its CPU
    emulation, unswizzled scales), per tensor and per expert, every e2m1 code and random fp8 scales."""
    from vllm.model_executor.layers.quantization.utils.nvfp4_emulation_utils import dequantize_to_dtype

    gen = torch.Generator().manual_seed(0)
    packed = torch.randint(0, 256, (3, 24, 32), dtype=torch.uint8, generator=gen)
    scale = (torch.rand(3, 24, 4, generator=gen) * 4).to(FP8_DTYPE)
    global_scale = torch.rand(3, generator=gen) / 448
    for dtype in (torch.float32, torch.bfloat16):
        ours = Nvfp4().dequantize(packed, scale, global_scale, dtype)
        assert torch.equal(ours, dequantize_to_dtype(packed, scale, global_scale, dtype, 16, swizzle=False))
        assert torch.equal(Nvfp4().dequantize(packed[0], scale[0], global_scale[0], dtype),
                           dequantize_to_dtype(packed[0], scale[0], global_scale[0], dtype, 16, swizzle=False))
    w = torch.randn(24, 64, generator=gen)
    back = Nvfp4().dequantize(*Nvfp4().quantize(w))
    assert (back - w).abs().max() <= w.abs().max() / 6  # within e2m1's widest step of the largest group


def _nvfp4_experts(inter: int, seed: int = 0):
    """Gate and up quantized as ModelOpt does each linear (a global scale of their own), the down too."""
    gen = torch.Generator().manual_seed(seed)
    fmt = Nvfp4()
    parts = [[fmt.quantize(torch.randn(rows, cols, generator=gen) * (1 + e)) for e in range(EXPERTS)]
             for rows, cols in ((inter, I4_HIDDEN), (inter, I4_HIDDEN), (I4_HIDDEN, inter))]
    gate, up, down = ([torch.stack([q[i] for q in part]) for i in range(3)] for part in parts)
    return ((torch.cat([gate[0], up[0]], 1), torch.cat([gate[1], up[1]], 1), torch.stack([gate[2], up[2]], 1)),
            (down[0], down[1], down[2][:, None]))


def test_nvfp4_experts_reference_is_dequantize_then_fused_moe():
    (gp, gs, gg), (dp, ds, dg) = _nvfp4_experts(32)
    weights, ids = _routing()
    x = torch.randn(TOKENS, I4_HIDDEN)
    fmt = Nvfp4()
    gate_up = torch.cat([fmt.dequantize(gp[:, :32], gs[:, :32], gg[:, 0]), fmt.dequantize(gp[:, 32:], gs[:, 32:],
                                                                                          gg[:, 1])], 1)
    expected = fused_moe_reference(x, gate_up, fmt.dequantize(dp, ds, dg[:, 0]), weights, ids, 0, "silu")
    out = fused_moe_nvfp4_reference(x, gp, dp, weights, ids, 0, "silu", gs, ds, gg, dg)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("inter", "dtype"), [(32, torch.float32), (48, torch.bfloat16)],
                         ids=["smaller", "tile-ragged"])
def test_nvfp4_experts_kernel_matches_reference(triton_interpret, dtype, inter):
    (gp, gs, gg), (dp, ds, dg) = _nvfp4_experts(inter)
    weights, ids = _routing()
    x = torch.randn(TOKENS, I4_HIDDEN).to(dtype)
    args = (x, gp, dp, weights, ids, 0, "silu", gs, ds, gg, dg)
    out, expected = fused_moe_nvfp4_triton(*args), fused_moe_nvfp4_reference(*args)
    torch.testing.assert_close(out, expected, atol=TOL[dtype]["atol"] * expected.abs().max().item(),
                               rtol=TOL[dtype]["rtol"])
    held = fused_moe_nvfp4(x, gp[2:], dp[2:], weights, ids, 2, "silu", gs[2:], ds[2:], gg[2:], dg[2:])
    whole = fused_moe_nvfp4_reference(x, gp, dp, weights * (ids >= 2), ids, 0, "silu", gs, ds, gg, dg)
    torch.testing.assert_close(held, whole, atol=TOL[dtype]["atol"] * whole.abs().max().item(),
                               rtol=TOL[dtype]["rtol"])


# -- packed 4-bit linears --------------------------------------------------------------------------------


@pytest.mark.parametrize(("fmt", "dtype"), [("int4", torch.bfloat16), ("nvfp4", torch.float32)])
def test_packed_linear_kernel_and_reference(triton_interpret, fmt, dtype):
    """N = 40 and K = 96 (three int4 groups, six NVFP4 groups; neither a power of 2): the reference
    is dequantize-then-linear, the kernel matches it, the op takes the kernel where it launches."""
    gen = torch.Generator().manual_seed(0)
    w, x, bias = torch.randn(40, 96, generator=gen), torch.randn(3, 5, 96, generator=gen).to(dtype), torch.randn(40)
    if fmt == "int4":
        packed, scale = Int4Group(32).quantize(w)
        args, dense = (x, packed, scale, "int4", 32, None, bias), Int4Group(32).dequantize(packed, scale, dtype)
    else:
        packed, scale, global_scale = Nvfp4().quantize(w)
        args = (x, packed, scale, "nvfp4", 16, global_scale.reshape(1), bias)
        dense = Nvfp4().dequantize(packed, scale, global_scale, dtype)
    expected = packed_linear_reference(*args)
    torch.testing.assert_close(expected.float(), (F.linear(x.float(), dense.float(), bias)).to(dtype).float())
    tol = TOL[dtype]
    for out in (packed_linear_triton(*args), packed_linear(*args)):
        torch.testing.assert_close(out, expected, atol=tol["atol"] * expected.abs().max().item(), rtol=tol["rtol"])
