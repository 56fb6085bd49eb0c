"""Tiny configurations of the Hugging Face decoder architectures afdc is verified on.

Every entry builds a randomly initialised model from its config class alone (no hub access),
small enough that capture, the split and the equivalence checks take a few seconds. The tests in
``tests/test_models_supported.py`` check each entry against the monolithic model; ``REFUSED``
lists architectures that afdc declines with :class:`afdc.UnsupportedModelError`, and why.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import transformers
from packaging.version import Version
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel
from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

# Shared by every entry; an entry's overrides win. Special token ids are kept inside the tiny
# vocabulary (some models size an embedding's padding_idx from them).
TINY_COMMON: dict = {
    "vocab_size": 128,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "max_position_embeddings": 128,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}

FAMILIES: dict[str, str] = {
    "pre-norm": "x + attn(norm(x)), then x + mlp(norm(x))",
    "post-norm": "extra norms on the branch outputs (sandwich / post-norm)",
    "parallel": "attention and MLP read the same input and both are added to the stream",
    "conv1d": "GPT-2 style Conv1D projections (flattened [b*s, h] matmuls)",
    "moe": "mixture-of-experts FFN (router, top-k experts, optional shared experts / dense first layers)",
    "hybrid": "attention interleaved with stateful token mixers (short convolutions, Mamba, Gated DeltaNet, KDA)",
    "hyper": "hyper-connections: several residual streams, mixed into each branch's input and out of its output",
}


@dataclass(frozen=True)
class ModelEntry:
    """One verified architecture: how to build it tiny, and what afdc should find in it."""

    name: str  # the architecture as people call it
    model_type: str  # transformers' ``model_type``
    family: str  # a key of ``FAMILIES``
    overrides: dict = field(default_factory=dict)  # config kwargs on top of TINY_COMMON
    notes: str = ""
    dense_layers: int = 2  # FFN layers the split should report as dense ...
    moe_layers: int = 0  # ... and as mixture-of-experts
    drop: tuple[str, ...] = ()  # TINY_COMMON keys this config class does not accept
    # Why the FFN cannot be sharded over several FFN ranks (TP or EP); empty: it can. Dense
    # layers can still run on several FFN ranks whole (--dense-ffn replicate).
    unshardable: str = ""
    # How the default plan splits the MoE layers over FFN ranks: "ep" (experts partitioned) or
    # "tp" (each expert's weights split: experts computed densely, or in a Python loop)
    moe_split: str = "ep"
    # The oldest transformers release whose implementation of it afdc captures, where an older
    # one was tried (the GPU machine's 5.17) and cannot be captured; empty: every release tried.
    transformers: str = ""

    @property
    def config_kwargs(self) -> dict:
        return {**{k: v for k, v in TINY_COMMON.items() if k not in self.drop}, **self.overrides}


# Small MoE and MLA shapes shared by several entries (each config class spells them its own way).
_E, _K, _MOE_I = 4, 2, 16
_MLA = {
    "num_key_value_heads": 4,
    "kv_lora_rank": 16,
    "q_lora_rank": 16,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "v_head_dim": 8,
}
_SWA = ["sliding_attention", "full_attention"]
# an indexer that leaves keys out at 10 tokens. 32 heads: with few, a query whose head weights are
# all negative scores every key <= 0, and the ties at 0 are broken by key position, so that in the
# model itself a left-padded row picks other keys than the same row alone
_DSA = {"index_topk": 4, "index_head_dim": 8, "index_n_heads": 32}


# Gated DeltaNet and Mamba-2 mixers, tiny
_GDN = {"layer_types": ["linear_attention", "full_attention"], "linear_num_key_heads": 2, "linear_num_value_heads": 4,
        "linear_key_head_dim": 8, "linear_value_head_dim": 8}
_MAMBA2 = {"mamba_n_heads": 4, "mamba_d_head": 16, "mamba_d_state": 8, "mamba_chunk_size": 4}

# Gemma 3n tiny: 4 layers, so that 2 read earlier layers' KV and 2 MLPs keep only their top activations
_GEMMA3N = {"num_hidden_layers": 4, "layer_types": _SWA * 2, "sliding_window": 4, "vocab_size_per_layer_input": 128,
            "hidden_size_per_layer_input": 8, "altup_num_inputs": 4, "num_kv_shared_layers": 2, "laurel_rank": 4,
            "activation_sparsity_pattern": [0.95, 0.95, 0.0, 0.0]}


def _e(name, model_type, family, overrides=None, notes="", moe=0, dense=None, **kw) -> ModelEntry:
    layers = (overrides or {}).get("num_hidden_layers", TINY_COMMON["num_hidden_layers"])
    return ModelEntry(
        name, model_type, family, overrides or {}, notes, layers - moe if dense is None else dense, moe, **kw
    )


ENTRIES: list[ModelEntry] = [
    # -- pre-norm dense --------------------------------------------------------------------------
    _e("Llama", "llama", "pre-norm"),
    _e("Qwen2", "qwen2", "pre-norm", notes="QKV biases"),
    _e("Qwen3", "qwen3", "pre-norm", notes="q/k norms"),
    _e("Mistral", "mistral", "pre-norm", {"sliding_window": 4}, "sliding window 4"),
    _e("Ministral", "ministral", "pre-norm", {"sliding_window": 4, "layer_types": _SWA}),
    _e("Phi-3", "phi3", "pre-norm", notes="fused gate_up and qkv projections"),
    _e("Granite", "granite", "pre-norm",
       {"embedding_multiplier": 2.0, "residual_multiplier": 0.5, "attention_multiplier": 0.2, "logits_scaling": 2.0},
       "scaled residual branches"),
    _e("OLMo", "olmo", "pre-norm", notes="non-parametric layer norm"),
    _e("StableLM", "stablelm", "pre-norm", notes="partial rotary, layer norm"),
    _e("Starcoder2", "starcoder2", "pre-norm", notes="GELU MLP with biases, tied embeddings"),
    _e("GLM", "glm", "pre-norm", notes="fused gate_up, partial rotary"),
    _e("ERNIE 4.5", "ernie4_5", "pre-norm", notes="tied embeddings"),
    _e("Hunyuan dense", "hunyuan_v1_dense", "pre-norm", notes="q/k norms"),
    _e("SmolLM3", "smollm3", "pre-norm", {"no_rope_layer_interval": 2}, "NoPE every 2nd layer, tied embeddings"),
    _e("Seed-OSS", "seed_oss", "pre-norm"),
    _e("XGLM", "xglm", "pre-norm", {"d_model": 32, "ffn_dim": 64, "num_layers": 2, "attention_heads": 4},
       "sinusoidal positions: valid up to the table's 128 positions (decode recomputes the prefix)"),
    _e("GPT-Neo", "gpt_neo", "pre-norm",
       {"attention_types": [[["global", "local"], 1]], "num_layers": 2, "window_size": 4},
       "hard-coded global/local attention: valid up to 127 positions (decode recomputes the prefix)"),
    _e("Doge", "doge", "pre-norm", notes="dynamic-mask attention: valid up to keep_window_size (2048) positions "
       "(decode recomputes the prefix)"),
    _e("Arcee", "arcee", "pre-norm", notes="ReLU² MLP without gate"),
    _e("Apertus", "apertus", "pre-norm", notes="xIELU activation with learned scalars, llama3 rope"),
    _e("Gemma", "gemma", "pre-norm", notes="scaled embeddings, (1 + w) RMSNorm, tied embeddings"),
    _e("Helium", "helium", "pre-norm"),
    _e("Nemotron", "nemotron", "pre-norm", notes="ReLU² MLP, partial rotary"),
    _e("Persimmon", "persimmon", "pre-norm", {"num_key_value_heads": 4}, "q/k layer norms, partial rotary"),
    _e("InternLM3", "internlm3", "pre-norm"),
    _e("BitNet", "bitnet", "pre-norm", notes="sub-norms inside attention and MLP",
       unshardable="the MLP normalizes over its intermediate dimension"),
    _e("DiffLlama", "diffllama", "pre-norm", notes="differential attention (two softmax maps)"),
    _e("VaultGemma", "vaultgemma", "pre-norm", {"sliding_window": 4, "query_pre_attn_scalar": 8}),
    _e("BioGPT", "biogpt", "pre-norm", notes="learned positions, scaled embeddings"),
    _e("GPT-BigCode", "gpt_bigcode", "pre-norm", {"multi_query": True}, "multi-query attention, tied embeddings"),
    _e("BLOOM", "bloom", "pre-norm", {"n_head": 4},
       "ALiBi from the attention mask, embedding layer norm, hard-coded attention (decode recomputes the prefix)"),
    _e("MPT", "mpt", "pre-norm", {"d_model": 32, "n_heads": 4, "n_layers": 2, "max_seq_len": 128},
       "ALiBi bias table (valid up to max_seq_len), hard-coded attention (decode recomputes the prefix)"),
    _e("OPT", "opt", "pre-norm", notes="learned positions; called without position_ids it skips padding"),
    _e("CTRL", "ctrl", "pre-norm", notes="sinusoidal positions, ReLU MLP"),
    _e("GPT-NeoX-Japanese", "gpt_neox_japanese", "pre-norm", notes="output biases added with the residual"),
    _e("ModernBERT decoder", "modernbert-decoder", "pre-norm", notes="GeGLU MLP, alternating local attention"),
    _e("Granite (sliding window)", "granite_swa", "pre-norm"),
    _e("HyperCLOVA X", "hyperclovax", "pre-norm"),
    _e("IQuest-Coder", "iquestcoder", "pre-norm"),
    _e("Jais 2", "jais2", "pre-norm", notes="MLP without gate"),
    _e("Ministral 3", "ministral3", "pre-norm"),
    _e("nanochat", "nanochat", "pre-norm", notes="non-parametric norms, ReLU² MLP"),
    _e("CWM", "cwm", "pre-norm"),
    _e("Apertus 1.5 (text)", "apertus1p5_text", "pre-norm"),
    _e("Youtu", "youtu", "pre-norm", _MLA, "MLA, tied embeddings"),
    _e("MiniCPM3", "minicpm3", "pre-norm", {**_MLA, "dim_model_base": 16},
       "MLA, scaled embeddings, residual branches and logits"),
    _e("EXAONE 3", "exaone", "pre-norm", notes="Llama's class"),
    # -- extra post-norms ------------------------------------------------------------------------
    _e("Gemma 2", "gemma2", "post-norm", {"sliding_window": 4, "query_pre_attn_scalar": 8},
       "sandwich norms, attention/final logit soft-capping, sliding window 4 on alternate layers"),
    _e("Gemma 3 (text)", "gemma3_text", "post-norm",
       {"sliding_window": 4, "query_pre_attn_scalar": 8, "layer_types": _SWA},
       "sandwich norms, q/k norms, sliding window 4 on alternate layers"),
    _e("Gemma 3n (text)", "gemma3n_text", "post-norm", _GEMMA3N,
       "AltUp (4 predictions of the stream, corrected after each layer), a LAuReL low-rank branch beside attention "
       "(kept with attention: too small for a round trip), per-layer input embeddings, the last 2 layers reading "
       "earlier layers' KV, gaussian top-k activation sparsity in the first 2 MLPs (their gate projection whole "
       "on each FFN rank)", dense=4),
    _e("OLMo 2", "olmo2", "post-norm", notes="norms on the attention and MLP outputs"),
    _e("OLMo 3", "olmo3", "post-norm", {"sliding_window": 4, "layer_types": _SWA}),
    _e("GLM-4", "glm4", "post-norm", notes="post-attention and post-MLP norms"),
    _e("EXAONE 4", "exaone4", "post-norm", {"sliding_window": 4, "sliding_window_pattern": 2}),
    _e("OpenAI GPT", "openai-gpt", "post-norm", notes="norm after each residual add, Conv1D projections"),
    _e("Gemma 4 unified (text)", "gemma4_unified_text", "post-norm"),
    _e("Dory", "dory", "post-norm",
       {"num_hidden_layers": 3, "n_input_layers": 1, "n_recurrent_layers": 1, "n_output_layers": 1,
        "sliding_window": 4},
       "L2-normed sandwich layers, residual as a learned interpolation; its looped middle layer (run twice with the "
       "same weights) keeps its MLP on the attention side", dense=2,
       unshardable="the MLP's output is L2-normalized inside the branch"),
    # -- parallel attention + MLP ----------------------------------------------------------------
    _e("GPT-NeoX", "gpt_neox", "parallel", notes="use_parallel_residual, separate norms"),
    _e("Cohere", "cohere", "parallel", notes="one shared norm, residual + attn + mlp"),
    _e("Cohere 2", "cohere2", "parallel", {"sliding_window": 4, "layer_types": _SWA}),
    _e("Phi (1/2)", "phi", "parallel", notes="one shared norm, partial rotary"),
    _e("Falcon (new decoder)", "falcon", "parallel", {"new_decoder_architecture": True, "num_kv_heads": 2},
       "hard-coded attention (captured inline, decode recomputes the prefix)", drop=("head_dim",)),
    _e("GPT-J", "gptj", "parallel", {"rotary_dim": 4},
       "hard-coded attention (captured inline, decode recomputes the prefix)"),
    _e("Cohere Compass (text)", "cohere_compass_text", "parallel",
       {"sliding_window": 4, "layer_types": _SWA,
        "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                            "full_attention": None}}, "NoPE full-attention layer"),
    _e("CodeGen", "codegen", "parallel", {"rotary_dim": 4}, "fused qkv, one shared norm, partial rotary"),
    # -- Conv1D projections ----------------------------------------------------------------------
    _e("GPT-2", "gpt2", "conv1d", notes="tied embeddings"),
    _e("GPT-SW3", "gpt-sw3", "conv1d"),
    # -- mixture of experts ----------------------------------------------------------------------
    _e("Mixtral", "mixtral", "moe", {"num_local_experts": _E, "num_experts_per_tok": _K}, moe=2),
    _e("Qwen2-MoE", "qwen2_moe", "moe",
       {"num_experts": _E, "num_experts_per_tok": _K, "moe_intermediate_size": _MOE_I,
        "shared_expert_intermediate_size": 32}, "sigmoid-gated shared expert", moe=2),
    _e("Qwen3-MoE", "qwen3_moe", "moe",
       {"num_experts": _E, "num_experts_per_tok": _K, "moe_intermediate_size": _MOE_I}, moe=2),
    _e("DeepSeek-V2", "deepseek_v2", "moe",
       {"num_hidden_layers": 3, "first_k_dense_replace": 1, "n_routed_experts": _E, "n_shared_experts": 1,
        "num_experts_per_tok": _K, "moe_intermediate_size": _MOE_I, **_MLA,
        "topk_method": "group_limited_greedy", "n_group": 2, "topk_group": 1},
       "MLA, first layer dense, group-limited greedy routing", moe=2),
    _e("DeepSeek-V3", "deepseek_v3", "moe",
       {"num_hidden_layers": 3, "first_k_dense_replace": 1, "n_routed_experts": 8, "n_shared_experts": 1,
        "num_experts_per_tok": _K, "moe_intermediate_size": _MOE_I, **_MLA, "n_group": 4, "topk_group": 2},
       "MLA, first layer dense, grouped sigmoid routing (n_group 4, topk_group 2)", moe=2),
    _e("gpt-oss", "gpt_oss", "moe",
       {"num_local_experts": _E, "num_experts_per_tok": _K, "intermediate_size": 32, "sliding_window": 4,
        "layer_types": _SWA},
       "attention sinks, clamped SwiGLU experts, sliding window 4 on alternate layers", moe=2),
    _e("OLMoE", "olmoe", "moe", {"num_experts": _E, "num_experts_per_tok": _K}, moe=2),
    _e("GraniteMoE", "granitemoe", "moe",
       {"num_local_experts": _E, "num_experts_per_tok": _K, "residual_multiplier": 0.5}, moe=2),
    _e("GraniteMoE shared", "granitemoeshared", "moe",
       {"num_local_experts": _E, "num_experts_per_tok": _K, "shared_intermediate_size": 32}, moe=2),
    _e("GraniteMoE (sliding window)", "granitemoe_swa", "moe", {"num_local_experts": _E, "num_experts_per_tok": _K},
       moe=2),
    _e("PhiMoE", "phimoe", "moe", {"num_local_experts": _E, "num_experts_per_tok": _K}, "sparsemixer routing",
       moe=2),
    _e("ERNIE 4.5 MoE", "ernie4_5_moe", "moe",
       {"moe_num_experts": _E, "moe_k": _K, "moe_intermediate_size": _MOE_I, "moe_num_shared_experts": 1,
        "moe_layer_start_index": 1, "moe_layer_end_index": 1}, "first layer dense, shared expert", moe=1),
    _e("Hunyuan MoE", "hunyuan_v1_moe", "moe", {"num_experts": _E, "moe_topk": _K}, moe=2),
    _e("dots.llm1", "dots1", "moe",
       {"n_routed_experts": _E, "n_shared_experts": 1, "num_experts_per_tok": _K, "moe_intermediate_size": _MOE_I,
        "first_k_dense_replace": 1}, "first layer dense", moe=1),
    _e("GLM-4-MoE", "glm4_moe", "moe",
       {"n_routed_experts": _E, "n_shared_experts": 1, "num_experts_per_tok": _K, "moe_intermediate_size": _MOE_I,
        "first_k_dense_replace": 1}, "first layer dense", moe=1),
    _e("GLM-4-MoE-Lite", "glm4_moe_lite", "moe",
       {"n_routed_experts": _E, "n_shared_experts": 1, "num_experts_per_tok": _K, "moe_intermediate_size": _MOE_I,
        "first_k_dense_replace": 1, **_MLA}, "MLA, first layer dense", moe=1),
    _e("MiniMax-M2", "minimax_m2", "moe", {"num_local_experts": _E, "num_experts_per_tok": _K}, moe=2),
    _e("FlexOlmo", "flex_olmo", "moe", {"num_experts": _E, "num_experts_per_tok": _K}, moe=2),
    _e("Llama 4 (text)", "llama4_text", "moe",
       {"num_local_experts": _E, "num_experts_per_tok": 1, "intermediate_size_mlp": 64,
        "interleave_moe_layer_step": 2, "attention_chunk_size": 4, "no_rope_layer_interval": 2},
       "chunked attention (4), NoPE layer, MoE on alternate layers (every expert runs on every token)",
       moe=1, moe_split="tp"),
    _e("DeepSeek-V3.2", "deepseek_v32", "moe",
       {"first_k_dense_replace": 1, "n_routed_experts": _E, "n_shared_experts": 1, "num_experts_per_tok": _K,
        "moe_intermediate_size": _MOE_I, **_MLA, "n_group": 1, "topk_group": 1, **_DSA},
       "MLA, sparse attention (indexer picks 4 keys per query; its keys cached beside the KV cache), first layer "
       "dense",
       moe=1),
    _e("GLM-MoE-DSA", "glm_moe_dsa", "moe",
       {"first_k_dense_replace": 1, "n_routed_experts": _E, "n_shared_experts": 1, "num_experts_per_tok": _K,
        "moe_intermediate_size": _MOE_I, **_MLA, "n_group": 1, "topk_group": 1, **_DSA},
       "MLA, sparse attention (indexer picks 4 keys per query; its keys cached beside the KV cache), first layer "
       "dense",
       moe=1),
    _e("MiniMax-M3 (text)", "minimax_m3_vl_text", "moe", {"num_local_experts": _E, "num_experts_per_tok": _K}, moe=2),
    _e("Aria (text)", "aria_text", "moe", {"moe_num_experts": _E, "moe_topk": _K, "moe_num_shared_experts": 1},
       "shared expert", moe=2, transformers="5.24"),  # 5.17's routing is data-dependent under torch.export
    _e("DBRX", "dbrx", "moe",
       {"d_model": 32, "n_heads": 4, "n_layers": 2, "max_seq_len": 128,
        "attn_config": {"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
        "ffn_config": {"ffn_hidden_size": 32, "moe_num_experts": _E, "moe_top_k": _K}},
       "clipped fused qkv; experts in a Python loop over those hit, flat [E*I, H] stacks (captured as grouped "
       "matmuls)", moe=2),
    _e("LongCat-Flash", "longcat_flash", "moe",
       {"num_layers": 1, "n_routed_experts": _E, "zero_expert_num": 2, "moe_topk": _K,
        "expert_ffn_hidden_size": _MOE_I, "ffn_hidden_size": 64, **_MLA},
       "MLA, two attention and two dense MLP sub-layers per layer; experts in a Python loop (captured as grouped "
       "matmuls), 2 zero-computation (identity) experts adding weight * x; shortcut-connected MoE, added after "
       "the next attention and MLP: its FFN work overlaps that attention", moe=1, dense=2),
    # -- hyper-connections ------------------------------------------------------------------------
    _e("HY-V4", "hy_v4", "hyper",
       {"n_routed_experts": _E, "n_shared_experts": 1, "num_experts_per_tok": _K, "moe_intermediate_size": _MOE_I,
        **_MLA, "n_group": 1, "topk_group": 1, "hc_mult": 2, "mlp_layer_types": ["dense", "sparse"], **_DSA},
       "2 residual streams, MLA, sparse attention (indexer keys cached), first layer dense", moe=1),
    _e("DeepSeek-V4", "deepseek_v4", "hyper",
       {"n_routed_experts": _E, "num_experts_per_tok": _K, "moe_intermediate_size": _MOE_I, "n_shared_experts": 1,
        "q_lora_rank": 16, "qk_rope_head_dim": 8, "hc_mult": 2, "mlp_layer_types": ["hash_moe", "moe"],
        "index_topk": 2, "layer_types": ["heavily_compressed_attention", "compressed_sparse_attention"],
        # windows short enough that the test's sequences close several and outgrow the sliding window
        "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 8}, "sliding_window": 8},
       "2 residual streams, compressed attention (HCA, CSA with an indexer: each attention a stateful mixer, its "
       "keys and compressed entries in the model's own cache; served with them in fixed-size state blocks sized "
       "from max_model_len), hash routing in the first MoE layer",
       moe=2),
    _e("Gemma 4 (text, MoE)", "gemma4_text", "moe",
       {"sliding_window": 4, "vocab_size_per_layer_input": 128, "hidden_size_per_layer_input": 8,
        "enable_moe_block": True, "num_experts": _E, "top_k_experts": _K, "moe_intermediate_size": _MOE_I},
       "sandwich norms, sliding window 4; a dense MLP beside the experts, each normed before their sum (over "
       "several FFN ranks the attention side norms the reduced sums); per-layer input embeddings: each layer's "
       "gated projection of them is low rank and stays with attention",
       moe=2, dense=0),
    _e("JetMoE", "jetmoe", "moe", {"num_local_experts": _E, "num_experts_per_tok": _K, "kv_channels": 8},
       "mixture-of-attention-heads attention, MoE experts in a Python loop over a stacked weight", moe=2,
       moe_split="tp"),
    _e("AFMoE", "afmoe", "moe",
       {"num_experts": _E, "num_experts_per_tok": _K, "moe_intermediate_size": _MOE_I, "num_dense_layers": 1,
        "num_shared_experts": 1, "sliding_window": 4, "global_attn_every_n_layers": 2}, moe=1),
    _e("EXAONE MoE", "exaone_moe", "moe",
       {"num_experts": _E, "num_experts_per_tok": _K, "moe_intermediate_size": _MOE_I,
        "first_k_dense_replace": 1, "sliding_window": 4, "sliding_window_pattern": 2}, moe=1),
    _e("Solar Open", "solar_open", "moe",
       {"n_routed_experts": _E, "n_shared_experts": 1, "num_experts_per_tok": _K,
        "moe_intermediate_size": _MOE_I}, moe=2),
    _e("Laguna", "laguna", "moe",
       {"num_experts": _E, "num_experts_per_tok": _K, "moe_intermediate_size": _MOE_I,
        "shared_expert_intermediate_size": _MOE_I, "sliding_window": 4}, "first layer dense", moe=1),
    _e("Cohere 2 MoE", "cohere2_moe", "moe",
       {"num_experts": _E, "num_experts_per_tok": _K, "sliding_window": 4}, "parallel attention + MoE", moe=2),
    _e("Mellum", "mellum", "moe",
       {"num_local_experts": _E, "num_experts_per_tok": _K, "moe_intermediate_size": _MOE_I,
        "sliding_window": 4}, moe=2),
    _e("Kolibri", "kolibri1", "moe",
       {"num_local_experts": _E, "num_experts_per_tok": _K, "moe_intermediate_size": _MOE_I,
        "shared_expert_intermediate_size": _MOE_I, "sliding_window": 4}, moe=2),
    _e("Flint", "flint", "moe",
       {"num_experts": _E, "num_experts_per_tok": _K, "moe_intermediate_size": _MOE_I,
        "shared_expert_intermediate_size": _MOE_I, "sliding_window": 4, "mlp_only_layers": [0]}, moe=1),
    _e("Hunyuan v3", "hy_v3", "moe",
       {"num_experts": _E, "num_experts_per_tok": _K, "moe_intermediate_size": _MOE_I, "num_shared_experts": 1},
       "first layer dense", moe=1),
    _e("MiMo-V2-Flash", "mimo_v2_flash", "moe",
       {"n_routed_experts": _E, "num_experts_per_tok": _K, "moe_intermediate_size": _MOE_I, "v_head_dim": 8,
        "sliding_window": 4}, "first layer dense", moe=1),
    _e("Sarvam MoE", "sarvam_moe", "moe",
       {"n_routed_experts": _E, "n_shared_experts": 1, "num_experts_per_tok": _K, "moe_intermediate_size": _MOE_I,
        "first_k_dense_replace": 1}, "GLM-4-MoE's class, first layer dense", moe=1),
    _e("Sarvam MLA", "sarvam_mla", "moe",
       {"n_routed_experts": _E, "n_shared_experts": 1, "num_experts_per_tok": _K, "moe_intermediate_size": _MOE_I,
        "first_k_dense_replace": 1, **_MLA, "n_group": 1, "topk_group": 1},
       "DeepSeek-V3's class: MLA, first layer dense", moe=1),
    _e("A.X K1", "axk1", "moe",
       {"n_routed_experts": _E, "n_shared_experts": 1, "num_experts_per_tok": _K, "moe_intermediate_size": _MOE_I,
        "first_k_dense_replace": 1, **_MLA, "n_group": 1, "topk_group": 1}, "MLA, first layer dense", moe=1),
    _e("A.X K2", "axk2", "moe",
       {"n_routed_experts": _E, "n_shared_experts": 1, "num_experts_per_tok": _K, "moe_intermediate_size": _MOE_I,
        "first_k_dense_replace": 1, **_MLA, **_DSA, "gated_norm_rank": 4},
       "MLA, sparse attention (indexer picks 4 keys per query), first layer dense", moe=1),
    _e("dots3-note (text)", "dots3_note_text", "moe",
       {"n_routed_experts": _E, "n_shared_experts": 1, "num_experts_per_tok": _K, "moe_intermediate_size": _MOE_I,
        "shared_experts_intermediate_size": _MOE_I, "first_k_dense_replace": 1, **_MLA, **_DSA,
        "sliding_window": 4, "layer_types": ["indexed_attention", "sliding_attention"],
        "swa_num_attention_heads": 4, "swa_num_key_value_heads": 4, "swa_q_lora_rank": 16, "swa_kv_lora_rank": 16,
        "swa_head_dim": 16, "swa_qk_nope_head_dim": 8, "swa_v_head_dim": 8},
       "MLA, sparse attention (indexer picks 4 keys per query) + sliding-window MLA layer of its own shape, first "
       "layer dense", moe=1),
    _e("Beam", "beam", "moe",
       {"num_experts": _E, "num_experts_per_tok": _K, "moe_intermediate_size": _MOE_I,
        "mlp_layer_types": ["dense", "sparse"], "layer_types": _SWA, "sliding_window": 4, "n_group": 2,
        "topk_group": 1},
       "sandwich norms, depth-scaled residual adds, NoPE full-attention layer, grouped routing, first layer dense",
       moe=1),
    # -- hybrids ---------------------------------------------------------------------------------
    _e("LFM2", "lfm2", "hybrid", {"layer_types": ["conv", "full_attention"], "block_auto_adjust_ff_dim": False},
       "gated short-convolution layer (a stateful mixer: its window kept per sequence) + attention layer"),
    _e("LFM2-MoE", "lfm2_moe", "hybrid",
       {"layer_types": ["conv", "full_attention"], "num_dense_layers": 1, "num_experts": _E,
        "num_experts_per_tok": _K, "moe_intermediate_size": _MOE_I},
       "short-convolution layer + attention layer, MoE after the first layer", moe=1),
    _e("Qwen3-Next", "qwen3_next", "hybrid",
       {**_GDN, "num_experts": _E, "num_experts_per_tok": _K, "moe_intermediate_size": _MOE_I,
        "shared_expert_intermediate_size": _MOE_I},
       "Gated DeltaNet layer + attention layer, MoE with a gated shared expert", moe=2),
    _e("Qwen3.5 (text)", "qwen3_5_text", "hybrid", _GDN, "Gated DeltaNet layer + attention layer"),
    _e("Qwen3.5-MoE (text)", "qwen3_5_moe_text", "hybrid",
       {**_GDN, "num_experts": _E, "num_experts_per_tok": _K, "moe_intermediate_size": _MOE_I,
        "shared_expert_intermediate_size": _MOE_I},
       "Gated DeltaNet layer + attention layer, MoE with a gated shared expert", moe=2),
    _e("OLMo hybrid", "olmo_hybrid", "hybrid",
       {"layer_types": ["linear_attention", "full_attention"], "linear_num_key_heads": 2,
        "linear_num_value_heads": 2, "linear_key_head_dim": 8, "linear_value_head_dim": 16},
       "Gated DeltaNet layer + attention layer", transformers="5.24"),  # 5.17's pads the length to a chunk
    _e("Kimi Linear", "kimi_linear", "hybrid",
       {"layer_types": ["linear_attention", "full_attention"], "mlp_layer_types": ["dense", "sparse"],
        "linear_num_heads": 2, "linear_head_dim": 8, "num_experts": _E, "num_experts_per_token": _K,
        "moe_intermediate_size": _MOE_I, "num_shared_experts": 1, **_MLA},
       "Kimi delta attention (KDA) layer + MLA layer, first layer dense", moe=1),
    _e("ZAYA1", "zaya", "hybrid",
       {"num_experts": _E, "num_experts_per_tok": 1, "moe_intermediate_size": _MOE_I, "router_hidden_size": 16},
       "compressed convolutional attention (a stateful mixer: its convolution window and delayed value in the "
       "cache) + top-1 MoE with a skip expert on every layer; residual adds shift and scale stream and branch "
       "((h + b) * s + (x + c) * r); each router reads the previous layer's router state, so routing stays with "
       "attention and the FFN side runs the experts; not servable yet (its attention keeps every key and value in "
       "its cache layer, which serving's fixed-size state blocks cannot bound: the artifact says so)", moe=2),
    _e("LFM3", "lfm3", "hybrid", {"layer_types": ["conv", "full_attention"], "sliding_window": 4},
       "short-convolution layer + gated attention layer, sandwich norms"),
    _e("Lara mini", "lara_mini", "hybrid",
       {**_GDN, "layer_types": ["linear_attention", "sliding_attention"], "sliding_window": 4, "num_experts": _E,
        "num_experts_per_tok": _K, "moe_intermediate_size": _MOE_I},
       "Gated DeltaNet layer + sliding-window attention layer, MoE on both", moe=2),
    _e("Bailing hybrid", "bailing_hybrid", "hybrid",
       {"layer_types": ["linear_attention", "full_attention"], "num_local_experts": _E, "n_shared_experts": 1,
        "num_experts_per_tok": _K, "moe_intermediate_size": _MOE_I, "first_k_dense_replace": 1, **_MLA,
        "n_group": 1, "topk_group": 1},
       "Kimi delta attention (KDA) layer + MLA layer, first layer dense", moe=1),
    _e("Bamba", "bamba", "hybrid", {"attn_layer_indices": [1], **_MAMBA2}, "Mamba-2 layer + attention layer"),
    _e("Falcon-H1", "falcon_h1", "hybrid",
       {"mamba_d_ssm": 32, "mamba_n_heads": 4, "mamba_d_head": 8, "mamba_d_state": 8, "mamba_chunk_size": 4},
       "Mamba-2 and attention side by side in every layer"),
    _e("Granite 4 hybrid MoE", "granitemoehybrid", "hybrid",
       {"layer_types": ["mamba", "attention"], "num_local_experts": _E, "num_experts_per_tok": _K,
        "shared_intermediate_size": 32, **_MAMBA2},
       "Mamba-2 layer + attention layer, MoE with a shared MLP", moe=2),
    _e("Nemotron-H", "nemotron_h", "hybrid",
       {"layers_block_type": ["mamba", "mlp", "attention", "moe"], "num_hidden_layers": 4,
        "mamba_num_heads": 4, "mamba_head_dim": 16, "ssm_state_size": 8, "n_groups": 1, "chunk_size": 4,
        "n_routed_experts": _E, "num_experts_per_tok": _K, "moe_intermediate_size": _MOE_I,
        "moe_shared_expert_intermediate_size": _MOE_I},
       "one block per layer: Mamba-2, MLP, attention, MoE", moe=1, dense=1),
    _e("Jamba", "jamba", "hybrid",
       {"num_experts": _E, "num_experts_per_tok": _K, "attn_layer_period": 2, "attn_layer_offset": 1,
        "expert_layer_period": 2, "expert_layer_offset": 1, "mamba_d_state": 4, "mamba_dt_rank": 4},
       "Mamba layer + attention layer, MoE on alternate layers", moe=1),
    _e("MiniMax", "minimax", "hybrid",
       {"layer_types": ["linear_attention", "full_attention"], "num_local_experts": _E, "num_experts_per_tok": _K,
        "block_size": 4},
       "lightning attention layer (a stateful mixer: its state kept in the model's own cache class) + attention "
       "layer, MoE on both", moe=2),
]

# One entry per structural variant: what the default test run (CI's) checks; `pytest --sweep` checks
# every entry.
CORE: frozenset[str] = frozenset({
    "llama", "qwen2", "qwen3", "mistral", "phi3", "granite", "starcoder2", "smollm3",
    "gemma2", "gemma3_text", "gemma3n_text", "olmo2",
    "gpt_neox", "cohere", "phi", "falcon",
    "gpt2",
    "mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v2", "deepseek_v3", "gpt_oss", "olmoe", "granitemoe", "phimoe",
    "dbrx", "longcat_flash",  # experts in a Python loop; identity experts and a shortcut-connected MoE
    "deepseek_v4",  # attention with compressors as a stateful mixer; hyper-connections; hash routing
    "lfm2", "qwen3_next", "granitemoehybrid", "zaya",
    # refusals
    "jamba", "rwkv",
})

_SPECIALIZES = (
    "the forward specializes the batch size or sequence length (torch.export could not keep them symbolic)"
)
_NO_FFN_SSM = (
    "no FFN region found: this is a pure sequence-mixer (state-space) model with no position-wise weight branch "
    "added to the residual stream"
)
_STATE_OUTSIDE_CACHE = "the forward keeps per-sequence state outside transformers' per-layer cache API"

# model_type -> the UnsupportedModelError text afdc raises for it (the message starts with this).
REFUSED: dict[str, str] = {
    "inkling_text": "no FFN region found: in model.layers.0 weight work (an MLP) runs into a token mixer",
    "zamba2": "no FFN region found: in model.layers.1 weight work (an MLP) runs after attention or a mixer in one "
              "branch of the residual stream, with no residual add between them",
    "recurrent_gemma": _STATE_OUTSIDE_CACHE,
    "rwkv": _SPECIALIZES,
    "mamba": _NO_FFN_SSM,
    "falcon_mamba": _NO_FFN_SSM,
    "inkling2_text": "no FFN region found: in model.layers.0 weight work (an MLP) runs into a token mixer",
    "hrm_text": "no FFN region found: in model weight work (an MLP) runs after attention or a mixer in one branch "
                "of the residual stream, with no residual add between them",
    "qwen4_exp_text": "the forward reads per-layer cache state outside a token mixer",
    "xlstm": "the forward reads per-layer cache state outside a token mixer",
    "inkling2_loop_text": "no FFN region found: in model.layers.0 weight work (an MLP) runs into a token mixer",
    "mamba2": _NO_FFN_SSM,
    "zamba": "no FFN region found: in model.layers.1 weight work (an MLP) runs after attention or a mixer in one "
             "branch of the residual stream, with no residual add between them",
    "cpmant": _SPECIALIZES,
}

# Refusals whose cause another refusal checked by default already shows (the same code path, often the same
# class): checked with ``--sweep`` only.
REFUSED_SWEEP: frozenset[str] = frozenset({"inkling2_text", "inkling2_loop_text", "mamba2", "zamba", "cpmant"})

# model_type -> what in the model's code leads to the refusal.
REFUSED_CAUSE: dict[str, str] = {
    "inkling_text": "its MLP's output runs through a short convolution over the sequence (mlp_sconv) before the "
                    "residual add, so the FFN branch mixes tokens; the same convolution follows attention",
    "zamba2": "its MLP sits in a shared attention block without a residual: the block's output is projected into "
              "the next Mamba layer's input, so no FFN branch of the residual stream exists to cut (its Mamba-2 "
              "mixers themselves are captured as stateful mixers)",
    "recurrent_gemma": "the recurrent block keeps its convolution window and RG-LRU state in module attributes "
                       "(conv1d_state, recurrent_states), set by the model's own _setup_cache, not in a cache; "
                       "inline, the RG-LRU scans the sequence in a Python loop",
    "rwkv": "the WKV recurrence scans the sequence in a Python loop",
    "mamba": "pure state-space model: no FFN to disaggregate",
    "falcon_mamba": "pure state-space model: no FFN to disaggregate",
    "inkling2_text": "its MoE's output runs through a short convolution over the sequence (post_mlp_convolution) "
                     "before the residual add, so the FFN branch mixes tokens; the same follows attention",
    "hrm_text": "its two decoder stacks (H and L) run several times per forward with the same weights "
                "(H_cycles x L_cycles recurrence); afdc cuts only an FFN whose weights nothing else reads, so no "
                "MLP is a region of its own and the message names what is left (not a missing residual add); with "
                "H_cycles 1 the H stack's MLP is found and split",
    "qwen4_exp_text": "its model forward keeps the indexer's position history in a cache layer "
                      "(indexer_position_ids), outside any token mixer; its QSA indexer also loops over rows and "
                      "queries in Python (torch.nonzero)",
    "xlstm": "its model forward hands each block its mLSTM state from the model's own xLSTMCache (rnn_state), "
             "read and written outside the blocks; each block is otherwise mLSTM + a gated FFN branch",
    "inkling2_loop_text": "as inkling2_text: its MoE's output runs through a short convolution over the sequence "
                          "before the residual add",
    "mamba2": "pure state-space model: no FFN to disaggregate",
    "cpmant": "its mask is built from a Python list of the sequence length (range(seqlen - prompt_length)), and "
              "it reads padding from token id 0 and prepends prompt tokens, ignoring the attention mask given",
    "zamba": "as zamba2: its MLP sits in a shared attention block whose output is projected into the next Mamba "
             "layer's input, so no FFN branch of the residual stream exists to cut",
}

# Inkling 2 (text, and its looped variant) tiny: the vocabulary it embeds is unpadded_vocab_size
_INKLING2 = {"unpadded_vocab_size": 128, "n_routed_experts": _E, "num_experts_per_tok": _K,
             "moe_intermediate_size": _MOE_I, "swa_num_attention_heads": 4, "swa_num_key_value_heads": 2,
             "swa_head_dim": 8, "sliding_window_size": 4, "d_rel": 4, "rel_extent": 16,
             "n_layers_per_attn_res_block": 1}

# The tiny configurations the refusals are checked with (on top of TINY_COMMON).
REFUSED_OVERRIDES: dict[str, dict] = {
    "inkling_text": {},
    "zamba2": {"layers_block_type": ["mamba", "hybrid"], "hybrid_layer_ids": [1], "mamba_d_state": 8,
               "n_mamba_heads": 4, "mamba_headdim": 16, "chunk_size": 4, "attention_head_dim": 8, "num_mem_blocks": 1},
    "recurrent_gemma": {"block_types": ["recurrent", "attention"], "lru_width": 32, "attention_window_size": 4},
    "mamba": {"state_size": 4},
    "falcon_mamba": {"state_size": 4},
    "rwkv": {"attention_hidden_size": 32},
    "inkling2_text": _INKLING2,
    "hrm_text": {"num_hidden_layers": 1, "H_cycles": 2, "L_cycles": 1},  # each stack runs twice
    "qwen4_exp_text": {**_GDN, "layer_types": ["linear_attention", "indexed_attention"], "num_experts": _E,
                       "num_experts_per_tok": _K, "moe_intermediate_size": _MOE_I,
                       "shared_expert_intermediate_size": _MOE_I, "hc_count": 2, "hc_lowrank": 8,
                       "indexer_n_heads": 4, "indexer_kv_heads": 1, "indexer_head_dim": 8, "indexer_budget": 4,
                       "indexer_compress_ratio": 2},
    # qk and v widths are rounded up to 64: a hidden size of 64 keeps the cache's state shapes the kernel's
    "xlstm": {"hidden_size": 64, "embedding_dim": 64, "num_heads": 4, "qk_dim_factor": 1.0, "chunk_size": 4,
              "autocast_kernel_dtype": "float32", "ffn_round_up_to_multiple_of": 16},
    "inkling2_loop_text": _INKLING2,
    "mamba2": {"num_heads": 4, "head_dim": 16, "state_size": 8, "n_groups": 1, "chunk_size": 4},
    "cpmant": {"dim_head": 8, "dim_ff": 64, "position_bias_num_buckets": 16, "position_bias_max_distance": 32,
               "prompt_types": 2, "prompt_length": 2, "segment_types": 4},
    "zamba": {"num_hidden_layers": 3, "layers_block_type": ["mamba", "hybrid", "hybrid"], "n_mamba_heads": 2,
              "mamba_d_state": 8, "use_mamba_kernels": False, "attention_head_dim": 8},
}


def build(entry: ModelEntry, seed: int = 0) -> PreTrainedModel:
    """The entry's tiny model: random weights from ``seed``, float32, eval mode."""
    return build_type(entry.model_type, entry.config_kwargs, seed)


def build_type(model_type: str, config_kwargs: dict, seed: int = 0) -> PreTrainedModel:
    cfg = AutoConfig.for_model(model_type, **config_kwargs)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()


def greedy(name_or_type: str, seed: int = 0) -> PreTrainedModel:
    """The entry's tiny model set up for greedy decoding that runs to the requested length (no
    EOS, pad id 0): what the equivalence checks compare ``generate`` with."""
    model = build(entry(name_or_type), seed)
    gc = model.generation_config
    gc.eos_token_id, gc.pad_token_id, gc.do_sample = None, 0, False
    return model


def left_padded(vocab: int, rows: int = 3, length: int = 11, seed: int = 7) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and attention mask of ``rows`` left-padded rows of different lengths (row ``i``
    has ``2 * i`` pads, id 0), the tokens drawn from ``seed``."""
    ids = torch.randint(3, vocab, (rows, length), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    for i in range(rows):
        ids[i, : 2 * i], mask[i, : 2 * i] = 0, 0
    return ids, mask


def unavailable(e: ModelEntry) -> str:
    """Why the installed transformers cannot give ``e`` (a reason to skip its tests); "" if it can."""
    if e.model_type not in CONFIG_MAPPING_NAMES:
        return f"transformers {transformers.__version__} has no {e.model_type} (added in a later release)"
    if e.transformers and Version(transformers.__version__) < Version(e.transformers):
        return f"transformers {transformers.__version__} < {e.transformers}: its {e.model_type} cannot be captured"
    return ""


def entry(name_or_type: str) -> ModelEntry:
    for e in ENTRIES:
        if name_or_type in (e.name, e.model_type):
            return e
    raise KeyError(name_or_type)
