"""Quantized weights as afdc's GEMM kernels read them, and the fp8 activations they multiply.

:func:`weight_tile` is a Triton device function that the kernels of ``fp8_linear`` and
``fused_moe`` call for each ``[BLOCK_K, BLOCK_N]`` tile of ``W^T``: it returns the tile in fp32,
dequantized as :mod:`afdc.quant.formats` defines the format, so the weight never exists widened
in memory. Formats (the ``FORMAT`` constexpr):

- ``"fp8"``: e4m3 weights, one float32 multiplier per ``scale_n x scale_k`` block (DeepSeek's
  ``weight_scale_inv``; compressed-tensors' per-channel and per-tensor scales as blocks of one row
  or of the whole weight);
- ``"mxfp4"``: bytes holding two e2m1 codes (the even ``k`` in the low nibble), a uint8 e8m0
  exponent per ``scale_k`` (32) values of a row; the e2m1 value is decoded arithmetically. One
  difference from the format's definition: the exponent byte 0 (``2 ** -127``, a subnormal
  float32) decodes to a zero scale; its products are under ``6 * 2 ** -127`` (about 3.5e-38).
- ``"int4"``: int32 words holding eight 4-bit values (the first ``k`` in the lowest bits), each the
  signed value plus 8, and a float scale (bf16 as shipped, widened here) per ``scale_k`` values of
  a row (compressed-tensors pack-quantized).
- ``"nvfp4"``: bytes of two e2m1 codes as for MXFP4, and a float32 scale per ``scale_k`` (16)
  values of a row: the checkpoint's fp8 scale times its per-tensor global scale, which the ops
  multiply once per call (:func:`nvfp4_scales`).

:func:`quantize_token_groups` is the dynamic fp8 activation quantization of w8a8 GEMMs
(:class:`afdc.quant.formats.TokenGroupQuant`): one Triton program per (row, group), or a static
per-tensor scale (compressed-tensors' ``input_scale``) for every group.
"""

from __future__ import annotations

import torch

from afdc.codegen.triton_support import device_function, interpreting, jit, launches, next_power_of_2, tl
from afdc.quant.formats import FP8_DTYPE, FP8_MAX, Fp8Scaled, TokenGroupQuant

WEIGHT_FORMATS = ("fp8", "mxfp4", "int4", "nvfp4")


def nvfp4_scales(scale: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """NVFP4's fp8 group scales times their tensor's global scale (one value, or one per leading
    index), in float32: the scale the ``"nvfp4"`` tile reads."""
    g = global_scale.float().reshape(*global_scale.shape, *(1,) * (scale.dim() - global_scale.dim()))
    return scale.float() * g


def rounding_grid(dtype: torch.dtype) -> tuple[int, int]:
    """``(mantissa bits, smallest normal exponent)`` of a float dtype, for :func:`rounded`; (0, 0)
    for float32, which needs no rounding."""
    if dtype == torch.float32:
        return 0, 0
    info = torch.finfo(dtype)
    return {torch.bfloat16: 7, torch.float16: 10, FP8_DTYPE: 3}[dtype], int(torch.log2(torch.tensor(info.tiny)))


@device_function
def rounded(v, MANTISSA: tl.constexpr, MIN_EXP: tl.constexpr):
    """``v`` (fp32) rounded to nearest, ties to even, onto the grid of a float with ``MANTISSA``
    bits and normal exponents from ``MIN_EXP``: what a cast to that float gives, kept in fp32.

    Triton's interpreter does not round to nearest on a downcast: to bf16 it truncates (1.0059 became
    1.0, not 1.0078; 0.99999 became 0.996, not 1.0), and it drops the carry when rounding up reaches
    the next power of 2 (to fp8, -125.2 became -64), so under it kernels round with this and cast
    (exactly) after, outputs included."""
    if MANTISSA == 0:
        return v
    ulp = tl.math.exp2(tl.maximum(tl.floor(tl.log2(tl.abs(v))), MIN_EXP) - MANTISSA)
    return tl.where(v == 0.0, v, ((v / ulp + 12582912.0) - 12582912.0) * ulp)  # 1.5 * 2 ** 23 rounds to integers


@device_function
def weight_tile(w_ptr, s_ptr, k, n, mask, stride_wn, stride_wk, stride_sn, stride_sk, scale_n, scale_k,
                FORMAT: tl.constexpr, EMULATE: tl.constexpr, MANTISSA: tl.constexpr, MIN_EXP: tl.constexpr):
    """The fp32 ``[len(k), len(n)]`` tile of ``W^T`` at input features ``k``, output features ``n``,
    dequantized, for the caller to round to the activations' dtype (whose grid ``MANTISSA``, ``MIN_EXP``
    give) by the caller's cast; ``EMULATE`` (the interpreter) rounds it first with :func:`rounded`,
    so that the cast is exact."""
    w = _dequantized(w_ptr, s_ptr, k, n, mask, stride_wn, stride_wk, stride_sn, stride_sk, scale_n, scale_k, FORMAT)
    if EMULATE:
        w = rounded(w, MANTISSA, MIN_EXP)
    return w


@device_function
def _dequantized(w_ptr, s_ptr, k, n, mask, stride_wn, stride_wk, stride_sn, stride_sk, scale_n, scale_k,
                 FORMAT: tl.constexpr):
    if FORMAT == "mxfp4" or FORMAT == "nvfp4":
        packed = tl.load(w_ptr + n[None, :] * stride_wn + (k // 2)[:, None] * stride_wk, mask=mask, other=0)
        code = (packed.to(tl.int32) >> ((k % 2) * 4)[:, None]) & 15
        exponent = (code >> 1) & 3
        mantissa = code & 1
        # twice the magnitude: the mantissa bit for exponent 0 (0 or 0.5), else (2 + m) * 2 ** (exponent - 1)
        twice = tl.where(exponent == 0, mantissa, (2 + mantissa) << tl.maximum(exponent - 1, 0))
        value = tl.where(code >= 8, -0.5, 0.5) * twice.to(tl.float32)
        if FORMAT == "nvfp4":
            s = tl.load(s_ptr + n[None, :] * stride_sn + (k // scale_k)[:, None] * stride_sk, mask=mask, other=0.0)
            return value * s
        e8m0 = tl.load(s_ptr + n[None, :] * stride_sn + (k // scale_k)[:, None] * stride_sk, mask=mask, other=127)
        # 2 ** (e - 127) is the float32 whose exponent field is e
        return value * (e8m0.to(tl.int32) << 23).to(tl.float32, bitcast=True)
    if FORMAT == "int4":
        word = tl.load(w_ptr + n[None, :] * stride_wn + (k // 8)[:, None] * stride_wk, mask=mask, other=0)
        nibble = (word >> ((k % 8) * 4)[:, None]) & 15
        s = tl.load(s_ptr + n[None, :] * stride_sn + (k // scale_k)[:, None] * stride_sk, mask=mask, other=0.0)
        return (nibble - 8).to(tl.float32) * s.to(tl.float32)
    w = tl.load(w_ptr + n[None, :] * stride_wn + k[:, None] * stride_wk, mask=mask, other=0.0).to(tl.float32)
    s = tl.load(s_ptr + (n // scale_n)[None, :] * stride_sn + (k // scale_k)[:, None] * stride_sk, mask=mask,
                other=0.0)
    return w * s


def _token_group_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    static_ptr,
    k,
    group,
    stride_xm,
    stride_qm,
    stride_sm,
    eps,
    STATIC: tl.constexpr,
    ROUND_FIRST: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    offsets = tl.arange(0, BLOCK)
    cols = g * group + offsets
    mask = (offsets < group) & (cols < k)
    x = tl.load(x_ptr + row * stride_xm + cols, mask=mask, other=0.0).to(tl.float32)
    if STATIC:
        scale = tl.load(static_ptr).to(tl.float32)
    else:
        scale = tl.math.div_rn(tl.maximum(tl.max(tl.abs(x), 0), eps), FP8_MAX)
    q = tl.clamp(tl.math.div_rn(x, scale), -FP8_MAX, FP8_MAX)
    if ROUND_FIRST:  # e4m3: 3 mantissa bits, normal exponents from -6
        q = rounded(q, 3, -6)
    tl.store(q_ptr + row * stride_qm + cols, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + row * stride_sm + g, scale)


def quantize_token_groups_reference(
    x: torch.Tensor, group: int, input_scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x_q, scales)`` of 2-D ``x``: scales ``[rows, ceil(K / group)]`` float32."""
    if input_scale is None:
        return TokenGroupQuant(group).quantize(x)
    groups = -(-x.shape[-1] // group)
    return Fp8Scaled.quantize_input(x, input_scale), input_scale.float().reshape(1, 1).expand(x.shape[0], groups)


def quantize_token_groups(
    x: torch.Tensor, group: int, input_scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`quantize_token_groups_reference` by a Triton kernel where one runs."""
    if x.dim() != 2:
        raise ValueError(f"quantize_token_groups: x {tuple(x.shape)} is not [rows, K]")
    if not launches(*(t for t in (x, input_scale) if t is not None)):
        return quantize_token_groups_reference(x, group, input_scale)
    x = x if x.stride(-1) == 1 else x.contiguous()
    rows, k = x.shape
    groups = -(-k // group)
    x_q = torch.empty(x.shape, dtype=FP8_DTYPE, device=x.device)
    scales = torch.empty(rows, groups, dtype=torch.float32, device=x.device)
    if x.numel():
        jit(_token_group_kernel)[(rows, groups)](
            x, x_q, scales, input_scale if input_scale is not None else scales, k, group, x.stride(0), x_q.stride(0),
            scales.stride(0), TokenGroupQuant(group).eps, STATIC=input_scale is not None, ROUND_FIRST=interpreting(),
            BLOCK=next_power_of_2(group),
        )
    return x_q, scales
