"""A vLLM-style paged KV cache for the attention side.

A serving engine's scheduler hands each step a flat run of tokens from many requests (prefills,
prefill chunks after a prefix-cache hit or an earlier chunk, single-token decodes) and, per
request, a block table naming the fixed-size cache blocks that hold its keys and values. The
attention program runs on that flat batch as one sequence (``input_ids [1, T]``, the tokens'
own positions as ``position_ids``) with a :class:`PagedBatch` as the active cache
(``kv_cache.active``). Each ``afdc::attention`` call then writes its keys and values into the
blocks and attends per request over the cached keys.

The graph's mask is ignored there: it is causal over the whole flat batch, wrong across
requests. Which keys a query reaches comes from the slot's :class:`SlotSpec` instead, and
:func:`afdc.lowering.attention_slots.attention_slots` derives it by running each call site's mask computation, refusing
masks the paged path cannot reproduce rather than serving a silently different model.

Programs whose masks depend on the hidden states (a sparse-attention indexer's top-k choice) run
on :class:`PagedRows` instead: the step's requests as the rows of a left-padded batch, where the
graph's own masks are right.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Callable, Sequence
from dataclasses import replace

import torch

from afdc.codegen.paged_attention import decode_kernel_runs, paged_decode_attention
from afdc.mixer_site import MixerSite
from afdc.ops import SlotSpec, causal_mask, reference_attention

# -- the cache ------------------------------------------------------------------------------------


class PagedKVStore:
    """Per slot, keys ``[num_blocks, block_size, kv_heads, head_dim]`` and values
    ``[num_blocks, block_size, kv_heads, value_dim]`` (a sparse-attention indexer's key cache is
    a store of one-head slots with ``value_dim == 0``).

    A block id names the same block in every slot, as vLLM's block tables do. ``kv`` hands over
    existing ``(keys, values)`` per slot (a serving engine's own allocation; they must be
    contiguous over blocks and block positions, vLLM's layout); otherwise zeroed tensors of
    ``dtype`` on ``device`` are allocated. Under ``--attn-tp N`` (``tp_ranks``) the store holds
    the heads of N TP ranks side by side, and :meth:`tp_shard` is one rank's view of its own.
    """

    def __init__(
        self,
        slots: Sequence[SlotSpec],
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        kv: Sequence[tuple[torch.Tensor, torch.Tensor]] | None = None,
        tp_ranks: int = 1,
    ):
        self.slots = tuple(slots)
        self.tp_ranks = tp_ranks
        if any(s.kv_heads % tp_ranks for s in self.slots):
            raise ValueError(f"{tp_ranks} TP ranks do not share the key/value heads of {self.slots} evenly")
        self.num_blocks, self.block_size = num_blocks, block_size
        if kv is None:
            kv = [
                tuple(torch.zeros(self._shape(s, dim), dtype=dtype, device=device) for dim in (s.head_dim, s.value_dim))
                for s in self.slots
            ]
        if len(kv) != len(self.slots):
            raise ValueError(f"{len(kv)} key/value pairs for {len(self.slots)} slots")
        self.keys = [k for k, _ in kv]
        self.values = [v for _, v in kv]
        # no slots: a program whose attention is all in stateful mixers (DeepSeek-V4's)
        self.dtype, self.device = (self.keys[0].dtype, self.keys[0].device) if kv else (dtype, torch.device(device))
        for i, (s, k, v) in enumerate(zip(self.slots, self.keys, self.values)):
            self._check(k, self._shape(s, s.head_dim), f"slot {i} keys")
            self._check(v, self._shape(s, s.value_dim), f"slot {i} values")
        # [num_blocks * block_size, heads, dim] views (checked above: flattening copies nothing): a
        # token's cache slot indexes them directly
        self._flat_keys = [k.flatten(0, 1) for k in self.keys]
        self._flat_values = [v.flatten(0, 1) for v in self.values]

    def tp_shard(self, tp_rank: int) -> PagedKVStore:
        """TP rank ``tp_rank``'s heads of every slot: a view, written in place."""
        if self.tp_ranks == 1:
            return self

        def heads(t: torch.Tensor) -> torch.Tensor:
            n = t.shape[2] // self.tp_ranks
            return t.narrow(2, tp_rank * n, n)

        slots = [replace(s, kv_heads=s.kv_heads // self.tp_ranks) for s in self.slots]
        kv = [(heads(k), heads(v)) for k, v in zip(self.keys, self.values)]
        return PagedKVStore(slots, self.num_blocks, self.block_size, kv=kv)

    def _shape(self, spec: SlotSpec, dim: int) -> tuple[int, ...]:
        return (self.num_blocks, self.block_size, spec.kv_heads, dim)

    def _check(self, t: torch.Tensor, shape: tuple[int, ...], what: str) -> None:
        if tuple(t.shape) != shape or t.dtype != self.dtype or t.device != self.device:
            raise ValueError(
                f"{what}: expected {shape} {self.dtype} on {self.device}, got {tuple(t.shape)} {t.dtype} on {t.device}"
            )
        if t.stride(0) != self.block_size * t.stride(1):
            raise ValueError(f"{what}: blocks and block positions must be contiguous (one token slot index)")

    def write(self, slot: int, slot_mapping: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        """Store ``[T, kv_heads, dim]`` keys and values at token slots ``slot_mapping`` ``[T]``."""
        self._flat_keys[slot].index_copy_(0, slot_mapping, key.to(self.dtype))
        self._flat_values[slot].index_copy_(0, slot_mapping, value.to(self.dtype))

    def read(self, slot: int, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values at token slots ``index`` (any shape ``S``): ``[*S, kv_heads, dim]``."""
        return self._flat_keys[slot][index], self._flat_values[slot][index]

    def token_slots(self, block_table: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The token slot of position ``positions`` of request ``rows`` (broadcast) in the blocks
        ``block_table [R, max_blocks]`` names."""
        return block_table[rows, positions // self.block_size] * self.block_size + positions % self.block_size

    def gather(self, slot: int, index: torch.Tensor, pad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per request its keys and values at token slots ``index [R, kv]``, ``[R, kv_heads, kv,
        dim]``, zeros where ``pad [R, kv, 1, 1]``: pad slots point anywhere, and unwritten cache
        memory could hold NaN, which a masked-out key still spreads through softmax and the value
        product."""
        return tuple(t.masked_fill(pad, 0).transpose(1, 2) for t in self.read(slot, index))

    def zero_blocks(self, block_ids: torch.Tensor | Sequence[int]) -> None:
        """Clear blocks in every slot (e.g. freshly allocated ones)."""
        ids = torch.as_tensor(block_ids, dtype=torch.long, device=self.device)
        for t in (*self.keys, *self.values):
            t.index_fill_(0, ids, 0)

    def copy_blocks(self, pairs: torch.Tensor | Sequence[tuple[int, int]]) -> None:
        """Copy block ``src`` to ``dst`` for each ``(src, dst)`` in every slot (copy-on-write of a
        shared, partly filled block). Sources are read before any destination is written."""
        src, dst = torch.as_tensor(pairs, dtype=torch.long, device=self.device).reshape(-1, 2).unbind(1)
        for t in (*self.keys, *self.values):
            t.index_copy_(0, dst, t.index_select(0, src))


class MixerStateStore:
    """Per stateful-mixer slot, its state tensors ``[num_blocks, *shape]``: one block per
    sequence holds its convolution window and recurrent state (vLLM's Mamba-style state blocks,
    whose ids come from the mixer's own cache group)."""

    def __init__(self, sites: Sequence[MixerSite], num_blocks: int, device: torch.device | str = "cpu"):
        self.tensors = {
            site.slot: [
                torch.zeros(num_blocks, *t.shape, dtype=getattr(torch, t.dtype), device=device) for t in site.state
            ]
            for site in sites
        }


class _MixerStep:
    """A paged step's stateful mixers: each request's state in block ``state_blocks[slot][r]`` of
    ``mixer_store``, loaded for each group of requests a mixer call runs together, the new
    state held until :meth:`commit_states` (the step went through), so that a step cut short
    and run again starts from the same state."""

    def _hold_states(self, mixer_store: MixerStateStore | None, state_blocks: dict[int, torch.Tensor] | None,
                     device: torch.device) -> None:
        self.mixer_store = mixer_store
        self.state_blocks = {slot: b.to(device, torch.long) for slot, b in (state_blocks or {}).items()}
        self._new_states: dict[int, list[tuple[torch.Tensor, list[torch.Tensor]]]] = {}
        self._group_states: dict[int, object] = {}  # group -> its transformers cache

    def _run_groups(self, mixers, slot: int, groups: list[tuple[torch.Tensor, int]], run_group) -> None:
        """For each group ``(request indices, tokens they ran before)``, ``run_group(i, state)``
        over their state (empty where they ran none), and keep what it leaves."""
        if self.mixer_store is None or slot not in self.state_blocks:
            raise ValueError(f"this paged step has no state blocks for stateful mixer slot {slot}")
        store, blocks = self.mixer_store.tensors[slot], self.state_blocks[slot]
        new = self._new_states[slot] = []
        for group, (requests, tokens) in enumerate(groups):
            # one transformers cache per group for the step; each call resets its own layer in it
            if group not in self._group_states:
                self._group_states[group] = mixers.new_state()
            state, ids = self._group_states[group], blocks[requests]
            mixers.reset(state, slot, [t[ids] for t in store] if tokens else None, tokens)
            run_group(group, state)
            new.append((ids, [t.clone() for t in mixers.read(state, slot)]))

    def commit_states(self) -> None:
        """Write the step's new mixer state into the store (the step went through)."""
        for slot, groups in self._new_states.items():
            for ids, tensors in groups:
                for t, value in zip(self.mixer_store.tensors[slot], tensors):
                    t[ids] = value.to(t.dtype)
        self._new_states.clear()


class PagedBatch(_MixerStep):
    """One step (or one micro-batch of a step) over a :class:`PagedKVStore`: the context to make
    active with ``kv_cache.active`` while the attention program runs on the step's tokens.

    ``block_table [R, max_blocks]`` holds request ``r``'s block ids, ``context_lens [R]`` how many
    of its tokens are cached already (prefix-cache hits, earlier chunks, decoded tokens), and
    ``query_lens [R]`` (each >= 1) how many it has in this step. The step's ``T`` tokens are
    request 0's, then request 1's, ...; token ``i`` of request ``r`` sits at position
    ``context_lens[r] + i``. Run the program on ``input_ids [1, T]``, ``attention_mask =
    ones [1, T]`` and ``position_ids =`` :attr:`positions`.

    Stateful mixers keep each request's state in block ``state_blocks[slot][r]`` of
    ``mixer_store``; a step's new state is written by :meth:`commit_states`, once the step is
    through, so that a step cut short and run again starts from the same state.

    ``logit_rows [N]`` (of the ``T`` tokens) are those whose logits the program's LM head
    computes under ``afdc::sampled_rows``: by default each request's last, where it samples; a
    request that wants its prompt logprobs takes all of its own. ``keep_hidden``, ``hidden`` and
    ``previous_hidden`` carry the hidden states of speculative decoding with an MTP drafter.

    The index tensors every layer uses are built here once; the only host sync is for the
    step's sizes.
    """

    def __init__(
        self,
        store: PagedKVStore,
        block_table: torch.Tensor,
        context_lens: torch.Tensor,
        query_lens: torch.Tensor,
        mixer_store: MixerStateStore | None = None,
        state_blocks: dict[int, torch.Tensor] | None = None,
        logit_rows: torch.Tensor | None = None,
    ):
        device = store.device
        self.store = store
        self._hold_states(mixer_store, state_blocks, device)
        self._groups: list[tuple[torch.Tensor, torch.Tensor, int]] | None = None
        self.block_table = block_table.to(device, torch.long)
        self.context_lens = context_lens.to(device, torch.long)
        self.query_lens = query_lens.to(device, torch.long)
        self.seq_lens = self.context_lens + self.query_lens
        q_lens, ctx_lens = self.query_lens, self.context_lens
        sizes = torch.stack([q_lens.sum(), q_lens.max(), self.seq_lens.max(), q_lens.min(), ctx_lens.min()])
        self.num_tokens, self.max_query_len, self.max_seq_len, min_query, min_context = sizes.tolist()
        self._check(min_query, min_context)
        requests, max_q = self.query_lens.shape[0], self.max_query_len

        request = torch.repeat_interleave(
            torch.arange(requests, device=device), self.query_lens, output_size=self.num_tokens
        )
        offset = torch.arange(self.num_tokens, device=device) - (self.query_lens.cumsum(0) - self.query_lens)[request]
        positions = self.context_lens[request] + offset
        self.positions = positions[None]  # [1, T]: the program's position_ids
        # the token rows whose logits the step wants: by default each request's last (where it samples)
        self.logit_rows = self.query_lens.cumsum(0) - 1 if logit_rows is None else logit_rows.to(device, torch.long)
        # speculative decoding with an MTP drafter (afdc.mtp): each token's LM-head input, kept by
        # afdc::sampled_rows where asked; the hidden states a drafter's tokens continue from
        self.keep_hidden = False
        self.hidden: torch.Tensor | None = None  # [1, T, hidden]
        self.previous_hidden: torch.Tensor | None = None  # [1, T, hidden], read by afdc::previous_hidden
        self.slot_mapping = store.token_slots(self.block_table, request, positions)  # [T]
        self._query_index = request * max_q + offset  # token -> row of the padded [R * max_q] queries

        k_pos = torch.arange(self.max_seq_len, device=device)
        key_valid = k_pos < self.seq_lens[:, None]
        rows = torch.arange(requests, device=device)[:, None]
        self._key_index = torch.where(key_valid, store.token_slots(self.block_table, rows, k_pos), 0)
        self._key_pad = ~key_valid[..., None, None]
        q_pos = self.context_lens[:, None] + torch.arange(max_q, device=device)
        self._masks = {  # per distinct reach, [R, 1, max_q, max_kv]
            _reach_key(s): s.allowed(q_pos[:, None, :, None], k_pos) for s in set(store.slots)
        }
        self._kernel = paged_attention_impl(device.type)

    def _check(self, min_query: int, min_context: int) -> None:
        requests = self.query_lens.shape[0]
        if self.context_lens.shape != (requests,) or self.block_table.shape[0] != requests:
            raise ValueError(
                f"{requests} query lengths, {tuple(self.context_lens.shape)} context lengths and "
                f"{tuple(self.block_table.shape)} block table rows: one each per request"
            )
        if min_query < 1 or min_context < 0:
            raise ValueError("every request needs at least one token this step and no negative context")
        if self.block_table.shape[1] * self.store.block_size < self.max_seq_len:
            raise ValueError(
                f"a request reaches {self.max_seq_len} tokens; {self.block_table.shape[1]} blocks of "
                f"{self.store.block_size} do not hold them"
            )

    def run_mixer(self, mixers, slot: int, hidden: torch.Tensor, mask, run) -> torch.Tensor:
        """A stateful mixer's call (:mod:`afdc.runtime.mixer_modules`) over the flat ``[1, T, d]`` step:
        the decoding requests together, one row each; every other request alone (its state
        loaded when it has computed tokens: a later prefill chunk, a resumed decode)."""
        width, groups = hidden.shape[-1], self._mixer_groups()
        out = torch.empty_like(hidden)

        def run_group(group: int, state) -> None:
            rows, requests, _ = groups[group]
            out[0, rows] = run(hidden[0, rows].reshape(len(requests), -1, width), None, state).reshape(-1, width)

        self._run_groups(mixers, slot, [(requests, tokens) for _, requests, tokens in groups], run_group)
        return out

    def _mixer_groups(self) -> list[tuple[torch.Tensor, torch.Tensor, int]]:
        """(token rows, request indices, tokens they ran before: 0 for none, else the first's), decodes first."""
        if self._groups is None:
            q, ctx = self.query_lens.tolist(), self.context_lens.tolist()
            starts = [0, *itertools.accumulate(q)]
            decode = [r for r in range(len(q)) if q[r] == 1 and ctx[r] > 0]
            groups = [(decode, [starts[r] for r in decode], ctx[decode[0]])] if decode else []
            groups += [([r], list(range(starts[r], starts[r + 1])), ctx[r]) for r in range(len(q)) if r not in decode]
            device = self.query_lens.device
            self._groups = [
                (torch.tensor(rows, device=device), torch.tensor(requests, device=device), tokens)
                for requests, rows, tokens in groups
            ]
        return self._groups

    def tp_shard(self, tp_rank: int) -> PagedBatch:
        """This step over TP rank ``tp_rank``'s heads of the store (see :mod:`afdc.runtime.tensor_parallel`)."""
        shard = copy.copy(self)
        shard.store = self.store.tp_shard(tp_rank)
        shard._group_states = {}  # TP ranks run at once, each its own whole mixers
        return shard

    def attend(self, slot, q, k, v, mask, scale, softcap, sinks, window) -> torch.Tensor:
        """The ``kv_cache`` entry point: store the step's keys and values, attend per request.

        ``mask`` and ``window`` are ignored; the slot's :class:`SlotSpec` says what each query
        reaches. ``q`` is ``[1, hq, T, d]``; returns ``[1, T, hq, dv]``.
        """
        if q.shape[0] != 1 or q.shape[2] != self.num_tokens:
            raise ValueError(
                f"a paged step runs its {self.num_tokens} tokens as one flat row; the attention got "
                f"queries {tuple(q.shape)}"
            )
        self.store.write(slot, self.slot_mapping, k[0].transpose(0, 1), v[0].transpose(0, 1))
        return self._kernel(self, slot, q, scale, softcap, sinks)

    # the padded per-request layout the torch implementation attends in

    def padded_queries(self, q: torch.Tensor) -> torch.Tensor:
        """``[1, hq, T, d]`` -> ``[R, hq, max_q, d]``, zeros past each request's tokens."""
        tokens = q[0].transpose(0, 1)
        padded = tokens.new_zeros(self.query_lens.shape[0] * self.max_query_len, *tokens.shape[1:])
        padded[self._query_index] = tokens
        return padded.unflatten(0, (-1, self.max_query_len)).transpose(1, 2)

    def padded_keys(self, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Each request's cached keys and values, ``[R, hk, max_kv, d]``, zeros past its length."""
        return self.store.gather(slot, self._key_index, self._key_pad)

    def mask(self, slot: int) -> torch.Tensor:
        """``[R, 1, max_q, max_kv]``: which cached keys each (padded) query attends to."""
        return self._masks[_reach_key(self.store.slots[slot])]

    def unpad(self, out: torch.Tensor) -> torch.Tensor:
        """``[R, max_q, hq, dv]`` -> the flat ``[1, T, hq, dv]``."""
        return out.flatten(0, 1)[self._query_index][None]


class PagedRows(_MixerStep):
    """One step's requests as the rows of a left-padded batch over a :class:`PagedKVStore`: for
    attention programs whose masks a flat batch cannot rebuild from positions (a sparse-attention
    indexer picks each query's keys from the hidden states, over keys it caches itself; a
    stateful mixer that is an attention of its own, given the graph's mask, as DeepSeek-V4's).

    The program runs as ``dm.generate`` runs it: on ``input_ids [R, s]`` with
    :attr:`attention_mask` ``[R, kv]`` marking each row's cached keys, right-aligned, and
    :attr:`positions`; every attention call applies the graph's own mask to the keys gathered from
    the blocks, and every ``afdc::cached_keys`` call extends the indexer's keys kept in
    ``key_store`` at the same token slots. All rows have the same ``s`` tokens this step (decoding
    requests together, a prefill or chunk alone), so no row's queries are padded.

    Stateful mixers run each group of rows that ran the same number of tokens together (their
    states, in ``mixer_store`` as for :class:`PagedBatch`, then have the same shapes).
    """

    def __init__(
        self,
        store: PagedKVStore,
        block_table: torch.Tensor,
        context_lens: torch.Tensor,
        query_len: int,
        key_store: PagedKVStore | None = None,
        logit_rows: torch.Tensor | None = None,
        mixer_store: MixerStateStore | None = None,
        state_blocks: dict[int, torch.Tensor] | None = None,
    ):
        device = store.device
        self.store, self.key_store = store, key_store
        self._hold_states(mixer_store, state_blocks, device)
        block_table, context_lens = block_table.to(device, torch.long), context_lens.to(device, torch.long)
        self.context_lens = context_lens
        requests, bs, s = context_lens.shape[0], store.block_size, query_len
        seq_lens = context_lens + s
        kv = int(seq_lens.max())
        if block_table.shape[0] != requests or (store.slots and block_table.shape[1] * bs < kv):
            raise ValueError(
                f"{requests} requests reaching {kv} tokens need a block table row each of at least "
                f"{-(-kv // bs)} blocks of {bs}; got {tuple(block_table.shape)}"
            )
        rows = torch.arange(requests, device=device)[:, None]
        self.positions = context_lens[:, None] + torch.arange(s, device=device)  # [R, s]
        if store.slots:
            self.slot_mapping = store.token_slots(block_table, rows, self.positions).flatten()
        k_pos = torch.arange(kv, device=device) - (kv - seq_lens[:, None])  # [R, kv]: < 0 is padding
        valid = k_pos >= 0
        if store.slots:  # a program whose attention is all in mixers (DeepSeek-V4) caches no keys here
            self._key_index = torch.where(valid, store.token_slots(block_table, rows, k_pos.clamp(min=0)), 0)
            self._key_pad = ~valid[..., None, None]
        self.attention_mask = valid.long()  # [R, kv]: the program's attention_mask
        # the tokens of each row whose logits the step wants: by default its last (where it samples)
        self.logit_rows = torch.tensor([s - 1], device=device) if logit_rows is None else logit_rows.to(device)
        self._shape = (requests, s)

    def attend(self, slot, q, k, v, mask, scale, softcap, sinks, window) -> torch.Tensor:
        """The ``kv_cache`` entry point: store the step's keys and values, attend over each row's
        cached keys with the call's ``mask`` (``[R, 1 or h, s, kv]``, the graph's own)."""
        if (q.shape[0], q.shape[2]) != self._shape:
            raise ValueError(f"a paged step of {self._shape} (rows, tokens): the attention got {tuple(q.shape)}")
        self.store.write(slot, self.slot_mapping, k.transpose(1, 2).flatten(0, 1), v.transpose(1, 2).flatten(0, 1))
        keys, values = self.store.gather(slot, self._key_index, self._key_pad)
        if mask is None:  # the op's default (causal, queries last) and each row's own keys
            mask = self.attention_mask.bool()[:, None, None, :] & causal_mask(q.shape[2], keys.shape[2], q.device)
        return reference_attention(q, keys.to(q.dtype), values.to(q.dtype), mask, scale, softcap, sinks)

    def extend_keys(self, slot: int, keys: torch.Tensor) -> torch.Tensor:
        """``afdc::cached_keys``: store the step's indexer keys ``[R, s, d]``, return each row's
        cached keys ``[R, kv, d]`` (zeros where the row is padded)."""
        if self.key_store is None:
            raise ValueError(f"this paged step has no key store for sparse-attention indexer slot {slot}")
        flat = keys.flatten(0, 1)[:, None]
        self.key_store.write(slot, self.slot_mapping, flat, flat.new_empty(flat.shape[0], 1, 0))
        held, _ = self.key_store.gather(slot, self._key_index, self._key_pad)
        return held[:, 0].to(keys.dtype)

    def run_mixer(self, mixers, slot: int, hidden: torch.Tensor, mask, run) -> torch.Tensor:
        """A stateful mixer's call over the rows ``[R, s, d]``: each group of rows that ran the
        same number of tokens together, its inputs (the graph's, e.g. its mask) cut to its rows."""
        lens = self.context_lens.tolist()
        groups = [torch.tensor([r for r, n in enumerate(lens) if n == tokens]) for tokens in dict.fromkeys(lens)]
        out = torch.empty_like(hidden)

        def run_group(group: int, state) -> None:
            rows = groups[group].to(hidden.device)
            whole = len(groups) == 1
            out[rows] = run(hidden[rows], None if mask is None else mask[rows], state, None if whole else rows)

        self._run_groups(mixers, slot, [(rows, lens[int(rows[0])]) for rows in groups], run_group)
        return out

    def tp_shard(self, tp_rank: int) -> PagedRows:
        """This step over TP rank ``tp_rank``'s heads; the indexer's one key head is every rank's
        (each writes the same keys)."""
        shard = copy.copy(self)
        shard.store = self.store.tp_shard(tp_rank)
        shard._group_states = {}  # TP ranks run at once, each its own whole mixers
        return shard


def _reach_key(spec: SlotSpec) -> tuple[int, bool]:
    return spec.window, spec.chunked


# -- kernels --------------------------------------------------------------------------------------

# (batch, slot, q [1, hq, T, d], scale, softcap, sinks) -> [1, T, hq, dv], called once the step's
# keys and values are in the store; reads what it needs from the batch (block table, lengths,
# slot_mapping, the slot's SlotSpec) and the store's tensors.
PagedAttention = Callable[[PagedBatch, int, torch.Tensor, float, float, torch.Tensor | None], torch.Tensor]

_KERNELS: dict[str, PagedAttention] = {}


def torch_paged_attention(
    batch: PagedBatch, slot: int, q: torch.Tensor, scale: float, softcap: float, sinks: torch.Tensor | None
) -> torch.Tensor:
    """The default on every device: gather each request's keys into a padded batch and run
    :func:`afdc.ops.reference_attention` on it with a per-request mask."""
    keys, values = batch.padded_keys(slot)
    out = reference_attention(
        batch.padded_queries(q), keys.to(q.dtype), values.to(q.dtype), batch.mask(slot), scale, softcap, sinks
    )
    return batch.unpad(out)


def kernel_paged_attention(
    batch: PagedBatch, slot: int, q: torch.Tensor, scale: float, softcap: float, sinks: torch.Tensor | None
) -> torch.Tensor:
    """A decode step (one query per request) in afdc's Triton kernel
    (:func:`afdc.codegen.paged_attention.paged_decode_attention`); any other step, or a device or
    dtype the kernel does not run on, in :func:`torch_paged_attention` for the whole batch, so the
    kernel never changes what the model computes."""
    keys, values = batch.store.keys[slot], batch.store.values[slot]
    if batch.max_query_len != 1 or not decode_kernel_runs(q, keys, values, batch.block_table, batch.seq_lens, sinks):
        return torch_paged_attention(batch, slot, q, scale, softcap, sinks)
    spec = batch.store.slots[slot]
    return paged_decode_attention(
        q, keys, values, batch.block_table, batch.seq_lens, block_size=batch.store.block_size,
        window=spec.window, chunked=spec.chunked, scale=scale, softcap=softcap, sinks=sinks,
    )


def register_paged_attention(device_type: str, kernel: PagedAttention) -> None:
    """Use ``kernel`` for batches whose store is on ``device_type`` (e.g. :func:`kernel_paged_attention`
    for ``"cuda"``); batches built afterwards pick it up."""
    _KERNELS[device_type] = kernel


def paged_attention_impl(device_type: str) -> PagedAttention:
    return _KERNELS.get(device_type, torch_paged_attention)
