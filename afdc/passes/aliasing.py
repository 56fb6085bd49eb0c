"""In-place writes in a captured graph, and whether a cut separates one from its readers.

``torch.export``'s default IR keeps a few in-place ops (``copy_`` into a slice, ``index_put_``,
``scatter_``). Their effect is not an edge of the graph: a node reading the written tensor
depends on the write only through the tensor's storage. Functionalizing the whole graph
(``run_decompositions``) retraces it, which costs minutes on a 671B model, so afdc keeps the
default IR and checks instead that every write and every reader of the written storage sit on the
same side of each cut; when they do not, capture is redone in functional form.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable

import torch.fx as fx


def _schema(node: fx.Node):
    return getattr(node.target, "_schema", None) if node.op == "call_function" else None


def is_view(node: fx.Node) -> bool:
    """Returns an alias of its first argument (``view``, ``slice``, ``transpose``, ``split``...)."""
    if node.op == "call_function" and node.target is operator.getitem:
        return is_view(node.args[0])
    schema = _schema(node)
    if schema is None or not schema.returns or schema.is_mutable:
        return False
    alias = schema.returns[0].alias_info
    return alias is not None and not alias.is_write


def written_args(node: fx.Node) -> list[fx.Node]:
    schema = _schema(node)
    if schema is None or not schema.is_mutable:
        return []
    return [
        node.args[i]
        for i, arg in enumerate(schema.arguments)
        if arg.alias_info is not None and arg.alias_info.is_write and i < len(node.args)
        and isinstance(node.args[i], fx.Node)
    ]


def storage_root(node: fx.Node) -> fx.Node:
    while is_view(node) and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    return node


def alias_group(root: fx.Node) -> set[fx.Node]:
    """The root and every view taken of it, transitively; in-place ops return their input too."""
    group, stack = {root}, [root]
    while stack:
        for user in stack.pop().users:
            if user not in group and (is_view(user) or written_args(user)):
                group.add(user)
                stack.append(user)
    return group


def writes(graph: fx.Graph) -> dict[fx.Node, list[fx.Node]]:
    """Storage root -> the in-place nodes writing into it."""
    out: dict[fx.Node, list[fx.Node]] = {}
    for node in graph.nodes:
        for arg in written_args(node):
            out.setdefault(storage_root(arg), []).append(node)
    return out


def split_writes(graph: fx.Graph, ffn_nodes: Iterable[fx.Node]) -> list[fx.Node]:
    """In-place writes whose storage is produced, written or read on both sides of the cut."""
    ffn = set(ffn_nodes)
    bad = []
    for root, writers in writes(graph).items():
        group = alias_group(root)
        touching = group | {u for n in group for u in n.users} | set(writers)
        if len({n in ffn for n in touching if n.op != "output"} | {root in ffn}) > 1:
            bad.extend(writers)
    return bad


def mutation_inputs(node: fx.Node, index: dict[fx.Node, list[fx.Node]]) -> list[fx.Node]:
    """Data a read of ``node`` depends on through in-place writes to its storage."""
    deps = []
    for writer in index.get(storage_root(node), ()):
        deps.extend(a for a in writer.all_input_nodes if storage_root(a) is not storage_root(node))
    return deps
