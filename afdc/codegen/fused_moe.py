"""The routed experts of an MoE layer, fused: Triton kernels, PyTorch reference, custom op.

The weights are transformers' fused expert parameters: ``gate_up_proj`` [E, 2I, H] (gate rows
first, then up rows) and ``down_proj`` [E, H, I]. A rank may hold a slice of the experts
(``first_expert`` onwards, expert parallelism); a token's choices of experts held elsewhere add
exactly zero, so the ranks' outputs sum to the whole layer's.

A shared expert (a gated MLP every token passes through, with separate gate, up and down weights
[Is, H], [Is, H], [H, Is], optionally scaled per token) joins the same two launches: the blocks
past the routed ones take the tokens in order through the shared weights, and its rows are summed
with the routed pairs. At decode sizes the routed blocks leave most of the GPU idle, and the
shared expert fills it instead of taking launches of its own.

gpt-oss-style experts are the same computation in other clothes, taken as options rather than as
a second kernel: weights stored input-major (``transposed``: [E, H, 2I] and [E, I, H], read in
place through their strides), gate and up columns alternating (``interleaved``), per-expert biases
added to the fp32 accumulators, and the clamped ``swigluoai`` activation
``(clamp(up, ±limit) + 1) * g * sigmoid(alpha * g)`` with ``g = min(gate, limit)``. DeepSeek-V4
clamps a plain SwiGLU the same way (``swiglu_limit``): ``silu(min(gate, limit)) * clamp(up, ±limit)``.

The kernels follow vLLM's fused_moe:

1. align (:func:`align_pairs`): the (token, k) pairs are sorted by local expert and each expert's
   run is padded to a multiple of BLOCK_M, so that a block of rows belongs to one expert. This is
   a handful of torch ops on the device (scatter_add, argsort, cumsum, searchsorted), sized for the
   worst case so that nothing waits on the host; blocks past the end are marked and exit at once.
2. gate-up GEMM: a program multiplies one block of rows by one BLOCK_N column tile of both the
   gate and the up weights, and stores ``act(gate) * up`` from its fp32 accumulators: the [rows, 2I]
   projection never reaches memory.
3. down GEMM: the same blocks times the down weights, scaled by the routing weight in the epilogue,
   one fp32 row per (token, k) pair.
4. combine: the sum over k of a token's pair rows (a torch sum).

The pair rows are kept in fp32 and summed before one rounding to the output dtype; the
intermediate ``act(gate) * up`` is rounded to the weights' dtype, the input of the down GEMM.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields, replace

import torch
import torch.fx as fx
import torch.nn.functional as F

from afdc.codegen import autotune
from afdc.codegen.quant_tiles import WEIGHT_FORMATS, quantize_token_groups, rounded, rounding_grid, weight_tile
from afdc.codegen.triton_support import interpreting, jit, launches, next_power_of_2, tl
from afdc.codegen.typed_calls import EmittedCall, takes_arguments_of

ACTIVATIONS = ("silu", "gelu", "gelu_tanh", "swigluoai", "swiglu_limit")


@dataclass(frozen=True)
class Experts:
    """The arguments of ``afdc::fused_moe`` (:func:`fused_moe`), declared once: the op's schema,
    its reference and its Triton launcher all take these, positionally or by name."""

    x: torch.Tensor
    w_gate_up: torch.Tensor
    w_down: torch.Tensor
    topk_weights: torch.Tensor
    topk_ids: torch.Tensor
    first_expert: int
    activation: str
    b_gate_up: torch.Tensor | None = None
    b_down: torch.Tensor | None = None
    transposed: bool = False
    interleaved: bool = False
    alpha: float | None = None
    limit: float | None = None
    s_gate: torch.Tensor | None = None
    s_up: torch.Tensor | None = None
    s_down: torch.Tensor | None = None
    s_scale: torch.Tensor | None = None

    @property
    def shared(self) -> tuple:
        return self.s_gate, self.s_up, self.s_down, self.s_scale

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return tuple(v for v in (getattr(self, f.name) for f in fields(self)) if isinstance(v, torch.Tensor))

    def output_major(self) -> Experts:
        """The same call with the weights as [E, 2I, H] and [E, H, I] views (:func:`output_major`)."""
        w_gate_up, w_down = output_major(self.w_gate_up, self.w_down, self.transposed)
        return replace(self, w_gate_up=w_gate_up, w_down=w_down, transposed=False)

    def check(self) -> None:
        """Raises unless the weights, biases, routing and shared expert fit together."""
        e = self.output_major()
        _check(e.x, e.w_gate_up, e.w_down, e.topk_ids, e.activation, e.b_gate_up, e.b_down, e.alpha, e.limit,
               e.shared)


def output_major(
    w_gate_up: torch.Tensor, w_down: torch.Tensor, transposed: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """The weights as [E, 2I, H] and [E, H, I] (views: input-major weights are not copied)."""
    return (w_gate_up.transpose(1, 2), w_down.transpose(1, 2)) if transposed else (w_gate_up, w_down)


def _check(
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: str,
    b_gate_up: torch.Tensor | None,
    b_down: torch.Tensor | None,
    alpha: float | None,
    limit: float | None,
    shared: tuple = (None, None, None, None),
) -> None:
    """Checks the output-major views of the weights (:func:`output_major`)."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"fused_moe: unknown activation {activation!r}; expected one of {', '.join(ACTIVATIONS)}")
    if activation == "swigluoai" and (alpha is None or limit is None):
        raise ValueError("fused_moe: the swigluoai activation needs alpha and limit")
    if activation == "swiglu_limit" and limit is None:
        raise ValueError("fused_moe: the swiglu_limit activation needs limit")
    experts, two_inter, hidden = w_gate_up.shape
    if x.dim() != 2 or x.shape[1] != hidden or two_inter % 2:
        raise ValueError(f"fused_moe: x {tuple(x.shape)} does not fit gate_up_proj {tuple(w_gate_up.shape)}")
    if tuple(w_down.shape) != (experts, hidden, two_inter // 2):
        raise ValueError(
            f"fused_moe: down_proj {tuple(w_down.shape)} does not fit gate_up_proj {tuple(w_gate_up.shape)}"
        )
    for name, bias, shape in (("gate_up", b_gate_up, (experts, two_inter)), ("down", b_down, (experts, hidden))):
        if bias is not None and tuple(bias.shape) != shape:
            raise ValueError(f"fused_moe: {name} bias {tuple(bias.shape)} is not {shape}, one row per expert")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0]:
        raise ValueError(f"fused_moe: topk_ids {tuple(topk_ids.shape)} is not [tokens, top_k] for x {tuple(x.shape)}")
    _check_shared(x, w_gate_up, b_gate_up, b_down, *shared)


def _check_shared(x, w_gate_up, b_gate_up, b_down, s_gate, s_up, s_down, s_scale) -> None:
    weights = (s_gate, s_up, s_down)
    if all(w is None for w in (*weights, s_scale)):
        return
    if any(w is None for w in weights):
        raise ValueError("fused_moe: a shared expert needs all of s_gate, s_up and s_down")
    if b_gate_up is not None or b_down is not None:
        raise ValueError("fused_moe: a shared expert next to expert biases is not supported")
    if s_gate.dim() != 2:
        raise ValueError(f"fused_moe: shared expert gate {tuple(s_gate.shape)} is not [Is, H]")
    shared_inter, hidden = s_gate.shape
    if tuple(s_up.shape) != (shared_inter, hidden) or tuple(s_down.shape) != (hidden, shared_inter):
        raise ValueError(f"fused_moe: shared expert gate {tuple(s_gate.shape)}, up {tuple(s_up.shape)} and down "
                         f"{tuple(s_down.shape)} are not [Is, H], [Is, H], [H, Is]")
    if hidden != x.shape[1] or any(w.dtype != w_gate_up.dtype for w in weights):
        raise ValueError(f"fused_moe: the shared expert ({s_gate.dtype}, hidden {hidden}) does not match the routed "
                         f"experts ({w_gate_up.dtype}, hidden {x.shape[1]})")
    if s_scale is not None and s_scale.numel() != x.shape[0]:
        raise ValueError(f"fused_moe: s_scale {tuple(s_scale.shape)} is not one value per token of x {tuple(x.shape)}")


def _gated(gate_up: torch.Tensor, activation: str, interleaved: bool, alpha, limit) -> torch.Tensor:
    """``act(gate) * up`` of [rows, 2I] projections."""
    inter = gate_up.shape[1] // 2
    gate, up = (gate_up[:, 0::2], gate_up[:, 1::2]) if interleaved else (gate_up[:, :inter], gate_up[:, inter:])
    if activation == "silu":
        return F.silu(gate) * up
    if activation == "gelu":
        return F.gelu(gate) * up
    if activation == "gelu_tanh":
        return F.gelu(gate, approximate="tanh") * up
    gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    if activation == "swiglu_limit":
        return F.silu(gate) * up
    return gate * torch.sigmoid(alpha * gate) * (up + 1)


@takes_arguments_of(Experts)
def fused_moe_reference(*args, **kwargs) -> torch.Tensor:
    """transformers' expert loop over the local experts, rounding where the kernels do (the
    arguments of :class:`Experts`)."""
    experts = Experts(*args, **kwargs)
    experts.check()
    return experts_reference(experts.output_major())


def experts_reference(
    e: Experts, intermediate: Callable[[torch.Tensor], torch.Tensor] | None = None
) -> torch.Tensor:
    """The expert loop over output-major weights; ``intermediate`` rounds ``act(gate) * up``, the
    down projection's input (by default to the down weights' dtype, as the kernels store it)."""
    x, w_gate_up, w_down, topk_weights = e.x, e.w_gate_up, e.w_down, e.topk_weights
    b_gate_up, b_down, activation, interleaved, alpha, limit = e.b_gate_up, e.b_down, e.activation, e.interleaved, \
        e.alpha, e.limit
    s_gate, s_up, s_down, s_scale = e.shared
    intermediate = intermediate or (lambda h: h.to(w_down.dtype))
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    local = e.topk_ids.long() - e.first_expert
    held = (local >= 0) & (local < w_gate_up.shape[0])
    for expert in local[held].unique().tolist():
        tokens, slots = torch.where(local == expert)
        gate_up = F.linear(x[tokens].to(w_gate_up.dtype), w_gate_up[expert]).float()
        if b_gate_up is not None:
            gate_up += b_gate_up[expert].float()
        hidden = intermediate(_gated(gate_up, activation, interleaved, alpha, limit))
        y = F.linear(hidden, w_down[expert]).float()
        if b_down is not None:
            y += b_down[expert].float()
        out.index_add_(0, tokens, y * topk_weights[tokens, slots, None].float())
    if s_gate is not None:
        rows = x.to(s_gate.dtype)
        gate_up = torch.cat([F.linear(rows, s_gate), F.linear(rows, s_up)], dim=-1).float()
        y = F.linear(_gated(gate_up, activation, False, alpha, limit).to(s_down.dtype), s_down).float()
        out += y if s_scale is None else y * s_scale.reshape(-1, 1).float()
    return out.to(x.dtype)


def align_pairs(
    topk_ids: torch.Tensor, first_expert: int, num_local_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The (token, k) pairs of the local experts sorted by expert, each expert's run padded to a
    multiple of ``block_m``: ``(sorted_pairs, block_experts)``.

    ``sorted_pairs`` holds pair ids ``token * top_k + k``, with ``topk_ids.numel()`` in padding
    rows; ``block_experts[b]`` is the local expert of rows ``[b * block_m, (b + 1) * block_m)``,
    -1 for the blocks past the last expert's run. Both are sized for the worst case, not for the
    actual routing, so that no op waits on the device (and CUDA graphs can hold them).
    """
    ids = topk_ids.reshape(-1).long()
    num_pairs = ids.numel()
    local = ids - first_expert
    held = (local >= 0) & (local < num_local_experts)
    # other ranks' pairs get the extra key num_local_experts: they sort last and are dropped
    key = torch.where(held, local, num_local_experts)
    counts = torch.zeros(num_local_experts + 1, dtype=torch.long, device=ids.device)
    counts.scatter_add_(0, key, torch.ones_like(key))
    order = torch.argsort(key, stable=True)
    sorted_key = key[order]

    # every expert with pairs wastes under one block in padding, and at most num_pairs experts have pairs
    max_blocks = -(-num_pairs // block_m) + min(num_local_experts, num_pairs)
    max_rows = max_blocks * block_m
    blocks = (counts[:-1] + block_m - 1) // block_m
    padded_end = torch.cumsum(blocks, 0) * block_m
    padded_start = torch.cat([padded_end - blocks * block_m, padded_end.new_full((1,), max_rows)])
    rank = torch.arange(num_pairs, device=ids.device) - (torch.cumsum(counts, 0) - counts)[sorted_key]
    # dropped pairs all land on one spare row past the end, cut off below
    dest = torch.where(sorted_key < num_local_experts, padded_start[sorted_key] + rank, max_rows)
    sorted_pairs = torch.full((max_rows + 1,), num_pairs, dtype=torch.long, device=ids.device)
    sorted_pairs = sorted_pairs.scatter_(0, dest, order)[:max_rows]

    block_start = torch.arange(max_blocks, device=ids.device) * block_m
    # a block's expert is the first whose padded run ends past the block's start (empty runs never do)
    block_experts = torch.searchsorted(padded_end, block_start, right=True)
    block_experts = torch.where(block_experts < num_local_experts, block_experts, -1).to(torch.int32)
    return sorted_pairs, block_experts


def default_block_sizes(num_pairs: int, num_local_experts: int, hidden: int, inter: int) -> tuple[int, int, int]:
    """``(BLOCK_M, BLOCK_N, BLOCK_K)`` after vLLM's untuned defaults.

    Decode batches give each expert a few rows, where a 16-row block wastes least padding and the
    wide K tile keeps the weight reads long; larger batches take 64-row blocks. Tiles never exceed
    the (power-of-2 rounded) matrix sizes, nor go under the 16 that ``tl.dot`` needs.
    """
    few_rows = num_pairs <= 16 * max(num_local_experts, 1)
    block_m, block_n, block_k = (16, 32, 64) if few_rows else (64, 64, 32)
    smallest = max(16, next_power_of_2(min(hidden, inter)))
    return block_m, min(block_n, smallest), min(block_k, smallest)


def _gate_up_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    out_ptr,
    s_gate_ptr,
    s_up_ptr,
    s_out_ptr,
    sorted_pairs_ptr,
    block_experts_ptr,
    num_routed_blocks,
    num_pairs,
    num_tokens,
    top_k,
    hidden,
    inter,
    shared_inter,
    alpha,
    limit,
    stride_xt,
    stride_xh,
    stride_we,
    stride_wn,
    stride_wh,
    stride_be,
    stride_bn,
    up_shift_w,
    up_shift_b,
    stride_op,
    stride_sgn,
    stride_sgh,
    stride_sun,
    stride_suh,
    stride_so,
    ws_ptr,
    a_scale_ptr,
    stride_wse,
    stride_wsn,
    stride_wsk,
    up_shift_ws,
    stride_asm,
    scale_n,
    scale_k,
    ACTIVATION: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_SHARED: tl.constexpr,
    FORMAT: tl.constexpr,
    W8A8: tl.constexpr,
    UPCAST: tl.constexpr,
    GRID_MANTISSA: tl.constexpr,
    GRID_MIN_EXP: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # gate column c is row c * stride_wn of the expert's [2I, H] weights (the host folds the row
    # step into the stride), and its up column lies up_shift_w elements on; the same for biases
    pid_m = tl.program_id(0)
    routed = pid_m < num_routed_blocks  # the blocks past them (HAS_SHARED) are the shared expert's
    block = tl.minimum(pid_m, num_routed_blocks - 1)
    expert = tl.load(block_experts_ptr + block).to(tl.int64)
    if routed & (expert < 0):
        return
    pairs = tl.load(sorted_pairs_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
    rows_ok = pairs < num_pairs
    x_rows = pairs // top_k
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    # [BLOCK_K, BLOCK_N] tiles of W^T (x @ W^T), over the gate rows and the up rows
    gate_ptrs = w_ptr + expert * stride_we + cols[None, :] * stride_wn + ks[:, None] * stride_wh
    up_ptrs = gate_ptrs + up_shift_w
    out_ptrs = out_ptr + pairs[:, None] * stride_op + cols[None, :]
    gate_step = BLOCK_K * stride_wh
    up_step = BLOCK_K * stride_wh
    n_cols = inter
    if HAS_SHARED:  # the same tiles of the shared expert's weights, token t at row t
        tokens = (pid_m - num_routed_blocks) * BLOCK_M + tl.arange(0, BLOCK_M)
        n_cols = tl.where(routed, inter, shared_inter)
        if tl.program_id(1) * BLOCK_N >= n_cols:
            return
        rows_ok = tl.where(routed, rows_ok, tokens < num_tokens)
        x_rows = tl.where(routed, x_rows, tokens)
        gate_ptrs = tl.where(routed, gate_ptrs, s_gate_ptr + cols[None, :] * stride_sgn + ks[:, None] * stride_sgh)
        up_ptrs = tl.where(routed, up_ptrs, s_up_ptr + cols[None, :] * stride_sun + ks[:, None] * stride_suh)
        out_ptrs = tl.where(routed, out_ptrs, s_out_ptr + tokens[:, None] * stride_so + cols[None, :])
        gate_step = tl.where(routed, gate_step, BLOCK_K * stride_sgh)
        up_step = tl.where(routed, up_step, BLOCK_K * stride_suh)
    cols_ok = cols < n_cols
    x_ptrs = x_ptr + x_rows[:, None] * stride_xt + ks[None, :] * stride_xh

    gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    # quantized weights (FORMAT): the expert's weights and scales, its up rows' scales further on
    w_expert = w_ptr + expert * stride_we
    ws_gate = ws_ptr + expert * stride_wse
    ws_up = ws_gate + up_shift_ws
    for k0 in range(0, hidden, BLOCK_K):
        ks_ok = ks < hidden - k0
        w_mask = ks_ok[:, None] & cols_ok[None, :]
        a = tl.load(x_ptrs, mask=rows_ok[:, None] & ks_ok[None, :], other=0.0)
        if FORMAT == "none":
            wg = tl.load(gate_ptrs, mask=w_mask, other=0.0)
            wu = tl.load(up_ptrs, mask=w_mask, other=0.0)
            a = a.to(wg.dtype)  # as transformers casts the input to the weights' dtype
            if UPCAST:
                a, wg, wu = a.to(tl.float32), wg.to(tl.float32), wu.to(tl.float32)
            gate = tl.dot(a, wg, gate, input_precision=PRECISION)
            up = tl.dot(a, wu, up, input_precision=PRECISION)
        elif W8A8:  # fp8 x fp8, each k tile inside one scale block: scaled per row and column after the dot
            wg = tl.load(gate_ptrs, mask=w_mask, other=0.0)
            wu = tl.load(up_ptrs, mask=w_mask, other=0.0)
            a_s = tl.load(a_scale_ptr + x_rows * stride_asm + k0 // scale_k, mask=rows_ok, other=0.0)[:, None]
            g_s = tl.load(ws_gate + (cols // scale_n) * stride_wsn + (k0 // scale_k) * stride_wsk, mask=cols_ok,
                          other=0.0)
            u_s = tl.load(ws_up + (cols // scale_n) * stride_wsn + (k0 // scale_k) * stride_wsk, mask=cols_ok,
                          other=0.0)
            if UPCAST:
                a, wg, wu = a.to(tl.float32), wg.to(tl.float32), wu.to(tl.float32)
            gate += tl.dot(a, wg, input_precision=PRECISION) * a_s * g_s[None, :]
            up += tl.dot(a, wu, input_precision=PRECISION) * a_s * u_s[None, :]
        else:  # weight-only: the tiles dequantized, rounded to the activations' dtype
            k = k0 + ks
            wg = weight_tile(w_expert, ws_gate, k, cols, w_mask, stride_wn, stride_wh, stride_wsn, stride_wsk,
                             scale_n, scale_k, FORMAT, UPCAST, GRID_MANTISSA, GRID_MIN_EXP).to(a.dtype)
            wu = weight_tile(w_expert + up_shift_w, ws_up, k, cols, w_mask, stride_wn, stride_wh, stride_wsn,
                             stride_wsk, scale_n, scale_k, FORMAT, UPCAST, GRID_MANTISSA, GRID_MIN_EXP).to(a.dtype)
            if UPCAST:
                a, wg, wu = a.to(tl.float32), wg.to(tl.float32), wu.to(tl.float32)
            gate = tl.dot(a, wg, gate, input_precision=PRECISION)
            up = tl.dot(a, wu, up, input_precision=PRECISION)
        x_ptrs += BLOCK_K * stride_xh
        gate_ptrs += gate_step
        up_ptrs += up_step
    if HAS_BIAS:
        gate_bias = b_ptr + expert * stride_be + cols * stride_bn
        gate += tl.load(gate_bias, mask=cols_ok, other=0.0).to(tl.float32)[None, :]
        up += tl.load(gate_bias + up_shift_b, mask=cols_ok, other=0.0).to(tl.float32)[None, :]

    if ACTIVATION == "silu":
        act = gate * tl.sigmoid(gate)
    elif ACTIVATION == "gelu":
        act = 0.5 * gate * (1.0 + tl.math.erf(gate * 0.7071067811865476))  # 1/sqrt(2)
    elif ACTIVATION == "gelu_tanh":
        # 0.5 * (1 + tanh(z)) == sigmoid(2z): the tanh form without a tanh; 1.5957... is 2 * sqrt(2/pi)
        act = gate * tl.sigmoid(1.5957691216057308 * (gate + 0.044715 * gate * gate * gate))
    elif ACTIVATION == "swiglu_limit":
        gate = tl.minimum(gate, limit)
        act = gate * tl.sigmoid(gate)
        up = tl.minimum(tl.maximum(up, -limit), limit)
    else:  # swigluoai
        gate = tl.minimum(gate, limit)
        act = gate * tl.sigmoid(alpha * gate)
        up = tl.minimum(tl.maximum(up, -limit), limit) + 1.0
    gated = act * up
    if UPCAST and FORMAT != "none":
        # w8a8 quantizes this to fp8, where a bf16 rounding the interpreter gets wrong (quant_tiles.rounded)
        # becomes a whole fp8 step: round it here, so that the cast is exact
        gated = rounded(gated, GRID_MANTISSA, GRID_MIN_EXP)
    tl.store(out_ptrs, gated.to(out_ptr.dtype.element_ty), mask=rows_ok[:, None] & cols_ok[None, :])


def _down_kernel(
    h_ptr,
    w_ptr,
    b_ptr,
    weights_ptr,
    out_ptr,
    s_h_ptr,
    s_down_ptr,
    s_scale_ptr,
    sorted_pairs_ptr,
    block_experts_ptr,
    num_routed_blocks,
    num_pairs,
    num_tokens,
    hidden,
    inter,
    shared_inter,
    stride_hp,
    stride_we,
    stride_wh,
    stride_wi,
    stride_be,
    stride_bh,
    stride_op,
    stride_shp,
    stride_sdh,
    stride_sdi,
    ws_ptr,
    a_scale_ptr,
    stride_wse,
    stride_wsn,
    stride_wsk,
    stride_asm,
    scale_n,
    scale_k,
    HAS_BIAS: tl.constexpr,
    HAS_SHARED: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    FORMAT: tl.constexpr,
    W8A8: tl.constexpr,
    UPCAST: tl.constexpr,
    GRID_MANTISSA: tl.constexpr,
    GRID_MIN_EXP: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    routed = pid_m < num_routed_blocks  # the blocks past them (HAS_SHARED) are the shared expert's
    block = tl.minimum(pid_m, num_routed_blocks - 1)
    expert = tl.load(block_experts_ptr + block).to(tl.int64)
    if routed & (expert < 0):
        return
    pairs = tl.load(sorted_pairs_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
    rows_ok = pairs < num_pairs
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols_ok = cols < hidden
    ks = tl.arange(0, BLOCK_K)

    h_ptrs = h_ptr + pairs[:, None] * stride_hp + ks[None, :]
    w_ptrs = w_ptr + expert * stride_we + cols[None, :] * stride_wh + ks[:, None] * stride_wi
    w_step = BLOCK_K * stride_wi
    k_end = inter
    routing = tl.load(weights_ptr + pairs, mask=rows_ok, other=0.0).to(tl.float32)
    out_ptrs = out_ptr + pairs[:, None] * stride_op + cols[None, :]
    if HAS_SHARED:  # the shared expert's rows go to output rows num_pairs + t
        tokens = (pid_m - num_routed_blocks) * BLOCK_M + tl.arange(0, BLOCK_M)
        tokens_ok = (tokens >= 0) & (tokens < num_tokens)  # none in a routed block
        rows_ok = tl.where(routed, rows_ok, tokens_ok)
        h_ptrs = tl.where(routed, h_ptrs, s_h_ptr + tokens[:, None] * stride_shp + ks[None, :])
        w_ptrs = tl.where(routed, w_ptrs, s_down_ptr + cols[None, :] * stride_sdh + ks[:, None] * stride_sdi)
        w_step = tl.where(routed, w_step, BLOCK_K * stride_sdi)
        k_end = tl.where(routed, inter, shared_inter)
        scale = tl.full([BLOCK_M], 1.0, tl.float32)
        if HAS_SCALE:
            scale = tl.load(s_scale_ptr + tokens, mask=tokens_ok, other=0.0)
        routing = tl.where(routed, routing, scale)
        out_ptrs = tl.where(routed, out_ptrs, out_ptr + (num_pairs + tokens)[:, None] * stride_op + cols[None, :])
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    w_expert = w_ptr + expert * stride_we
    ws_expert = ws_ptr + expert * stride_wse
    for k0 in range(0, k_end, BLOCK_K):
        ks_ok = ks < k_end - k0
        w_mask = ks_ok[:, None] & cols_ok[None, :]
        a = tl.load(h_ptrs, mask=rows_ok[:, None] & ks_ok[None, :], other=0.0)
        if FORMAT == "none":
            w = tl.load(w_ptrs, mask=w_mask, other=0.0)
            if UPCAST:
                a, w = a.to(tl.float32), w.to(tl.float32)
            acc = tl.dot(a, w, acc, input_precision=PRECISION)
        elif W8A8:
            w = tl.load(w_ptrs, mask=w_mask, other=0.0)
            a_s = tl.load(a_scale_ptr + pairs * stride_asm + k0 // scale_k, mask=rows_ok, other=0.0)
            w_s = tl.load(ws_expert + (cols // scale_n) * stride_wsn + (k0 // scale_k) * stride_wsk, mask=cols_ok,
                          other=0.0)
            if UPCAST:
                a, w = a.to(tl.float32), w.to(tl.float32)
            acc += tl.dot(a, w, input_precision=PRECISION) * a_s[:, None] * w_s[None, :]
        else:
            w = weight_tile(w_expert, ws_expert, k0 + ks, cols, w_mask, stride_wh, stride_wi, stride_wsn, stride_wsk,
                            scale_n, scale_k, FORMAT, UPCAST, GRID_MANTISSA, GRID_MIN_EXP).to(a.dtype)
            if UPCAST:
                a, w = a.to(tl.float32), w.to(tl.float32)
            acc = tl.dot(a, w, acc, input_precision=PRECISION)
        h_ptrs += BLOCK_K
        w_ptrs += w_step
    if HAS_BIAS:
        acc += tl.load(b_ptr + expert * stride_be + cols * stride_bh, mask=cols_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptrs, acc * routing[:, None], mask=rows_ok[:, None] & cols_ok[None, :])


# Tile shapes worth timing (vLLM's tuned configs cluster here); clamped to the matrix sizes.
_CANDIDATES = [(16, 32, 64), (16, 64, 64), (16, 128, 64), (32, 64, 64), (32, 128, 64), (64, 64, 32),
               (64, 128, 32), (64, 128, 64), (128, 128, 32), (128, 256, 64)]


def candidate_block_sizes(hidden: int, inter: int) -> list[tuple[int, int, int]]:
    smallest = max(16, next_power_of_2(min(hidden, inter)))
    return list(dict.fromkeys((m, min(n, smallest), min(k, smallest)) for m, n, k in _CANDIDATES))


@dataclass(frozen=True)
class ExpertScales:
    """How the routed experts' weights are quantized, for the kernels (``afdc/codegen/fused_moe_quant.py``
    builds it): ``format`` one of :data:`afdc.codegen.quant_tiles.WEIGHT_FORMATS`, the scales of the
    gate-up and down weights, and the block each scale covers (``scale_n`` output x ``scale_k`` input
    features). fp8 gate-up scales hold the gate rows' blocks, then the up rows'
    (``[E, 2 * ceil(I / scale_n), ceil(H / scale_k)]``); MXFP4 scales have one row per weight row."""

    format: str
    gate_up: torch.Tensor
    down: torch.Tensor
    scale_n: int
    scale_k: int
    w8a8: bool = False  # fp8 only: activations quantized per token group of scale_k, fp8 x fp8 dots

    def __post_init__(self) -> None:
        if self.format not in WEIGHT_FORMATS or (self.w8a8 and self.format != "fp8"):
            raise ValueError(f"fused_moe: weights in {self.format!r}{' with w8a8' if self.w8a8 else ''} are not "
                             f"supported; formats: {', '.join(WEIGHT_FORMATS)} (w8a8 with fp8 only)")


def w8a8_block_k(block_k: int, scale_k: int) -> int:
    """The K tile of a w8a8 GEMM: a power of 2 dividing the scale block, so that a tile has one scale."""
    tile = min(block_k, scale_k & -scale_k)
    if tile < 16:
        raise ValueError(f"w8a8 needs a weight block_k that is a multiple of 16 (tl.dot's smallest K), got {scale_k}; "
                         "run it weight-only (w8a8=False)")
    return tile


@takes_arguments_of(Experts, block_m=None, block_n=None, block_k=None)
def fused_moe_triton(*args, block_m: int | None = None, block_n: int | None = None, block_k: int | None = None,
                     **kwargs) -> torch.Tensor:
    """:func:`fused_moe` by the Triton kernels. Block sizes not given are tuned for this device and
    shape (:mod:`afdc.codegen.autotune`, on by default on CUDA) or else :func:`default_block_sizes`."""
    experts = Experts(*args, **kwargs)
    experts.check()
    kernel = "fused_moe" + ("_transposed" if experts.transposed else "")
    return launch(experts.output_major(), None, (block_m, block_n, block_k), kernel)


def launch(
    e: Experts, scales: ExpertScales | None, tiles: tuple[int | None, int | None, int | None], kernel: str
) -> torch.Tensor:
    """Runs the kernels on output-major, checked experts (quantized when ``scales`` is given);
    ``kernel`` names the variant in the autotune cache."""
    x, w_gate_up, w_down, topk_ids = e.x, e.w_gate_up, e.w_down, e.topk_ids
    tokens, hidden = x.shape
    num_local, two_inter = w_gate_up.shape[:2]
    inter = two_inter // 2
    num_pairs = topk_ids.numel()
    if num_pairs == 0:
        return torch.zeros_like(x)
    has_shared = e.s_gate is not None
    shared_inter = e.s_gate.shape[0] if has_shared else 0
    if tiles == (None, None, None):
        # the weights' layout and a shared expert change which tiles read memory best
        kernel += f"_shared{shared_inter}" if has_shared else ""
        key = autotune.TuneKey.of(kernel, w_gate_up, (next_power_of_2(num_pairs), num_local, hidden, inter))
        tiles = autotune.shipped().nearest(key) or tiles  # tuned offline for this device
        if tiles == (None, None, None) and autotune.enabled(x):
            tiles = autotune.tuner().best(key, candidate_block_sizes(hidden, inter),
                                          lambda tried: launch(e, scales, tried, kernel), x)
    block_m, block_n, block_k = (given or default for given, default in
                                 zip(tiles, default_block_sizes(num_pairs, num_local, hidden, inter)))
    w8a8 = scales is not None and scales.w8a8
    if w8a8:
        block_k = w8a8_block_k(block_k, scales.scale_k)

    sorted_pairs, block_experts = align_pairs(topk_ids, e.first_expert, num_local, block_m)
    routed_blocks = block_experts.numel()
    shared_blocks = -(-tokens // block_m) if has_shared else 0
    # quantized weights are dequantized to the activations' dtype, the dtype they multiply in
    compute_dtype = w_gate_up.dtype if scales is None else x.dtype
    # The interpreter keeps bf16 as raw uint16 and its tl.dot multiplies those bits: it gets fp32
    # operands. fp32 runs in full precision ("ieee"), as torch's matmul does unless TF32 is enabled.
    upcast = interpreting()
    grid = rounding_grid(compute_dtype)  # where quantized weights are rounded to (the interpreter rounds itself)
    precision = "ieee" if upcast or compute_dtype == torch.float32 else "tf32"  # tf32 is ignored for bf16/fp16
    step = 2 if e.interleaved else 1  # gate column c sits at row c * step
    up_row = 1 if e.interleaved else inter  # and its up column that many rows on
    stride_we, stride_wn, stride_wh = w_gate_up.stride()
    # pointers a kernel never reads stand in for the tensors an option leaves out
    b1 = e.b_gate_up if e.b_gate_up is not None else x
    b2 = e.b_down if e.b_down is not None else x
    s_gate, s_up, s_down = (e.s_gate, e.s_up, e.s_down) if has_shared else (w_gate_up[0],) * 3
    scale = e.s_scale.reshape(-1).float() if e.s_scale is not None else x
    hidden_states = torch.empty(num_pairs, inter, dtype=compute_dtype, device=x.device)
    shared_states = (torch.empty(tokens, shared_inter, dtype=compute_dtype, device=x.device) if has_shared
                     else hidden_states)
    quant = _QuantArgs.of(scales, x, inter, up_row, step)
    grid_n = -(-max(inter, shared_inter) // block_n)
    jit(_gate_up_kernel)[(routed_blocks + shared_blocks, grid_n)](
        quant.x,
        w_gate_up,
        b1,
        hidden_states,
        s_gate,
        s_up,
        shared_states,
        sorted_pairs,
        block_experts,
        routed_blocks,
        num_pairs,
        tokens,
        topk_ids.shape[1],
        hidden,
        inter,
        shared_inter,
        e.alpha or 0.0,
        e.limit or 0.0,
        quant.x.stride(0),
        quant.x.stride(1),
        stride_we,
        stride_wn * step,
        stride_wh,
        b1.stride(0),
        b1.stride(1) * step,
        up_row * stride_wn,
        up_row * b1.stride(1),
        hidden_states.stride(0),
        *s_gate.stride(),
        *s_up.stride(),
        shared_states.stride(0),
        *quant.gate_up_args,
        ACTIVATION=e.activation,
        HAS_BIAS=e.b_gate_up is not None,
        HAS_SHARED=has_shared,
        FORMAT=quant.format,
        W8A8=w8a8,
        UPCAST=upcast,
        GRID_MANTISSA=grid[0],
        GRID_MIN_EXP=grid[1],
        PRECISION=precision,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
    )
    h, h_scales = quantize_token_groups(hidden_states, scales.scale_k) if w8a8 else (hidden_states, x)
    # pairs of other ranks' experts are never written: they stay zero; the shared rows follow the pairs
    pair_out = torch.zeros(num_pairs + (tokens if has_shared else 0), hidden, dtype=torch.float32, device=x.device)
    jit(_down_kernel)[(routed_blocks + shared_blocks, -(-hidden // block_n))](
        h,
        w_down,
        b2,
        e.topk_weights.reshape(-1).contiguous(),
        pair_out,
        shared_states,
        s_down,
        scale,
        sorted_pairs,
        block_experts,
        routed_blocks,
        num_pairs,
        tokens,
        hidden,
        inter,
        shared_inter,
        h.stride(0),
        *w_down.stride(),
        b2.stride(0),
        b2.stride(1),
        pair_out.stride(0),
        shared_states.stride(0),
        *s_down.stride(),
        *quant.down_args(h_scales),
        HAS_BIAS=e.b_down is not None,
        HAS_SHARED=has_shared,
        HAS_SCALE=e.s_scale is not None,
        FORMAT=quant.format,
        W8A8=w8a8,
        UPCAST=upcast,
        GRID_MANTISSA=grid[0],
        GRID_MIN_EXP=grid[1],
        PRECISION=precision,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
    )
    out = pair_out[:num_pairs].view(tokens, -1, hidden).sum(dim=1)
    if has_shared:
        out += pair_out[num_pairs:]
    return out.to(x.dtype)


@dataclass(frozen=True)
class _QuantArgs:
    """The kernels' quantization arguments: the activations they read (fp8 for w8a8) and the
    scales' pointers, strides and blocks; stand-ins that are never read for bf16 weights."""

    format: str
    x: torch.Tensor
    gate_up_args: tuple
    down_scales: torch.Tensor
    scale_n: int
    scale_k: int

    @classmethod
    def of(cls, scales: ExpertScales | None, x: torch.Tensor, inter: int, up_row: int, step: int) -> _QuantArgs:
        if scales is None:
            return cls("none", x, (x, x, 0, 0, 0, 0, 0, 1, 1), x, 1, 1)
        stride_se, stride_sn, stride_sk = scales.gate_up.stride()
        # fp8: the up rows' blocks follow the gate rows' ceil(I / scale_n); MXFP4: a scale row per weight row
        up_shift = -(-inter // scales.scale_n) * stride_sn if scales.format == "fp8" else up_row * stride_sn
        a, a_scales = quantize_token_groups(x, scales.scale_k) if scales.w8a8 else (x, x)
        gate_up = (scales.gate_up, a_scales, stride_se, stride_sn * step, stride_sk, up_shift, a_scales.stride(0),
                   scales.scale_n, scales.scale_k)
        return cls(scales.format, a, gate_up, scales.down, scales.scale_n, scales.scale_k)

    def down_args(self, h_scales: torch.Tensor) -> tuple:
        if self.format == "none":
            return self.x, self.x, 0, 0, 0, 0, 1, 1
        return (self.down_scales, h_scales, *self.down_scales.stride(), h_scales.stride(0), self.scale_n,
                self.scale_k)


@torch.library.custom_op("afdc::fused_moe", mutates_args=())
@takes_arguments_of(Experts)
def fused_moe(*args, **kwargs) -> torch.Tensor:
    """``sum_k topk_weights[t, k] * expert(x[t])`` over the choices of the local experts
    ``[first_expert, first_expert + E_local)``: ``down(act(gate(x)) * up(x))`` with ``w_gate_up``
    [E_local, 2I, H] (gate rows, then up rows) and ``w_down`` [E_local, H, I]. Other experts'
    choices add zero. ``activation`` is one of :data:`ACTIVATIONS`; the result has x's dtype.

    Options for other expert formats: per-expert biases ``b_gate_up`` [E_local, 2I] and
    ``b_down`` [E_local, H]; ``transposed`` weights [E_local, H, 2I] and [E_local, I, H];
    ``interleaved`` gate and up rows (gate ``2c``, up ``2c + 1``); ``alpha`` and ``limit`` of
    ``swigluoai``, ``limit`` of ``swiglu_limit``. A shared expert every token passes through:
    ``s_down(act(s_gate x) * s_up x)`` times ``s_scale`` (one value per token, or 1), added to the sum.
    """
    if launches(*Experts(*args, **kwargs).tensors()):
        return fused_moe_triton(*args, **kwargs)
    return fused_moe_reference(*args, **kwargs)


@fused_moe.register_fake
def _(*args, **kwargs):
    experts = Experts(*args, **kwargs)
    experts.check()
    return torch.empty_like(experts.x)


@dataclass(frozen=True)
class FusedMoeCall(EmittedCall):
    """One ``afdc::fused_moe`` node's arguments by name (tensors are graph values)."""

    node: fx.Node
    x: fx.Node
    w_gate_up: fx.Node
    w_down: fx.Node
    topk_weights: fx.Node
    topk_ids: fx.Node
    first_expert: object  # an int, or a graph value (rank * experts per rank) on a sharded rank
    activation: str
    b_gate_up: fx.Node | None = None
    b_down: fx.Node | None = None
    transposed: bool = False
    interleaved: bool = False
    alpha: float | None = None
    limit: float | None = None
    s_gate: fx.Node | None = None
    s_up: fx.Node | None = None
    s_down: fx.Node | None = None
    s_scale: fx.Node | None = None

    OP = torch.ops.afdc.fused_moe.default

    @property
    def has_shared_expert(self) -> bool:
        return self.s_down is not None

    @property
    def has_biases(self) -> bool:
        return self.b_gate_up is not None or self.b_down is not None
