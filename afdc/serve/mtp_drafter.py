"""Drafting with the model's own MTP layer in afdc's vLLM worker (``--speculative-config '{"method":
"mtp", "num_speculative_tokens": k}'``), as vLLM's own proposer does it (``llm_base_proposer.py``).

The artifact holds the drafter's attention program beside the model's (:mod:`afdc.mtp`); its MoE
is the FFN ranks' last layer. After each step, the drafter runs once over every position whose
token after it is known: for a request that sampled, the known tokens it ran and the drafts it
kept (their token after: the next kept one, the last one's the token just sampled); for a prefill
chunk short of its prompt, the chunk (the prompt's next token after it). Each position's input is
the target's LM-head input there (kept by ``afdc::sampled_rows``) and the token after it; the
drafter writes its own KV cache at the position (a paged store of its own on the same block ids,
so prefix caching and copy-on-write hold for it too), and its logits at a request's last position
give the first draft, greedily. Each further draft is one more pass of one token per request, at
the next position, on the last draft and the drafter's own LM-head input of the pass before. Those
passes write the drafter's cache at positions the next step's first pass writes again. Every pass
is one exchange with the FFN ranks for the drafter's one FFN layer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from afdc.runtime.attention_rank import MicroBatch
from afdc.runtime.paged import PagedBatch, PagedKVStore


@dataclass(frozen=True)
class DraftRow:
    """One request's tokens in the drafter's first pass after a step."""

    index: int  # the request's index in the step (and in its hidden rows' order)
    start: int  # position of its first token: its computed tokens before the step
    ids: list[int]  # the token after each position
    drafts: bool  # whether it proposes drafts (else the pass only writes the drafter's cache)


def first_pass(computed: Sequence[int], scheduled: Sequence[int], drafted: Sequence[int], tokens: Sequence[list[int]],
               kept: Sequence[list[int] | None], proposes: Sequence[bool]) -> list[DraftRow]:
    """Each request's positions of the step whose next token is known, for the drafter's first
    pass. Per request: its computed tokens before the step, the tokens it ran, how many of them
    were drafts, its tokens now (the kept ones appended), the tokens the step kept (None: a chunk
    short of its prompt, which samples nothing) and whether it may propose."""
    rows = []
    for i, (c, n, d, toks, k) in enumerate(zip(computed, scheduled, drafted, tokens, kept)):
        valid = n if k is None else n - d + len(k) - 1
        ids = list(toks[c + 1:c + 1 + valid])
        if len(ids) != valid:
            raise RuntimeError(f"the drafter needs {valid} tokens after position {c}; the request has {len(ids)}")
        rows.append(DraftRow(i, c, ids, proposes[i] and k is not None))
    return rows


class MtpDrafts:
    """The drafter program of one attention rank, its KV cache, and its passes after each step."""

    def __init__(self, program, store: PagedKVStore, k: int):
        self.program = program
        self.store = store
        self.k = k

    def propose(self, rows: list[DraftRow], hidden: torch.Tensor, offsets: Sequence[int],
                block_tables: Sequence[list[int]], k: int,
                run: Callable[[list[MicroBatch], object], list]) -> dict[int, list[int]]:
        """Up to ``k`` drafts per request of ``rows`` that proposes, by its index. ``hidden``
        ``[T, h]``: the step's LM-head inputs, request ``i``'s from row ``offsets[i]``;
        ``block_tables``: each request's attention blocks; ``run(batches, program)`` runs a pass
        (a step of its own, through the FFN ranks) and returns its outputs."""
        k = min(k, self.k)
        rows = [r for r in rows if r.ids]
        if not rows:
            return {}
        previous = torch.cat([hidden[offsets[r.index]:offsets[r.index] + len(r.ids)] for r in rows])
        batch = self._batch([r.ids for r in rows], [r.start for r in rows], [block_tables[r.index] for r in rows],
                            previous)
        logits = run([batch], self.program)[0].logits
        # the first pass runs even when the step asks for no drafts (vLLM's dynamic speculative
        # decoding's k = 0 at some batch sizes): a later step's drafts read its cache at these positions
        proposing = [j for j, r in enumerate(rows) if r.drafts]
        if not proposing or k <= 0:
            return {}
        ends = torch.tensor([len(r.ids) for r in rows]).cumsum(0) - 1
        draft = logits.flatten(0, -2)[proposing].argmax(-1)
        recycled = batch.cache.hidden[0, ends[proposing]]
        drafts = [[t] for t in draft.tolist()]
        position = [rows[j].start + len(rows[j].ids) for j in proposing]
        tables = [block_tables[rows[j].index] for j in proposing]
        for step in range(1, k):
            batch = self._batch([[d[-1]] for d in drafts], [p + step - 1 for p in position], tables, recycled)
            logits = run([batch], self.program)[0].logits
            draft = logits.flatten(0, -2).argmax(-1)
            recycled = batch.cache.hidden[0]
            for d, t in zip(drafts, draft.tolist()):
                d.append(t)
        return {rows[j].index: d for j, d in zip(proposing, drafts)}

    def _batch(self, ids: list[list[int]], starts: list[int], tables: list[list[int]],
               previous: torch.Tensor) -> MicroBatch:
        """One pass's micro-batch: each request's ``ids`` from position ``starts`` on, continuing
        from ``previous [T, h]``."""
        device = self.store.device
        width = max(len(b) for b in tables)
        paged = PagedBatch(self.store, torch.tensor([b + [0] * (width - len(b)) for b in tables]),
                           torch.tensor(starts), torch.tensor([len(i) for i in ids]))
        paged.keep_hidden = True
        paged.previous_hidden = previous[None]
        flat = torch.tensor([t for row in ids for t in row], device=device)[None]
        return MicroBatch(flat, torch.ones_like(flat), paged.positions, paged)
