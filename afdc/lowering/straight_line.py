"""The ``eager`` backend's lowering: a program's graph compiled to one straight-line Python function.

An FX ``GraphModule`` run as captured pays, around every node, for Python that a model's own
forward does not: each weight is a walk through nested modules
(``getattr(self.model.layers, "0").self_attn.q_proj.weight``, a ``Module.__getattr__`` per
level), each aten call goes through ``OpOverload.__call__``, and each afdc op goes through the
dispatcher's custom-op machinery and back into Python. On a decode step of a small model that
was a third of the step. Here the graph is written out once as source in which each weight is
one dict lookup in its owner module's parameters or buffers, aten overloads are called through
the C++ entry point that ``OpOverload.__call__`` forwards to, Python custom ops (afdc's,
transformers' grouped-matmul fallback) call their functions (:func:`afdc.ops.body_of`), and casts
to the dtype a value already has are left out (``to`` returns its input then). Each value is
released after its last use, as FX's own code does.

A program that sends to the FFN side is also written as a generator that pauses after each
``afdc::send`` (:meth:`StraightLine.steps`): one thread can then interleave several micro-batches,
running the next one's attention while the FFN side computes for the one that sent.

The program's module and graph stay as they were (passes, reports and the other backends read
them); :attr:`StraightLine.code` is what runs.
"""

from __future__ import annotations

import builtins
import functools
import keyword
import linecache
import math
import operator
import re
from collections.abc import Callable, Generator
from itertools import count

import torch
import torch.fx as fx

from afdc.codegen.triton_support import source_lock
from afdc.ops import SendCall, body_of
from afdc.ops.call import bound
from afdc.passes.matching import copy_graph

_NODE_KINDS = {"placeholder", "get_attr", "call_function", "output"}
# size arithmetic (on SymInts at capture, ints at run time), written as FX writes it
_INFIX = {
    operator.add: "+", operator.sub: "-", operator.mul: "*", operator.floordiv: "//", operator.truediv: "/",
    operator.mod: "%", operator.pow: "**",
}
_SOURCES = count()


class StraightLine:
    """A graph compiled to one function of the graph's placeholders; ``code`` is its source.

    The casts left out were judged by the dtypes its inputs had at capture (``dtypes``: input
    index, dtype): called with others (a float64 attention mask, say), it runs ``module`` as it is.
    """

    def __init__(
        self,
        fn: Callable,
        code: str,
        module: fx.GraphModule,
        dtypes: list[tuple[int, torch.dtype]],
        stepwise: Callable[..., Generator] | None = None,
    ):
        self.fn = fn
        self.code = code
        self.module = module
        self.dtypes = dtypes
        self.stepwise = stepwise  # the generator form (None: the graph sends nothing)

    def _as_captured(self, args: tuple) -> bool:
        return all(args[i].dtype == dtype for i, dtype in self.dtypes)

    def __call__(self, *args):
        if not self._as_captured(args):
            return self.module(*args)
        if torch.is_grad_enabled():  # a custom op called as its function must not record (see body_of)
            with torch.no_grad():
                return self.fn(*args)
        return self.fn(*args)

    def steps(self, *args) -> Generator[None, None, object] | None:
        """A generator that runs the program, pausing after each ``afdc::send``; its return value
        is the program's. None where the program sends nothing or runs as its module (see above).
        Run it under ``torch.no_grad()``, as :meth:`__call__` runs the function."""
        return self.stepwise(*args) if self.stepwise is not None and self._as_captured(args) else None


def sends(node: fx.Node) -> bool:
    """Whether ``node`` sends to the FFN side (where the generator form pauses by default)."""
    return node.target is SendCall.OP


def straight_line(module: fx.GraphModule, pause_after: Callable[[fx.Node], bool] = sends) -> StraightLine | None:
    """``module``'s graph as one function, or None for a graph this does not write out (its own
    calling convention, submodule or method calls): that one runs as the module itself. Its
    generator form pauses after each node ``pause_after`` names (each send to the FFN side)."""
    graph = module.graph
    if type(graph._codegen) is not fx.graph.CodeGen or any(
        n.op not in _NODE_KINDS or (n.op == "placeholder" and (n.args or n.target.startswith("*")))
        for n in graph.nodes
    ):
        return None
    graph = copy_graph(graph)
    inputs = graph.find_nodes(op="placeholder")
    dropped = False
    if all("val" in n.meta for n in inputs):  # else a value's dtype may hang on an input's unknown one
        for node in list(graph.nodes):
            source = _uncast(node)
            if source is not None:
                node.replace_all_uses_with(source)
                graph.erase_node(node)
                dropped = True
    dtypes = [(i, n.meta["val"].dtype) for i, n in enumerate(inputs) if isinstance(n.meta.get("val"), torch.Tensor)]
    return _Writer(module, graph, pause_after).write(dtypes if dropped else [])


def _uncast(node: fx.Node) -> fx.Node | None:
    """The input of a cast to the dtype it has (known from capture), which returns the input itself."""
    if node.op != "call_function" or node.target is not torch.ops.aten.to.dtype:
        return None
    args = bound(node, node.target)
    source = args["self"]
    value = source.meta.get("val") if isinstance(source, fx.Node) else None
    same = (
        isinstance(value, torch.Tensor)
        and value.dtype == args["dtype"]
        and not args["copy"]
        and args["memory_format"] in (None, torch.preserve_format)
    )
    return source if same else None


class _Writer:
    def __init__(self, module: fx.GraphModule, graph: fx.Graph, pause_after: Callable[[fx.Node], bool]):
        self.module = module
        self.graph = graph
        self.pause_after = pause_after
        self.globals: dict[str, object] = {}
        self._global_of: dict[int, str] = {}
        locals_ = (n.name for n in graph.nodes if n.op != "get_attr")
        self._taken = {"forward", "forward_steps", *locals_, *builtins.__dict__, *keyword.kwlist}
        self.names: dict[fx.Node, str] = {}

    def bind(self, value: object, hint: str) -> str:
        """The global name ``value`` has in the source (one per object)."""
        if id(value) in self._global_of:
            return self._global_of[id(value)]
        base = re.sub(r"\W", "_", hint)[:48]
        base = base if base.isidentifier() else f"c_{base}"
        name, n = base, 0
        while name in self._taken:
            n += 1
            name = f"{base}_{n}"
        self._taken.add(name)
        self.globals[name] = value
        self._global_of[id(value)] = name
        return name

    def fmt(self, a) -> str:
        if isinstance(a, fx.Node):
            return self.names[a]
        if isinstance(a, tuple):
            return "(" + "".join(f"{self.fmt(x)}, " for x in a) + ")"
        if isinstance(a, list):
            return "[" + ", ".join(self.fmt(x) for x in a) + "]"
        if isinstance(a, dict):
            return "{" + ", ".join(f"{self.fmt(k)}: {self.fmt(v)}" for k, v in a.items()) + "}"
        if isinstance(a, slice):
            return f"slice({self.fmt(a.start)}, {self.fmt(a.stop)}, {self.fmt(a.step)})"
        if a is None or type(a) in (bool, int, str) or (type(a) is float and math.isfinite(a)):
            return repr(a)
        return self.bind(a, str(a))

    def attribute(self, target: str) -> str:
        """How the code reads the module's attribute ``target``: a parameter or buffer through its
        owner's dict (one lookup; ``module.to()`` or an assigning ``load_state_dict`` replaces the
        entry, and the code then reads the new tensor, as the module would), anything else bound."""
        *path, leaf = target.split(".")
        owner = functools.reduce(getattr, path, self.module)
        for table in (owner._parameters, owner._buffers):
            if leaf in table:
                return f"{self.bind(table, target.rpartition('.')[0] or 'module')}[{leaf!r}]"
        return self.bind(getattr(owner, leaf), target)

    def call(self, node: fx.Node) -> str:
        target, args = node.target, node.args
        if target is operator.getitem and isinstance(args[0], fx.Node) and type(args[1]) is int:
            return f"{self.fmt(args[0])}[{args[1]}]"
        if target in _INFIX and len(args) == 2 and not node.kwargs:
            return f"{self.fmt(args[0])} {_INFIX[target]} {self.fmt(args[1])}"
        body = body_of(target)
        if body is not None:
            fn, hint = body, body.__name__
        elif type(target) is torch._ops.OpOverload:
            # what OpOverload.__call__ forwards to, without that Python frame
            fn, hint = target._op, str(target)
        else:
            fn, hint = target, getattr(target, "__name__", "fn")
        parts = [self.fmt(a) for a in args] + [f"{k}={self.fmt(v)}" for k, v in node.kwargs.items()]
        return f"{self.bind(fn, hint)}({', '.join(parts)})"

    def write(self, dtypes: list[tuple[int, torch.dtype]]) -> StraightLine:
        released: dict[fx.Node, list[fx.Node]] = {n: [] for n in self.graph.nodes}
        seen: set[fx.Node] = set()
        for node in reversed(self.graph.nodes):
            for value in node.all_input_nodes:
                if value not in seen:
                    seen.add(value)
                    released[node].append(value)
        params, lines, pauses = [], [], []
        for node in self.graph.nodes:
            if node.op == "placeholder":
                self.names[node] = node.name
                params.append(node.name)
            elif node.op == "get_attr":
                self.names[node] = self.attribute(node.target)
            elif node.op == "call_function":
                self.names[node] = node.name
                lines.append(f"{node.name} = {self.call(node)}" if node.users else self.call(node))
                if self.pause_after(node):
                    pauses.append(len(lines))
            else:
                lines.append(f"return {self.fmt(node.args[0])}")
            dead = [self.names[v] for v in released[node] if v.op != "get_attr"]
            if dead and node.op != "output":
                lines.append(" = ".join(dead) + " = None")
        signature = ", ".join(params)
        code = f"def forward({signature}):\n" + "".join(f"    {line}\n" for line in lines)
        if pauses:
            for at in reversed(pauses):
                lines.insert(at, "yield")
            code += f"\n\ndef forward_steps({signature}):\n" + "".join(f"    {line}\n" for line in lines)
        filename = f"<afdc straight line {next(_SOURCES)}>"
        # tracebacks through the generated code show its lines
        linecache.cache[filename] = (len(code), None, code.splitlines(keepends=True), filename)
        with source_lock():
            exec(compile(code, filename, "exec"), self.globals)
        return StraightLine(self.globals["forward"], code, self.module, dtypes, self.globals.get("forward_steps"))
