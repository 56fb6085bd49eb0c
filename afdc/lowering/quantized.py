"""Matmuls by quantized weights become afdc's quantized ops, after the split is decided in bf16.

The partition and sharding run on the bf16-shaped graph, so the split and the bytes that cross are
those of the bf16 model. This rewrite then finds each weight the checkpoint stores quantized (from
the scheme, by parameter name: no per-model code) and replaces the matmuls that read it:

- ``aten.linear(x, w, b)`` by ``afdc::fp8_linear(x, w, w_scale, block_n, block_k, b)``, or
  ``afdc::packed_linear`` for int4 and NVFP4 weights (dense linears on either side: attention
  projections, dense MLPs, shared experts);
- the routed experts, first recognised as one ``afdc::fused_moe`` (:func:`experts_as_op`), by
  ``afdc::fused_moe_fp8``, ``afdc::fused_moe_mxfp4``, ``afdc::fused_moe_int4`` or
  ``afdc::fused_moe_nvfp4`` with the scales appended.

An FFN segment takes each scale as a weight placeholder of its own (its own :class:`Split` and name
in every layer's binding); the attention graph reads it with ``get_attr``. A stateful mixer that
reads a quantized weight (DeepSeek-V4's attention, run in the model's own code) is given the
stored data and scales among its weights, and its site names the linear and the op to run there
(:class:`afdc.mixer_site.QuantizedLinear`): the rebuilt module runs the same op for it. A scale is split with
its weight: whole experts under EP, whole blocks under TP (a split that would cut a block is a
:class:`PlanError` naming the weight, the block and the rank counts that work), per-channel scales
with their channels; MXFP4 experts are split by expert only; int4 words and NVFP4 bytes along
the input dim as their groups (a group is a whole number of them); NVFP4's per-matrix global
scales with their experts, whole under TP.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.fx as fx

from afdc.codegen.fp8_linear import Fp8LinearCall
from afdc.codegen.fused_moe import FusedMoeCall
from afdc.codegen.fused_moe_quant import FusedMoeFp8Call, FusedMoeInt4Call, FusedMoeMxfp4Call, FusedMoeNvfp4Call
from afdc.codegen.packed_linear import PackedLinearCall
from afdc.codegen.typed_calls import EmittedCall
from afdc.errors import PlanError, UnsupportedModelError
from afdc.mixer_site import MixerSite, QuantizedLinear
from afdc.ops.call import position
from afdc.ops.mixer import MixerCall
from afdc.passes.graph_facts import op_name
from afdc.passes.moe_experts import experts_as_op
from afdc.quant.scheme import PACKED_VALUES, QuantFormat, QuantizedParameter
from afdc.quant.stored import QuantizedTensors, Role, StoredTensor
from afdc.segment import Segment, SegmentBinding, ShardSlice, Split, add_weight, inputs, weights


@dataclass(frozen=True)
class QuantizedGraphs:
    segments: list[Segment]
    layers: list[SegmentBinding]
    attention_graph: fx.Graph
    attrs: dict[str, torch.Tensor]  # the stored tensors' meta values, beside the captured attrs
    mixers: list[MixerSite]  # the stateful mixers' sites, with the quantized linears each runs


def quantize_graphs(
    segments: list[Segment],
    layers: list[SegmentBinding],
    attention_graph: fx.Graph,
    attrs: dict[str, torch.Tensor],
    quant: QuantizedTensors,
    ffn_ranks: int,
    mixers: list[MixerSite],
) -> QuantizedGraphs:
    """The graphs with every matmul by a quantized weight on its quantized op (see the module)."""
    layers = [SegmentBinding(b.segment, list(b.weights)) for b in layers]
    new_segments = [
        _quantize_segment(seg, [b for b in layers if b.segment == i], quant, ffn_ranks)
        for i, seg in enumerate(segments)
    ]
    sites = {s.slot: s for s in mixers}
    _quantize_attention(attention_graph, quant, sites)
    meta = {t.name: torch.empty(t.shape, dtype=t.dtype, device="meta") for t in quant.tensors().values()}
    return QuantizedGraphs(new_segments, layers, attention_graph, {**attrs, **meta}, [sites[s.slot] for s in mixers])


# -- which weights, how split ------------------------------------------------------------------------


def _stored(quant: QuantizedTensors, parameter: str) -> tuple[StoredTensor, StoredTensor, StoredTensor | None]:
    data, scale = quant.role(parameter, Role.DATA), quant.role(parameter, Role.SCALE)
    assert data is not None and scale is not None  # every quantized parameter has both
    return data, scale, quant.role(parameter, Role.INPUT_SCALE)


def _extra_roles(quant: QuantizedTensors, p: QuantizedParameter, split: Split) -> dict[Role, Split]:
    """The split of each stored tensor beside the data and its scale: a static input scale (one
    value) whole; NVFP4's global scales (one per matrix) with their experts under EP, else whole."""
    roles = {}
    if quant.role(p.name, Role.INPUT_SCALE) is not None:
        roles[Role.INPUT_SCALE] = Split()
    if quant.role(p.name, Role.GLOBAL_SCALE) is not None:
        roles[Role.GLOBAL_SCALE] = split if split.experts else Split()
    return roles


def _workable(sizes: tuple[int, ...], block: int) -> list[int]:
    return [f for f in range(1, 65) if all(n % (f * block) == 0 for n in sizes)]


def scale_split(parameter: str, shape: tuple[int, ...], block: tuple[int, ...], split: Split, ranks: int,
                fmt: QuantFormat) -> Split:
    """How the FFN ranks hold the scale of a weight they hold by ``split``."""
    if split.dim is None or ranks == 1:
        return Split()
    dim = split.dim
    if fmt is QuantFormat.MXFP4 and not split.experts:
        raise PlanError(
            f"{parameter} is MXFP4, whose 32-value blocks afdc keeps whole: the plan splits it by tensor parallelism "
            f"along dim {dim}; use expert parallelism for its experts (--ffn-parallel ep)"
        )
    step = block[dim]
    if split.experts or step == 1:
        return split
    if step >= shape[dim] or fmt is QuantFormat.FP8_TENSOR:
        # one scale along this dim (per channel along K), or one per matrix (per tensor, fused gate_up's
        # two included): every rank reads them whole
        return Split()
    sizes = ShardSlice(0, split.blocks, 0, 1, split.sections).sizes(shape[dim])
    if any(n % (ranks * step) for n in sizes):
        raise PlanError(
            f"the plan splits {parameter} {list(shape)} along dim {dim} over {ranks} FFN ranks, which cuts its "
            f"{'x'.join(map(str, block[-2:]))} scale blocks ({step} rows of dim {dim} per scale); F that split it on "
            f"block boundaries: {', '.join(map(str, _workable(sizes, step))) or 'none'} "
            "(or a plan that holds this layer whole, or expert parallelism for experts)"
        )
    return replace(split, sections=tuple(n // step for n in split.sections))


def _data_split(split: Split, data: StoredTensor) -> Split:
    """The data's split: the parameter's (MXFP4 blocks: by expert only, checked by :func:`scale_split`;
    int4 words along the input dim: the sections in words, whole groups checked by :func:`scale_split`)."""
    if split.dim is None:
        return split
    if data.format is QuantFormat.MXFP4:
        return Split(0, experts=True)
    if data.format in PACKED_VALUES and split.dim == len(data.shape) - 1:
        return replace(split, sections=tuple(n // PACKED_VALUES[data.format] for n in split.sections))
    return split


# -- the FFN segments ---------------------------------------------------------------------------------


def _quantize_segment(seg: Segment, bindings: list[SegmentBinding], quant: QuantizedTensors, ranks: int) -> Segment:
    if not bindings:
        return seg
    first = list(bindings[0].weights)  # the bf16 parameter names (the bindings are renamed below)
    quantized = [i for i, name in enumerate(first) if name in quant.by_parameter]
    for b in bindings:
        mine = [i for i, name in enumerate(b.weights) if name in quant.by_parameter]
        if mine != quantized:
            raise UnsupportedModelError(
                f"FFN layers sharing one segment store different weights quantized ({first} and {b.weights}); "
                "afdc needs layers of one structure quantized alike"
            )
    if not quantized:
        return seg
    graph = seg.graph
    places = weights(graph)
    matched = experts_as_op(graph) if any(len(quant.scheme.parameter(first[i]).shape) == 3 for i in quantized) else None
    splits = list(seg.splits)
    added: dict[int, dict[Role, fx.Node]] = {}
    for i in quantized:
        p = quant.scheme.parameter(first[i])
        data = quant.role(p.name, Role.DATA)
        splits[i] = _data_split(seg.splits[i], data)
        roles = {Role.SCALE: scale_split(p.name, p.shape, p.block, seg.splits[i], ranks, p.format),
                 **_extra_roles(quant, p, seg.splits[i])}
        added[i] = {}
        for role, split in roles.items():
            with graph.inserting_before(inputs(graph)[0]):
                node = add_weight(graph, len(weights(graph)))
            stored = quant.role(p.name, role)
            node.meta["val"] = torch.empty(stored.shape, dtype=stored.dtype, device="meta")
            added[i][role] = node
            splits.append(split)
            for b in bindings:
                b.weights.append(quant.role(b.weights[i], role).name)
        places[i].meta["val"] = torch.empty(data.shape, dtype=data.dtype, device="meta")
    for b in bindings:
        for i in quantized:
            b.weights[i] = quant.role(b.weights[i], Role.DATA).name
    scheme = quant.scheme
    for i in quantized:
        p = scheme.parameter(first[i])
        if len(p.shape) == 2:
            _linears(graph, places[i], added[i], p)
    experts = [i for i in quantized if len(scheme.parameter(first[i]).shape) == 3]
    _experts(graph, {places[i]: (scheme.parameter(first[i]), added[i]) for i in experts})
    for i in experts:
        _only_quantized_ops(places[i], first[i], matched.skipped if matched else [])
    graph.eliminate_dead_code()
    graph.lint()
    return replace(seg, splits=tuple(splits))


def _linears(graph: fx.Graph, weight: fx.Node, scales: dict[Role, fx.Node], p: QuantizedParameter,
             sites: dict[int, MixerSite] | None = None) -> None:
    """Each ``linear(x, weight, bias)`` on ``weight`` as its quantized op, and each stateful mixer
    reading ``weight`` (``sites``: theirs, updated) given the stored tensors; any other use is refused."""
    for user in list(weight.users):
        if MixerCall.matches(user) and sites is not None:
            _into_mixer(user, weight, scales, p, sites)
            continue
        if op_name(user) != "linear" or user.args[1] is not weight:
            raise UnsupportedModelError(
                f"{user.name} ({op_name(user)}) reads a quantized weight other than as a linear's weight; "
                "afdc rewrites only linears on quantized weights"
            )
        x, bias = user.args[0], (user.args[2] if len(user.args) > 2 else user.kwargs.get("bias"))
        call, arguments = _linear_op(p, scales)
        with graph.inserting_before(user):
            new = call.emit(graph, x=x, weight=weight, bias=bias, **arguments)
        new.meta = dict(user.meta)
        user.replace_all_uses_with(new)
        graph.erase_node(user)


def _linear_op(p: QuantizedParameter, scales: dict[Role, Any]) -> tuple[type[EmittedCall], dict[str, Any]]:
    """The op a linear on ``p`` runs, and its arguments besides ``x``, ``weight`` and ``bias``."""
    if p.format in PACKED_VALUES:
        return PackedLinearCall, dict(weight_scale=scales[Role.SCALE], format=_KERNEL_FORMAT[p.format],
                                      group_size=p.block[-1], weight_scale_2=scales.get(Role.GLOBAL_SCALE))
    return Fp8LinearCall, dict(weight_scale=scales[Role.SCALE], block_n=p.block[-2], block_k=p.block[-1],
                               w8a8=False, input_scale=scales.get(Role.INPUT_SCALE))


def _into_mixer(mixer: fx.Node, weight: fx.Node, scales: dict[Role, fx.Node], p: QuantizedParameter,
                sites: dict[int, MixerSite]) -> None:
    """The mixer's op given ``weight``'s scales after the module's other weights (before its other
    inputs), and its site the linear that reads ``weight`` with the op to run there: the module's
    own code calls the linear, whose weight the op already passes (as stored, now)."""
    call = MixerCall.of(mixer)
    site = sites[call.slot]
    own = site.weights[call.weights.index(weight)]
    if not own.endswith(".weight"):
        raise UnsupportedModelError(
            f"{p.name} is stored quantized ({p.format.value}) and the stateful mixer {site.module} reads it as {own}, "
            "not as a linear's weight: afdc runs quantized linears only; use the model's bf16 checkpoint"
        )
    linear = own.removesuffix(".weight")
    op, arguments = _linear_op(p, scales)
    stored = {arg: v for arg, v in arguments.items() if isinstance(v, fx.Node)}
    names = {arg: "weight" + _suffix(node.target, p.name) for arg, node in stored.items()}
    constants = tuple((arg, v) for arg, v in arguments.items() if arg not in stored and v is not None)
    held = len(site.weights)
    mixer.update_arg(position(MixerCall.OP, "weights"), [*call.weights[:held], *stored.values(), *call.weights[held:]])
    sites[call.slot] = replace(
        site,
        weights=(*site.weights, *(f"{linear}.{names[arg]}" for arg in stored)),
        linears=(*site.linears, QuantizedLinear(linear, op.OP._schema.name.split("::")[1],
                                                (("weight", "weight"), *names.items()), constants)),
    )


def _suffix(name: str, parameter: str) -> str:
    """What a stored tensor's name adds to its parameter's (``_scale``, ``_input_scale``, ``_scale_2``)."""
    if not name.startswith(parameter):
        raise UnsupportedModelError(f"the stored tensor {name} is not named after its parameter {parameter}")
    return name[len(parameter):]


def _experts(graph: fx.Graph, quantized: dict[fx.Node, tuple]) -> None:
    """Each fused MoE on quantized experts as its quantized op."""
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not FusedMoeCall.OP:
            continue
        call = FusedMoeCall.of(node)
        if call.w_gate_up not in quantized and call.w_down not in quantized:
            continue
        if call.w_gate_up not in quantized or call.w_down not in quantized or call.has_shared_expert:
            raise UnsupportedModelError(
                f"{node.name}: routed experts with only some weights quantized (or a shared expert fused in) "
                "have no quantized kernel"
            )
        (p, gate_up), (p_down, down) = quantized[call.w_gate_up], quantized[call.w_down]
        common = dict(x=call.x, topk_weights=call.topk_weights, topk_ids=call.topk_ids,
                      first_expert=call.first_expert, activation=call.activation, b_gate_up=call.b_gate_up,
                      b_down=call.b_down, alpha=call.alpha, limit=call.limit)
        with graph.inserting_before(node):
            if p.format is QuantFormat.MXFP4:
                new = FusedMoeMxfp4Call.emit(graph, w_gate_up_blocks=call.w_gate_up, w_down_blocks=call.w_down,
                                             w_gate_up_scales=gate_up[Role.SCALE], w_down_scales=down[Role.SCALE],
                                             interleaved=call.interleaved, **common)
            elif p.format in PACKED_VALUES:
                if call.transposed or call.interleaved:
                    raise UnsupportedModelError(f"{node.name}: {p.format.value} experts stored input-major or with "
                                                "interleaved gate and up rows have no kernel")
                packed = dict(w_gate_up_packed=call.w_gate_up, w_down_packed=call.w_down,
                              w_gate_up_scale=gate_up[Role.SCALE], w_down_scale=down[Role.SCALE], **common)
                if p.format is QuantFormat.INT4_GROUP:
                    new = FusedMoeInt4Call.emit(graph, group_size=p.block[-1], **packed)
                else:
                    new = FusedMoeNvfp4Call.emit(graph, w_gate_up_scale_2=gate_up[Role.GLOBAL_SCALE],
                                                 w_down_scale_2=down[Role.GLOBAL_SCALE], **packed)
            else:
                if call.transposed:
                    raise UnsupportedModelError(f"{node.name}: fp8 experts stored input-major have no kernel")
                block_n, block_k = _fp8_expert_block(p, p_down)
                new = FusedMoeFp8Call.emit(graph, w_gate_up=call.w_gate_up, w_down=call.w_down,
                                           w_gate_up_scale=gate_up[Role.SCALE], w_down_scale=down[Role.SCALE],
                                           block_n=block_n, block_k=block_k, w8a8=False, **common)
        new.meta = dict(node.meta)
        node.replace_all_uses_with(new)
        graph.erase_node(node)


def _fp8_expert_block(gate_up: QuantizedParameter, down: QuantizedParameter) -> tuple[int, int]:
    """The one ``block_n x block_k`` that ``fused_moe_fp8`` reads both matrices' scales by. fp8 blocks
    are the same for both; a per-channel or per-tensor scale spans a whole row or matrix, whose sizes
    differ between gate_up ``[2I, H]`` and down ``[H, I]``: a block as large as the larger one is
    still one scale along that dim of either (the checkpoint's scales, ``[E, 2I, 1]`` and ``[E, H, 1]``
    per channel, fit it as shipped)."""
    if gate_up.format is QuantFormat.FP8_BLOCK:
        if gate_up.block[-2:] != down.block[-2:]:
            raise UnsupportedModelError(f"{gate_up.name} and {down.name} are fp8 in different blocks "
                                        f"({gate_up.block[-2:]}, {down.block[-2:]}): fused_moe_fp8 takes one")
        return gate_up.block[-2], gate_up.block[-1]
    return max(gate_up.block[-2], down.block[-2]), max(gate_up.block[-1], down.block[-1])


_EXPERT_OPS = (FusedMoeFp8Call.OP, FusedMoeMxfp4Call.OP, FusedMoeInt4Call.OP, FusedMoeNvfp4Call.OP)
_KERNEL_FORMAT = {QuantFormat.INT4_GROUP: "int4", QuantFormat.NVFP4: "nvfp4"}  # quant_tiles' names


def _only_quantized_ops(weight: fx.Node, parameter: str, unmatched: list[str]) -> None:
    """Refuses quantized experts that a graph op other than a quantized one still reads: the routed
    experts were not recognised as one fused MoE, and the bf16 op would read the stored bytes."""
    others = [u for u in weight.users if u.target not in _EXPERT_OPS]
    if others:
        raise UnsupportedModelError(
            f"{parameter} is stored quantized but {others[0].name} ({op_name(others[0])}) reads it: afdc did not "
            f"recognise these routed experts as one fused MoE ({'; '.join(unmatched) or 'no grouped matmul found'}), "
            "and only that has quantized kernels; use the model's bf16 checkpoint"
        )


# -- the attention graph -------------------------------------------------------------------------------


def _quantize_attention(graph: fx.Graph, quant: QuantizedTensors, sites: dict[int, MixerSite]) -> None:
    for node in list(graph.find_nodes(op="get_attr")):
        p = quant.scheme.parameter(node.target)
        if p is None:
            continue
        data, scale, _ = _stored(quant, p.name)
        if len(p.shape) != 2:
            raise UnsupportedModelError(f"{node.target} ({p.format.value}) on the attention side has no quantized op")
        node.target = data.name  # packed formats store the data under a name of its own
        node.meta["val"] = torch.empty(data.shape, dtype=data.dtype, device="meta")
        with graph.inserting_after(node):
            scales = {Role.SCALE: graph.get_attr(scale.name)}
            for role in (Role.INPUT_SCALE, Role.GLOBAL_SCALE):
                if (extra := quant.role(p.name, role)) is not None:
                    scales[role] = graph.get_attr(extra.name)
        _linears(graph, node, scales, p, sites)
    graph.lint()
