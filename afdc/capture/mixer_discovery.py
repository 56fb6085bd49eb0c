"""Stateful mixers made opaque: each module found asking the stand-in cache for per-layer state is
called as one ``afdc::mixer`` op (:mod:`afdc.mixer_site`), whose Python loops then stay out of the graph.

Each call site traced is recorded as a :class:`MixerSite` in the session of the stand-in cache the
mixer was called with.
"""

from __future__ import annotations

import contextlib
import dis
import functools
import inspect
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.utils._pytree as pytree
from transformers import PreTrainedModel

from afdc import ops
from afdc.capture.standin_cache import CacheLength
from afdc.errors import UnsupportedModelError
from afdc.mixer_site import MixerSite


def _mixer_forward(module: torch.nn.Module, path: str, original, *args, **kwargs) -> torch.Tensor:
    """What a stateful mixer's ``forward`` is during capture: one ``afdc::mixer`` op.

    The op takes the hidden states (the first argument), the 2-D padding mask (the first 2-D tensor
    argument named a mask, if any), the module's weights and its other tensor arguments (alone or
    in dicts and tuples); the cache argument is left to the runtime, other arguments are recorded
    as they were traced. Arguments the forward's code never reads (what a
    decoder layer hands every mixer alike: position embeddings, ``**kwargs``) are passed as None."""
    signature = inspect.signature(original)
    arguments = dict(signature.bind(*args, **kwargs).arguments)
    read = _names_read(original)
    for name, p in signature.parameters.items():
        extras = arguments.pop(name, {}) if p.kind is inspect.Parameter.VAR_KEYWORD else {}
        arguments.update(extras if name in read else {})
        if name in arguments and name not in read:
            arguments[name] = None
    (hidden_name, hidden), *rest = arguments.items()
    cache = [name for name, value in rest if isinstance(value, CacheLength)]
    if not cache:
        raise UnsupportedModelError(f"the stateful mixer {path} was called without the model's cache", path)
    if not isinstance(hidden, torch.Tensor):
        raise UnsupportedModelError(f"the stateful mixer {path} takes no hidden states first ({hidden_name})", path)
    # a 2-D tensor is taken for the padding mask only where the forward calls it a mask (position
    # ids are 2-D too); any other tensors, alone or in dicts and tuples, are passed as inputs
    mask_name = next((n for n, v in rest if isinstance(v, torch.Tensor) and v.dim() == 2 and "mask" in n), None)
    inputs = [
        (f"{name}{_path(keys)}", leaf)
        for name, value in rest
        if name not in cache and name != mask_name
        for keys, leaf in pytree.tree_flatten_with_path(value)[0]
        if isinstance(leaf, torch.Tensor)
    ]
    constants = []
    for name, value in rest:
        if name in cache or name == mask_name or _holds_tensors(value):
            continue
        if value is not None and not isinstance(value, (bool, int, float, str)):
            raise UnsupportedModelError(
                f"the stateful mixer {path} takes {name}={type(value).__name__}, which afdc cannot record", path
            )
        constants.append((name, value))
    weights = [*module.named_parameters(), *module.named_buffers()]
    sites = arguments[cache[0]].session.mixer_sites
    site = MixerSite(
        slot=len(sites),
        module=path,
        weights=tuple(name for name, _ in weights),
        cache_argument=cache[0],
        mask_argument=mask_name,
        constants=tuple(constants),
        width=int(hidden.shape[-1]),
        layer=getattr(module, "layer_idx", None) if inputs else None,
        inputs=tuple(name for name, _ in inputs),
    )
    sites.append(site)
    mask = arguments[mask_name] if mask_name is not None else None
    out = ops.mixer(hidden, mask, [t for _, t in weights] + [t for _, t in inputs], site.slot)
    # a forward returning (output, its state) to a caller that unpacks both (MiniMax's): unpacking
    # the op's one tensor instead would split it along the batch, pinning the batch size
    unpacked = _caller_unpacks()
    return (out, *[None] * (unpacked - 1)) if unpacked else out


def _path(keys) -> str:
    """A pytree key path as the ``/``-joined keys and indices :attr:`MixerSite.inputs` records."""
    return "".join(f"/{getattr(k, 'key', getattr(k, 'idx', k))}" for k in keys)


def _holds_tensors(value) -> bool:
    return any(isinstance(leaf, torch.Tensor) for leaf in pytree.tree_leaves(value))


def token_mixer(module: torch.nn.Module, model: PreTrainedModel) -> torch.nn.Module:
    """The token mixer of a decoder layer that holds ``module``: its child on the way down to
    ``module`` (the module itself where a layer's child asked, as a Mamba mixer does). A compressor
    inside an attention (DeepSeek-V4's) makes that attention the stateful mixer: what it returns
    is no branch of the residual stream, and the attention's keys live beside its state."""
    path = next((p for p, m in model.named_modules() if m is module), None)
    parts = path.split(".") if path else []
    layer = next((i for i, part in enumerate(parts) if part.isdigit()), None)
    if layer is None or layer + 2 >= len(parts):
        return module
    return model.get_submodule(".".join(parts[: layer + 2]))


def _caller_unpacks() -> int:
    """How many values the code that called the module being captured (the first frame outside
    torch and this module) unpacks from the call's result; 0 when it takes it whole."""
    frame = inspect.currentframe()
    skipped = (str(Path(torch.__file__).parent), __file__)
    while frame is not None and frame.f_code.co_filename.startswith(skipped):
        frame = frame.f_back
    if frame is None:
        return 0
    after = [i for i in dis.get_instructions(frame.f_code) if i.offset > frame.f_lasti and i.opname != "CACHE"]
    del frame
    return after[0].argval if after and after[0].opname == "UNPACK_SEQUENCE" else 0


def _names_read(function) -> set[str]:
    """The local names (arguments among them) that ``function``'s own code reads, decorators
    unwrapped; a name only a nested function reads counts too."""
    code = inspect.unwrap(getattr(function, "__func__", function)).__code__
    names: set[str] = set()
    for ins in dis.get_instructions(code):
        if ins.opname.startswith("LOAD_FAST") or ins.opname in ("LOAD_DEREF", "LOAD_CLOSURE", "MAKE_CELL"):
            names.update(ins.argval if isinstance(ins.argval, tuple) else (ins.argval,))
    return names


@contextlib.contextmanager
def as_mixer_ops(model: PreTrainedModel, classes: set[type]) -> Iterator[None]:
    """Every module of ``classes`` in ``model`` called as one ``afdc::mixer`` op."""
    wrapped = [(path, m) for path, m in model.named_modules() if type(m) in classes]
    for path, m in wrapped:
        m.forward = functools.partial(_mixer_forward, m, path, m.forward)
    try:
        yield
    finally:
        for _, m in wrapped:
            del m.forward
