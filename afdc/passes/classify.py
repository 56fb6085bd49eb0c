"""Classification: find each layer's FFN region in a captured graph, by structure alone.

A residual add is an ``add`` whose one operand (the stream) is an ancestor of the other (the
branch). A branch's region is everything between the stream value and the branch value. The
region is an FFN region when it holds weight matrices worth a round trip (at least as many
elements as one square matrix of the stream's width) and mixes nothing across tokens: no
attention op, no convolution, and nothing computed from the attention mask or the positions
other than through a token mixer.
A branch that is a sum of terms (parallel attention + MLP) is split into its terms first.
Module and parameter names are used for nothing here but the ``label`` shown in reports.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from afdc.errors import UnsupportedModelError
from afdc.ops import AttentionCall, MixerCall
from afdc.passes import graph_facts as gf

aten = torch.ops.aten

_MIXER_OPS = (AttentionCall.OP, MixerCall.OP)  # one node per call site
_CONVOLUTIONS = (aten.convolution, aten.conv1d, aten.conv2d, aten._convolution)
_PRODUCTS = (
    aten.mm, aten.bmm, aten.matmul, aten.baddbmm, aten.addmm, aten.einsum,
    aten.scaled_dot_product_attention, aten._scaled_dot_product_flash_attention_for_cpu,
)


@dataclass
class FFNRegion:
    """One layer's FFN: the nodes between the stream value it reads and the branch it adds back."""

    index: int  # position along the residual stream, counted over FFN regions only
    nodes: list[fx.Node]  # in graph order, including the get_attr nodes of its own parameters
    stream: fx.Node  # the residual-stream value the region reads
    label: str  # the module path it came from, for reports only


@dataclass
class Classification:
    regions: list[FFNRegion]
    mixers: list[fx.Node]  # attention and stateful-mixer ops (one per call site)
    # token-mixing nodes outside attention and mixer ops (recurrent, hard-coded attention), except
    # those over keys the cache keeps (a sparse-attention indexer's scores): decode cannot cache them
    inline_mixers: list[fx.Node]


def _is_mixer(node: fx.Node, free: set[fx.Node]) -> bool:
    """Mixes values across tokens: attention, convolution, or a product of two activations
    (``q @ k^T`` of attention written inline); an FFN multiplies activations by weights only."""
    if node.target in _MIXER_OPS or gf.is_op(node, *_CONVOLUTIONS):
        return True
    if gf.is_op(node, *_PRODUCTS):
        activations = [a for a in node.all_input_nodes if gf.is_tensor(a) and a not in free]
        return len(activations) >= 2 and not _per_position(node)
    return False


def _per_position(node: fx.Node) -> bool:
    """A batched matmul of small matrices, one pair per position: its operands' leading dims are the
    same (batch, tokens, ...), symbolic, and their matrix dims all static, so no token count is
    contracted or spanned (a hyper-connection's ``comb^T @ streams``, [b, s, n, n] @ [b, s, n, d]). A product
    that mixes tokens has a token count (symbolic) among its matrix dims."""
    if not gf.is_op(node, aten.matmul, aten.bmm):
        return False
    shapes = [a.meta["val"].shape for a in node.all_input_nodes if gf.is_tensor(a)]
    return (
        len(shapes) == 2
        and len(shapes[0]) == len(shapes[1]) >= 3
        and gf.same_shape(shapes[0][:-2], shapes[1][:-2])
        and any(not isinstance(d, int) for d in shapes[0][:-2])  # (a graph of one length says nothing)
        and all(isinstance(d, int) for shape in shapes for d in shape[-2:])
    )


def _downstream(nodes: list[fx.Node]) -> set[fx.Node]:
    """``nodes`` and everything computed from them."""
    seen, todo = set(), list(nodes)
    while todo:
        n = todo.pop()
        if n not in seen:
            seen.add(n)
            todo.extend(n.users)
    return seen


def _is_weight_derived(node: fx.Node) -> bool:
    """A get_attr, or a tensor computed from get_attrs alone (not from sizes)."""
    if node.op == "get_attr":
        return True
    return gf.is_tensor(node) and all(_is_weight_derived(i) for i in node.all_input_nodes)


def _low_rank(stream: fx.Node, matrices: list[fx.Node]) -> bool:
    """Whether the branch's weights hold fewer elements than one square matrix of the stream's
    width: a low-rank adapter beside attention (Gemma 3n's LAuReL, rank 64 of 2048), too little
    work to pay for a round trip to the FFN side, so it stays with attention. Every MLP and MoE
    holds several width x intermediate matrices."""
    width = stream.meta["val"].shape[-1]
    return isinstance(width, int) and sum(m.meta["val"].numel() for m in matrices) < width * width


def _label(nodes: list[fx.Node]) -> str:
    """The innermost module path shared by the region's op nodes (a report label)."""
    paths = []
    for n in nodes:
        stack = n.meta.get("nn_module_stack")
        if n.op == "call_function" and stack:
            paths.append([p for p, _ in stack.values()])
    if not paths:
        return "?"
    common = paths[0]
    for p in paths[1:]:
        common = [a for a, b in zip(common, p) if a == b]
    return common[-1] if common else "?"


class _Finder:
    def __init__(self, graph: fx.Graph, parameter_names: set[str]):
        self.order = list(graph.nodes)
        self.index = {n: i for i, n in enumerate(self.order)}
        self.anc = gf.ancestors(graph)
        self.params = parameter_names
        self.free = gf.data_free(graph)
        self.mixers = [n for n in self.order if n.target in _MIXER_OPS]
        # a per-token value a layer hands the next one past the stream (Zaya's router state) is
        # computed from the mask only through the mixers, as the stream itself is
        self.positional = gf.positional(graph, self.free, self.mixers)

    def region(self, stream: fx.Node, branch: fx.Node) -> list[fx.Node]:
        """Nodes strictly after ``stream`` up to ``branch``, plus the weights only they read.

        "Weights" includes values derived from parameters alone (a transposed expert tensor).
        """
        s = 1 << self.index[stream]
        members = {n for n in gf.nodes_of(self.anc[branch], self.order) if self.anc[n] & s} | {branch}
        frontier = list(members)
        while frontier:
            for p in frontier.pop().all_input_nodes:
                if p in members or p not in self.free or p.op == "placeholder":
                    continue
                if _is_weight_derived(p) and all(u in members for u in p.users):
                    members.add(p)
                    frontier.append(p)
        return sorted(members, key=self.index.__getitem__)

    def is_ffn(self, stream: fx.Node, region: list[fx.Node]) -> bool:
        members = set(region)
        matrices = [p for p in region if gf.is_parameter(p, self.params) and p.meta["val"].ndim >= 2]
        side_inputs = [
            p
            for n in region
            for p in n.all_input_nodes
            if p not in members and p is not stream and p not in self.free and gf.is_tensor(p)
        ]
        reads_positions = any(p in self.positional for p in side_inputs)
        return (
            bool(matrices)
            and not _low_rank(stream, matrices)
            and not reads_positions
            and not any(_is_mixer(n, self.free) for n in region)
        )

    def residual_operands(self, node: fx.Node) -> tuple[fx.Node, fx.Node] | None:
        """``(stream, branch)`` when ``node`` adds a branch computed from the stream."""
        if not gf.is_op(node, aten.add) or len(node.args) != 2:
            return None
        x, y = node.args
        if not (isinstance(x, fx.Node) and isinstance(y, fx.Node) and gf.is_tensor(x) and gf.is_tensor(y)):
            return None
        if not gf.same_shape(x.meta["val"].shape, y.meta["val"].shape):
            return None
        if self.anc[y] >> self.index[x] & 1:
            return x, y
        if self.anc[x] >> self.index[y] & 1:
            return y, x
        for combined, branch in ((x, y), (y, x)):
            stream = self._stream_within(combined, branch)
            if stream is not None:
                return stream, branch
        for combined, branch in ((x, y), (y, x)):
            stream = self._shortcut_stream(combined, branch)
            if stream is not None:
                return stream, branch
        return None

    def _shortcut_stream(self, combined: fx.Node, branch: fx.Node) -> fx.Node | None:
        """The stream value of a shortcut-connected branch: one computed from an earlier value of
        the stream and added to a later one (``combined``, itself a residual add), past the
        sub-layers between (LongCat-Flash's MoE, added after the next attention and MLP). It is
        the latest value of the branch's shape that both descend from, when its region to the
        branch is an FFN."""
        if not gf.is_op(combined, aten.add) or self.residual_operands(combined) is None:
            return None
        shape = branch.meta["val"].shape
        common = self.anc[branch] & self.anc[combined]
        while common:  # the latest first: the highest bit
            latest = common.bit_length() - 1
            common ^= 1 << latest
            a = self.order[latest]
            if a not in self.free and gf.is_tensor(a) and gf.same_shape(a.meta["val"].shape, shape):
                return a if self.is_ffn(a, self.region(a, branch)) else None
        return None

    def _stream_within(self, combined: fx.Node, branch: fx.Node, depth: int = 2) -> fx.Node | None:
        """The stream value that ``combined`` scales, casts, shifts, mixes or adds another branch
        to, when ``branch`` is computed from it: ``residual * alpha + branch``, ``(residual + attn) +
        mlp``, ``residual.float() + branch``, ``comb @ streams + branch`` (hyper-connections), or
        ``(residual + bias) * scale + branch`` (Zaya's, two ops deep)."""
        if not gf.is_op(combined, aten.add, aten.mul, aten.sub, aten.div, aten.matmul, aten.to, aten._to_copy):
            return None
        shape = combined.meta["val"].shape
        for a in combined.all_input_nodes:
            if a in self.free or not gf.is_tensor(a) or not gf.same_shape(a.meta["val"].shape, shape):
                continue
            if self.anc[branch] >> self.index[a] & 1:
                return a
            stream = self._stream_within(a, branch, depth - 1) if depth > 1 and self._shifted_by_weights(a) else None
            if stream is not None:
                return stream
        return None

    def _shifted_by_weights(self, node: fx.Node) -> bool:
        """``node`` shifts or scales one value by weights or constants alone (``x + c``); a value
        scaled by an activation (a routing weight) is a branch's work, not the stream's."""
        if not gf.is_op(node, aten.add, aten.mul, aten.sub, aten.div):
            return False
        return sum(a not in self.free for a in node.all_input_nodes) == 1

    def ffn_terms(self, stream: fx.Node, branch: fx.Node) -> list[list[fx.Node]]:
        if not self.anc[branch] >> self.index[stream] & 1:
            return []  # a term that is the stream itself, or not computed from it (an embedding's lookup)
        region = self.region(stream, branch)
        if self.is_ffn(stream, region):
            return [region]
        # value-preserving wrappers: eval-mode dropout, which the functional IR turns into a clone
        eval_dropout = gf.is_op(branch, aten.dropout) and branch.args[2:3] == (False,)
        if eval_dropout or gf.is_op(branch, aten.clone, aten.alias):
            return self.ffn_terms(stream, branch.args[0])
        if gf.is_op(branch, aten.add, aten.add_) and len(branch.args) == 2 and all(
            isinstance(a, fx.Node) for a in branch.args
        ):
            return [r for term in branch.args if gf.is_tensor(term) for r in self.ffn_terms(stream, term)]
        return []


def classify(graph: fx.Graph, parameter_names: set[str]) -> Classification:
    """Find the FFN regions; raises :class:`UnsupportedModelError` when there are none."""
    finder = _Finder(graph, parameter_names)
    regions: list[tuple[fx.Node, list[fx.Node]]] = []
    claimed: dict[fx.Node, int] = {}
    for node in graph.nodes:
        operands = finder.residual_operands(node)
        if operands is None:
            continue
        stream, branch = operands
        for region in finder.ffn_terms(stream, branch):
            overlap = {claimed[n] for n in region if n in claimed and n.op != "get_attr"}
            if overlap:
                raise UnsupportedModelError(
                    "two FFN regions share computation; the cut cannot be expressed", _label(region)
                )
            claimed.update((n, len(regions)) for n in region)
            regions.append((stream, region))
    mixers = finder.mixers
    over_cached = _downstream(graph.find_nodes(op="call_function", target=torch.ops.afdc.cached_keys.default))
    inline = [
        n for n in graph.nodes
        if n.op == "call_function" and n not in mixers and n not in over_cached and _is_mixer(n, finder.free)
    ]
    if not regions:
        serial = _weights_after_mixing(graph, finder)
        if serial is not None:
            raise UnsupportedModelError(
                f"no FFN region found: in {serial} weight work (an MLP) runs after attention or a mixer in one branch "
                "of the residual stream, with no residual add between them, so it is no branch of its own: afdc "
                "cuts only position-wise branches that read the stream and are added back to it"
            )
        into = _weights_into_mixing(graph, finder)
        if into is not None:
            raise UnsupportedModelError(
                f"no FFN region found: in {into} weight work (an MLP) runs into a token mixer (a short convolution, "
                "attention) before the branch is added to the residual stream, so its output mixes tokens: afdc "
                "cuts only position-wise branches that read the stream and are added back to it"
            )
        attention = any(n.target is torch.ops.afdc.attention.default for n in mixers)
        kind = "a model" if attention else "a pure sequence-mixer (state-space) model"
        raise UnsupportedModelError(
            f"no FFN region found: this is {kind} with no position-wise weight branch added to the residual stream"
        )
    return Classification(
        [FFNRegion(i, nodes, stream, _label(nodes)) for i, (stream, nodes) in enumerate(regions)], mixers, inline
    )


def _weights_into_mixing(graph: fx.Graph, finder: _Finder) -> str | None:
    """The label of a residual branch whose mixer takes two or more weight products in series,
    an MLP (Inkling's short convolution of its MLP's output), or None. Attention's own inputs
    are one product deep (q, k, v projections), and a mixer starts the count again."""
    for node in graph.nodes:
        operands = finder.residual_operands(node)
        if operands is None:
            continue
        region = sorted(finder.region(*operands), key=finder.index.__getitem__)
        inside, depth = set(region), {}
        for n in region:
            deepest = max((depth.get(a, 0) for a in n.all_input_nodes if a in inside), default=0)
            depth[n] = 0 if n.target in _MIXER_OPS else deepest + _reads_weight(n, finder.params)
        if any(m.target in _MIXER_OPS and depth.get(m.args[0], 0) >= 2 for m in region):
            return _label(region)
    return None


def _reads_weight(node: fx.Node, params: set[str]) -> bool:
    """Whether ``node`` takes a matrix (or stacked experts') parameter, directly or through views
    and casts of it alone (a transposed expert weight into a grouped matmul)."""
    for p in node.all_input_nodes:
        while p.op == "call_function" and len(p.all_input_nodes) == 1:
            p = p.all_input_nodes[0]
        if gf.is_parameter(p, params) and p.meta["val"].ndim >= 2:
            return True
    return False


def _weights_after_mixing(graph: fx.Graph, finder: _Finder) -> str | None:
    """The label of a residual branch that applies an MLP's weights after a mixer in it (attention,
    a norm and an MLP in series, as Zamba's shared block), or None."""
    for node in graph.nodes:
        operands = finder.residual_operands(node)
        if operands is None:
            continue
        region = finder.region(*operands)
        mixing = [m for m in region if m.target in _MIXER_OPS]
        after = [
            n for n in region
            if any(finder.anc[n] >> finder.index[m] & 1 for m in mixing)
            and any(gf.is_parameter(p, finder.params) and p.meta["val"].ndim >= 2 for p in n.all_input_nodes)
        ]
        if len(after) >= 3:  # beyond the mixer's own output projection, an MLP's two or more
            return _label(region)
    return None
