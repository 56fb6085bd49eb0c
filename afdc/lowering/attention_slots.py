"""Which cache entry each attention call site has, and which keys its queries reach.

A paged KV cache ignores the graph's masks (causal over a whole flat batch, wrong across
requests): it needs, per ``afdc::attention`` call, a :class:`SlotSpec` saying how many key/value
heads the slot holds and which positions a query reaches. :func:`attention_slots` reads them off
an attention graph, running each call site's mask computation, and refuses masks a paged cache
cannot reproduce rather than serving a silently different model.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from afdc.capture import key_length_tied
from afdc.errors import UnsupportedModelError
from afdc.ops import AttentionCall, MixerCall, SlotSpec
from afdc.passes import graph_facts as gf


def attention_slots(graph: fx.Graph, masks_applied: bool = False) -> list[SlotSpec]:
    """The :class:`SlotSpec` of every ``afdc::attention`` call in ``graph``, in slot order.

    ``graph`` is a captured or attention-program graph (``dm.attention.module.graph``). Raises
    :class:`UnsupportedModelError` for what the paged path cannot serve. It cannot tell from the
    graph whether other token mixers (convolutions, recurrences) run inline; those models have
    ``dm.incremental == False`` and must be refused by the caller. ``masks_applied``: the paged
    cache applies the graph's own masks (:class:`afdc.runtime.paged.PagedRows`), so a mask
    computed from the hidden states is served as it is (its reach is then the whole context).
    """
    calls = AttentionCall.all_in(graph)
    if not calls:
        raise UnsupportedModelError(
            "the graph has no afdc attention op (the model has no attention, or hard-codes it inline): nothing to page"
        )
    _check_incremental(graph)
    from_tokens = _token_dependent(graph)
    specs: dict[int, SlotSpec] = {}
    for call in calls:
        q, k, v, mask, slot, window = call.q, call.k, call.v, call.mask, call.slot, call.window
        if slot < 0:
            raise UnsupportedModelError(
                "an attention call has no cache slot (slot -1: it was not numbered at capture), "
                "so its keys and values have nowhere to go in a paged cache"
            )
        if slot in specs:
            raise UnsupportedModelError(f"attention slot {slot} is used by two calls; a paged cache needs one each")
        kv_heads, head_dim = _concrete(k, slot, "keys")
        value_heads, value_dim = _concrete(v, slot, "values")
        if value_heads != kv_heads or q.meta["val"].shape[1] % kv_heads:
            raise UnsupportedModelError(
                f"attention slot {slot}: {q.meta['val'].shape[1]} query heads over {kv_heads} key and "
                f"{value_heads} value heads is not grouped-query attention"
            )
        spec = SlotSpec(kv_heads, head_dim, value_dim)
        if mask in from_tokens and not masks_applied:
            raise UnsupportedModelError(
                f"attention slot {slot}: its mask is computed from the hidden states (a sparse-attention indexer "
                "or a learned position bias); the paged cache, which rebuilds masks from positions, cannot reproduce it"
            )
        specs[slot] = spec if mask in from_tokens else _reach(graph, mask, window, spec, slot)
    if sorted(specs) != list(range(len(specs))):
        raise UnsupportedModelError(f"attention slots {sorted(specs)} are not numbered 0..{len(specs) - 1}")
    return [specs[s] for s in range(len(specs))]


def indexer_key_slots(graph: fx.Graph) -> list[SlotSpec]:
    """Per ``afdc::cached_keys`` slot (a sparse-attention indexer's key cache), its keys as a
    one-head slot with no values: ``[b, s, d]`` keys per call. ``graph`` carries shapes."""
    specs: dict[int, SlotSpec] = {}
    for node in graph.find_nodes(op="call_function", target=torch.ops.afdc.cached_keys.default):
        keys, slot = node.args[:2]
        shape = keys.meta["val"].shape
        if len(shape) != 3 or not isinstance(shape[2], int):
            raise UnsupportedModelError(f"indexer key slot {slot}: keys of shape {tuple(shape)}, not [b, s, d]")
        if slot in specs:
            raise UnsupportedModelError(f"indexer key slot {slot} is used by two calls; a paged cache needs one each")
        specs[slot] = SlotSpec(kv_heads=1, head_dim=shape[2], value_dim=0)
    if sorted(specs) != list(range(len(specs))):
        raise UnsupportedModelError(f"indexer key slots {sorted(specs)} are not numbered 0..{len(specs) - 1}")
    return [specs[s] for s in range(len(specs))]


def program_slots(module: fx.GraphModule) -> tuple[list[SlotSpec], list[SlotSpec]]:
    """The paged-cache slots of an attention program (its attention calls', its sparse-attention
    indexers'), found on a fake-tensor run over a few tokens (past keys included), since a loaded
    program's graph carries no shapes. With indexers the program's masks are its own to apply
    (:class:`afdc.runtime.paged.PagedRows`); per TP rank under ``--attn-tp`` (one shard's heads).
    A program whose every attention is a stateful mixer's (DeepSeek-V4's) has no slots."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        inputs = (torch.zeros(1, 3, dtype=torch.long), torch.ones(1, 5, dtype=torch.long), torch.arange(2, 5)[None])
    FakeTensorProp(module, mode).propagate(*inputs)
    keys = indexer_key_slots(module.graph)
    if not AttentionCall.all_in(module.graph) and MixerCall.all_in(module.graph):
        _check_incremental(module.graph)
        return [], keys
    return attention_slots(module.graph, masks_applied=bool(keys)), keys


def _check_incremental(graph: fx.Graph) -> None:
    if key_length_tied(graph):
        raise UnsupportedModelError(
            "the graph ties the key length to the token count (captured non-incremental: decode "
            "recomputes the prefix), so it keeps state outside the KV cache that paging cannot hold"
        )


def _concrete(node: fx.Node, slot: int, what: str) -> tuple[int, int]:
    heads, dim = node.meta["val"].shape[1], node.meta["val"].shape[3]
    if not isinstance(heads, int) or not isinstance(dim, int):
        raise UnsupportedModelError(f"attention slot {slot}: the {what}' head count or size is not fixed")
    return heads, dim


def _reach(graph: fx.Graph, mask: fx.Node | None, window: int, spec: SlotSpec, slot: int) -> SlotSpec:
    """``spec`` with the window the call's mask applies, found by running the mask's computation
    for 3 queries at the end of ``2 * window + 3`` keys, where causal, sliding-window and chunked
    masks all differ (for ``window >= 2``; at 1 the last two coincide)."""
    if mask is None:  # the op's default: causal with the queries at the end
        return spec
    kv = 2 * window + 3
    q_pos, k_pos = torch.arange(kv - 3, kv)[:, None], torch.arange(kv)
    try:
        allowed = _run_mask(graph, mask, q_pos.shape[0], kv)
    except Exception as err:
        raise UnsupportedModelError(f"attention slot {slot}: could not evaluate its mask ({err})") from err
    if allowed.dtype != torch.bool:
        allowed = allowed == 0  # additive: 0 attends, a large negative value does not
    candidates = [replace(spec, window=window), replace(spec, window=window, chunked=True)] if window else []
    for candidate in [*candidates, spec]:
        if bool((allowed.cpu() == candidate.allowed(q_pos, k_pos)).all()):
            return candidate
    raise UnsupportedModelError(
        f"attention slot {slot}: its mask is neither causal nor a sliding window or chunk of {window} "
        "over positions; the paged cache, which ignores the graph's mask, cannot reproduce it"
    )


def _token_dependent(graph: fx.Graph) -> set[fx.Node]:
    """The nodes whose values depend on the tokens themselves, not only on their count."""
    free = gf.data_free(graph)
    dependent: set[fx.Node] = set()
    for node in graph.nodes:
        is_tokens = node.op == "placeholder" and node.target == "input_ids"
        if node not in free and (is_tokens or any(i in dependent for i in node.all_input_nodes)):
            dependent.add(node)
    return dependent


def _run_mask(graph: fx.Graph, mask: fx.Node, queries: int, keys: int) -> torch.Tensor:
    """Evaluate the nodes ``mask`` depends on for one unpadded row of ``queries`` tokens at the
    end of ``keys`` positions."""
    needed, stack = set(), [mask]
    while stack:
        node = stack.pop()
        if node not in needed:
            needed.add(node)
            stack.extend(node.all_input_nodes)
    sub, env = fx.Graph(), {}
    for node in graph.nodes:
        if node in needed:
            env[node] = sub.node_copy(node, env.__getitem__)
    sub.output(env[mask])
    device = next(iter(graph.find_nodes(op="placeholder"))).meta["val"].device
    device = torch.device("cpu") if device.type == "meta" else device
    inputs = {
        "input_ids": torch.zeros(1, queries, dtype=torch.long, device=device),
        "attention_mask": torch.ones(1, keys, dtype=torch.long, device=device),
        "position_ids": torch.arange(keys - queries, keys, device=device)[None],
    }
    module = fx.GraphModule(graph.owning_module or torch.nn.Module(), sub)
    return module(*(inputs[n.target] for n in sub.find_nodes(op="placeholder")))
