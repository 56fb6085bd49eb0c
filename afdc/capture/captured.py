"""What a capture produces: :class:`CapturedGraph`, the inputs its graph takes, and why decode may
have to recompute the prefix."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from afdc.mixer_site import MixerSite
from afdc.segment import RowView

INPUT_NAMES = ("input_ids", "attention_mask", "position_ids")

# CapturedGraph.recompute: why decode must recompute the whole prefix
ONE_LENGTH = "the graph holds for one sequence length only"
NO_POSITIONS = "the forward takes no position_ids, so new tokens find their positions only from the whole prefix"
TIED = "the graph ties the key length to the token count"


@dataclass(kw_only=True)
class CapturedGraph:
    """A model's forward as one FX graph whose parameters are ``get_attr`` nodes named by FQN."""

    graph: fx.Graph
    attrs: dict[str, torch.Tensor]  # FQN -> tensor, parameters and buffers and constants
    parameter_names: list[str]  # the FQNs in ``attrs`` that are model parameters
    out_spec: pytree.TreeSpec  # rebuilds the model's output object from the graph's outputs
    # why decode must recompute the whole prefix ("": new tokens decode against the KV cache)
    recompute: str
    max_positions: int | None = None  # the longest key length the graph is valid for (None: any)
    # why the graph holds for the example's lengths only ("": it holds for any). Every capture
    # that is not shape-polymorphic says why: a static export records the dynamic ones' errors.
    specialized: str = ""
    # of a specialized capture: per-sequence state the forward keeps outside transformers' cache
    # layers, where afdc finds no mixer to keep it per sequence ("": none found)
    state_outside_cache: str = ""
    mixers: list[MixerSite] = field(default_factory=list)  # the graph's afdc::mixer call sites, by slot
    # parameters the graph reads as views of what the checkpoint stores (a loop-experts module's stacks)
    views: dict[str, RowView] = field(default_factory=dict)


def key_length_tied(graph: fx.Graph) -> bool:
    """Whether a captured graph needs the key length to equal the token count (captured
    non-incrementally: decode recomputes the prefix)."""
    inputs = {n.target: n.meta["val"] for n in graph.find_nodes(op="placeholder")}
    tokens, keys = (inputs[name].shape[1] for name in ("input_ids", "attention_mask"))
    return _expr(tokens) == _expr(keys)  # compared as expressions: == on SymInts would add a guard


def _expr(dim):
    return dim.node.expr if isinstance(dim, torch.SymInt) else dim
