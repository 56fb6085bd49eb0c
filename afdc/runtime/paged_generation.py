"""``dm.generate`` over a paged KV cache, its decode steps at static shapes (attention graphs).

``dm.generate`` keeps a contiguous cache that grows every step, which no CUDA graph can replay.
After ``dm.use_attention_graphs(N)`` it decodes as afdc's vLLM worker steps instead: each
attention rank's program prepared for flat batches (:mod:`afdc.runtime.flat_batches`, a copy
sharing the weights), a paged KV store per call, one prefill step of each row's own tokens (its
left padding dropped: the same logits), then decode steps of one token per row, each micro-batch
padded to its bucket (:mod:`afdc.runtime.decode_graphs`), in CUDA graphs on a GPU.
"""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass

import torch

from afdc.errors import AfdcError
from afdc.runtime.attention_rank import MicroBatch, run_concurrently
from afdc.runtime.decode_graphs import DecodeGraphs
from afdc.runtime.flat_batches import prepare_for_flat_batches
from afdc.runtime.paged import PagedBatch, PagedKVStore
from afdc.runtime.programs import AttentionProgram, device_of


@dataclass
class PagedGeneration:
    """Per attention rank: its program prepared for flat batches, its cache slots and their
    dtype, and its decode steps at static shapes (set on the rank: ``rank.decode``)."""

    programs: list[AttentionProgram]
    slots: list[list]
    dtypes: list[torch.dtype]
    rows_only: list[bool]
    block_size: int
    width: int  # blocks a row may hold: ``max_length`` tokens

    @classmethod
    def of(cls, dm, largest: int, block_size: int, max_length: int) -> PagedGeneration:
        if not dm.incremental:
            raise AfdcError("attention graphs need a KV cache: this model's decode recomputes the prefix")
        programs, slots, dtypes, rows_only = [], [], [], []
        width = -(-max_length // block_size)
        for rank in dm.ranks:
            if not isinstance(rank.program, AttentionProgram) or rank.program.mixers:
                raise AfdcError("attention graphs: not under attention TP nor for stateful mixers yet")
            program = _sharing_weights(rank.program)
            device = device_of(program)
            prepared = prepare_for_flat_batches(program, program.backend, device, mixers=[])
            if prepared.rows:
                raise AfdcError("attention graphs: not for sparse-attention indexers (their steps run as rows)")
            rank.decode = DecodeGraphs(program, rank.dispatch, largest, width, graphs=device.type == "cuda")
            programs.append(program)
            slots.append(prepared.slots)
            dtypes.append(prepared.dtype)
            rows_only.append(prepared.rows_only)
        return cls(programs, slots, dtypes, rows_only, block_size, width)

    def generate(self, dm, rules, input_ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """``dm.generate``'s loop (see :meth:`DisaggregatedModel.generate`) over paged steps."""
        total = int(rules.config.max_length)
        if total > self.width * self.block_size:
            raise AfdcError(f"{total} tokens exceed the {self.width * self.block_size} that use_attention_graphs "
                            "was given (max_length)")
        tasks = dm._tasks(input_ids.shape[0])
        stores = {rank: self._store(rank, sum(rows.stop - rows.start for _, rows in parts))
                  for rank, parts in tasks.items()}  # fmt: skip
        step = [row[m.bool()].tolist() for row, m in zip(input_ids, mask)]  # each row's own tokens
        computed = [0] * len(step)
        tokens, unfinished = input_ids, torch.ones(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        while True:
            logits = self._step(dm, tasks, stores, step, computed)
            scores = rules.scores(tokens, logits)
            nxt = rules.choose(scores, unfinished)
            tokens = torch.cat([tokens, nxt[:, None]], dim=1)
            computed = [c + len(s) for c, s in zip(computed, step)]
            step = [[t] for t in nxt.tolist()]
            unfinished = rules.unfinished(tokens, scores, unfinished)
            if not bool(unfinished.any()):
                return tokens

    def _store(self, rank: int, rows: int) -> PagedKVStore:
        program = self.programs[rank]
        return PagedKVStore(
            self.slots[rank], 1 + rows * self.width, self.block_size, self.dtypes[rank], device_of(program)
        )

    def _step(self, dm, tasks, stores, step: list[list[int]], computed: list[int]) -> torch.Tensor:
        """One step of every row (its ``step`` tokens after its ``computed`` ones): each row's last logits."""
        def run_rank(rank: int, parts) -> list[torch.Tensor]:
            first = parts[0][1].start
            batches = []
            for _, rows in parts:
                local = range(rows.start - first, rows.stop - first)  # the rank's rows: blocks 1 + i * width...
                table = torch.tensor([[1 + i * self.width + b for b in range(self.width)] for i in local])
                mine, context = step[rows], torch.tensor(computed[rows])
                paged = PagedBatch(stores[rank], table, context, torch.tensor([len(s) for s in mine]))
                ids = torch.tensor([t for s in mine for t in s], device=paged.store.device)
                batches.append(MicroBatch(ids[None], torch.ones_like(ids)[None], paged.positions, paged))
            attention = dm.ranks[rank]
            outs, _ = attention.run(attention.begin_step(), batches, self.programs[rank])
            if self.rows_only[rank]:
                return [o.logits[0] for o in outs]
            return [o.logits[0][b.cache.logit_rows] for o, b in zip(outs, batches)]

        results, dm._pool = run_concurrently(
            dm._pool, [functools.partial(run_rank, rank, parts) for rank, parts in tasks.items()]
        )
        return torch.cat([x for logits in results for x in logits])


def _sharing_weights(program: AttentionProgram) -> AttentionProgram:
    """A copy of ``program`` whose graph can be rewritten, holding the same weight tensors."""
    tensors = [*program.module.parameters(), *program.module.buffers()]
    return copy.deepcopy(program, memo={id(t): t for t in tensors})
