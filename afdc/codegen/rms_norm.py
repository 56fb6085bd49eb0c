"""RMSNorm, alone and fused with the residual add before it: Triton kernel, PyTorch reference, custom ops.

``afdc::rms_norm`` covers Llama-style norms (``offset`` 0.0: ``y * w``) and Gemma-style ones
(``offset`` 1.0: ``y * (1 + w)``); both compute in fp32 and cast once to ``out_dtype``.
``afdc::add_rms_norm`` also returns the residual sum, which the next layer's residual add needs,
so one kernel reads ``x`` and ``residual`` once and writes both results.

One program normalizes one row held whole in registers, so a row is read from memory once.
The row helpers here are shared by the other row-wise kernels (layer norm, act_mul).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from afdc.codegen.triton_support import jit, launches, next_power_of_2, tl

# A row is one block in registers; liger-kernel caps its row kernels at the same width, and no
# Hugging Face decoder's hidden size comes near it.
MAX_ROW_WIDTH = 65536


def as_rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` as ``[rows, last dim]`` with a contiguous last dim: a view whenever reshape allows one.

    Kernels take each row's stride, so leading dims that merge into one stride are not copied.
    """
    rows = t.reshape(-1, t.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def row_block(width: int) -> int:
    """The block one program loads a row into; raises if the row cannot fit in registers."""
    if width > MAX_ROW_WIDTH:
        raise ValueError(f"rows of {width} elements exceed the row kernels' limit of {MAX_ROW_WIDTH}")
    return next_power_of_2(width)


def row_num_warps(block: int) -> int:
    """Warps for one row per program: enough that each thread holds a few dozen elements at most."""
    return min(max(block // 512, 4), 16)


def check_row_param(op: str, name: str, param: torch.Tensor | None, width: int) -> None:
    """A per-feature weight or bias must have one element per column (the kernel reads ``width`` of them)."""
    if param is not None and tuple(param.shape) != (width,):
        raise ValueError(f"{op}: {name} has shape {tuple(param.shape)}, expected ({width},)")


def check_residual(op: str, x: torch.Tensor, residual: torch.Tensor) -> None:
    """The fused add does not broadcast: the residual stream and the block output have one shape."""
    if x.shape != residual.shape:
        raise ValueError(f"{op}: x {tuple(x.shape)} and residual {tuple(residual.shape)} differ in shape")


def row_outputs(
    x: torch.Tensor, residual: torch.Tensor | None, out_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A norm kernel's outputs, shaped like ``x``: the normed rows, and with a residual its sum
    with ``x`` (in the dtype torch's add would give it)."""
    out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    summed = None if residual is None else torch.empty(x.shape, dtype=torch.result_type(x, residual), device=x.device)
    return out, summed


def present(*tensors: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
    """The tensors that are not None (optional weights and biases), for :func:`launches`."""
    return tuple(t for t in tensors if t is not None)


def launch_row_kernel(
    kernel: Callable,
    op: str,
    x: torch.Tensor,
    residual: torch.Tensor | None,
    params: dict[str, torch.Tensor | None],
    scalars: tuple,
    out_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Runs a norm kernel, one program per row, returning ``(normed, summed)`` (``summed`` None
    without a residual). The kernel takes ``(x, residual, *params, out, sum, x row stride,
    residual row stride, width, *scalars)`` and the constexprs ``HAS_RESIDUAL``, ``HAS_<PARAM>``
    for each optional per-feature parameter, and ``BLOCK``."""
    width = x.shape[-1]
    for name, param in params.items():
        check_row_param(op, name, param, width)
    out, summed = row_outputs(x, residual, out_dtype)
    if x.numel() == 0:
        return out, summed
    x2 = as_rows(x)
    r2 = as_rows(residual) if residual is not None else x2
    block = row_block(width)
    jit(kernel)[(x2.shape[0],)](
        x2,
        r2,
        *(param.contiguous() if param is not None else x2 for param in params.values()),
        out,
        summed if summed is not None else out,
        x2.stride(0),
        r2.stride(0),
        width,
        *scalars,
        HAS_RESIDUAL=residual is not None,
        **{f"HAS_{name.upper()}": param is not None for name, param in params.items()},
        BLOCK=block,
        num_warps=row_num_warps(block),
    )
    return out, summed


# -- reference -----------------------------------------------------------------------------------


def rms_norm_reference(
    x: torch.Tensor, weight: torch.Tensor | None, eps: float, offset: float, out_dtype: torch.dtype
) -> torch.Tensor:
    x32 = x.float()
    y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * (offset + weight.float())
    return y.to(out_dtype)


def add_rms_norm_reference(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    offset: float,
    out_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    check_residual("add_rms_norm", x, residual)
    summed = x + residual
    return rms_norm_reference(summed, weight, eps, offset, out_dtype), summed


# -- kernel --------------------------------------------------------------------------------------


def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    sum_ptr,
    x_row_stride,
    res_row_stride,
    n_cols,
    eps,
    offset,
    HAS_RESIDUAL: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # int64 row offsets: rows * stride passes 2**31 on large prefill batches.
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * res_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
        # Normalize the sum as stored (rounded to its dtype), as the unfused add then norm would.
        summed = (x + r).to(sum_ptr.dtype.element_ty)
        tl.store(sum_ptr + row * n_cols + cols, summed, mask=mask)
        x = summed.to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(x * x, 0) / n_cols + eps)
    y = x * rstd
    if HAS_WEIGHT:
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        y = y * (offset + w)
    tl.store(out_ptr + row * n_cols + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm_triton(
    x: torch.Tensor, weight: torch.Tensor | None, eps: float, offset: float, out_dtype: torch.dtype
) -> torch.Tensor:
    return launch_row_kernel(_rms_norm_kernel, "rms_norm", x, None, {"weight": weight}, (eps, offset), out_dtype)[0]


def add_rms_norm_triton(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    offset: float,
    out_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    check_residual("add_rms_norm", x, residual)
    return launch_row_kernel(_rms_norm_kernel, "rms_norm", x, residual, {"weight": weight}, (eps, offset), out_dtype)


# -- custom ops ----------------------------------------------------------------------------------


@torch.library.custom_op("afdc::rms_norm", mutates_args=())
def rms_norm(
    x: torch.Tensor, weight: torch.Tensor | None, eps: float, offset: float, out_dtype: torch.dtype
) -> torch.Tensor:
    """RMSNorm over the last dim in fp32, times ``offset + weight`` when a weight is given."""
    if launches(*present(x, weight)):
        return rms_norm_triton(x, weight, eps, offset, out_dtype)
    return rms_norm_reference(x, weight, eps, offset, out_dtype)


@rms_norm.register_fake
def _(x, weight, eps, offset, out_dtype):
    return x.new_empty(x.shape, dtype=out_dtype)


@torch.library.custom_op("afdc::add_rms_norm", mutates_args=())
def add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    offset: float,
    out_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(x + residual), x + residual)``: the residual add and the norm that follows it."""
    if launches(*present(x, residual, weight)):
        return add_rms_norm_triton(x, residual, weight, eps, offset, out_dtype)
    return add_rms_norm_reference(x, residual, weight, eps, offset, out_dtype)


@add_rms_norm.register_fake
def _(x, residual, weight, eps, offset, out_dtype):
    check_residual("add_rms_norm", x, residual)
    return x.new_empty(x.shape, dtype=out_dtype), x.new_empty(x.shape, dtype=torch.result_type(x, residual))
