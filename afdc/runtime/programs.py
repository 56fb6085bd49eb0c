"""The two runnable programs a partition produces, each owning only its own weights."""

from __future__ import annotations

import contextlib
import itertools
import math
import operator
import threading
from collections.abc import Callable, Generator
from dataclasses import dataclass

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from afdc.lowering import backends
from afdc.lowering.lm_head import split_head
from afdc.lowering.straight_line import StraightLine
from afdc.ops import LibraryOps, calls_library_ops
from afdc.ops.context import MixerTable, mixers_active
from afdc.runtime import trace
from afdc.runtime.static_shapes import StaticShapes, paddable
from afdc.segment import Dispatch, ExpertRouting, Segment, SegmentBinding, as_rows, at_tokens


class _Lowered:
    """A graph module and what runs it under a backend, lowered at first use (in the process
    that runs it: FFN programs are sent to server processes before they run) and once, though
    the micro-batches' threads may all call at the same time."""

    def __init__(self, module: fx.GraphModule, name: str):
        self.module = module
        self.name = name
        self.backend = "eager"
        self._kernels: fx.GraphModule | None = None  # backends.with_kernels, shared by both lowerings
        self._run: Callable | None = None
        self._pieces: StraightLine | bool | None = False  # backends.lower_in_pieces (False: not yet)
        self._lock = threading.Lock()

    def use(self, backend: str, device: torch.device) -> None:
        self.backend = backends.resolve(backend, device)
        self._kernels = self._run = None
        self._pieces = False

    def _with_kernels(self, args: tuple) -> fx.GraphModule:
        """``module`` as both lowerings take it (called under the lock)."""
        if self._kernels is None:
            self._kernels = backends.with_kernels(self.module, self.backend, self.name, args)
        return self._kernels

    def _lowered(self, args: tuple) -> Callable:
        if self._run is None:
            with self._lock:
                if self._run is None:
                    self._run = backends.lower(self._with_kernels(args), self.backend, self.name)
        return self._run

    def __call__(self, *args):
        return self._lowered(args)(*args)

    def steps(self, *args) -> Generator[None, None, tuple] | None:
        """The run as a generator that pauses after each send to the FFN side, where its code can
        pause (straight-line code: the ``eager`` backend's, or under a compiling backend the code
        calling Inductor's pieces of the program cut at its sends, lowered at the first call of
        this); else None."""
        run = self._lowered(args)
        if not isinstance(run, StraightLine):
            if self._pieces is False:
                with self._lock:
                    if self._pieces is False:
                        self._pieces = backends.lower_in_pieces(self._with_kernels(args), self.backend, self.name)
            run = self._pieces
        return run.steps(*args) if run is not None else None

    def at_exchange(self, args: tuple, wrap: Callable) -> StraightLine | None:
        """A new lowering of the run in pieces cut around each send and receive, its computing
        pieces run by ``wrap`` (:func:`backends.lower_at_exchange`)."""
        with self._lock:
            module = self._with_kernels(args)
        return backends.lower_at_exchange(module, self.backend, wrap, self.name)

    def __getstate__(self):
        return {"module": self.module, "name": self.name, "backend": self.backend}

    def __setstate__(self, state):
        self.__init__(state["module"], state["name"])
        self.backend = state["backend"]


def device_of(module: torch.nn.Module) -> torch.device:
    """Where a module's weights are, so where it computes."""
    tensors = itertools.chain(module.parameters(), module.buffers())
    return next((t.device for t in tensors), torch.device("cpu"))


# The dtypes a program's activations can be in; float8 and packed 4-bit ones only ever store weights.
_COMPUTE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def compute_dtype(module: fx.GraphModule) -> torch.dtype:
    """The dtype a program's activations are in, so its KV cache's: its token embedding table's,
    where the residual stream starts. Not merely its first floating parameter's: a quantized
    checkpoint's programs also hold weights stored in float8 (and scales in float32), and which
    tensor a module holds first is an accident of its graph's order. A program without a token
    embedding (none captured yet) computes in its first parameter of an activation dtype."""
    for node in module.graph.find_nodes(op="call_function", target=torch.ops.aten.embedding.default):
        table = node.args[0]
        if isinstance(table, fx.Node) and table.op == "get_attr":
            return operator.attrgetter(table.target)(module).dtype
    return next((p.dtype for p in module.parameters() if p.dtype in _COMPUTE_DTYPES), torch.float32)


class AttentionProgram(torch.nn.Module):
    """Embeddings, attention and other mixers, the residual stream, norms and the LM head.

    Its graph sends each FFN layer's inputs and receives its outputs through the active
    connector; attention ops read and extend the active KV cache; stateful-mixer ops run through
    ``mixers`` (:mod:`afdc.runtime.mixer_modules`), whose state the active KV cache keeps.

    It runs in two stages (:mod:`afdc.lowering.lm_head`): :meth:`body`, everything up to the LM
    head, once per micro-batch, then :meth:`finish`, the head once over every micro-batch's rows.
    """

    def __init__(self, module: fx.GraphModule, out_spec: pytree.TreeSpec, mixers: MixerTable | None = None):
        super().__init__()
        self.module = module
        self.out_spec = out_spec
        self.mixers = mixers
        self._backend = "eager"
        self._stages: _Stages | None = None  # cut and lowered at the first call, after any rewrite
        self._lock = threading.Lock()

    @classmethod
    def from_graph(
        cls,
        graph: fx.Graph,
        attrs: dict[str, torch.Tensor],
        out_spec: pytree.TreeSpec,
        mixers: MixerTable | None = None,
    ):
        used = {n.target for n in graph.nodes if n.op == "get_attr"}
        return cls(fx.GraphModule({name: attrs[name] for name in used}, graph), out_spec, mixers)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor):
        return self.finish([self.body(input_ids, attention_mask, position_ids)])[0]

    def body(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor) -> list:
        """The program up to its LM head: its flat outputs, the head's input rows in place of the logits."""
        with self.active():
            return list(self._staged().body(input_ids, attention_mask, position_ids))

    def body_steps(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor
    ) -> Generator[None, None, tuple] | None:
        """:meth:`body` as a generator that pauses after each send to the FFN side (its return
        value is the body's outputs), where the backend's code can pause; else None. The caller
        enters :meth:`active` around the resumes, as :meth:`body` does around its call."""
        return self._staged().body.steps(input_ids, attention_mask, position_ids)

    def body_at_exchange(self, args: tuple, wrap: Callable) -> StraightLine | None:
        """The body lowered afresh as pieces cut around its sends and receives, for ``args``
        (input_ids, attention_mask, position_ids), each computing piece run by ``wrap(piece, run)``
        (see :mod:`afdc.runtime.decode_graphs`); None where it sends nothing."""
        return self._staged().body.at_exchange(args, wrap)

    def active(self) -> contextlib.AbstractContextManager:
        """What the program's ops need active while it runs (its mixer table)."""
        return mixers_active(self.mixers) if self.mixers else contextlib.nullcontext()

    def finish(self, bodies: list[list]) -> list:
        """Each micro-batch's outputs from its :meth:`body` outputs, the LM head run once over all their rows."""
        stages = self._staged()
        if stages.head is not None:
            hidden = [flat[stages.index] for flat in bodies]
            width = hidden[0].shape[-1]
            (logits,) = stages.head(torch.cat([h.reshape(-1, width) for h in hidden]))
            parts = logits.split([h.numel() // width for h in hidden])
            for flat, h, part in zip(bodies, hidden, parts):
                flat[stages.index] = part.reshape(*h.shape[:-1], part.shape[-1])
        return [pytree.tree_unflatten(flat, self.out_spec) for flat in bodies]

    def _staged(self) -> _Stages:
        if self._stages is None:
            with self._lock:
                if self._stages is None:
                    self._stages = _Stages.of(self.module, self.out_spec, self._backend)
        return self._stages

    def __getstate__(self):  # a copy cuts and lowers afresh (a lock and compiled code do not copy)
        state = {**self.__dict__, "_stages": None}
        del state["_lock"]
        return state

    def __setstate__(self, state):
        super().__setstate__(state)
        self._lock = threading.Lock()

    def use_backend(self, backend: str) -> None:
        """Run under ``backend`` (:mod:`afdc.lowering.backends`) from the next call on; rewrite
        ``module``'s graph (as the serving passes do) before this, not after."""
        self._backend = backends.resolve(backend, device_of(self.module))
        self._stages = None

    @property
    def backend(self) -> str:
        """What runs it, resolved for its device (``eager``, ``inductor`` or ``afdc``)."""
        return self._backend

    def parameter_names(self) -> list[str]:
        return [name for name, _ in self.module.named_parameters()]


@dataclass
class _Stages:
    """An attention program cut before its LM head, each part lowered at its first call."""

    body: _Lowered
    head: _Lowered | None  # None: the program has no LM head to cut off (the body is all of it)
    index: int  # the flat output the head's rows stand in for

    @classmethod
    def of(cls, module: fx.GraphModule, out_spec: pytree.TreeSpec, backend: str) -> _Stages:
        device = device_of(module)

        def lowered(part: fx.GraphModule, name: str) -> _Lowered:
            run = _Lowered(part, name)
            run.use(backend, device)
            return run

        split = split_head(module, out_spec)
        if split is None:
            return cls(lowered(module, "attention program"), None, -1)
        return cls(lowered(split.body, "attention program"), lowered(split.head, "LM head"), split.index)


class FFNProgram(torch.nn.Module):
    """One FFN rank: the segment graphs of every FFN layer, bound to this rank's weights.

    Each :class:`~afdc.segment.Segment` says how the attention side dispatches to it and combines
    the ranks' outputs; ``layers[i]`` binds FFN layer ``i`` to its segment and weight names.
    """

    def __init__(
        self, *, segments: list[Segment], layers: list[SegmentBinding], weights: dict[str, torch.Tensor], rank: int
    ):
        super().__init__()
        self.segments = torch.nn.ModuleList(fx.GraphModule(torch.nn.Module(), s.graph) for s in segments)
        self._lowered = [_Lowered(s, f"FFN segment {i}") for i, s in enumerate(self.segments)]
        self.backend = "eager"  # what use_backend asked for
        self.layers = layers
        self.rank = rank
        self._dispatch = [s.dispatch() for s in segments]
        self._weights = weights
        self._parameters_owned = {n for n, w in weights.items() if isinstance(w, torch.nn.Parameter)}
        self.token_buckets = 0  # see use_buckets
        self._static: list[StaticShapes | None] | None = None  # per segment, while token_buckets

    def __getstate__(self):  # first, what registers another library's op its segments call
        first = {"_library_ops": LibraryOps()} if any(calls_library_ops(s) for s in self.segments) else {}
        return {**first, **self.__dict__}

    def __setstate__(self, state):
        state = dict(state)
        state.pop("_library_ops", None)
        super().__setstate__(state)

    @trace.phase("program.ffn_run")
    def run(self, layer: int, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        binding = self.layers[layer]
        outputs = self._lowered[binding.segment](*(self._weights[w] for w in binding.weights), *inputs, self.rank)
        return list(outputs)

    def use_backend(self, backend: str) -> None:
        """Run every segment under ``backend`` (:mod:`afdc.lowering.backends`); segments are lowered
        at their first run, on the device of this rank's weights."""
        self.backend = backend
        self._lowered = [_Lowered(s, f"FFN segment {i}") for i, s in enumerate(self.segments)]
        for lowered in self._lowered:
            lowered.use(backend, self.device)
        self.use_buckets(self.token_buckets)  # over the segments just lowered

    def use_buckets(self, largest: int) -> None:
        """Run :meth:`run_batch` at token counts padded to powers of two up to ``largest``
        (:mod:`afdc.runtime.static_shapes`), each captured in a CUDA graph where this rank
        computes on a GPU; ``0`` runs every batch at its own count again."""
        self.token_buckets = largest
        graphs = self.device.type == "cuda"
        self._static = None if not largest else [
            StaticShapes(lowered, d.inputs, largest, graphs, lowered.name) if paddable(d.inputs) else None
            for lowered, d in zip(self._lowered, self._dispatch, strict=True)
        ]  # fmt: skip

    @property
    def device(self) -> torch.device:
        """Where this rank's weights are, so where it computes."""
        return next((w.device for w in self._weights.values()), torch.device("cpu"))

    def run_batch(self, layer: int, messages: list[list[torch.Tensor]], tokens: list[int]) -> list[list[torch.Tensor]]:
        """Run FFN layer ``layer`` once over the tokens of several messages, then split the outputs.

        This is what makes AFD pay: one FFN batch from every attention rank and micro-batch.
        Each output comes back per message as ``[tokens, per-token...]`` (one message alone may
        come back in the program's own shape, unless :meth:`use_buckets` pads its batches).
        """
        binding = self.layers[layer]
        layouts = self._dispatch[binding.segment].inputs
        static = self._static[binding.segment] if self._static is not None else None
        if (len(messages) == 1 and static is None) or any(lay is None for lay in layouts):
            return [self.run(layer, m) for m in messages]
        total = sum(tokens)
        batched = [
            torch.cat([m[i].reshape(t, math.prod(abs(d) for d in lay)) for m, t in zip(messages, tokens)]).reshape(
                at_tokens(lay, total)
            )
            for i, lay in enumerate(layouts)
        ]
        if static is not None:
            outputs = static.rows([self._weights[w] for w in binding.weights], batched, self.rank, total)
        else:
            outputs = [as_rows(o, total) for o in self.run(layer, batched)]
        return [list(parts) for parts in zip(*(o.split(tokens) for o in outputs))]

    @property
    def routing(self) -> list[ExpertRouting | None]:
        """Per segment: how its tokens go only to their experts' ranks (None: to every rank)."""
        return [d.experts for d in self._dispatch]

    def dispatch(self, layer: int) -> Dispatch:
        """How FFN layer ``layer``'s inputs go out to the FFN ranks and their replies combine."""
        return self._dispatch[self.layers[layer].segment]

    def parameter_names(self) -> list[str]:
        return sorted(self._parameters_owned)

    def parameters_of(self, names: list[str]) -> list[torch.Tensor]:
        return [self._weights[n] for n in names]


def combine(programs: list[FFNProgram], layer: int, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Run FFN layer ``layer`` in-process on the FFN ranks it goes to and combine their outputs."""
    dispatch = programs[0].dispatch(layer)
    if len(programs) == 1 and not dispatch.partial_rows:  # the one rank's reply is the result, whatever the reduction
        return programs[0].run(layer, inputs)
    tokens = dispatch.tokens(inputs)
    shares = dispatch.shares(inputs, tokens, len(programs))
    replies = [programs[s.rank].run(layer, dispatch.take(inputs, s, tokens)) for s in shares]
    return [dispatch.combine(i, [r[i] for r in replies], shares) for i in range(len(replies[0]))]
