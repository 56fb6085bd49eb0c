"""An attention program prepared for a serving engine's steps over a paged KV cache.

A serving engine (vLLM) hands each step a flat run of tokens from many requests
(:class:`afdc.runtime.paged.PagedBatch`); the program as compiled runs a batch of rows, Hugging
Face style. :func:`prepare_for_flat_batches` rewrites a loaded attention program for the steps,
once, before its first run, and says what the engine needs to lay its cache out:

- the paged cache's slots, read off the program (:mod:`afdc.lowering.attention_slots`); a program
  with sparse-attention indexers keeps its own masks and runs on rows of a padded batch instead
  (:class:`afdc.runtime.paged.PagedRows`);
- each token's cache position read from its position (:mod:`afdc.lowering.cache_positions`): in a
  flat batch each request has its own context;
- the LM head on the rows the step names only (:mod:`afdc.lowering.sampled_rows`);
- the backend lowered after those rewrites, and afdc's paged decode kernel where it runs.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from afdc.errors import UnsupportedModelError
from afdc.lowering.attention_slots import program_slots
from afdc.lowering.backends import resolve
from afdc.lowering.cache_positions import positions_as_cache_positions
from afdc.lowering.sampled_rows import sample_rows_only
from afdc.mixer_site import MixerSite
from afdc.ops import SlotSpec
from afdc.runtime.paged import kernel_paged_attention, register_paged_attention
from afdc.runtime.programs import compute_dtype
from afdc.runtime.tensor_parallel import TensorParallelAttention


@dataclass(frozen=True)
class FlatBatchProgram:
    """What a prepared attention program asks of the engine's steps and cache."""

    slots: list[SlotSpec]  # per attention slot, every TP rank's heads side by side (one paged store)
    key_slots: list[SlotSpec]  # per sparse-attention indexer slot, its key cache
    tp_ranks: int  # TP ranks the attention rank runs as (--attn-tp)
    rows: bool  # steps run as rows of a padded batch (PagedRows): indexers, or mixers given the graph's masks
    rows_only: bool  # the LM head runs on the step's logit rows only (else on every token's)
    backend: str  # what runs the program, resolved for the device
    dtype: torch.dtype  # of its activations (compute_dtype): the cache's


def prepare_for_flat_batches(
    program, backend: str, device: torch.device, mixers: list[MixerSite]
) -> FlatBatchProgram:
    """Rewrite ``program`` (an :class:`~afdc.runtime.programs.AttentionProgram` or its TP ranks) in
    place for a serving engine's steps under ``backend`` (the plan's, or the one asked for), and
    describe it. ``mixers``: the model's stateful mixers. Those that are attentions of their own
    (their state grows with the sequence, they take the graph's mask: DeepSeek-V4's) run on rows
    too; those with a fixed state run on a flat batch, so not beside indexers (refused with
    :class:`UnsupportedModelError`)."""
    shards = program.shards if isinstance(program, TensorParallelAttention) else [program]
    slots, key_slots = program_slots(program.module)
    growing = [m.module for m in mixers if not m.fixed_state]
    rows = bool(key_slots) or bool(growing)
    if key_slots and mixers:
        raise UnsupportedModelError(
            "a model with both sparse-attention indexers and stateful mixers: afdc's paged steps run "
            "indexers over rows of a padded batch and mixers over a flat batch, not both yet"
        )
    if growing and (len(shards) > 1 or len(growing) < len(mixers)):
        raise UnsupportedModelError(
            f"the stateful mixers {', '.join(growing)} keep their own keys and compressed entries: afdc serves "
            "them on one attention TP rank, in a model whose every mixer does (not yet under --attn-tp or beside "
            "fixed-state mixers)"
        )
    rows_only = all([sample_rows_only(x.module, x.out_spec) for x in shards])
    if not rows:
        for x in shards:
            positions_as_cache_positions(x.module.graph)
            x.module.recompile()
    program.use_backend(backend)  # lowered after the graph is final
    resolved = resolve(backend, device)
    if resolved == "afdc" and device.type == "cuda":
        register_paged_attention("cuda", kernel_paged_attention)  # decode steps attend in afdc's Triton kernel
    return FlatBatchProgram(
        slots=[replace(x, kv_heads=x.kv_heads * len(shards)) for x in slots],
        key_slots=key_slots,
        tp_ranks=len(shards),
        rows=rows,
        rows_only=rows_only,
        backend=resolved,
        dtype=compute_dtype(program.module),
    )
