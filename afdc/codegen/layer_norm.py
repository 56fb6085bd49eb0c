"""LayerNorm, alone and fused with the residual add before it: Triton kernel, PyTorch reference, custom ops.

Same layout as :mod:`afdc.codegen.rms_norm`: one program per row held whole in registers, fp32
statistics, one cast to ``out_dtype``; ``afdc::add_layer_norm`` reads ``x`` and ``residual``
once and writes both the normalized row and the sum.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from afdc.codegen.rms_norm import check_residual, launch_row_kernel, present
from afdc.codegen.triton_support import launches, tl

# -- reference -----------------------------------------------------------------------------------


def layer_norm_reference(
    x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float, out_dtype: torch.dtype
) -> torch.Tensor:
    def f32(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.float()

    return F.layer_norm(x.float(), (x.shape[-1],), f32(weight), f32(bias), eps).to(out_dtype)


def add_layer_norm_reference(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    out_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    check_residual("add_layer_norm", x, residual)
    summed = x + residual
    return layer_norm_reference(summed, weight, bias, eps, out_dtype), summed


# -- kernel --------------------------------------------------------------------------------------


def _layer_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    b_ptr,
    out_ptr,
    sum_ptr,
    x_row_stride,
    res_row_stride,
    n_cols,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * res_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
        summed = (x + r).to(sum_ptr.dtype.element_ty)
        tl.store(sum_ptr + row * n_cols + cols, summed, mask=mask)
        x = summed.to(tl.float32)
    mean = tl.sum(x, 0) / n_cols
    # Padding columns must not count in the variance: they would add mean**2 each.
    centered = tl.where(mask, x - mean, 0.0)
    var = tl.sum(centered * centered, 0) / n_cols
    y = centered * tl.math.rsqrt(var + eps)
    if HAS_WEIGHT:
        y = y * tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        y = y + tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * n_cols + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def layer_norm_triton(
    x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float, out_dtype: torch.dtype
) -> torch.Tensor:
    return launch_row_kernel(_layer_norm_kernel, "layer_norm", x, None, {"weight": weight, "bias": bias}, (eps,),
                             out_dtype)[0]


def add_layer_norm_triton(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    out_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    check_residual("add_layer_norm", x, residual)
    return launch_row_kernel(_layer_norm_kernel, "layer_norm", x, residual, {"weight": weight, "bias": bias}, (eps,),
                             out_dtype)


# -- custom ops ----------------------------------------------------------------------------------


@torch.library.custom_op("afdc::layer_norm", mutates_args=())
def layer_norm(
    x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float, out_dtype: torch.dtype
) -> torch.Tensor:
    """``F.layer_norm`` over the last dim, computed in fp32 and cast to ``out_dtype``."""
    if launches(*present(x, weight, bias)):
        return layer_norm_triton(x, weight, bias, eps, out_dtype)
    return layer_norm_reference(x, weight, bias, eps, out_dtype)


@layer_norm.register_fake
def _(x, weight, bias, eps, out_dtype):
    return x.new_empty(x.shape, dtype=out_dtype)


@torch.library.custom_op("afdc::add_layer_norm", mutates_args=())
def add_layer_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    out_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(layer_norm(x + residual), x + residual)``: the residual add and the norm that follows it."""
    if launches(*present(x, residual, weight, bias)):
        return add_layer_norm_triton(x, residual, weight, bias, eps, out_dtype)
    return add_layer_norm_reference(x, residual, weight, bias, eps, out_dtype)


@add_layer_norm.register_fake
def _(x, residual, weight, bias, eps, out_dtype):
    check_residual("add_layer_norm", x, residual)
    return x.new_empty(x.shape, dtype=out_dtype), x.new_empty(x.shape, dtype=torch.result_type(x, residual))
