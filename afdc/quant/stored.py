"""The tensors an artifact holds for a quantized parameter, named and shaped as the programs take them.

A quantized parameter of the bf16 model (``QuantizedParameter``) is stored as its quantized data
and its scale(s), in the checkpoint's bytes:

- fp8 (blocks, per channel, per tensor): the data keeps the parameter's name and shape in
  float8_e4m3fn; the scale is ``<name>_scale`` (float32 blocks, or as the checkpoint stores it:
  bf16 per channel, float8_e8m0fnu powers of two with ``scale_fmt: ue8m0``, widened per call),
  laid out like the data (fused experts' scales stacked and concatenated as their weights are);
  a static input scale is ``<name>_input_scale`` (of a linear: routed experts run weight-only, and
  their per-expert input scales are not stored). Per-tensor scales of fused experts are the grid
  ``[E, 2, 1]`` (gate's, up's) and ``[E, 1, 1]``, one block per matrix.
- MXFP4 (gpt-oss experts): ``<name>_blocks`` uint8 ``[E, out, in / 32, 16]`` and
  ``<name>_scales`` uint8 ``[E, out, in / 32]``, output-major as the checkpoint and the kernel
  take them, whatever the bf16 parameter's orientation. DeepSeek-V4's fp4 experts (fp8 with
  ``expert_dtype: fp4``) keep their containers, the same bytes: ``<name>_blocks`` int8
  ``[E, out, in / 2]`` and ``<name>_scales`` float8_e8m0fnu ``[E, out, in / 32]``; the op views
  them as bytes.
- int4 (compressed-tensors pack-quantized): ``<name>_packed`` int32 ``[..., out, in / 8]`` and
  ``<name>_scale`` ``[..., out, ceil(in / group)]`` in the checkpoint's float dtype, output-major
  (fused experts' rows stacked and concatenated as their weights are).
- NVFP4 (ModelOpt): ``<name>_packed`` uint8 ``[..., out, in / 2]``, ``<name>_scale`` float8_e4m3fn
  ``[..., out, in / 16]`` and ``<name>_scale_2`` float32, the global scale of each checkpoint
  matrix: ``[1]`` for a linear, ``[E, 2]`` for fused experts' gate_up (gate's, up's), ``[E, 1]``
  for their down.

Each stored tensor names the checkpoint tensors it is read from by the key the bf16 checkpoint
would have used (``sources``), so the resharder composes it with the very conversion that
composes the bf16 parameter (per-expert tensors stacked into the fused form).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum

import torch

from afdc.quant.scheme import (
    MXFP4_GROUP,
    MXFP4_GROUP_BYTES,
    PACKED_VALUES,
    QuantFormat,
    QuantizationError,
    QuantizedParameter,
    QuantScheme,
)


class Role(str, Enum):
    DATA = "data"
    SCALE = "scale"
    INPUT_SCALE = "input_scale"
    GLOBAL_SCALE = "global_scale"


@dataclass(frozen=True)
class StoredTensor:
    """One tensor of the artifact that stands for (part of) a quantized parameter."""

    name: str
    parameter: str
    role: Role
    format: QuantFormat
    shape: tuple[int, ...]
    dtype: torch.dtype
    # (the key the bf16 checkpoint has for it, the checkpoint key holding this tensor's bytes)
    sources: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class QuantizedTensors:
    """A scheme's parameters as the artifact stores them: by parameter, its data, scale and input scale."""

    scheme: QuantScheme
    by_parameter: dict[str, tuple[StoredTensor, ...]]

    @classmethod
    def of(cls, scheme: QuantScheme) -> QuantizedTensors:
        return cls(scheme, {p.name: _stored(scheme, p) for p in scheme.parameters})

    def role(self, parameter: str, role: Role) -> StoredTensor | None:
        return next((t for t in self.by_parameter.get(parameter, ()) if t.role is role), None)

    def tensors(self) -> dict[str, StoredTensor]:
        """Every stored tensor by its artifact name."""
        return {t.name: t for ts in self.by_parameter.values() for t in ts}

    def stored_bytes(self, parameter: str) -> int | None:
        """The bytes the checkpoint stores ``parameter`` in (its data, scales and input scale), None
        when it is not quantized."""
        stored = self.by_parameter.get(parameter)
        return sum(math.prod(t.shape) * t.dtype.itemsize for t in stored) if stored else None


def _stored(scheme: QuantScheme, p: QuantizedParameter) -> tuple[StoredTensor, ...]:
    members = [w for w in (scheme.weight(s) for s in p.sources) if w is not None]
    if p.format is QuantFormat.MXFP4:
        experts, out, inner = _output_major(p)
        groups = inner // MXFP4_GROUP
        data_sources = tuple((w.name.removesuffix("_blocks"), w.name) for w in members)
        scale_sources = tuple((w.name.removesuffix("_blocks"), w.scale.name) for w in members)
        if scheme.method == "fp8":  # DeepSeek-V4's fp4 experts: the same bytes, as int8 pairs and e8m0 exponents
            blocks, blocks_dtype, scales_dtype = (*experts, out, inner // 2), torch.int8, torch.float8_e8m0fnu
        else:
            blocks, blocks_dtype, scales_dtype = (*experts, out, groups, MXFP4_GROUP_BYTES), torch.uint8, torch.uint8
        return (
            StoredTensor(f"{p.name}_blocks", p.name, Role.DATA, p.format, blocks, blocks_dtype, data_sources),
            StoredTensor(f"{p.name}_scales", p.name, Role.SCALE, p.format, (*experts, out, groups), scales_dtype,
                         scale_sources),
        )  # fmt: skip
    if p.format in PACKED_VALUES:
        return _packed(p, members)
    direct = len(members) == 1 and members[0].shape == p.shape  # stored as the parameter is: shapes as stored
    scale_shape = members[0].scale.shape if direct else p.scale_shape
    scale_dtype = members[0].scale.dtype if members else scheme.fp8_scale_dtype
    stored = [
        StoredTensor(p.name, p.name, Role.DATA, p.format, p.shape, torch.float8_e4m3fn,
                     tuple((w.name, w.name) for w in members)),
        StoredTensor(f"{p.name}_scale", p.name, Role.SCALE, p.format, scale_shape, scale_dtype,
                     tuple((w.name, w.scale.name) for w in members)),
    ]  # fmt: skip
    # routed experts run weight-only (fused_moe_fp8 takes no input scale): their per-expert input scales stay out
    if p.static_input_scale and len(p.shape) == 2:
        inputs = [w.input_scale for w in members if w.input_scale is not None]
        shape, dtype = (inputs[0].shape, inputs[0].dtype) if inputs else ((1,), torch.float32)
        stored.append(StoredTensor(f"{p.name}_input_scale", p.name, Role.INPUT_SCALE, p.format, shape, dtype,
                                   tuple((w.name, i.name) for w, i in zip(members, inputs))))  # fmt: skip
    return tuple(stored)


def _packed(p: QuantizedParameter, members: list) -> tuple[StoredTensor, ...]:
    """int4 words or NVFP4 bytes, output-major, their group scales, and NVFP4's global scales."""
    *lead, out, inner = p.shape
    per = PACKED_VALUES[p.format]
    if p.block[-1] == 1 and inner != 1:
        raise QuantizationError(f"{p.name} {list(p.shape)} is {p.format.value} with its groups along dim -2 (an "
                                "input-major parameter); afdc runs packed weights stored output-major only")
    if inner % per:
        raise QuantizationError(f"{p.name} {list(p.shape)}: {p.format.value} packs {per} input features an "
                                f"element, and {inner} is not a multiple of {per}")
    int4 = p.format is QuantFormat.INT4_GROUP
    keys = [w.name.removesuffix("_packed") if int4 else w.name for w in members]  # the bf16 checkpoint's key
    stored = [
        StoredTensor(f"{p.name}_packed", p.name, Role.DATA, p.format, (*lead, out, inner // per),
                     torch.int32 if int4 else torch.uint8, tuple(zip(keys, (w.name for w in members)))),
        StoredTensor(f"{p.name}_scale", p.name, Role.SCALE, p.format, p.scale_shape,
                     members[0].scale.dtype if members else (torch.bfloat16 if int4 else torch.float8_e4m3fn),
                     tuple(zip(keys, (w.scale.name for w in members)))),
    ]  # fmt: skip
    if not int4:
        stored.append(StoredTensor(f"{p.name}_scale_2", p.name, Role.GLOBAL_SCALE, p.format, (*lead, p.matrices),
                                   torch.float32, tuple(zip(keys, (w.global_scale.name for w in members)))))
    return tuple(stored)


def _output_major(p: QuantizedParameter) -> tuple[tuple[int, ...], int, int]:
    """(leading dims, output features, input features) of a parameter; the input dim is the one
    the MXFP4 groups run along (its block is the group)."""
    *lead, a, b = p.shape
    if p.block[-1] == MXFP4_GROUP:
        return tuple(lead), a, b
    return tuple(lead), b, a  # input-major ([E, in, out], gpt-oss): the group runs along dim -2
