"""Tiny checkpoints in the quantized formats models ship in, and the same models dequantized.

Each builder makes a small random bf16 model, saves it as ``save_pretrained`` does (per-expert hub
layout), quantizes the tensors the real release quantizes, exactly as the format defines it,
and writes config.json (with the release's kind of ``quantization_config``) and
model.safetensors as the hub ships them. It also returns the reference: the same model with every
quantized weight dequantized by the format's definition, in float32, loaded by transformers from
a plain checkpoint beside it. The quantization here is written independently of afdc.quant on
purpose: tests quantize, the library dequantizes.

Formats (float8 is float8_e4m3fn, whose largest value is 448):
- fp8 blocks: a float32 ``weight_scale_inv`` per block = the block's max |w| / 448; stored
  ``q = fp8(w / scale)``; ``w = q * scale``. Edge blocks may be partial. With ``scale_fmt: ue8m0``
  (DeepSeek-V4) the scale is that value rounded up to a power of two and stored as float8_e8m0fnu,
  as transformers' own fp8 quantizer writes it.
- fp8 per channel / per tensor (compressed-tensors): ``weight_scale`` [out, 1] or [1], in the
  model's dtype, = max |w| over the row / tensor / 448.
- int4 pack-quantized (compressed-tensors): written by compressed-tensors' own observer math
  (``calculate_qparams``) and compressor (``PackedQuantizationCompressor``), so the layout is the
  library's: ``weight_packed`` int32, ``weight_scale`` bf16 per group of 32, ``weight_shape``.
- NVFP4 (ModelOpt): per matrix a float32 ``weight_scale_2`` = max |w| / (6 * 448); per 16 values
  along the last dim an fp8 ``weight_scale`` = the group's max |w| / 6 / weight_scale_2; each
  value the e2m1 code nearest ``w / (weight_scale * weight_scale_2)``, two a byte, the even element
  in the low nibble. The dequantized value is vLLM's own reading (``dequantize_to_dtype``).
- MXFP4: along the last dim, groups of 32 share the exponent ``e = floor(log2(max |w|)) - 2``
  (e2m1's largest value is 6 = 1.5 * 2**2), stored as the byte ``e + 127``; each value is the
  e2m1 code nearest ``w / 2**e`` (saturating at 6), two a byte, the even element in the low nibble.
  DeepSeek-V4's fp4 experts (``expert_dtype: fp4``) are these bytes in other containers: the codes
  int8 ``[out, in / 2]``, the exponents float8_e8m0fnu ``[out, in / 32]`` as ``weight_scale_inv``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    DeepseekV3Config,
    GptOssConfig,
    LlamaConfig,
    PretrainedConfig,
    PreTrainedModel,
    Qwen3MoeConfig,
)

from models_supported import catalog

FP8_MAX = 448.0
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # codes 0..7; code | 8 is the negative
MX_GROUP = 32


# -- the formats, as they define themselves ---------------------------------------------------------


def fp8_blocks(
    weight: torch.Tensor, block: tuple[int, int], ue8m0: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8 weight, scale per block) of a 2-D weight: float32, or (``ue8m0``) the power of two at
    or above it in float8_e8m0fnu."""
    rows, cols = weight.shape
    br, bc = block
    grid = (math.ceil(rows / br), math.ceil(cols / bc))
    padded = torch.zeros(grid[0] * br, grid[1] * bc, dtype=torch.float32)
    padded[:rows, :cols] = weight.float()
    amax = padded.reshape(grid[0], br, grid[1], bc).abs().amax(dim=(1, 3))
    scale = (amax / FP8_MAX).clamp(min=1e-12)
    if ue8m0:
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    full = scale.repeat_interleave(br, 0).repeat_interleave(bc, 1)[:rows, :cols]
    q = (weight.float() / full).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale.to(torch.float8_e8m0fnu) if ue8m0 else scale


def fp8_blocks_dequantized(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    rows, cols = q.shape
    full = scale.float().repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[:rows, :cols]
    return q.float() * full


def fp8_scaled(weight: torch.Tensor, per_channel: bool, scale_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8 weight, scale [out, 1] or [1]) with the scale stored in ``scale_dtype``."""
    amax = weight.float().abs().amax(dim=1, keepdim=True) if per_channel else weight.float().abs().amax().reshape(1)
    scale = (amax / FP8_MAX).clamp(min=1e-12).to(scale_dtype)
    return (weight.float() / scale.float()).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


def mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(uint8 blocks [..., cols/32, 16], uint8 scales [..., cols/32]) along the last dim."""
    *lead, cols = weight.shape
    groups = weight.float().reshape(*lead, cols // MX_GROUP, MX_GROUP)
    amax = groups.abs().amax(dim=-1)
    exponent = torch.where(amax > 0, torch.floor(torch.log2(amax)) - 2, torch.full_like(amax, -127)).clamp(-127, 127)
    return _e2m1_codes(groups / torch.exp2(exponent).unsqueeze(-1)), (exponent + 127).to(torch.uint8)


def _e2m1_codes(scaled: torch.Tensor) -> torch.Tensor:
    nearest = (scaled.abs().unsqueeze(-1) - torch.tensor(E2M1)).abs().argmin(dim=-1)  # saturates at 6 by itself
    codes = (nearest | torch.where(scaled < 0, 8, 0)).to(torch.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


NV_GROUP = 16


def nvfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(uint8 [rows, cols/2], float8 scales [rows, cols/16], float32 global scale []) of a 2-D weight."""
    w = weight.float()
    global_scale = (w.abs().amax() / (6 * FP8_MAX)).clamp(min=1e-12)
    groups = w.reshape(w.shape[0], -1, NV_GROUP)
    scale = (groups.abs().amax(dim=-1) / 6 / global_scale).clamp(max=FP8_MAX).to(torch.float8_e4m3fn)
    divisor = (scale.float() * global_scale).clamp(min=1e-30).unsqueeze(-1)
    return _e2m1_codes(groups / divisor).flatten(-2), scale, global_scale


def mxfp4_dequantized(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    table = torch.tensor([*E2M1, *(-v for v in E2M1)])
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).long()  # low nibble first
    values = table[codes].flatten(-2) * torch.exp2(scales.float() - 127).unsqueeze(-1)
    return values.flatten(-2)


# -- checkpoints -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class QuantCheckpoint:
    """A checkpoint directory in a shipping format and its dequantized reference model."""

    directory: Path
    reference: PreTrainedModel  # float32, weights dequantized by the format's definition
    quantized: tuple[str, ...]  # checkpoint names of the quantized weights (the data tensors)
    kept: tuple[str, ...]  # checkpoint names of the matrices left unquantized


# A hub tensor to (its shipped tensors, its dequantized value), or None to ship it as it is.
Quantizer = Callable[[str, torch.Tensor], tuple[dict[str, torch.Tensor], torch.Tensor] | None]


def _write(
    directory: Path, config: PretrainedConfig, quantization: dict, quantize: Quantizer, seed: int
) -> QuantCheckpoint:
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    plain = directory.parent / f"{directory.name}-bf16"
    model.save_pretrained(plain)
    shipped: dict[str, torch.Tensor] = {}
    dequantized: dict[str, torch.Tensor] = {}
    quantized, kept = [], []
    for name, tensor in load_file(plain / "model.safetensors").items():
        found = quantize(name, tensor)
        if found is None:
            shipped[name], dequantized[name] = tensor, tensor.float()
            if tensor.dim() >= 2:
                kept.append(name)
        else:
            parts, dequantized[name] = found
            shipped.update(parts)
            quantized.append(next(iter(parts)))
    directory.mkdir(parents=True, exist_ok=True)
    save_file(shipped, directory / "model.safetensors", metadata={"format": "pt"})
    document = json.loads((plain / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**document, "quantization_config": quantization}, indent=2))

    reference_dir = directory.parent / f"{directory.name}-dequantized"
    reference_dir.mkdir(exist_ok=True)
    save_file(dequantized, reference_dir / "model.safetensors", metadata={"format": "pt"})
    (reference_dir / "config.json").write_text(json.dumps({**document, "dtype": "float32"}, indent=2))
    reference = AutoModelForCausalLM.from_pretrained(reference_dir, dtype=torch.float32).eval()
    return QuantCheckpoint(directory, reference, tuple(quantized), tuple(kept))


def _fp8_block_quantizer(
    block: tuple[int, int], select: Callable[[str, torch.Tensor], bool], scale_fmt: str = "float",
    expert_dtype: str = "fp8",
) -> Quantizer:
    """fp8 blocks for the selected tensors; with ``expert_dtype="fp4"`` the routed experts' as
    DeepSeek-V4 ships them: MXFP4's bytes, the codes int8 ``[out, in / 2]`` and the exponents e8m0."""

    def quantize(name: str, tensor: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor] | None:
        if not select(name, tensor):
            return None
        if expert_dtype == "fp4" and ".experts." in name:
            blocks, scales = mxfp4(tensor)
            codes, exponents = blocks.flatten(-2).view(torch.int8), scales.view(torch.float8_e8m0fnu)
            return {name: codes, f"{name}_scale_inv": exponents}, mxfp4_dequantized(blocks, scales)
        q, scale = fp8_blocks(tensor, block, ue8m0=scale_fmt == "ue8m0")
        return {name: q, f"{name}_scale_inv": scale}, fp8_blocks_dequantized(q, scale, block)

    return quantize


def _layer_matrix(name: str, tensor: torch.Tensor) -> bool:
    return name.startswith("model.layers.") and name.endswith(".weight") and tensor.dim() == 2


def deepseek_v3_fp8(
    directory: Path, block: tuple[int, int] = (16, 16), seed: int = 0, scale_fmt: str = "float",
    expert_dtype: str = "fp8",
) -> QuantCheckpoint:
    """DeepSeek-V3-shaped: one dense layer, one MoE layer (4 routed experts, a shared expert).

    As DeepSeek ships it: every linear of the decoder layers (MLA projections, dense MLP, shared
    and routed experts, one by one) fp8 in blocks; the router (float32), norms, embedding and LM
    head unquantized; no modules_to_not_convert. ``kv_a_proj_with_mqa`` has 48 rows: at
    ``block=(32, 32)`` its last block is partial, as 576 rows are at 128 in DeepSeek-V3. The default
    16 divides every dim because transformers 5.24 infers the block from the scale grid
    (rows // scale rows): at 32 it dequantizes that tensor with 24-row blocks, silently wrong.
    ``scale_fmt="ue8m0"``: the scales as DeepSeek-V4 ships them (powers of two, float8_e8m0fnu);
    with ``expert_dtype="fp4"`` too, the routed experts fp4 as V4-Flash ships its own.
    """
    config = DeepseekV3Config(
        vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
        first_k_dense_replace=1, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
        n_shared_experts=1, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=32,
        qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16, max_position_embeddings=256,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )  # fmt: skip
    quantization = {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": list(block),
        "scale_fmt": scale_fmt,
        "expert_dtype": expert_dtype,
    }

    def select(name: str, tensor: torch.Tensor) -> bool:
        return _layer_matrix(name, tensor) and not name.endswith("mlp.gate.weight") and "norm" not in name

    return _write(directory, config, quantization, _fp8_block_quantizer(block, select, scale_fmt, expert_dtype), seed)


def qwen3_moe_fp8(
    directory: Path,
    block: tuple[int, int] = (32, 32),
    seed: int = 0,
    vocab_size: int = 128,
    moe_intermediate_size: int = 32,
    scale_fmt: str = "float",
) -> QuantCheckpoint:
    """Qwen3-MoE-shaped, as the ``-FP8`` releases ship: attention and experts fp8 in blocks, the
    router (``mlp.gate``) and LM head bf16 and listed, layer by layer, in modules_to_not_convert.
    (``vocab_size`` 512 fits afdc's demo tokenizer, for serving.) An expert size that is no multiple of
    the block leaves its experts' last blocks partial. ``scale_fmt="ue8m0"``: power-of-two scales in
    float8_e8m0fnu."""
    layers = 2
    config = Qwen3MoeConfig(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=96, moe_intermediate_size=moe_intermediate_size,
        num_hidden_layers=layers,
        num_experts=4, num_experts_per_tok=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=256,
    )  # fmt: skip
    skipped = ["lm_head", *(f"model.layers.{i}.mlp.gate" for i in range(layers))]
    quantization = {
        "activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": list(block),
        "modules_to_not_convert": skipped, "scale_fmt": scale_fmt,
    }  # fmt: skip

    def select(name: str, tensor: torch.Tensor) -> bool:
        return _layer_matrix(name, tensor) and name.removesuffix(".weight") not in skipped

    return _write(directory, config, quantization, _fp8_block_quantizer(block, select, scale_fmt), seed)


def deepseek_v4_fp8(directory: Path, block: tuple[int, int] = (16, 16), seed: int = 0) -> QuantCheckpoint:
    """DeepSeek-V4-shaped (afdc's catalog entry: hash-routed then top-k MoE, HCA and CSA attention,
    2 residual streams), quantized as DeepSeek-V4-Flash ships: its linears fp8 in blocks with ue8m0
    scales, each routed expert's w1/w2/w3 fp4 (``expert_dtype: fp4``, MXFP4 bytes in int8 with e8m0
    scales), the routers, hyper-connections, ``wo_a`` (no ``nn.Linear``), norms and head unquantized,
    and the compressors' projections and the indexer's scorer bf16 (the modules transformers keeps
    out of fp8 for this release: ``_keep_in_fp32_modules``). Every dim of a quantized linear is a
    multiple of the block or smaller than it, which transformers' block inference (rows // scale
    rows) reads right."""
    kwargs = {**catalog.TINY_COMMON, **catalog.entry("deepseek_v4").config_kwargs}
    config = AutoConfig.for_model("deepseek_v4", **kwargs)
    quantization = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "scale_fmt": "ue8m0",
                    "weight_block_size": list(block), "expert_dtype": "fp4"}  # fmt: skip

    def select(name: str, tensor: torch.Tensor) -> bool:
        kept = ("ffn.gate.weight", "wo_a.weight", "indexer.weights_proj.weight")
        return _layer_matrix(name, tensor) and not name.endswith(kept) and ".compressor." not in name

    return _write(directory, config, quantization, _fp8_block_quantizer(block, select, "ue8m0", "fp4"), seed)


def gpt_oss_mxfp4(
    directory: Path, seed: int = 0, intermediate_size: int = 64, top_k: int = 2, hidden_size: int = 64
) -> QuantCheckpoint:
    """gpt-oss-shaped: experts in MXFP4 as gpt-oss ships them, everything else bf16.

    The model's ``experts.gate_up_proj`` is ``[E, in, out]``; the hub stores ``gate_up_proj_blocks``
    ``[E, out, in/32, 16]`` and ``gate_up_proj_scales`` ``[E, out, in/32]`` (groups along ``in``),
    and the same for ``down_proj``; expert biases stay bf16. ``intermediate_size`` is the experts'
    and ``hidden_size`` the model's, each a multiple of 32 (MXFP4 has no partial groups; gpt-oss's
    2880 is 90 of them).
    """
    config = GptOssConfig(
        vocab_size=128, hidden_size=hidden_size, intermediate_size=intermediate_size, num_hidden_layers=2,
        num_local_experts=4, num_experts_per_tok=top_k, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        sliding_window=8, max_position_embeddings=131072,
    )  # fmt: skip
    quantization = {
        "modules_to_not_convert": [
            "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head",
        ],
        "quant_method": "mxfp4",
    }  # fmt: skip

    def quantize(name: str, tensor: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor] | None:
        if not name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            return None
        blocks, scales = mxfp4(tensor.transpose(1, 2))
        dequantized = mxfp4_dequantized(blocks, scales).transpose(1, 2).contiguous()
        return {f"{name}_blocks": blocks, f"{name}_scales": scales}, dequantized

    return _write(directory, config, quantization, quantize, seed)


def _compressed_fp8(per_channel: bool, static_input: bool, ignore: list[str],
                    select: Callable[[str, torch.Tensor], bool]) -> tuple[dict, Quantizer]:
    """(quantization_config, quantizer) of compressed-tensors float8 as llm-compressor writes it:
    the selected linears fp8 with a ``weight_scale`` per channel ([out, 1]) or per tensor ([1]) in
    bf16; activations dynamic per token (FP8_DYNAMIC) or, ``static_input``, by a static per-tensor
    ``input_scale`` ([1], max |x| / 448 for |x| <= 8)."""
    strategy = "channel" if per_channel else "tensor"
    inputs = (
        {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "tensor", "dynamic": False}
        if static_input
        else {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "token", "dynamic": True}
    )
    quantization = {
        "quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
        "config_groups": {"group_0": {
            "targets": ["Linear"], "input_activations": inputs, "output_activations": None,
            "weights": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": strategy, "dynamic": False},
        }},
        "ignore": ignore, "kv_cache_scheme": None,
    }  # fmt: skip

    def quantize(name: str, tensor: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor] | None:
        if not select(name, tensor):
            return None
        q, scale = fp8_scaled(tensor, per_channel, torch.bfloat16)
        module = name.removesuffix(".weight")
        parts = {name: q, f"{name}_scale": scale}
        if static_input:
            parts[f"{module}.input_scale"] = torch.tensor([8.0 / FP8_MAX], dtype=torch.bfloat16)
        return parts, q.float() * scale.float()

    return quantization, quantize


def llama_compressed_fp8(
    directory: Path, per_channel: bool = True, static_input: bool = False, seed: int = 0, intermediate_size: int = 96
) -> QuantCheckpoint:
    """Llama-shaped in compressed-tensors float8 (:func:`_compressed_fp8`): every decoder linear,
    LM head ignored.

    The reference dequantizes the weights only: quantizing the activations (dynamic per token, or
    by the static scale) is the w8a8 kernel's part, not the checkpoint's.
    """
    config = LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=intermediate_size, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
    )  # fmt: skip

    def select(name: str, tensor: torch.Tensor) -> bool:
        return _layer_matrix(name, tensor) and "norm" not in name

    return _write(directory, config, *_compressed_fp8(per_channel, static_input, ["lm_head"], select), seed)


def qwen3_moe_compressed_fp8(
    directory: Path, seed: int = 0, moe_intermediate_size: int = 32, per_channel: bool = True,
    static_input: bool = False,
) -> QuantCheckpoint:
    """Qwen3-MoE-shaped as llm-compressor's FP8_DYNAMIC recipe ships MoE models (RedHat's
    ``-FP8-dynamic`` releases): attention and every routed expert, one by one, fp8 per channel with
    dynamic per-token activations; the routers (``re:.*mlp.gate$``) and LM head ignored."""
    config = _qwen3_moe_config(moe_intermediate_size)

    def select(name: str, tensor: torch.Tensor) -> bool:
        return _layer_matrix(name, tensor) and "norm" not in name and not name.endswith("mlp.gate.weight")

    quantization, quantize = _compressed_fp8(per_channel, static_input, ["lm_head", "re:.*mlp.gate$"], select)
    return _write(directory, config, quantization, quantize, seed)


def _deepseek_v3_config(intermediate_size: int, moe_intermediate_size: int) -> DeepseekV3Config:
    """One dense layer, one MoE layer (4 routed experts, a shared one), MLA attention; hidden size 64."""
    return DeepseekV3Config(
        vocab_size=128, hidden_size=64, intermediate_size=intermediate_size,
        moe_intermediate_size=moe_intermediate_size, num_hidden_layers=2, first_k_dense_replace=1,
        n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1, n_shared_experts=1,
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=32, qk_rope_head_dim=16,
        qk_nope_head_dim=16, v_head_dim=16, max_position_embeddings=256,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )  # fmt: skip


def _qwen3_moe_config(moe_intermediate_size: int, vocab_size: int = 128) -> Qwen3MoeConfig:
    """Two MoE layers of 4 experts, GQA 4/2; hidden size 64."""
    return Qwen3MoeConfig(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=96, moe_intermediate_size=moe_intermediate_size,
        num_hidden_layers=2, num_experts=4, num_experts_per_tok=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, max_position_embeddings=256,
    )  # fmt: skip


INT4_GROUP = 32
# Kimi-K2-Thinking's quantization_config: routed experts int4, attention, shared experts, dense MLPs
# and the LM head in bf16
KIMI_INT4_IGNORE = ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"]


def _int4_quantization(ignore: list[str]) -> dict:
    weights = {
        "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": INT4_GROUP,
        "dynamic": False, "actorder": None, "block_structure": None, "observer": "minmax", "observer_kwargs": {},
    }  # fmt: skip
    return {
        "quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None,
                                      "output_activations": None}},
        "ignore": ignore, "kv_cache_scheme": None,
    }  # fmt: skip


def _routed_expert(name: str, tensor: torch.Tensor) -> bool:
    return ".mlp.experts." in name and name.endswith(".weight")


def _int4_quantizer(quantization: dict, select: Callable[[str, torch.Tensor], bool] = _routed_expert) -> Quantizer:
    """Each selected linear (by default each routed expert's, the hub's per-expert tensors) through
    compressed-tensors' own observer math and pack-quantized compressor; the dequantized value by
    its own decompressor given the scales in float32 (exact: given them in bf16, as transformers'
    reading does, it rounds each weight to bf16)."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationScheme
    from compressed_tensors.quantization.utils import calculate_qparams

    group = quantization["config_groups"]["group_0"]
    scheme = QuantizationScheme(targets=group["targets"], weights=group["weights"])

    def quantize(name: str, tensor: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor] | None:
        if not select(name, tensor):
            return None
        grouped = tensor.unflatten(-1, (-1, INT4_GROUP))
        scale, zero = calculate_qparams(grouped.amin(dim=-1), grouped.amax(dim=-1), scheme.weights)
        parts = PackedQuantizationCompressor.compress({"weight": tensor, "weight_scale": scale.to(tensor.dtype),
                                                       "weight_zero_point": zero}, scheme)
        module = name.removesuffix(".weight")
        # the data tensor first (QuantCheckpoint.quantized names it)
        shipped = {f"{module}.{k}": v for k, v in sorted(parts.items(), key=lambda kv: kv[0] != "weight_packed")}
        back = PackedQuantizationCompressor.decompress({**parts, "weight_scale": scale.float()}, scheme)["weight"]
        return shipped, back.float()

    return quantize


def deepseek_v3_int4(directory: Path, seed: int = 0, moe_intermediate_size: int = 32) -> QuantCheckpoint:
    """DeepSeek-V3-shaped (one dense layer, one MoE layer of 4 routed experts and a shared one) as
    Kimi-K2-Thinking ships: the routed experts int4 pack-quantized, groups of 32, the rest bf16."""
    config = _deepseek_v3_config(96, moe_intermediate_size)
    quantization = _int4_quantization(KIMI_INT4_IGNORE)
    return _write(directory, config, quantization, _int4_quantizer(quantization), seed)


def qwen3_moe_int4(
    directory: Path, seed: int = 0, moe_intermediate_size: int = 64, vocab_size: int = 128
) -> QuantCheckpoint:
    """Qwen3-MoE-shaped, its routed experts int4 pack-quantized in groups of 32 (attention, router
    and LM head ignored, as compressed-tensors' W4A16 MoE recipes leave them)."""
    config = _qwen3_moe_config(moe_intermediate_size, vocab_size)
    quantization = _int4_quantization(["lm_head", "re:.*self_attn.*", "re:.*mlp\\.gate$"])
    return _write(directory, config, quantization, _int4_quantizer(quantization), seed)


def lfm2_int4(directory: Path, seed: int = 0, hidden_size: int = 64, intermediate_size: int = 96) -> QuantCheckpoint:
    """LFM2-shaped (a gated short-convolution layer, a stateful mixer, then an attention layer) as
    compressed-tensors' default W4A16 recipe writes it (``targets: Linear``, ``ignore: lm_head``):
    every linear of the decoder layers int4 pack-quantized in groups of 32, the mixer's ``in_proj``
    and ``out_proj`` too; its depthwise convolution, norms and embedding stay bf16."""
    kwargs = {**catalog.entry("lfm2").config_kwargs, "hidden_size": hidden_size, "intermediate_size": intermediate_size}
    quantization = _int4_quantization(["lm_head"])
    return _write(directory, AutoConfig.for_model("lfm2", **kwargs), quantization,
                  _int4_quantizer(quantization, _layer_matrix), seed)


def _nvfp4_quantizer(select: Callable[[str, torch.Tensor], bool]) -> Quantizer:
    from vllm.model_executor.layers.quantization.utils.nvfp4_emulation_utils import dequantize_to_dtype

    def quantize(name: str, tensor: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor] | None:
        if not select(name, tensor):
            return None
        packed, scale, global_scale = nvfp4(tensor)
        parts = {name: packed, f"{name}_scale": scale, f"{name}_scale_2": global_scale}
        return parts, dequantize_to_dtype(packed, scale, global_scale, torch.float32, NV_GROUP, swizzle=False)

    return quantize


def _modelopt_nvfp4(exclude: list[str]) -> dict:
    return {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": NV_GROUP, "kv_cache_quant_algo": None,
            "exclude_modules": exclude, "producer": {"name": "modelopt"}}


def deepseek_v3_nvfp4(directory: Path, seed: int = 0, moe_intermediate_size: int = 32) -> QuantCheckpoint:
    """DeepSeek-V3-shaped as NVIDIA's DeepSeek-R1/V3 FP4 releases ship: every linear of the
    decoder layers NVFP4 (dense MLP, shared and routed experts) except attention; router, norms,
    embedding and LM head unquantized. The dense MLP's 128 features split over 4 FFN ranks on
    16-value group boundaries."""
    config = _deepseek_v3_config(128, moe_intermediate_size)

    def select(name: str, tensor: torch.Tensor) -> bool:
        return _layer_matrix(name, tensor) and ".mlp." in name and not name.endswith("mlp.gate.weight")

    return _write(directory, config, _modelopt_nvfp4(["lm_head", "model.layers.*.self_attn*"]),
                  _nvfp4_quantizer(select), seed)


def qwen3_moe_nvfp4(directory: Path, seed: int = 0, moe_intermediate_size: int = 64) -> QuantCheckpoint:
    """Qwen3-MoE-shaped in NVFP4 with its attention too (a linear on the attention side); router
    and LM head excluded."""
    config = _qwen3_moe_config(moe_intermediate_size)

    def select(name: str, tensor: torch.Tensor) -> bool:
        return _layer_matrix(name, tensor) and "norm" not in name and not name.endswith("mlp.gate.weight")

    return _write(directory, config, _modelopt_nvfp4(["lm_head", "*.mlp.gate"]), _nvfp4_quantizer(select), seed)


BUILDERS: dict[str, Callable[[Path], QuantCheckpoint]] = {
    "deepseek_v3_fp8": deepseek_v3_fp8,
    "deepseek_v3_fp8_ue8m0": lambda directory: deepseek_v3_fp8(directory, scale_fmt="ue8m0"),
    "deepseek_v4_fp8": deepseek_v4_fp8,
    "qwen3_moe_fp8": qwen3_moe_fp8,
    "gpt_oss_mxfp4": gpt_oss_mxfp4,
    "llama_fp8_channel": llama_compressed_fp8,
    "qwen3_moe_fp8_channel": qwen3_moe_compressed_fp8,
    "deepseek_v3_int4": deepseek_v3_int4,
    "qwen3_moe_int4": qwen3_moe_int4,
    "deepseek_v3_nvfp4": deepseek_v3_nvfp4,
    "qwen3_moe_nvfp4": qwen3_moe_nvfp4,
    "llama_fp8_tensor": lambda directory: llama_compressed_fp8(directory, per_channel=False, static_input=True),
}
