"""Quantized checkpoints compiled, sharded with their scales, loaded and run (CPU: the ops' references).

Each test builds a tiny model in a shipping format (tests/quant_checkpoints.py quantizes it as the
format defines) and compares afdc's run with the same model whose weights are dequantized by that
definition: logits within bf16 tolerance, greedy tokens equal.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from quant_checkpoints import (
    deepseek_v3_fp8,
    deepseek_v3_int4,
    deepseek_v3_nvfp4,
    deepseek_v4_fp8,
    gpt_oss_mxfp4,
    lfm2_int4,
    llama_compressed_fp8,
    qwen3_moe_compressed_fp8,
    qwen3_moe_fp8,
    qwen3_moe_int4,
    qwen3_moe_nvfp4,
)
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM, CompressedTensorsConfig

import afdc
from afdc.artifact.manifest import FORMAT_VERSION, read_manifest
from afdc.cli import main
from afdc.codegen.fp8_linear import fp8_linear_reference
from afdc.mixer_site import QuantizedLinear
from afdc.quant.scheme import scheme_from_config
from afdc.quant.stored import QuantizedTensors
from afdc.runtime import kv_cache
from afdc.runtime.quantized_linears import with_quantized_linears
from tests.tiers import sweep

NEW_TOKENS = 5
_DEQUANTIZED = CompressedTensorsConfig(run_compressed=False)  # transformers reads compressed-tensors dequantized


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(3, 128, (2, 7), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    return ids, mask


def _check_runs(dm, reference) -> None:
    ids, mask = _batch()
    got, want = _logits(dm), _logits(reference)
    # bf16 activations against a float32 reference of the same dequantized weights
    torch.testing.assert_close(got, want, atol=0.02 * want.abs().max().item(), rtol=0)
    kw = dict(attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
    assert torch.equal(dm.generate(ids, **kw), reference.generate(ids, **kw))


def _logits(model) -> torch.Tensor:
    ids, mask = _batch()
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    return model(input_ids=ids, attention_mask=mask, position_ids=pos).logits.float()[mask.bool()]


def _decoded_logits(dm, prefill: int = 5) -> torch.Tensor:
    """:func:`_logits` of ``dm`` run as decode does: the first ``prefill`` positions at once, then
    one token a step against the cache those left (the one attention rank's, as ``dm.generate``
    keeps it)."""
    ids, mask = _batch()
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    caches = {(0, 0): kv_cache.KVCache()}
    with torch.no_grad():
        steps = [dm._run(ids[:, :prefill], mask[:, :prefill], pos[:, :prefill], caches).logits]
        steps += [dm._run(ids[:, t : t + 1], mask[:, : t + 1], pos[:, t : t + 1], caches).logits
                  for t in range(prefill, ids.shape[1])]
    return torch.cat(steps, dim=1).float()[mask.bool()]


def _distance(got: torch.Tensor, want: torch.Tensor) -> float:
    """The largest difference, relative to the largest logit."""
    return (got - want).abs().max().item() / want.abs().max().item()


def _check_against_transformers(
    dm, directory: Path, greedy: bool = True, dtype: torch.dtype = torch.bfloat16, logits=_logits,
    new_tokens: int = NEW_TOKENS, **loading
) -> None:
    """``dm`` (compiled in ``dtype``) against transformers' own reading of the quantized checkpoint
    (``loading``: the ``from_pretrained`` options it needs to dequantize): in bf16, ``dm``'s
    ``logits`` (one prefill, or :func:`_decoded_logits`) no further from the float32 reading than
    1.5x the bf16 monolith's own distance from it; in float32, within 1e-5; and (``greedy``) the
    same ``new_tokens`` greedy tokens. Generating in Triton's interpreter is most of a test's time,
    so cases of one format share it out."""
    fp32 = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, **loading).eval()
    want, got = _logits(fp32), logits(dm)
    if dtype == torch.float32:
        assert _distance(got, want) < 1e-5, f"afdc's logits are {_distance(got, want):.2e} from transformers' reading"
    else:
        bf16 = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.bfloat16, **loading).eval()
        monolith = _distance(_logits(bf16), want)
        assert _distance(got, want) <= 1.5 * monolith, (
            f"afdc's logits are {_distance(got, want):.4f} of the largest from transformers' reading, "
            f"the bf16 monolith's {monolith:.4f}"
        )
    if greedy:
        ids, mask = _batch()
        kw = dict(attention_mask=mask, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
        assert torch.equal(dm.generate(ids, **kw), fp32.generate(ids, **kw))


def _ffn_bytes(artifact: Path) -> int:
    return sum(p.stat().st_size for p in (artifact / "weights").glob("ffn-*.safetensors"))


def _stored(artifact: Path, rank: int) -> dict[str, tuple[str, list[int]]]:
    with safe_open(artifact / "weights" / f"ffn-{rank}.safetensors", "pt") as f:
        return {k: (f.get_slice(k).get_dtype(), f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118 (safe_open handles are not iterable)


def test_deepseek_fp8_blocks_at_2a4f_ep_and_tp_half_the_bf16_bytes(tmp_path):
    """DeepSeek-V3-shaped, fp8 in 8x8 blocks: the dense layer split by TP on block boundaries, the
    routed experts by EP with their scales; the FFN rank files hold fp8 bytes and float32 scales."""
    ck = deepseek_v3_fp8(tmp_path / "ds", block=(8, 8))
    art = tmp_path / "art"
    manifest = afdc.compile_model(str(ck.directory), "2A4F", art, progress=False)
    assert {lay.ffn_split for lay in manifest.layers} == {"tp", "ep"}
    assert manifest.quant.method == "fp8"
    # its config counts an MTP layer (DeepSeek-V3's default): no drafter compiled, the manifest says why
    assert manifest.drafter is None and "quantized (fp8)" in manifest.no_drafter, manifest.no_drafter
    scale = manifest.quant.tensors["model.layers.1.mlp.experts.gate_up_proj_scale"]
    assert (scale.role, scale.format, scale.block, scale.dtype) == ("scale", "fp8-block", [1, 8, 8], "float32")
    held = _stored(art, 1)
    assert held["model.layers.1.mlp.experts.gate_up_proj"] == ("F8_E4M3", [1, 64, 64])  # 1 of 4 experts
    assert held["model.layers.1.mlp.experts.gate_up_proj_scale"] == ("F32", [1, 8, 8])
    assert held["model.layers.0.mlp.down_proj.weight"] == ("F8_E4M3", [64, 24])  # 96 / 4 in-features, 3 blocks
    assert held["model.layers.0.mlp.down_proj.weight_scale"] == ("F32", [8, 3])
    _check_runs(afdc.load_deployment(art), ck.reference)

    plain = afdc.compile_model(str(tmp_path / "ds-bf16"), "2A4F", tmp_path / "bf16", progress=False)
    assert plain.quant is None
    ratio = _ffn_bytes(art) / _ffn_bytes(tmp_path / "bf16")
    print(f"FFN rank files, fp8 8x8 blocks / bf16: {ratio:.3f}")
    assert 0.5 < ratio < 0.65  # fp8 halves the weights; 8x8 blocks add 1/16 in float32 scales


def test_qwen3_moe_fp8_over_shm_processes(tmp_path):
    """Qwen3-MoE-shaped with its router and LM head bf16 (modules_to_not_convert): 1A2F in-process,
    then the FFN ranks as processes over shm, which load their fp8 rank files themselves."""
    ck = qwen3_moe_fp8(tmp_path / "qwen")
    afdc.compile_model(str(ck.directory), "1A2F", tmp_path / "art", progress=False)
    assert _stored(tmp_path / "art", 0)["model.layers.0.mlp.gate.weight"][0] == "BF16"
    dm = afdc.load_deployment(tmp_path / "art", connector="shm")
    _check_runs(dm, ck.reference)
    with dm.launch(timeout=60):
        _check_runs(dm, ck.reference)


@pytest.mark.parametrize(
    ("hidden", "inter", "plan"),
    [(64, 128, "1A1F"), sweep(64, 128, "1A2F"), sweep(64, 128, "2A2F"), (96, 32, "1A2F"), (96, 96, "2A4F"),
     (96, 160, "2A2F")],
)
def test_gpt_oss_mxfp4_experts_against_transformers(tmp_path, hidden, inter, plan):
    """Expert sizes larger than, smaller than and equal to the hidden size, each expert's blocks
    stored output-major as shipped, against transformers' own reading of the checkpoint. Hidden
    size 96 and experts of 160 hold odd numbers of 32-value groups (3, 5), as gpt-oss's 2880 holds
    90: the kernels' K tiles end part-way through a tile."""
    ck = gpt_oss_mxfp4(tmp_path / "oss", intermediate_size=inter, hidden_size=hidden)
    art = tmp_path / "art"
    afdc.compile_model(str(ck.directory), plan, art, progress=False)
    held = _stored(art, 0)
    experts = 4 // int(plan[-2])
    assert held["model.layers.0.mlp.experts.gate_up_proj_blocks"] == ("U8", [experts, 2 * inter, hidden // 32, 16])
    assert held["model.layers.0.mlp.experts.gate_up_proj_scales"] == ("U8", [experts, 2 * inter, hidden // 32])
    assert held["model.layers.0.mlp.experts.down_proj_blocks"] == ("U8", [experts, hidden, inter // 32, 16])
    assert "model.layers.0.mlp.experts.gate_up_proj" not in held
    _check_against_transformers(afdc.load_deployment(art), ck.directory, greedy=plan == "1A1F")


@pytest.mark.parametrize("inter", [32, 64, 96], ids=["smaller", "equal", "larger"])
def test_qwen3_moe_fp8_expert_sizes_against_transformers(tmp_path, inter):
    """fp8 blocks on experts smaller than, as large as and larger than the hidden size (64), compiled
    in float32: what afdc reads from the checkpoint is what transformers reads, to float32 rounding.
    (In bf16 the Triton kernels round differently from the monolith, and a near tie in a top-k
    routing then sends a token elsewhere: the logits' largest difference says little there.)"""
    ck = qwen3_moe_fp8(tmp_path / "qwen", moe_intermediate_size=inter)
    afdc.compile_model(str(ck.directory), afdc.Plan.parse("1A2F", dtype="fp32"), tmp_path / "art", progress=False)
    scale = _stored(tmp_path / "art", 1)["model.layers.0.mlp.experts.gate_up_proj_scale"]
    assert scale == ("F32", [2, 2 * inter // 32, 2])
    dm = afdc.load_deployment(tmp_path / "art")
    _check_against_transformers(dm, ck.directory, greedy=inter == 96, dtype=torch.float32)


@pytest.mark.parametrize("scale_fmt", ["float", "ue8m0"])
def test_deepseek_fp8_ragged_blocks(tmp_path, scale_fmt):
    """32x32 blocks: kv_a_proj_with_mqa's 48 rows end in a 16-row block. transformers infers the
    block from the scale grid (48 rows in 2 scale rows: 24) and misreads it, so this is checked
    against the format's definition, in float32; with float32 scales and with V4's power-of-two ones."""
    ck = deepseek_v3_fp8(tmp_path / "ds", block=(32, 32), scale_fmt=scale_fmt)
    afdc.compile_model(str(ck.directory), afdc.Plan.parse("1A1F", dtype="fp32"), tmp_path / "art", progress=False)
    assert _distance(_logits(afdc.load_deployment(tmp_path / "art")), _logits(ck.reference)) < 1e-5


def test_deepseek_fp8_ue8m0_scales_against_transformers(tmp_path):
    """DeepSeek-V4-Flash's quantization: scale_fmt ue8m0 (each block's scale a power of two stored as
    float8_e8m0fnu) and expert_dtype fp4 (routed experts as MXFP4's bytes in int8, e8m0 exponents).
    The artifact keeps those bytes as stored, split with their blocks (the dense MLP by TP, the
    experts by EP), and the kernels widen the scales to float32, exactly. On a DeepSeek-V3-shaped
    model at 1A2F in bf16 the logits of a left-padded batch are as close to transformers' own reading
    of the checkpoint as its bf16 monolith's, with the same greedy tokens; ue8m0 fp8 experts
    (Qwen3-MoE, larger than the hidden size) in float32 within 1e-5."""
    ck = deepseek_v3_fp8(tmp_path / "ds", scale_fmt="ue8m0", expert_dtype="fp4")
    art = tmp_path / "art"
    manifest = afdc.compile_model(str(ck.directory), "1A2F", art, progress=False)
    assert manifest.quant.tensors["model.layers.1.mlp.experts.gate_up_proj_scales"].dtype == "float8_e8m0fnu"
    held = _stored(art, 1)
    assert held["model.layers.1.mlp.experts.gate_up_proj_blocks"] == ("I8", [2, 64, 32])  # 2 of 4 experts
    assert held["model.layers.1.mlp.experts.down_proj_scales"] == ("F8_E8M0", [2, 64, 1])  # one per 32 inputs
    assert held["model.layers.0.mlp.down_proj.weight_scale"] == ("F8_E8M0", [4, 3])  # 48 of 96 in-features
    _check_against_transformers(afdc.load_deployment(art), ck.directory)

    ck = qwen3_moe_fp8(tmp_path / "qwen", moe_intermediate_size=96, scale_fmt="ue8m0")
    afdc.compile_model(str(ck.directory), afdc.Plan.parse("1A1F", dtype="fp32"), tmp_path / "qwen-art",
                       progress=False)
    assert _stored(tmp_path / "qwen-art", 0)["model.layers.0.mlp.experts.down_proj_scale"] == ("F8_E8M0", [4, 2, 3])
    _check_against_transformers(afdc.load_deployment(tmp_path / "qwen-art"), ck.directory, greedy=False,
                                dtype=torch.float32)


def test_llama_compressed_tensors_per_channel_at_2a4f(tmp_path):
    """Per-channel scales split with their channels (gate/up column-parallel), whole where the
    split runs along K (down row-parallel)."""
    ck = llama_compressed_fp8(tmp_path / "llama")
    art = tmp_path / "art"
    manifest = afdc.compile_model(str(ck.directory), "2A4F", art, progress=False)
    assert {lay.ffn_split for lay in manifest.layers} == {"tp"}
    held = _stored(art, 2)
    assert held["model.layers.0.mlp.gate_proj.weight_scale"] == ("BF16", [24, 1])
    assert held["model.layers.0.mlp.down_proj.weight_scale"] == ("BF16", [64, 1])
    dm = afdc.load_deployment(art)
    _check_runs(dm, ck.reference)
    # the MLP larger than the hidden size; the library's own reading (compressed_tensors, through transformers)
    _check_against_transformers(dm, ck.directory, greedy=False, quantization_config=_DEQUANTIZED)


@pytest.mark.parametrize("inter", [32, 64], ids=["smaller", "equal"])
def test_llama_compressed_tensors_mlp_sizes_against_the_library(tmp_path, inter):
    ck = llama_compressed_fp8(tmp_path / "llama", per_channel=inter == 32, static_input=inter == 64,
                              intermediate_size=inter)
    afdc.compile_model(str(ck.directory), "1A1F", tmp_path / "art", progress=False)
    _check_against_transformers(afdc.load_deployment(tmp_path / "art"), ck.directory, greedy=False,
                                quantization_config=_DEQUANTIZED)


@pytest.mark.parametrize(
    ("inter", "plan", "per_channel"),
    [(32, "1A2F", True), (96, "2A4F", True), (64, "1A2F-tp", False)],
    ids=["smaller-1A2F", "larger-2A4F", "equal-per-tensor-static-1A2F-tp"],
)
def test_qwen3_moe_compressed_tensors_fp8_against_the_library(tmp_path, inter, plan, per_channel):
    """llm-compressor's FP8_DYNAMIC MoE (RedHat's ``-FP8-dynamic`` releases): attention and each routed
    expert fp8 with a bf16 scale per channel, activations dynamic per token (run weight-only, as
    transformers reads it); and per tensor with static input scales. Experts smaller than, as large
    as and larger than the hidden size (64; larger failed before: down's per-channel scales were
    read in blocks of H), by EP and by TP; logits against compressed-tensors' own reading."""
    ck = qwen3_moe_compressed_fp8(tmp_path / "ck", moe_intermediate_size=inter, per_channel=per_channel,
                                  static_input=not per_channel)
    plan, _, parallel = plan.partition("-")
    art = tmp_path / "art"
    afdc.compile_model(str(ck.directory), afdc.Plan.parse(plan, ffn_parallel=parallel or "auto"), art, progress=False)
    ranks = int(plan[-2])
    experts, cols = (4, inter // ranks) if parallel == "tp" else (4 // ranks, inter)
    held = _stored(art, ranks - 1)
    assert held["model.layers.0.mlp.experts.gate_up_proj"] == ("F8_E4M3", [experts, 2 * cols, 64])
    assert held["model.layers.0.mlp.experts.down_proj"] == ("F8_E4M3", [experts, 64, cols])
    rows = (2 * cols, 64) if per_channel else (2, 1)  # a scale per row, or per matrix (gate's, up's; down's)
    assert held["model.layers.0.mlp.experts.gate_up_proj_scale"] == ("BF16", [experts, rows[0], 1])
    assert held["model.layers.0.mlp.experts.down_proj_scale"] == ("BF16", [experts, rows[1], 1])
    _check_against_transformers(afdc.load_deployment(art), ck.directory, greedy=plan == "1A2F" and not parallel,
                                quantization_config=_DEQUANTIZED)


@pytest.mark.parametrize(
    ("build", "inter", "plan", "attention_tp"),
    [(deepseek_v3_int4, 32, "1A2F", 1), (deepseek_v3_int4, 96, "2A4F", 1), (qwen3_moe_int4, 64, "1A2F-tp", 1),
     (qwen3_moe_int4, 64, "2A4F", 2)],
    ids=["deepseek-smaller-1A2F", "deepseek-larger-2A4F", "qwen-equal-1A2F-tp", "qwen-equal-2A4F-attn-tp2"],
)
def test_int4_pack_quantized_experts_against_transformers(tmp_path, build, inter, plan, attention_tp):
    """Kimi-K2-Thinking's format (compressed-tensors pack-quantized int4, groups of 32, written by
    the library's compressor) on routed experts smaller than, as large as and larger than the hidden
    size (64): the FFN rank files hold the packed words and bf16 group scales, whole experts under
    EP, whole groups under TP; logits against transformers' own reading of the checkpoint. Attention
    stays bf16 in these releases, so ``--attn-tp 2`` shards it as in a bf16 model."""
    ck = build(tmp_path / "ck", moe_intermediate_size=inter)
    plan, _, parallel = plan.partition("-")
    art = tmp_path / "art"
    afdc.compile_model(str(ck.directory), afdc.Plan.parse(plan, ffn_parallel=parallel or "auto",
                                                          attention_tp=attention_tp), art, progress=False)
    assert {p.name for p in (art / "weights").glob("attn-tp*.safetensors")} == (
        {f"attn-tp{t}{part}.safetensors" for t in range(attention_tp) for part in ("", "-state")}
        if attention_tp > 1 else set()
    )
    ranks, layer = int(plan[-2]), f"model.layers.{1 if build is deepseek_v3_int4 else 0}.mlp.experts"
    experts, cols = (4, inter // ranks) if parallel == "tp" else (4 // ranks, inter)
    held = _stored(art, ranks - 1)
    assert held[f"{layer}.gate_up_proj_packed"] == ("I32", [experts, 2 * cols, 64 // 8])
    assert held[f"{layer}.gate_up_proj_scale"] == ("BF16", [experts, 2 * cols, 64 // 32])
    assert held[f"{layer}.down_proj_packed"] == ("I32", [experts, 64, cols // 8])
    assert held[f"{layer}.down_proj_scale"] == ("BF16", [experts, 64, cols // 32])
    assert f"{layer}.gate_up_proj" not in held
    _check_against_transformers(afdc.load_deployment(art), ck.directory, greedy=plan == "1A2F" and not parallel,
                                quantization_config=_DEQUANTIZED)
    if build is deepseek_v3_int4 and plan == "2A4F":
        afdc.compile_model(str(tmp_path / "ck-bf16"), plan, tmp_path / "bf16", progress=False)
        ratio = _ffn_bytes(art) / _ffn_bytes(tmp_path / "bf16")
        experts_bytes = sum(math.prod(shape) * (4 if dtype == "I32" else 2) for rank in range(ranks)
                            for name, (dtype, shape) in _stored(art, rank).items() if ".experts." in name)
        print(f"FFN rank files, int4 experts (groups of 32) / bf16: {ratio:.3f} "
              f"(the routed experts alone: {experts_bytes / (2 * 4 * 3 * 64 * inter):.3f})")
        assert ratio < 0.75


@pytest.mark.parametrize(
    ("build", "inter", "plan"),
    [(deepseek_v3_nvfp4, 32, "1A2F"), (deepseek_v3_nvfp4, 128, "2A4F"), (qwen3_moe_nvfp4, 64, "2A4F")],
    ids=["deepseek-smaller-1A2F", "deepseek-larger-2A4F", "qwen-equal-2A4F"],
)
def test_nvfp4_checkpoints_against_vllms_reading(tmp_path, build, inter, plan):
    """ModelOpt NVFP4 as NVIDIA ships DeepSeek and Qwen3 FP4 (dense MLPs, shared and routed experts,
    and for Qwen attention too): the rank files hold the packed bytes, fp8 group scales and float32
    global scales, whole experts under EP and whole groups under TP; logits against the checkpoint as
    vLLM's NVFP4 dequantization reads it (transformers does not load pre-quantized NVFP4)."""
    ck = build(tmp_path / "ck", moe_intermediate_size=inter)
    art = tmp_path / "art"
    afdc.compile_model(str(ck.directory), plan, art, progress=False)
    ranks, layer = int(plan[-2]), f"model.layers.{1 if build is deepseek_v3_nvfp4 else 0}.mlp.experts"
    held = _stored(art, ranks - 1)
    assert held[f"{layer}.gate_up_proj_packed"] == ("U8", [4 // ranks, 2 * inter, 64 // 2])
    assert held[f"{layer}.gate_up_proj_scale"] == ("F8_E4M3", [4 // ranks, 2 * inter, 64 // 16])
    assert held[f"{layer}.gate_up_proj_scale_2"] == ("F32", [4 // ranks, 2])
    assert held[f"{layer}.down_proj_scale_2"] == ("F32", [4 // ranks, 1])
    if build is deepseek_v3_nvfp4:  # the dense MLP by TP: 128 features in groups of 16 over the ranks
        assert held["model.layers.0.mlp.down_proj.weight_packed"] == ("U8", [64, 128 // ranks // 2])
        assert held["model.layers.0.mlp.down_proj.weight_scale"] == ("F8_E4M3", [64, 128 // ranks // 16])
    _check_against_transformers(afdc.load_deployment(art), tmp_path / "ck-dequantized", greedy=plan == "1A2F")
    if build is qwen3_moe_nvfp4:
        with safe_open(art / "weights" / "attn.safetensors", "pt") as f:
            assert f.get_slice("model.layers.0.self_attn.q_proj.weight_packed").get_dtype() == "U8"
        # its attention is NVFP4 too: --attn-tp would have to split packed groups and their scales
        with pytest.raises(afdc.PlanError, match=r"--attn-tp 2 on a checkpoint that quantizes attention-side "
                           r"weights \(model\.layers\.0\.self_attn\..*_proj\.weight is nvfp4"):
            afdc.compile_model(str(ck.directory), afdc.Plan.parse(plan, attention_tp=2), tmp_path / "tp",
                               progress=False)
        afdc.compile_model(str(tmp_path / "ck-bf16"), plan, tmp_path / "bf16", progress=False)
        print(f"FFN rank files, NVFP4 / bf16: {_ffn_bytes(art) / _ffn_bytes(tmp_path / 'bf16'):.3f}")
        assert _ffn_bytes(art) / _ffn_bytes(tmp_path / "bf16") < 0.4


def test_int4_tp_split_that_cuts_a_group_is_refused(tmp_path):
    ck = qwen3_moe_int4(tmp_path / "qwen", moe_intermediate_size=64)  # 4 ranks: 16 features each, half a group
    refusal = r"experts\.(gate_up|down)_proj .*1x32 scale blocks.*F that split it on block boundaries: 1, 2 "
    with pytest.raises(afdc.PlanError, match=refusal):
        afdc.compile_model(str(ck.directory), afdc.Plan.parse("1A4F", ffn_parallel="tp"), tmp_path / "a",
                           progress=False)


def test_tp_split_that_cuts_a_block_is_refused(tmp_path):
    """fp8 blocks: refused naming the weight, the block and the F that work; MXFP4: TP refused."""
    ck = deepseek_v3_fp8(tmp_path / "ds")  # 16x16 blocks: 96 intermediate features over 4 ranks is 24 each
    refusal = r"model\.layers\.0\.mlp\.(up|gate|down)_proj\.weight .*16x16 scale blocks.*: 1, 2, 3, 6 "
    with pytest.raises(afdc.PlanError, match=refusal):
        afdc.compile_model(str(ck.directory), "2A4F", tmp_path / "art", progress=False)
    oss = gpt_oss_mxfp4(tmp_path / "oss")
    with pytest.raises(afdc.PlanError, match=r"experts\.gate_up_proj is MXFP4.*--ffn-parallel ep"):
        afdc.compile_model(str(oss.directory), afdc.Plan.parse("1A2F", ffn_parallel="tp"), tmp_path / "b",
                           progress=False)


def test_quantized_experts_not_recognised_as_one_fused_moe_are_refused(tmp_path):
    """One expert a token (top-1) is a routing afdc's MoE recognition does not match: the compile is
    refused naming the weight and why, instead of a bf16 matmul reading the MXFP4 bytes at run time."""
    ck = gpt_oss_mxfp4(tmp_path / "oss", top_k=1)
    with pytest.raises(afdc.UnsupportedModelError, match=r"experts\.gate_up_proj is stored quantized but .* did not "
                       r"recognise these routed experts as one fused MoE \(fused_moe at"):
        afdc.compile_model(str(ck.directory), "1A1F", tmp_path / "art", progress=False)


def test_deepseek_v4_as_shipped_against_transformers(tmp_path):
    """DeepSeek-V4-Flash's quantization on its own architecture: every FFN segment, the hash-routed
    layer's (its token-id lookup, sort and offsets on the FFN side) and the top-k layer's, runs one
    fused MoE over the fp4 experts with V4's clamped SwiGLU; each attention, a stateful mixer run in
    the model's own code, is given its fp8 weights as stored with their ue8m0 scales, and its
    linears on them run afdc's fp8 op (the compressors' bf16 ones stay the model's). At 1A2F the
    logits of a left-padded batch, decoded incrementally (a prefill, then a token a step against the
    cache), are as close to transformers' own reading of the checkpoint as its bf16 monolith's,
    with the same greedy tokens."""
    ck = deepseek_v4_fp8(tmp_path / "v4")
    art = tmp_path / "art"
    manifest = afdc.compile_model(str(ck.directory), "1A2F", art, progress=False)
    assert manifest.incremental_decode and read_manifest(art).mixers == manifest.mixers
    csa = manifest.mixers[1]  # the compressed sparse attention: compressor, indexer
    linears = {q.module: q for q in csa.linears}
    assert linears["q_a_proj"] == QuantizedLinear(
        "q_a_proj", "fp8_linear", (("weight", "weight"), ("weight_scale", "weight_scale")),
        (("block_n", 16), ("block_k", 16), ("w8a8", False)),
    )
    assert {"q_b_proj", "kv_proj", "o_b_proj", "compressor.indexer.q_b_proj"} < linears.keys()
    assert not {"o_a_proj", "compressor.kv_proj", "compressor.indexer.scorer.weights_proj"} & linears.keys()
    assert csa.weights[-len(linears):] == tuple(f"{m}.weight_scale" for m in linears)
    # the config alone (a plan-only compile) names the same stored tensors: the compressors' bf16 too
    from_config = QuantizedTensors.of(scheme_from_config(AutoConfig.from_pretrained(ck.directory))).tensors()
    assert from_config.keys() == manifest.quant.tensors.keys()
    with safe_open(art / "weights" / "attn.safetensors", "pt") as f:
        assert f.get_slice("model.layers.1.self_attn.q_a_proj.weight").get_dtype() == "F8_E4M3"
        assert f.get_slice("model.layers.1.self_attn.q_a_proj.weight_scale").get_dtype() == "F8_E8M0"
    # the logits of a prefill of 5 positions and 2 decode steps; decoding in Triton's interpreter
    # is most of the test's time, so 3 greedy tokens
    _check_against_transformers(afdc.load_deployment(art), ck.directory, logits=_decoded_logits, new_tokens=3)


@pytest.mark.parametrize(("hidden", "inter"), [(64, 96), (96, 160)])
def test_int4_linears_inside_a_stateful_mixer_against_transformers(tmp_path, hidden, inter):
    """compressed-tensors' default W4A16 recipe (every Linear but the LM head) on LFM2: its short
    convolution, a stateful mixer run in the model's own code, is given its in_proj and out_proj
    as stored (int32 words, bf16 group scales) and runs afdc's packed int4 op there. Hidden sizes
    of 2 and 3 groups of 32, MLPs of 3 and 5, compiled in float32, the logits of a left-padded batch
    decoded incrementally (a prefill, then a token a step against the mixer's state): the format's
    definition within 1e-5; transformers' own reading of the checkpoint, which rounds each
    dequantized weight to its scales' bf16, no further than that definition is, with its greedy tokens."""
    ck = lfm2_int4(tmp_path / "lfm2", hidden_size=hidden, intermediate_size=inter)
    art = tmp_path / "art"
    manifest = afdc.compile_model(str(ck.directory), afdc.Plan.parse("1A1F", dtype="fp32"), art, progress=False)
    (conv,) = manifest.mixers
    stored, int4 = (("weight", "weight"), ("weight_scale", "weight_scale")), (("format", "int4"), ("group_size", 32))
    assert conv.linears == tuple(QuantizedLinear(m, "packed_linear", stored, int4) for m in ("in_proj", "out_proj"))
    with safe_open(art / "weights" / "attn.safetensors", "pt") as f:
        assert f.get_slice("model.layers.0.conv.in_proj.weight_packed").get_shape() == [3 * hidden, hidden // 8]
        assert f.get_slice("model.layers.0.conv.out_proj.weight_scale").get_dtype() == "BF16"
    dm = afdc.load_deployment(art)
    got, exact = _decoded_logits(dm), _logits(ck.reference)
    assert _distance(got, exact) < 1e-5, f"afdc's logits are {_distance(got, exact):.2e} from the format's definition"
    transformers = AutoModelForCausalLM.from_pretrained(ck.directory, dtype=torch.float32,
                                                        quantization_config=_DEQUANTIZED).eval()
    want = _logits(transformers)
    assert _distance(got, want) <= _distance(exact, want) + 1e-5
    ids, mask = _batch()
    kw = dict(attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
    assert torch.equal(dm.generate(ids, **kw), transformers.generate(ids, **kw))


def test_cli_says_what_dtype_does_to_a_quantized_checkpoint(tmp_path):
    ck = qwen3_moe_fp8(tmp_path / "qwen")
    result = CliRunner().invoke(
        main, ["compile", str(ck.directory), "--plan", "1A2F", "--dtype", "fp32", "-o", str(tmp_path / "a"), "--quiet"]
    )
    assert result.exit_code == 0, result.output
    assert "--dtype fp32 converts the unquantized tensors only" in result.output
    assert "12 quantized weights and their scales stay as stored" in result.output
    held = _stored(tmp_path / "a", 0)
    assert held["model.layers.0.mlp.experts.down_proj"][0] == "F8_E4M3"
    assert held["model.layers.0.mlp.experts.down_proj_scale"][0] == "F32"
    assert held["model.layers.0.mlp.gate.weight"][0] == "F32"
    document = json.loads((tmp_path / "a" / "manifest.json").read_text())
    assert document["format_version"] == read_manifest(tmp_path / "a").format_version == FORMAT_VERSION


def test_plan_only_compile_from_the_config_alone_names_the_same_tensors(tmp_path):
    """--no-weights reads the scheme from the config's quantization_config: the same stored tensors
    (names, shapes, blocks) as the compile that read the checkpoint's headers."""
    ck = qwen3_moe_fp8(tmp_path / "qwen")
    with_weights = afdc.compile_model(str(ck.directory), "1A2F", tmp_path / "a", progress=False)
    plan_only = afdc.compile_model(str(ck.directory / "config.json"), "1A2F", tmp_path / "b", weights=False,
                                   progress=False)
    assert plan_only.quant.tensors == with_weights.quant.tensors
    assert plan_only.quant.summary == "fp8: 12 quantized parameters (fp8-block 32x32)"
    assert all(t.block[-2:] == [32, 32] for t in plan_only.quant.tensors.values())


def test_disaggregate_a_model_transformers_loaded_from_quantized_checkpoints(tmp_path):
    """fp8 blocks: transformers dequantizes on CPU, so the model splits as bf16 and matches its own
    outputs. compressed-tensors: it keeps the fp8 weights, which afdc refuses saying what to do;
    loaded with run_compressed=False it splits as bf16."""
    ck = qwen3_moe_fp8(tmp_path / "qwen")
    model = AutoModelForCausalLM.from_pretrained(ck.directory).eval()
    _check_runs(afdc.disaggregate(model, "1A2F"), model)

    ct = llama_compressed_fp8(tmp_path / "llama")
    kept = AutoModelForCausalLM.from_pretrained(ct.directory)
    with pytest.raises(afdc.UnsupportedModelError, match=r"run_compressed=False.*afdc compile"):
        afdc.disaggregate(kept, "1A2F")
    config = CompressedTensorsConfig(run_compressed=False)
    dequantized = AutoModelForCausalLM.from_pretrained(ct.directory, quantization_config=config).eval()
    _check_runs(afdc.disaggregate(dequantized, "1A2F"), dequantized)


def _plan(config: Path, *extra: str) -> dict:
    result = CliRunner().invoke(main, ["plan", str(config), "--context", "256", "--json", *extra])
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


def _checkpoint_bytes(directory: Path) -> int:
    """The weights' bytes (compressed-tensors' ``weight_shape``, the unpacked shape as data, is no weight)."""
    with safe_open(directory / "model.safetensors", "pt") as f:
        return sum(_nbytes(f.get_slice(k)) for k in f.keys() if not k.endswith(".weight_shape"))  # noqa: SIM118 (safe_open handles are not iterable)


def _nbytes(tensor_slice) -> int:
    itemsize = {"F8_E4M3": 1, "U8": 1, "BF16": 2, "F32": 4, "I32": 4}[tensor_slice.get_dtype()]
    return itemsize * math.prod(tensor_slice.get_shape())


@pytest.mark.parametrize(
    "build", [qwen3_moe_fp8, gpt_oss_mxfp4, deepseek_v3_int4, qwen3_moe_nvfp4], ids=["fp8", "mxfp4", "int4", "nvfp4"]
)
def test_plan_prices_each_weight_at_its_stored_bytes(tmp_path, build):
    """From the config alone, the planner holds the checkpoint's bytes (fp8, MXFP4, int4 and NVFP4
    data, their scales, the bf16 rest, and DeepSeek's router score bias, a persistent buffer in
    float32), FLOPs at fp8 for fp8 only; --weight-dtype prices every weight at one dtype."""
    ck = build(tmp_path / "ck")
    fp8 = build is qwen3_moe_fp8
    stored = _plan(ck.directory / "config.json")
    assert (stored["weight_dtype"], stored["weights_as_stored"]) == ("fp8" if fp8 else "bf16", True)
    held = stored["attention_weight_bytes"] + stored["ffn_weight_bytes"]
    assert held == _checkpoint_bytes(ck.directory)
    bf16_bytes = _checkpoint_bytes(tmp_path / "ck-bf16")  # the same model saved in bf16
    print(f"weights as stored / bf16: {held / bf16_bytes:.3f}")
    if fp8:  # one run is enough to show the override (a plan captures the model: seconds)
        bf16 = _plan(ck.directory / "config.json", "--weight-dtype", "bf16")
        assert (bf16["weight_dtype"], bf16["weights_as_stored"]) == ("bf16", False)
        assert bf16["attention_weight_bytes"] + bf16["ffn_weight_bytes"] == bf16_bytes


def test_inspect_reports_each_weight_at_its_stored_bytes(tmp_path):
    """afdc inspect's report (from the config alone) holds the MXFP4 checkpoint's bytes: each MoE
    layer's expert matrices at their blocks and scales, the rest (biases, router) at bf16."""
    ck = gpt_oss_mxfp4(tmp_path / "oss")
    result = CliRunner().invoke(main, ["inspect", str(ck.directory / "config.json"), "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["attention_weight_bytes"] + report["ffn_weight_bytes"] == _checkpoint_bytes(ck.directory)
    with safe_open(ck.directory / "model.safetensors", "pt") as f:
        for layer in report["layers"]:
            stacked = [f"{layer['module']}.mlp.experts.{p}_{part}" for p in ("gate_up_proj", "down_proj")
                       for part in ("blocks", "scales")]
            assert layer["expert_weight_bytes"] == sum(_nbytes(f.get_slice(k)) for k in stacked)


def test_a_mixers_quantized_linear_runs_only_where_its_module_calls_it_as_a_linear():
    """The module rebuilt for a mixer gets afdc's op for a linear whose own forward is nn.Linear's:
    the format's reading of the stored tensors; a linear with a forward of its own (V4's grouped
    ``o_a_proj`` reads its weight itself) is refused by name, and so is a site, read from an
    artifact, naming an op that is no quantized linear."""

    class Grouped(torch.nn.Linear):
        def forward(self, x):
            return x @ self.weight.T

    module = torch.nn.Module()
    module.proj, module.grouped = torch.nn.Linear(32, 16, bias=True), Grouped(32, 16)
    fp8 = QuantizedLinear("proj", "fp8_linear", (("weight", "weight"), ("weight_scale", "weight_scale")),
                          (("block_n", 16), ("block_k", 16)))
    with_quantized_linears(module, (fp8,))
    weight = torch.randn(16, 32).to(torch.float8_e4m3fn)
    scale, bias, x = torch.rand(1, 2) + 0.5, torch.randn(16), torch.randn(3, 32)
    params = {"weight": weight, "weight_scale": scale, "bias": bias}
    got = torch.func.functional_call(module.proj, params, (x,), strict=True)
    torch.testing.assert_close(got, fp8_linear_reference(x, weight, scale, 16, 16, bias))
    with pytest.raises(afdc.UnsupportedModelError, match=r"Module\.grouped \(Grouped\) reads its weight in code"):
        with_quantized_linears(module, (replace(fp8, module="grouped"),))
    with pytest.raises(afdc.AfdcError, match=r"'aten::linear' is not a quantized linear op"):
        with_quantized_linears(torch.nn.Sequential(torch.nn.Linear(32, 16)),
                               (replace(fp8, module="0", op="aten::linear"),))
