"""Which code runs a program's graph: ``eager``, ``inductor``, or ``afdc``.

``afdc`` substitutes afdc's kernels where a pass recognizes their computation (fused MoE and
its routing, residual-add + RMSNorm / LayerNorm, activation-and-multiply) and hands the rest of
the graph to Inductor; ``inductor`` is Inductor alone; ``eager`` runs the graph as captured, its
ops called one by one from straight-line Python (:mod:`afdc.lowering.straight_line`).
``auto`` is ``afdc`` on a GPU and ``eager`` on a CPU, where Triton has no backend and Inductor's
C++ build costs more than it saves on small batches.

The substituted ops are custom ops whose fake kernels Inductor traces through as single nodes;
each runs its Triton kernel where Triton runs (CUDA, or the interpreter) and its PyTorch
reference elsewhere, so every backend is correct on every device.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.fx as fx
from torch._prims_common import make_contiguous_strides_for

from afdc import segment
from afdc.codegen.triton_support import source_lock
from afdc.lowering.fuse_activation import fuse_activations
from afdc.lowering.fuse_moe import fuse_moe, fuse_shared_experts
from afdc.lowering.fuse_norms import fuse_norms
from afdc.lowering.piecewise import Piece, pauses_after_piece, split_at_exchange, split_at_sends
from afdc.lowering.straight_line import StraightLine, straight_line
from afdc.passes.matching import FusionReport, copy_graph
from afdc.plan import BACKENDS

logger = logging.getLogger("afdc.backend")

def resolve(backend: str, device: torch.device) -> str:
    """The backend ``backend`` means on ``device``."""
    if backend not in BACKENDS:
        raise ValueError(f"backend {backend!r} is not one of {', '.join(BACKENDS)}")
    if backend == "auto":
        return "afdc" if device.type == "cuda" else "eager"
    return backend


def substitute_kernels(graph: fx.Graph) -> FusionReport:
    """Every kernel substitution, in place; MoE first, since it takes the experts' activation in."""
    report = fuse_moe(graph)
    report.merge(fuse_shared_experts(graph))
    report.merge(fuse_activations(graph))
    return report.merge(fuse_norms(graph))


def copy_module(module: fx.GraphModule) -> fx.GraphModule:
    """A module with its own copy of ``module``'s graph (the same weights), to rewrite freely."""
    return fx.GraphModule(module, copy_graph(module.graph))


def annotate(module: fx.GraphModule, args: tuple) -> None:
    """Give a program read back from an artifact (its nodes carry no values) the fake values the
    passes read, propagated from ``args`` with every activation size symbolic (weights ``w*``
    keep theirs), so that no check passes by the coincidence of one call's sizes."""
    from torch._dispatch.python import enable_python_dispatcher
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    mode = FakeTensorMode(shape_env=ShapeEnv(specialize_zero_one=False), allow_non_fake_inputs=True)
    fakes = []
    for node, value in zip(module.graph.find_nodes(op="placeholder"), args):
        if isinstance(value, torch.Tensor):
            how = DimDynamic.STATIC if segment.is_weight(node) else DimDynamic.DYNAMIC
            context = StatelessSymbolicContext(dynamic_sizes=[how] * value.dim())
            value = mode.from_tensor(value, symbolic_context=context)
        fakes.append(value)
    # as torch.export does: composite ops (matmul) take their SymInt-aware Python decompositions; the
    # C++ ones asked a symbolic size for its value on CUDA under torch 2.11
    with enable_python_dispatcher():
        FakeTensorProp(module, mode).propagate_dont_convert_inputs(*fakes)


def lower(module: fx.GraphModule, backend: str, name: str = "program") -> Callable:
    """What runs ``module`` (given :func:`with_kernels`) under ``backend`` (already resolved);
    ``module`` itself is unchanged."""
    if backend == "eager":
        return straight_line(module) or module
    if _tensor_parallel(module):
        # A TP rank of an attention rank runs in a thread that meets the others in collectives;
        # Dynamo compiling such threads stalled them past the group's timeout (not solved), so
        # under --attn-tp the attention program runs afdc's kernels without Inductor.
        logger.info("%s: attention TP: not compiled by Inductor", name)
        return straight_line(module) or module
    return Compiled(module)


def lower_in_pieces(module: fx.GraphModule, backend: str, name: str = "program") -> StraightLine | None:
    """What runs ``module`` (given :func:`with_kernels`) under a compiling ``backend`` so that it
    can pause after each send: Inductor's pieces of it cut at its sends
    (:mod:`afdc.lowering.piecewise`), called by straight-line code. None where :func:`lower`'s code
    pauses already (``eager``, attention TP) or the program sends nothing. Only the micro-batches'
    interleave asks for it: each piece call costs Dynamo's guards and AOT wrappers (about 110 us
    on this CPU; a 12-layer program decoded 20% slower in pieces than whole), which a single call
    need not pay."""
    if backend == "eager" or _tensor_parallel(module):
        return None
    split = split_at_sends(module)
    if split is None:
        return None
    parent, pieces = split
    for piece in pieces:
        piece.run = Compiled(piece.module)
    logger.info("%s: cut at its sends into %d pieces, each compiled by Inductor", name, len(pieces))
    return straight_line(parent, pause_after=pauses_after_piece)


def lower_at_exchange(
    module: fx.GraphModule, backend: str, wrap: Callable[[Piece, Callable], Callable], name: str = "program"
) -> StraightLine | None:
    """What runs ``module`` (given :func:`with_kernels`) as pieces cut around each send and
    receive (:func:`~afdc.lowering.piecewise.split_at_exchange`), called by straight-line code
    that pauses after each send: each exchange piece as it is, each computing piece as
    ``wrap(piece, what runs it under backend)`` (a CUDA graph per shape, say). None where the
    program sends nothing or is an attention TP rank's."""
    split = split_at_exchange(module) if not _tensor_parallel(module) else None
    if split is None:
        return None
    parent, pieces = split
    for piece in pieces:
        run = straight_line(piece.module) or piece.module
        piece.run = run if piece.exchange else wrap(piece, run if backend == "eager" else Compiled(piece.module))
    logger.info("%s: cut around its sends and receives into %d pieces", name, len(pieces))
    return straight_line(parent, pause_after=pauses_after_piece)


def with_kernels(module: fx.GraphModule, backend: str, name: str = "program", args: tuple = ()) -> fx.GraphModule:
    """What :func:`lower` and :func:`lower_in_pieces` take for ``module``, first called with
    ``args``: under ``afdc``, a copy of it with afdc's kernels substituted; else ``module``."""
    if backend != "afdc":
        return module
    with source_lock():  # FX compiles the graph's code, maybe in a TP rank's thread (see source_lock)
        module = copy_module(module)
        if any("val" not in n.meta for n in module.graph.find_nodes(op="placeholder")):
            annotate(module, args)
        report = substitute_kernels(module.graph)
        module.recompile()
    logger.info("afdc backend: %s: %s afdc kernels, %d candidates left to Inductor",
                name, report.fused or "no", len(report.skipped))
    return module


def _tensor_parallel(module: fx.GraphModule) -> bool:
    return bool(module.graph.find_nodes(op="call_function", target=torch.ops.afdc.tp_all_reduce.default))


class Compiled:
    """``module`` compiled by Inductor for symbolic sizes (token counts vary every step: at once
    rather than after a recompile), called with its activations dense (:func:`_dense`)."""

    def __init__(self, module: fx.GraphModule):
        self.module = torch.compile(module, backend="inductor", dynamic=True)
        placeholders = module.graph.find_nodes(op="placeholder")
        self._activations = [i for i, node in enumerate(placeholders) if not segment.is_weight(node)]

    def __call__(self, *args):
        return self.module(*_dense(args, self._activations))


def _dense(args: tuple, activations: list[int]) -> list:
    """``args`` with each activation that is a strided view replaced by a contiguous copy.

    Dynamo guards on strides and storage offsets as well as sizes. A micro-batch's rows are a view
    into the batch at an offset, and position ids may be expanded (stride 0, which a size-1 dim
    keeps contiguous). Each such input made a new graph until the recompile limit (8), past which
    the frame ran eagerly. Weights keep theirs: they do not change between calls."""
    args = list(args)
    for i in activations:
        x = args[i]
        if isinstance(x, torch.Tensor) and (x.storage_offset() or x.stride() != make_contiguous_strides_for(x.shape)):
            args[i] = x.clone(memory_format=torch.contiguous_format)
    return args
