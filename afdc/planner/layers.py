"""Decoder layers that compute the same function, so that one capture can stand for many.

Capturing a model costs time in proportion to its layers, while a 61-layer model usually has two
or three distinct layers (dense and MoE, sliding and full attention). Two layers are taken to
compute the same function when their structural signatures are equal: the module tree, every
parameter and buffer's name, shape and dtype, every plain attribute of every submodule except
those that only carry the layer's position (``layer_idx``), and the per-layer entries of the
config (``layer_types[i]``), which some forwards read by position instead of through the layer.

:func:`layer_pattern` picks the shortest prefix of the layer list that holds every distinct
layer twice (once if it occurs once): the model is captured with only that prefix, whose layers
keep their own positions, so every per-position lookup in the forward still sees the right
entry. The second copy is a check: a forward that treats layers differently by position alone
(which no signature sees) makes the two copies cost differently, and :class:`LayerPattern`
refuses to extrapolate. Whatever is refused here is planned from the full capture instead.
"""

from __future__ import annotations

import contextlib
import enum
import functools
import types
from collections import defaultdict
from collections.abc import Callable, Hashable, Iterable, Iterator
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch import nn

from afdc.errors import AfdcError

# What every nn.Module carries (parameters, hooks, ...): compared through the module tree instead
_MODULE_INTERNALS = frozenset(vars(nn.Module()))
_PLAIN = (type(None), bool, int, float, complex, str, bytes, enum.Enum)


class LayerMismatch(AfdcError):
    """Layers taken to be identical cost differently in the capture, or a cost cannot be
    attributed to a layer: the prefix capture cannot stand for the whole model."""


@dataclass(frozen=True)
class LayerPattern:
    """Which layers of a model's decoder layer list are identical, and the prefix captured.

    ``first[j]`` is the first layer with layer ``j``'s signature; the capture holds layers
    ``0 .. prefix - 1``, and layer ``j >= prefix`` costs what layer ``first[j]`` costs there.
    """

    path: str  # the layer list's module path, e.g. "model.layers"
    first: tuple[int, ...]
    prefix: int

    @property
    def count(self) -> int:
        return len(self.first)

    def layer_of(self, name: str) -> int | None:
        """The layer a module path or parameter name lies in (None: outside the layer list)."""
        head, _, rest = name.partition(self.path + ".")
        if head or not rest:
            return None
        index = rest.split(".", 1)[0]
        return int(index) if index.isdigit() else None

    def layer_of_node(self, node: fx.Node) -> int | None:
        """The layer whose forward emitted ``node``; LayerMismatch when export recorded no module."""
        stack = node.meta.get("nn_module_stack")
        if not stack:
            raise LayerMismatch(f"{node.name} has no module stack: its layer is unknown")
        for path, _ in stack.values():
            index = self.layer_of(path)
            if index is not None:
                return index
        return None

    def _by_layer(self, items: Iterable, owners: Iterable[int | None], compare: Callable) -> dict[int, list]:
        """The prefix's items grouped by layer, after checking that layers with one signature
        have equal items (by ``compare``)."""
        grouped: dict[int, list] = defaultdict(list)
        for item, owner in zip(items, owners):
            if owner is not None:
                grouped[owner].append(item)
        for i in range(self.prefix):
            if [compare(x) for x in grouped[i]] != [compare(x) for x in grouped[self.first[i]]]:
                raise LayerMismatch(f"layers {self.first[i]} and {i} have one signature but cost differently")
        return grouped

    def expand(self, items: list, owners: list[int | None], compare: Callable = lambda x: x) -> list:
        """The whole model's per-layer list from the prefix capture's (in layer order, every item
        in a layer): the items of layer ``first[j]`` stand for each layer ``j`` past the prefix."""
        if None in owners or owners != sorted(owners):
            raise LayerMismatch("a per-layer cost lies outside the layer list or out of layer order")
        grouped = self._by_layer(items, owners, compare)
        return list(items) + [x for j in range(self.prefix, self.count) for x in grouped[self.first[j]]]

    def total(self, prefix_total: float, parts: Iterable[tuple[int | None, float]]) -> float:
        """The whole model's sum from the prefix capture's ``prefix_total`` and the ``(layer, value)``
        parts it is the sum of (layer None: outside the layer list, counted once)."""
        parts = list(parts)
        if sum(v for _, v in parts) != prefix_total:
            raise LayerMismatch(f"the parts of a total ({prefix_total}) do not add up to it")
        grouped = self._by_layer([v for _, v in parts], [o for o, _ in parts], lambda x: x)
        return prefix_total + sum(sum(grouped[self.first[j]]) for j in range(self.prefix, self.count))


def decoder_layers(model: nn.Module) -> tuple[str, nn.ModuleList] | None:
    """The module list holding the decoder layers: of the lists as long as the config's
    ``num_hidden_layers``, the one holding the most parameters (an expert list nested in a layer
    holds fewer than the layers around it)."""
    n = getattr(model.config.get_text_config(), "num_hidden_layers", None)
    lists = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m) == n]
    if not n or not lists:
        return None
    return max(lists, key=lambda item: sum(p.numel() for p in item[1].parameters()))


def _value_key(value, owner: nn.Module) -> Hashable:
    """A comparable stand-in for an attribute's value. Objects the signature cannot look into
    compare by identity: one shared by every layer (the config) keeps layers equal; one per
    layer makes every layer distinct, which only costs speed."""
    if isinstance(value, _PLAIN):
        return (type(value), value)
    if isinstance(value, (tuple, list)):
        return (type(value), tuple(_value_key(v, owner) for v in value))
    if isinstance(value, dict):
        return (dict, tuple((_value_key(k, owner), _value_key(v, owner)) for k, v in value.items()))
    if isinstance(value, torch.Tensor):
        return (torch.Tensor, tuple(value.shape), value.dtype)
    if isinstance(value, (torch.dtype, torch.device)):
        return str(value)
    if isinstance(value, types.MethodType) and value.__self__ is owner:
        return (types.MethodType, value.__func__)
    if isinstance(value, functools.partial):  # activations bind their options per instance
        return (functools.partial, _value_key(value.func, owner), _value_key((value.args, value.keywords), owner))
    return ("object", id(value))


def _attributes(layer: nn.Module) -> Iterator[tuple[tuple[str, str], object, nn.Module]]:
    """``((submodule path, attribute), value, submodule)`` for the plain attributes of the layer's modules."""
    for name, module in layer.named_modules(remove_duplicate=False):
        for attr, value in vars(module).items():
            if attr not in _MODULE_INTERNALS:
                yield (name, attr), value, module


def _position_attributes(layers: list[nn.Module]) -> set[tuple[str, str]]:
    """Integer attributes equal to the layer's position plus one constant wherever they occur,
    at least twice (``layer_idx``, ``layer_number``; a hybrid keeps it in a different submodule
    per layer kind): they tell layers apart without changing what they compute."""
    offsets: dict[tuple[str, str], set[int]] = defaultdict(set)
    occurrences: dict[tuple[str, str], int] = defaultdict(int)
    for i, layer in enumerate(layers):
        for key, value, _ in _attributes(layer):
            if type(value) is int:
                offsets[key].add(value - i)
                occurrences[key] += 1
    return {key for key, found in offsets.items() if len(found) == 1 and occurrences[key] >= 2}


def _config_entries(config, n: int) -> list[tuple[str, object]]:
    """Config fields that hold one entry per layer (``layer_types``), and lists of layer indices
    (``mlp_only_layers``)."""
    fields = []
    for name, value in vars(config).items():
        if not isinstance(value, (list, tuple)):
            continue
        if len(value) == n:
            fields.append((name, "per layer"))
        elif "layer" in name and all(type(v) is int and 0 <= v < n for v in value):
            fields.append((name, "indices"))
    return fields


def _signature(layer: nn.Module, i: int, skip: set[tuple[str, str]], config, entries) -> Hashable:
    tree = []
    for name, module in layer.named_modules(remove_duplicate=False):
        tree.append((name, type(module).__module__, type(module).__qualname__))
        for kind in ("_parameters", "_buffers"):
            for tname, t in getattr(module, kind).items():
                tree.append((name, kind, tname, None if t is None else (tuple(t.shape), t.dtype)))
    attrs = tuple((key, _value_key(value, module)) for key, value, module in _attributes(layer) if key not in skip)
    config_part = tuple(
        (field, getattr(config, field)[i] if kind == "per layer" else i in getattr(config, field))
        for field, kind in entries
    )
    return tuple(tree), attrs, config_part


def layer_pattern(model: nn.Module) -> LayerPattern | None:
    """The model's identical layers and the prefix to capture; None when the layer list cannot
    be found or no shorter prefix would do."""
    found = decoder_layers(model)
    if found is None:
        return None
    path, layer_list = found
    layers = list(layer_list)
    n = len(layers)
    config = model.config.get_text_config()
    skip, entries = _position_attributes(layers), _config_entries(config, n)
    signatures = [_signature(layer, i, skip, config, entries) for i, layer in enumerate(layers)]
    seen: dict[Hashable, list[int]] = defaultdict(list)
    for i, sig in enumerate(signatures):
        seen[sig].append(i)
    prefix = 1 + max(members[min(1, len(members) - 1)] for members in seen.values())
    if prefix >= n:
        return None
    return LayerPattern(path, tuple(seen[sig][0] for sig in signatures), prefix)


@contextlib.contextmanager
def captured_prefix(model: nn.Module, pattern: LayerPattern) -> Iterator[None]:
    """Hold only the pattern's prefix in the model's layer list for the duration (the config
    keeps its layer count: forwards slice ``layers[:num_hidden_layers]`` and index per-layer
    config entries by position, both right for a prefix)."""
    parent_path, _, name = pattern.path.rpartition(".")
    parent = model.get_submodule(parent_path)
    full = getattr(parent, name)
    setattr(parent, name, full[: pattern.prefix])
    try:
        yield
    finally:
        setattr(parent, name, full)
