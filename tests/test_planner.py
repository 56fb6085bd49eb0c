"""`afdc plan`: the per-token cost walk against hand-computed values, and the planner's model.

The cost tests build tiny models on the meta device (config dtype float32: 4 bytes per element
crossing the cut) and ask for the KV cache in bf16 (2 bytes). Every expected value is written out
so that a reader can check it against the architecture.
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace

import pytest
import sympy
from click.testing import CliRunner
from transformers import AutoConfig

import afdc
from afdc.api import Built, build
from afdc.cli import main
from afdc.errors import AfdcError, PlanError
from afdc.passes.graph_facts import token_symbols
from afdc.planner import (
    Assumptions,
    LayerFacts,
    ModelFacts,
    afd_step,
    balance,
    fan_out,
    ffn_bytes_per_gpu,
    ffn_read_per_gpu,
    model_facts,
    plan,
    require_matplotlib,
    split_for_planning,
)
from afdc.planner.cost import FORMULATION_LATENT, FORMULATION_STANDARD, DecodeCost, decode_cost, op_flops
from afdc.planner.hardware import HardwareError, HardwareProfile, get_profile, load_profiles
from afdc.planner.result import format_ms
from afdc.source import empty_model
from models_supported.catalog import entry

L = 100  # context length of the cost tests
KV = 2  # bf16 KV cache


def _split(config) -> Built:
    return build(empty_model(config), afdc.Plan.parse("1A1F"))


# --------------------------------------------------------------------------- (a) GQA dense llama


def _angle_table_flops(built: Built) -> float:
    """One token's FLOPs in the rotary embedding's angle table where it is a matmul (transformers
    5.17: ``inv_freq @ positions``, d/2 products; later versions multiply elementwise: 0)."""
    graph = built.attention_graph
    rotary = [n for n in graph.nodes if any(k.endswith("rotary_emb") for k in n.meta.get("nn_module_stack", {}))]
    return float(sum((op_flops(n) for n in rotary), sympy.Integer(0)).subs(dict.fromkeys(token_symbols(graph), 1)))


@pytest.fixture(scope="module")
def llama():
    # hidden 32, 4 query heads of 8, 2 KV heads, FFN 64, vocab 128, 2 layers, untied head
    cfg = AutoConfig.for_model(
        "llama", vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
    )  # fmt: skip
    return _split(cfg)


def test_cost_gqa_dense_llama(llama):
    c = decode_cost(llama, L, kv_dtype_bytes=KV)
    layers, h, heads, kv_heads, d, ffn, vocab = 2, 32, 4, 2, 8, 64, 128
    # K and V of each KV head for every cached token
    assert c.kv_bytes == layers * L * (2 * kv_heads * d) * KV == 12_800
    # QK^T and PV: every query head against L keys of d dims, and L values of d dims
    assert c.attention_flops == layers * 2 * heads * L * (d + d) == 25_600
    # q (h->32), k (h->16), v (h->16), o (32->h) per layer, plus the LM head (h->vocab)
    assert c.linear_flops - _angle_table_flops(llama) == layers * 2 * h * (32 + 16 + 16 + 32) + 2 * h * vocab == 20_480
    # gate, up and down: three h x ffn matmuls
    assert c.ffn_flops == layers * 2 * 3 * h * ffn == 24_576
    # the normed hidden state goes out, the FFN output comes back: h floats each way per layer
    assert c.cut_bytes_to_ffn == c.cut_bytes_to_attn == layers * h * 4 == 256
    assert c.formulation == FORMULATION_STANDARD


# --------------------------------------------------------------------------- (b) MoE with shared experts


@pytest.fixture(scope="module")
def qwen2_moe():
    # 8 experts of 16, top-2, a shared expert of 48 with its sigmoid gate, GQA as above
    cfg = AutoConfig.for_model(
        "qwen2_moe", vocab_size=128, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
        shared_expert_intermediate_size=48, num_experts=8, num_experts_per_tok=2, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, decoder_sparse_step=1, mlp_only_layers=[],
    )  # fmt: skip
    return _split(cfg)


def test_cost_moe_with_shared_expert(qwen2_moe):
    c = decode_cost(qwen2_moe, L, kv_dtype_bytes=KV)
    h, experts, top_k, moe_ffn, shared_ffn = 32, 8, 2, 16, 48
    router = 2 * h * experts  # 512
    routed = top_k * 2 * 3 * h * moe_ffn  # 6144: only the chosen experts run
    shared = 2 * 3 * h * shared_ffn  # 9216
    shared_gate = 2 * h * 1  # 64
    assert [layer.ffn_flops for layer in c.ffn_layers] == [router + routed + shared + shared_gate] * 2 == [15_936] * 2
    assert c.ffn_flops == 31_872
    assert c.kv_bytes == 2 * L * (2 * 2 * 8) * KV
    # the planner recovers one expert's size and the always-read part from totals alone
    facts = model_facts(qwen2_moe, L)
    layer = facts.layers[0]
    assert layer.count == 2 and layer.experts == experts and layer.top_k == top_k
    assert layer.expert_bytes == 3 * h * moe_ffn * 2  # bf16 weights
    assert layer.ffn_fixed_bytes == (3 * h * shared_ffn + h * experts + h) * 2  # shared + router + gate


# --------------------------------------------------------------------------- (c) MLA


@pytest.fixture(scope="module")
def deepseek_v3():
    # MLA: latent 16, rotary key 8, no-rope 8, value 8, 4 heads; first layer dense, then 8 experts
    # top-2 (2 groups, 1 chosen) and one shared expert
    cfg = AutoConfig.for_model(
        "deepseek_v3", vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=3, first_k_dense_replace=1, n_routed_experts=8, num_experts_per_tok=2, n_group=2,
        topk_group=1, n_shared_experts=1, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32,
        kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
    )  # fmt: skip
    return _split(cfg)


def test_cost_mla_latent_form(deepseek_v3):
    c = decode_cost(deepseek_v3, L, kv_dtype_bytes=KV)
    layers, h, heads, latent, rope, nope, v, vocab = 3, 64, 4, 16, 8, 8, 8, 256
    assert c.formulation == FORMULATION_LATENT
    # the cache holds the normed latent and the shared rotary key, not per-head K and V
    assert c.kv_bytes == layers * L * (latent + rope) * KV == 14_400
    # absorbed: each head scores against latent+rope dims and sums latent dims
    assert c.attention_flops == layers * 2 * heads * L * ((latent + rope) + latent) == 96_000
    # q_a (h->32), q_b (32->4*16), kv_a (h->16+8), kv_b (16->4*(8+8)), o (4*8->h); absorbing kv_b into
    # the query and output sides costs the same 2*16*4*(8+8) per token
    q_a, q_b, kv_a = h * 32, 32 * heads * (nope + rope), h * (latent + rope)
    kv_b, o = latent * heads * (nope + v), heads * v * h
    per_layer = 2 * (q_a + q_b + kv_a + kv_b + o)
    assert per_layer == 17_408
    assert c.linear_flops - _angle_table_flops(deepseek_v3) == layers * per_layer + 2 * h * vocab == 84_992
    dense = 2 * 3 * h * 128  # 49152
    moe = 2 * 3 * h * 32 * (2 + 1) + 2 * h * 8  # two routed + one shared expert + router: 37888
    assert [layer.ffn_flops for layer in c.ffn_layers] == [dense, moe, moe]


@pytest.fixture(scope="module")
def deepseek_v32():
    # one layer of the MLA model above (its dense MLP: the attention side is what DSA changes) plus
    # DeepSeek Sparse Attention's lightning indexer: 2 heads of 16, the top 32 keys
    cfg = AutoConfig.for_model(
        "deepseek_v32", vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
        first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32,
        kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
        index_n_heads=2, index_head_dim=16, index_topk=32,
    )  # fmt: skip
    return build(empty_model(cfg), afdc.Plan.parse("1A1F"), rewrite=False)  # the planner's capture, no codegen


def test_cost_sparse_attention_reads_top_k_keys_and_the_indexer_reads_them_all(deepseek_v32):
    h, heads, latent, rope, vocab = 64, 4, 16, 8, 256
    idx_heads, idx_dim, top_k, q_lora = 2, 16, 32, 32
    c = decode_cost(deepseek_v32, L, kv_dtype_bytes=KV)
    # held: the latent + rotary key and the indexer's key at every position
    assert c.kv_bytes == L * (latent + rope + idx_dim) * KV == 8_000
    # read: the latent at the top-k's positions, the indexer's keys at all of them
    assert c.kv_read_bytes == (top_k * (latent + rope) + L * idx_dim) * KV == 4_736
    # absorbed MLA over the top-k keys, plus the indexer's scores (q.k per head, then the head weights)
    mla = 2 * heads * top_k * ((latent + rope) + latent)
    indexer = 2 * idx_heads * idx_dim * L + 2 * idx_heads * L
    assert c.attention_flops == mla + indexer == 17_040
    # the indexer's projections (wq_b from the query latent, wk and the head weights from the hidden
    # state) are linear FLOPs; its scoring against the cache is not (it grows with the context).
    # The MLA layer's own: 17_408 (test_cost_mla_latent_form), the LM head 2 * h * vocab
    projections = 2 * (q_lora * idx_heads * idx_dim + h * idx_dim + h * idx_heads)
    assert c.linear_flops - _angle_table_flops(deepseek_v32) == 17_408 + projections + 2 * h * vocab
    # below the top-k every key is read: held and read agree
    short = decode_cost(deepseek_v32, 20, kv_dtype_bytes=KV)
    assert short.kv_read_bytes == short.kv_bytes == 20 * (latent + rope + idx_dim) * KV


# --------------------------------------------------------------------------- (d) sliding window


@pytest.fixture(scope="module")
def gpt_oss():
    # alternating sliding (window 16) and full attention layers; 4 experts top-2
    cfg = AutoConfig.for_model(
        "gpt_oss", vocab_size=128, hidden_size=32, intermediate_size=16, num_local_experts=4,
        num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        sliding_window=16, layer_types=["sliding_attention", "full_attention"], max_position_embeddings=256,
    )  # fmt: skip
    return _split(cfg)


def test_cost_sliding_window_reads_only_the_window(gpt_oss):
    c = decode_cost(gpt_oss, L, kv_dtype_bytes=KV)
    window, heads, kv_heads, d = 16, 4, 2, 8
    sliding, full = c.attention_layers
    assert sliding.kv_bytes == min(L, window) * 2 * kv_heads * d * KV == 1_024
    assert full.kv_bytes == L * 2 * kv_heads * d * KV == 6_400
    assert sliding.attention_flops == 2 * heads * min(L, window) * (d + d) == 2_048
    assert full.attention_flops == 2 * heads * L * (d + d) == 12_800
    assert c.kv_bytes == 7_424 and c.attention_flops == 14_848
    # below the window a sliding layer reads the whole context
    short = decode_cost(gpt_oss, 10, kv_dtype_bytes=KV)
    assert short.attention_layers[0].kv_bytes == short.attention_layers[1].kv_bytes == 10 * 32 * KV
    # router (h->4) and two experts of gate_up (h->2*16) and down (16->h)
    assert [layer.ffn_flops for layer in c.ffn_layers] == [2 * 32 * 4 + 2 * (2 * 32 * 32 + 2 * 16 * 32)] * 2


# --------------------------------------------------------------------------- one capture per distinct layer


def _catalog_config(model_type: str, layers: int):
    """The catalog's tiny config with ``layers`` layers (per-layer lists repeated to match)."""
    kwargs = dict(entry(model_type).config_kwargs)
    old = kwargs.get("num_hidden_layers", 2)
    kwargs = {k: (v * layers)[:layers] if isinstance(v, list) and len(v) == old else v for k, v in kwargs.items()}
    return AutoConfig.for_model(model_type, **{**kwargs, "num_hidden_layers": layers})


@pytest.mark.parametrize(
    ("model_type", "layers", "prefix", "distinct"),
    [
        ("deepseek_v3", 5, 3, 2),  # first layer dense, then MoE: layers 0-2 captured, 3-4 counted as 1-2
        ("gpt_oss", 6, 4, 2),  # sliding and full attention alternating: 0-3 captured, 4-5 as 0-1
        ("lfm2", 6, 4, 2),  # short convolution and attention alternating
    ],
)
def test_prefix_capture_costs_what_the_full_capture_costs(model_type, layers, prefix, distinct):
    model = empty_model(_catalog_config(model_type, layers))
    short, pattern = split_for_planning(model)
    assert pattern is not None and pattern.prefix == prefix and len(set(pattern.first)) == distinct
    assert len(model.get_submodule(pattern.path)) == layers  # the model got its layers back
    full = build(model, afdc.Plan.parse("1A1F"))
    assert len(short.report.layers) < len(full.report.layers)
    for context in (2, 4096):  # below and past the sliding window
        short_facts = model_facts(short, context, "fp8", "bf16", layers=pattern)
        assert short_facts == model_facts(full, context, "fp8", "bf16")
        assert short_facts.layer_count == layers


def test_prefix_capture_falls_back_when_layers_differ_by_position_alone(monkeypatch):
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    forward = LlamaDecoderLayer.forward

    def first_layer_runs_its_mlp_twice(self, hidden_states, *args, **kwargs):
        if self.self_attn.layer_idx == 0:  # nothing in the modules says so: only the capture shows it
            hidden_states = hidden_states + self.mlp(hidden_states)
        return forward(self, hidden_states, *args, **kwargs)

    monkeypatch.setattr(LlamaDecoderLayer, "forward", first_layer_runs_its_mlp_twice)
    built, pattern = split_for_planning(empty_model(_catalog_config("llama", 4)))
    assert pattern is None and built.report.attention_calls == 4  # the full capture, all four layers


# --------------------------------------------------------------------------- planner model (synthetic)

TOY = HardwareProfile(
    name="TOY", peak_flops={"bf16": 1e15}, hbm_bandwidth=1e12, hbm_capacity=100e9,
    interconnect_bandwidth=1e9, nic_bandwidth=1e9, price_per_hour=1.0,
)  # fmt: skip
EXACT = Assumptions(activation_reserve=0.0, hbm_efficiency=1.0, compute_efficiency=1.0, network_efficiency=1.0)


def _toy_facts(count: int = 1000, to_ffn: float = 187.5, **layer) -> ModelFacts:
    """A dense model whose attention reads 1 MB of KV per sequence and layer and holds no weights,
    and whose FFN does 0.25 us of work per token at 1 PFLOP/s, reading no weights."""
    values = dict(
        count=count, kv_bytes=1e6, attention_flops=0.0, linear_flops=0.0, attention_weight_bytes=0.0,
        ffn_flops=2.5e8, ffn_fixed_bytes=0.0, expert_bytes=0.0, experts=0, top_k=0,
        to_ffn_bytes=to_ffn, to_attn_bytes=to_ffn,
    )  # fmt: skip
    values.update(layer)
    lf = LayerFacts(**values)
    cost = DecodeCost(8192, 2, FORMULATION_STANDARD, 0, 0, 0, 0, 0, 0)
    return ModelFacts("toy", 8192, "bf16", "bf16", cost, (lf,), 1e9, 1e9, 0.0)


def test_balance_ratio_equalizes_attention_and_ffn():
    # micro-batch of 10 sequences: attention reads 10 x 1 MB at 1 TB/s = 10 us per layer;
    # r attention GPUs send 10r tokens to each FFN GPU: 10r x 0.25 us = 2.5r us, equal at r = 4
    bal = balance(_toy_facts(count=1), TOY, TOY, y=2, batch=10, a=EXACT)
    assert bal.attention_ms == pytest.approx(10e-3)
    assert bal.ratio == pytest.approx(4.0, rel=1e-6)
    assert bal.compute_ratio == pytest.approx(4.0)
    assert not bal.read_bound


def test_micro_batches_follow_megascale_rule_and_layer_time_follows_simulator():
    # one-way transfer per sequence: 187.5 B at 1 GB/s = 0.1875 us; FFN 0.25 us: Tc/Tf = 0.75,
    # so m >= 2(1 + 0.75) = 3.5: four micro-batches
    facts = _toy_facts(count=1000)
    point = afd_step(facts, TOY, TOY, x=1, y=1, batch=8, a=EXACT)
    assert point.needed == pytest.approx(3.5)
    assert point.micro_batches == 4
    # micro-batches of 2: attention 2 us, FFN 0.5 us, transfers 0.375 us each way; a layer takes
    # max(a + f + c_out + c_back, m * max(a, f, c_out, c_back)) = max(3.25, 8) = 8 us
    assert point.tpot == pytest.approx(1000 * 8e-6)
    # with a slow link the transfers are the slowest stage and m is capped
    slow = afd_step(_toy_facts(count=1, to_ffn=10_000.0), TOY, TOY, x=1, y=1, batch=8, a=EXACT)
    assert slow.micro_batches == EXACT.max_micro_batches and slow.needed > slow.micro_batches


def test_replicated_dense_ffn_trades_memory_and_weight_reads_for_traffic():
    # a dense FFN of 4 GB over y = 4 GPUs: split, each holds and reads 1 GB and every token goes
    # to all 4; replicated, each holds and reads 4 GB and a token goes to one of them
    facts = _toy_facts(count=1, ffn_fixed_bytes=4e9)
    (layer,) = facts.layers
    assert (ffn_bytes_per_gpu(layer, 4), fan_out(layer, 4)) == (1e9, 4.0)
    assert (ffn_bytes_per_gpu(layer, 4, "replicate"), fan_out(layer, 4, "replicate")) == (4e9, 1.0)
    assert ffn_read_per_gpu(layer, 4, 64, "replicate") == 4e9
    tp = afd_step(facts, TOY, TOY, x=1, y=4, batch=8, a=EXACT)
    rep = afd_step(facts, TOY, TOY, x=1, y=4, batch=8, a=replace(EXACT, dense_ffn="replicate"))
    # times are per micro-batch (batch / m tokens): a quarter of the bytes for the same tokens
    assert rep.times.to_ffn * rep.micro_batches == pytest.approx(tp.times.to_ffn * tp.micro_batches / 4)
    assert rep.times.ffn > tp.times.ffn  # each GPU reads the whole layer


def test_plan_prefers_memory_or_tpot_and_compares_monolithic():
    r = plan(_toy_facts(), TOY, TOY, tpot_ms=50, assumptions=EXACT)
    assert r.afd is not None and r.afd.tpot_ms <= 50
    assert r.afd.batch_limit in ("memory", "tpot")
    assert r.monolithic and all(d.tpot_ms <= 50 for d in r.monolithic)
    assert any(line.startswith(("AFD wins", "AFD loses")) for line in r.explanation)


def test_impossible_tpot_says_by_how_much():
    # batch 1: attention 1 us + FFN 0.25 us + 2 x 0.1875 us per layer, 1000 layers: 1.625 ms (AFD);
    # monolithic on one GPU moves nothing: 1.25 ms. Against 1.2 ms: 35% and 4% over.
    with pytest.raises(PlanError) as err:
        plan(_toy_facts(), TOY, TOY, tpot_ms=1.2, assumptions=EXACT)
    msg = str(err.value)
    assert "TPOT 1.2 ms cannot be met: even batch 1 needs 1.6 ms (35% over)" in msg
    assert "monolithic on TOY: TPOT 1.2 ms cannot be met: even batch 1 needs 1.2 ms (4% over)" in msg


def test_context_that_does_not_fit_says_so():
    huge = _toy_facts(kv_bytes=1e9)  # 1000 layers x 1 GB: one sequence needs 1 TB
    with pytest.raises(PlanError, match=r"context 8192 does not fit on TOY: attention weights 1.0 GB plus one"):
        plan(huge, TOY, TOY, tpot_ms=1e6, assumptions=EXACT)


# --------------------------------------------------------------------------- hardware


def test_builtin_profiles_cover_the_issue_list():
    names = set(load_profiles())
    assert {"H100", "H200", "H800", "H20", "A100", "A800", "L40S", "B200", "Ascend910B"} <= names
    h20 = get_profile("h20")
    assert h20.flops("bf16") == 148e12 and h20.flops("fp8") == 296e12 and h20.hbm_capacity == 96e9
    assert get_profile("A100").flops("fp8") == 312e12  # no FP8: weight-only, bf16 math
    assert get_profile("ascend 910b").name == "Ascend910B"


def test_unknown_hardware_lists_the_known_ones():
    with pytest.raises(HardwareError) as err:
        get_profile("H9000")
    msg = str(err.value)
    assert isinstance(err.value, AfdcError)
    assert "unknown hardware 'H9000'" in msg
    assert all(name in msg for name in ("A100", "A800", "Ascend910B", "B200", "H100", "H20", "H200", "H800", "L40S"))


def test_hw_file_adds_and_overrides(tmp_path):
    path = tmp_path / "hw.json"
    mine = {"name": "MyChip", "peak_flops": {"bf16": 5e14}, "hbm_bandwidth": 2e12, "hbm_capacity": 64e9,
            "interconnect_bandwidth": 1e11, "nic_bandwidth": 2.5e10, "price_per_hour": 0.5}  # fmt: skip
    cheap_h20 = {**get_profile("H20").__dict__, "price_per_hour": 0.1, "aliases": []}
    path.write_text(json.dumps({"profiles": [mine, cheap_h20]}))
    profiles = load_profiles(path)
    assert get_profile("mychip", profiles).hbm_bandwidth == 2e12
    assert get_profile("H20", profiles).price_per_hour == 0.1
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([{"name": "X", "peak_flops": {"bf16": 1}}]))
    with pytest.raises(HardwareError, match="lacks hbm_bandwidth"):
        load_profiles(bad)


# --------------------------------------------------------------------------- dtypes and the command line


def test_dtype_options_change_the_numbers(llama):
    base = model_facts(llama, 4096, "bf16", "bf16")
    fp8_weights = model_facts(llama, 4096, "fp8", "bf16")
    fp8_kv = model_facts(llama, 4096, "bf16", "fp8")
    assert fp8_weights.attention_weight_bytes == base.attention_weight_bytes / 2
    assert fp8_weights.ffn_weight_bytes == base.ffn_weight_bytes / 2
    assert fp8_weights.kv_bytes == base.kv_bytes
    assert fp8_kv.kv_bytes == base.kv_bytes / 2 == 2 * 4096 * 32
    assert fp8_kv.ffn_weight_bytes == base.ffn_weight_bytes
    # the attention weights read per step leave out the embedding table (a row gather)
    assert base.attention_read_bytes == (llama.report.attention_parameters - 128 * 32) * 2


@pytest.fixture(scope="module")
def llama_config_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("cfg") / "config.json"
    cfg = AutoConfig.for_model(
        "llama", vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
    )  # fmt: skip
    path.write_text(cfg.to_json_string())
    return str(path)


FIELDS = ("kv_bytes", "attention_flops", "linear_flops", "ffn_flops", "cut_bytes_to_ffn", "cut_bytes_to_attn")


def test_cli_plan_json_dtypes_and_plot(llama_config_file, tmp_path, llama):
    pytest.importorskip("matplotlib")
    png = tmp_path / "plan.png"
    args = ["plan", llama_config_file, "--context", "4096", "--attn-hw", "H20", "--ffn-hw", "H800"]
    args += ["--kv-dtype", "fp8", "--weight-dtype", "fp8", "--json", "--plot", str(png)]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    # the per-token fields are decode_cost's, with the KV cache at 1 byte per element
    cost = decode_cost(llama, 4096, kv_dtype_bytes=1)
    assert {k: data[k] for k in FIELDS} == {k: getattr(cost, k) for k in FIELDS}
    assert data["kv_bytes"] == 2 * 4096 * (2 * 2 * 8) * 1
    assert data["attention_weight_bytes"] == llama.report.attention_parameters * 1
    assert data["ffn_weight_bytes"] == llama.report.ffn_parameters * 1
    afd = data["plan"]["afd"]
    assert afd["name"] == f"{afd['attention_gpus']}A{afd['ffn_gpus']}F"
    assert afd["tpot_ms"] <= 50 and afd["tokens_per_gpu_s"] > 0 and afd["cost_per_million_tokens"] > 0
    assert data["plan"]["monolithic"] and data["plan"]["explanation"]
    assert png.stat().st_size > 10_000


def test_cli_plan_unknown_hardware_fails_before_capture(llama_config_file):
    result = CliRunner().invoke(main, ["plan", llama_config_file, "--attn-hw", "H9000"])
    assert result.exit_code == 2
    known = "A100, A800, Ascend910B, Ascend910C, B200, GB200, H100, H20, H200, H800, L40S"
    assert f"unknown hardware 'H9000'; known: {known}" in result.output


def test_plot_without_matplotlib_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails as if not installed
    with pytest.raises(PlanError, match=r"--plot needs matplotlib: pip install 'afdc\[plot\]'"):
        require_matplotlib()


def test_times_of_a_tiny_model_keep_their_digits():
    """A tiny model's per-layer times are microseconds: they print as such, not as 0.00 ms."""
    assert [format_ms(x) for x in (26.86, 3.356, 0.1, 0.0235, 0.0, 2e-4)] == [
        "26.86 ms", "3.36 ms", "0.10 ms", "0.024 ms", "0.00 ms", "0.2 us"
    ]


# --------------------------------------------------------------------------- interconnect, skew, W8A8, --compare


def test_local_share_and_a_round_over_both_fabrics():
    from afdc.planner.interconnect import local_share, round_time

    assert local_share(8, 8) == 1.0 and local_share(1, 8) == 1.0
    assert local_share(16, 8) == pytest.approx(7 / 15)  # 7 of 15 peers share the node
    hw = replace(TOY, interconnect_bandwidth=4e9, nic_bandwidth=1e9, scale_up_latency=1e-6, nic_latency=5e-6)
    # 8 MB, half the peers local: 4 MB at 4 GB/s = 1 ms beside 4 MB at 1 GB/s = 4 ms, plus the NIC's latency
    assert round_time(8e6, 0.5, hw, 1.0) == pytest.approx(4e-3 + 5e-6)
    assert round_time(8e6, 1.0, hw, 1.0) == pytest.approx(2e-3 + 1e-6)  # all in the domain
    assert round_time(0.0, 0.5, hw, 1.0) == 0.0


def test_per_message_latency_counts_once_per_transfer_in_afd_and_ep():
    facts = _toy_facts(count=10)
    slow = replace(TOY, scale_up_latency=1e-3)
    one = replace(EXACT, micro_batches=1)
    base, late = afd_step(facts, TOY, TOY, 1, 1, 8, one), afd_step(facts, slow, slow, 1, 1, 8, one)
    # one micro-batch: a layer is a + f + c_out + c_back, and each transfer pays 1 ms more
    assert late.tpot - base.tpot == pytest.approx(10 * 2 * 1e-3)
    assert late.micro_batches == base.micro_batches == 1
    from afdc.planner.deployment import mono_step

    assert mono_step(facts, slow, 1, 8, EXACT).tpot == mono_step(facts, TOY, 1, 8, EXACT).tpot  # one GPU sends nothing
    assert mono_step(facts, slow, 2, 8, EXACT).tpot > mono_step(facts, TOY, 2, 8, EXACT).tpot


# DeepEP-Ascend's low-latency kernels on an A3 (910C) 384 SuperPOD (sgl-project/sgl-kernel-npu
# README): 128 tokens a rank, hidden 7168, top-8 of 256, INT8 dispatch: latency by EP size
DEEPEP_ASCEND_DISPATCH_US = {8: 132, 16: 139, 32: 153}


@pytest.mark.parametrize("ep", sorted(DEEPEP_ASCEND_DISPATCH_US))
def test_910c_ep_dispatch_matches_deepep_ascend_within_5_percent(ep):
    from afdc.planner.deployment import dispatch_bytes
    from afdc.planner.interconnect import local_share, round_time

    hw, a = get_profile("Ascend910C"), Assumptions(dispatch_dtype="int8")
    facts = _toy_facts(count=1, experts=256, top_k=8, to_ffn=7168 * 2)  # bf16 hidden states, sent in int8
    layer = facts.layers[0]
    # what mono_step sends per dispatch: each token to the distinct ranks of its top-8, the own rank free
    remote = 128 * fan_out(layer, ep) * (ep - 1) / ep
    local = local_share(ep, hw.scale_up_domain)
    t = round_time(remote * dispatch_bytes(facts, layer, a), local, hw, a.network_efficiency)
    assert t * 1e6 == pytest.approx(DEEPEP_ASCEND_DISPATCH_US[ep], rel=0.05)


def test_expert_skew_slows_the_busiest_ffn_gpu_and_its_link():
    # a MoE layer: 8 experts of 1 MB, top-2, no fixed part; compute 0.25 us per token
    facts = _toy_facts(count=1, experts=8, top_k=2, expert_bytes=0.0)
    even = replace(EXACT, micro_batches=2)
    skewed = replace(even, expert_skew=1.5)
    a, b = afd_step(facts, TOY, TOY, 4, 2, 8, even), afd_step(facts, TOY, TOY, 4, 2, 8, skewed)
    assert b.times.ffn == pytest.approx(1.5 * a.times.ffn)
    assert b.times.to_ffn == pytest.approx(1.5 * a.times.to_ffn)  # the FFN end of the link is the slower end
    dense = _toy_facts(count=1)  # a dense FFN split by TP is balanced whatever the router
    assert afd_step(dense, TOY, TOY, 4, 2, 8, skewed).tpot == afd_step(dense, TOY, TOY, 4, 2, 8, even).tpot


def test_dispatch_dtype_and_fixed_micro_batches():
    facts = _toy_facts(count=1)
    bf16 = afd_step(facts, TOY, TOY, 1, 1, 8, replace(EXACT, micro_batches=2))
    int8 = afd_step(facts, TOY, TOY, 1, 1, 8, replace(EXACT, micro_batches=2, dispatch_dtype="int8"))
    assert bf16.micro_batches == int8.micro_batches == 2
    # the toy's cut is captured at 2 bytes an element: int8 halves what goes out, not what comes back
    assert int8.times.to_ffn == pytest.approx(bf16.times.to_ffn / 2)
    assert int8.times.to_attn == pytest.approx(bf16.times.to_attn)


def test_two_stage_exchange_sends_one_nic_copy_per_ffn_domain():
    # 16 FFN GPUs of another chip (two 8-GPU domains, nothing shared with attention), 8 experts,
    # top-2; an interconnect so fast that the NIC alone sets the time
    facts = _toy_facts(count=1, experts=8, top_k=2)
    hw_a = replace(TOY, interconnect_bandwidth=1e15)
    hw_f = replace(hw_a, name="TOYF")
    one, two = replace(EXACT, micro_batches=1), replace(EXACT, micro_batches=1, two_stage_exchange=True)
    flat, staged = afd_step(facts, hw_a, hw_f, 4, 16, 8, one), afd_step(facts, hw_a, hw_f, 4, 16, 8, two)
    # a token reaches 16(1 - (15/16)^2) = 1.94 GPUs but 2(1 - (1/2)^2) = 1.5 domains
    assert staged.times.to_ffn / flat.times.to_ffn == pytest.approx(1.5 / 1.9375)
    assert staged.times.to_attn / flat.times.to_attn == pytest.approx(1.5 / 1.9375)
    # inside one scale-up domain there is no NIC stage to save
    assert afd_step(facts, TOY, TOY, 4, 4, 8, two).tpot == afd_step(facts, TOY, TOY, 4, 4, 8, one).tpot


def test_tp_baseline_shards_weights_and_kv_and_pays_two_all_reduces_a_layer():
    from afdc.planner.deployment import tp_deployment, tp_step

    facts = _toy_facts(count=1)
    step = tp_step(facts, TOY, 4, 8, EXACT)
    # 8 sequences a GPU: 8 x 1 MB of KV at 1 TB/s = 8 us; 32 tokens x 0.25 us over 4 GPUs = 2 us;
    # each all-reduce moves 2 x 3/4 x 32 x 187.5 B = 9 kB at 1 GB/s = 9 us, twice
    assert step.times.attention == pytest.approx(8e-6)
    assert step.times.ffn == pytest.approx(2e-6)
    assert step.tpot == pytest.approx(8e-6 + 2e-6 + 2 * 9e-6)
    d = tp_deployment(facts, TOY, 4, 1.0, EXACT)
    # 2 GB of weights split four ways leave 99.5 GB for 1 MB sequences
    assert d.name == "TP4" and d.max_batch_memory == 99_500
    assert tp_deployment(facts, TOY, 16, 1.0, EXACT) is None  # TP stays inside one 8-GPU domain


def test_compare_margin_is_the_product_of_its_factors_and_the_dead_zone_is_where_afd_loses():
    from afdc.planner.compare import factors

    facts = {8192: _toy_facts(count=100), 4096: replace(_toy_facts(count=100), context=4096)}
    slow_nic = replace(TOY, nic_bandwidth=1e8, interconnect_bandwidth=1e8, scale_up_domain=2)
    c = afdc.planner.compare(facts, slow_nic, slow_nic, [0.5, 1, 4, 16], tpot_ms=50, a=EXACT, ffn_gpus=2)
    assert c.contexts == [4096, 8192] and len(c.points) == 8
    for p in c.points:
        if p.margin is not None:
            batch, step, share = factors(p)
            assert batch * step * share == pytest.approx(1 + p.margin)
    # a slow NIC caps what the FFN pool can be fed: the widest ratios lose
    assert 16 in c.dead_zone(8192)
    text = str(c)
    assert "context 8192:" in text and "GPUs decoding x" in text
    data = c.to_dict()
    assert {p["winner"] for p in data["points"]} <= {"AFD", "EP", "none"} and len(data["verdicts"]) == 2


def test_cli_plan_compare_json_and_plot(llama_config_file, tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "compare.png"
    args = ["plan", llama_config_file, "--compare", "--ratios", "1,2", "--contexts", "1024,4096", "--ffn-gpus", "1",
            "--ep-gpus", "2", "--micro-batches", "2", "--expert-skew", "1.2", "--dispatch-dtype", "fp8",
            "--scale-up-domain", "72", "--two-stage-exchange", "--json", "--plot", str(png)]  # fmt: skip
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert [(p["context"], p["ratio"], p["afd"], p["ep"]) for p in data["points"]] == [
        (1024, 1.0, "1A1F", "EP2"), (1024, 2.0, "2A1F", "EP2"), (4096, 1.0, "1A1F", "EP2"), (4096, 2.0, "2A1F", "EP2")
    ]  # fmt: skip
    assert png.stat().st_size > 10_000
    bad = CliRunner().invoke(main, ["plan", llama_config_file, "--compare", "--ratios", "a,b"])
    assert bad.exit_code == 2 and "--ratios" in bad.output


def test_cluster_profiles_name_a_source_for_every_figure():
    figures = ("peak_flops", "hbm_bandwidth", "hbm_capacity", "interconnect_bandwidth", "nic_bandwidth",
               "scale_up_domain", "scale_up_latency", "nic_latency")  # fmt: skip
    for name in ("Ascend910C", "H800", "H20", "GB200", "H100"):
        hw = get_profile(name)
        assert set(figures) <= set(hw.sources), f"{name} lacks sources for {set(figures) - set(hw.sources)}"
    c = get_profile("910C")
    assert c.scale_up_domain == 768 and c.flops("int8") == 2 * c.flops("bf16")
    assert get_profile("GB200").scale_up_domain == 72


def test_hw_file_sources_must_name_known_fields(tmp_path):
    path = tmp_path / "hw.json"
    mine = {"name": "MyChip", "peak_flops": {"bf16": 5e14}, "hbm_bandwidth": 2e12, "hbm_capacity": 64e9,
            "interconnect_bandwidth": 1e11, "nic_bandwidth": 2.5e10, "sources": {"hbm_bandwith": "typo"}}  # fmt: skip
    path.write_text(json.dumps([mine]))
    with pytest.raises(HardwareError, match=r"sources for unknown fields \['hbm_bandwith'\]"):
        load_profiles(path)
