"""The built-in demo: a tiny random MoE model built offline, for the README's first command."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, DeepseekV3Config, PreTrainedModel, Qwen3MoeConfig


def demo_config() -> Qwen3MoeConfig:
    """A Qwen3-MoE-shaped model: GQA attention, 8 experts top-2, every layer MoE."""
    return Qwen3MoeConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=8,
        num_experts_per_tok=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )


def demo_model(seed: int = 0) -> PreTrainedModel:
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(demo_config()).eval()
    model.config._name_or_path = "afdc-demo-moe"
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def demo_batch(
    vocab: int, seed: int = 1, shape: tuple[int, int] = (2, 12), pads: tuple[int, ...] = (3,)
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random prompts (``shape``), row i left-padded by ``pads[i]`` pad tokens (id 0)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, shape, generator=g)
    mask = torch.ones_like(ids)
    for row, pad in enumerate(pads):
        ids[row, :pad], mask[row, :pad] = 0, 0
    return ids, mask


CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def demo_tokenizer(vocab_size: int = 512):
    """A byte-level BPE tokenizer trained offline on a few sentences: any text encodes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = [
        "Attention and feed-forward layers run on separate pools of GPUs.",
        "The quick brown fox jumps over the lazy dog. Hello world, how are you today?",
        "Mixture-of-experts models route each token to a few experts out of many.",
    ] * 50
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>", chat_template=CHAT_TEMPLATE
    )


def save_demo(directory, seed: int = 0) -> None:
    """The demo model and its tokenizer, saved as a Hugging Face model directory."""
    model = demo_model(seed)
    model.save_pretrained(directory)
    demo_tokenizer(model.config.vocab_size).save_pretrained(directory)


def demo_mtp_config() -> DeepseekV3Config:
    """A DeepSeek-V3-shaped model with one multi-token-prediction layer: MLA attention, the first
    layer dense, 8 routed experts top-2 in groups, a shared expert."""
    return DeepseekV3Config(
        vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
        first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=16,
        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, n_routed_experts=8, n_shared_experts=1,
        num_experts_per_tok=2, n_group=4, topk_group=2, num_nextn_predict_layers=1, max_position_embeddings=512,
        tie_word_embeddings=False,
    )


def save_demo_mtp(directory, seed: int = 0) -> None:
    """The MTP demo model and its tokenizer, saved as DeepSeek-V3 ships its checkpoint: the MTP
    layer's weights (``model.layers.{num_hidden_layers}.*``: enorm, hnorm, eh_proj, its decoder
    layer, shared_head) beside the model's, random like them."""
    from afdc.mtp import attach

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(demo_mtp_config()).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    with torch.no_grad():
        for module in attach(model).modules():
            model._init_weights(module)
    model.save_pretrained(directory)
    demo_tokenizer(model.config.vocab_size).save_pretrained(directory)


def demo_artifact(cache: str | None = None, say=print):
    """The demo model saved and compiled 1A1F under ``cache`` (default ``~/.cache/afdc/demo``), once."""
    import os
    from pathlib import Path

    from afdc.artifact.manifest import MANIFEST, ArtifactError, read_manifest
    from afdc.compile import compile_model

    root = Path(cache or os.environ.get("AFDC_CACHE", Path.home() / ".cache" / "afdc")) / "demo"
    artifact = root / "afdc-demo"  # the served model name
    if (artifact / MANIFEST).is_file():
        try:
            read_manifest(artifact)
            say(f"using the demo artifact in {artifact}")
            return artifact
        except ArtifactError as err:  # compiled by another afdc (an older format): compiled again below
            say(f"the cached demo artifact cannot be used ({err})")
    say(f"building the demo model (random Qwen3-MoE, 8 experts) and its tokenizer in {root / 'model'}")
    save_demo(root / "model")
    say("compiling it for plan 1A1F")
    compile_model(str(root / "model"), "1A1F", artifact, progress=False, force=True)
    return artifact
