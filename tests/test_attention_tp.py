"""Tensor parallelism inside an attention rank (``--attn-tp``): the sharded attention program
against the monolith, in process, from an artifact, and with FFN servers in other processes."""

from __future__ import annotations

import json
import threading
import time
from dataclasses import asdict

import pytest
import torch

import afdc
from afdc.artifact.manifest import ArtifactError, read_manifest
from afdc.demo import demo_batch
from afdc.runtime.rendezvous import PeerLost
from afdc.runtime.tensor_parallel import TensorParallelAttention
from afdc.segment import Split
from models_supported import catalog


def _model(model_type: str):
    return catalog.build(next(e for e in catalog.ENTRIES if e.model_type == model_type)).eval()


def _batch(vocab: int):
    return demo_batch(vocab, seed=1, shape=(3, 7), pads=(3, 0, 1))


def _check(model, dm, new_tokens: int = 4):
    """Same logits on the real tokens and the same greedy tokens as the monolith."""
    ids, mask = _batch(model.config.get_text_config().vocab_size)
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=mask).logits
    got = dm(ids, attention_mask=mask).logits
    real = mask.bool()
    torch.testing.assert_close(got[real], ref[real], atol=2e-5, rtol=2e-5)
    expect = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    assert torch.equal(dm.generate(ids, mask, max_new_tokens=new_tokens, pad_token_id=0), expect)


def _weight(program, name: str) -> torch.Tensor:
    return next(p for n, p in program.module.named_parameters() if n.endswith(name))


@pytest.mark.parametrize(
    "model_type, plan, options, split",
    [
        ("llama", "1A1F", {}, "q_proj"),  # GQA: 4 query heads, 2 key/value heads, each rank 2 and 1
        ("qwen3", "1A2F", {"micro_batches": 2}, "q_proj"),  # a norm per head (q_norm / k_norm)
        ("olmo2", "1A1F", {}, "q_proj"),  # a norm over all heads: its mean is all-reduced
        ("gpt_oss", "2A2F", {"micro_batches": 2}, "q_proj"),  # sinks per head, an o_proj bias, MoE
        ("mixtral", "1A2F", {"router": "attn"}, "q_proj"),  # the router on the attention side stays whole
        ("deepseek_v3", "1A2F", {}, "q_b_proj"),  # MLA: latents whole, heads split, rotary key broadcast
        ("phi3", "1A1F", {}, "qkv_proj"),  # a fused [q; k; v] sliced unevenly: each section split
        ("glm", "1A1F", {}, "q_proj"),  # interleaved rotary (stacked halves), q/k/v biases split with them
        ("persimmon", "2A1F", {}, "query_key_value"),  # fused per head, a layer norm per head
    ],
)
def test_attention_tp_matches_the_monolith(model_type, plan, options, split):
    model = _model(model_type)
    dm = afdc.disaggregate(model, plan, attention_tp=2, **options)
    program = dm.attention
    assert isinstance(program, TensorParallelAttention) and len(program.shards) == 2
    # every TP rank holds half of the heads' projection, and all-reduces after the output projection
    name = f"layers.0.self_attn.{split}.weight"
    full = model.get_parameter(f"model.{name}")
    assert [tuple(_weight(s, name).shape) for s in program.shards] == [(full.shape[0] // 2, full.shape[1])] * 2
    assert any(n.target is torch.ops.afdc.tp_all_reduce.default for n in program.module.graph.nodes)
    report = dm.report()
    assert report.attention_tp == 2 and 0 < report.attention_tp_split < report.attention_parameters
    _check(model, dm)


def test_sections_of_a_fused_projection():
    """Each rank holds its share of every section: [q0 q1 | k0 k1 | v0 v1] -> [q0 k0 v0], [q1 k1 v1]."""
    full = torch.arange(16).reshape(8, 2)
    split = Split(dim=0, sections=(4, 2, 2))
    assert split.divides(8, 2) and not split.divides(8, 4)
    assert torch.equal(split.local(full, 0, 2), full[[0, 1, 4, 6]])
    assert torch.equal(split.local(full, 1, 2), full[[2, 3, 5, 7]])
    assert Split(**json.loads(json.dumps(asdict(split)))) == split  # as the manifest stores it


def test_attention_tp_refuses_what_it_cannot_split():
    model = _model("llama")  # 4 query heads, 2 key/value heads
    with pytest.raises(afdc.PlanError, match="--attn-tp 3 does not divide the model's 4 attention heads"):
        afdc.disaggregate(model, "1A1F", attention_tp=3)
    with pytest.raises(afdc.PlanError, match="--attn-tp 4 does not divide the model's 2 key/value heads"):
        afdc.disaggregate(model, "1A1F", attention_tp=4)
    with pytest.raises(afdc.PlanError, match=r"--attn-tp \(attention_tp\) must be at least 1"):
        afdc.Plan.parse("1A1F", attention_tp=0)
    # XGLM's embedding is an index_select (its weight kept whole) and its attention folds the
    # heads into the batch dim, which no rule splits: every weight stays whole, and it says why,
    # naming the line of model source
    with pytest.raises(afdc.PlanError, match=r"reshape at modeling_xglm\.py:\d+ \(\w+ = \w+\.reshape"):
        afdc.disaggregate(catalog.build(catalog.entry("xglm")), "1A1F", attention_tp=2)
    # Doge's dynamic mask has a value per head computed from all of them: it cannot follow a split
    with pytest.raises(afdc.PlanError, match="mask has a value per head"):
        afdc.disaggregate(catalog.build(catalog.entry("doge")), "1A1F", attention_tp=2)


def test_attention_tp_artifact(tmp_path):
    model = _model("llama")
    model.save_pretrained(tmp_path / "src")
    out = tmp_path / "art"
    afdc.compile_model(str(tmp_path / "src"), afdc.Plan.parse("2A1F", attention_tp=2), out, progress=False)
    manifest = read_manifest(out)
    assert manifest.attention_splits["model.layers.0.self_attn.q_proj.weight"] == Split(dim=0)
    assert manifest.attention_splits["model.layers.0.self_attn.o_proj.weight"] == Split(dim=1)
    assert "model.embed_tokens.weight" not in manifest.attention_splits  # whole on every TP rank
    attn = [r for r in manifest.ranks if r.role == "attn"]
    assert [(r.rank, r.tp_rank, r.weights) for r in attn] == [
        (a, t, [f"weights/attn-tp{t}-state.safetensors", f"weights/attn-tp{t}.safetensors"])
        for a in range(2)
        for t in range(2)
    ]
    shard = afdc.load(out, "attn", 1, tp_rank=1)  # one TP rank: only its heads
    full = model.get_parameter("model.layers.0.self_attn.q_proj.weight")
    torch.testing.assert_close(_weight(shard, "layers.0.self_attn.q_proj.weight"), full[full.shape[0] // 2 :])
    with pytest.raises(ArtifactError, match="2 TP ranks per attn rank"):
        afdc.load(out, "attn", 0, tp_rank=2)
    _check(model, afdc.load_deployment(out))


def test_attention_tp_with_ffn_servers_and_a_lost_rank():
    """FFN ranks in other processes: TP rank 0 alone talks to them; when one dies, every TP rank
    stops at once with afdc.PeerLost (not after the TP group's own timeout)."""
    model = _model("qwen3_moe")
    dm = afdc.disaggregate(model, "1A2F", attention_tp=2, micro_batches=2)
    ids, mask = _batch(model.config.vocab_size)
    expect = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
    timeout = 5.0
    with dm.launch("gloo", timeout=timeout, join_timeout=60) as cluster:
        assert dm.attention.timeout == timeout + 60
        assert torch.equal(dm.generate(ids, mask, max_new_tokens=4, pad_token_id=0), expect)
        killer = threading.Timer(0.3, cluster.kill, (1,))
        killer.start()
        started = time.monotonic()
        with pytest.raises(PeerLost, match="ffn rank 1 lost"):
            dm.generate(ids, mask, max_new_tokens=10_000, pad_token_id=0)
        killer.join()
        assert time.monotonic() - started < 0.3 + timeout + 5
        cluster.start(1)
        assert torch.equal(dm.generate(ids, mask, max_new_tokens=4, pad_token_id=0), expect)


def test_attention_tp_under_the_afdc_backend():
    """The GPU default path: afdc's kernels in every TP rank's program (not Inductor, see
    afdc.lowering.backends.lower) and in the FFN's, Inductor for the rest of the FFN."""
    model = _model("qwen3_moe")
    dm = afdc.disaggregate(model, "1A2F", attention_tp=2, backend="afdc", micro_batches=2)
    assert [s.backend for s in dm.attention.shards] == ["afdc", "afdc"]
    _check(model, dm)
