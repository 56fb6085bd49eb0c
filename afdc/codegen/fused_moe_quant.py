"""Routed experts whose weights stay quantized as the checkpoint ships them: custom ops, references.

Four ops, each ``afdc::fused_moe``'s computation (:mod:`afdc.codegen.fused_moe`, whose kernels run
them) with the weights in a quantized format, dequantized tile by tile inside the kernels. Their
first seven arguments are ``fused_moe``'s, so a graph rewrite swaps the target and appends the
scales::

    afdc::fused_moe_fp8(Tensor x, Tensor w_gate_up, Tensor w_down, Tensor topk_weights,
        Tensor topk_ids, SymInt first_expert, str activation, Tensor w_gate_up_scale,
        Tensor w_down_scale, SymInt block_n, SymInt block_k, bool w8a8=False,
        Tensor? b_gate_up=None, Tensor? b_down=None, float? alpha=None, float? limit=None) -> Tensor

    afdc::fused_moe_mxfp4(Tensor x, Tensor w_gate_up_blocks, Tensor w_down_blocks,
        Tensor topk_weights, Tensor topk_ids, SymInt first_expert, str activation,
        Tensor w_gate_up_scales, Tensor w_down_scales, Tensor? b_gate_up=None,
        Tensor? b_down=None, bool interleaved=False, float? alpha=None, float? limit=None) -> Tensor

    afdc::fused_moe_int4(Tensor x, Tensor w_gate_up_packed, Tensor w_down_packed,
        Tensor topk_weights, Tensor topk_ids, SymInt first_expert, str activation,
        Tensor w_gate_up_scale, Tensor w_down_scale, SymInt group_size, Tensor? b_gate_up=None,
        Tensor? b_down=None, float? alpha=None, float? limit=None) -> Tensor

    afdc::fused_moe_nvfp4(Tensor x, Tensor w_gate_up_packed, Tensor w_down_packed,
        Tensor topk_weights, Tensor topk_ids, SymInt first_expert, str activation,
        Tensor w_gate_up_scale, Tensor w_down_scale, Tensor w_gate_up_scale_2, Tensor w_down_scale_2,
        Tensor? b_gate_up=None, Tensor? b_down=None, float? alpha=None, float? limit=None) -> Tensor

``fused_moe_fp8``: :class:`afdc.quant.formats.Fp8Block` experts in transformers' fused form,
``w_gate_up`` [E_local, 2I, H] and ``w_down`` [E_local, H, I] float8_e4m3fn, output-major; the
scales multiply (DeepSeek's ``weight_scale_inv``, float8_e8m0fnu powers of two in V4's ``ue8m0``;
compressed-tensors' per-channel ``weight_scale`` as blocks of one row, in bf16; each as shipped,
widened to float32 per call): ``w_gate_up_scale`` float32
[E_local, 2 * ceil(I / block_n), ceil(H / block_k)] (each expert's gate_proj blocks, then its
up_proj blocks, as the per-expert checkpoint tensors concatenate; with I a multiple of block_n,
``[E, 2I / block_n, H / block_k]``) and ``w_down_scale`` [E_local, ceil(H / block_n), ceil(I / block_k)].
``w8a8=False`` dequantizes the weights to x's dtype in the kernel (any GPU); ``w8a8=True``
quantizes the activations per token group of ``block_k`` (x, and ``act(gate) * up`` before the
down projection) and multiplies fp8 by fp8 with fp32 accumulators (GPUs with fp8 tensor cores;
``block_k`` a multiple of 16).

``fused_moe_mxfp4``: :class:`afdc.quant.formats.Mxfp4` experts as gpt-oss ships them,
``*_blocks`` uint8 [E_local, 2I, H / 32, 16] and [E_local, H, I / 32, 16], ``*_scales`` uint8
[E_local, 2I, H / 32] and [E_local, H, I / 32]: output-major, so unlike the bf16 gpt-oss
experts there is no ``transposed``. gpt-oss's gate and up rows alternate (``interleaved``), it has
biases and ``swigluoai``. Weight-only: dequantized to x's dtype in the kernel.

``fused_moe_int4``: :class:`afdc.quant.formats.Int4Group` experts (compressed-tensors
pack-quantized, Kimi-K2-Thinking): ``*_packed`` int32 [E_local, 2I, H / 8] and [E_local, H, I / 8],
``*_scale`` (bf16 as shipped) [E_local, 2I, ceil(H / group_size)] and [E_local, H, ceil(I / group_size)],
output-major, gate rows then up rows. Weight-only: dequantized to x's dtype in the kernel.

``fused_moe_nvfp4``: :class:`afdc.quant.formats.Nvfp4` experts (ModelOpt NVFP4): ``*_packed``
uint8 [E_local, 2I, H / 2] and [E_local, H, I / 2], ``*_scale`` float8_e4m3fn [E_local, 2I, H / 16]
and [E_local, H, I / 16], and the global scales float32 ``w_gate_up_scale_2`` [E_local, 2] (each
expert's gate_proj's, then its up_proj's) and ``w_down_scale_2`` [E_local, 1]. Weight-only (vLLM's
W4A16 NVFP4; the checkpoint's ``input_scale`` is not read): the kernels take the fp8 scales times
the global ones in float32, made once per call (:func:`afdc.codegen.quant_tiles.nvfp4_scales`).

All take the local experts of an expert-parallel rank from ``first_expert`` on, as
``fused_moe`` does, and no shared expert (a shared expert's linears are ``afdc::fp8_linear``).
The references dequantize by the format's definition and run ``fused_moe``'s reference loop,
rounding where the kernels do.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields, replace

import torch
import torch.fx as fx

from afdc.codegen.fused_moe import Experts, ExpertScales, experts_reference, launch
from afdc.codegen.quant_tiles import nvfp4_scales
from afdc.codegen.triton_support import launches
from afdc.codegen.typed_calls import EmittedCall, takes_arguments_of
from afdc.quant.formats import INT4_PACK, Fp8Block, Int4Group, Mxfp4, Nvfp4, TokenGroupQuant

# float8_e8m0fnu: DeepSeek-V4's power-of-two scales (scale_fmt ue8m0), which widen exactly as well
_FLOAT_SCALES = (torch.float32, torch.bfloat16, torch.float16, torch.float8_e8m0fnu)


def _tensors(args: object) -> tuple[torch.Tensor, ...]:
    values = (getattr(args, f.name) for f in fields(args))
    return tuple(v for v in values if isinstance(v, torch.Tensor))


@dataclass(frozen=True)
class Fp8Experts:
    """The arguments of ``afdc::fused_moe_fp8`` (the op's schema is read from these fields)."""

    x: torch.Tensor
    w_gate_up: torch.Tensor
    w_down: torch.Tensor
    topk_weights: torch.Tensor
    topk_ids: torch.Tensor
    first_expert: int
    activation: str
    w_gate_up_scale: torch.Tensor
    w_down_scale: torch.Tensor
    block_n: int
    block_k: int
    w8a8: bool = False
    b_gate_up: torch.Tensor | None = None
    b_down: torch.Tensor | None = None
    alpha: float | None = None
    limit: float | None = None

    def experts(self) -> Experts:
        return Experts(self.x, self.w_gate_up, self.w_down, self.topk_weights, self.topk_ids, self.first_expert,
                       self.activation, self.b_gate_up, self.b_down, alpha=self.alpha, limit=self.limit)

    def widened(self) -> Fp8Experts:
        """The call with its scales in float32, as the kernels and :class:`Fp8Block` take them:
        compressed-tensors ships per-channel scales in the model's dtype (bf16), DeepSeek-V4 its block
        scales as powers of two (float8_e8m0fnu): both widen exactly."""
        if self.w_gate_up_scale.dtype not in _FLOAT_SCALES or self.w_down_scale.dtype not in _FLOAT_SCALES:
            raise ValueError(f"fused_moe_fp8: scales {self.w_gate_up_scale.dtype} and {self.w_down_scale.dtype} are "
                             "not float32, bfloat16, float16 or float8_e8m0fnu")
        return replace(self, w_gate_up_scale=self.w_gate_up_scale.float(), w_down_scale=self.w_down_scale.float())

    def check(self) -> None:
        self.experts().check()
        call = self.widened()
        fmt = Fp8Block(self.block_n, self.block_k)
        fmt.check("fused_moe_fp8 w_down", call.w_down, call.w_down_scale)
        num, two_inter, hidden = self.w_gate_up.shape
        gate_rows, cols = fmt.scale_shape(two_inter // 2, hidden)
        expected = (num, 2 * gate_rows, cols)
        scale = self.w_gate_up_scale
        if self.w_gate_up.dtype != self.w_down.dtype or tuple(scale.shape) != expected:
            raise ValueError(f"fused_moe_fp8: w_gate_up {self.w_gate_up.dtype} {tuple(self.w_gate_up.shape)} in "
                             f"[{self.block_n}, {self.block_k}] blocks needs fp8 weights and float scales {expected} "
                             f"(the gate rows' blocks, then the up rows'), got {scale.dtype} {tuple(scale.shape)}")

    def reference(self) -> torch.Tensor:
        return self.widened()._reference()

    def _reference(self) -> torch.Tensor:
        fmt = Fp8Block(self.block_n, self.block_k)
        inter = self.w_gate_up.shape[1] // 2
        gate, up = self.w_gate_up[:, :inter], self.w_gate_up[:, inter:]
        gate_s, up_s = self.w_gate_up_scale.chunk(2, dim=1)
        if not self.w8a8:  # weights dequantized to x's dtype, as the kernels round them
            dtype = self.x.dtype
            w_gate_up = torch.cat([fmt.dequantize(gate, gate_s, dtype), fmt.dequantize(up, up_s, dtype)], dim=1)
            return experts_reference(replace(self.experts(), w_gate_up=w_gate_up,
                                             w_down=fmt.dequantize(self.w_down, self.w_down_scale, dtype)))
        groups = TokenGroupQuant(self.block_k)

        def fake_quant(h: torch.Tensor) -> torch.Tensor:  # what the kernels' fp8 operands hold, in fp32
            return groups.dequantize(*groups.quantize(h.to(self.x.dtype)))

        w_gate_up = torch.cat([fmt.dequantize(gate, gate_s), fmt.dequantize(up, up_s)], dim=1)
        experts = replace(self.experts(), x=fake_quant(self.x), w_gate_up=w_gate_up,
                          w_down=fmt.dequantize(self.w_down, self.w_down_scale))
        return experts_reference(experts, fake_quant).to(self.x.dtype)

    def launch(self, tiles: tuple[int | None, int | None, int | None]) -> torch.Tensor:
        call = self.widened()
        scales = ExpertScales("fp8", call.w_gate_up_scale, call.w_down_scale, self.block_n, self.block_k, self.w8a8)
        return launch(self.experts(), scales, tiles, "fused_moe_fp8" + ("_w8a8" if self.w8a8 else ""))


@dataclass(frozen=True)
class Mxfp4Experts:
    """The arguments of ``afdc::fused_moe_mxfp4`` (the op's schema is read from these fields)."""

    x: torch.Tensor
    w_gate_up_blocks: torch.Tensor
    w_down_blocks: torch.Tensor
    topk_weights: torch.Tensor
    topk_ids: torch.Tensor
    first_expert: int
    activation: str
    w_gate_up_scales: torch.Tensor
    w_down_scales: torch.Tensor
    b_gate_up: torch.Tensor | None = None
    b_down: torch.Tensor | None = None
    interleaved: bool = False
    alpha: float | None = None
    limit: float | None = None

    def __post_init__(self) -> None:
        # DeepSeek-V4's fp4 experts hold MXFP4's bytes as int8 [E, N, K / 2] with e8m0 exponents: viewed as bytes
        for name, packed in (("w_gate_up_blocks", self.w_gate_up_blocks), ("w_down_blocks", self.w_down_blocks)):
            if packed.dtype == torch.int8:
                object.__setattr__(self, name, packed.view(torch.uint8).unflatten(-1, (-1, Mxfp4().block // 2)))
        for name, scales in (("w_gate_up_scales", self.w_gate_up_scales), ("w_down_scales", self.w_down_scales)):
            if scales.dtype == torch.float8_e8m0fnu:
                object.__setattr__(self, name, scales.view(torch.uint8))

    def experts(self, w_gate_up: torch.Tensor, w_down: torch.Tensor) -> Experts:
        return Experts(self.x, w_gate_up, w_down, self.topk_weights, self.topk_ids, self.first_expert,
                       self.activation, self.b_gate_up, self.b_down, False, self.interleaved, self.alpha, self.limit)

    def check(self) -> None:
        fmt = Mxfp4()
        fmt.check("fused_moe_mxfp4 gate_up", self.w_gate_up_blocks, self.w_gate_up_scales)
        fmt.check("fused_moe_mxfp4 down", self.w_down_blocks, self.w_down_scales)
        # the weights' logical shapes, [E, 2I, H] and [E, H, I], checked against the rest as fused_moe checks them
        logical = [torch.empty(*b.shape[:-2], b.shape[-2] * b.shape[-1] * 2, device="meta")
                   for b in (self.w_gate_up_blocks, self.w_down_blocks)]
        self.experts(*logical).check()

    def reference(self) -> torch.Tensor:
        fmt, dtype = Mxfp4(), self.x.dtype
        return experts_reference(self.experts(fmt.dequantize(self.w_gate_up_blocks, self.w_gate_up_scales, dtype),
                                              fmt.dequantize(self.w_down_blocks, self.w_down_scales, dtype)))

    def launch(self, tiles: tuple[int | None, int | None, int | None]) -> torch.Tensor:
        # the blocks as [E, N, K / 2] bytes: the kernels find k's byte and nibble
        experts = self.experts(self.w_gate_up_blocks.flatten(-2), self.w_down_blocks.flatten(-2))
        scales = ExpertScales("mxfp4", self.w_gate_up_scales, self.w_down_scales, 1, Mxfp4().block)
        return launch(experts, scales, tiles, "fused_moe_mxfp4")


@dataclass(frozen=True)
class Int4Experts:
    """The arguments of ``afdc::fused_moe_int4`` (the op's schema is read from these fields)."""

    x: torch.Tensor
    w_gate_up_packed: torch.Tensor
    w_down_packed: torch.Tensor
    topk_weights: torch.Tensor
    topk_ids: torch.Tensor
    first_expert: int
    activation: str
    w_gate_up_scale: torch.Tensor
    w_down_scale: torch.Tensor
    group_size: int
    b_gate_up: torch.Tensor | None = None
    b_down: torch.Tensor | None = None
    alpha: float | None = None
    limit: float | None = None

    def experts(self, w_gate_up: torch.Tensor, w_down: torch.Tensor) -> Experts:
        return Experts(self.x, w_gate_up, w_down, self.topk_weights, self.topk_ids, self.first_expert,
                       self.activation, self.b_gate_up, self.b_down, alpha=self.alpha, limit=self.limit)

    def check(self) -> None:
        fmt = Int4Group(self.group_size)
        fmt.check("fused_moe_int4 gate_up", self.w_gate_up_packed, self.w_gate_up_scale)
        fmt.check("fused_moe_int4 down", self.w_down_packed, self.w_down_scale)
        logical = [torch.empty(*p.shape[:-1], p.shape[-1] * INT4_PACK, device="meta")
                   for p in (self.w_gate_up_packed, self.w_down_packed)]
        self.experts(*logical).check()

    def reference(self) -> torch.Tensor:
        fmt, dtype = Int4Group(self.group_size), self.x.dtype
        return experts_reference(self.experts(fmt.dequantize(self.w_gate_up_packed, self.w_gate_up_scale, dtype),
                                              fmt.dequantize(self.w_down_packed, self.w_down_scale, dtype)))

    def launch(self, tiles: tuple[int | None, int | None, int | None]) -> torch.Tensor:
        experts = self.experts(self.w_gate_up_packed, self.w_down_packed)  # the kernels find k's word and nibble
        scales = ExpertScales("int4", self.w_gate_up_scale, self.w_down_scale, 1, self.group_size)
        return launch(experts, scales, tiles, "fused_moe_int4")


@dataclass(frozen=True)
class Nvfp4Experts:
    """The arguments of ``afdc::fused_moe_nvfp4`` (the op's schema is read from these fields)."""

    x: torch.Tensor
    w_gate_up_packed: torch.Tensor
    w_down_packed: torch.Tensor
    topk_weights: torch.Tensor
    topk_ids: torch.Tensor
    first_expert: int
    activation: str
    w_gate_up_scale: torch.Tensor
    w_down_scale: torch.Tensor
    w_gate_up_scale_2: torch.Tensor
    w_down_scale_2: torch.Tensor
    b_gate_up: torch.Tensor | None = None
    b_down: torch.Tensor | None = None
    alpha: float | None = None
    limit: float | None = None

    def experts(self, w_gate_up: torch.Tensor, w_down: torch.Tensor) -> Experts:
        return Experts(self.x, w_gate_up, w_down, self.topk_weights, self.topk_ids, self.first_expert,
                       self.activation, self.b_gate_up, self.b_down, alpha=self.alpha, limit=self.limit)

    def check(self) -> None:
        fmt = Nvfp4()
        fmt.check("fused_moe_nvfp4 gate_up", self.w_gate_up_packed, self.w_gate_up_scale, self.w_gate_up_scale_2)
        fmt.check("fused_moe_nvfp4 down", self.w_down_packed, self.w_down_scale, self.w_down_scale_2)
        experts = self.w_gate_up_packed.shape[0]
        if tuple(self.w_gate_up_scale_2.shape) != (experts, 2) or tuple(self.w_down_scale_2.shape) != (experts, 1):
            raise ValueError(f"fused_moe_nvfp4: global scales {tuple(self.w_gate_up_scale_2.shape)} and "
                             f"{tuple(self.w_down_scale_2.shape)} are not [{experts}, 2] (gate, up) and [{experts}, 1]")
        logical = [torch.empty(*p.shape[:-1], p.shape[-1] * 2, device="meta")
                   for p in (self.w_gate_up_packed, self.w_down_packed)]
        self.experts(*logical).check()

    def scales(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The float32 scales the kernels read: each group's fp8 scale times its matrix's global scale."""
        inter = self.w_gate_up_packed.shape[1] // 2
        rows = self.w_gate_up_scale_2.repeat_interleave(inter, dim=1)  # gate rows, then up rows
        return nvfp4_scales(self.w_gate_up_scale, rows), nvfp4_scales(self.w_down_scale, self.w_down_scale_2)

    def reference(self) -> torch.Tensor:
        fmt, dtype = Nvfp4(), self.x.dtype
        inter = self.w_gate_up_packed.shape[1] // 2
        halves = [fmt.dequantize(self.w_gate_up_packed[:, rows], self.w_gate_up_scale[:, rows],
                                 self.w_gate_up_scale_2[:, i], dtype)
                  for i, rows in enumerate((slice(0, inter), slice(inter, None)))]
        down = fmt.dequantize(self.w_down_packed, self.w_down_scale, self.w_down_scale_2[:, 0], dtype)
        return experts_reference(self.experts(torch.cat(halves, dim=1), down))

    def launch(self, tiles: tuple[int | None, int | None, int | None]) -> torch.Tensor:
        experts = self.experts(self.w_gate_up_packed, self.w_down_packed)  # the kernels find k's byte and nibble
        scales = ExpertScales("nvfp4", *self.scales(), 1, Nvfp4().group)
        return launch(experts, scales, tiles, "fused_moe_nvfp4")


Tiles = tuple[int | None, int | None, int | None]


def _define_ops(name: str, arguments: type, doc: str) -> tuple[Callable, Callable, Callable]:
    """``(reference, triton, op)`` of the quantized MoE ``afdc::<name>`` whose arguments are the
    fields of ``arguments`` (a class with ``check``, ``reference`` and ``launch``): the op runs the
    kernels where they launch, else the reference; ``triton`` takes ``tiles`` (BLOCK_M, BLOCK_N,
    BLOCK_K), each tuned or defaulted where None as ``fused_moe_triton`` does."""

    def checked(*args, **kwargs):
        call = arguments(*args, **kwargs)
        call.check()
        return call

    @takes_arguments_of(arguments)
    def reference(*args, **kwargs) -> torch.Tensor:
        return checked(*args, **kwargs).reference()

    def triton(*args, tiles: Tiles = (None, None, None), **kwargs) -> torch.Tensor:
        return checked(*args, **kwargs).launch(tiles)

    @takes_arguments_of(arguments)
    def op(*args, **kwargs) -> torch.Tensor:
        call = checked(*args, **kwargs)
        return call.launch((None, None, None)) if launches(*_tensors(call)) else call.reference()

    op.__doc__ = doc
    op = torch.library.custom_op(f"afdc::{name}", mutates_args=())(op)

    @op.register_fake
    def _(*args, **kwargs):
        return torch.empty_like(checked(*args, **kwargs).x)

    return reference, triton, op


fused_moe_fp8_reference, fused_moe_fp8_triton, fused_moe_fp8 = _define_ops(
    "fused_moe_fp8", Fp8Experts, "``afdc::fused_moe`` over fp8 block-scaled experts (the module docstring).")
fused_moe_mxfp4_reference, fused_moe_mxfp4_triton, fused_moe_mxfp4 = _define_ops(
    "fused_moe_mxfp4", Mxfp4Experts, "``afdc::fused_moe`` over MXFP4 experts (the module docstring).")
fused_moe_int4_reference, fused_moe_int4_triton, fused_moe_int4 = _define_ops(
    "fused_moe_int4", Int4Experts, "``afdc::fused_moe`` over int4 pack-quantized experts (the module docstring).")
fused_moe_nvfp4_reference, fused_moe_nvfp4_triton, fused_moe_nvfp4 = _define_ops(
    "fused_moe_nvfp4", Nvfp4Experts, "``afdc::fused_moe`` over NVFP4 experts (the module docstring).")


@dataclass(frozen=True)
class FusedMoeFp8Call(EmittedCall):
    """One ``afdc::fused_moe_fp8`` node's arguments by name (tensors are graph values)."""

    node: fx.Node
    x: fx.Node
    w_gate_up: fx.Node
    w_down: fx.Node
    topk_weights: fx.Node
    topk_ids: fx.Node
    first_expert: object  # an int, or a graph value on a sharded rank
    activation: str
    w_gate_up_scale: fx.Node
    w_down_scale: fx.Node
    block_n: int
    block_k: int
    w8a8: bool = False
    b_gate_up: fx.Node | None = None
    b_down: fx.Node | None = None
    alpha: float | None = None
    limit: float | None = None

    OP = torch.ops.afdc.fused_moe_fp8.default


@dataclass(frozen=True)
class FusedMoeMxfp4Call(EmittedCall):
    """One ``afdc::fused_moe_mxfp4`` node's arguments by name (tensors are graph values)."""

    node: fx.Node
    x: fx.Node
    w_gate_up_blocks: fx.Node
    w_down_blocks: fx.Node
    topk_weights: fx.Node
    topk_ids: fx.Node
    first_expert: object
    activation: str
    w_gate_up_scales: fx.Node
    w_down_scales: fx.Node
    b_gate_up: fx.Node | None = None
    b_down: fx.Node | None = None
    interleaved: bool = False
    alpha: float | None = None
    limit: float | None = None

    OP = torch.ops.afdc.fused_moe_mxfp4.default


@dataclass(frozen=True)
class FusedMoeInt4Call(EmittedCall):
    """One ``afdc::fused_moe_int4`` node's arguments by name (tensors are graph values)."""

    node: fx.Node
    x: fx.Node
    w_gate_up_packed: fx.Node
    w_down_packed: fx.Node
    topk_weights: fx.Node
    topk_ids: fx.Node
    first_expert: object
    activation: str
    w_gate_up_scale: fx.Node
    w_down_scale: fx.Node
    group_size: int
    b_gate_up: fx.Node | None = None
    b_down: fx.Node | None = None
    alpha: float | None = None
    limit: float | None = None

    OP = torch.ops.afdc.fused_moe_int4.default


@dataclass(frozen=True)
class FusedMoeNvfp4Call(EmittedCall):
    """One ``afdc::fused_moe_nvfp4`` node's arguments by name (tensors are graph values)."""

    node: fx.Node
    x: fx.Node
    w_gate_up_packed: fx.Node
    w_down_packed: fx.Node
    topk_weights: fx.Node
    topk_ids: fx.Node
    first_expert: object
    activation: str
    w_gate_up_scale: fx.Node
    w_down_scale: fx.Node
    w_gate_up_scale_2: fx.Node
    w_down_scale_2: fx.Node
    b_gate_up: fx.Node | None = None
    b_down: fx.Node | None = None
    alpha: float | None = None
    limit: float | None = None

    OP = torch.ops.afdc.fused_moe_nvfp4.default
