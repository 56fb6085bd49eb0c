"""`afdc compile` artifacts: every family under 1A1F, 2A1F and 1A2F, loaded rank by rank, against
the monolith; and the errors a user meets (bad plans, broken artifacts, partial checkpoints)."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForImageTextToText

import afdc
from afdc.artifact.checkpoint import CheckpointError
from afdc.artifact.manifest import ArtifactError, read_manifest
from afdc.cli import main
from afdc.demo import demo_batch
from afdc.errors import AfdcError
from afdc.segment import ExpertRouting
from models_supported import catalog

# One architecture per family of models_supported (MoE: three routing styles, plus renamed experts).
FAMILY_MODELS = ["llama", "olmo2", "gpt_neox", "gpt2", "qwen3_moe", "deepseek_v3", "gpt_oss", "mixtral", "lfm2"]
PLANS = ["1A1F", "2A1F", "1A2F"]


def _entry(model_type: str) -> catalog.ModelEntry:
    return next(e for e in catalog.ENTRIES if e.model_type == model_type)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """model_type -> (monolith, its save_pretrained directory), built once."""
    cache: dict[str, tuple] = {}

    def get(model_type: str):
        if model_type not in cache:
            model = catalog.build(_entry(model_type))
            path = tmp_path_factory.mktemp(model_type) / "src"
            model.save_pretrained(path)
            cache[model_type] = (model, path)
        return cache[model_type]

    return get


def _batch(vocab: int):
    return demo_batch(vocab, seed=0, shape=(3, 9), pads=(4,))


def _reference(model, ids, mask):
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask, position_ids=pos).logits, pos


# each family under one plan by default, the three plans in turn; under all three with --sweep
@pytest.mark.parametrize(
    ("model_type", "plan"),
    [
        pytest.param(m, p, id=f"{m}-{p}", marks=() if j == i % len(PLANS) else pytest.mark.sweep)
        for i, m in enumerate(FAMILY_MODELS)
        for j, p in enumerate(PLANS)
    ],
)
def test_artifact_matches_monolith(saved, tmp_path, model_type, plan):
    model, src = saved(model_type)
    out = tmp_path / "art"
    manifest = afdc.compile_model(str(src), plan, out, progress=False)
    assert (out / "manifest.json").is_file() and not list(tmp_path.glob(".art.partial-*"))

    dm = afdc.load_deployment(out)
    ids, mask = _batch(model.config.vocab_size)
    ref, pos = _reference(model, ids, mask)
    got = dm(ids, attention_mask=mask, position_ids=pos).logits
    valid = mask.bool()
    torch.testing.assert_close(got[valid], ref[valid], atol=2e-5, rtol=1e-4)
    assert torch.equal(got[valid].argmax(-1), ref[valid].argmax(-1))

    # Each rank loads only its own weights: the roles' weight sets are disjoint and cover the model.
    attn = set(afdc.load(out, "attn", 0).parameter_names())
    ffn_ranks = [afdc.load(out, "ffn", r) for r in range(manifest.plan.ffn_ranks)]
    ffn = set(ffn_ranks[0].parameter_names())
    assert attn and ffn and not attn & ffn
    assert {n for n, _ in model.named_parameters()} <= attn | ffn <= set(model.state_dict())


@pytest.mark.parametrize("model_type", ["gpt_neo", "falcon"])
def test_constants_the_forward_creates_are_written_with_their_values(saved, tmp_path, model_type):
    """GPT-Neo makes its mask value with torch.tensor(finfo.min, device=...), Falcon indexes with
    Python lists (qkv[..., [-2], :]): on the meta device the capture makes these on the host, so
    the artifact holds their values."""
    model, src = saved(model_type)
    afdc.compile_model(str(src), "1A2F", tmp_path / "art", progress=False)
    dm = afdc.load_deployment(tmp_path / "art")
    # what the program reads beyond the model's state: the constants the capture lifted
    constants = [t for n, t in dm.attention.module.state_dict().items() if n not in model.state_dict()]
    assert constants and not any(t.is_meta for t in constants)
    ids, mask = _batch(model.config.vocab_size)
    ref, pos = _reference(model, ids, mask)
    got = dm(ids, attention_mask=mask, position_ids=pos).logits
    torch.testing.assert_close(got[mask.bool()], ref[mask.bool()], atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("model_type", ["qwen3_moe", "gpt_oss", "deepseek_v3"])
def test_expert_parallel_rank_files_hold_their_experts(saved, tmp_path, model_type):
    model, src = saved(model_type)
    manifest = afdc.compile_model(str(src), "2A2F", tmp_path / "art", progress=False)
    state = model.state_dict()
    experts = [
        name
        for lay in manifest.layers
        for name, split in zip(lay.weights, manifest.segments[lay.segment].splits)
        if split.experts
    ]
    assert experts and all(lay.ffn_split == "ep" for lay in manifest.layers if lay.kind == "moe")
    for rank in range(2):
        (rel,) = [f for f in manifest.rank_files("ffn", rank).weights if not f.endswith("-state.safetensors")]
        with safe_open(tmp_path / "art" / rel, "pt") as f:
            for name in experts:
                full = state[name]
                half = full.shape[0] // 2
                torch.testing.assert_close(f.get_tensor(name), full[rank * half : (rank + 1) * half])
    # Greedy decoding across 2 attention and 2 FFN ranks equals the monolith's.
    ids, mask = _batch(model.config.vocab_size)
    ref = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    got = afdc.load_deployment(tmp_path / "art").generate(ids, attention_mask=mask, max_new_tokens=6, pad_token_id=0)
    assert torch.equal(got, ref)


def test_expert_routing_is_recorded_and_served_from_the_artifact(saved, tmp_path):
    model, src = saved("qwen3_moe")
    out = tmp_path / "art"
    manifest = afdc.compile_model(str(src), afdc.Plan.parse("1A2F", router="attn"), out, progress=False)
    assert [s.routing for s in manifest.segments] == [ExpertRouting(input=1, per_rank=2, top_k=2)]
    assert read_manifest(out).segments[0].routing == manifest.segments[0].routing
    dm = afdc.load_deployment(out)
    ids, mask = _batch(model.config.vocab_size)
    ref, pos = _reference(model, ids, mask)
    got = dm(ids, attention_mask=mask, position_ids=pos).logits
    torch.testing.assert_close(got[mask.bool()], ref[mask.bool()], atol=2e-5, rtol=1e-4)


def test_shared_experts_whole_on_every_rank_with_routed_tokens(saved, tmp_path):
    """--router attn: DeepSeek-V3's shared expert is stored whole in every FFN rank's file (and
    with --dense-ffn replicate its dense first layer), and the MoE layer's tokens go only to their
    experts' ranks, with the owner mark as the segment's last input; served from the artifact."""
    model, src = saved("deepseek_v3")
    plan = afdc.Plan.parse("1A2F", router="attn", dense_ffn="replicate")
    manifest = afdc.compile_model(str(src), plan, tmp_path / "art", progress=False)
    dense, moe = manifest.segments
    assert dense.routing is None and dense.reduce == ["rows"]
    assert moe.routing == ExpertRouting(input=2, per_rank=4, top_k=None, owner=3) and moe.inputs[3][-1] == 1
    assert [s.experts for s in moe.splits] == [True, True, False, False, False]
    assert all(s.dim is None for s in moe.splits[2:])
    shared = "model.layers.1.mlp.shared_experts.down_proj.weight"
    for rank in range(2):
        (rel,) = [f for f in manifest.rank_files("ffn", rank).weights if not f.endswith("-state.safetensors")]
        with safe_open(tmp_path / "art" / rel, "pt") as f:
            torch.testing.assert_close(f.get_tensor(shared), model.state_dict()[shared])
    ids, mask = _batch(model.config.vocab_size)
    ref, pos = _reference(model, ids, mask)
    got = afdc.load_deployment(tmp_path / "art")(ids, attention_mask=mask, position_ids=pos).logits
    torch.testing.assert_close(got[mask.bool()], ref[mask.bool()], atol=2e-5, rtol=1e-4)


def test_tensor_parallel_dense_and_experts(saved, tmp_path):
    model, src = saved("qwen3_moe")
    manifest = afdc.compile_model(str(src), "1A2F", tmp_path / "art", progress=False, force=False)
    assert manifest.plan.ffn_parallel == "auto"
    tp = afdc.compile_model(
        str(src), afdc.Plan.parse("1A2F", ffn_parallel="tp"), tmp_path / "tp", progress=False
    )
    assert {lay.ffn_split for lay in tp.layers} == {"tp"}
    ids, mask = _batch(model.config.vocab_size)
    ref, pos = _reference(model, ids, mask)
    got = afdc.load_deployment(tmp_path / "tp")(ids, attention_mask=mask, position_ids=pos).logits
    torch.testing.assert_close(got[mask.bool()], ref[mask.bool()], atol=2e-5, rtol=1e-4)


def test_replicated_dense_layers(saved, tmp_path):
    """--dense-ffn replicate: every FFN rank file holds the dense layers whole (any F, here 3 for a
    hidden size of 64), MoE layers stay expert-parallel, and the artifact matches the monolith."""
    for model_type, plan in (("llama", "1A3F"), ("deepseek_v3", "2A2F")):
        model, src = saved(model_type)
        out = tmp_path / model_type
        result = CliRunner().invoke(
            main, ["compile", str(src), "--plan", plan, "--dense-ffn", "replicate", "-o", str(out), "--quiet"]
        )
        assert result.exit_code == 0, result.output
        manifest = read_manifest(out)
        assert manifest.plan.dense_ffn == "replicate"
        kinds = {(lay.kind, lay.ffn_split) for lay in manifest.layers}
        assert kinds == ({("dense", "dp")} if model_type == "llama" else {("dense", "dp"), ("moe", "ep")})
        state = model.state_dict()
        dense = [w for lay in manifest.layers if lay.ffn_split == "dp" for w in lay.weights if w in state]
        for rank in range(manifest.plan.ffn_ranks):
            files = [out / f for f in manifest.rank_files("ffn", rank).weights]
            held = {}
            for path in files:
                with safe_open(path, "pt") as f:
                    names = set(f.keys()) & set(dense)
                    held |= {name: f.get_tensor(name) for name in names}
            assert held.keys() == set(dense)
            assert all(torch.equal(held[name], state[name]) for name in dense)
        ids, mask = _batch(model.config.vocab_size)
        ref = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
        got = afdc.load_deployment(out).generate(ids, attention_mask=mask, max_new_tokens=6, pad_token_id=0)
        assert torch.equal(got, ref)


def test_plan_errors(saved, tmp_path):
    _, dense = saved("llama")
    _, moe = saved("qwen3_moe")
    with pytest.raises(afdc.PlanError, match="dense model"):
        afdc.compile_model(str(dense), afdc.Plan.parse("1A2F", ffn_parallel="ep"), tmp_path / "a", weights=False)
    with pytest.raises(afdc.PlanError, match="do not divide the 4 experts"):
        afdc.compile_model(str(moe), "1A3F", tmp_path / "b", weights=False)
    with pytest.raises(afdc.PlanError, match="do not divide"):
        afdc.compile_model(str(dense), "1A3F", tmp_path / "c", weights=False)
    for bad in ("2A", "0A1F", "1A0F", "AF", "2x2"):
        with pytest.raises(afdc.PlanError):
            afdc.Plan.parse(bad)
    with pytest.raises(afdc.PlanError, match=r"--attn-tp \(attention_tp\) must be at least 1"):
        afdc.Plan.parse("2A2F", attention_tp=0)
    with pytest.raises(afdc.PlanError, match="--ffn-parallel"):
        afdc.Plan.parse("2A2F", ffn_parallel="dp")
    with pytest.raises(afdc.PlanError, match="--dense-ffn 'dp' is not one of tp, replicate"):
        afdc.Plan.parse("2A2F", dense_ffn="dp")
    assert not any(tmp_path.iterdir())  # nothing half-written


@pytest.mark.parametrize(("intermediate", "tp_fits"), [(48, True), (64, False)])
def test_experts_f_does_not_divide_suggests_tp_only_where_it_fits(intermediate, tp_fits):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("mixtral", hidden_size=32, intermediate_size=intermediate, num_hidden_layers=1,
                                  num_attention_heads=4, num_key_value_heads=2, vocab_size=64, num_local_experts=4,
                                  num_experts_per_tok=2)
    model = AutoModelForCausalLM.from_config(config).eval()
    with pytest.raises(afdc.PlanError, match="3 FFN ranks do not divide the 4 experts") as err:
        afdc.disaggregate(model, "1A3F")
    assert ("or --ffn-parallel tp" in str(err.value)) == tp_fits
    if tp_fits:
        afdc.disaggregate(model, "1A3F", ffn_parallel="tp")


def test_a_model_source_that_is_not_a_model_is_named(saved, tmp_path):
    _, src = saved("qwen3_moe")
    art = tmp_path / "art"
    afdc.compile_model(str(src), "1A1F", art, weights=False, progress=False)
    (tmp_path / "empty").mkdir()
    for source, said in (
        (str(tmp_path / "missing"), "no such directory"),
        (str(tmp_path / "empty"), "has no config.json: give the directory a model was saved to"),
        (str(art), "is an afdc artifact, not a model: serve it"),
    ):
        result = CliRunner().invoke(main, ["inspect", source])
        assert result.exit_code != 0 and said in result.output, result.output


def test_broken_artifacts_are_refused(saved, tmp_path):
    _, src = saved("qwen3_moe")
    out = tmp_path / "art"
    manifest = afdc.compile_model(str(src), "1A2F", out, progress=False)
    with pytest.raises(AfdcError, match="already exists"):
        afdc.compile_model(str(src), "1A2F", out, progress=False)
    # refused before anything is read or compiled: a source that is not there is not even looked at
    with pytest.raises(AfdcError, match="already exists"):
        afdc.compile_model(str(tmp_path / "no-such-model"), "1A2F", out, progress=False)
    afdc.compile_model(str(src), "1A2F", out, progress=False, force=True)  # --force replaces it

    with pytest.raises(ArtifactError, match="rank 2 is not one"):
        afdc.load(out, "ffn", 2)
    with pytest.raises(ArtifactError, match="'gpu' is not"):
        afdc.load(out, "gpu", 0)

    ffn_file = out / manifest.rank_files("ffn", 1).weights[-1]
    data = bytearray(ffn_file.read_bytes())
    data[-1] ^= 0xFF
    ffn_file.write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match="corrupted"):
        afdc.load(out, "ffn", 1)
    afdc.load(out, "ffn", 0)  # the other rank's files are intact
    ffn_file.write_bytes(bytes(data[:-100]))
    with pytest.raises(ArtifactError, match="truncated"):
        afdc.load(out, "ffn", 1)

    (out / manifest.attention_program).write_text("raise SystemExit")
    with pytest.raises(ArtifactError, match=r"attention\.json"):
        afdc.load(out, "attn", 0)

    (out / "manifest.json").unlink()
    with pytest.raises(ArtifactError, match=r"no manifest\.json"):
        afdc.load(out, "attn", 0)


def test_future_format_is_refused(saved, tmp_path):
    _, src = saved("llama")
    out = tmp_path / "art"
    afdc.compile_model(str(src), "1A1F", out, progress=False)
    data = json.loads((out / "manifest.json").read_text())
    data["format_version"] = 99
    (out / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(ArtifactError, match="format 99"):
        read_manifest(out)


def test_partial_checkpoint_leaves_nothing(saved, tmp_path):
    _, src = saved("llama")
    partial = tmp_path / "partial"
    shutil.copytree(src, partial)
    from safetensors.torch import load_file, save_file

    state = load_file(partial / "model.safetensors")
    dropped = sorted(n for n in state if "layers.1.mlp" in n)
    save_file({k: v for k, v in state.items() if k not in dropped}, partial / "model.safetensors", {"format": "pt"})
    with pytest.raises(CheckpointError) as err:
        afdc.compile_model(str(partial), "1A2F", tmp_path / "art", progress=False)
    assert all(n in str(err.value) for n in dropped)
    assert not (tmp_path / "art").exists() and not list(tmp_path.glob(".art.partial-*"))


def test_no_weights_compiles_a_plan_only(saved, tmp_path):
    model, src = saved("deepseek_v3")
    config = tmp_path / "config.json"
    config.write_text((Path(src) / "config.json").read_text())
    result = CliRunner().invoke(
        main, ["compile", str(config), "--plan", "2A2F", "--no-weights", "--quiet", "-o", str(tmp_path / "art")]
    )
    assert result.exit_code == 0, result.output
    assert "2A2F" in result.output and "no weights" in result.output
    manifest = read_manifest(tmp_path / "art")
    assert not manifest.weights_included and manifest.layers[0].to_ffn[0].shape_per_token == [model.config.hidden_size]
    with pytest.raises(ArtifactError, match="--no-weights"):
        afdc.load(tmp_path / "art", "ffn", 0)
    # A config file holds no weights: compiling with weights says what to do.
    result = CliRunner().invoke(main, ["compile", str(config), "-o", str(tmp_path / "w")])
    assert result.exit_code == 2 and "--no-weights" in result.output
    config.write_text(json.dumps({"model_type": "no_such_model", "hidden_size": 8}))
    result = CliRunner().invoke(main, ["compile", str(config), "--no-weights", "-o", str(tmp_path / "x")])
    assert result.exit_code == 2 and "unknown model_type 'no_such_model'" in result.output


_SMALL_VIT = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
              "image_size": 28, "patch_size": 14}
_SMALL_QWEN_VIT = {"depth": 1, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2, "out_hidden_size": 32,
                   "deepstack_visual_indexes": [0], "num_position_embeddings": 16}


_GLM5_NEXT = {"layer_types": ["linear_attention", "indexed_attention"], "mlp_layer_types": ["dense", "sparse"],
              "indexer_types": ["full", "full"], "n_routed_experts": 4, "num_experts_per_tok": 2,
              "moe_intermediate_size": 16, "kv_lora_rank": 16, "q_lora_rank": 16, "qk_nope_head_dim": 8,
              "v_head_dim": 8, "qk_head_dim": 8, "index_topk": 4, "index_head_dim": 8, "index_n_heads": 2,
              "linear_head_dim": 8, "linear_num_heads": 4, "index_kpool": 2, "num_key_value_heads": 4, "hc_mult": 2}


@pytest.mark.parametrize(("model_type", "text_type", "text", "vision"), [
    ("gemma3", "gemma3_text", {}, _SMALL_VIT),  # a causal-LM class of its own (Gemma3ForConditionalGeneration)
    # image-text-to-text only (Qwen3-VL-MoE's flagship): experts, and M-RoPE over three position axes
    ("qwen3_vl_moe", "qwen3_moe", {"rope_parameters": {"rope_theta": 1e4, "rope_type": "default",
                                                       "mrope_section": [2, 1, 1]}}, _SMALL_QWEN_VIT),
    # image-text-to-text only (GLM-5 Next): linear attention and an indexed MLA (stateful mixers whose
    # indexer reads the padding mask at every step), hyper-connections, experts
    ("glm5_next", "glm5_next_text", _GLM5_NEXT, {"depth": 1, "hidden_size": 16, "num_heads": 2, "intermediate_size": 32,
                                                "out_hidden_size": 32, "projection_intermediate_size": 32}),
], ids=["gemma3", "qwen3_vl_moe", "glm5_next"])
def test_a_multimodal_checkpoint_compiles_its_language_model(tmp_path, model_type, text_type, text, vision):
    """A multimodal checkpoint, compiled as transformers builds it (its causal-LM class, else its
    image-text-to-text class) and captured on token inputs: the artifact holds the language model
    alone (no tower weight is written), its logits on a left-padded batch are the checkpoint's own
    model's, and so are its greedy tokens."""
    entries = {e.model_type: e for e in catalog.ENTRIES}
    text = {**catalog.TINY_COMMON, **(entries[text_type].config_kwargs if text_type in entries else {}), **text}
    config = AutoConfig.for_model(model_type, text_config=text, vision_config=vision)
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32).eval()
    assert any("visual" in n or "vision" in n for n, _ in model.named_parameters())
    model.save_pretrained(tmp_path / "src")
    manifest = afdc.compile_model(str(tmp_path / "src"), "1A2F", tmp_path / "art", progress=False)
    assert "moe" in {lay.kind for lay in manifest.layers} or model_type == "gemma3"
    for file in (tmp_path / "art" / "weights").glob("*.safetensors"):
        with safe_open(file, "pt") as f:
            names = f.keys()
        assert names and not [n for n in names if "vision" in n or "visual" in n or "multi_modal" in n], file
    ids, mask = _batch(text["vocab_size"])
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=mask).logits
    dm = afdc.load_deployment(tmp_path / "art")
    got = dm(ids, attention_mask=mask).logits
    torch.testing.assert_close(got[mask.bool()], ref[mask.bool()], atol=2e-5, rtol=1e-4)
    expected = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, eos_token_id=None,
                              pad_token_id=0)
    assert torch.equal(dm.generate(ids, attention_mask=mask, max_new_tokens=4, eos_token_id=[]), expected)


def test_a_library_the_model_class_needs_is_named(tmp_path):
    """Gemma 3n's multimodal class builds its vision tower with timm: without timm (this project's
    installs lack it: it needs torchvision, which breaks vLLM's CPU imports) compile says so."""
    if importlib.util.find_spec("timm") is not None:
        pytest.skip("timm is installed: the class builds")
    text = {**catalog.TINY_COMMON, **catalog.entry("gemma3n_text").config_kwargs}
    AutoConfig.for_model("gemma3n", text_config=text).save_pretrained(tmp_path / "src")
    result = CliRunner().invoke(
        main, ["compile", str(tmp_path / "src" / "config.json"), "--no-weights", "-o", str(tmp_path / "x")]
    )
    assert result.exit_code == 2, result.output
    assert "gemma3n's model class only with a library that is not installed" in result.output
    assert "timm" in result.output and not (tmp_path / "x").exists()


def test_artifacts_of_new_layouts_match_and_keep_their_length_bound(saved, tmp_path):
    """Hyper-connections and sparse attention (HY-V4), and Gemma 4's MoE over two FFN ranks (its
    norms of partial sums on the attention side, its per-layer inputs with attention) compile
    and load like any model, as do DBRX's experts kept as flat [E*I, H] stacks (each FFN rank's
    rows of them, read as [E/2, I, H]); a length bound found at capture (XGLM's position table)
    travels in the manifest and is enforced by the loaded deployment."""
    for model_type in ("hy_v4", "gemma4_text", "dbrx"):
        model, src = saved(model_type)
        afdc.compile_model(str(src), "1A2F", tmp_path / model_type, progress=False)
        ids, mask = _batch(model.config.vocab_size)
        ref, pos = _reference(model, ids, mask)
        got = afdc.load_deployment(tmp_path / model_type)(ids, attention_mask=mask, position_ids=pos).logits
        torch.testing.assert_close(got[mask.bool()], ref[mask.bool()], atol=2e-5, rtol=1e-4)

    model, src = saved("xglm")
    manifest = afdc.compile_model(str(src), "1A1F", tmp_path / "xglm", progress=False)
    assert manifest.max_positions == 128
    dm = afdc.load_deployment(tmp_path / "xglm")
    assert dm.max_positions == 128
    with pytest.raises(AfdcError, match="exceed the 128"):
        dm(torch.randint(3, 128, (1, 129)))
