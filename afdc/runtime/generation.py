"""How ``dm.generate`` picks each next token: the way transformers' ``generate`` does.

The disaggregated model runs its programs; which token follows is decided here by transformers'
own logits processors and stopping criteria, built by the same ``GenerationMixin`` methods that
``model.generate`` calls, from the model's generation config merged with the call's arguments.
So a repetition penalty shipped in ``generation_config.json``, forced BOS/EOS tokens, bad words,
suppressed tokens, n-gram blocking, a minimum length, sampling warpers and stop criteria act as
they do in ``model.generate``. What a decoder-only greedy or sampling loop cannot honour (beam
search, contrastive search, assisted decoding, classifier-free guidance, several sequences per
prompt, dict outputs) is refused by name, whether it comes from the call or from the config.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import GenerationConfig, GenerationMixin, PretrainedConfig
from transformers.generation import GenerationMode, LogitsProcessorList, StoppingCriteriaList

# generate's own arguments (not generation-config fields) that the loop below honours
_LOOP_ARGUMENTS = ("logits_processor", "stopping_criteria", "prefix_allowed_tokens_fn", "tokenizer")
# generation-config fields that ask for more than next-token choices, with why afdc refuses them
_REFUSED = {
    "guidance_scale": (lambda v: v not in (None, 1, 1.0), "classifier-free guidance runs the model twice per step"),
    "num_return_sequences": (lambda v: v not in (None, 1), "afdc returns one sequence per prompt"),
    "return_dict_in_generate": (bool, "dm.generate returns the token tensor only"),
    "output_scores": (bool, "dm.generate returns the token tensor only"),
    "output_logits": (bool, "dm.generate returns the token tensor only"),
    "output_attentions": (bool, "the programs do not return attention weights"),
    "output_hidden_states": (bool, "the programs do not return hidden states"),
}


class _Model(GenerationMixin):
    """What ``GenerationMixin``'s builders read of a model: its config, generation config and device."""

    def __init__(self, config: PretrainedConfig, generation_config: GenerationConfig, device: torch.device):
        self.config = config
        self.generation_config = generation_config
        self.device = device


@dataclass
class Decoding:
    """One ``generate`` call's rules: its merged generation config, processors and stopping criteria."""

    config: GenerationConfig
    processors: LogitsProcessorList
    stopping: StoppingCriteriaList
    pad: torch.Tensor | None  # what finished rows append (None: rows all stop together)
    attention_mask: torch.Tensor  # the call's, or the one generate infers from the pad token

    @property
    def sample(self) -> bool:
        return self.config.get_generation_mode() == GenerationMode.SAMPLE

    def scores(self, tokens: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """The processed scores of each row's next token, from the logits of its last position."""
        return self.processors(tokens, logits.to(dtype=torch.float32, copy=True))

    def choose(self, scores: torch.Tensor, unfinished: torch.Tensor) -> torch.Tensor:
        """The token each row appends (finished rows: the pad token), as ``_sample`` picks it."""
        if self.sample:
            chosen = torch.multinomial(torch.softmax(scores, dim=-1), num_samples=1).squeeze(1)
        else:
            chosen = scores.argmax(dim=-1)
        if self.pad is not None:
            chosen = torch.where(unfinished, chosen, self.pad.to(chosen.device))
        return chosen

    def unfinished(self, tokens: torch.Tensor, scores: torch.Tensor, unfinished: torch.Tensor) -> torch.Tensor:
        """Which rows go on once ``tokens`` holds their new token."""
        return unfinished & ~self.stopping(tokens, scores)


def decoding(
    config: PretrainedConfig | None,
    generation_config: GenerationConfig | None,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    kwargs: dict,
) -> Decoding:
    """The rules ``model.generate(input_ids, attention_mask=attention_mask, **kwargs)`` would
    follow, built by transformers' own methods; raises naming what afdc cannot honour. Without
    ``attention_mask`` the mask is inferred as ``generate`` infers it (pad tokens in the input,
    where the pad token is not also EOS, are masked)."""
    loop = {name: kwargs.pop(name) for name in _LOOP_ARGUMENTS if name in kwargs}
    call_config = kwargs.pop("generation_config", None)  # the call's own, over the model's
    base = generation_config if generation_config is not None else GenerationConfig()
    model = _Model(config if config is not None else PretrainedConfig(), base, input_ids.device)
    given = call_config if call_config is not None else base
    explicit_max = kwargs.get("max_length") is not None or given.max_length is not None
    explicit_min = kwargs.get("min_length") is not None or given.min_length is not None
    gen, unused = model._prepare_generation_config(call_config, **kwargs)
    unused = sorted(set(unused) - {"output_attentions", "output_hidden_states"})
    if unused:
        raise TypeError(
            f"dm.generate does not take {unused}: it takes input_ids, attention_mask, generation-config "
            f"values (max_new_tokens, repetition_penalty, ...) and {', '.join(_LOOP_ARGUMENTS)}"
        )
    _refuse_what_cannot_be_honoured(gen)
    model._prepare_special_tokens(gen, True, device=input_ids.device)
    if attention_mask is None:
        attention_mask = model._prepare_attention_mask_for_generation(input_ids, gen, {})
    gen = model._prepare_generated_length(
        gen, has_default_max_length=not explicit_max, has_default_min_length=not explicit_min,
        model_input_name="input_ids", input_ids_length=input_ids.shape[1], inputs_tensor=input_ids,
    )
    processors = model._get_logits_processor(
        gen, input_ids_seq_length=input_ids.shape[1], encoder_input_ids=input_ids,
        prefix_allowed_tokens_fn=loop.get("prefix_allowed_tokens_fn"),
        logits_processor=loop.get("logits_processor") or LogitsProcessorList(), device=input_ids.device,
        model_kwargs={"attention_mask": attention_mask},
    )
    stopping = model._get_stopping_criteria(
        gen, loop.get("stopping_criteria") or StoppingCriteriaList(), tokenizer=loop.get("tokenizer")
    )
    # as _sample: rows finished by an EOS-like criterion are padded while the others go on
    pad = gen._pad_token_tensor if any(hasattr(c, "eos_token_id") for c in stopping) else None
    return Decoding(config=gen, processors=processors, stopping=stopping, pad=pad, attention_mask=attention_mask)


def _refuse_what_cannot_be_honoured(gen: GenerationConfig) -> None:
    mode = gen.get_generation_mode()
    if mode not in (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE):
        raise ValueError(
            f"dm.generate decodes greedily or samples, one token per step; the generation config asks for "
            f"{mode.value} (num_beams={gen.num_beams}, penalty_alpha={gen.penalty_alpha}, "
            "assistant/prompt lookup settings): set them back to their defaults, or serve the model "
            "(afdc compile, then afdc up) and use vLLM's API"
        )
    for name, (asks, why) in _REFUSED.items():
        value = getattr(gen, name, None)
        if asks(value):
            raise ValueError(f"dm.generate cannot honour {name}={value!r}: {why}")
