"""The built-in demo: a tiny random MoE model built offline, for the README's first command."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel, Qwen3MoeConfig


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


def demo_batch(vocab: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Two prompts, the first left-padded by three tokens."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (2, 12), generator=g)
    mask = torch.ones_like(ids)
    ids[0, :3], mask[0, :3] = 0, 0
    return ids, mask
