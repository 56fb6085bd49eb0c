"""The streaming resharder, on tiny random models saved by transformers (and a few hand-made checkpoints)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from accelerate import init_empty_weights
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import (
    AutoModelForCausalLM,
    GptOssConfig,
    LlamaConfig,
    LlamaForCausalLM,
    LlamaModel,
    MixtralConfig,
    Qwen3MoeConfig,
    core_model_loading,
)
from transformers.conversion_mapping import register_checkpoint_conversion_mapping
from transformers.core_model_loading import Chunk, Concatenate, Interleave, Transpose, WeightConverter

from afdc.artifact.checkpoint import Checkpoint, CheckpointError, resolve
from afdc.artifact.reshard import FileDigest, TargetFile, TargetTensor, reshard
from afdc.segment import ShardSlice
from afdc.source import empty_model

SMALL = dict(hidden_size=32, num_hidden_layers=2, vocab_size=128, num_attention_heads=4, num_key_value_heads=2)
HALVES = [ShardSlice(0, part=0, parts=2), ShardSlice(0, part=1, parts=2)]


def _llama(**extra) -> LlamaConfig:
    return LlamaConfig(intermediate_size=48, **SMALL, **extra)


def _qwen3_moe() -> Qwen3MoeConfig:
    return Qwen3MoeConfig(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, head_dim=8, **SMALL)


def _saved(config, directory: Path, **save_options) -> dict[str, torch.Tensor]:
    """Save a random model of ``config``; return its state dict (the truth the rank files must match)."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(directory, **save_options)
    return model.state_dict()


def _check(files: list[TargetFile], digests: dict[Path, FileDigest], truth: dict[str, torch.Tensor], dtype=None):
    assert list(digests) == [file.path for file in files]
    for file in files:
        data = file.path.read_bytes()
        assert digests[file.path] == FileDigest(hashlib.sha256(data).hexdigest(), len(data))
        loaded = load_file(file.path)
        assert sorted(loaded) == sorted(tensor.name for tensor in file.tensors)
        for tensor in file.tensors:
            expected = tensor.slice.take(truth[tensor.name])
            if dtype is not None and expected.is_floating_point():
                expected = expected.to(dtype)
            got = loaded[tensor.name]
            assert got.dtype == expected.dtype and got.shape == tensor.slice.local_shape(truth[tensor.name].shape)
            assert torch.equal(got, expected), tensor.name


def _rank_files(directory: Path, names_and_slices: list[list[tuple[str, ShardSlice]]]) -> list[TargetFile]:
    return [
        TargetFile(directory / f"rank{rank}.safetensors", [TargetTensor(name, part) for name, part in tensors])
        for rank, tensors in enumerate(names_and_slices)
    ]


def test_shard_slice_ranges():
    assert ShardSlice().index((6, 4)) == [] and ShardSlice().local_shape((6, 4)) == (6, 4)
    assert ShardSlice(0, part=1, parts=2).index((6, 4)) == [(3, 6)]
    assert ShardSlice(1, blocks=2, part=1, parts=2).index((3, 8)) == [(2, 4), (6, 8)]
    assert ShardSlice(0, part=2, parts=3).index((7,)) == [(4, 7)]  # uneven: floor boundaries
    assert ShardSlice(1, blocks=2, part=0, parts=2).local_shape((3, 8, 5)) == (3, 4, 5)
    full = torch.arange(16).reshape(2, 8)
    assert ShardSlice(1, blocks=2, part=1, parts=2).take(full).tolist() == [[2, 3, 6, 7], [10, 11, 14, 15]]
    with pytest.raises(ValueError):
        ShardSlice(0, blocks=3).index((8,))
    with pytest.raises(ValueError):
        ShardSlice(None, parts=2)
    with pytest.raises(ValueError):
        ShardSlice(0, part=2, parts=2)


def test_dense_model_tensor_parallel_and_bf16(tmp_path):
    truth = _saved(_llama(), tmp_path / "ckpt")
    assert (tmp_path / "ckpt" / "model.safetensors").is_file()
    names = list(truth)
    # Column-parallel q (dim 0), row-parallel o (dim 1), the rest replicated.
    sliced = {"model.layers.0.self_attn.q_proj.weight": 0, "model.layers.1.self_attn.o_proj.weight": 1}
    ranks = [
        [(name, ShardSlice(sliced[name], part=r, parts=2) if name in sliced else ShardSlice()) for name in names]
        for r in range(2)
    ]
    files = _rank_files(tmp_path, ranks)
    files[0].metadata["rank"] = "0"
    digests = reshard(tmp_path / "ckpt", empty_model(_llama()), files, dtype=torch.bfloat16, progress=False)
    _check(files, digests, truth, dtype=torch.bfloat16)
    with safe_open(files[0].path, framework="pt") as handle:
        assert handle.metadata() == {"format": "pt", "rank": "0"}


def test_moe_legacy_experts_from_sharded_checkpoint(tmp_path):
    """Qwen3-MoE saves per-expert keys; the model holds stacked, fused gate_up_proj [E, 2I, H]."""
    truth = _saved(_qwen3_moe(), tmp_path / "ckpt", max_shard_size="20KB")
    index = json.loads((tmp_path / "ckpt" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    assert "model.layers.0.mlp.experts.3.gate_proj.weight" in index["weight_map"]
    gate_up, down = "model.layers.1.mlp.experts.gate_up_proj", "model.layers.1.mlp.experts.down_proj"
    ranks = [
        [
            ("model.layers.0.mlp.experts.gate_up_proj", half),  # EP
            ("model.layers.0.mlp.experts.down_proj", half),
            (gate_up, ShardSlice(1, blocks=2, part=r, parts=2)),  # TP of the fused [gate; up]
            (down, ShardSlice(2, part=r, parts=2)),
            ("model.embed_tokens.weight", ShardSlice()),
            ("model.layers.1.self_attn.k_proj.weight", half),
        ]
        for r, half in enumerate(HALVES)
    ]
    files = _rank_files(tmp_path, ranks)
    _check(files, reshard(tmp_path / "ckpt", empty_model(_qwen3_moe()), files, progress=False), truth)


def test_a_rank_reads_only_its_rows(tmp_path):
    config = _qwen3_moe()
    _saved(config, tmp_path / "ckpt")
    name = "model.layers.0.mlp.experts.gate_up_proj"  # [E=4, 2I=32, H=32] from per-expert [I=16, H=32] tensors
    layout = resolve(Checkpoint.discover(tmp_path / "ckpt"), empty_model(config), [name])[name]
    ep = layout.take(0, ShardSlice(0, part=1, parts=2).index(layout.shape))
    experts = [f"model.layers.0.mlp.experts.{e}.{proj}_proj.weight" for e in (2, 3) for proj in ("gate", "up")]
    assert sorted(ep.keys()) == sorted(experts)
    assert all(piece.source_index() == (slice(0, 16), slice(0, 32)) for piece in ep.pieces)  # whole experts
    tp = layout.take(1, ShardSlice(1, blocks=2, part=1, parts=2).index(layout.shape))
    assert len(tp.keys()) == 8  # every expert, but only the second half of its rows
    assert all(piece.source_index() == (slice(8, 16), slice(0, 32)) for piece in tp.pieces)


def test_checkpoint_of_the_base_model(tmp_path):
    """Keys saved by LlamaModel lack the `model.` prefix of LlamaForCausalLM's names."""
    torch.manual_seed(0)
    base = LlamaModel(_llama())
    base.save_pretrained(tmp_path / "ckpt")
    truth = {f"model.{name}": tensor for name, tensor in base.state_dict().items()}
    files = _rank_files(tmp_path, [[(name, half) for name in truth if name.endswith("proj.weight")] for half in HALVES])
    _check(files, reshard(tmp_path / "ckpt", empty_model(_llama()), files, progress=False), truth)


def test_mixtral_renamed_experts(tmp_path):
    """Mixtral's checkpoint has block_sparse_moe.experts.N.w1/w2/w3: a renaming plus converters."""
    config = MixtralConfig(num_local_experts=4, num_experts_per_tok=2, intermediate_size=16, **SMALL)
    truth = _saved(config, tmp_path / "ckpt")
    ranks = [
        [(name, half if name.endswith(("gate_up_proj", "down_proj")) else ShardSlice()) for name in truth]
        for half in HALVES
    ]
    files = _rank_files(tmp_path, ranks)
    _check(files, reshard(tmp_path / "ckpt", empty_model(config), files, progress=False), truth)


def test_gpt_oss_fused_checkpoint_with_expert_biases(tmp_path):
    """GPT-OSS stores experts already fused (keys equal the names), gate/up interleaved, with biases."""
    config = GptOssConfig(num_local_experts=4, num_experts_per_tok=2, intermediate_size=16, head_dim=8, **SMALL)
    truth = _saved(config, tmp_path / "ckpt", max_shard_size="30KB")
    experts = [name for name in truth if ".experts." in name]
    assert "model.layers.0.mlp.experts.gate_up_proj_bias" in experts
    ranks = [
        [(name, half) for name in experts]
        + [("model.layers.0.mlp.experts.gate_up_proj", ShardSlice(2, part=r, parts=2))]  # interleaved pairs stay whole
        for r, half in enumerate(HALVES)
    ]
    files = [
        TargetFile(tmp_path / f"ep{r}.safetensors", [TargetTensor(name, part) for name, part in tensors[:-1]])
        for r, tensors in enumerate(ranks)
    ] + [TargetFile(tmp_path / f"tp{r}.safetensors", [TargetTensor(*tensors[-1])]) for r, tensors in enumerate(ranks)]
    _check(files, reshard(tmp_path / "ckpt", empty_model(config), files, progress=False), truth)


def test_tied_embeddings(tmp_path):
    config = _llama(tie_word_embeddings=True)
    truth = _saved(config, tmp_path / "ckpt")
    files = _rank_files(tmp_path, [[("model.embed_tokens.weight", half), ("lm_head.weight", half)] for half in HALVES])
    _check(files, reshard(tmp_path / "ckpt", empty_model(config), files, progress=False), truth)

    # A checkpoint holding only the tied partner (lm_head) still provides the embedding.
    only_head = {name: t.clone() for name, t in truth.items() if name != "model.embed_tokens.weight"}
    (tmp_path / "head").mkdir()
    save_file(only_head, tmp_path / "head" / "model.safetensors")
    files = _rank_files(tmp_path, [[("model.embed_tokens.weight", ShardSlice())]])
    _check(files, reshard(tmp_path / "head", empty_model(config), files, progress=False), truth)


def test_absent_and_incomplete_tensors_are_listed_together(tmp_path):
    config = _qwen3_moe()
    truth = _saved(config, tmp_path / "full")
    state = load_file(tmp_path / "full" / "model.safetensors")
    dropped = [name for name in state if ".layers.1.self_attn." in name]  # 6 tensors: q, k, v, o, q_norm, k_norm
    dropped += [f"model.layers.0.mlp.experts.3.{proj}.weight" for proj in ("gate_proj", "up_proj")]  # E: 4 -> 3
    dropped += ["model.layers.1.mlp.experts.2.up_proj.weight"]  # 4 gates, 3 ups: they do not concatenate
    (tmp_path / "partial").mkdir()
    save_file({name: t for name, t in state.items() if name not in dropped}, tmp_path / "partial" / "model.safetensors")
    files = _rank_files(tmp_path, [[(name, ShardSlice()) for name in truth]])
    with pytest.raises(CheckpointError) as raised:
        reshard(tmp_path / "partial", empty_model(config), files, progress=False)
    message = str(raised.value)
    assert "partial (model.safetensors)" in message
    assert (
        "6 tensor(s) absent: model.layers.1.self_attn.q_proj.weight, model.layers.1.self_attn.k_proj.weight" in message
    )
    assert "2 tensor(s) incomplete or of another shape" in message
    assert "model.layers.0.mlp.experts.gate_up_proj (model [4, 32, 32], checkpoint [3, 32, 32] from" in message
    assert "model.layers.1.mlp.experts.gate_up_proj (concatenates checkpoint tensors of shapes" in message


def test_many_absent_tensors_are_counted(tmp_path):
    config = _llama()
    _saved(config, tmp_path / "full")
    (tmp_path / "empty").mkdir()
    save_file({"unrelated": torch.zeros(2)}, tmp_path / "empty" / "model.safetensors")
    names = [name for name in empty_model(config).state_dict()]
    with pytest.raises(CheckpointError, match=rf"{len(names)} tensor\(s\) absent: .* and {len(names) - 10} more"):
        reshard(tmp_path / "empty", empty_model(config), _rank_files(tmp_path, [[(n, ShardSlice()) for n in names]]))


def test_truncated_shard_is_named(tmp_path):
    config = _qwen3_moe()
    truth = _saved(config, tmp_path / "ckpt", max_shard_size="20KB")
    shard = sorted((tmp_path / "ckpt").glob("model-*.safetensors"))[1]
    shard.write_bytes(shard.read_bytes()[:-100])
    files = _rank_files(tmp_path, [[(name, ShardSlice()) for name in truth]])
    with pytest.raises(CheckpointError, match=rf"{shard.name}.*truncated or corrupt"):
        reshard(tmp_path / "ckpt", empty_model(config), files, progress=False)


def test_no_checkpoint(tmp_path):
    model = empty_model(_llama())
    files = _rank_files(tmp_path, [[("model.norm.weight", ShardSlice())]])
    with pytest.raises(CheckpointError, match=r"does not exist; expected a directory with model\.safetensors"):
        reshard(tmp_path / "nowhere", model, files)
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(
        CheckpointError, match=r"no safetensors checkpoint in .*bin: expected .* found pytorch_model\.bin"
    ):
        reshard(tmp_path / "bin", model, files)


# -- conversions transformers has for other model types, on a Llama with a test-only mapping -------


class FusedCheckpointLlama(LlamaForCausalLM):
    """Its checkpoints keep q/k/v fused, gate/up fused, down_proj transposed and o_proj in two column halves."""


class InterleavedCheckpointLlama(LlamaForCausalLM):
    """Its checkpoints keep gate/up interleaved row by row."""


_FUSED_CONVERSIONS = [
    WeightConverter("mlp.gate_up_proj.weight", ["mlp.gate_proj.weight", "mlp.up_proj.weight"], [Chunk(dim=0)]),
    WeightConverter("mlp.down_proj.weight_t", "mlp.down_proj.weight", [Transpose(0, 1)]),
    WeightConverter(
        ["self_attn.o_left.weight", "self_attn.o_right.weight"], "self_attn.o_proj.weight", [Concatenate(dim=1)]
    ),
]
# Split (uneven sections: q, k and v under GQA) came after transformers 5.17; without it q/k/v stay apart
FUSED_QKV = hasattr(core_model_loading, "Split")
if FUSED_QKV:
    _FUSED_CONVERSIONS.append(
        WeightConverter(
            "self_attn.qkv_proj.weight",
            ["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"],
            [core_model_loading.Split(dim=0)],
        )
    )
register_checkpoint_conversion_mapping("FusedCheckpointLlama", _FUSED_CONVERSIONS, overwrite=True)
register_checkpoint_conversion_mapping(
    "InterleavedCheckpointLlama",
    [
        WeightConverter(
            "mlp.gate_up_proj.weight", ["mlp.gate_proj.weight", "mlp.up_proj.weight"], [Interleave(dim=0), Chunk(dim=0)]
        )
    ],
    overwrite=True,
)


def _meta(cls, config):
    with init_empty_weights():
        return cls(config)


def _fused_checkpoint(truth: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    fused = {}
    for name, tensor in truth.items():
        layer, _, leaf = name.rpartition(".self_attn.") if ".self_attn." in name else name.rpartition(".mlp.")
        if leaf == "q_proj.weight" and FUSED_QKV:
            qkv = [truth[f"{layer}.self_attn.{p}_proj.weight"] for p in "qkv"]
            fused[f"{layer}.self_attn.qkv_proj.weight"] = torch.cat(qkv)
        elif leaf == "gate_proj.weight":
            fused[f"{layer}.mlp.gate_up_proj.weight"] = torch.cat([tensor, truth[f"{layer}.mlp.up_proj.weight"]])
        elif leaf == "down_proj.weight":
            fused[f"{layer}.mlp.down_proj.weight_t"] = tensor.t().contiguous()
        elif leaf == "o_proj.weight":
            fused[f"{layer}.self_attn.o_left.weight"], fused[f"{layer}.self_attn.o_right.weight"] = (
                part.contiguous() for part in tensor.chunk(2, dim=1)
            )
        elif leaf == "up_proj.weight" or (leaf in ("k_proj.weight", "v_proj.weight") and FUSED_QKV):
            continue  # fused with gate_proj or q_proj
        else:
            fused[name] = tensor
    return fused


def test_split_chunk_transpose_and_inner_concatenation(tmp_path):
    config = _llama()
    truth = _saved(config, tmp_path / "unused")
    (tmp_path / "ckpt").mkdir()
    save_file(_fused_checkpoint(truth), tmp_path / "ckpt" / "model.safetensors")
    layer = "model.layers.1"
    ranks = [
        [
            (f"{layer}.self_attn.k_proj.weight", half),
            (f"{layer}.mlp.up_proj.weight", half),
            (f"{layer}.mlp.down_proj.weight", ShardSlice(1, part=r, parts=2)),  # read from a transposed source
            # o_proj's two halves interleave row by row: writes land ahead of the hashed frontier
            (f"{layer}.self_attn.o_proj.weight", ShardSlice()),
            ("model.layers.0.self_attn.o_proj.weight", half),
        ]
        for r, half in enumerate(HALVES)
    ]
    files = _rank_files(tmp_path, ranks)
    _check(files, reshard(tmp_path / "ckpt", _meta(FusedCheckpointLlama, config), files, progress=False), truth)


def test_unstreamable_conversion_is_refused_by_name(tmp_path):
    config = _llama()
    truth = _saved(config, tmp_path / "unused")
    state = {name: t for name, t in truth.items() if ".mlp.gate_proj" not in name and ".mlp.up_proj" not in name}
    for layer in range(2):
        gate, up = (truth[f"model.layers.{layer}.mlp.{p}_proj.weight"] for p in ("gate", "up"))
        state[f"model.layers.{layer}.mlp.gate_up_proj.weight"] = torch.stack([gate, up], dim=1).reshape(-1, 32)
    (tmp_path / "ckpt").mkdir()
    save_file(state, tmp_path / "ckpt" / "model.safetensors")
    model = _meta(InterleavedCheckpointLlama, config)
    # Tensors that do not go through the converter are fine.
    files = _rank_files(tmp_path, [[("model.layers.0.mlp.down_proj.weight", ShardSlice())]])
    _check(files, reshard(tmp_path / "ckpt", model, files, progress=False), truth)
    files = _rank_files(tmp_path, [[("model.layers.1.mlp.up_proj.weight", ShardSlice())]])
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.mlp\.up_proj\.weight: .* uses Interleave"):
        reshard(tmp_path / "ckpt", model, files, progress=False)
