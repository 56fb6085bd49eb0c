"""Small pure queries over a captured FX graph, shared by the passes."""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from pathlib import Path

import sympy
import torch
import torch.fx as fx

# A large token count at which to measure "bytes per token": exact for values that scale with
# the tokens, close to zero for values that do not, and huge for values that grow faster.
_TOKENS_HINT = 4096


def is_tensor(node: fx.Node) -> bool:
    return isinstance(node.meta.get("val"), torch.Tensor)


def holds_tensors(node: fx.Node) -> bool:
    """A tensor, or a tuple of them (``broadcast_tensors``, ``split``), which ``getitem`` reads."""
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) or (
        isinstance(val, (tuple, list)) and bool(val) and all(isinstance(v, torch.Tensor) for v in val)
    )


def is_parameter(node: fx.Node, parameter_names: set[str]) -> bool:
    return node.op == "get_attr" and node.target in parameter_names


def is_op(node: fx.Node, *packets) -> bool:
    return node.op == "call_function" and getattr(node.target, "overloadpacket", None) in packets


# Ops that pass their input through unchanged in eval mode (dropout included): shape and values kept.
IDENTITY_OPS = {"to", "_to_copy", "type_as", "clone", "contiguous", "alias", "detach", "lift_fresh_copy", "dropout"}


def op_name(node: fx.Node) -> str:
    """The aten op a node calls, without namespace or overload (``linear``); "" for anything else."""
    target = node.target
    return target.__name__.split(".")[0] if isinstance(target, torch._ops.OpOverload) else ""


def over_last_dim(node: fx.Node) -> bool:
    """Whether an op that works along one dim (top-k, softmax, chunk, sum, amax, unsqueeze) works
    along the last; True for any other op."""
    name = op_name(node)
    source = node.args[0].meta.get("val") if node.args and isinstance(node.args[0], fx.Node) else None
    last = source.dim() - 1 if isinstance(source, torch.Tensor) else -1
    if name == "topk":
        return (node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", -1)) in (-1, last)
    if name == "softmax":
        return node.args[1] in (-1, last)
    if name == "chunk":
        return (node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)) in (-1, last)
    if name in ("sum", "amax"):
        dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
        return isinstance(dims, (list, tuple)) and list(dims) in ([-1], [last])
    if name == "unsqueeze":
        return node.args[1] in (-1, last + 1)
    return True


def where(node: fx.Node) -> str:
    """``node`` for a person: its op and the line of model source it was traced from."""
    what = op_name(node) or node.name
    frames = re.findall(r'File "([^"]+)", line (\d+), in \w+\n\s*(.*)', node.meta.get("stack_trace") or "")
    if not frames:
        return f"{what} ({node.name})"
    path, line, code = frames[-1]
    return f"{what} at {Path(path).name}:{line} ({code.strip()})"


def ancestors(graph: fx.Graph) -> dict[fx.Node, int]:
    """Each node's strict ancestors as a bitset over the graph's node order."""
    index = {n: i for i, n in enumerate(graph.nodes)}
    anc: dict[fx.Node, int] = {}
    for node in graph.nodes:
        bits = 0
        for inp in node.all_input_nodes:
            bits |= anc[inp] | (1 << index[inp])
        anc[node] = bits
    return anc


def nodes_of(bits: int, order: list[fx.Node]) -> list[fx.Node]:
    out, i = [], 0
    while bits:
        if bits & 1:
            out.append(order[i])
        bits >>= 1
        i += 1
    return out


def bitset(nodes: Iterable[fx.Node], index: dict[fx.Node, int]) -> int:
    bits = 0
    for n in nodes:
        bits |= 1 << index[n]
    return bits


def token_symbols(graph: fx.Graph) -> tuple[sympy.Symbol, sympy.Symbol]:
    """The batch and token-count symbols: the two dims of the ``input_ids`` placeholder."""
    ids = next(n for n in graph.nodes if n.op == "placeholder" and n.name == "input_ids")
    b, s = ids.meta["val"].shape
    return sym_expr(b), sym_expr(s)


def sym_expr(dim) -> sympy.Expr:
    return dim.node.expr if isinstance(dim, torch.SymInt) else sympy.Integer(dim)


def same_shape(a: Sequence, b: Sequence) -> bool:
    """Whether two shapes are the same expressions. Comparing symbolic sizes with ``==`` would
    guard on them, which pins a size to its example value (a batch of 2) for the rest of the
    capture: passes must never do that."""
    return len(a) == len(b) and all(sym_expr(x) == sym_expr(y) for x, y in zip(a, b))


def shapes_match(a: Sequence, b: Sequence) -> bool:
    """Whether two shapes can be the same at run time, decided without guarding: static sizes
    equal, a symbolic size against a symbolic one. For the programs' kernel patterns, whose
    inputs arrive with a fresh symbol each (two token counts of one step); the kernels check
    the sizes they are given."""
    return len(a) == len(b) and all(
        isinstance(x, torch.SymInt) == isinstance(y, torch.SymInt) and (isinstance(x, torch.SymInt) or x == y)
        for x, y in zip(a, b)
    )


def bytes_per_token(node: fx.Node, tokens: tuple[sympy.Symbol, sympy.Symbol]) -> float:
    """Bytes of ``node``'s tensor per token, measured at one sequence of ``_TOKENS_HINT`` tokens."""
    val = node.meta["val"]
    numel = sympy.Integer(1)
    for d in val.shape:
        numel *= sym_expr(d)
    batch = tokens[0]
    subs = {sym: (1 if sym == batch else _TOKENS_HINT) for sym in numel.free_symbols}
    return float(numel.subs(subs)) * val.element_size() / _TOKENS_HINT


def per_token_shape(node: fx.Node, tokens: tuple[sympy.Symbol, sympy.Symbol]) -> tuple[int, ...] | None:
    """The shape of one token's slice of ``node`` when its leading dims are ``[b, s]`` or ``[b*s]``."""
    shape = [sym_expr(d) for d in node.meta["val"].shape]
    b, s = tokens
    if len(shape) >= 2 and shape[0] == b and shape[1] == s:
        rest = shape[2:]
    elif shape and (per := sympy.cancel(shape[0] / (b * s))).is_Integer:
        rest = ([per] if per != 1 else []) + shape[1:]
    else:
        return None
    return tuple(int(d) for d in rest) if all(d.is_Integer for d in rest) else None


def token_layout(node: fx.Node, tokens: tuple[sympy.Symbol, sympy.Symbol]) -> list[int] | None:
    """``node``'s shape at batch 1 and T tokens, an int per dim with ``-k`` for ``k * T``; None
    unless its leading dims are the tokens (``[b, s]`` or ``[k*b*s]``) so rows can be concatenated."""
    if per_token_shape(node, tokens) is None:
        return None
    b, s = tokens
    layout = []
    for d in node.meta["val"].shape:
        e = sym_expr(d).subs(b, 1)
        if e.is_Integer:
            layout.append(int(e))
        elif (k := sympy.cancel(e / s)).is_Integer:
            layout.append(-int(k))
        else:
            return None
    return layout


_SHAPE_READS = ("sym_size", "sym_numel", "sym_stride", "sym_storage_offset")


def positional(graph: fx.Graph, free: set[fx.Node], past: Iterable[fx.Node] = ()) -> set[fx.Node]:
    """The values computed from the attention mask or the positions (not merely sized by them),
    other than through the nodes ``past`` (token mixers, whose outputs are per-token values)."""
    found: set[fx.Node] = set()
    stop = set(past)
    for n in graph.nodes:
        is_input = n.op == "placeholder" and n.name in ("attention_mask", "position_ids")
        if is_input or (n not in free and n not in stop and any(i in found for i in n.all_input_nodes)):
            found.add(n)
    return found


def data_free(graph: fx.Graph) -> set[fx.Node]:
    """Nodes whose values depend on no input data: shape arithmetic, buffers, constants, ``arange``.

    Either side can recompute these rather than receive them.
    """
    free: set[fx.Node] = set()
    for node in graph.nodes:
        if node.op == "get_attr":
            free.add(node)
        elif node.op == "call_function":
            reads_shape_only = any(k in str(node.target) for k in _SHAPE_READS)
            if reads_shape_only or all(i in free for i in node.all_input_nodes):
                free.add(node)
    return free
