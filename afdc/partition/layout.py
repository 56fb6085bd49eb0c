"""How a value of a graph is laid out over the ranks that share its work: the lattice that
sharding propagates (:class:`Layout`), and the two ways an op can refuse the layouts it is given.

A layout is either a fact about a computed value (replicated, split, a partial sum, rows owned
by one rank) or, for a weight, what is known before its split is decided. The op rules
(:mod:`afdc.partition.op_rules`) map their inputs' layouts to their output's, and raise
:class:`Conflict` or :class:`NeedBlocks` when the weights' decisions so far do not fit.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass

import sympy
import torch.fx as fx

from afdc.passes import graph_facts as gf


class Kind(enum.Enum):
    REPLICATED = "R"  # the full value on every rank
    SPLIT = "S"  # rank r holds part r of each of `blocks` equal blocks (or of each section) along `dim`
    PARTIAL = "P"  # the full value is the sum over the ranks
    OWNED = "Z"  # every element is held by one rank and zero on the others (so also partial)
    OWNED_ONLY = "G"  # correct on the elements this rank holds, arbitrary elsewhere
    WEIGHT = "W"  # a weight whose split is not decided yet; `dims` maps value dims to weight dims
    EXPERTS = "E"  # an expert-parallel weight: this rank's experts along `dim`


@dataclass(frozen=True)
class Layout:
    kind: Kind
    dim: int = 0
    blocks: int = 1
    blame: frozenset[int] = frozenset()  # the weights whose split produced this layout
    weight: int = -1  # WEIGHT only
    dims: tuple[int | None, ...] = ()  # WEIGHT only
    sections: tuple[int, ...] = ()  # SPLIT: the dim is these unequal sections (a fused [q; k; v]), not blocks

    @property
    def pieces(self) -> tuple[int, tuple[int, ...]]:
        """What each rank's share is made of: equal blocks, or sections."""
        return self.blocks, self.sections

    @property
    def replicated(self) -> bool:
        return self.kind is Kind.REPLICATED


R = Layout(Kind.REPLICATED)


class Conflict(Exception):
    """An op cannot take the layouts it is given; ``blame`` names the weights whose splits led
    there (none: keeping weights whole cannot avoid it)."""

    def __init__(self, blame: frozenset[int], reason: str):
        super().__init__(reason)
        self.blame, self.reason = blame, reason
        self.node: fx.Node | None = None  # where it arose (set by the propagation's driver)


class NeedBlocks(Exception):
    """An op needs the ``weights``' split to be made of ``blocks`` equal blocks, or of ``sections``
    (a fused projection cut into its parts), so that each part is split over the ranks."""

    def __init__(self, weights: frozenset[int], blocks: int = 1, sections: tuple[int, ...] = ()):
        super().__init__()
        self.weights, self.blocks, self.sections = weights, blocks, sections


def shape(node: fx.Node) -> list[sympy.Expr]:
    return [gf.sym_expr(d) for d in node.meta["val"].shape]


def union(layouts: Iterable[Layout]) -> frozenset[int]:
    """The weights blamed for any of ``layouts``."""
    return frozenset().union(*(lay.blame for lay in layouts))
