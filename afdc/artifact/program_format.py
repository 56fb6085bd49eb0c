"""Programs on disk as data: an FX graph written as JSON, read back into a GraphModule without
running anything from the file.

A program file lists the graph's nodes in order, one per line: name, op, target, and arguments
as typed literals (references to earlier nodes, numbers, strings, lists, tuples, dtypes, devices).
Reading resolves every call target against an allow-list: aten ops (less those that name a
file), afdc's own ops, transformers' grouped expert matmul, and a short list of Python operators
on sizes. A program naming anything
else is refused by name; nothing is imported, evaluated or executed from the file, so an
artifact whose program and manifest were changed together still cannot run code. Names are
checked to be identifiers before FX turns the graph into Python, so none can smuggle code into
it. Programs are captured on the meta device, so every device they name is the run's device.

Nodes carry no values (``meta['val']``), as programs read back never have: lowering propagates
fake values from the first call's arguments (:func:`afdc.lowering.annotate`).
"""

from __future__ import annotations

import json
import keyword
import math
import numbers
import operator
import re
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx

import afdc.ops  # registers the afdc ops the programs call; another library's on demand
from afdc.artifact.manifest import ArtifactError
from afdc.errors import AfdcError

FORMAT = "afdc-fx-graph/1"
OP_NAMESPACES = ("aten", "afdc")
# ops of other libraries that captured graphs keep: transformers' grouped expert matmul (an
# unsharded MoE segment calls it)
LIBRARY_OPS = ("transformers.grouped_mm_fallback",)
# Python functions a captured graph calls on sizes and tuples (FX writes them as `a * b`, `t[0]`)
PYTHON_FUNCTIONS = {
    f"operator.{f.__name__}": f
    for f in (
        operator.getitem, operator.add, operator.sub, operator.mul, operator.truediv, operator.floordiv,
        operator.mod, operator.neg, operator.eq, operator.ne, operator.lt, operator.le, operator.gt, operator.ge,
    )
} | {f"torch.{f.__name__}": f for f in (torch.sym_max, torch.sym_min, torch.sym_float, torch.sym_int)}
_PYTHON_NAMES = {f: name for name, f in PYTHON_FUNCTIONS.items()}
# An op that reads or writes a file by name (torch.save's and torch.from_file's kernels) is no
# graph computation: refused like any name outside the list.
_FILE_ARGUMENTS = ("filename", "path", "file")

_DTYPES = {str(d).removeprefix("torch."): d for d in vars(torch).values() if isinstance(d, torch.dtype)}
_LAYOUTS = {str(v).removeprefix("torch."): v for v in vars(torch).values() if isinstance(v, torch.layout)}
_MEMORY_FORMATS = {str(v).removeprefix("torch."): v for v in vars(torch).values() if isinstance(v, torch.memory_format)}
_IDENTIFIER = re.compile(rf"(?!(?:{'|'.join(keyword.kwlist)})$)[A-Za-z_][A-Za-z0-9_]*")  # not a Python keyword
_ATTRIBUTE = re.compile(r"[A-Za-z0-9_]+(\.[A-Za-z0-9_]+)*")  # a weight's qualified name: model.layers.0.mlp
_NODE_OPS = ("placeholder", "get_attr", "call_function", "output")


# -- writing -----------------------------------------------------------------------------------


def program_text(graph: fx.Graph) -> str:
    """``graph`` as the text of a program file: a header, then one node per line (diffable).
    Inputs come first, in their order, as in the function FX generates for the graph."""
    ordered = sorted(graph.nodes, key=lambda node: node.op != "placeholder")  # stable: keeps the rest's order
    nodes = [json.dumps(_node_entry(node), allow_nan=False) for node in ordered]
    return f'{{"format": "{FORMAT}",\n "nodes": [\n  ' + ",\n  ".join(nodes) + "\n ]}\n"


def write_program(graph: fx.Graph, path: Path) -> None:
    path.write_text(program_text(graph))


def _node_entry(node: fx.Node) -> dict[str, Any]:
    if node.op not in _NODE_OPS:
        raise AfdcError(f"cannot write a program with a {node.op} node ({node.name}): afdc's graphs have none")
    entry: dict[str, Any] = {"name": node.name, "op": node.op}
    if node.op in ("placeholder", "get_attr"):
        entry["target"] = node.target
    elif node.op == "call_function":
        entry["target"] = _target_name(node)
    if node.args:
        entry["args"] = _encode(node.args, node)["tuple"]
    if node.kwargs:
        entry["kwargs"] = {k: _encode(v, node) for k, v in node.kwargs.items()}
    return entry


def _target_name(node: fx.Node) -> str:
    target = node.target
    if isinstance(target, torch._ops.OpOverload | torch._ops.OpOverloadPacket):
        name = str(target)  # "aten.embedding.default"
        if _allowed_op(name):
            return name
    if target in _PYTHON_NAMES:
        return _PYTHON_NAMES[target]
    raise AfdcError(
        f"cannot write a program that calls {target!r} (node {node.name}): a program may call aten and afdc ops, "
        f"{', '.join(LIBRARY_OPS)} and {', '.join(PYTHON_FUNCTIONS)}"
    )


def _encode(value: Any, node: fx.Node) -> Any:
    if isinstance(value, fx.Node):
        return {"node": value.name}
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, numbers.Integral):  # a size the capture left as a sympy Integer
        return int(value)
    if isinstance(value, float):
        return value if math.isfinite(value) else {"float": str(value)}
    if isinstance(value, list):
        return [_encode(v, node) for v in value]
    if isinstance(value, tuple):
        return {"tuple": [_encode(v, node) for v in value]}
    for tag, table in (("dtype", _DTYPES), ("layout", _LAYOUTS), ("memory_format", _MEMORY_FORMATS)):
        if value in table.values():
            return {tag: str(value).removeprefix("torch.")}
    if isinstance(value, torch.device):
        return {"device": str(value)}
    raise AfdcError(f"cannot write a program whose node {node.name} takes {value!r} ({type(value).__name__})")


# -- reading -----------------------------------------------------------------------------------


def load_program(path: Path, attrs: dict[str, torch.Tensor], device: torch.device) -> fx.GraphModule:
    """The program at ``path`` as a GraphModule reading ``attrs`` (by fully qualified name),
    creating its tensors on ``device``. Raises :class:`ArtifactError` naming the file and what
    in it is not a program."""
    try:
        data = json.loads(path.read_text())
    except (UnicodeDecodeError, ValueError, RecursionError) as err:
        raise ArtifactError(f"{path} is not an afdc program ({err}); recompile the artifact with this afdc") from err
    try:
        graph = _Reader(device, attrs).graph(data)
    except RecursionError:
        raise ArtifactError(f"{path}: values nest deeper than any program's") from None
    except _Refused as err:
        raise ArtifactError(f"{path}: {err}") from None
    root = torch.nn.Module()
    for name, tensor in attrs.items():
        _install(root, name, tensor)
    return fx.GraphModule(root, graph)


class _Refused(Exception):
    """What makes a program file no program (the loader adds the file's name)."""


class _Reader:
    def __init__(self, device: torch.device, attrs: dict[str, torch.Tensor]):
        self.device = device
        self.attrs = attrs
        self.nodes: dict[str, fx.Node] = {}

    def graph(self, data: Any) -> fx.Graph:
        if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("nodes"), list):
            raise _Refused(f"not a program of format {FORMAT}; recompile the artifact with this afdc")
        graph = fx.Graph()
        for entry in data["nodes"]:
            if "output" in self.nodes:
                raise _Refused("nodes follow the output node")
            self.add(graph, entry)
        if "output" not in self.nodes:
            raise _Refused("the program has no output node")
        graph.lint()
        return graph

    def add(self, graph: fx.Graph, entry: Any) -> None:
        if not isinstance(entry, dict) or set(entry) - {"name", "op", "target", "args", "kwargs"}:
            raise _Refused(f"a node is not an object of name, op, target, args and kwargs: {str(entry)[:200]}")
        name, op = entry.get("name"), entry.get("op")
        if not isinstance(name, str) or not _IDENTIFIER.fullmatch(name) or name in self.nodes:
            raise _Refused(f"node name {name!r} is not a new identifier")
        if op not in _NODE_OPS:
            raise _Refused(f"node {name}: op {op!r} is not one of {', '.join(_NODE_OPS)}")
        if op == "output" and name != "output":
            raise _Refused(f"the output node is named {name!r}, not 'output'")
        args, kwargs = entry.get("args", []), entry.get("kwargs", {})
        if not isinstance(args, list) or not isinstance(kwargs, dict):
            raise _Refused(f"node {name}: args must be a list and kwargs an object")
        if not all(isinstance(k, str) and _IDENTIFIER.fullmatch(k) for k in kwargs):
            raise _Refused(f"node {name}: a keyword of {list(kwargs)} is not an identifier")
        target = self.target(op, entry.get("target"), name)
        args = tuple(self.value(v, name) for v in args)
        kwargs = {k: self.value(v, name) for k, v in kwargs.items()}
        self.nodes[name] = graph.create_node(op, target, args, kwargs, name=name)

    def target(self, op: str, target: Any, name: str) -> Any:
        if op == "output":
            return "output"
        if op == "call_function":
            return _resolve(target, name)
        if op == "placeholder" and not (isinstance(target, str) and _IDENTIFIER.fullmatch(target)):
            raise _Refused(f"node {name}: input name {target!r} is not an identifier")
        if op == "get_attr" and not (isinstance(target, str) and _ATTRIBUTE.fullmatch(target)):
            raise _Refused(f"node {name}: weight name {target!r} is not a qualified name")
        if op == "get_attr" and target not in self.attrs:
            raise _Refused(f"node {name} reads {target}, which no weight file of this rank holds")
        return target

    def value(self, value: Any, name: str) -> Any:
        if value is None or isinstance(value, bool | int | float | str):
            return value
        if isinstance(value, list):
            return [self.value(v, name) for v in value]
        if not isinstance(value, dict) or len(value) != 1:
            raise _Refused(f"node {name}: {str(value)[:200]} is no value")
        ((tag, raw),) = value.items()
        if tag == "node":
            if not isinstance(raw, str) or raw not in self.nodes:
                raise _Refused(f"node {name} refers to {raw!r}, which is not an earlier node")
            return self.nodes[raw]
        if tag == "tuple" and isinstance(raw, list):
            return tuple(self.value(v, name) for v in raw)
        if tag == "float" and raw in ("inf", "-inf", "nan"):
            return float(raw)
        if tag == "device" and isinstance(raw, str):
            return self.device
        for known, table in (("dtype", _DTYPES), ("layout", _LAYOUTS), ("memory_format", _MEMORY_FORMATS)):
            if tag == known and isinstance(raw, str) and raw in table:
                return table[raw]
        raise _Refused(f"node {name}: {str(value)[:200]} is no value")


def _resolve(target: Any, node: str = "?") -> Any:
    """The function a program's call ``target`` names, if the allow-list holds it; else
    :class:`_Refused` naming it. Looks names up in tables and op registries, and imports nothing
    a name chooses (an allowed library's ops are registered by one fixed import)."""
    if not isinstance(target, str):
        raise _Refused(f"node {node} calls {target!r}, which is not a name")
    if target in PYTHON_FUNCTIONS:
        return PYTHON_FUNCTIONS[target]
    parts = target.split(".")
    if len(parts) in (2, 3) and _allowed_op(target) and all(_IDENTIFIER.fullmatch(p) for p in parts[1:]):
        if parts[0] in afdc.ops.LIBRARY_NAMESPACES:
            afdc.ops.register_library_ops()
        op = _op(*parts)
        if op is not None:
            return op
    raise _Refused(
        f"node {node} calls {target}, which is not an aten or afdc op, nor one of {', '.join(LIBRARY_OPS)} and the "
        "Python operators a program may call; afdc never writes such a program: the file was altered, or written "
        "by something else"
    )


def _allowed_op(name: str) -> bool:
    """Whether ``name`` ("aten.mm", "aten.mm.default") is in an allowed namespace or list."""
    return name.split(".")[0] in OP_NAMESPACES or ".".join(name.split(".")[:2]) in LIBRARY_OPS


def _op(namespace: str, name: str, overload: str | None = None) -> torch._ops.OpOverload | None:
    """The op, looked up by attribute (ops namespaces and packets find their ops in the dispatcher's
    registry; ``__and__`` is an aten op): whatever the lookup gives is used only if it is an op
    of ``namespace``."""
    try:
        packet = getattr(getattr(torch.ops, namespace), name)
        op = packet if overload is None else getattr(packet, overload)
    except (AttributeError, RuntimeError):
        return None
    if isinstance(op, torch._ops.OpOverloadPacket):
        schemas = [getattr(op, o)._schema for o in op.overloads()]
    elif isinstance(op, torch._ops.OpOverload):
        schemas = [op._schema]
    else:
        return None
    if str(op).split(".")[0] != namespace:
        return None
    names_a_file = any(a.name in _FILE_ARGUMENTS for s in schemas for a in s.arguments)
    return None if names_a_file else op


def _install(root: torch.nn.Module, name: str, tensor: torch.Tensor) -> None:
    *path, leaf = name.split(".")
    module = root
    for part in path:
        if not hasattr(module, part):
            module.add_module(part, torch.nn.Module())
        module = getattr(module, part)
    if isinstance(tensor, torch.nn.Parameter):
        module.register_parameter(leaf, tensor)
    else:
        module.register_buffer(leaf, tensor)
