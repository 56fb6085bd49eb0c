"""The transformers class a model is built with: the one that generates text from its checkpoint.

That is the causal-LM class, or, for a multimodal checkpoint whose ``model_type`` has none (Kimi-K2.5,
Qwen3-VL-MoE, GLM-4.5V, GLM-5 Next, Mistral 3), its image-text-to-text class: called on token ids
alone it runs its language model, so its towers are never captured and none of their weights is
written.
"""

from __future__ import annotations

from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, PretrainedConfig, PreTrainedModel
from transformers.models.auto.modeling_auto import (
    MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
    MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
)


def from_config(config: PretrainedConfig, **kwargs) -> PreTrainedModel:
    """``config``'s model with fresh weights (``kwargs`` as ``from_config`` takes them); raises
    ``ValueError`` where transformers has neither class for it."""
    kind = config.model_type
    if kind not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and kind in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES:
        return AutoModelForImageTextToText.from_config(config, **kwargs)
    return AutoModelForCausalLM.from_config(config, **kwargs)
