"""The source checkpoint: its safetensors files, and how its tensors compose the model's.

A checkpoint's tensor names need not be the model's. transformers 5 saves MoE experts in the legacy
per-expert layout (``mlp.experts.3.gate_proj.weight``) while the module holds one stacked, fused
parameter (``mlp.experts.gate_up_proj``), and some model types rename keys. ``from_pretrained`` maps
them with the model's conversion mapping; we take the very same mapping and key matching
(``get_model_conversion_mapping``, ``rename_source_key``) but run the converters' operations on
*layouts* instead of tensors. A layout says which box of a target tensor each checkpoint tensor (or
part of one) fills, so a rank can read just the parts of the boxes that fall in its slice.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from transformers import PretrainedConfig, PreTrainedModel, core_model_loading
from transformers.conversion_mapping import get_model_conversion_mapping
from transformers.core_model_loading import (
    Chunk,
    Concatenate,
    ConversionOps,
    MergeModulelist,
    Transpose,
    WeightConverter,
    dot_natural_key,
)

from afdc.errors import AfdcError
from afdc.quant.scheme import checkpoint_renamer
from afdc.quant.stored import StoredTensor

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
EXPECTED = f"{SINGLE_NAME}, or model-0000x-of-0000y.safetensors shards with {INDEX_NAME}"

# The safetensors format's dtype codes.
DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "F8_E8M0": torch.float8_e8m0fnu,  # DeepSeek-V4's power-of-two fp8 block scales (scale_fmt ue8m0)
    "C64": torch.complex64,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U64": torch.uint64,
    "U32": torch.uint32,
    "U16": torch.uint16,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


class CheckpointError(AfdcError):
    """The source checkpoint is absent, incomplete, corrupt, or does not fit the model."""


# -- discovery -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SourceTensor:
    """A checkpoint entry as its file's header describes it."""

    file: Path
    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True)
class Checkpoint:
    """A safetensors checkpoint directory: its files and every tensor they hold (headers only)."""

    directory: Path
    files: tuple[Path, ...]
    tensors: dict[str, SourceTensor]

    @classmethod
    def discover(cls, directory: str | Path) -> Checkpoint:
        directory = Path(directory)
        files = _checkpoint_files(directory)
        tensors: dict[str, SourceTensor] = {}
        for path in files:
            for name, entry in _read_header(path).items():
                tensors.setdefault(name, entry)
        return cls(directory, tuple(files), tensors)

    def describe(self, limit: int = 4) -> str:
        """The files searched, for error messages."""
        names = [path.name for path in self.files]
        shown = ", ".join(names[:limit]) + (f", ... ({len(names)} files)" if len(names) > limit else "")
        return f"{self.directory} ({shown})"


def _checkpoint_files(directory: Path) -> list[Path]:
    if not directory.is_dir():
        raise CheckpointError(f"checkpoint directory {directory} does not exist; expected a directory with {EXPECTED}")
    index = directory / INDEX_NAME
    if index.is_file():
        try:
            shard_names = set(json.loads(index.read_text())["weight_map"].values())
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            raise CheckpointError(
                f"{index} is not a safetensors index (a JSON object with a 'weight_map'): {err}"
            ) from err
        files = [directory / name for name in sorted(shard_names)]
        absent = [path.name for path in files if not path.is_file()]
        if absent:
            raise CheckpointError(f"{index} lists shard files absent from {directory}: {', '.join(absent)}")
        return files
    if (directory / SINGLE_NAME).is_file():
        return [directory / SINGLE_NAME]
    found = ", ".join(sorted(path.name for path in directory.iterdir())[:8]) or "nothing"
    raise CheckpointError(f"no safetensors checkpoint in {directory}: expected {EXPECTED}; found {found}")


def _read_header(path: Path) -> dict[str, SourceTensor]:
    try:
        with safe_open(path, framework="pt") as handle:
            names = handle.keys()  # a list: safe_open handles are not iterable
            slices = {name: handle.get_slice(name) for name in names}
            entries = {name: (tuple(part.get_shape()), part.get_dtype()) for name, part in slices.items()}
    except (SafetensorError, OSError) as err:
        raise CheckpointError(f"{path}: not a readable safetensors file (truncated or corrupt?): {err}") from err
    unknown = {code for _, code in entries.values() if code not in DTYPES}
    if unknown:
        raise CheckpointError(f"{path}: tensors of dtype {', '.join(sorted(unknown))}, which afdc does not handle")
    return {name: SourceTensor(path, shape, DTYPES[code]) for name, (shape, code) in entries.items()}


class SourceReader:
    """Reads regions of checkpoint tensors, with one source file open at a time.

    ``safe_open`` maps the file and ``get_slice`` returns views of that mapping, so every page read
    stays resident (and counts in this process's RSS) until the mapping is closed. Re-opening the
    file after about ``REMAP_BYTES`` keeps the resident set bounded however large a shard is.
    Not thread-safe: use one reader per thread.
    """

    REMAP_BYTES = 256 << 20

    def __init__(self, checkpoint: Checkpoint):
        self._checkpoint = checkpoint
        self._path: Path | None = None
        self._handle: Any = None
        self._mapped = 0

    def read(self, key: str, index: tuple[slice, ...]) -> torch.Tensor:
        path = self._checkpoint.tensors[key].file
        try:
            if path != self._path or self._mapped > self.REMAP_BYTES:
                self.close()
                self._handle, self._path = safe_open(path, framework="pt"), path
            region = self._handle.get_slice(key)[index]
        except (SafetensorError, OSError) as err:  # e.g. the file changed since it was discovered
            raise CheckpointError(f"{path}: cannot read {key}: {err}") from err
        self._mapped += region.numel() * region.element_size()
        return region

    def close(self) -> None:
        self._handle, self._path, self._mapped = None, None, 0  # dropping the handle unmaps the file

    def __enter__(self) -> SourceReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# -- layouts ---------------------------------------------------------------------------------------


class _NotStreamable(Exception):
    """A conversion step that cannot be expressed as boxes of checkpoint tensors."""


class _Misfit(Exception):
    """Checkpoint tensors that do not fit together as the conversion needs (e.g. an expert missing)."""


def _put(values: tuple[int, ...], at: int, value: int) -> tuple[int, ...]:
    return (*values[:at], value, *values[at + 1 :])


@dataclass(frozen=True)
class Piece:
    """A region of one checkpoint tensor, placed as a box in a target tensor.

    ``axes[t]`` is the source axis that target axis ``t`` runs along, or None for an axis of extent 1
    added by stacking. The box starts at ``dst_start`` with extents ``shape``; the source region
    starts at ``src_start`` (one entry per source axis) with the same extents, in source axis order.
    """

    key: str
    axes: tuple[int | None, ...]
    src_start: tuple[int, ...]
    dst_start: tuple[int, ...]
    shape: tuple[int, ...]

    @classmethod
    def whole(cls, key: str, shape: tuple[int, ...]) -> Piece:
        zeros = (0,) * len(shape)
        return cls(key, tuple(range(len(shape))), zeros, zeros, shape)

    def source_index(self) -> tuple[slice, ...]:
        """The region to read, as an index into the source tensor."""
        extent = {axis: size for axis, size in zip(self.axes, self.shape) if axis is not None}
        return tuple(slice(start, start + extent[axis]) for axis, start in enumerate(self.src_start))

    def arrange(self, region: torch.Tensor) -> torch.Tensor:
        """The region as read from the source, laid out as this piece's box (a view where possible)."""
        return region.permute([axis for axis in self.axes if axis is not None]).reshape(self.shape)

    def stacked(self, dim: int, index: int) -> Piece:
        def insert(values: tuple, value: Any) -> tuple:
            return (*values[:dim], value, *values[dim:])

        return Piece(
            self.key, insert(self.axes, None), self.src_start, insert(self.dst_start, index), insert(self.shape, 1)
        )

    def shifted(self, dim: int, offset: int) -> Piece:
        return Piece(
            self.key, self.axes, self.src_start, _put(self.dst_start, dim, self.dst_start[dim] + offset), self.shape
        )

    def transposed(self, dim0: int, dim1: int) -> Piece:
        def swap(values: tuple) -> tuple:
            values = list(values)
            values[dim0], values[dim1] = values[dim1], values[dim0]
            return tuple(values)

        return Piece(self.key, swap(self.axes), self.src_start, swap(self.dst_start), swap(self.shape))

    def cropped(self, dim: int, lo: int, hi: int, at: int) -> Piece | None:
        """The part of the box within rows [lo, hi) of ``dim``, moved so that row ``lo`` lands at ``at``."""
        start, stop = max(lo, self.dst_start[dim]), min(hi, self.dst_start[dim] + self.shape[dim])
        if start >= stop:
            return None
        src_start, axis = self.src_start, self.axes[dim]
        if axis is not None:
            src_start = _put(src_start, axis, src_start[axis] + start - self.dst_start[dim])
        return Piece(
            self.key,
            self.axes,
            src_start,
            _put(self.dst_start, dim, start - lo + at),
            _put(self.shape, dim, stop - start),
        )


@dataclass(frozen=True)
class Layout:
    """A tensor of ``shape``, tiled by the boxes of ``pieces``."""

    shape: tuple[int, ...]
    pieces: tuple[Piece, ...]

    @classmethod
    def whole(cls, key: str, shape: tuple[int, ...]) -> Layout:
        return cls(shape, (Piece.whole(key, shape),))

    @classmethod
    def lifted(cls, key: str) -> Layout:
        """A 0-d tensor as shape [1] (its one axis added, as stacking adds one)."""
        return cls((1,), (Piece(key, (None,), (), (0,), (1,)),))

    def unsqueezed(self) -> Layout:
        """The same elements with a trailing axis of size 1."""
        return Layout((*self.shape, 1), tuple(
            Piece(p.key, (*p.axes, None), p.src_start, (*p.dst_start, 0), (*p.shape, 1)) for p in self.pieces
        ))

    def keys(self) -> list[str]:
        return list(dict.fromkeys(piece.key for piece in self.pieces))

    def take(self, dim: int, ranges: Iterable[tuple[int, int]]) -> Layout:
        """The tensor made of rows [lo, hi) along ``dim`` for each range, concatenated in order."""
        pieces: list[Piece] = []
        at = 0
        for lo, hi in ranges:
            pieces += [part for piece in self.pieces if (part := piece.cropped(dim, lo, hi, at)) is not None]
            at += hi - lo
        return Layout(_put(self.shape, dim, at), tuple(pieces))

    def transposed(self, dim0: int, dim1: int) -> Layout:
        shape = list(self.shape)
        shape[dim0], shape[dim1] = shape[dim1], shape[dim0]
        return Layout(tuple(shape), tuple(piece.transposed(dim0, dim1) for piece in self.pieces))


def stack(layouts: list[Layout], dim: int) -> Layout:
    shapes = {layout.shape for layout in layouts}
    if len(shapes) != 1:
        raise _Misfit(f"stacks checkpoint tensors of different shapes {sorted(shapes)}")
    pieces = tuple(piece.stacked(dim, i) for i, layout in enumerate(layouts) for piece in layout.pieces)
    shape = layouts[0].shape
    return Layout((*shape[:dim], len(layouts), *shape[dim:]), pieces)


def concatenate(layouts: list[Layout], dim: int) -> Layout:
    rests = {_put(layout.shape, dim, 0) for layout in layouts}
    if len(rests) != 1:
        raise _Misfit(
            f"concatenates checkpoint tensors of shapes {[layout.shape for layout in layouts]} along dim {dim}"
        )
    pieces, offset = [], 0
    for layout in layouts:
        pieces += [piece.shifted(dim, offset) for piece in layout.pieces]
        offset += layout.shape[dim]
    return Layout(_put(layouts[0].shape, dim, offset), tuple(pieces))


# -- transformers' conversion operations, on layouts -------------------------------------------------


@dataclass(frozen=True)
class Unstreamable:
    """A target tensor whose conversion from the checkpoint cannot be streamed slice by slice."""

    converter: str
    reason: str


@dataclass(frozen=True)
class Misfit:
    """A target tensor that its checkpoint tensors do not make up."""

    reason: str


@dataclass(frozen=True)
class _Context:
    first_name: str  # the converter's first target, as transformers passes it (`full_layer_name`)
    shapes: dict[str, tuple[int, ...]]
    config: PretrainedConfig


# Each step mirrors the op's `convert` in transformers.core_model_loading, naming outputs with the op's
# own target-pattern methods, so the two cannot drift apart on which tensor ends up where.
Values = dict[str, Any]  # pattern -> Layout, or a list of them (one per expert) as collected
Step = Callable[[Any, Values, WeightConverter, _Context], Values]


def _only(value: Layout | list[Layout]) -> Layout:
    return value[0] if isinstance(value, list) else value


def _merge_modulelist(op: MergeModulelist, values: Values, converter: WeightConverter, ctx: _Context) -> Values:
    return {
        op.get_target_pattern(len(values), pattern, converter.target_patterns): (
            stack(value, op.dim) if isinstance(value, list) else value
        )
        for pattern, value in values.items()
    }


def _concatenate(op: Concatenate, values: Values, converter: WeightConverter, ctx: _Context) -> Values:
    parts: list[Layout] = []
    for pattern in converter.source_patterns:  # the order of the patterns, not of the checkpoint
        if pattern in values:
            value = values[pattern]
            parts += value if isinstance(value, list) else [value]
    return {op.get_target_pattern(converter.target_patterns): concatenate(parts, op.dim)}


def _transpose(op: Transpose, values: Values, converter: WeightConverter, ctx: _Context) -> Values:
    target = op.get_target_pattern(values, converter.source_patterns, converter.target_patterns)
    layout = _only(next(iter(values.values())))
    if op.check_dims and layout.shape == ctx.shapes.get(ctx.first_name):
        return {target: layout}
    return {target: layout.transposed(op.dim0, op.dim1)}


def _single_input(values: Values) -> Layout:
    if len(values) > 1:
        raise _NotStreamable(f"splits {len(values)} inputs at once")
    return _only(next(iter(values.values())))


def _chunk(op: Chunk, values: Values, converter: WeightConverter, ctx: _Context) -> Values:
    layout = _single_input(values)
    targets = op.get_target_patterns(converter.target_patterns, config=ctx.config)
    size = layout.shape[op.dim]
    step = -(-size // len(targets))  # torch.chunk's chunk size (so possibly fewer chunks than targets)
    bounds = [(lo, min(lo + step, size)) for lo in range(0, size, step)]
    return {target: layout.take(op.dim, [bound]) for target, bound in zip(targets, bounds)}


def _split(op: ConversionOps, values: Values, converter: WeightConverter, ctx: _Context) -> Values:
    layout = _single_input(values)
    first = converter.target_patterns[0]
    split: Values = {}
    lo = 0
    for target in converter.target_patterns:
        hi = lo + ctx.shapes[ctx.first_name.replace(first, target)][op.dim]
        split[target] = layout.take(op.dim, [(lo, hi)])
        lo = hi
    return split


STREAMABLE: dict[type[ConversionOps], Step] = {
    MergeModulelist: _merge_modulelist,
    Concatenate: _concatenate,
    Transpose: _transpose,
    Chunk: _chunk,
}
# Split (a fused tensor cut into targets sized like the model's parameters) came after transformers
# 5.17; the conversion mappings of the versions without it never use it.
if hasattr(core_model_loading, "Split"):
    STREAMABLE[core_model_loading.Split] = _split


def _convert(converter: WeightConverter, collected: Values, ctx: _Context) -> dict[str, Layout | Unstreamable | Misfit]:
    """Run ``converter`` on the collected layouts; name the results as ``WeightConverter.convert`` does."""
    values = collected
    try:
        for op in converter.operations:
            step = STREAMABLE.get(type(op))
            if step is None:
                supported = ", ".join(kind.__name__ for kind in STREAMABLE)
                raise _NotStreamable(f"uses {type(op).__name__}, which afdc cannot stream (supported: {supported})")
            try:
                values = step(op, values, converter, ctx)
            except ValueError as err:  # transformers' own naming refused the pattern combination
                raise _NotStreamable(f"{type(op).__name__}: {err}") from err
    except (_NotStreamable, _Misfit) as err:
        marker = Unstreamable(repr(converter), str(err)) if isinstance(err, _NotStreamable) else Misfit(str(err))
        first = converter.target_patterns[0]
        return {ctx.first_name.replace(first, target): marker for target in converter.target_patterns}
    full_name = ctx.first_name.replace("*.", "0.")
    affix = next((full_name.partition(target) for target in values if target in full_name), None)
    if affix is None:
        return {target: _only(value) for target, value in values.items()}
    prefix, _, suffix = affix
    return {prefix + target + suffix: _only(value) for target, value in values.items()}


def _source_layouts(
    checkpoint: Checkpoint, model: PreTrainedModel, shapes: dict[str, tuple[int, ...]], lift_scalars: bool = False
) -> dict[str, Layout | Unstreamable | Misfit]:
    """Every model tensor the checkpoint provides, as a layout of checkpoint tensors.

    Key matching follows ``convert_and_load_state_dict_in_model``: keys in natural order, renamings
    then at most one converter per key, the base-model prefix added or dropped as the model needs.
    ``lift_scalars`` reads a 0-d tensor as one of shape [1] (per-tensor scales, which the conversion
    then stacks and concatenates as it does their weights).
    """
    mapping = get_model_conversion_mapping(model)  # what from_pretrained uses (legacy renames included)
    converters = [transform for transform in mapping if isinstance(transform, WeightConverter)]
    by_pattern = {pattern: converter for converter in converters for pattern in converter.source_patterns}
    rename = checkpoint_renamer(mapping, model.base_model_prefix, shapes)

    layouts: dict[str, Layout | Unstreamable | Misfit] = {}
    groups: dict[str, tuple[WeightConverter, defaultdict[str, list[Layout]]]] = {}
    for key in sorted(checkpoint.tensors, key=dot_natural_key):
        name, pattern = rename(key)
        if name not in shapes:
            continue  # a tensor this model does not have (from_pretrained reports it as unexpected)
        shape = tuple(checkpoint.tensors[key].shape)
        whole = Layout.lifted(key) if lift_scalars and not shape else Layout.whole(key, shape)
        if pattern is None:
            layouts.setdefault(name, whole)
        else:
            converter, collected = groups.setdefault(name, (by_pattern[pattern], defaultdict(list)))
            collected[pattern].append(whole)
    for first_name, (converter, collected) in groups.items():
        layouts.update(_convert(converter, dict(collected), _Context(first_name, shapes, model.config)))
    return layouts


def _tied_partners(model: PreTrainedModel) -> dict[str, list[str]]:
    """For each tied parameter, the names it shares its weight with."""
    groups: defaultdict[str, set[str]] = defaultdict(set)
    for target, source in (getattr(model, "all_tied_weights_keys", None) or {}).items():
        groups[source] |= {source, target}
    return {name: sorted(group - {name}) for group in groups.values() for name in group}


def _stored_layouts(
    checkpoint: Checkpoint, model: PreTrainedModel, stored: Iterable[StoredTensor]
) -> dict[str, Layout | Unstreamable | Misfit]:
    """The layouts of a quantized parameter's stored tensors (scales, MXFP4 blocks): each role's
    checkpoint tensors seen under the keys the bf16 checkpoint has, so that the conversion which
    composes the parameter (per-expert tensors stacked, gate and up concatenated) composes them too."""
    by_role: defaultdict[str, list[StoredTensor]] = defaultdict(list)
    for tensor in stored:
        by_role[tensor.role.value].append(tensor)
    layouts: dict[str, Layout | Unstreamable | Misfit] = {}
    for tensors in by_role.values():
        keys = {bf16: key for t in tensors for bf16, key in t.sources}
        view = Checkpoint(checkpoint.directory, checkpoint.files, {b: checkpoint.tensors[k] for b, k in keys.items()})
        found = _source_layouts(view, model, {t.parameter: t.shape for t in tensors}, lift_scalars=True)
        for t in tensors:
            layout = found.get(t.parameter)
            if isinstance(layout, Layout):
                layout = Layout(layout.shape, tuple(replace(p, key=keys[p.key]) for p in layout.pieces))
                if (*layout.shape, 1) == t.shape:  # per-tensor scales stack to [E, 2]: the grid is [E, 2, 1]
                    layout = layout.unsqueezed()
            if layout is not None:
                layouts[t.name] = layout
    return layouts


def resolve(
    checkpoint: Checkpoint,
    model: PreTrainedModel,
    names: Iterable[str],
    stored: Mapping[str, StoredTensor] | None = None,
) -> dict[str, Layout]:
    """The layout of each named model tensor (a state_dict name, or one of ``stored``: a quantized
    parameter's scale or blocks) in the checkpoint.

    A name the checkpoint lacks is taken from a tied partner that it has. Raises one CheckpointError
    listing every tensor that is absent or comes out in another shape (e.g. experts missing), or one
    naming a tensor whose conversion cannot be streamed.
    """
    names = list(dict.fromkeys(names))
    stored = {n: t for n, t in (stored or {}).items() if n in names}
    shapes = {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}
    unknown = [name for name in names if name not in shapes and name not in stored]
    if unknown:
        raise ValueError(f"not tensors of {type(model).__name__}: {', '.join(unknown[:10])}")
    layouts = _source_layouts(checkpoint, model, shapes)
    layouts.update(_stored_layouts(checkpoint, model, stored.values()))
    shapes.update({n: t.shape for n, t in stored.items()})
    partners = _tied_partners(model)
    resolved: dict[str, Layout] = {}
    missing: list[str] = []
    misshapen: list[str] = []
    for name in names:
        found = next((layouts[other] for other in (name, *partners.get(name, ())) if other in layouts), None)
        if found is None:
            missing.append(name)
        elif isinstance(found, Unstreamable):
            raise CheckpointError(f"{name}: transformers loads it through {found.converter}, which {found.reason}")
        elif isinstance(found, Misfit):
            misshapen.append(f"{name} ({found.reason})")
        elif found.shape != shapes[name]:
            keys = ", ".join(found.keys()[:3]) + (", ..." if len(found.keys()) > 3 else "")
            misshapen.append(f"{name} (model {list(shapes[name])}, checkpoint {list(found.shape)} from {keys})")
        else:
            resolved[name] = found
    if missing or misshapen:
        problems = [
            f"{len(items)} tensor(s) {what}: {', '.join(items[:10])}"
            + (f" and {len(items) - 10} more" if len(items) > 10 else "")
            for what, items in (("absent", missing), ("incomplete or of another shape", misshapen))
            if items
        ]
        raise CheckpointError(
            f"the checkpoint {checkpoint.describe()} does not hold the model's tensors: {'; '.join(problems)}"
        )
    return resolved
