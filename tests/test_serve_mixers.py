"""Serving models with more per-layer state than K and V under vLLM, with the official ``openai``
client: stateful-mixer hybrids (each mixer's state in vLLM's hybrid KV-cache groups, Mamba-style
state specs, one block per request) and DeepSeek-V3.2-style sparse attention (the indexer's keys
in the paged blocks beside K and V).

Greedy completions, concurrent and under preemption (a pool too small for every request),
equal ``dm.generate`` of the same artifact, for Gated DeltaNet hybrid MoEs (Qwen3-Next, and
Qwen3.5-MoE, whose vLLM implementation imports torchvision: vLLM resolves it to afdc's served-model
class and never imports its own), Mamba-2 hybrid MoEs (Granite 4 hybrid, Nemotron-H), a
lightning-attention hybrid MoE whose state lives in a cache class of its own (MiniMax),
DeepSeek-V3.2 and DeepSeek-V4 (each attention with its compressors a mixer whose growing state is
held in fixed-size state blocks sized from --max-model-len); and one with less: Gemma 3n, whose last
layers read earlier layers' keys and values; and a multimodal checkpoint's language model
(Qwen3-VL-MoE).
"""

from __future__ import annotations

import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForImageTextToText

pytest.importorskip("vllm")
openai = pytest.importorskip("openai")
pytestmark = pytest.mark.slow  # vLLM servers: run first (tests/conftest.py)

import afdc  # noqa: E402
from afdc.compile import compile_model  # noqa: E402
from afdc.demo import demo_tokenizer  # noqa: E402
from models_supported import catalog  # noqa: E402
from tests.test_serve import (  # noqa: E402
    PREFIX_CACHING,
    _assert_prefix_caching_and_preemption,
    _complete,
    _counter,
    _reference,
    _serving,
)
from tests.tiers import sweep  # noqa: E402

VOCAB = 512
PROMPTS = [[5, 17, 99, 230], [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 300], [42], [260, 261, 262, 263, 264, 265]]


def _artifact(root: Path, model_type: str, plan: str, micro_batches: int = 1, attention_tp: int = 1) -> Path:
    source, out = root / f"{model_type}-src", root / f"{model_type}-{plan}-m{micro_batches}-tp{attention_tp}"
    model = catalog.build_type(model_type, {**catalog.entry(model_type).config_kwargs, "vocab_size": VOCAB})
    model.save_pretrained(source)
    demo_tokenizer(VOCAB).save_pretrained(source)
    plan = afdc.Plan.parse(plan, micro_batches=micro_batches, attention_tp=attention_tp)
    compile_model(str(source), plan, out, progress=False)
    return out


def _check_completions(client, artifact: Path) -> None:
    """8 concurrent greedy completions of PROMPTS equal dm.generate."""
    ref = _reference(artifact, PROMPTS)
    with ThreadPoolExecutor(8) as pool:
        assert list(pool.map(lambda p: _complete(client, p), PROMPTS * 2)) == ref * 2


@pytest.mark.parametrize(
    ("model_type", "plan", "micro_batches", "backend"),
    [
        ("qwen3_next", "2A2F", 2, None),
        ("minimax", "1A2F", 1, None),
        sweep("qwen3_5_moe_text", "1A1F", 1, None),  # Gated DeltaNet as qwen3_next; its vLLM import quirk
        sweep("nemotron_h", "1A1F", 1, None),  # Mamba-2 as granitemoehybrid (test_hybrid_preemption_keeps_outputs)
        ("longcat_flash", "1A2F", 1, None),
        sweep("dbrx", "2A2F", 1, None),  # experts in a Python loop, as LongCat-Flash's; no mixer
        ("deepseek_v4", "1A2F", 1, None),
    ],
)
def test_hybrid_completions_equal_afdc_generate(tmp_path, model_type, plan, micro_batches, backend):
    """With two micro-batches, they take turns in the engine core's thread, each with its own
    mixer states (DeepSeek-V3.2's: test_sparse_attention_in_micro_batches_with_prefix_caching_and_preemption).
    (Granite 4 hybrid, and Qwen3-Next under --attn-tp 2 and ``inductor``: test_hybrid_preemption_keeps_outputs.)
    LongCat-Flash has no mixer but two MLA calls per layer, experts captured from a Python loop
    (its identity experts' gate/up rows not in the FFN files) and a MoE received after the next
    attention. DeepSeek-V4 has no attention op outside its mixers (only state blocks per request),
    its steps run as rows, and requests of different lengths decode side by side (a group per
    length); prefix caching is off and, its blocks never growing, vLLM never preempts it."""
    artifact = _artifact(tmp_path, model_type, plan, micro_batches)
    with _serving(artifact, "shm", tmp_path, ("--return-tokens-as-token-ids",), backend=backend) as (client, _):
        _check_completions(client, artifact)


# Qwen3-Next's one server runs what it would take two to run one by one (a vLLM start is most of a
# served test's time): --attn-tp 2, two micro-batches and ``inductor``
@pytest.mark.parametrize(
    ("model_type", "plan", "micro_batches", "attention_tp", "backend"),
    [("qwen3_next", "1A1F", 2, 2, "inductor"), ("granitemoehybrid", "1A2F", 1, 1, None)],
)
def test_hybrid_preemption_keeps_outputs(tmp_path, model_type, plan, micro_batches, attention_tp, backend):
    """A pool of 12 blocks for 6 requests that each need an attention block per 16 tokens and a
    state block: vLLM preempts requests to free blocks, and a resumed request recomputes its
    state from its tokens; the outputs stay those of dm.generate (Gated DeltaNet and Mamba-2).
    Then concurrent greedy completions on the same server equal dm.generate too: under --attn-tp 2
    each TP rank runs the mixers whole on its own view of the step; with two micro-batches they take
    turns in the engine core's thread, each with its own mixer states; under ``inductor`` the
    program runs in pieces, and the worker's warm-up steps before serving (their keys and mixer
    states written into the null block) leave every request's tokens as they were."""
    artifact = _artifact(tmp_path, model_type, plan, micro_batches, attention_tp)
    prompts = [list(range(100 + i, 130 + i)) for i in range(6)]
    ref = _reference(artifact, prompts, 24)
    args = ("--return-tokens-as-token-ids", "--block-size", "16", "--num-gpu-blocks-override", "12",
            "--max-num-seqs", "6")
    with _serving(artifact, "shm", tmp_path, args, backend=backend) as (client, _):
        with ThreadPoolExecutor(6) as pool:
            got = list(pool.map(lambda p: _complete(client, p, 24), prompts))
        metrics = urllib.request.urlopen(str(client.base_url).removesuffix("/v1/") + "/metrics").read().decode()
        _check_completions(client, artifact)
    assert got == ref
    assert _counter(metrics, "vllm:num_preemptions_total") > 0
    log = (tmp_path / "attn.log").read_text()
    assert f"{attention_tp} TP ranks, {micro_batches} micro-batches, backend {backend or 'eager'}" in log


def test_sparse_attention_in_micro_batches_with_prefix_caching_and_preemption(tmp_path):
    """DeepSeek-V3.2 at 2A2F with two micro-batches: its indexer picks 4 keys per query from its own
    paged key cache, decoding requests run as the rows of one padded batch per micro-batch, prefills
    alone; concurrent greedy completions equal dm.generate. Its indexer keys are per token, like K
    and V, so prefix caching stays on: then, on the same server (a pool of 10 blocks of 16 tokens per
    engine), 8 concurrent requests sharing a 32-token prefix reuse the cached prefix blocks (their
    indexer keys included) and are preempted to free blocks; the outputs stay those of dm.generate."""
    artifact = _artifact(tmp_path, "deepseek_v32", "2A2F", micro_batches=2)
    with _serving(artifact, "shm", tmp_path, ("--return-tokens-as-token-ids", *PREFIX_CACHING)) as (client, _):
        _check_completions(client, artifact)
        _assert_prefix_caching_and_preemption(client, artifact)


def test_layers_reading_earlier_layers_kv_with_prefix_caching_and_preemption(tmp_path):
    """Gemma 3n at 1A2F with two micro-batches: its last 2 layers attend over the keys and values of
    earlier layers (KV sharing), beside AltUp, LAuReL and per-layer inputs on the attention side;
    concurrent greedy completions equal dm.generate, and so do requests that reuse cached prefix
    blocks and are preempted."""
    artifact = _artifact(tmp_path, "gemma3n_text", "1A2F", micro_batches=2)
    with _serving(artifact, "shm", tmp_path, ("--return-tokens-as-token-ids", *PREFIX_CACHING)) as (client, _):
        _check_completions(client, artifact)
        _assert_prefix_caching_and_preemption(client, artifact)


def test_a_multimodal_checkpoints_language_model_is_served(tmp_path):
    """Qwen3-VL-MoE has no causal-LM class, only an image-text-to-text one: its artifact holds the
    language model (experts, M-RoPE over three position axes) and serves text like any model, in a
    fresh worker process that imports the model's own output class to read the program's output.
    Concurrent greedy completions equal dm.generate."""
    text = {**catalog.TINY_COMMON, **catalog.entry("qwen3_moe").config_kwargs, "vocab_size": VOCAB,
            "rope_parameters": {"rope_theta": 1e4, "rope_type": "default", "mrope_section": [2, 1, 1]}}
    vision = {"depth": 1, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2, "out_hidden_size": 32,
              "deepstack_visual_indexes": [0], "num_position_embeddings": 16}
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(
        AutoConfig.for_model("qwen3_vl_moe", text_config=text, vision_config=vision), dtype=torch.float32)
    model.save_pretrained(tmp_path / "src")
    demo_tokenizer(VOCAB).save_pretrained(tmp_path / "src")
    compile_model(str(tmp_path / "src"), afdc.Plan.parse("1A2F"), tmp_path / "art", progress=False)
    with _serving(tmp_path / "art", "shm", tmp_path, ("--return-tokens-as-token-ids",)) as (client, _):
        _check_completions(client, tmp_path / "art")


def test_manifest_state_is_what_serving_allocates(tmp_path):
    artifact = _artifact(tmp_path, "granitemoehybrid", "1A1F")
    manifest = afdc.artifact.manifest.read_manifest(artifact)
    assert manifest.mixers and all(m.state for m in manifest.mixers)
    from afdc.runtime.paged import MixerStateStore

    store = MixerStateStore(manifest.mixers, 3)
    for site in manifest.mixers:
        assert [tuple(t.shape[1:]) for t in store.tensors[site.slot]] == [t.shape for t in site.state]
        assert [t.dtype for t in store.tensors[site.slot]] == [getattr(torch, t.dtype) for t in site.state]
