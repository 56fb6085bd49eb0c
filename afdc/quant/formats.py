"""The quantized weight formats checkpoints ship, each defined by its dequantization in PyTorch.

Each format is a frozen dataclass holding what the checkpoint's ``quantization_config`` fixes
(block sizes, strategy); its ``dequantize`` is the format's definition, which afdc's kernels
(``afdc/codegen/fp8_linear.py``, ``afdc/codegen/fused_moe_quant.py``) and their references must
reproduce, and its ``quantize`` is how a checkpoint's producer makes the tensors (tests use it to
save tiny models in the shipping format). Weights are output-major ``[..., N, K]`` (``N`` output
features, ``K`` input features; leading dims are experts), as ``nn.Linear`` and transformers'
fused experts store them.

- :class:`Fp8Block`: fp8 e4m3 weights with one float32 ``weight_scale_inv`` per
  ``block_n x block_k`` block, ``[ceil(N / block_n), ceil(K / block_k)]`` (DeepSeek-V3, Kimi K2,
  the Qwen3 ``-FP8`` releases: ``quant_method: fp8``, ``weight_block_size``). Despite its name
  ``weight_scale_inv`` multiplies: ``w = fp8.float() * scale_inv[n // block_n, k // block_k]``.
  Last blocks may be ragged (DeepSeek-V3 ships such shapes).
- :class:`Fp8Scaled`: compressed-tensors float8, a float32 ``weight_scale`` per output channel
  (``[N, 1]``) or per tensor (one value) that multiplies, and optionally a static per-tensor
  ``input_scale`` that activations are divided by before the fp8 cast. Both are block formats
  with one block per row or one block in all (:meth:`Fp8Scaled.blocks`), which is how the kernels
  take them.
- :class:`Mxfp4`: OCP MX fp4 (gpt-oss experts): ``*_blocks`` uint8 ``[..., N, K / 32, 16]``, two
  e2m1 values per byte (low nibble first, the even ``k``), and ``*_scales`` uint8
  ``[..., N, K / 32]``, one e8m0 exponent (bias 127) per 32 values:
  ``w = E2M1_VALUES[code] * 2 ** (scale - 127)``. transformers' ``convert_moe_packed_tensors``
  (integrations/mxfp4.py) is the reference this reproduces bit for bit; it returns the transpose
  ``[..., K, N]``, gpt-oss's input-major parameters.
- :class:`Int4Group`: compressed-tensors ``pack-quantized`` int4 (Kimi-K2-Thinking's experts,
  W4A16 releases): ``weight_packed`` int32 ``[..., N, K / 8]``, eight 4-bit values a word, the
  lowest bits the first ``k``, each the signed value plus 8; ``weight_scale`` ``[..., N, K / group]``
  (the model's float dtype) per ``group`` values along K, symmetric (no zero point):
  ``w = (nibble - 8) * scale``. compressed-tensors' ``unpack_from_int32`` and ``dequantize`` are the
  reference this reproduces.
- :class:`Nvfp4`: NVIDIA ModelOpt NVFP4 (``quant_algo: NVFP4``; DeepSeek-R1/V3 and Qwen3 ``-FP4``):
  ``weight`` uint8 ``[..., N, K / 2]``, two e2m1 codes a byte (low nibble first, the even ``k``),
  ``weight_scale`` float8_e4m3fn ``[..., N, K / 16]`` per 16 values, and ``weight_scale_2`` a
  float32 per tensor (``amax / (6 * 448)``): ``w = E2M1_VALUES[code] * weight_scale * weight_scale_2``.
  vLLM's ``dequantize_to_dtype`` (nvfp4_emulation_utils.py, unswizzled scales) is the reference.
- :class:`TokenGroupQuant`: the dynamic activation quantization of DeepSeek's fp8 GEMMs: each
  row's groups of ``group`` values along K share one float32 scale ``max(amax, eps) / 448``, and
  ``x_q = fp8(clamp(x / scale, -448, 448))``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite e4m3fn value, torch.finfo(torch.float8_e4m3fn).max

# e2m1 codes 0..15: sign bit 3, exponent bits 2..1 (bias 1), mantissa bit 0; 0 and 8 are +-0
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
E8M0_BIAS = 127
MXFP4_BLOCK = 32
INT4_PACK = 8  # 4-bit values an int32 holds
INT4_OFFSET = 8  # stored unsigned: the signed value plus 8


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _check_fp8(name: str, weight: torch.Tensor) -> None:
    if weight.dtype != FP8_DTYPE:
        raise ValueError(f"{name}: the weight is {weight.dtype}, expected {FP8_DTYPE} (fp8 e4m3)")


def _expand_blocks(scale: torch.Tensor, rows: int, cols: int, block_n: int, block_k: int) -> torch.Tensor:
    """One scale per element of a ``[..., rows, cols]`` weight (ragged last blocks cut off)."""
    scale = scale.repeat_interleave(block_n, dim=-2)[..., :rows, :]
    return scale.repeat_interleave(block_k, dim=-1)[..., :cols]


def _to_fp8(scaled: torch.Tensor) -> torch.Tensor:
    return scaled.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


@dataclass(frozen=True)
class Fp8Block:
    """fp8 e4m3 weights with a float32 multiplier per ``block_n x block_k`` block."""

    block_n: int = 128
    block_k: int = 128

    def __post_init__(self) -> None:
        if self.block_n < 1 or self.block_k < 1:
            raise ValueError(f"fp8 block sizes must be positive, got [{self.block_n}, {self.block_k}]")

    def scale_shape(self, n: int, k: int) -> tuple[int, int]:
        """The ``weight_scale_inv`` shape of an ``[N, K]`` weight."""
        return _cdiv(n, self.block_n), _cdiv(k, self.block_k)

    def check(self, name: str, weight: torch.Tensor, scale_inv: torch.Tensor) -> None:
        """Raises naming ``name`` unless ``scale_inv`` has one float32 value per block of ``weight``."""
        _check_fp8(name, weight)
        expected = (*weight.shape[:-2], *self.scale_shape(*weight.shape[-2:]))
        if tuple(scale_inv.shape) != expected or scale_inv.dtype != torch.float32:
            raise ValueError(f"{name}: weight {tuple(weight.shape)} in [{self.block_n}, {self.block_k}] blocks needs "
                             f"float32 scales {expected}, got {scale_inv.dtype} {tuple(scale_inv.shape)}")

    def dequantize(
        self, weight: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype = torch.float32
    ) -> torch.Tensor:
        """``weight.float() * scale_inv`` of each element's block, in fp32, rounded once to ``dtype``."""
        self.check("fp8 block dequantize", weight, scale_inv)
        rows, cols = weight.shape[-2:]
        return (weight.float() * _expand_blocks(scale_inv, rows, cols, self.block_n, self.block_k)).to(dtype)

    def quantize(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(fp8 weight, scale_inv)``: each block divided by ``amax / 448`` (1 for an all-zero block)."""
        rows, cols = weight.shape[-2:]
        nb, kb = self.scale_shape(rows, cols)
        padded = F.pad(weight.float(), (0, kb * self.block_k - cols, 0, nb * self.block_n - rows))
        tiles = padded.unflatten(-1, (kb, self.block_k)).unflatten(-3, (nb, self.block_n))
        amax = tiles.abs().amax(dim=(-3, -1))
        scale_inv = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
        return _to_fp8(weight.float() / _expand_blocks(scale_inv, rows, cols, self.block_n, self.block_k)), scale_inv


@dataclass(frozen=True)
class Fp8Scaled:
    """compressed-tensors float8: a float32 ``weight_scale`` per output channel or per tensor."""

    strategy: Literal["channel", "tensor"]
    static_input: bool = False  # a per-tensor ``input_scale`` ships with the weight

    def __post_init__(self) -> None:
        if self.strategy not in ("channel", "tensor"):
            raise ValueError(f"compressed-tensors float8 strategy {self.strategy!r} is not 'channel' or 'tensor'")

    def blocks(self, n: int, k: int) -> Fp8Block:
        """The same scales as :class:`Fp8Block`: a block per row, or one block over the whole weight."""
        return Fp8Block(1, k) if self.strategy == "channel" else Fp8Block(n, k)

    def block_scale(self, weight_scale: torch.Tensor, n: int, k: int) -> torch.Tensor:
        """``weight_scale`` (``[N, 1]``, ``[N]``, ``[1]`` or ``[]``) in :meth:`blocks`' scale shape."""
        shape = self.blocks(n, k).scale_shape(n, k)
        if weight_scale.numel() != shape[0] * shape[1]:
            raise ValueError(f"compressed-tensors {self.strategy} scale {tuple(weight_scale.shape)} does not fit a "
                             f"[{n}, {k}] weight: expected {shape[0]} value(s)")
        return weight_scale.float().reshape(shape)

    def dequantize(
        self, weight: torch.Tensor, weight_scale: torch.Tensor, dtype: torch.dtype = torch.float32
    ) -> torch.Tensor:
        _check_fp8("compressed-tensors float8 dequantize", weight)
        # the scale as [N, 1] or [1, 1] broadcasts over the row or the whole weight
        return (weight.float() * self.block_scale(weight_scale, *weight.shape)).to(dtype)

    def quantize(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(fp8 weight, weight_scale)``, the scale ``[N, 1]`` per channel or ``[1]`` per tensor."""
        w = weight.float()
        amax = w.abs().amax(dim=-1, keepdim=True) if self.strategy == "channel" else w.abs().amax().reshape(1)
        scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
        return _to_fp8(w / scale), scale

    @staticmethod
    def quantize_input(x: torch.Tensor, input_scale: torch.Tensor) -> torch.Tensor:
        """The static activation quantization: ``fp8(clamp(x / input_scale))``."""
        return _to_fp8(x.float() / input_scale.float().reshape(()))


def _e2m1_values(packed: torch.Tensor) -> torch.Tensor:
    """The fp32 values of bytes holding two e2m1 codes each, low nibble first: ``[..., 2 * bytes]``."""
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=packed.device)
    return lut[torch.stack([packed & 0x0F, packed >> 4], dim=-1).flatten(-2).long()]


def _e2m1_packed(scaled: torch.Tensor) -> torch.Tensor:
    """Each value rounded to the nearest e2m1 (saturating at 6), two codes a byte, the even one low."""
    # the nearest of e2m1's magnitudes by the midpoints between them (a tie goes to the smaller)
    midpoints = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], device=scaled.device)
    codes = (torch.bucketize(scaled.abs(), midpoints) | torch.where(scaled < 0, 8, 0)).to(torch.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


@dataclass(frozen=True)
class Mxfp4:
    """OCP MX fp4: e2m1 values packed two per byte, an e8m0 exponent per 32 of them."""

    block: int = MXFP4_BLOCK

    def check(self, name: str, blocks: torch.Tensor, scales: torch.Tensor) -> None:
        half = self.block // 2
        if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
            raise ValueError(f"{name}: MXFP4 blocks and scales are uint8, got {blocks.dtype} and {scales.dtype}")
        if blocks.dim() < 3 or blocks.shape[-1] != half or tuple(blocks.shape[:-1]) != tuple(scales.shape):
            raise ValueError(f"{name}: MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} are not "
                             f"[..., N, K/{self.block}, {half}] and [..., N, K/{self.block}]")

    def dequantize(
        self, blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32
    ) -> torch.Tensor:
        """The ``[..., N, K]`` weight (output-major), computed in fp32 and rounded once to ``dtype``."""
        self.check("MXFP4 dequantize", blocks, scales)
        values = torch.ldexp(_e2m1_values(blocks), scales.to(torch.int32)[..., None] - E8M0_BIAS)
        return values.flatten(-2).to(dtype)

    def quantize(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(blocks, scales)`` of a ``[..., N, K]`` weight, K a multiple of 32: each group's exponent the
        smallest that fits its largest value in e2m1's 6, each value rounded to the nearest e2m1."""
        if weight.shape[-1] % self.block:
            raise ValueError(f"MXFP4 needs K a multiple of {self.block}, got a weight {tuple(weight.shape)}")
        groups = weight.float().unflatten(-1, (-1, self.block))
        amax = groups.abs().amax(dim=-1)
        exponent = torch.ceil(torch.log2(torch.where(amax > 0, amax, 1.0) / 6.0)).clamp(-E8M0_BIAS, E8M0_BIAS)
        return _e2m1_packed(groups / torch.exp2(exponent)[..., None]), (exponent + E8M0_BIAS).to(torch.uint8)


@dataclass(frozen=True)
class Nvfp4:
    """e2m1 values packed two a byte, an fp8 e4m3 scale per 16 of them, and a float32 scale per tensor."""

    group: int = 16

    def check(self, name: str, packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor) -> None:
        k = packed.shape[-1] * 2 if packed.dim() >= 2 else 0
        expected = (*packed.shape[:-1], _cdiv(k, self.group))
        if packed.dtype != torch.uint8 or scale.dtype != FP8_DTYPE or tuple(scale.shape) != expected or \
                global_scale.dtype != torch.float32:
            raise ValueError(f"{name}: NVFP4 is uint8 [..., N, K/2] with float8_e4m3fn scales [..., N, K/{self.group}] "
                             f"and a float32 global scale; got {packed.dtype} {tuple(packed.shape)}, {scale.dtype} "
                             f"{tuple(scale.shape)} and {global_scale.dtype}")

    def dequantize(self, packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor,
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The ``[..., N, K]`` weight in fp32, rounded once to ``dtype``; ``global_scale`` one value, or
        one per leading index (per expert)."""
        self.check("NVFP4 dequantize", packed, scale, global_scale)
        values = _e2m1_values(packed).unflatten(-1, (-1, self.group))
        g = global_scale.float().reshape(*global_scale.shape, *(1,) * (scale.dim() - global_scale.dim()))
        return (values * (scale.float() * g)[..., None]).flatten(-2).to(dtype)

    def quantize(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(packed, scale, global_scale)`` as ModelOpt makes them: the global ``amax / (6 * 448)``,
        each group's fp8 scale ``group amax / 6 / global``, each value the nearest e2m1."""
        if weight.shape[-1] % self.group:
            raise ValueError(f"NVFP4 needs K a multiple of {self.group}, got a weight {tuple(weight.shape)}")
        w = weight.float()
        amax = w.abs().amax()
        global_scale = torch.where(amax > 0, amax / (6.0 * FP8_MAX), torch.ones_like(amax)).float()
        groups = w.unflatten(-1, (-1, self.group))
        scale = _to_fp8(groups.abs().amax(dim=-1) / 6.0 / global_scale)
        divisor = scale.float() * global_scale
        scaled = groups / torch.where(divisor > 0, divisor, 1.0)[..., None]
        return _e2m1_packed(scaled).flatten(-2), scale, global_scale


@dataclass(frozen=True)
class Int4Group:
    """Symmetric int4 weights, eight a little-endian int32, one float scale per ``group`` values along K."""

    group: int = 32

    def __post_init__(self) -> None:
        if self.group < 1:
            raise ValueError(f"int4 group size must be positive, got {self.group}")

    def check(self, name: str, packed: torch.Tensor, scale: torch.Tensor) -> None:
        """Raises naming ``name`` unless ``packed`` is int32 ``[..., N, K / 8]`` and ``scale`` a float
        ``[..., N, ceil(K / group)]``."""
        k = packed.shape[-1] * INT4_PACK if packed.dim() >= 2 else 0
        expected = (*packed.shape[:-1], _cdiv(k, self.group))
        if packed.dtype != torch.int32 or packed.dim() < 2 or tuple(scale.shape) != expected or \
                not scale.dtype.is_floating_point:
            raise ValueError(f"{name}: int4 weights are int32 [..., N, K/{INT4_PACK}] with float scales "
                             f"[..., N, ceil(K/{self.group})]; got {packed.dtype} {tuple(packed.shape)} and "
                             f"{scale.dtype} {tuple(scale.shape)}")

    def unpack(self, packed: torch.Tensor) -> torch.Tensor:
        """The signed int4 values ``[..., N, K]`` (int8) of the packed words."""
        shifts = torch.arange(INT4_PACK, dtype=torch.int32, device=packed.device) * 4
        nibbles = (packed[..., None] >> shifts) & 0xF
        return (nibbles - INT4_OFFSET).flatten(-2).to(torch.int8)

    def dequantize(self, packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The ``[..., N, K]`` weight, ``value * scale`` in fp32, rounded once to ``dtype``."""
        self.check("int4 dequantize", packed, scale)
        values = self.unpack(packed).float()
        full = scale.float().repeat_interleave(self.group, dim=-1)[..., : values.shape[-1]]
        return (values * full).to(dtype)

    def quantize(
        self, weight: torch.Tensor, scale_dtype: torch.dtype = torch.bfloat16
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(packed, scale)`` of a ``[..., N, K]`` weight, K a multiple of 8: each group's scale
        ``amax / 7.5`` (int4's range is [-8, 7]) in ``scale_dtype``, values rounded and clamped."""
        k = weight.shape[-1]
        if k % INT4_PACK:
            raise ValueError(f"int4 packing needs K a multiple of {INT4_PACK}, got a weight {tuple(weight.shape)}")
        groups = _cdiv(k, self.group)
        padded = F.pad(weight.float(), (0, groups * self.group - k)).unflatten(-1, (groups, self.group))
        amax = padded.abs().amax(dim=-1)
        scale = torch.where(amax > 0, amax / 7.5, torch.ones_like(amax)).to(scale_dtype)
        full = scale.float().repeat_interleave(self.group, dim=-1)[..., :k]
        values = torch.round(weight.float() / full).clamp(-8, 7).to(torch.int32) + INT4_OFFSET
        shifts = torch.arange(INT4_PACK, dtype=torch.int32, device=weight.device) * 4
        return (values.unflatten(-1, (-1, INT4_PACK)) << shifts).sum(dim=-1, dtype=torch.int32), scale


@dataclass(frozen=True)
class TokenGroupQuant:
    """Dynamic fp8 activations, one scale per ``group`` values of a row (DeepSeek: 128, the weights' block_k)."""

    group: int = 128
    eps: float = 1e-10  # keeps an all-zero group's scale finite (vLLM's value)

    def quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(x_q, scales)``: ``x_q`` fp8 like ``x``, ``scales`` float32 ``[..., ceil(K / group)]``."""
        k = x.shape[-1]
        groups = _cdiv(k, self.group)
        padded = F.pad(x.float(), (0, groups * self.group - k)).unflatten(-1, (groups, self.group))
        scales = padded.abs().amax(dim=-1).clamp(min=self.eps) / FP8_MAX
        return _to_fp8(x.float() / scales.repeat_interleave(self.group, dim=-1)[..., :k]), scales

    def dequantize(self, x_q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        return x_q.float() * scales.repeat_interleave(self.group, dim=-1)[..., : x_q.shape[-1]]
