"""The forward through non-strict ``torch.export``, with symbolic batch, token and key lengths, on
real or meta tensors; and how far a *relaxed* export (guards recorded, not proven) holds."""

from __future__ import annotations

import contextlib
import inspect
import itertools
import logging

import sympy
import torch
from torch.overrides import TorchFunctionMode
from transformers import PreTrainedModel

from afdc.capture import session
from afdc.capture.session import CaptureSession
from afdc.capture.standin_cache import WithCacheLength


def takes_positions(model: PreTrainedModel) -> bool:
    """Whether the forward takes ``position_ids``. One that does not finds its positions itself:
    from the attention mask (ALiBi) or from its own cache's length, which afdc's KV cache replaces."""
    return "position_ids" in inspect.signature(model.forward).parameters


def export_forward(
    model: PreTrainedModel, mode: str, functional: bool, cache: str | None, traced: CaptureSession
) -> torch.export.ExportedProgram:
    """``mode``: "incremental" (kv and s independent, every guard proven), "relaxed" (see
    :func:`relaxed_limit`; traced with kv == s, which export may then tie) or "static".
    ``cache``: the forward's argument that gets a stand-in cache (its tensors' names then
    start with :data:`~afdc.capture.standin_cache.WRAPPED`); None: no cache. ``traced`` is the
    attempt's session: it gets the attention slots and mixer call sites traced."""
    batch = torch.export.Dim("batch")  # strict in every mode: one batch size, never specialized
    if mode == "relaxed":
        seq = kv = torch.export.Dim.DYNAMIC
    else:
        seq, kv = torch.export.Dim("seq"), torch.export.Dim("kv")
    dims = {"input_ids": {0: batch, 1: seq}, "attention_mask": {0: batch, 1: kv}, "position_ids": {0: batch, 1: seq}}
    inputs = _example_inputs(model, 3 if mode == "incremental" else 0)
    # a failed attempt is expected (the next mode tries again) and its error is reported by
    # capture(); fake tensors would also log it with a traceback
    fake_log = logging.getLogger("torch._subclasses.fake_tensor")
    level, fake_log.level = fake_log.level, logging.CRITICAL
    try:
        with session.tracing(traced):
            with _HostConstants() if inputs["input_ids"].is_meta else contextlib.nullcontext():
                ep = torch.export.export(
                    WithCacheLength(model, cache, traced) if cache else model,
                    args=(),
                    kwargs=inputs,
                    dynamic_shapes=None if mode == "static" else {name: dims[name] for name in inputs},
                    strict=False,
                )
            return ep.run_decompositions({}) if functional else ep
    finally:
        fake_log.level = level


def _example_inputs(model: PreTrainedModel, kv_extra: int) -> dict[str, torch.Tensor]:
    device = next(itertools.chain(model.parameters(), model.buffers())).device
    b, s = 2, 5
    vocab = model.config.get_text_config().vocab_size
    inputs = {
        "input_ids": torch.randint(0, vocab, (b, s), device=device),
        "attention_mask": torch.ones(b, s + kv_extra, dtype=torch.long, device=device),
        "position_ids": torch.arange(kv_extra, kv_extra + s, device=device).expand(b, s),
    }
    if not takes_positions(model):
        del inputs["position_ids"]
    return inputs


class _HostConstants(TorchFunctionMode):
    """Make the constants a forward creates from Python values on the host, not on the meta
    device, so that a capture of a meta model keeps their values: ``torch.tensor(<number>,
    device=...)`` (GPT-Neo's mask value; a 0-dim host tensor mixes with any device's) and the
    index tensor of ``x[..., [i, j]]`` (Falcon's key/value split; host indices index any device)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.tensor and args and isinstance(args[0], (bool, int, float)):
            kwargs = {**kwargs, "device": "cpu"}
        elif func is torch.Tensor.__getitem__:
            index = args[1]
            args = (args[0], tuple(map(_host_index, index)) if isinstance(index, tuple) else _host_index(index))
        return func(*args, **kwargs)


def _host_index(index):
    if isinstance(index, list) and index and all(type(i) is int for i in index):
        return torch.tensor(index)
    return index


class Specialized(Exception):
    """A relaxed capture that holds for too few lengths."""


def relaxed_limit(ep: torch.export.ExportedProgram, context: int | None) -> int | None:
    """The largest key length a "relaxed" capture is valid for (None: any).

    A strict export refuses a guard it cannot prove for every length: a true relation sympy
    cannot show (``min(2048, s) <= s``, a sparse-attention indexer's top-k), an upper bound (a
    position table sliced to the length), or a branch taken for this length only (one chunk of a
    chunked scan). A relaxed export (``Dim.DYNAMIC``) records such guards and goes on, so every
    guard on the lengths is evaluated here at :data:`_PROBES` (every length up to 256, then
    around each power of two): the capture is valid up to the last probe before one fails. It is
    refused when that falls short of the model's own ``context`` (less one: some guards exclude
    the table's full size), as it does for a branch taken for short inputs only. A guard that
    fails only between probes past 256 would go unseen; none of the measured decoders has one.
    """
    if ep.graph.find_nodes(op="call_function", target=torch.ops.aten._assert_scalar.default):
        raise Specialized("the graph asserts a relation between the lengths")
    inputs = {n.name: n.meta["val"] for n in ep.graph.find_nodes(op="placeholder")}
    seq, keys = inputs["input_ids"].shape[1], inputs["attention_mask"].shape[1]
    for dim in (seq, keys):
        if not isinstance(dim, torch.SymInt):
            raise Specialized(f"a token dimension is specialized to {dim}")
    shape_env = seq.node.shape_env
    s, kv = seq.node.expr, keys.node.expr
    guards = {str(e): e for g in shape_env.guards if (e := shape_env.replace(g.expr)).free_symbols & {s, kv}}
    valid = None
    for length in _PROBES:
        # queries at the end of the keys: as many as the keys, the fewest, or half of them
        for queries, key_length in dict.fromkeys([(length, length), (2, length), (length, 2 * length)]):
            if s == kv and queries != key_length:
                continue
            values = {s: queries, kv: key_length}
            for guard in guards.values():
                point = {x: sympy.Integer(values.get(x, 3)) for x in guard.free_symbols}  # 3: any batch
                if not bool(guard.xreplace(point)):
                    if valid is None:
                        raise Specialized(f"the graph fails its guards at {queries} queries over {key_length} keys, "
                                          f"the shortest lengths checked ({guard})")
                    if context is not None and valid < context - 1:
                        raise Specialized(f"the graph holds only up to {valid} positions ({guard})")
                    return valid
        valid = length
    return None


# Lengths at which a relaxed capture's guards are checked (see relaxed_limit).
_PROBES = sorted({*range(2, 257), *(2**e + d for e in range(8, 21) for d in (-1, 0, 1))})
