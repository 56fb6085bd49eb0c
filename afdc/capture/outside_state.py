"""Per-sequence state a forward keeps where transformers' cache API does not hold it: what the
refusal of a specialized capture names, since afdc finds no mixer to keep that state per sequence."""

from __future__ import annotations

import torch
from transformers import PreTrainedModel


def state_outside_cache(model: PreTrainedModel) -> str:
    """Where the forward keeps per-sequence state that transformers' per-layer cache API does not
    hold ("": nowhere found): tensors it sets on its own modules, or in fields of its own cache
    class beside the cache layers. Found by running it once over two tokens with a cache."""
    if any(p.is_meta for p in model.parameters()):
        return ""
    modules = [m for _, m in model.named_modules()]
    before = [_tensor_fields(m) for m in modules]
    ids = torch.zeros(1, 2, dtype=torch.long, device=next(model.parameters()).device)
    try:
        with torch.no_grad():
            out = model(input_ids=ids, use_cache=True)
    except Exception:  # a forward that cannot run this way tells nothing here
        return ""
    set_on_modules = sorted(
        f"{type(m).__name__}.{name}"
        for m, held in zip(modules, before)
        for name, ids_now in _tensor_fields(m).items()
        if held.get(name) != ids_now
    )
    cache = getattr(out, "past_key_values", None)
    in_cache = sorted(f"{type(cache).__name__}.{name}" for name in _tensor_fields(cache) if name != "layers")
    where = [f"{', '.join(set_on_modules)} (module attributes)"] if set_on_modules else []
    where += [f"{', '.join(in_cache)} (the model's own cache class)"] if in_cache else []
    return "; ".join(where)


def _tensor_fields(obj) -> dict[str, tuple[int, ...]]:
    """``obj``'s public instance fields holding tensors (alone or in a list, tuple or dict), with
    the ids of those tensors (a field set again holds new ones). A module's parameters and buffers
    are in its private fields: a buffer a forward recomputes (a dynamic RoPE's) is not state."""
    fields = {}
    for name, value in vars(obj).items() if obj is not None else ():
        if name.startswith("_"):
            continue
        items = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else [value]
        tensors = tuple(id(t) for t in items if isinstance(t, torch.Tensor))
        if tensors:
            fields[name] = tensors
    return fields
