"""Capture: the export attempts, most polymorphic first, until one gives a graph; each module type
found asking the stand-in cache for state is made a mixer op, and the attempts start again."""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from afdc.capture.attention_hooks import afdc_attention
from afdc.capture.canonical import canonical_names, to_get_attr_graph, unwrap_module_stack
from afdc.capture.captured import NO_POSITIONS, ONE_LENGTH, TIED, CapturedGraph, key_length_tied
from afdc.capture.expert_loops import as_grouped_experts
from afdc.capture.export import Specialized, export_forward, relaxed_limit, takes_positions
from afdc.capture.mixer_discovery import as_mixer_ops, token_mixer
from afdc.capture.outside_state import state_outside_cache
from afdc.capture.session import CaptureSession
from afdc.capture.standin_cache import WRAPPED, StatefulMixer, cache_argument
from afdc.errors import UnsupportedModelError


def capture(model: PreTrainedModel, functional: bool = False) -> CapturedGraph:
    """Capture ``model``'s forward; raises :class:`UnsupportedModelError` when it cannot.

    The graph is captured shape-polymorphic when possible: strictly first, then relaxed (see
    :func:`~afdc.capture.export.relaxed_limit`). Some mixers tie the mask length to the token
    count (then decode recomputes the prefix); some hold for too few lengths (the graph is still
    returned, so that classification can say what the model is; :attr:`CapturedGraph.specialized`
    says why).

    ``functional=True`` retraces the graph without in-place ops (slow on big models; needed
    only when a cut would separate an in-place write from its readers, see ``passes.aliasing``).
    """
    model.eval()
    argument = cache_argument(model)
    mixers: set[type] = set()
    with afdc_attention(model), torch.no_grad(), as_grouped_experts(model) as views:
        while True:  # each module type found asking the cache for state is made a mixer op, then again
            try:
                with as_mixer_ops(model, mixers):
                    captured = _capture(model, functional, argument, with_mixers=bool(mixers))
                break
            except StatefulMixer as found:
                mixer = token_mixer(found.module, model) if found.module is not None else None
                if mixer is None or type(mixer) in mixers or _contains_layers(mixer, model):
                    raise UnsupportedModelError(
                        f"the forward reads per-layer cache state outside a token mixer ({found})"
                    ) from None
                mixers.add(type(mixer))
    captured.views = views
    if captured.specialized:
        captured.state_outside_cache = state_outside_cache(model)
    return captured


def _contains_layers(module: torch.nn.Module, model: PreTrainedModel) -> bool:
    """Whether ``module`` is the model or its backbone (not one layer's mixer)."""
    return module is model or module is model.base_model


def _capture(model: PreTrainedModel, functional: bool, argument: str | None, with_mixers: bool) -> CapturedGraph:
    errors = []
    # with the stand-in cache first; a forward that wants more of a cache than mixers found so far
    # is captured without it (its cache positions then start at 0 in every call)
    caches = (argument,) if with_mixers else (argument, None) if argument else (None,)
    attempts = [(mode, cache) for mode in ("incremental", "relaxed", "static") for cache in caches]
    for mode, cache in attempts:
        traced = CaptureSession()
        try:
            ep = export_forward(model, mode, functional, cache, traced)
        except (UnsupportedModelError, StatefulMixer):
            raise
        except Exception as err:
            if isinstance(err.__cause__, StatefulMixer):  # export re-raised what the stand-in raised
                raise err.__cause__ from None
            errors.append(f"{mode}: {(str(err).splitlines() or [type(err).__name__])[0]}")
            continue
        captured = _captured(ep, mode, model, "; ".join(errors), WRAPPED if cache else "")
        captured.mixers = traced.mixer_sites
        return captured
    raise UnsupportedModelError("torch.export could not capture the forward: " + "; ".join(errors))


def _captured(
    ep: torch.export.ExportedProgram, mode: str, model: PreTrainedModel, errors: str, prefix: str
) -> CapturedGraph:
    """The graph of an export in ``mode``, its tensors named without ``prefix``. A relaxed export
    whose guards fail short of the model's context is kept as a specialized graph: classifying it
    says what the model is (re-exporting statically would say the same, slower)."""
    unwrap_module_stack(ep.graph, prefix)
    canonical = canonical_names(model)
    unwrapped = {name: name.removeprefix(prefix) for name in (*ep.state_dict, *ep.constants)}
    names = {name: canonical.get(bare, bare) for name, bare in unwrapped.items()}
    if mode == "static":
        return to_get_attr_graph(ep, names, ONE_LENGTH, specialized=errors)
    try:
        limit = relaxed_limit(ep, _context_length(model)) if mode == "relaxed" else None
    except Specialized as err:
        return to_get_attr_graph(ep, names, ONE_LENGTH, specialized=str(err))
    captured = to_get_attr_graph(ep, names, "", max_positions=limit)
    if not takes_positions(model):
        captured.recompute = NO_POSITIONS
    elif key_length_tied(captured.graph):
        captured.recompute = TIED
    return captured


def _context_length(model: PreTrainedModel) -> int | None:
    return getattr(model.config.get_text_config(), "max_position_embeddings", None)
