"""The two runnable programs a partition produces, each owning only its own weights."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.fx as fx
import torch.utils._pytree as pytree


class AttentionProgram(torch.nn.Module):
    """Embeddings, attention and other mixers, the residual stream, norms and the LM head.

    Its graph sends each FFN layer's inputs and receives its outputs through the active
    connector; attention ops read and extend the active KV cache.
    """

    def __init__(self, module: fx.GraphModule, out_spec: pytree.TreeSpec):
        super().__init__()
        self.module = module
        self.out_spec = out_spec

    @classmethod
    def from_graph(cls, graph: fx.Graph, attrs: dict[str, torch.Tensor], out_spec: pytree.TreeSpec):
        used = {n.target for n in graph.nodes if n.op == "get_attr"}
        return cls(fx.GraphModule({name: attrs[name] for name in used}, graph), out_spec)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor):
        flat = self.module(input_ids, attention_mask, position_ids)
        return pytree.tree_unflatten(list(flat), self.out_spec)

    def parameter_names(self) -> list[str]:
        return [name for name, _ in self.module.named_parameters()]


@dataclass
class FFNLayer:
    segment: int
    weights: list[str]


# An input's shape at batch 1 and T tokens: an int is a fixed size, -k stands for k * T.
TokenLayout = list[int]


def _at_tokens(layout: TokenLayout, tokens: int) -> list[int]:
    return [d if d >= 0 else -d * tokens for d in layout]


class FFNProgram(torch.nn.Module):
    """One FFN rank: the segment graphs of every FFN layer, bound to this rank's weights.

    Segment graphs take ``(weights..., inputs..., rank)``; ``reduce[segment][i]`` says how the
    attention side combines output ``i`` over the FFN ranks (``sum`` of partial results, or the
    ``first`` rank's copy of a replicated one). ``inputs[segment][i]`` is input ``i``'s token
    layout (None when it is not token-major), which lets one run serve several senders' tokens.
    """

    def __init__(
        self,
        segments: list[fx.Graph],
        layers: list[FFNLayer],
        weights: dict[str, torch.Tensor],
        reduce: list[list[str]],
        rank: int = 0,
        inputs: list[list[TokenLayout | None]] | None = None,
    ):
        super().__init__()
        self.segments = torch.nn.ModuleList(fx.GraphModule(torch.nn.Module(), g) for g in segments)
        self.layers = layers
        self.reduce = reduce
        self.rank = rank
        self.inputs = inputs if inputs is not None else [[None] for _ in segments]
        self._weights = weights
        self._parameters_owned = {n for n, w in weights.items() if isinstance(w, torch.nn.Parameter)}

    def run(self, layer: int, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        binding = self.layers[layer]
        outputs = self.segments[binding.segment](*(self._weights[w] for w in binding.weights), *inputs, self.rank)
        return list(outputs)

    def run_batch(self, layer: int, messages: list[list[torch.Tensor]], tokens: list[int]) -> list[list[torch.Tensor]]:
        """Run FFN layer ``layer`` once over the tokens of several messages, then split the outputs.

        This is what makes AFD pay: one FFN batch from every attention rank and micro-batch.
        Each output comes back per message as ``[tokens, per-token...]``.
        """
        layouts = self.inputs[self.layers[layer].segment]
        if len(messages) == 1 or any(lay is None for lay in layouts):
            return [self.run(layer, m) for m in messages]
        total = sum(tokens)
        batched = [
            torch.cat([m[i].reshape(t, math.prod(abs(d) for d in lay)) for m, t in zip(messages, tokens)]).reshape(
                _at_tokens(lay, total)
            )
            for i, lay in enumerate(layouts)
        ]
        outputs = [o.reshape(total, o.numel() // max(total, 1)) for o in self.run(layer, batched)]
        return [list(parts) for parts in zip(*(o.split(tokens) for o in outputs))]

    def reduction(self, layer: int) -> list[str]:
        return self.reduce[self.layers[layer].segment]

    def parameter_names(self) -> list[str]:
        return sorted(self._parameters_owned)

    def parameters_of(self, names: list[str]) -> list[torch.Tensor]:
        return [self._weights[n] for n in names]


def reduce_outputs(per_rank: list[list[torch.Tensor]], reduce: list[str]) -> list[torch.Tensor]:
    """Combine the FFN ranks' outputs: partial results add up (in rank order), replicated ones
    come from rank 0."""
    return [
        functools.reduce(torch.add, [out[i] for out in per_rank]) if how == "sum" else per_rank[0][i]
        for i, how in enumerate(reduce)
    ]


def combine(programs: list[FFNProgram], layer: int, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Run FFN layer ``layer`` on every FFN rank and combine the ranks' outputs."""
    return reduce_outputs([p.run(layer, inputs) for p in programs], programs[0].reduction(layer))
