"""A checkpoint's quantization, recognised from its config and safetensors headers (afdc.quant.scheme)."""

from __future__ import annotations

import json
import math
from fnmatch import fnmatch
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, LlamaConfig

from afdc.artifact.checkpoint import Checkpoint
from afdc.quant.scheme import QuantFormat, QuantizationError, meta_model, recognise, scheme_from_config
from tests.quant_checkpoints import BUILDERS, QuantCheckpoint, deepseek_v3_fp8

CONFIGS = Path("/work/shared/configs")

# What each builder's checkpoint must be recognised as: method, formats, block of a 2-D weight.
EXPECTED = {
    "deepseek_v3_fp8": ("fp8", {QuantFormat.FP8_BLOCK}, (16, 16)),
    "deepseek_v3_fp8_ue8m0": ("fp8", {QuantFormat.FP8_BLOCK}, (16, 16)),
    "deepseek_v4_fp8": ("fp8", {QuantFormat.FP8_BLOCK, QuantFormat.MXFP4}, (16, 16)),
    "qwen3_moe_fp8": ("fp8", {QuantFormat.FP8_BLOCK}, (32, 32)),
    "gpt_oss_mxfp4": ("mxfp4", {QuantFormat.MXFP4}, None),
    "llama_fp8_channel": ("compressed-tensors", {QuantFormat.FP8_CHANNEL}, (1, -1)),
    "qwen3_moe_fp8_channel": ("compressed-tensors", {QuantFormat.FP8_CHANNEL}, (1, -1)),
    "llama_fp8_tensor": ("compressed-tensors", {QuantFormat.FP8_TENSOR}, (-1, -1)),
    "deepseek_v3_int4": ("compressed-tensors", {QuantFormat.INT4_GROUP}, (1, 32)),
    "qwen3_moe_int4": ("compressed-tensors", {QuantFormat.INT4_GROUP}, (1, 32)),
    "deepseek_v3_nvfp4": ("modelopt", {QuantFormat.NVFP4}, (1, 16)),
    "qwen3_moe_nvfp4": ("modelopt", {QuantFormat.NVFP4}, (1, 16)),
}


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict[str, QuantCheckpoint]:
    root = tmp_path_factory.mktemp("quant")
    return {name: build(root / name) for name, build in BUILDERS.items()}


def _recognise(directory: Path):
    return recognise(AutoConfig.from_pretrained(directory), Checkpoint.discover(directory).tensors)


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_each_shipping_format_is_recognised_tensor_by_tensor(built, name):
    checkpoint = built[name]
    scheme = _recognise(checkpoint.directory)
    method, formats, block = EXPECTED[name]
    assert scheme.method == method
    assert set(scheme.formats()) == formats
    assert sorted(w.name for w in scheme.weights) == sorted(checkpoint.quantized)
    assert not {w.parameter for w in scheme.weights} & set(checkpoint.kept)
    stored = Checkpoint.discover(checkpoint.directory).tensors
    for weight in scheme.weights:
        assert weight.data.dtype == stored[weight.name].dtype
        assert weight.scale.shape == tuple(stored[weight.scale.name].shape)
        if block is not None and len(weight.shape) == 2 and weight.format is not QuantFormat.MXFP4:
            assert weight.block == tuple(size if step == -1 else step for step, size in zip(block, weight.shape))
    # every scale the checkpoint holds belongs to a weight, and nothing else is taken for one
    scales = {n for n in stored if n.endswith(("_scale_inv", "weight_scale", "_scales", "input_scale", "_scale_2"))}
    assert scheme.scale_names() == scales
    # the parameters are the reference model's, with their shapes
    shapes = {n: tuple(p.shape) for n, p in checkpoint.reference.named_parameters()}
    for parameter in scheme.parameters:
        assert shapes[parameter.name] == parameter.shape
        assert len(parameter.block) == len(parameter.shape)


def test_fp8_experts_one_by_one_make_the_fused_parameter(built):
    scheme = _recognise(built["qwen3_moe_fp8"].directory)
    gate_up = scheme.parameter("model.layers.1.mlp.experts.gate_up_proj")
    assert gate_up.shape == (4, 64, 64) and gate_up.block == (1, 32, 32) and gate_up.scale_shape == (4, 2, 2)
    assert len(gate_up.sources) == 8  # gate and up of 4 experts
    assert {w.parameter for w in scheme.weights if w.name.startswith("model.layers.1.mlp.experts.0.")} == {
        "model.layers.1.mlp.experts.gate_up_proj",
        "model.layers.1.mlp.experts.down_proj",
    }


def test_mxfp4_groups_run_along_the_input_dim_of_transposed_experts(built):
    """gpt-oss holds experts as [E, in, out]; the hub groups 32 values along `in` (a square
    down_proj cannot tell its orientation by its shape)."""
    scheme = _recognise(built["gpt_oss_mxfp4"].directory)
    for name in ("model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj"):
        assert scheme.parameter(name).block == (1, 32, 1)
    blocks = scheme.weight("model.layers.0.mlp.experts.gate_up_proj_blocks")
    assert blocks.data.shape == (4, 128, 2, 16) and blocks.shape == (4, 128, 64)
    assert blocks.scale.name == "model.layers.0.mlp.experts.gate_up_proj_scales"


def test_static_input_scales_come_with_their_weights(built):
    scheme = _recognise(built["llama_fp8_tensor"].directory)
    assert scheme.activation_scheme == "static"
    for weight in scheme.weights:
        assert weight.input_scale.name == weight.name.removesuffix("weight") + "input_scale"
    assert all(p.static_input_scale for p in scheme.parameters)
    assert _recognise(built["llama_fp8_channel"].directory).activation_scheme == "dynamic"


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_a_config_alone_gives_the_same_parameters_as_its_checkpoint(built, name):
    directory = built[name].directory
    from_checkpoint = _recognise(directory)
    from_config = scheme_from_config(AutoConfig.from_pretrained(directory))
    assert {(p.name, p.format, p.shape, p.block, p.matrices) for p in from_config.parameters} == {
        (p.name, p.format, p.shape, p.block, p.matrices) for p in from_checkpoint.parameters
    }
    assert all(p.sources == () for p in from_config.parameters)


def test_modules_to_not_convert_are_honoured(built):
    directory = built["qwen3_moe_fp8"].directory
    scheme = _recognise(directory)
    assert "model.layers.0.mlp.gate" in scheme.not_converted
    names = {p.name for p in scheme.parameters}
    assert "lm_head.weight" not in names and not any(".mlp.gate." in n for n in names)
    assert "model.layers.0.self_attn.q_proj.weight" in names

    # a module the config keeps in bf16 that the checkpoint stores in fp8 is an error naming it
    config = AutoConfig.from_pretrained(directory)
    config.quantization_config["modules_to_not_convert"].append("model.layers.0.self_attn.q_proj")
    with pytest.raises(QuantizationError, match=r"model\.layers\.0\.self_attn\.q_proj\.weight .*keeps its module"):
        recognise(config, Checkpoint.discover(directory).tensors)


def test_a_partial_edge_block_has_a_scale_of_its_own(tmp_path):
    """kv_a_proj_with_mqa has 48 rows: two 32-row blocks, the second half full (576 rows at 128 in
    DeepSeek-V3)."""
    checkpoint = deepseek_v3_fp8(tmp_path / "ds32", block=(32, 32))
    weight = _recognise(checkpoint.directory).weight("model.layers.1.self_attn.kv_a_proj_with_mqa.weight")
    assert weight.shape == (48, 64) and weight.scale.shape == (2, 2)


def _rewrite(directory: Path, name: str, tensor: torch.Tensor | None) -> None:
    path = directory / "model.safetensors"
    tensors = load_file(path)
    if tensor is None:
        del tensors[name]
    else:
        tensors[name] = tensor
    save_file(tensors, path, metadata={"format": "pt"})


@pytest.mark.parametrize(
    "name, scale",
    [
        ("deepseek_v3_fp8", "model.layers.1.self_attn.o_proj.weight_scale_inv"),
        ("gpt_oss_mxfp4", "model.layers.1.mlp.experts.down_proj_scales"),
        ("llama_fp8_channel", "model.layers.0.self_attn.k_proj.weight_scale"),
    ],
)
def test_a_scale_that_does_not_fit_its_weight_is_refused_by_name(tmp_path, name, scale):
    directory = BUILDERS[name](tmp_path / name).directory
    good = load_file(directory / "model.safetensors")[scale]
    _rewrite(directory, scale, torch.cat([good, good[:1]]))  # one row of blocks too many
    with pytest.raises(QuantizationError, match=rf"{scale.replace('.', r'.')} has shape"):
        _recognise(directory)
    _rewrite(directory, scale, None)
    with pytest.raises(QuantizationError, match=rf"no {scale.replace('.', r'.')}"):
        _recognise(directory)


def test_float8_tensors_without_a_quantization_config_are_refused(built, tmp_path):
    source = built["deepseek_v3_fp8"].directory
    config = json.loads((source / "config.json").read_text())
    del config["quantization_config"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(QuantizationError, match="no quantization_config"):
        recognise(AutoConfig.from_pretrained(tmp_path), Checkpoint.discover(source).tensors)


UNSUPPORTED = {
    # as AutoAWQ and GPTQModel write them
    "awq": {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"},
    "gptq": {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True,
             "checkpoint_format": "gptq"},
    "int-quantized": {  # llm-compressor's W8A8 int8: per-channel weights, dynamic per-token activations
        "quant_method": "compressed-tensors",
        "format": "int-quantized",
        "config_groups": {"group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel", "dynamic": False},
            "input_activations": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token",
                                  "dynamic": True}}},
    },
    "nvfp4-pack-quantized": {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized",
                             "config_groups": {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 4}}}},
    "bitsandbytes": {"quant_method": "bitsandbytes", "load_in_4bit": True},
    "fbgemm_fp8": {"quant_method": "fbgemm_fp8"},
    "pack-quantized": {  # asymmetric: zero points
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
            "num_bits": 4, "type": "int", "symmetric": False, "strategy": "group", "group_size": 128}}},
    },
    "8-bit int": {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "int"}}},
    },
    "e5m2": {"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [128, 128]},
    "FP8": {"quant_method": "modelopt", "quant_algo": "FP8"},  # ModelOpt's other algorithms
    "static": {"quant_method": "fp8", "activation_scheme": "static", "weight_block_size": [128, 128]},
    "scale_fmt 'ue4m3'": {"quant_method": "fp8", "scale_fmt": "ue4m3", "weight_block_size": [128, 128]},
    # fp4 experts' exponents are e8m0: with float scales they would be no format afdc knows
    "expert_dtype 'fp4'": {"quant_method": "fp8", "expert_dtype": "fp4", "weight_block_size": [128, 128]},
}


@pytest.mark.parametrize("what", sorted(UNSUPPORTED))
def test_other_schemes_are_refused_by_name_listing_the_supported(what):
    config = LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4)
    config.quantization_config = UNSUPPORTED[what]
    with pytest.raises(QuantizationError) as refused:
        scheme_from_config(config)
    message = str(refused.value)
    assert what in message and "not supported" in message
    instead = {"awq": "compressed-tensors W4A16", "gptq": "compressed-tensors W4A16", "int-quantized": "FP8_DYNAMIC"}
    assert instead.get(what, "") in message  # what to run instead, for the formats most asked for
    for supported in ("fp8 (quant_method 'fp8'", "compressed-tensors float8", "compressed-tensors int4", "mxfp4",
                      "modelopt NVFP4"):
        assert supported in message
    with pytest.raises(QuantizationError, match="not supported"):
        recognise(config, {})


def _shipped_configs() -> list[Path]:
    # with the benchmarks' configs (DeepSeek-V4-Flash's as shipped: fp8 blocks with ue8m0 scales)
    found = (*CONFIGS.glob("*.json"), *(Path(__file__).parents[1] / "benchmarks" / "configs").glob("*.json"))
    return sorted((p for p in found if "quantization_config" in json.loads(p.read_text())), key=lambda p: p.stem)


def test_the_shipped_configs_include_quantized_ones():
    assert len(_shipped_configs()) >= 3


@pytest.mark.parametrize("path", _shipped_configs(), ids=lambda p: p.stem)
def test_each_shipped_quantized_config_gives_its_scheme_without_weights(path):
    config = AutoConfig.from_pretrained(path)
    quantization = json.loads(path.read_text())["quantization_config"]
    model = meta_model(config)
    scheme = scheme_from_config(config, model)
    assert scheme.method == quantization["quant_method"] and scheme.parameters
    ue8m0 = quantization.get("scale_fmt") == "ue8m0"
    # V4's config class moves its top-level expert_dtype into the quantization_config
    fp4_experts = dict(config.quantization_config).get("expert_dtype") == "fp4"
    assert scheme.fp8_scale_dtype == (torch.float8_e8m0fnu if ue8m0 else torch.float32)
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    skipped = quantization.get("modules_to_not_convert") or ["lm_head"]
    for parameter in scheme.parameters:
        assert shapes[parameter.name] == parameter.shape
        assert parameter.scale_shape == tuple(math.ceil(s / b) for s, b in zip(parameter.shape, parameter.block))
        module = parameter.name.rpartition(".")[0]
        assert not any(fnmatch(module, s) or fnmatch(module, s + ".*") for s in skipped), parameter.name
        if fp4_experts and ".experts." in parameter.name:  # DeepSeek-V4's fp4 experts are MXFP4
            assert parameter.format is QuantFormat.MXFP4 and parameter.block[-2:] == (1, 32)
        elif "weight_block_size" in quantization:
            assert parameter.format is QuantFormat.FP8_BLOCK
            assert sorted(parameter.block[-2:]) == sorted(quantization["weight_block_size"])
    # every matrix of every decoder layer's experts is quantized
    experts = {n for n in shapes if ".experts." in n and len(shapes[n]) == 3}
    assert experts <= {p.name for p in scheme.parameters}


def test_the_deepseek_v4_flash_config_as_shipped_is_fp8_with_ue8m0_scales():
    assert "deepseek-v4-flash" in {p.stem for p in _shipped_configs()}


def test_ue8m0_scales_must_be_stored_as_float8_e8m0fnu(built, tmp_path):
    """A checkpoint whose scales are not what its scale_fmt says is refused naming the scale and the
    rule: float32 scales under ue8m0, or e8m0 ones under the default 'float'."""
    for source, config_fmt, dtype in (("deepseek_v3_fp8", "ue8m0", "float32"),
                                      ("deepseek_v3_fp8_ue8m0", "float", "float8_e8m0fnu")):
        config = AutoConfig.from_pretrained(built[source].directory)
        config.quantization_config["scale_fmt"] = config_fmt
        with pytest.raises(QuantizationError, match=rf"weight_scale_inv has shape .* dtype torch\.{dtype}, "
                                                    r".*scale_fmt says"):
            recognise(config, Checkpoint.discover(built[source].directory).tensors)


def test_an_unquantized_config_has_no_scheme():
    config = LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4)
    assert scheme_from_config(config) is None
