"""A linear layer whose weight is packed 4-bit (int4 groups or NVFP4): Triton kernel, reference, custom op.

::

    afdc::packed_linear(Tensor x, Tensor weight, Tensor weight_scale, str format, SymInt group_size,
        Tensor? weight_scale_2=None, Tensor? bias=None) -> Tensor

``x`` [..., K] (bf16, fp16 or fp32); the result ``[..., N]`` in x's dtype, ``bias`` added in fp32.
Weight-only: the kernel (``afdc/codegen/fp8_linear.py``'s, reading quant_tiles' format) dequantizes
each weight tile to x's dtype and multiplies with fp32 accumulators.

- ``format="int4"`` (:class:`afdc.quant.formats.Int4Group`, compressed-tensors pack-quantized):
  ``weight`` int32 [N, K / 8], ``weight_scale`` float [N, ceil(K / group_size)];
- ``format="nvfp4"`` (:class:`afdc.quant.formats.Nvfp4`, ModelOpt): ``weight`` uint8 [N, K / 2],
  ``weight_scale`` float8_e4m3fn [N, K / 16], ``weight_scale_2`` the float32 global scale (one value).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx
import torch.nn.functional as F

from afdc.codegen.fp8_linear import launch_linear
from afdc.codegen.quant_tiles import nvfp4_scales
from afdc.codegen.rms_norm import present
from afdc.codegen.triton_support import launches
from afdc.codegen.typed_calls import EmittedCall, takes_arguments_of
from afdc.quant.formats import INT4_PACK, Int4Group, Nvfp4

PACKED_FORMATS = ("int4", "nvfp4")


@dataclass(frozen=True)
class PackedLinear:
    """The arguments of ``afdc::packed_linear`` (the op's schema is read from these fields)."""

    x: torch.Tensor
    weight: torch.Tensor
    weight_scale: torch.Tensor
    format: str
    group_size: int
    weight_scale_2: torch.Tensor | None = None
    bias: torch.Tensor | None = None

    def in_features(self) -> int:
        return self.weight.shape[-1] * (INT4_PACK if self.format == "int4" else 2)

    def check(self) -> None:
        if self.format not in PACKED_FORMATS:
            raise ValueError(f"packed_linear: format {self.format!r} is not one of {', '.join(PACKED_FORMATS)}")
        if self.weight.dim() != 2 or self.x.shape[-1] != self.in_features():
            raise ValueError(f"packed_linear: x {tuple(self.x.shape)} does not fit a {self.format} weight "
                             f"{tuple(self.weight.shape)}")
        if self.format == "int4":
            Int4Group(self.group_size).check("packed_linear", self.weight, self.weight_scale)
        elif self.weight_scale_2 is None or self.weight_scale_2.numel() != 1 or self.group_size != Nvfp4().group:
            raise ValueError("packed_linear: an nvfp4 weight needs its one global weight_scale_2, groups of 16")
        else:
            Nvfp4().check("packed_linear", self.weight, self.weight_scale, self.weight_scale_2)
        if self.bias is not None and tuple(self.bias.shape) != (self.weight.shape[0],):
            raise ValueError(f"packed_linear: bias {tuple(self.bias.shape)} is not ({self.weight.shape[0]},)")

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        if self.format == "int4":
            return Int4Group(self.group_size).dequantize(self.weight, self.weight_scale, dtype)
        return Nvfp4().dequantize(self.weight, self.weight_scale, self.weight_scale_2.reshape(()), dtype)

    def scale(self) -> torch.Tensor:
        """The scales the kernel reads: int4's as shipped, NVFP4's times the global scale in float32."""
        if self.format == "int4":
            return self.weight_scale
        return nvfp4_scales(self.weight_scale, self.weight_scale_2.reshape(()))


@takes_arguments_of(PackedLinear)
def packed_linear_reference(*args, **kwargs) -> torch.Tensor:
    """The weight dequantized by its format's definition, rounded to x's dtype; products summed in fp32."""
    call = PackedLinear(*args, **kwargs)
    call.check()
    rows = call.x.reshape(-1, call.x.shape[-1]).float()
    out = F.linear(rows, call.dequantized(call.x.dtype).float(), None if call.bias is None else call.bias.float())
    return out.to(call.x.dtype).reshape(*call.x.shape[:-1], call.weight.shape[0])


@takes_arguments_of(PackedLinear)
def packed_linear_triton(*args, **kwargs) -> torch.Tensor:
    """:func:`packed_linear` by the Triton kernel."""
    call = PackedLinear(*args, **kwargs)
    call.check()
    return launch_linear(call.x, call.weight, call.scale(), 1, call.group_size, call.bias, call.format)


@torch.library.custom_op("afdc::packed_linear", mutates_args=())
@takes_arguments_of(PackedLinear)
def packed_linear(*args, **kwargs) -> torch.Tensor:
    """``x @ dequantize(weight).T + bias`` for a packed 4-bit weight (the module docstring)."""
    call = PackedLinear(*args, **kwargs)
    tensors = present(call.x, call.weight, call.weight_scale, call.weight_scale_2, call.bias)
    return packed_linear_triton(*args, **kwargs) if launches(*tensors) else packed_linear_reference(*args, **kwargs)


@packed_linear.register_fake
def _(*args, **kwargs):
    call = PackedLinear(*args, **kwargs)
    call.check()
    return call.x.new_empty((*call.x.shape[:-1], call.weight.shape[0]))


@dataclass(frozen=True)
class PackedLinearCall(EmittedCall):
    """One ``afdc::packed_linear`` node's arguments by name (tensors are graph values)."""

    node: fx.Node
    x: fx.Node
    weight: fx.Node
    weight_scale: fx.Node
    format: str
    group_size: int
    weight_scale_2: fx.Node | None = None
    bias: fx.Node | None = None

    OP = torch.ops.afdc.packed_linear.default
