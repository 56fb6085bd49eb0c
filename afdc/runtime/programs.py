"""The two runnable programs a partition produces, each owning only its own weights."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx
import torch.utils._pytree as pytree


class AttentionProgram(torch.nn.Module):
    """Embeddings, attention and other mixers, the residual stream, norms and the LM head.

    Its graph sends each FFN layer's inputs and receives its outputs through the active
    connector; attention ops read and extend the active KV cache.
    """

    def __init__(self, graph: fx.Graph, attrs: dict[str, torch.Tensor], out_spec: pytree.TreeSpec):
        super().__init__()
        used = {n.target for n in graph.nodes if n.op == "get_attr"}
        self.module = fx.GraphModule({name: attrs[name] for name in used}, graph)
        self.out_spec = out_spec

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor):
        flat = self.module(input_ids, attention_mask, position_ids)
        return pytree.tree_unflatten(list(flat), self.out_spec)

    def parameter_names(self) -> list[str]:
        return [name for name, _ in self.module.named_parameters()]


@dataclass
class FFNLayer:
    segment: int
    weights: list[str]


class FFNProgram(torch.nn.Module):
    """The FFN segment of every layer: shared segment graphs, per-layer weights."""

    def __init__(self, segments: list[fx.Graph], layers: list[FFNLayer], weights: dict[str, torch.Tensor]):
        super().__init__()
        self.segments = torch.nn.ModuleList(fx.GraphModule(torch.nn.Module(), g) for g in segments)
        self.layers = layers
        self._weights = weights
        self._parameters_owned = {n for n, w in weights.items() if isinstance(w, torch.nn.Parameter)}

    def run(self, layer: int, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        binding = self.layers[layer]
        outputs = self.segments[binding.segment](*(self._weights[w] for w in binding.weights), *inputs)
        return list(outputs)

    def parameter_names(self) -> list[str]:
        return sorted(self._parameters_owned)

    def parameters_of(self, names: list[str]) -> list[torch.Tensor]:
        return [self._weights[n] for n in names]
