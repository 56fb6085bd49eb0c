"""The disaggregated model: an attention program and an FFN program joined by a connector.

``dm(...)`` is a drop-in for the model's own call (prefill); ``dm.generate`` is greedy decoding
with the KV cache on the attention side. Both run only the two programs and the connector.
"""

from __future__ import annotations

import functools

import torch
import torch.utils._pytree as pytree

from afdc.runtime import connector as connectors
from afdc.runtime import kv_cache
from afdc.runtime.programs import AttentionProgram, FFNProgram, combine


def default_position_ids(input_ids: torch.Tensor, past: int = 0) -> torch.Tensor:
    """What transformers uses when no position ids are given: positions count padding too."""
    b, s = input_ids.shape
    return torch.arange(past, past + s, device=input_ids.device).expand(b, s)


def positions_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that skip left padding, as transformers' ``generate`` computes them."""
    pos = attention_mask.long().cumsum(-1) - 1
    return pos.masked_fill(attention_mask == 0, 1)


# Arguments of a transformers forward that do not change the logits.
_IGNORED_KWARGS = {"use_cache", "return_dict", "past_key_values"}


def _concat(outputs: list):
    """Outputs of the attention ranks, each for its rows of the batch, as one output."""
    flat = [pytree.tree_flatten(o) for o in outputs]
    by_leaf = zip(*(leaves for leaves, _ in flat))
    leaves = [torch.cat(parts) if isinstance(parts[0], torch.Tensor) else parts[0] for parts in by_leaf]
    return pytree.tree_unflatten(leaves, flat[0][1])


class DisaggregatedModel:
    """``attention[i]`` is attention rank i (it runs its share of the batch's rows); ``ffn[j]``
    is FFN rank j (every FFN layer runs on all of them and their outputs are combined)."""

    def __init__(
        self,
        attention: list[AttentionProgram],
        ffn: list[FFNProgram],
        incremental: bool,
        report,
        generation_config=None,
    ):
        self.attention_ranks = attention
        self.ffn_ranks = ffn
        self.attention = attention[0]
        self.ffn = ffn[0]
        self.incremental = incremental  # False: decode recomputes the prefix (inline recurrent mixers)
        self._report = report
        self.generation_config = generation_config
        self.last_traffic = connectors.Traffic()

    def report(self):
        """What was split, what crosses the cut, and how many bytes per token."""
        return self._report

    def _rows(self, batch: int) -> list[slice]:
        n = len(self.attention_ranks)
        bounds = [batch * i // n for i in range(n + 1)]
        return [slice(bounds[i], bounds[i + 1]) for i in range(n)]

    def _run(self, input_ids, attention_mask, position_ids, caches: list[kv_cache.KVCache | None]):
        link = connectors.LoopbackConnector(functools.partial(combine, self.ffn_ranks))
        outputs = []
        with torch.no_grad(), connectors.active(link):
            for program, rows, cache in zip(self.attention_ranks, self._rows(input_ids.shape[0]), caches):
                if rows.stop > rows.start:
                    with kv_cache.active(cache):
                        outputs.append(program(input_ids[rows], attention_mask[rows], position_ids[rows]))
        self.last_traffic = link.traffic
        return _concat(outputs)

    def __call__(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, position_ids=None, **kwargs
    ):
        if kwargs.get("past_key_values") is not None:
            raise ValueError("afdc keeps its KV cache on the attention side; use dm.generate for decoding")
        unsupported = sorted(k for k, v in kwargs.items() if k not in _IGNORED_KWARGS and v is not None)
        if unsupported:
            raise TypeError(
                f"the disaggregated model takes input_ids, attention_mask and position_ids; got {unsupported}"
            )
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        if position_ids is None:
            position_ids = default_position_ids(input_ids)
        return self._run(input_ids, attention_mask, position_ids, [None] * len(self.attention_ranks))

    def forward(self, *args, **kwargs):
        return self(*args, **kwargs)

    @torch.no_grad()
    def generate(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        max_new_tokens: int = 20,
        eos_token_id: int | list[int] | None = None,
        pad_token_id: int | None = None,
    ) -> torch.Tensor:
        """Greedy decoding; returns prompt and new tokens like ``model.generate(do_sample=False)``."""
        cfg = self.generation_config
        if eos_token_id is None and cfg is not None:
            eos_token_id = cfg.eos_token_id
        if pad_token_id is None and cfg is not None:
            pad_token_id = cfg.pad_token_id
        eos = torch.tensor([] if eos_token_id is None else eos_token_id, device=input_ids.device).flatten()
        if pad_token_id is None and eos.numel():
            pad_token_id = int(eos[0])
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)

        ranks = len(self.attention_ranks)
        caches = [kv_cache.KVCache() for _ in range(ranks)] if self.incremental else [None] * ranks
        tokens, mask = input_ids, attention_mask
        step_ids, step_pos = input_ids, positions_from_mask(mask)
        finished = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        for _ in range(max_new_tokens):
            if not self.incremental:
                step_ids, step_pos = tokens, positions_from_mask(mask)
            logits = self._run(step_ids, mask, step_pos, caches).logits[:, -1, :]
            nxt = logits.argmax(-1)
            if eos.numel():
                nxt = torch.where(finished, torch.full_like(nxt, pad_token_id), nxt)
                finished |= torch.isin(nxt, eos)
            tokens = torch.cat([tokens, nxt[:, None]], dim=1)
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            step_ids, step_pos = nxt[:, None], step_pos[:, -1:] + 1
            if eos.numel() and bool(finished.all()):
                break
        return tokens
