"""The stand-in cache the forward gets during capture: it stores nothing and says it holds ``kv - s`` tokens.

What the forward reads of its cache (how many tokens it holds: every cache position in
transformers is ``arange(s) + cache length``) is answered as ``kv - s``. What it has of per-layer
state it answers by naming the module that asked (:class:`StatefulMixer`), which capture then
makes a mixer op (:mod:`afdc.capture.mixer_discovery`), and so does a read of one of its layers.
"""

from __future__ import annotations

import inspect

import torch
from transformers import Cache, PreTrainedModel

from afdc import ops
from afdc.capture.session import CaptureSession

WRAPPED = "model."  # the FQN prefix of the model's tensors inside WithCacheLength

# the forward's cache argument (and output field): transformers 5.24 renamed past_key_values
CACHE_ARGUMENTS = ("cache", "past_key_values")


class CacheLength(Cache):
    """The forward's cache during capture: it holds nothing, and says it holds ``past`` tokens.

    afdc's attention op keeps the keys and values, so the forward needs no real cache; but
    without one it would place every call's tokens at cache positions ``0..s-1`` and decode
    would read the wrong position wherever the forward reads it (Llama 4's NoPE temperature,
    which grows with the position). With this stand-in the positions are ``kv - s + i``: the
    queries are the last ``s`` of the ``kv`` keys, as the attention op places them.
    ``session`` numbers the sparse-attention indexers' key caches."""

    def __init__(self, past, session: CaptureSession):
        super().__init__(layers=[])
        self.layers = _NoLayers()
        self.past = past
        self.session = session

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        return key_states, value_states

    def update_indexer(self, keys, layer_idx):
        """A sparse-attention indexer's keys: those cached for the sequence, then these."""
        return ops.cached_keys(keys, next(self.session.key_slots), keys.shape[1] + self.past)

    def get_seq_length(self, layer_idx: int = 0):
        return self.past

    def get_query_offset(self, layer_idx: int = 0):
        return self.past

    def get_mask_sizes(self, query_length, layer_idx):
        # older transformers pass the queries' cache positions (a tensor with one per query)
        queries = query_length.shape[0] if isinstance(query_length, torch.Tensor) else query_length
        return self.past + queries, 0

    @property
    def is_compileable(self) -> bool:
        return False

    def __getattr__(self, name: str):
        # a cache API of the model's own (MiniMax's get_linear_cache): whoever asks keeps state in
        # the cache; an AttributeError still, so that getattr(cache, name, default) stays quiet
        raise StatefulMixer()

    # per-layer state that only a stateful mixer reads or writes: the caller is one
    def get_conv_state(self, *args, **kwargs):
        raise StatefulMixer()

    get_recurrent_state = update_conv_state = update_recurrent_state = is_recording_past = get_conv_state


class StatefulMixer(AttributeError):
    """Raised by the stand-in cache when a module asks it for per-layer state (or for anything it
    does not have): ``module`` is the innermost module whose code asked."""

    def __init__(self):
        frame = inspect.currentframe()
        module = None
        while frame is not None and module is None:
            owner = frame.f_locals.get("self")
            if isinstance(owner, torch.nn.Module):
                module = owner
            frame = frame.f_back
        del frame
        super().__init__(f"{type(module).__name__} reads per-layer state of the cache")
        self.module = module


class _NoLayers(list):
    """The stand-in's cache layers: none. A module that reads a layer of the cache directly
    (DeepSeek-V4's compressors keep their buffers and compressed entries there) keeps per-layer
    state, so reading one names it as a stateful mixer rather than failing on an index."""

    def __getitem__(self, index):
        raise StatefulMixer()


class WithCacheLength(torch.nn.Module):
    """``model`` called with a :class:`CacheLength` of ``kv - s`` tokens as its argument
    ``argument``, the cache left out of its output (export cannot return it)."""

    def __init__(self, model: PreTrainedModel, argument: str, session: CaptureSession):
        super().__init__()
        self.model = model
        self.argument = argument
        self.session = session

    def forward(self, input_ids, attention_mask, position_ids=None):
        cache = {self.argument: CacheLength(attention_mask.shape[1] - input_ids.shape[1], self.session)}
        positions = {} if position_ids is None else {"position_ids": position_ids}
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, **cache, **positions)
        return type(out)(**{k: v for k, v in out.items() if k not in CACHE_ARGUMENTS})


def cache_argument(model: PreTrainedModel) -> str | None:
    """The forward's argument that takes its cache (None: it takes none)."""
    parameters = inspect.signature(model.forward).parameters
    return next((name for name in CACHE_ARGUMENTS if name in parameters), None)
