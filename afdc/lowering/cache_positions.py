"""Cache positions of a flat batch of requests: each token's own position.

A captured forward computes the position each query token has in the cache as transformers
writes it, ``arange(s) + cache length``, with the cache length ``kv - s`` (see
:mod:`afdc.capture`): right for a batch of rows (left padding counted, as ``generate`` counts
it), wrong for vLLM's flat batch, where the tokens of many requests sit side by side in one row
and each request has its own context. There, a token's cache position is its position (vLLM
pads nothing), which the program already takes as ``position_ids [1, T]``. This pass rewrites
the one for the other, so computations that read the cache position (Llama 4's NoPE
temperature) see each request's own.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

aten = torch.ops.aten


def _length(node, inputs: tuple[str, ...]) -> bool:
    """Whether ``node`` reads dimension 1 (tokens or keys) of one of the graph inputs ``inputs``."""
    return (
        isinstance(node, fx.Node)
        and node.target == aten.sym_size.int
        and node.args[1] == 1
        and getattr(node.args[0], "op", None) == "placeholder"
        and node.args[0].target in inputs
    )


def cache_position_nodes(graph: fx.Graph) -> list[fx.Node]:
    """The nodes computing ``arange(s) + (kv - s)``: the queries' positions in the cache. Matched
    by structure, so that it works on loaded programs, whose graphs carry no shapes."""
    tokens, keys = ("input_ids", "position_ids"), ("attention_mask",)
    found = []
    for add in graph.find_nodes(op="call_function", target=aten.add.Tensor):
        steps, past = add.args[:2]
        if (
            isinstance(steps, fx.Node)
            and steps.target == aten.arange.default
            and _length(steps.args[0], tokens)
            and isinstance(past, fx.Node)
            and past.target is operator.sub
            and _length(past.args[0], keys)
            and _length(past.args[1], tokens)
        ):
            found.append(add)
    return found


def positions_as_cache_positions(graph: fx.Graph) -> fx.Graph:
    """``graph`` with each token's cache position read from ``position_ids`` (a flat batch of
    one row); a graph that computes none is returned unchanged."""
    found = cache_position_nodes(graph)
    if not found:
        return graph
    positions = next(n for n in graph.find_nodes(op="placeholder") if n.target == "position_ids")
    for add in found:
        with graph.inserting_before(add):
            row = graph.call_function(aten.select.int, (positions, 0, 0))
        add.replace_all_uses_with(row)
        graph.erase_node(add)
    graph.eliminate_dead_code()
    graph.lint()
    return graph
