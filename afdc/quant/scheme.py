"""Which quantized format each weight of a model is stored in, recognised from the model itself.

The evidence is the config's ``quantization_config`` and the checkpoint's safetensors headers
(names, dtypes, shapes), never a model name or type. These schemes are recognised:

- ``fp8`` (DeepSeek-V3 / Kimi K2 / Qwen3 ``-FP8``): ``X.weight`` float8_e4m3fn with a float32
  ``X.weight_scale_inv`` per ``weight_block_size`` block (ceil at the edges), multiplied in;
  ``modules_to_not_convert`` stay in bf16. A fused expert tensor ``E.gate_up_proj`` takes
  ``E.gate_up_proj_scale_inv`` (the same suffix rule). With ``scale_fmt: ue8m0`` (DeepSeek-V4)
  the scales are powers of two stored as float8_e8m0fnu, one byte each, as transformers reads them.
- ``compressed-tensors`` float8: ``X.weight`` float8_e4m3fn with ``X.weight_scale`` per output
  channel (``[out, 1]``), per tensor (``[1]``) or per block, and a static ``X.input_scale`` when
  the input activations are static; the ``ignore`` list stays in bf16.
- ``compressed-tensors`` ``pack-quantized`` int4 (Kimi-K2-Thinking's experts, W4A16 releases):
  ``X.weight_packed`` int32 ``[out, in / 8]`` (eight 4-bit values a word), ``X.weight_scale`` a
  float per ``group_size`` values along ``in`` (``[out, ceil(in / group)]``), ``X.weight_shape``
  the unpacked shape; symmetric (no zero point), weight-only.
- ``modelopt`` NVFP4 (``quant_algo: NVFP4``; NVIDIA's DeepSeek-R1/V3 and Qwen3 ``-FP4``):
  ``X.weight`` uint8 ``[out, in / 2]`` (two e2m1 a byte), ``X.weight_scale`` float8_e4m3fn
  ``[out, in / 16]``, ``X.weight_scale_2`` one float32 per tensor; ``exclude_modules`` (wildcards)
  stay in bf16. Run weight-only (the activations' ``input_scale`` is not read).
- ``mxfp4`` (gpt-oss experts): ``E.P_blocks`` uint8 ``[..., rows, cols/32, 16]`` (two e2m1 values a
  byte, low nibble first) with ``E.P_scales`` uint8 ``[..., rows, cols/32]`` (an e8m0 exponent,
  bias 127, per 32 values along ``cols``).

Two views come out. ``QuantizedWeight`` is a checkpoint tensor as stored (per expert where the hub
stores experts one by one); ``QuantizedParameter`` is a parameter of the bf16 model (fused experts
as one tensor) with its block along each of *its* dims, so a transposed expert layout (gpt-oss:
``[E, in, out]``) gets its block on the right axis. Checkpoint names become parameter names by
transformers' own conversion mapping, as ``from_pretrained`` maps them.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from enum import Enum
from fnmatch import fnmatch, translate
from typing import Any, Protocol

import torch
from torch import nn
from transformers import PretrainedConfig
from transformers.conversion_mapping import get_model_conversion_mapping
from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key
from transformers.quantizers.base import get_keys_to_not_convert
from transformers.quantizers.quantizers_utils import should_convert_module

from afdc.errors import AfdcError


class QuantizationError(AfdcError, ValueError):
    """A checkpoint's quantization is unsupported, or its tensors do not fit its config."""


class QuantFormat(str, Enum):
    """How one weight's values are stored and scaled."""

    FP8_BLOCK = "fp8-block"  # float8_e4m3fn, one float scale per block (multiplied in)
    FP8_CHANNEL = "fp8-channel"  # float8_e4m3fn, one float scale per output channel
    FP8_TENSOR = "fp8-tensor"  # float8_e4m3fn, one float scale for the whole weight
    MXFP4 = "mxfp4"  # packed e2m1 pairs, one e8m0 exponent per 32 values along the input dim
    INT4_GROUP = "int4-group"  # eight int4 an int32, one float scale per group along the input dim
    NVFP4 = "nvfp4"  # packed e2m1 pairs, an fp8 scale per 16 values along the input dim, a float32 per matrix


SUPPORTED = (
    "fp8 (quant_method 'fp8', fmt e4m3, dynamic activations, weight_block_size or per-tensor scales)",
    "compressed-tensors float8 (format float-quantized, 8-bit float weights per channel, per tensor or per block)",
    "compressed-tensors int4 (format pack-quantized, 4-bit symmetric int weights per group, weight-only)",
    "mxfp4 (quant_method 'mxfp4', gpt-oss experts as *_blocks / *_scales)",
    "modelopt NVFP4 (quant_method 'modelopt', quant_algo NVFP4, groups of 16, run weight-only)",
)
# the formats computed in the activations' dtype (weight-only): the planner's FLOPs are bf16's
WEIGHT_ONLY = frozenset({QuantFormat.MXFP4, QuantFormat.INT4_GROUP, QuantFormat.NVFP4})
INT4_PACK = 8  # int4 values an int32 word holds
NVFP4_GROUP = 16
# the packed formats stored [..., out, in / values]: input features a stored element holds
PACKED_VALUES = {QuantFormat.INT4_GROUP: INT4_PACK, QuantFormat.NVFP4: 2}

MXFP4_GROUP = 32  # values sharing one exponent
MXFP4_GROUP_BYTES = MXFP4_GROUP // 2  # two values a byte

_FLOAT_SCALES = (torch.float32, torch.bfloat16, torch.float16)
# fp8's scale_fmt to the dtypes its scales are stored in: ue8m0 is one byte a block, a power of two
# (DeepSeek-V4), which widens to float32 exactly wherever afdc computes with it
FP8_SCALE_FORMATS = {"float": _FLOAT_SCALES, "ue8m0": (torch.float8_e8m0fnu,)}


class TensorHeader(Protocol):
    """What a safetensors header says of a tensor (afdc.artifact.checkpoint.SourceTensor is one)."""

    @property
    def shape(self) -> tuple[int, ...]: ...

    @property
    def dtype(self) -> torch.dtype: ...


@dataclass(frozen=True)
class TensorSpec:
    """A checkpoint tensor: its name, shape and dtype as stored."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True)
class QuantizedWeight:
    """One quantized tensor of the checkpoint, with its scales.

    ``shape`` is the dequantized tensor in the checkpoint's orientation (for MXFP4, the blocks
    unpacked: ``[..., rows, cols]``); ``block`` is how many elements one scale covers along each
    dim of ``shape`` (a partial block at the edge has a scale of its own).
    """

    name: str
    parameter: str
    format: QuantFormat
    data: TensorSpec
    shape: tuple[int, ...]
    block: tuple[int, ...]
    scale: TensorSpec
    input_scale: TensorSpec | None = None
    global_scale: TensorSpec | None = None  # NVFP4's per-tensor weight_scale_2


@dataclass(frozen=True)
class QuantizedParameter:
    """A parameter of the bf16 model whose values the checkpoint stores quantized.

    ``shape`` is the bf16 parameter's; ``block`` the elements one scale covers along each of its
    dims; ``scale_shape`` the scales it needs in that orientation. ``sources`` names the checkpoint
    tensors (``QuantizedWeight.name``) it is assembled from, empty when known from a config alone;
    ``matrices`` how many checkpoint matrices each leading index concatenates (a fused gate_up: 2),
    each with a global scale of its own in NVFP4.
    """

    name: str
    format: QuantFormat
    shape: tuple[int, ...]
    block: tuple[int, ...]
    sources: tuple[str, ...] = ()
    static_input_scale: bool = False
    matrices: int = 1

    @property
    def scale_shape(self) -> tuple[int, ...]:
        return tuple(math.ceil(size / step) for size, step in zip(self.shape, self.block, strict=True))


@dataclass(frozen=True)
class QuantScheme:
    """A model's quantization: the method, and every quantized weight in both views."""

    method: str
    activation_scheme: str
    not_converted: tuple[str, ...]
    parameters: tuple[QuantizedParameter, ...]
    weights: tuple[QuantizedWeight, ...] = ()
    # the dtype a float8 weight's scales are stored in when no checkpoint header says (a config alone)
    fp8_scale_dtype: torch.dtype = torch.float32

    def parameter(self, name: str) -> QuantizedParameter | None:
        return next((p for p in self.parameters if p.name == name), None)

    def weight(self, name: str) -> QuantizedWeight | None:
        return next((w for w in self.weights if w.name == name), None)

    def scale_names(self) -> frozenset[str]:
        """Every scale tensor of the checkpoint (weight and input scales)."""
        specs = (spec for w in self.weights for spec in (w.scale, w.input_scale, w.global_scale))
        return frozenset(spec.name for spec in specs if spec is not None)

    def formats(self) -> tuple[QuantFormat, ...]:
        return tuple(dict.fromkeys(p.format for p in self.parameters))

    def describe(self) -> str:
        """One line for reports: the method and its formats (fp8 blocks with their size)."""
        kinds = dict.fromkeys(
            f"{p.format.value} {'x'.join(map(str, p.block[-2:]))}"
            if p.format is QuantFormat.FP8_BLOCK
            else p.format.value
            for p in self.parameters
        )
        return f"{self.method}: {len(self.parameters)} quantized parameters ({', '.join(kinds)})"


# -- the config --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Rules:
    """What a quantization_config says, once checked: each convertible module's format and block."""

    method: str
    activation_scheme: str
    not_converted: tuple[str, ...]
    # module name, class name -> (format, block over [out, in], static input scale), or None if left in bf16
    linear: Callable[[str, str], tuple[QuantFormat, tuple[int, int], bool] | None]
    # an experts module's name -> the format and block of its stacked matrices, or None if left in bf16
    experts: Callable[[str], tuple[QuantFormat, tuple[int, int]] | None]
    explicit_skips: bool  # False: transformers also keeps the output embedding in bf16
    formats: frozenset[QuantFormat]  # every format the config names
    fp8_scale_dtypes: tuple[torch.dtype, ...] = _FLOAT_SCALES  # what a float8 weight's scales may be stored as


def quantization_config(config: PretrainedConfig) -> dict[str, Any] | None:
    """The config's quantization_config as a plain dict, None when the model is not quantized."""
    found = getattr(config, "quantization_config", None)
    if found is None:
        return None
    return found.to_dict() if hasattr(found, "to_dict") else dict(found)


def planned_weight_dtype(config: PretrainedConfig) -> str | None:
    """The weight dtype of a checkpoint of ``config`` as the planner names it, for its FLOP rate
    (the bytes are each weight's as stored): ``fp8`` for the 8-bit float schemes; None when the
    model is not quantized, or in a format computed in bf16 (MXFP4, weight-only)."""
    qc = quantization_config(config)
    if qc is None:
        return None
    return None if _rules(qc).formats <= WEIGHT_ONLY else "fp8"


# why the formats users most often ask for are refused, and what to run instead
_INT4_LAYOUTS = ("its int4 layout (qweight packed along the input dim, qzeros zero points, scales, g_idx) has no "
                 "afdc kernel; the same model as compressed-tensors W4A16 (pack-quantized, symmetric) runs")
_WHY_NOT = {
    "gptq": _INT4_LAYOUTS,
    "awq": _INT4_LAYOUTS,
    "int-quantized": "8-bit integer weights (W8A8 int8, W8A16) have no afdc kernel; its fp8 release "
                     "(compressed-tensors FP8_DYNAMIC, float-quantized) runs",
}


def _refuse(what: str, kind: str = "") -> QuantizationError:
    supported = "; ".join(SUPPORTED)
    why = f" ({_WHY_NOT[kind]})" if kind in _WHY_NOT else ""
    return QuantizationError(
        f"{what} is not supported{why}. afdc runs checkpoints quantized as: {supported}. "
        "Use a checkpoint in one of these, or its bf16 release."
    )


def _rules(qc: dict[str, Any]) -> _Rules:
    method = str(qc.get("quant_method", "")).lower()
    if method == "fp8":
        return _fp8_rules(qc)
    if method == "compressed-tensors":
        return _compressed_tensors_rules(qc)
    if method == "modelopt":
        return _modelopt_rules(qc)
    if method == "mxfp4":
        skip = tuple(qc.get("modules_to_not_convert") or ())
        mxfp4 = (QuantFormat.MXFP4, (1, MXFP4_GROUP))
        return _Rules(method, "dynamic", skip, lambda _name, _cls: None, lambda _name: mxfp4, bool(skip),
                      frozenset({QuantFormat.MXFP4}))
    raise _refuse(f"quantization_config.quant_method {method or '(none)'!r}", method)


def _fp8_rules(qc: dict[str, Any]) -> _Rules:
    fmt = str(qc.get("fmt", "e4m3")).lower()
    if fmt != "e4m3":
        raise _refuse(f"fp8 with fmt {fmt!r} (only e4m3)")
    activation = str(qc.get("activation_scheme", "dynamic")).lower()
    if activation != "dynamic":
        raise _refuse(f"fp8 with activation_scheme {activation!r} (static activation scales)")
    scale_fmt = qc.get("scale_fmt") or "float"
    if scale_fmt not in FP8_SCALE_FORMATS:
        raise _refuse(f"fp8 with scale_fmt {scale_fmt!r} (only {' or '.join(map(repr, FP8_SCALE_FORMATS))})")
    expert_dtype = str(qc.get("expert_dtype") or "fp8")
    if expert_dtype not in ("fp8", "fp4") or (expert_dtype == "fp4" and scale_fmt != "ue8m0"):
        raise _refuse(f"fp8 with expert_dtype {expert_dtype!r} (fp8, or fp4 with scale_fmt 'ue8m0')")
    if qc.get("modules_to_convert"):
        raise _refuse("fp8 with modules_to_convert (quantized embeddings)")
    size = qc.get("weight_block_size")
    if size is None:
        block, fmt_ = (-1, -1), QuantFormat.FP8_TENSOR
    elif (
        isinstance(size, (list, tuple))
        and len(size) == 2
        and all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in size)
    ):
        block, fmt_ = (size[0], size[1]), QuantFormat.FP8_BLOCK
    else:
        raise QuantizationError(f"quantization_config.weight_block_size {size!r} is not two positive integers")
    skip = tuple(qc.get("modules_to_not_convert") or qc.get("ignored_layers") or ())

    def linear(_name: str, cls: str) -> tuple[QuantFormat, tuple[int, int], bool] | None:
        return (fmt_, block, False) if cls == "Linear" else None

    # DeepSeek-V4's fp4 experts are MXFP4: e2m1 pairs, one e8m0 exponent per 32 inputs of a row
    experts = (QuantFormat.MXFP4, (1, MXFP4_GROUP)) if expert_dtype == "fp4" else (fmt_, block)
    return _Rules("fp8", "dynamic", skip, linear, lambda _name: experts, bool(skip), frozenset({fmt_, experts[0]}),
                  FP8_SCALE_FORMATS[scale_fmt])


def _modelopt_rules(qc: dict[str, Any]) -> _Rules:
    """ModelOpt's quantization_config (or hf_quant_config.json's ``quantization``): NVFP4 only."""
    qc = {**qc, **(qc.get("quantization") or {})}
    algo = str(qc.get("quant_algo"))
    if algo not in ("NVFP4", "W4A16_NVFP4"):
        raise _refuse(f"modelopt with quant_algo {algo!r}")
    if qc.get("group_size", NVFP4_GROUP) != NVFP4_GROUP:
        raise _refuse(f"modelopt NVFP4 with group_size {qc['group_size']!r} (NVFP4 groups are 16)")
    if qc.get("kv_cache_quant_algo") or qc.get("kv_cache_scheme"):
        raise _refuse("modelopt NVFP4 with a quantized KV cache")
    exclude = tuple(qc.get("exclude_modules") or qc.get("ignore") or ())

    def linear(name: str, cls: str) -> tuple[QuantFormat, tuple[int, int], bool] | None:
        # ModelOpt's exclusions are wildcards (vLLM matches them with fnmatch)
        if cls != "Linear" or any(fnmatch(name, pattern) for pattern in exclude):
            return None
        return QuantFormat.NVFP4, (1, NVFP4_GROUP), False

    def experts(module: str) -> tuple[QuantFormat, tuple[int, int]] | None:
        found = linear(f"{module}.0.gate_proj", "Linear")
        return None if found is None else found[:2]

    # transformers' module filter takes regexes: the wildcards as regexes
    skip = tuple(translate(pattern) for pattern in exclude)
    return _Rules("modelopt", "dynamic", skip, linear, experts, True, frozenset({QuantFormat.NVFP4}))


@dataclass(frozen=True)
class _Group:
    targets: tuple[str, ...]
    format: QuantFormat
    block: tuple[int, int]
    static_input: bool


_CT_FORMATS = ("float-quantized", "pack-quantized")


def _compressed_tensors_rules(qc: dict[str, Any]) -> _Rules:
    fmt = qc.get("format")
    if fmt not in (*_CT_FORMATS, "mixed-precision"):
        raise _refuse(f"compressed-tensors format {fmt!r}", str(fmt))
    status = qc.get("quantization_status", "compressed")
    if status != "compressed":
        raise _refuse(f"compressed-tensors with quantization_status {status!r} (weights not stored quantized)")
    for key in ("sparsity_config", "kv_cache_scheme", "transform_config"):
        if qc.get(key):
            raise _refuse(f"compressed-tensors with a {key}")
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise QuantizationError("compressed-tensors quantization_config has no config_groups")
    parsed = [_ct_group(name, group, fmt) for name, group in groups.items()]
    ignore = tuple(qc.get("ignore") or ())
    statics = {g.static_input for g in parsed}

    def linear(name: str, cls: str) -> tuple[QuantFormat, tuple[int, int], bool] | None:
        group = next((g for g in parsed if any(_ct_matches(t, name, cls) for t in g.targets)), None)
        if group is None or any(_ct_matches(i, name, cls) for i in ignore):
            return None
        return group.format, group.block, group.static_input

    def experts(module: str) -> tuple[QuantFormat, tuple[int, int]] | None:
        # the checkpoint stores each expert as its own linear, which the config's targets select
        found = linear(f"{module}.0.gate_proj", "Linear")
        return None if found is None else found[:2]

    activation = "static" if statics == {True} else "dynamic" if statics == {False} else "mixed"
    formats = frozenset(g.format for g in parsed)
    return _Rules("compressed-tensors", activation, ignore, linear, experts, True, formats)


def _ct_matches(target: str, name: str, cls: str) -> bool:
    """compressed-tensors' target rule: ``re:`` a regex on the module name, else a class or module name."""
    if target.startswith("re:"):
        return re.match(target[3:], name) is not None
    return target in (cls, name)


def _ct_group(name: str, group: Any, top_format: str) -> _Group:
    weights = group.get("weights") if isinstance(group, dict) else None
    if not isinstance(weights, dict):
        raise QuantizationError(f"compressed-tensors config group {name!r} has no weights entry")
    fmt = group.get("format") or top_format
    if fmt == "pack-quantized":
        return _ct_int4_group(name, group, weights)
    if fmt != "float-quantized":
        raise _refuse(f"compressed-tensors group {name!r} in format {fmt!r}", str(fmt))
    kind = f"{weights.get('num_bits')}-bit {weights.get('type')} weights, strategy {weights.get('strategy')}"
    if weights.get("num_bits") != 8 or weights.get("type") != "float" or not weights.get("symmetric", True):
        raise _refuse(f"compressed-tensors group {name!r} with {kind}")
    if weights.get("dynamic"):
        raise _refuse(f"compressed-tensors group {name!r} with dynamic weight scales")
    strategy = weights.get("strategy")
    if strategy == "channel":
        fmt, block = QuantFormat.FP8_CHANNEL, (1, -1)
    elif strategy == "tensor":
        fmt, block = QuantFormat.FP8_TENSOR, (-1, -1)
    elif strategy == "block" and len(weights.get("block_structure") or ()) == 2:
        fmt, block = QuantFormat.FP8_BLOCK, tuple(weights["block_structure"])
    else:
        raise _refuse(f"compressed-tensors group {name!r} with {kind}")
    inputs = group.get("input_activations")
    static = False
    if inputs:
        if inputs.get("num_bits") != 8 or inputs.get("type") != "float":
            bits = f"{inputs.get('num_bits')}-bit {inputs.get('type')}"
            raise _refuse(f"compressed-tensors group {name!r} with {bits} activations")
        static = not inputs.get("dynamic", False)
        if static and inputs.get("strategy") != "tensor":
            raise _refuse(f"compressed-tensors group {name!r} with static {inputs.get('strategy')} input scales")
    if group.get("output_activations"):
        raise _refuse(f"compressed-tensors group {name!r} with quantized output activations")
    targets = tuple(group.get("targets") or ())
    if not targets:
        raise QuantizationError(f"compressed-tensors config group {name!r} has no targets")
    return _Group(targets, fmt, block, static)


def _ct_int4_group(name: str, group: dict, weights: dict) -> _Group:
    """A pack-quantized group: symmetric 4-bit ints per group along the input dim, weight-only."""
    kind = (f"{weights.get('num_bits')}-bit {weights.get('type')} weights, strategy {weights.get('strategy')}, "
            f"{'symmetric' if weights.get('symmetric', True) else 'asymmetric (zero points)'}")
    size = weights.get("group_size")
    if (weights.get("num_bits") != 4 or weights.get("type") != "int" or not weights.get("symmetric", True)
            or weights.get("strategy") != "group" or not isinstance(size, int) or isinstance(size, bool)
            or size < 1 or size % INT4_PACK):
        raise _refuse(f"compressed-tensors pack-quantized group {name!r} with {kind}, group size {size}")
    if weights.get("dynamic") or weights.get("actorder") == "group":
        raise _refuse(f"compressed-tensors group {name!r} with dynamic weight scales or activation-ordered groups")
    if group.get("input_activations") or group.get("output_activations"):
        raise _refuse(f"compressed-tensors pack-quantized group {name!r} with quantized activations")
    targets = tuple(group.get("targets") or ())
    if not targets:
        raise QuantizationError(f"compressed-tensors config group {name!r} has no targets")
    return _Group(targets, QuantFormat.INT4_GROUP, (1, size), False)


def _full(block: tuple[int, int], shape: tuple[int, int]) -> tuple[int, int]:
    """A block with -1 (the whole dim) resolved against [out, in]."""
    return tuple(size if step == -1 else step for step, size in zip(block, shape, strict=True))  # type: ignore[return-value]


# -- from a config alone -------------------------------------------------------------------------------


def meta_model(config: PretrainedConfig) -> nn.Module:
    """The bf16 model of ``config`` on the meta device (no memory, no weights)."""
    from afdc import model_class

    with torch.device("meta"):
        return model_class.from_config(config)


def scheme_from_config(config: PretrainedConfig, model: nn.Module | None = None) -> QuantScheme | None:
    """The scheme a checkpoint of ``config`` holds, with every parameter it quantizes (no weights).

    The quantized parameters are those transformers converts when it loads such a checkpoint: each
    ``nn.Linear`` the config's rules select and, for fp8 and mxfp4, the 3-D weights of each
    ``experts`` module, except modules the config keeps in bf16 (and, with no list given, the
    output embedding) and those the model's class keeps out of quantization, as transformers'
    quantizers do (``_keep_in_fp32_modules``: DeepSeek-V4's compressor projections ship in bf16).
    ``model`` is the bf16 model (built on the meta device when not given).
    """
    qc = quantization_config(config)
    if qc is None:
        return None
    rules = _rules(qc)
    model = model if model is not None else meta_model(config)
    skip = [*rules.not_converted, *(getattr(model, "_keep_in_fp32_modules", None) or ())]
    if not rules.explicit_skips:
        skip += get_keys_to_not_convert(model)
    parameters = []
    for module_name, module in model.named_modules():
        if not should_convert_module(module_name, skip):
            continue
        if type(module) is nn.Linear:
            found = rules.linear(module_name, "Linear")
            if found is not None:
                fmt, block, static = found
                shape = tuple(module.weight.shape)
                parameters.append(
                    QuantizedParameter(f"{module_name}.weight", fmt, shape, _full(block, shape), (), static)
                )
        elif module_name.endswith(".experts") and (found := rules.experts(module_name)) is not None:
            parameters += _expert_parameters(module_name, module, *found)
    return QuantScheme(rules.method, rules.activation_scheme, rules.not_converted, tuple(parameters),
                       fp8_scale_dtype=rules.fp8_scale_dtypes[0])


def _matrices_apart(fmt: QuantFormat, matrices: int) -> int:
    """:attr:`QuantizedParameter.matrices` of a parameter concatenating ``matrices`` checkpoint
    matrices per leading index: they count apart only where the format stores something per matrix
    (NVFP4's global scale); an fp8 or MXFP4 gate_up is one grid of scales."""
    return matrices if fmt is QuantFormat.NVFP4 else 1


def _expert_parameters(
    module_name: str, module: nn.Module, fmt: QuantFormat, block: tuple[int, int]
) -> list[QuantizedParameter]:
    """The experts' stacked matrices, ``[E, out, in]`` or transposed ``[E, in, out]``."""
    transposed = bool(getattr(module, "is_transposed", False))
    found = []
    for name, param in module.named_parameters(recurse=False):
        if param.dim() != 3:
            continue  # biases stay in bf16
        out_in = (param.shape[2], param.shape[1]) if transposed else (param.shape[1], param.shape[2])
        step = _full(block, out_in)
        along = (1, step[1], step[0]) if transposed else (1, *step)
        # transformers' fused experts concatenate each expert's gate_proj and up_proj into gate_up_proj
        matrices = _matrices_apart(fmt, 2 if name == "gate_up_proj" else 1)
        found.append(QuantizedParameter(f"{module_name}.{name}", fmt, tuple(param.shape), along, matrices=matrices))
    return found


# -- from a checkpoint -----------------------------------------------------------------------------


def recognise(
    config: PretrainedConfig, tensors: Mapping[str, TensorHeader], model: nn.Module | None = None
) -> QuantScheme | None:
    """The scheme of a checkpoint, every quantized tensor checked against its headers.

    ``tensors`` is the checkpoint's headers by name (``afdc.artifact.checkpoint.Checkpoint.tensors``
    reads them lazily); ``model`` the bf16 model of ``config``, used for its parameter names
    (built on the meta device when not given). None when the checkpoint is not quantized.
    Raises QuantizationError for an unsupported scheme, a quantized tensor the config keeps in
    bf16, a weight without its scale (or the reverse), or a scale whose shape does not fit.
    """
    qc = quantization_config(config)
    if qc is None:
        stray = [name for name, t in tensors.items() if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)]
        if stray:
            raise QuantizationError(
                f"the checkpoint stores {stray[0]} (and {len(stray) - 1} more) in float8 but its config has no "
                "quantization_config; add the quantization_config the checkpoint was written with"
            )
        return None
    rules = _rules(qc)
    model = model if model is not None else meta_model(config)
    if rules.method == "mxfp4":
        weights = _mxfp4_weights(tensors)
    elif rules.method == "modelopt":
        weights = _nvfp4_weights(rules, tensors)
    else:
        if QuantFormat.INT4_GROUP in rules.formats:
            packed = _int4_weights(rules, tensors)
        elif QuantFormat.MXFP4 in rules.formats:  # fp8 with fp4 experts
            packed = _fp4_expert_weights(rules, tensors)
        else:
            packed = []
        weights = _fp8_weights(rules, tensors, {w.scale.name for w in packed}) + packed
    if not weights:
        raise QuantizationError(
            f"the config says quant_method {rules.method!r} but no checkpoint tensor is stored quantized "
            "(no float8 weight with its scale, no *_blocks with *_scales, no weight_packed with its weight_scale)"
        )
    for w in weights:
        if not should_convert_module(_module_of(w.name), list(rules.not_converted)):
            raise QuantizationError(
                f"{w.name} is stored as {w.format.value} but the quantization_config keeps its module in bf16 "
                f"(modules_to_not_convert / ignore: {', '.join(rules.not_converted)})"
            )
    to_parameter = _parameter_names(model)
    weights = [_with_parameter(w, to_parameter(w.parameter)) for w in weights]
    parameters = _parameters(weights, model)
    return QuantScheme(rules.method, rules.activation_scheme, rules.not_converted, parameters, tuple(weights),
                       rules.fp8_scale_dtypes[0])


def _module_of(name: str) -> str:
    return name.rpartition(".")[0]


def _fp8_weights(
    rules: _Rules, tensors: Mapping[str, TensorHeader], other_scales: set[str] = frozenset()
) -> list[QuantizedWeight]:
    suffix = "_scale_inv" if rules.method == "fp8" else "_scale"
    weights = []
    for name, header in tensors.items():
        if header.dtype != torch.float8_e4m3fn:
            if header.dtype == torch.float8_e5m2:
                raise _refuse(f"{name} stored as float8_e5m2")
            continue
        scale = tensors.get(name + suffix)
        if scale is None:
            raise QuantizationError(f"{name} is float8 but the checkpoint has no {name + suffix} to scale it")
        found = rules.linear(_module_of(name), "Linear")  # fp8's rules give every linear its one format
        if found is None:
            raise QuantizationError(
                f"{name} is float8 but no compressed-tensors config group targets its module "
                "(or the ignore list names it)"
            )
        fmt, block, static = found
        if fmt is QuantFormat.INT4_GROUP:
            raise QuantizationError(f"{name} is float8 but the config gives its module int4 pack-quantized")
        shape = tuple(header.shape)
        if len(shape) < 2:
            raise QuantizationError(f"{name} is float8 of shape {list(shape)}; a quantized weight is a matrix")
        step = (1,) * (len(shape) - 2) + _full(block, shape[-2:])
        weights.append(
            QuantizedWeight(
                name,
                name,
                fmt,
                _spec(name, header),
                shape,
                step,
                _checked_scale(name + suffix, tensors[name + suffix], shape, step, fmt, rules.fp8_scale_dtypes),
                _input_scale(name, tensors) if static else None,
            )
        )
    # compressed-tensors also writes `input_scale`, which is not a weight's scale
    orphan_suffix = "weight" + suffix if rules.method == "compressed-tensors" else suffix
    _no_orphans(tensors, orphan_suffix, {w.scale.name for w in weights} | other_scales)
    return weights


def _int4_weights(rules: _Rules, tensors: Mapping[str, TensorHeader]) -> list[QuantizedWeight]:
    """compressed-tensors pack-quantized weights: ``X.weight_packed`` int32 with ``X.weight_scale``."""
    weights = []
    for name, header in tensors.items():
        if not name.endswith(".weight_packed"):
            continue
        stem = name.removesuffix("_packed")
        found = rules.linear(_module_of(name), "Linear")
        if found is None or found[0] is not QuantFormat.INT4_GROUP:
            raise QuantizationError(
                f"{name} holds packed int4 but no pack-quantized config group targets its module "
                "(or the ignore list names it)"
            )
        scale = tensors.get(stem + "_scale")
        if scale is None:
            raise QuantizationError(f"{name} holds packed int4 but the checkpoint has no {stem}_scale")
        shape = tuple(header.shape)
        if header.dtype != torch.int32 or len(shape) < 2:
            raise QuantizationError(f"{name} should be int32 [..., out, in / {INT4_PACK}] (packed int4), "
                                    f"found {_spec(name, header)}")
        logical = (*shape[:-1], shape[-1] * INT4_PACK)
        step = (1,) * (len(logical) - 1) + (found[1][1],)
        weights.append(QuantizedWeight(name, stem, QuantFormat.INT4_GROUP, _spec(name, header), logical, step,
                                       _checked_scale(stem + "_scale", scale, logical, step, QuantFormat.INT4_GROUP)))
    return weights


def _fp4_expert_weights(rules: _Rules, tensors: Mapping[str, TensorHeader]) -> list[QuantizedWeight]:
    """DeepSeek-V4's fp4 experts (``expert_dtype: fp4``): ``X.weight`` int8 ``[..., out, in / 2]``, two
    e2m1 codes a byte (MXFP4's bytes), with ``X.weight_scale_inv`` ``[..., out, in / 32]`` (e8m0)."""
    weights = []
    for name, header in tensors.items():
        if header.dtype != torch.int8 or name + "_scale_inv" not in tensors:
            continue
        found = rules.experts(_module_of(name))
        shape = tuple(header.shape)
        if len(shape) < 2 or found is None or found[0] is not QuantFormat.MXFP4:
            raise QuantizationError(f"{name} holds packed fp4 ({_spec(name, header)}) but the config gives "
                                    "fp4 to routed experts' matrices only")
        logical = (*shape[:-1], shape[-1] * 2)
        step = (1,) * (len(logical) - 1) + (MXFP4_GROUP,)
        scale = _checked_scale(name + "_scale_inv", tensors[name + "_scale_inv"], logical, step, QuantFormat.MXFP4)
        weights.append(QuantizedWeight(name, name, QuantFormat.MXFP4, _spec(name, header), logical, step, scale))
    return weights


def _input_scale(weight: str, tensors: Mapping[str, TensorHeader]) -> TensorSpec:
    name = f"{_module_of(weight)}.input_scale"
    header = tensors.get(name)
    if header is None:
        raise QuantizationError(f"the config gives {weight} static input scales but the checkpoint has no {name}")
    if math.prod(header.shape) != 1 or header.dtype not in _FLOAT_SCALES:
        found = _spec(name, header)
        raise QuantizationError(f"{name} should be one float (per-tensor static input scale), found {found}")
    return _spec(name, header)


def _mxfp4_weights(tensors: Mapping[str, TensorHeader]) -> list[QuantizedWeight]:
    weights = []
    for name, header in tensors.items():
        if not name.endswith("_blocks"):
            continue
        stem = name.removesuffix("_blocks")
        scales = tensors.get(stem + "_scales")
        if scales is None:
            raise QuantizationError(f"{name} holds MXFP4 blocks but the checkpoint has no {stem}_scales")
        shape = tuple(header.shape)
        if header.dtype != torch.uint8 or len(shape) < 3 or shape[-1] != MXFP4_GROUP_BYTES:
            raise QuantizationError(
                f"{name} should be uint8 [..., rows, groups, {MXFP4_GROUP_BYTES}] (MXFP4 blocks), "
                f"found {_spec(name, header)}"
            )
        logical = (*shape[:-2], shape[-2] * MXFP4_GROUP)
        step = (1,) * (len(logical) - 1) + (MXFP4_GROUP,)
        weights.append(
            QuantizedWeight(
                name,
                stem,
                QuantFormat.MXFP4,
                _spec(name, header),
                logical,
                step,
                _checked_scale(stem + "_scales", scales, logical, step, QuantFormat.MXFP4),
            )
        )
    _no_orphans(tensors, "_scales", {w.scale.name for w in weights})
    return weights


def _nvfp4_weights(rules: _Rules, tensors: Mapping[str, TensorHeader]) -> list[QuantizedWeight]:
    """ModelOpt NVFP4 weights: ``X.weight`` uint8 with ``X.weight_scale`` and ``X.weight_scale_2``."""
    weights = []
    for name, header in tensors.items():
        if not name.endswith(".weight") or header.dtype != torch.uint8:
            continue
        scale, global_scale = tensors.get(name + "_scale"), tensors.get(name + "_scale_2")
        if scale is None or global_scale is None:
            raise QuantizationError(f"{name} holds packed NVFP4 but the checkpoint lacks {name}_scale or "
                                    f"{name}_scale_2")
        if rules.linear(_module_of(name), "Linear") is None:
            raise QuantizationError(f"{name} is stored as NVFP4 but the quantization_config's exclude_modules "
                                    "name its module")
        shape = tuple(header.shape)
        if len(shape) < 2:
            raise QuantizationError(f"{name} is uint8 of shape {list(shape)}; an NVFP4 weight is a matrix")
        if math.prod(global_scale.shape) != 1 or global_scale.dtype != torch.float32:
            raise QuantizationError(f"{name}_scale_2 should be one float32 (the global scale), found "
                                    f"{_spec(name + '_scale_2', global_scale)}")
        logical = (*shape[:-1], shape[-1] * 2)
        step = (1,) * (len(logical) - 1) + (NVFP4_GROUP,)
        weights.append(QuantizedWeight(name, name, QuantFormat.NVFP4, _spec(name, header), logical, step,
                                       _checked_scale(name + "_scale", scale, logical, step, QuantFormat.NVFP4),
                                       global_scale=_spec(name + "_scale_2", global_scale)))
    _no_orphans(tensors, "weight_scale", {w.scale.name for w in weights})
    _no_orphans(tensors, "weight_scale_2", {w.global_scale.name for w in weights})
    return weights


def _no_orphans(tensors: Mapping[str, TensorHeader], suffix: str, used: set[str]) -> None:
    orphans = [name for name in tensors if name.endswith(suffix) and name not in used]
    if orphans:
        weight = orphans[0].removesuffix(suffix)
        raise QuantizationError(
            f"{orphans[0]} scales {weight}, which the checkpoint does not store quantized "
            f"({weight} {'absent' if weight not in tensors else 'is ' + str(tensors[weight].dtype)})"
        )


def _spec(name: str, header: TensorHeader) -> TensorSpec:
    return TensorSpec(name, tuple(header.shape), header.dtype)


def _checked_scale(
    name: str, header: TensorHeader, shape: tuple[int, ...], block: tuple[int, ...], fmt: QuantFormat,
    float_scales: tuple[torch.dtype, ...] = _FLOAT_SCALES,
) -> TensorSpec:
    """The scale tensor, refused unless its shape is one value per block of ``shape`` and its dtype
    one the format stores (``float_scales`` for the float8 formats)."""
    want = tuple(math.ceil(size / step) for size, step in zip(shape, block, strict=True))
    got = tuple(header.shape)
    if fmt is QuantFormat.FP8_TENSOR:
        fits = math.prod(got) == 1
    elif fmt is QuantFormat.FP8_CHANNEL:
        fits = got in (want, want[:-1])  # compressed-tensors writes [out, 1]; [out] means the same
    else:
        fits = got == want
    # MXFP4's exponents: bytes (gpt-oss) or the same bytes typed e8m0 (DeepSeek-V4's fp4 experts)
    mxfp4 = (torch.uint8, torch.float8_e8m0fnu)
    dtypes = {QuantFormat.MXFP4: mxfp4, QuantFormat.NVFP4: (torch.float8_e4m3fn,)}.get(fmt, float_scales)
    if not fits or header.dtype not in dtypes:
        blocks = "x".join(map(str, block))
        raise QuantizationError(
            f"{name} has shape {list(got)} and dtype {header.dtype}, but a {fmt.value} weight of shape "
            f"{list(shape)} in blocks of {blocks} needs {list(want)} of {' or '.join(map(str, dtypes))}"
            + (" (as the config's scale_fmt says: 'ue8m0' stores float8_e8m0fnu, 'float' a float dtype)"
               if dtypes in FP8_SCALE_FORMATS.values() else "")
        )
    return _spec(name, header)


def _with_parameter(weight: QuantizedWeight, parameter: str) -> QuantizedWeight:
    return replace(weight, parameter=parameter)


def checkpoint_renamer(mapping: list, prefix: str | None, shapes: Mapping) -> Callable[[str], tuple[str, str | None]]:
    """Checkpoint key to ``(model tensor name, the converter source pattern it matched or None)``,
    as ``from_pretrained`` renames keys (``mapping``: ``get_model_conversion_mapping``'s): renamings,
    then at most one converter, the base-model ``prefix`` added or dropped as ``shapes`` (the
    model's tensor names) need; a key that already is a model name only has its prefix fixed."""
    renamings = [t for t in mapping if isinstance(t, WeightRenaming)]
    converters = [t for t in mapping if isinstance(t, WeightConverter)]

    def rename(key: str) -> tuple[str, str | None]:
        name, pattern = rename_source_key(key, renamings, converters, prefix, shapes)
        if name not in shapes and key in shapes:
            name, pattern = rename_source_key(key, [], [], prefix, shapes)
        return name, pattern

    return rename


def _parameter_names(model: nn.Module) -> Callable[[str], str]:
    """Checkpoint name to model parameter name, as from_pretrained renames keys."""
    shapes = model.state_dict()
    rename = checkpoint_renamer(get_model_conversion_mapping(model), getattr(model, "base_model_prefix", None), shapes)
    return lambda key: rename(key)[0]


def _parameters(weights: list[QuantizedWeight], model: nn.Module) -> tuple[QuantizedParameter, ...]:
    """Group checkpoint tensors by the parameter they make, each block set along its dims.

    An experts module that holds its matrices as ``[E, in, out]`` says so (``is_transposed``); that
    settles the orientation of a square one.
    """
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    groups: defaultdict[str, list[QuantizedWeight]] = defaultdict(list)
    for w in weights:
        if w.parameter not in shapes:
            raise QuantizationError(
                f"{w.name} is stored quantized but the model has no parameter {w.parameter} for it "
                "(is the config the checkpoint's?)"
            )
        groups[w.parameter].append(w)
    return tuple(
        _parameter(
            name, members, shapes[name], bool(getattr(model.get_submodule(_module_of(name)), "is_transposed", False))
        )
        for name, members in groups.items()
    )


def _parameter(
    name: str, members: list[QuantizedWeight], shape: tuple[int, ...], transposed: bool
) -> QuantizedParameter:
    first = members[0]
    kinds = {(w.format, w.block, w.shape, w.input_scale is not None) for w in members}
    if len(kinds) > 1:
        raise QuantizationError(f"{name} is assembled from checkpoint tensors quantized differently: {first.name}, ...")
    if sum(math.prod(w.shape) for w in members) != math.prod(shape):
        raise QuantizationError(
            f"{name} {list(shape)} is assembled from {len(members)} quantized tensors ({first.name}, ...) "
            f"of {list(first.shape)}: some are missing or extra"
        )
    block = _block_along(shape, first, transposed)
    if block is None:
        raise QuantizationError(
            f"{name} {list(shape)} is assembled from {first.name} {list(first.shape)} in blocks of "
            f"{'x'.join(map(str, first.block))}, which do not line up with it"
        )
    sources = tuple(w.name for w in members)
    matrices = _matrices_apart(first.format, len(members) // math.prod(shape[: len(shape) - len(first.shape)]))
    return QuantizedParameter(name, first.format, shape, block, sources, first.input_scale is not None, matrices)


def _block_along(shape: tuple[int, ...], weight: QuantizedWeight, transposed: bool) -> tuple[int, ...] | None:
    """The block of ``weight`` along the dims of the parameter it is stacked/concatenated into.

    The parameter's trailing dims are the tensor's (a stacked or concatenated dim a whole number
    of blocks), with the last two swapped when the parameter is ``transposed``. None when they do
    not line up.
    """
    src, block = weight.shape, weight.block
    lead = len(shape) - len(src)
    if lead < 0 or (transposed and len(src) < 2):
        return None
    if transposed:
        src, block = (*src[:-2], src[-1], src[-2]), (*block[:-2], block[-1], block[-2])
    fits = all(
        size == part or (size % part == 0 and part % step == 0)  # stacked pieces start on block bounds
        for size, part, step in zip(shape[lead:], src, block, strict=True)
    )
    return (1,) * lead + tuple(block) if fits else None
