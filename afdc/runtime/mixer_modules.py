"""The attention program's stateful mixers: each ``afdc::mixer`` call site run with the model's own code.

A call runs the module the site names (:class:`afdc.mixer_site.MixerSite`) with the weights the op
passes (``torch.func.functional_call``), handing it the cache the model's forward would build (a
cache class of the model's own where its modeling code defines one, as MiniMax's; else
transformers' ``DynamicCache`` from the config): the module reads and writes its own layer's
convolution window and recurrent state there, by its own code, for prefill (any number of
tokens) and decode alike. The active KV cache keeps that cache per sequence batch, so its rows
stay those of the KV cache; with none active a call starts from an empty state (prefill from
scratch, as the model's call without a cache).
"""

from __future__ import annotations

import copy
import functools
import inspect
import sys
import threading
from dataclasses import replace

import torch
from accelerate import init_empty_weights
from transformers import Cache, DynamicCache, PretrainedConfig

from afdc import model_class
from afdc.errors import AfdcError
from afdc.mixer_site import MixerSite, StateTensor
from afdc.ops.context import current_cache
from afdc.runtime.bounded_state import BoundedState
from afdc.runtime.quantized_linears import with_quantized_linears


class Mixers:
    """The ``afdc::mixer`` call sites of one attention program, by slot, and their modules."""

    def __init__(self, sites: list[MixerSite], modules: dict[int, torch.nn.Module], config: PretrainedConfig):
        self.sites = {s.slot: s for s in sites}
        self.modules = modules
        self.config = config
        cache_class = _cache_class(next(iter(modules.values()))) if modules else DynamicCache
        takes_config = "config" in inspect.signature(cache_class).parameters
        self._new_cache = functools.partial(cache_class, config=config) if takes_config else cache_class
        self._blank: Cache | None = None  # its layers never run: copied fresh for each call
        self._bounded: dict[int, BoundedState] = {}  # growing states held in fixed tensors (serving)
        self._lock = threading.Lock()

    @classmethod
    def from_config(cls, sites: list[MixerSite], config: PretrainedConfig) -> Mixers:
        """``sites`` run by modules rebuilt from the model's ``config`` on the meta device: a call
        passes the weights, the module brings only its code (an artifact's attention rank); its
        linears on weights stored quantized run afdc's quantized ops (:mod:`afdc.runtime.quantized_linears`)."""
        with init_empty_weights(include_buffers=True):
            model = model_class.from_config(config)
        return cls(sites, {s.slot: with_quantized_linears(model.get_submodule(s.module), s.linears) for s in sites},
                   config)

    def __bool__(self) -> bool:
        return bool(self.sites)

    def bound(self, max_len: int, dtype: torch.dtype) -> list[MixerSite]:
        """The sites, each whose state grows with the sequence given fixed state tensors that hold
        it for sequences of up to ``max_len`` tokens (:mod:`afdc.runtime.bounded_state`), which
        :meth:`reset` and :meth:`read` then take and give."""
        out = []
        for slot, site in sorted(self.sites.items()):
            if not site.fixed_state:
                layer = self._blank_layer(site.layer)
                self._bounded[slot] = BoundedState(self.modules[slot], layer, max_len, dtype)
                site = replace(site, state=self._bounded[slot].tensors)
            out.append(site)
        return out

    def new_state(self) -> Cache:
        """An empty per-sequence-batch state, as the model's forward makes its cache."""
        return self._new_cache()

    def mix(self, slot: int, hidden: torch.Tensor, mask: torch.Tensor | None, weights: list[torch.Tensor]):
        """The ``afdc::mixer`` entry point: the active cache hands each group of its sequences
        to :meth:`run` with their state (none active: one group, from an empty state)."""
        run = functools.partial(self.run, slot, weights)
        cache = current_cache()
        if cache is None:
            return run(hidden, mask, self.new_state())
        if not hasattr(cache, "run_mixer"):
            raise AfdcError(f"{type(cache).__name__} keeps no state for the stateful mixer {self.sites[slot].module}")
        return cache.run_mixer(self, slot, hidden, mask, run)

    def run(
        self, slot: int, weights: list[torch.Tensor], hidden: torch.Tensor, mask: torch.Tensor | None, state,
        rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Site ``slot``'s module over ``hidden [b, s, d]``, reading and extending ``state`` (a
        transformers cache whose layer :attr:`MixerSite.layer` holds these sequences' state);
        ``rows``: ``hidden`` is these rows of the call's batch, whose inputs are cut to them."""
        site, module = self.sites[slot], self.modules[slot]
        arguments = dict(site.constants)
        arguments[site.cache_argument] = state
        if site.mask_argument is not None:
            # a single decoded token is never padding: where transformers' recurrent mask is None
            # (no padding), a mask of ones, as GLM-5 Next's model gives its indexer, which always reads it
            if mask is None or hidden.shape[1] == 1:
                mask = torch.ones(hidden.shape[:2], dtype=torch.bool, device=hidden.device)
            arguments[site.mask_argument] = mask
        if site.inputs:
            given = weights[len(site.weights):]
            if rows is not None:
                given = [t[rows] for t in given]
            if any(map(_is_mask, given)):  # only attention layers of the cache size their keys
                keys = _held_keys(state, site.layer, hidden.shape[1])
                given = [_as_additive(t, keys, hidden.dtype) if _is_mask(t) else t for t in given]
            arguments.update(_nest(dict(zip(site.inputs, given))))
        params = dict(zip(site.weights, weights))
        # functional_call swaps the weights into the shared module and back: micro-batch threads
        # take turns (one would otherwise run on another's restored, e.g. meta, weights)
        with self._lock:
            out = torch.func.functional_call(module, params, (hidden,), arguments, strict=True)
        if isinstance(out, tuple):
            out = out[0]
        if out.shape != hidden.shape:
            raise AfdcError(f"the stateful mixer {site.module} returned {tuple(out.shape)} for {tuple(hidden.shape)}")
        return out

    def reset(self, state, slot: int, tensors: list[torch.Tensor] | None = None, tokens: int = 0) -> None:
        """Give ``state`` a fresh layer for site ``slot``, holding ``tensors`` (the site's state
        of some sequences, in :attr:`MixerSite.state` order, as if they had run before; a state
        held in bounded tensors: as if they had run ``tokens`` tokens) or empty. One cache can
        then serve every site of a step, each call starting from what it is given, however
        often the step is run."""
        site = self.sites[slot]
        values = list(tensors) if tensors is not None else [None] * len(site.state)
        if slot in self._bounded or any(_field(spec) is None for spec in site.state):
            layer = state.layers[site.layer] = copy.deepcopy(self._blank_layer(site.layer))
        if slot in self._bounded:
            if tensors is not None:
                self._bounded[slot].unpack(layer, values, tokens)
            return
        for spec, t in zip(site.state, values):
            field = _field(spec)
            if field is not None:  # a per-layer list of the cache class's own: None is "not run yet"
                held = getattr(state, field)
                held.extend([None] * (site.layer + 1 - len(held)))
                held[site.layer] = t
            elif t is not None:
                kind, index = _kind_index(spec)
                layer.lazy_initialization(**{f"{kind}_states": t}, state_idx=index)
                getattr(layer, f"{kind}_states")[index].copy_(t)
                layer.has_previous_state[index] = True

    def read(self, state, slot: int) -> list[torch.Tensor]:
        """Site ``slot``'s state in ``state``, in :attr:`MixerSite.state` order."""
        site = self.sites[slot]
        if slot in self._bounded:
            return self._bounded[slot].pack(state.layers[site.layer])
        out = []
        for spec in site.state:
            field = _field(spec)
            if field is not None:
                out.append(getattr(state, field)[site.layer])
            else:
                kind, index = _kind_index(spec)
                out.append(getattr(state.layers[site.layer], f"{kind}_states")[index])
        return out

    def _blank_layer(self, layer: int):
        if self._blank is None:
            self._blank = self.new_state()
        return self._blank.layers[layer]

    def probe(self) -> list[MixerSite]:
        """Each site with its per-sequence state (and the cache layer holding it), found by
        running its module, with its own weights, once over two tokens of one sequence."""
        out = []
        for slot, site in sorted(self.sites.items()):
            if not site.fixed_state:  # its state grows with the sequence: no fixed shape to find
                out.append(site)
                continue
            module, state = self.modules[slot], self.new_state()
            weight = next(iter(module.parameters()), None)
            hidden = torch.zeros(
                1, 2, site.width or self.config.get_text_config().hidden_size,
                dtype=weight.dtype if weight is not None else torch.float32,
                device=weight.device if weight is not None else None,
            )
            mask = {} if site.mask_argument is None else {site.mask_argument: None}
            with torch.no_grad():
                module(hidden, **dict(site.constants), **mask, **{site.cache_argument: state})
            layer, tensors = _state_of(state)
            out.append(MixerSite(**{**site.__dict__, "layer": layer, "state": tuple(tensors)}))
        return out


def _is_mask(t: torch.Tensor) -> bool:
    return t.dtype == torch.bool and t.dim() == 4


def _held_keys(state: Cache, layer: int | None, queries: int) -> int | None:
    """How many keys the mixer's cache layer will attend over for ``queries`` new tokens (its
    sliding window's, as transformers sizes masks); None: every key of the sequence."""
    if layer is None or layer >= len(state.layers):
        return None
    return state.layers[layer].get_mask_sizes(queries)[0]


def _as_additive(mask: torch.Tensor, keys: int | None, dtype: torch.dtype) -> torch.Tensor:
    """The graph's boolean mask over all of a sequence's keys as the module's own eager attention
    takes it: additive, over the last ``keys`` keys (those its cache layer holds)."""
    if keys is not None:
        mask = mask[..., -keys:]
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, torch.finfo(dtype).min)


def _nest(flat: dict[str, torch.Tensor]) -> dict:
    """Arguments from :attr:`MixerSite.inputs` paths: ``a/k/0`` is ``a["k"][0]`` (all-digit keys
    make a tuple)."""
    out: dict = {}
    for path, value in flat.items():
        node, *keys = path.split("/")
        out.setdefault(node, []).append((keys, value))
    return {name: _build(items) for name, items in out.items()}


def _build(items: list) -> object:
    if len(items) == 1 and not items[0][0]:
        return items[0][1]
    groups: dict[str, list] = {}
    for (key, *rest), value in items:
        groups.setdefault(key, []).append((rest, value))
    built = {key: _build(group) for key, group in groups.items()}
    if all(key.isdigit() for key in built):
        return tuple(built[key] for key in sorted(built, key=int))
    return built


def _kind_index(spec: StateTensor) -> tuple[str, int]:
    kind, index = spec.name.split(".")
    return kind, int(index)


def _field(spec: StateTensor) -> str | None:
    """The cache-class field (a per-layer list) that holds ``spec``, named ``@field``; None for
    transformers' cache-layer states (``conv.0``, ``recurrent.0``)."""
    return spec.name[1:] if spec.name.startswith("@") else None


def _cache_class(module: torch.nn.Module) -> type[Cache]:
    """The cache class a model's forward builds: one its own modeling module defines, else
    transformers' ``DynamicCache``."""
    name = type(module).__module__
    own = [
        c for c in vars(sys.modules[name]).values()
        if inspect.isclass(c) and issubclass(c, Cache) and c.__module__ == name
    ]
    return own[0] if len(own) == 1 else DynamicCache


def _state_tensor(name: str, t: torch.Tensor) -> StateTensor:
    return StateTensor(name, tuple(t.shape[1:]), str(t.dtype).removeprefix("torch."))


def _state_of(cache: Cache) -> tuple[int | None, list[StateTensor]]:
    """The layer of ``cache`` holding state after one mixer call, and its tensors per sequence:
    in a transformers cache layer, or in a per-layer list field of the model's own cache class."""
    for index, layer in enumerate(cache.layers):
        tensors = [
            _state_tensor(f"{kind}.{i}", t)
            for kind in ("conv", "recurrent")
            for i, t in (getattr(layer, f"{kind}_states", None) or {}).items()
            if isinstance(t, torch.Tensor)
        ]
        if tensors:
            return index, tensors
    fields = {name: held for name, held in vars(cache).items() if name != "layers" and isinstance(held, list)}
    for field, held in fields.items():
        for index, t in enumerate(held):
            if isinstance(t, torch.Tensor):
                return index, [_state_tensor(f"@{field}", t)]
    return None, []
