"""An exported program as afdc's :class:`CapturedGraph`: parameters, buffers and constants as
``get_attr`` nodes named by the model's canonical FQNs, module paths as the model names them."""

from __future__ import annotations

import itertools

import torch
import torch.fx as fx
from transformers import PreTrainedModel

from afdc.capture.captured import INPUT_NAMES, ONE_LENGTH, CapturedGraph
from afdc.errors import UnsupportedModelError


def unwrap_module_stack(graph: fx.Graph, prefix: str) -> None:
    """Module paths (report labels, layer lookup) as the model names them: without ``prefix``
    and without the wrapper's own frame."""
    if not prefix:
        return
    root = prefix.removesuffix(".")
    for node in graph.nodes:
        if stack := node.meta.get("nn_module_stack"):
            node.meta["nn_module_stack"] = {
                key: ("" if path == root else path.removeprefix(prefix), cls)
                for key, (path, cls) in stack.items()
                if path
            }


def canonical_names(model: PreTrainedModel) -> dict[str, str]:
    """Each name a parameter or buffer is reachable by -> the one ``named_parameters()`` /
    ``named_buffers()`` report: a tied weight (embedding and LM head) has several, and export
    may lift it under any of them."""
    first: dict[int, str] = {}
    tensors = itertools.chain(
        model.named_parameters(remove_duplicate=False), model.named_buffers(remove_duplicate=False)
    )
    return {name: first.setdefault(id(t), name) for name, t in tensors}


def to_get_attr_graph(
    ep: torch.export.ExportedProgram,
    canonical: dict[str, str] | None = None,
    recompute: str = ONE_LENGTH,
    max_positions: int | None = None,
    specialized: str = "",
) -> CapturedGraph:
    """Turn the exported program's lifted parameter/buffer/constant inputs into ``get_attr`` nodes
    named by the model's canonical FQNs."""
    sig = ep.graph_signature
    canonical = canonical or {}
    state = {canonical.get(k, k): v for k, v in {**ep.state_dict, **ep.constants}.items()}
    lifted = {**sig.inputs_to_parameters, **sig.inputs_to_buffers, **sig.inputs_to_lifted_tensor_constants}
    lifted = {k: canonical.get(v, v) for k, v in lifted.items()}
    parameters = [canonical.get(v, v) for v in sig.inputs_to_parameters.values()]
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in ep.graph.nodes:
        if node.op == "placeholder" and node.name in lifted:
            new = graph.get_attr(lifted[node.name])
            new.meta = dict(node.meta)
        else:
            new = graph.node_copy(node, lambda n: env[n])
        env[node] = new
    user_inputs = [n for n in graph.nodes if n.op == "placeholder"]
    if [n.name for n in user_inputs] == list(INPUT_NAMES[:2]):  # a forward that takes no position_ids
        with graph.inserting_after(user_inputs[1]):
            positions = graph.placeholder("position_ids")
        positions.meta["val"] = user_inputs[0].meta["val"]  # unused; the programs all take the same inputs
        user_inputs.append(positions)
    graph.lint()
    if [n.name for n in user_inputs] != list(INPUT_NAMES):
        raise UnsupportedModelError(f"unexpected graph inputs {[n.name for n in user_inputs]}")
    attrs = {name: state[name] for name in lifted.values()}
    return CapturedGraph(
        graph=graph, attrs=attrs, parameter_names=parameters, out_spec=ep.call_spec.out_spec, recompute=recompute,
        max_positions=max_positions, specialized=specialized,
    )
