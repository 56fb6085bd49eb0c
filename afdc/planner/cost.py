"""Per-token decode cost, counted from the partitioned graphs (:class:`afdc.api.Built`).

Every count is a sympy expression in the graph's own symbols (batch ``b``, tokens ``s``, keys
``kv``) evaluated at one decoded token (``b = s = 1``) and context ``L``: nothing here knows a
model family. FLOPs count a multiply-add as 2.

KV cache: for each attention op, the bytes a serving engine keeps per token are the smallest set
of values, between the layer's first projections and the op's key/value inputs, from which keys
and values are computed (a min-cut over element counts). For grouped-query attention that is K
and V themselves; for multi-head latent attention (MLA) it is the normed latent plus the rotary
key part, and attention is counted in the absorbed form serving engines run (queries and outputs
in latent space). Sliding-window and chunked layers read at most their window.

Sparse attention (DeepSeek Sparse Attention, DSA): where an attention call's mask comes from a
top-k over scores computed against keys the layer caches itself (``afdc::cached_keys``: the
lightning indexer's), a decode step reads every cached indexer key and the attention's KV at the
top-k's count only, while the cache holds both at the whole context. The indexer's scoring FLOPs
(against every cached key) count as attention FLOPs, not as linear ones.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import sympy
import torch
import torch.fx as fx

from afdc.api import Built
from afdc.ops import AttentionCall
from afdc.partition.mincut import INF, FlowGraph
from afdc.passes import aliasing
from afdc.passes import graph_facts as gf
from afdc.planner.layers import LayerPattern

aten = torch.ops.aten

FORMULATION_STANDARD = "standard (K and V cached per KV head)"
FORMULATION_LATENT = "latent (MLA: latent + rotary key cached, up-projections absorbed)"


def _dims(node: fx.Node) -> list[sympy.Expr]:
    return [gf.sym_expr(d) for d in node.meta["val"].shape]


def _numel(node: fx.Node) -> sympy.Expr:
    return sympy.Mul(*_dims(node))


def _is_value(node: fx.Node) -> bool:
    """A tensor, or a tuple of tensors (split, topk) read through getitem."""
    return gf.is_tensor(node) or isinstance(node.meta.get("val"), (tuple, list))


def _weight_read(node: fx.Node, free: set[fx.Node]) -> bool:
    return any(a in free and gf.is_tensor(a) and a.meta["val"].ndim >= 2 for a in node.all_input_nodes)


def op_flops(node: fx.Node) -> sympy.Expr:
    """FLOPs of one matrix-product node (0 for every other op)."""
    if node.op != "call_function":
        return sympy.Integer(0)
    packet = getattr(node.target, "overloadpacket", None)
    args = [a for a in node.args if isinstance(a, fx.Node)]
    if packet in (aten.linear, aten.mm, aten.addmm, aten.bmm, aten.baddbmm, aten.matmul):
        a = args[1] if packet in (aten.addmm, aten.baddbmm) else args[0]
        return 2 * _numel(node) * _dims(a)[-1]
    if packet is aten._grouped_mm or str(node.target).startswith("transformers.grouped_mm"):
        return 2 * _numel(node) * _dims(args[0])[-1]
    if packet is aten.einsum:
        return _einsum_flops(node)
    if packet in (aten.convolution, aten._convolution):
        weight = _dims(args[1])
        return 2 * _numel(node) * sympy.Mul(*weight[1:])
    return sympy.Integer(0)


def _einsum_flops(node: fx.Node) -> sympy.Expr:
    equation, operands = node.args[0], node.args[1]
    inputs = equation.replace(" ", "").split("->")[0].split(",")
    sizes: dict[str, sympy.Expr] = {}
    for letters, operand in zip(inputs, operands):
        for letter, size in zip(letters, _dims(operand)):
            sizes[letter] = size
    return 2 * sympy.Mul(*sizes.values())


@dataclass
class LayerCost:
    """One decoded token's cost in one attention call or one FFN layer."""

    kv_bytes: float = 0.0  # held per sequence (keys and values, a sparse indexer's keys too)
    kv_read_bytes: float | None = None  # read per step; None: all it holds (dense attention)
    attention_flops: float = 0.0
    linear_flops: float = 0.0
    ffn_flops: float = 0.0
    cut_bytes_to_ffn: float = 0.0
    cut_bytes_to_attn: float = 0.0

    def __post_init__(self):
        if self.kv_read_bytes is None:
            self.kv_read_bytes = self.kv_bytes


@dataclass
class DecodeCost:
    """What one decoded token costs at context ``context``, whole model and per side."""

    context: int
    kv_dtype_bytes: int
    formulation: str
    kv_bytes: float
    attention_flops: float
    linear_flops: float
    ffn_flops: float
    cut_bytes_to_ffn: float
    cut_bytes_to_attn: float
    attention_layers: list[LayerCost] = field(default_factory=list)
    ffn_layers: list[LayerCost] = field(default_factory=list)
    kv_read_bytes: float | None = None  # KV read per step (None: all kv_bytes; less under sparse attention)

    def __post_init__(self):
        if self.kv_read_bytes is None:
            self.kv_read_bytes = self.kv_bytes

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class AttentionSite:
    """What the cost walk needs to know of one attention op."""

    call: AttentionCall
    cached_k: float  # elements per token kept for keys (in the latent form, shared by all heads)
    cached_v: float  # elements per token kept for values
    latent: bool  # the cache is smaller than K and V: count the absorbed form
    cached_latent: float = 0.0  # latent form: elements per token cached (keys and values share them)
    sparse: SparseIndexer | None = None  # the indexer choosing this call's keys (DSA), if any


@dataclass(frozen=True)
class SparseIndexer:
    """A sparse-attention indexer (DSA's lightning indexer) as the graph shows it: a top-k over
    scores against keys the layer caches itself, the top-k building the attention's mask.
    Expressions are in the graph's symbols: per decoded token, the keys' count a free symbol."""

    top_k: sympy.Expr  # keys the attention reads (e.g. min(2048, keys))
    cached: float  # indexer key elements cached per token
    flops: sympy.Expr  # scoring FLOPs per decoded token, against every cached key
    nodes: frozenset[fx.Node]  # the scoring nodes (their FLOPs are not linear FLOPs)


def sparse_indexer(call: AttentionCall, free: set[fx.Node]) -> SparseIndexer | None:
    """The indexer behind ``call``'s mask: the ``aten.topk`` above the mask (within this layer:
    the walk stops at other attention calls) whose scores read an ``afdc::cached_keys``."""
    if call.mask is None:
        return None
    above: set[fx.Node] = set()
    stack = [call.mask]
    while stack:
        n = stack.pop()
        if n in above or n in free or AttentionCall.matches(n):
            continue
        above.add(n)
        stack.extend(n.all_input_nodes)
    topks = [n for n in above if gf.is_op(n, aten.topk)]
    caches = [n for n in above if n.op == "call_function" and n.target is torch.ops.afdc.cached_keys.default]
    if len(topks) != 1 or not caches:
        return None
    topk = topks[0]
    # the scoring: what lies between the cached keys and the top-k
    scoring, stack = set(), list(caches)
    while stack:
        n = stack.pop()
        if n in scoring or n not in above:
            continue
        scoring.add(n)
        stack.extend(u for u in n.users if u is not topk)
    k = topk.args[1]
    k_expr = gf.sym_expr(k.meta["val"]) if isinstance(k, fx.Node) else sympy.Integer(k)
    cached = sum(float(sympy.Mul(*_dims(c)[2:])) for c in caches)
    return SparseIndexer(k_expr, cached, sum((op_flops(n) for n in scoring), sympy.Integer(0)), frozenset(scoring))


def _projection_slice(call: AttentionCall, free: set[fx.Node]) -> tuple[set[fx.Node], set[fx.Node]]:
    """Nodes between the first projections and the op's k/v inputs, and those first projections."""
    written = aliasing.writes(call.node.graph)
    inner: set[fx.Node] = set()
    sources: set[fx.Node] = set()
    stack = [call.k, call.v]
    while stack:
        n = stack.pop()
        if n in inner or n in free or not _is_value(n):
            continue
        inner.add(n)
        if _weight_read(n, free) and op_flops(n) != 0:
            # keep walking: a projection whose input is another projection's output is an up-projection
            upstream = [a for a in n.all_input_nodes if a not in free and _is_value(a)]
            if not any(_reaches_projection(a, free) for a in upstream):
                sources.add(n)
                continue
        stack.extend(n.all_input_nodes)
        stack.extend(aliasing.mutation_inputs(n, written))
    return inner, sources


def _adds_activations(node: fx.Node, free: set[fx.Node]) -> bool:
    return gf.is_op(node, aten.add) and sum(a not in free and gf.is_tensor(a) for a in node.all_input_nodes) == 2


def _reaches_projection(node: fx.Node, free: set[fx.Node]) -> bool:
    """Another projection's output lies above ``node`` without crossing a sum of activations
    (a residual add): ``node`` is then the input of an up-projection."""
    seen: set[fx.Node] = set()
    stack = [node]
    while stack:
        n = stack.pop()
        if n in seen or n in free or not _is_value(n) or n.op != "call_function":
            continue
        seen.add(n)
        if _weight_read(n, free) and op_flops(n) != 0:
            return True
        if not _adds_activations(n, free):
            stack.extend(n.all_input_nodes)
    return False


def attention_site(call: AttentionCall, free: set[fx.Node], tokens: tuple[sympy.Symbol, sympy.Symbol]) -> AttentionSite:
    """What a serving engine caches per token for ``call`` (the min-cut the module docstring describes)."""
    attn, k, v = call.node, call.k, call.v
    inner, sources = _projection_slice(call, free)
    subs = {tokens[0]: 1, tokens[1]: 1}

    def per_token(n: fx.Node) -> float:
        return float(_numel(n).subs(subs))

    # an in-place write feeds the storage it writes: treat it as an edge into that storage's root
    feeds: dict[fx.Node, list[fx.Node]] = {}
    for root, writers in aliasing.writes(attn.graph).items():
        for w in writers:
            for a in w.all_input_nodes:
                if aliasing.storage_root(a) is not root:
                    feeds.setdefault(a, []).append(root)
    flow = FlowGraph()
    for n in inner:
        users = [u for u in [*n.users, *feeds.get(n, ())] if u in inner or u is attn]
        ends = [n, *users]
        a, b = ("in", n), ("out", n)
        for e in ends:
            flow.add_edge(e, a, INF)
            flow.add_edge(b, e, INF)
        flow.add_edge(a, b, per_token(n) if not isinstance(n.meta.get("val"), (tuple, list)) else INF)
        if n in sources:
            flow.add_edge("src", n, INF)
    for t, name in ((k, "k"), (v, "v")):
        flow.add_edge(t, name, INF)
        flow.add_edge(name, "sink", INF)
    flow.max_flow("src", "sink")
    sink_side = flow.sink_side("sink")
    # the cut: source-side nodes with a consumer on the sink side (the latest cut of minimum size)
    cut = {n for n in inner if n not in sink_side and any(u in sink_side for u in [*n.users, *feeds.get(n, ())])}
    latent = sum(per_token(n) for n in cut) < per_token(k) + per_token(v)
    sparse = sparse_indexer(call, free)
    if not latent:
        return AttentionSite(call, per_token(k), per_token(v), False, sparse=sparse)
    written = aliasing.writes(attn.graph)
    anc_k, anc_v = _ancestors_within(k, inner, written) | {k}, _ancestors_within(v, inner, written) | {v}
    cached_k = sum(per_token(n) for n in cut if n in anc_k)
    cached_v = sum(per_token(n) for n in cut if n in anc_v)
    return AttentionSite(call, cached_k, cached_v, True, sum(per_token(n) for n in cut), sparse)


def _ancestors_within(node: fx.Node, inner: set[fx.Node], written) -> set[fx.Node]:
    seen: set[fx.Node] = set()
    stack = [node]
    while stack:
        n = stack.pop()
        for a in [*n.all_input_nodes, *aliasing.mutation_inputs(n, written)]:
            if a in inner and a not in seen:
                seen.add(a)
                stack.append(a)
    return seen


def at_context(expr: sympy.Expr, tokens: tuple[sympy.Symbol, sympy.Symbol], context: int) -> float:
    """``expr`` for one decoded token (batch and tokens 1) against ``context`` cached keys (every
    other symbol of an attention-side count is a key count)."""
    subs = {tokens[0]: 1, tokens[1]: 1}
    subs.update({sym: context for sym in expr.free_symbols - set(subs)})
    return float(expr.subs(subs))


def attention_cost(
    site: AttentionSite, context: int, kv_dtype_bytes: int, tokens: tuple[sympy.Symbol, sympy.Symbol]
) -> LayerCost:
    """One decoded token's KV held and read and QK/PV FLOPs in ``site`` at ``context`` keys
    (fewer past its window, or the indexer's top-k of them)."""
    q = site.call.q.meta["val"]
    hq, dk = int(q.shape[1]), int(q.shape[-1])
    dv = int(site.call.node.meta["val"].shape[-1])
    window = site.call.window
    keys = min(context, window) if window else context
    # absorbed MLA: every head scores against the cached key dims and sums the cached value dims
    per_head = site.cached_k + site.cached_v if site.latent else dk + dv
    cached = site.cached_latent if site.latent else site.cached_k + site.cached_v
    held = keys * cached * kv_dtype_bytes
    if site.sparse is None:
        return LayerCost(kv_bytes=held, attention_flops=float(2 * hq * keys * per_head))
    # DSA: the attention reads the top-k's keys; the indexer reads (and holds) its keys at every position
    attended = min(keys, at_context(site.sparse.top_k, tokens, context))
    indexer = context * site.sparse.cached * kv_dtype_bytes
    return LayerCost(
        kv_bytes=held + indexer,
        kv_read_bytes=attended * cached * kv_dtype_bytes + indexer,
        attention_flops=float(2 * hq * attended * per_head) + at_context(site.sparse.flops, tokens, context),
    )


def _per_token(expr: sympy.Expr, tokens) -> float:
    subs = {tokens[0]: 1, tokens[1]: 1}
    return float(expr.subs(subs)) if expr.free_symbols - set(subs) == set() else math.nan


def graph_flops(graph: fx.Graph, tokens: tuple[sympy.Symbol, sympy.Symbol], skip: set[fx.Node] = frozenset()) -> float:
    """One token's matrix-product FLOPs in ``graph`` (NaN if a count keeps a symbol besides the tokens')."""
    total = sympy.Integer(0)
    for n in graph.nodes:
        if n not in skip:
            total += op_flops(n)
    return _per_token(total, tokens)


def decode_cost(
    built: Built, context: int, kv_dtype_bytes: int | None = None, layers: LayerPattern | None = None
) -> DecodeCost:
    """Cost of one decoded token at ``context`` for a partitioned model (:func:`afdc.api.build`).

    With ``layers``, ``built`` holds only the pattern's prefix of the layers, and the cost is the
    whole model's: each layer past the prefix costs what the first layer like it costs.
    """
    graph = built.attention_graph
    tokens = gf.token_symbols(graph)
    free = gf.data_free(graph)
    attn_calls = AttentionCall.all_in(graph)
    if kv_dtype_bytes is None:
        kv_dtype_bytes = attn_calls[0].k.meta["val"].element_size() if attn_calls else 2
    sites = [attention_site(c, free, tokens) for c in attn_calls]
    attn_layers = [attention_cost(s, context, kv_dtype_bytes, tokens) for s in sites]
    scoring = set().union(*(s.sparse.nodes for s in sites if s.sparse))  # attention FLOPs, not linear
    ffn_layers = []
    for layer, binding in zip(built.report.layers, built.layers):
        seg = built.segments[binding.segment].graph
        ffn_layers.append(
            LayerCost(
                ffn_flops=graph_flops(seg, tokens),
                cut_bytes_to_ffn=layer.bytes_to_ffn,
                cut_bytes_to_attn=layer.bytes_to_attn,
            )
        )
    linear_flops = graph_flops(graph, tokens, skip=scoring)
    if layers is not None:
        attn_layers = layers.expand(attn_layers, [layers.layer_of_node(c.node) for c in attn_calls])
        ffn_layers = layers.expand(ffn_layers, [layers.layer_of(r.module) for r in built.report.layers])
        parts = [
            (layers.layer_of_node(n), _per_token(f, tokens))
            for n in graph.nodes
            if n not in scoring and (f := op_flops(n)) != 0
        ]
        linear_flops = layers.total(linear_flops, parts)
    return DecodeCost(
        context=context,
        kv_dtype_bytes=kv_dtype_bytes,
        formulation=FORMULATION_LATENT if any(s.latent for s in sites) else FORMULATION_STANDARD,
        kv_bytes=sum(c.kv_bytes for c in attn_layers),
        kv_read_bytes=sum(c.kv_read_bytes for c in attn_layers),
        attention_flops=sum(c.attention_flops for c in attn_layers),
        linear_flops=linear_flops,
        ffn_flops=sum(c.ffn_flops for c in ffn_layers),
        cut_bytes_to_ffn=sum(c.cut_bytes_to_ffn for c in ffn_layers),
        cut_bytes_to_attn=sum(c.cut_bytes_to_attn for c in ffn_layers),
        attention_layers=attn_layers,
        ffn_layers=ffn_layers,
    )
