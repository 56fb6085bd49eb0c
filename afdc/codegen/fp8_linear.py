"""A linear layer with an fp8 block-scaled weight: Triton kernel, PyTorch reference, custom op.

::

    afdc::fp8_linear(Tensor x, Tensor weight, Tensor weight_scale, SymInt block_n, SymInt block_k,
        Tensor? bias=None, bool w8a8=False, Tensor? input_scale=None) -> Tensor

``x`` [..., K] (bf16, fp16 or fp32), ``weight`` [N, K] float8_e4m3fn, ``weight_scale`` the
float32 multiplier of each ``block_n x block_k`` block (:class:`afdc.quant.formats.Fp8Block`),
``ceil(N / block_n) * ceil(K / block_k)`` values in any shape that reshapes to that grid; the
result is ``[..., N]`` in x's dtype, ``bias`` added in fp32. One op for every fp8 scheme:

- DeepSeek-V3 / Qwen3-FP8 blocks: ``weight_scale_inv`` as is, ``block_n, block_k`` from
  ``weight_block_size`` (DeepSeek-V4's ``ue8m0`` scales, float8_e8m0fnu powers of two, and
  compressed-tensors' bf16 ones are widened to float32 per call, exactly);
- compressed-tensors per channel: ``weight_scale`` [N, 1] with ``block_n=1, block_k=K``;
- compressed-tensors per tensor: the one ``weight_scale`` with ``block_n=N, block_k=K``.

``w8a8=False`` (weight-only, any GPU): the kernel dequantizes each weight tile to x's dtype and
multiplies with fp32 accumulators. ``w8a8=True`` (GPUs with fp8 tensor cores): the activations
are quantized to fp8 first, per token group of ``block_k`` (DeepSeek's dynamic scheme), or with
the static per-tensor ``input_scale`` when one is given (compressed-tensors), and the kernel
multiplies fp8 by fp8, scaling each K tile's product by its row and column scales; a K tile must
lie in one scale block, so ``block_k`` is a multiple of 16 or covers all of K.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx
import torch.nn.functional as F

from afdc.codegen.fused_moe import w8a8_block_k
from afdc.codegen.quant_tiles import (
    quantize_token_groups,
    quantize_token_groups_reference,
    rounded,
    rounding_grid,
    weight_tile,
)
from afdc.codegen.rms_norm import present
from afdc.codegen.triton_support import interpreting, jit, launches, next_power_of_2, tl
from afdc.codegen.typed_calls import EmittedCall, takes_arguments_of
from afdc.quant.formats import Fp8Block, TokenGroupQuant


@dataclass(frozen=True)
class Fp8Linear:
    """The arguments of ``afdc::fp8_linear`` (the op's schema is read from these fields)."""

    x: torch.Tensor
    weight: torch.Tensor
    weight_scale: torch.Tensor
    block_n: int
    block_k: int
    bias: torch.Tensor | None = None
    w8a8: bool = False
    input_scale: torch.Tensor | None = None

    def block_scale(self) -> torch.Tensor:
        """Checks the call; the scales as the ``[ceil(N / block_n), ceil(K / block_k)]`` grid."""
        return _block_scale(self.x, self.weight, self.weight_scale, self.block_n, self.block_k, self.bias,
                            self.input_scale)


def _block_scale(x, weight, weight_scale, block_n, block_k, bias, input_scale) -> torch.Tensor:
    if weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"fp8_linear: x {tuple(x.shape)} does not fit weight {tuple(weight.shape)} ([N, K])")
    fmt = Fp8Block(block_n, block_k)
    grid = fmt.scale_shape(*weight.shape)
    if weight_scale.numel() != grid[0] * grid[1]:
        raise ValueError(f"fp8_linear: weight {tuple(weight.shape)} in [{block_n}, {block_k}] blocks needs "
                         f"{grid[0]} x {grid[1]} scales, got {tuple(weight_scale.shape)}")
    scale = weight_scale.float().reshape(grid)
    fmt.check("fp8_linear", weight, scale)
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"fp8_linear: bias {tuple(bias.shape)} is not ({weight.shape[0]},)")
    if input_scale is not None and input_scale.numel() != 1:
        raise ValueError(f"fp8_linear: input_scale {tuple(input_scale.shape)} is not one per-tensor value")
    return scale


@takes_arguments_of(Fp8Linear)
def fp8_linear_reference(*args, **kwargs) -> torch.Tensor:
    """The weight dequantized by the format's definition, in fp32, rounding where the kernel does."""
    call = Fp8Linear(*args, **kwargs)
    scale = call.block_scale()
    x, weight, block_n, block_k, bias, input_scale = call.x, call.weight, call.block_n, call.block_k, call.bias, \
        call.input_scale
    rows = x.reshape(-1, x.shape[-1])
    fmt = Fp8Block(block_n, block_k)
    if call.w8a8:  # the activations as their fp8 values times their scales, the weight in fp32
        x_q, x_s = quantize_token_groups_reference(rows, block_k, input_scale)
        a, w = TokenGroupQuant(block_k).dequantize(x_q, x_s), fmt.dequantize(weight, scale)
    else:  # the weight rounded to x's dtype, the products summed in fp32
        a, w = rows.float(), fmt.dequantize(weight, scale, x.dtype).float()
    out = F.linear(a, w, None if bias is None else bias.float())
    return out.to(x.dtype).reshape(*x.shape[:-1], weight.shape[0])


def _fp8_linear_kernel(
    x_ptr,
    xs_ptr,
    w_ptr,
    ws_ptr,
    b_ptr,
    out_ptr,
    m,
    n,
    k,
    stride_xm,
    stride_xsm,
    stride_wn,
    stride_wk,
    stride_wsn,
    stride_wsk,
    stride_om,
    scale_n,
    scale_k,
    FORMAT: tl.constexpr,
    W8A8: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    UPCAST: tl.constexpr,
    GRID_MANTISSA: tl.constexpr,
    GRID_MIN_EXP: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    rows_ok = rows < m
    cols_ok = cols < n
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, k, BLOCK_K):
        kk = k0 + ks
        ks_ok = kk < k
        w_mask = ks_ok[:, None] & cols_ok[None, :]
        a_ptrs = x_ptr + rows[:, None].to(tl.int64) * stride_xm + kk[None, :]
        a = tl.load(a_ptrs, mask=rows_ok[:, None] & ks_ok[None, :], other=0.0)
        if W8A8:  # the tile lies in one scale block: its product scaled per row and per column
            w = tl.load(w_ptr + cols[None, :] * stride_wn + kk[:, None] * stride_wk, mask=w_mask, other=0.0)
            a_s = tl.load(xs_ptr + rows * stride_xsm + k0 // scale_k, mask=rows_ok, other=0.0)
            w_s = tl.load(ws_ptr + (cols // scale_n) * stride_wsn + (k0 // scale_k) * stride_wsk, mask=cols_ok,
                          other=0.0)
            if UPCAST:
                a, w = a.to(tl.float32), w.to(tl.float32)
            acc += tl.dot(a, w, input_precision=PRECISION) * a_s[:, None] * w_s[None, :]
        else:
            w = weight_tile(w_ptr, ws_ptr, kk, cols, w_mask, stride_wn, stride_wk, stride_wsn, stride_wsk, scale_n,
                            scale_k, FORMAT, UPCAST, GRID_MANTISSA, GRID_MIN_EXP).to(x_ptr.dtype.element_ty)
            if UPCAST:
                a, w = a.to(tl.float32), w.to(tl.float32)
            acc = tl.dot(a, w, acc, input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=cols_ok, other=0.0).to(tl.float32)[None, :]
    if UPCAST:  # the interpreter's downcast truncates (quant_tiles.rounded): round to nearest first
        acc = rounded(acc, GRID_MANTISSA, GRID_MIN_EXP)
    out_ptrs = out_ptr + rows[:, None].to(tl.int64) * stride_om + cols[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=rows_ok[:, None] & cols_ok[None, :])


@takes_arguments_of(Fp8Linear)
def fp8_linear_triton(*args, **kwargs) -> torch.Tensor:
    """:func:`fp8_linear` by the Triton kernel."""
    call = Fp8Linear(*args, **kwargs)
    scale = call.block_scale()
    x, weight, block_n, block_k, bias, w8a8 = call.x, call.weight, call.block_n, call.block_k, call.bias, call.w8a8
    return launch_linear(x, weight, scale, block_n, block_k, bias, "fp8", w8a8, call.input_scale)


def launch_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block_n: int, block_k: int,
                  bias: torch.Tensor | None, fmt: str, w8a8: bool = False,
                  input_scale: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W^T + bias`` by the kernel, ``W`` read tile by tile in quant_tiles' format ``fmt`` with
    ``scale`` [rows of blocks, blocks of K] (checked by the caller); ``[..., N]`` in x's dtype."""
    rows = x.reshape(-1, x.shape[-1])
    rows = rows if rows.stride(-1) == 1 else rows.contiguous()
    m, k = rows.shape
    n = weight.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out.reshape(*x.shape[:-1], n)
    tile_m = min(64, max(16, next_power_of_2(m)))
    tile_n = min(64, max(16, next_power_of_2(n)))
    tile_k = min(128, max(16, next_power_of_2(k)))
    a, a_scales = rows, rows
    if w8a8:
        # a tile must not cross a scale block (unless one block covers all of K)
        tile_k = tile_k if block_k >= k else w8a8_block_k(tile_k, block_k)
        a, a_scales = quantize_token_groups(rows, block_k, input_scale)
    upcast = interpreting()
    grid = rounding_grid(x.dtype)
    jit(_fp8_linear_kernel)[(-(-m // tile_m), -(-n // tile_n))](
        a,
        a_scales,
        weight,
        scale,
        bias if bias is not None else scale,
        out,
        m,
        n,
        k,
        a.stride(0),
        a_scales.stride(0),
        *weight.stride(),
        *scale.stride(),
        out.stride(0),
        block_n,
        block_k,
        FORMAT=fmt,
        W8A8=w8a8,
        HAS_BIAS=bias is not None,
        UPCAST=upcast,
        GRID_MANTISSA=grid[0],
        GRID_MIN_EXP=grid[1],
        PRECISION="ieee" if upcast or x.dtype == torch.float32 else "tf32",
        BLOCK_M=tile_m,
        BLOCK_N=tile_n,
        BLOCK_K=tile_k,
    )
    return out.reshape(*x.shape[:-1], n)


@torch.library.custom_op("afdc::fp8_linear", mutates_args=())
@takes_arguments_of(Fp8Linear)
def fp8_linear(*args, **kwargs) -> torch.Tensor:
    """``x @ dequantize(weight).T + bias`` for an fp8 block-scaled weight (the module docstring)."""
    call = Fp8Linear(*args, **kwargs)
    if launches(*present(call.x, call.weight, call.weight_scale, call.bias, call.input_scale)):
        return fp8_linear_triton(*args, **kwargs)
    return fp8_linear_reference(*args, **kwargs)


@fp8_linear.register_fake
def _(*args, **kwargs):
    call = Fp8Linear(*args, **kwargs)
    call.block_scale()
    return call.x.new_empty((*call.x.shape[:-1], call.weight.shape[0]))


@dataclass(frozen=True)
class Fp8LinearCall(EmittedCall):
    """One ``afdc::fp8_linear`` node's arguments by name (tensors are graph values)."""

    node: fx.Node
    x: fx.Node
    weight: fx.Node
    weight_scale: fx.Node
    block_n: int
    block_k: int
    bias: fx.Node | None = None
    w8a8: bool = False
    input_scale: fx.Node | None = None

    OP = torch.ops.afdc.fp8_linear.default
