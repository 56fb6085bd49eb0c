"""Capture: a Hugging Face causal LM's forward as one FX graph with opaque attention ops.

afdc registers its own attention implementation (and mask builder) with transformers'
``AttentionInterface`` (:mod:`.attention_hooks`); the implementation calls the ``afdc::attention``
custom op, so every softmax-attention call becomes exactly one graph node, whatever backend the
model would have used. The forward is then captured with non-strict ``torch.export``
(:mod:`.export`) with symbolic batch, token and key lengths, on real or meta tensors, and the
exported program becomes a :class:`CapturedGraph` (:mod:`.canonical`).

A stateful token mixer (a convolution window, an SSM or linear-attention state kept from step to
step) is found by what its forward does with the cache: the stand-in cache (:mod:`.standin_cache`)
answers nothing of per-layer state, and the module whose forward asks for it is made one
``afdc::mixer`` op per call (:mod:`.mixer_discovery`, :mod:`afdc.mixer_site`), whose Python loops then
stay out of the graph.

The graph's inputs are ``input_ids [b, s]``, ``attention_mask [b, kv]`` and ``position_ids [b, s]``,
where the queries are the last ``s`` of the ``kv`` positions: the same graph runs prefill
(``kv == s``) and incremental decode against the KV cache held by the attention op. What the
forward reads of its cache (how many tokens it holds: every cache position in transformers is
``arange(s) + cache length``) is answered as ``kv - s`` by a stand-in cache that stores nothing.

What one export attempt has traced (attention slots, mixer call sites, mask windows) is held by a
:class:`~.session.CaptureSession` made for that attempt; :mod:`.driver` runs the attempts.
"""

from afdc.capture.attention_hooks import IMPLEMENTATION
from afdc.capture.captured import INPUT_NAMES, CapturedGraph, key_length_tied
from afdc.capture.driver import capture
from afdc.capture.export import takes_positions

__all__ = ["IMPLEMENTATION", "INPUT_NAMES", "CapturedGraph", "capture", "key_length_tied", "takes_positions"]
