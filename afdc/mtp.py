"""A model's own multi-token-prediction (MTP) layer as the drafter of speculative decoding.

A checkpoint with ``num_nextn_predict_layers`` MTP layers (DeepSeek-V3 and its descendants)
stores them after the decoder layers, as ``model.layers.{num_hidden_layers + i}.*``: ``enorm``,
``hnorm``, ``eh_proj``, a whole decoder layer (attention and MoE) and ``shared_head.norm`` /
``shared_head.head``. transformers builds none of it (its models drop those weights on load).
vLLM's drafter (``vllm/model_executor/models/deepseek_mtp.py``) computes, for a token ``t`` at
position ``p``::

    x  = eh_proj(cat(enorm(embed(t) if p > 0 else 0), hnorm(h)))
    y  = decoder_layer(x)            # attention over the drafter's own KV cache
    h' = shared_head.norm(y);  logits = shared_head.head(h')

where ``h`` is the target model's last hidden state (its LM head's input) at position ``p - 1``,
and each further draft continues from the previous draft's ``h'``. The first MTP layer is the
drafter (vLLM takes layer ``i % n`` for draft ``i`` of a checkpoint with ``n``; all shipped
checkpoints we know have one).

:func:`attach` appends the MTP layer to the target's own layer list, so that the model's tensor
names are the checkpoint's (the target's forward runs its first ``num_hidden_layers`` layers only);
:func:`drafter` is a causal LM over those modules whose forward is the drafter's, so afdc captures
and splits it like any model: its attention on the attention side, its MoE on the FFN ranks. The
hidden states it continues from are a step's data, handed to it through ``afdc::previous_hidden``.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.masking_utils import create_causal_mask
from transformers.modeling_outputs import CausalLMOutputWithPast

from afdc import ops
from afdc.errors import UnsupportedModelError

# the config fields that count a checkpoint's MTP layers, as the model families name them
_COUNTS = ("num_nextn_predict_layers",)


def mtp_layers(config) -> int:
    """How many MTP layers the checkpoint of ``config`` holds (0: none)."""
    text = config.get_text_config()
    return next((int(getattr(text, name)) for name in _COUNTS if getattr(text, name, None)), 0)


def backbone(model: PreTrainedModel) -> nn.Module:
    """The decoder stack the MTP layer is appended to: a Llama-style one, or a refusal."""
    base = model.base_model
    for part in ("embed_tokens", "layers", "norm", "rotary_emb"):
        if not hasattr(base, part):
            raise UnsupportedModelError(
                f"{type(model).__name__} has MTP layers but its backbone has no '{part}': afdc builds the MTP "
                "drafter of decoders laid out as transformers' Llama-style backbones only"
            )
    return base


def attach(model: PreTrainedModel) -> nn.Module | None:
    """Append the checkpoint's first MTP layer to ``model``'s layers, as the checkpoint names it,
    on the model's device and in its dtype; returns it (None: the model has no MTP layers). Its
    weights are those of a fresh layer until a checkpoint's are loaded into it."""
    if not mtp_layers(model.config):
        return None
    stack = backbone(model)
    config = model.config.get_text_config()
    index = config.num_hidden_layers
    if len(stack.layers) > index:
        return stack.layers[index]  # attached already
    first = stack.layers[0]
    parameter = next(model.parameters())
    hidden, eps = config.hidden_size, getattr(config, "rms_norm_eps", 1e-6)
    norm = type(stack.norm)
    with torch.device(parameter.device):
        layer = type(first)(config, index)  # a decoder layer at the MTP layer's index (MoE where the model's are)
        layer.enorm, layer.hnorm = norm(hidden, eps=eps), norm(hidden, eps=eps)
        layer.eh_proj = nn.Linear(2 * hidden, hidden, bias=False)
        layer.shared_head = nn.Module()
        layer.shared_head.norm = norm(hidden, eps=eps)
        layer.shared_head.head = nn.Linear(hidden, config.vocab_size, bias=False)
    layer.to(parameter.dtype)
    stack.layers.append(layer)
    return layer


class MtpDrafter(PreTrainedModel):
    """The drafter over a target model's modules with its MTP layer attached: ``forward`` takes the
    draft tokens (each the token after the position whose hidden state it continues from) and
    returns the MTP layer's logits; the hidden states come from ``afdc::previous_hidden``."""

    def __init__(self, target: PreTrainedModel):
        super().__init__(target.config)
        self.base_model_prefix = target.base_model_prefix
        setattr(self, target.base_model_prefix, backbone(target))
        self.__dict__["_target"] = target  # not a submodule: only its backbone's tensors are the drafter's

    def _init_weights(self, module: nn.Module) -> None:
        self._target._init_weights(module)

    def mtp_layer(self) -> nn.Module:
        return self.base_model.layers[self.config.get_text_config().num_hidden_layers]

    def forward(self, input_ids, attention_mask=None, position_ids=None, cache=None, **kwargs):
        backbone, layer = self.base_model, self.mtp_layer()
        embeds = backbone.embed_tokens(input_ids)
        if position_ids is None:  # as the backbone numbers them: after what the cache holds
            past = cache.get_seq_length() if cache is not None else 0
            position_ids = (torch.arange(input_ids.shape[1], device=input_ids.device) + past).unsqueeze(0)
        embeds = embeds.masked_fill((position_ids == 0).unsqueeze(-1), 0)  # as vLLM's: no token before position 0
        previous = ops.previous_hidden(embeds)
        hidden = layer.eh_proj(torch.cat([layer.enorm(embeds), layer.hnorm(previous)], dim=-1))
        mask = create_causal_mask(config=self.config, inputs_embeds=hidden, attention_mask=attention_mask,
                                  cache=cache, position_ids=position_ids)
        hidden = layer(hidden, attention_mask=mask, position_ids=position_ids, cache=cache,
                       position_embeddings=backbone.rotary_emb(hidden, position_ids), **kwargs)
        return CausalLMOutputWithPast(logits=layer.shared_head.head(layer.shared_head.norm(hidden)))


def drafter(model: PreTrainedModel) -> MtpDrafter | None:
    """The MTP drafter of ``model`` (its MTP layer attached first); None for a model without one."""
    if attach(model) is None:
        return None
    # the attention and experts implementations the target's class supports are the drafter's: it
    # runs its layer (transformers reads some of them off the source of the class's module)
    flags = {k: getattr(type(model), k) for k in dir(type(model)) if k.startswith("_supports_")}
    cls = type(MtpDrafter.__name__, (MtpDrafter,), {**flags, "__module__": type(model).__module__})
    return cls(model)
