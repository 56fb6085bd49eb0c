"""Capture: a Hugging Face causal LM's forward as one FX graph with opaque attention ops.

afdc registers its own attention implementation (and mask builder) with transformers'
``AttentionInterface``; the implementation calls the ``afdc::attention`` custom op, so every
softmax-attention call becomes exactly one graph node, whatever backend the model would have used.
The forward is then captured with non-strict ``torch.export`` with symbolic batch, token and
key lengths, on real or meta tensors.

A stateful token mixer (a convolution window, an SSM or linear-attention state kept from step to
step) is found by what its forward does with the cache: the stand-in cache below answers nothing
of per-layer state, and the module whose forward asks for it is made one ``afdc::mixer`` op per
call (:mod:`afdc.mixer_site`), whose Python loops then stay out of the graph.

The graph's inputs are ``input_ids [b, s]``, ``attention_mask [b, kv]`` and ``position_ids [b, s]``,
where the queries are the last ``s`` of the ``kv`` positions: the same graph runs prefill
(``kv == s``) and incremental decode against the KV cache held by the attention op. What the
forward reads of its cache (how many tokens it holds: every cache position in transformers is
``arange(s) + cache length``) is answered as ``kv - s`` by a stand-in cache that stores nothing.
"""

from __future__ import annotations

import contextlib
import dis
import functools
import inspect
import itertools
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import sympy
import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch.overrides import TorchFunctionMode
from transformers import AttentionInterface, Cache, PreTrainedModel
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from afdc import ops
from afdc.errors import UnsupportedModelError
from afdc.mixer_site import MixerSite

IMPLEMENTATION = "afdc"
INPUT_NAMES = ("input_ids", "attention_mask", "position_ids")

# Keyword arguments that change what attention computes and that afdc's op does not apply:
# refusing is better than a silently wrong model.
_UNSUPPORTED_ATTENTION_KWARGS = ("sinks",)


_slots: list[Iterator[int]] = []
_mixer_sites: list[list[MixerSite]] = []  # per export attempt, in call order
_key_slots: list[Iterator[int]] = []  # per export attempt: sparse-attention indexers' key caches
# mask tensor id -> (mask, the sliding-window or chunk size it was built with), within one capture;
# holding the mask keeps its id from being reused
_windows: dict[int, tuple[torch.Tensor, int]] = {}


def key_length_tied(graph: fx.Graph) -> bool:
    """Whether a captured graph needs the key length to equal the token count (captured
    non-incrementally: decode recomputes the prefix)."""
    inputs = {n.target: n.meta["val"] for n in graph.find_nodes(op="placeholder")}
    tokens, keys = (inputs[name].shape[1] for name in ("input_ids", "attention_mask"))
    return _expr(tokens) == _expr(keys)  # compared as expressions: == on SymInts would add a guard


def _expr(dim):
    return dim.node.expr if isinstance(dim, torch.SymInt) else dim


def _attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, softcap=None, **kwargs):
    for name in _UNSUPPORTED_ATTENTION_KWARGS:
        if kwargs.get(name) is not None:
            raise UnsupportedModelError(f"attention passes `{name}`, which afdc's attention op does not implement yet")
    slot = next(_slots[-1]) if _slots else -1
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    sinks = kwargs.get("s_aux")
    window = _windows.get(id(attention_mask), (None, 0))[1] or kwargs.get("sliding_window") or 0
    mask = _fold_into_mask(attention_mask, kwargs.get("indices"), kwargs.get("position_bias"), softcap)
    out = ops.attention(query, key, value, mask, slot, float(scale), float(softcap or 0.0), sinks, window)
    return out, None


def _fold_into_mask(mask, indices, position_bias, softcap):
    """The mask with what some models pass beside it folded in, as transformers' eager path does.

    ``indices [b, s, topk]``: the keys a sparse-attention indexer chose for each query
    (DeepSeek-V3.2-style); the rest are masked. ``position_bias``: an additive score bias
    ``[b, h, q, kv]`` (a learned relative-position bias). The graph then computes the mask from
    the hidden states, which the paged serving path, which rebuilds masks from positions, refuses.
    """
    if indices is None and position_bias is None:
        return mask
    if mask is None:
        raise UnsupportedModelError("attention passes `indices` or `position_bias` without a mask to fold them into")
    if indices is not None:
        chosen = torch.zeros(mask.shape[0], mask.shape[-2], mask.shape[-1], dtype=torch.bool, device=mask.device)
        chosen = chosen.scatter(-1, indices.long(), True).unsqueeze(1)
        mask = mask & chosen if mask.dtype == torch.bool else mask.masked_fill(~chosen, torch.finfo(mask.dtype).min)
    if position_bias is not None:
        if softcap:
            raise UnsupportedModelError("attention passes both a softcap and a `position_bias`; their order is unknown")
        if mask.dtype == torch.bool:
            mask = ops.open_empty_rows(mask)  # a row with no key to attend to attends everything
            mask = position_bias.masked_fill(~mask, torch.finfo(position_bias.dtype).min)
        else:
            mask = mask + position_bias
    return mask


def _mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None, attention_mask=None, **kwargs):
    """The stock boolean mask, with the queries placed at the end of the keys.

    afdc never hands transformers a cache, so transformers sees ``kv`` positions in the 2-D mask
    and ``s`` queries; placing the queries last makes one graph serve prefill and decode.
    """
    local_size = kwargs.get("local_size")
    kwargs = {k: v for k, v in kwargs.items() if k in ("use_vmap", "device")}
    mask = sdpa_mask(
        batch_size=batch_size,
        q_length=q_length,
        kv_length=kv_length,
        q_offset=kv_length - q_length,
        kv_offset=0,
        mask_function=mask_function,
        attention_mask=attention_mask,
        allow_is_causal_skip=False,
        allow_is_bidirectional_skip=False,
        **kwargs,
    )
    if local_size and _slots:
        _windows[id(mask)] = (mask, int(local_size))
    return mask


AttentionInterface.register(IMPLEMENTATION, _attention_forward)
AttentionMaskInterface.register(IMPLEMENTATION, _mask)


class _CacheLength(Cache):
    """The forward's cache during capture: it holds nothing, and says it holds ``past`` tokens.

    afdc's attention op keeps the keys and values, so the forward needs no real cache; but
    without one it would place every call's tokens at cache positions ``0..s-1`` and decode
    would read the wrong position wherever the forward reads it (Llama 4's NoPE temperature,
    which grows with the position). With this stand-in the positions are ``kv - s + i``: the
    queries are the last ``s`` of the ``kv`` keys, as the attention op places them."""

    def __init__(self, past):
        super().__init__(layers=[])
        self.past = past

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        return key_states, value_states

    def update_indexer(self, keys, layer_idx):
        """A sparse-attention indexer's keys: those cached for the sequence, then these."""
        return ops.cached_keys(keys, next(_key_slots[-1]), keys.shape[1] + self.past)

    def get_seq_length(self, layer_idx: int = 0):
        return self.past

    def get_query_offset(self, layer_idx: int = 0):
        return self.past

    def get_mask_sizes(self, query_length, layer_idx):
        # older transformers pass the queries' cache positions (a tensor with one per query)
        queries = query_length.shape[0] if isinstance(query_length, torch.Tensor) else query_length
        return self.past + queries, 0

    @property
    def is_compileable(self) -> bool:
        return False

    def __getattr__(self, name: str):
        # a cache API of the model's own (MiniMax's get_linear_cache): whoever asks keeps state in
        # the cache; an AttributeError still, so that getattr(cache, name, default) stays quiet
        raise _StatefulMixer()

    # per-layer state that only a stateful mixer reads or writes: the caller is one
    def get_conv_state(self, *args, **kwargs):
        raise _StatefulMixer()

    get_recurrent_state = update_conv_state = update_recurrent_state = is_recording_past = get_conv_state


class _StatefulMixer(AttributeError):
    """Raised by the stand-in cache when a module asks it for per-layer state (or for anything it
    does not have): ``module`` is the innermost module whose code asked."""

    def __init__(self):
        frame = inspect.currentframe()
        module = None
        while frame is not None and module is None:
            owner = frame.f_locals.get("self")
            if isinstance(owner, torch.nn.Module):
                module = owner
            frame = frame.f_back
        del frame
        super().__init__(f"{type(module).__name__} reads per-layer state of the cache")
        self.module = module


def _mixer_forward(module: torch.nn.Module, path: str, original, *args, **kwargs) -> torch.Tensor:
    """What a stateful mixer's ``forward`` is during capture: one ``afdc::mixer`` op.

    The op takes the hidden states (the first argument), the 2-D padding mask (the one other tensor
    argument, if any) and the module's weights; the cache argument is left to the runtime, other
    arguments are recorded as they were traced. Arguments the forward's code never reads (what a
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
    cache = [name for name, value in rest if isinstance(value, _CacheLength)]
    if not cache:
        raise UnsupportedModelError(f"the stateful mixer {path} was called without the model's cache", path)
    tensors = [(name, v) for name, v in rest if isinstance(v, torch.Tensor)]
    if len(tensors) > 1 or any(v.dim() != 2 for _, v in tensors) or not isinstance(hidden, torch.Tensor):
        raise UnsupportedModelError(
            f"the stateful mixer {path} takes tensors afdc does not know how to pass: "
            f"{[hidden_name] + [name for name, _ in tensors]} (afdc passes the hidden states and a 2-D padding mask)",
            path,
        )
    constants = []
    for name, value in rest:
        if name in cache or isinstance(value, torch.Tensor):
            continue
        if value is not None and not isinstance(value, (bool, int, float, str)):
            raise UnsupportedModelError(
                f"the stateful mixer {path} takes {name}={type(value).__name__}, which afdc cannot record", path
            )
        constants.append((name, value))
    weights = [*module.named_parameters(), *module.named_buffers()]
    site = MixerSite(
        slot=len(_mixer_sites[-1]),
        module=path,
        weights=tuple(name for name, _ in weights),
        cache_argument=cache[0],
        mask_argument=tensors[0][0] if tensors else None,
        constants=tuple(constants),
    )
    _mixer_sites[-1].append(site)
    mask = tensors[0][1] if tensors else None
    out = ops.mixer(hidden, mask, [t for _, t in weights], site.slot)
    # a forward returning (output, its state) to a caller that unpacks both (MiniMax's): unpacking
    # the op's one tensor instead would split it along the batch, pinning the batch size
    unpacked = _caller_unpacks()
    return (out, *[None] * (unpacked - 1)) if unpacked else out


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
def _as_mixer_ops(model: PreTrainedModel, classes: set[type]) -> Iterator[None]:
    """Every module of ``classes`` in ``model`` called as one ``afdc::mixer`` op."""
    wrapped = [(path, m) for path, m in model.named_modules() if type(m) in classes]
    for path, m in wrapped:
        m.forward = functools.partial(_mixer_forward, m, path, m.forward)
    try:
        yield
    finally:
        for _, m in wrapped:
            del m.forward


class _WithCacheLength(torch.nn.Module):
    """``model`` called with a :class:`_CacheLength` of ``kv - s`` tokens as its argument
    ``argument``, the cache left out of its output (export cannot return it)."""

    def __init__(self, model: PreTrainedModel, argument: str):
        super().__init__()
        self.model = model
        self.argument = argument

    def forward(self, input_ids, attention_mask, position_ids=None):
        cache = {self.argument: _CacheLength(attention_mask.shape[1] - input_ids.shape[1])}
        positions = {} if position_ids is None else {"position_ids": position_ids}
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, **cache, **positions)
        return type(out)(**{k: v for k, v in out.items() if k not in _CACHE_ARGUMENTS})


_WRAPPED = "model."  # the FQN prefix of the model's tensors inside _WithCacheLength


# the forward's cache argument (and output field): transformers 5.24 renamed past_key_values
_CACHE_ARGUMENTS = ("cache", "past_key_values")


def _cache_argument(model: PreTrainedModel) -> str | None:
    parameters = inspect.signature(model.forward).parameters
    return next((name for name in _CACHE_ARGUMENTS if name in parameters), None)


@dataclass(kw_only=True)
class CapturedGraph:
    """A model's forward as one FX graph whose parameters are ``get_attr`` nodes named by FQN."""

    graph: fx.Graph
    attrs: dict[str, torch.Tensor]  # FQN -> tensor, parameters and buffers and constants
    parameter_names: list[str]  # the FQNs in ``attrs`` that are model parameters
    out_spec: pytree.TreeSpec  # rebuilds the model's output object from the graph's outputs
    # why decode must recompute the whole prefix ("": new tokens decode against the KV cache)
    recompute: str
    max_positions: int | None = None  # the longest key length the graph is valid for (None: any)
    # why the graph holds for the example's lengths only ("": it holds for any). Every capture
    # that is not shape-polymorphic says why: a static export records the dynamic ones' errors.
    specialized: str = ""
    # of a specialized capture: per-sequence state the forward keeps outside transformers' cache
    # layers, where afdc finds no mixer to keep it per sequence ("": none found)
    state_outside_cache: str = ""
    mixers: list[MixerSite] = field(default_factory=list)  # the graph's afdc::mixer call sites, by slot


@contextlib.contextmanager
def _afdc_attention(model: PreTrainedModel) -> Iterator[None]:
    """Route attention through afdc's op, and keep the cache out of the outputs.

    A model with hard-coded attention cannot switch; it is captured as it is, its attention
    inline (the classifier keeps token-mixing computation on the attention side). Switching the
    name anyway would hand its code afdc's boolean mask where it expects an additive one.
    """
    configs = list(_all_configs(model.config))
    saved = [(c, c._attn_implementation, getattr(c, "use_cache", None)) for c in configs]
    switch = type(model)._can_set_attn_implementation()
    if switch:
        model.set_attn_implementation(IMPLEMENTATION)
    for c in configs:
        if switch:
            c._attn_implementation = IMPLEMENTATION
        c.use_cache = False  # a DynamicCache in the outputs is not exportable
    try:
        yield
    finally:
        for c, impl, use_cache in saved:
            c._attn_implementation = impl
            c.use_cache = use_cache


def _all_configs(config) -> Iterator:
    yield config
    for name in getattr(config, "sub_configs", {}) or {}:
        sub = getattr(config, name, None)
        if sub is not None:
            yield from _all_configs(sub)


def takes_positions(model: PreTrainedModel) -> bool:
    """Whether the forward takes ``position_ids``. One that does not finds its positions itself:
    from the attention mask (ALiBi) or from its own cache's length, which afdc's KV cache replaces."""
    return "position_ids" in inspect.signature(model.forward).parameters


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


def _export(
    model: PreTrainedModel, mode: str, functional: bool, cache: str | None, sites: list[MixerSite]
) -> torch.export.ExportedProgram:
    """``mode``: "incremental" (kv and s independent, every guard proven), "relaxed" (see
    :func:`_relaxed_limit`; traced with kv == s, which export may then tie) or "static".
    ``cache``: the forward's argument that gets a :class:`_CacheLength` (its tensors' names then
    start with :data:`_WRAPPED`); None: no cache. ``sites`` gets the mixer call sites traced."""
    batch = torch.export.Dim("batch")  # strict in every mode: one batch size, never specialized
    if mode == "relaxed":
        seq = kv = torch.export.Dim.DYNAMIC
    else:
        seq, kv = torch.export.Dim("seq"), torch.export.Dim("kv")
    dims = {"input_ids": {0: batch, 1: seq}, "attention_mask": {0: batch, 1: kv}, "position_ids": {0: batch, 1: seq}}
    inputs = _example_inputs(model, 3 if mode == "incremental" else 0)
    _slots.append(itertools.count())
    _mixer_sites.append([])
    _key_slots.append(itertools.count())
    # a failed attempt is expected (the next mode tries again) and its error is reported by
    # capture(); fake tensors would also log it with a traceback
    fake_log = logging.getLogger("torch._subclasses.fake_tensor")
    level, fake_log.level = fake_log.level, logging.CRITICAL
    try:
        with _HostConstants() if inputs["input_ids"].is_meta else contextlib.nullcontext():
            ep = torch.export.export(
                _WithCacheLength(model, cache) if cache else model,
                args=(),
                kwargs=inputs,
                dynamic_shapes=None if mode == "static" else {name: dims[name] for name in inputs},
                strict=False,
            )
        return ep.run_decompositions({}) if functional else ep
    finally:
        fake_log.level = level
        sites.extend(_mixer_sites.pop())
        _key_slots.pop()
        _slots.pop()
        _windows.clear()


def capture(model: PreTrainedModel, functional: bool = False) -> CapturedGraph:
    """Capture ``model``'s forward; raises :class:`UnsupportedModelError` when it cannot.

    The graph is captured shape-polymorphic when possible: strictly first, then relaxed (see
    :func:`_relaxed_limit`). Some mixers tie the mask length to the token count (then decode
    recomputes the prefix); some hold for too few lengths (the graph is still returned, so that
    classification can say what the model is; :attr:`CapturedGraph.specialized` says why).

    ``functional=True`` retraces the graph without in-place ops (slow on big models; needed
    only when a cut would separate an in-place write from its readers, see ``passes.aliasing``).
    """
    model.eval()
    argument = _cache_argument(model)
    mixers: set[type] = set()
    with _afdc_attention(model), torch.no_grad():
        while True:  # each module type found asking the cache for state is made a mixer op, then again
            try:
                with _as_mixer_ops(model, mixers):
                    captured = _capture(model, functional, argument, with_mixers=bool(mixers))
                break
            except _StatefulMixer as found:
                if found.module is None or type(found.module) in mixers or _contains_layers(found.module, model):
                    raise UnsupportedModelError(
                        f"the forward reads per-layer cache state outside a token mixer ({found})"
                    ) from None
                mixers.add(type(found.module))
    if captured.specialized:
        captured.state_outside_cache = _state_outside_cache(model)
    return captured


def _state_outside_cache(model: PreTrainedModel) -> str:
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
        sites: list[MixerSite] = []
        try:
            ep = _export(model, mode, functional, cache, sites)
        except (UnsupportedModelError, _StatefulMixer):
            raise
        except Exception as err:
            if isinstance(err.__cause__, _StatefulMixer):  # export re-raised what the stand-in raised
                raise err.__cause__ from None
            errors.append(f"{mode}: {(str(err).splitlines() or [type(err).__name__])[0]}")
            continue
        captured = _captured(ep, mode, model, "; ".join(errors), _WRAPPED if cache else "")
        captured.mixers = sites
        return captured
    raise UnsupportedModelError("torch.export could not capture the forward: " + "; ".join(errors))


def _captured(
    ep: torch.export.ExportedProgram, mode: str, model: PreTrainedModel, errors: str, prefix: str
) -> CapturedGraph:
    """The graph of an export in ``mode``, its tensors named without ``prefix``. A relaxed export
    whose guards fail short of the model's context is kept as a specialized graph: classifying it
    says what the model is (re-exporting statically would say the same, slower)."""
    _unwrap_module_stack(ep.graph, prefix)
    canonical = _canonical_names(model)
    unwrapped = {name: name.removeprefix(prefix) for name in (*ep.state_dict, *ep.constants)}
    names = {name: canonical.get(bare, bare) for name, bare in unwrapped.items()}
    if mode == "static":
        return _to_get_attr_graph(ep, names, _ONE_LENGTH, specialized=errors)
    try:
        limit = _relaxed_limit(ep, _context_length(model)) if mode == "relaxed" else None
    except _Specialized as err:
        return _to_get_attr_graph(ep, names, _ONE_LENGTH, specialized=str(err))
    captured = _to_get_attr_graph(ep, names, "", max_positions=limit)
    if not takes_positions(model):
        captured.recompute = _NO_POSITIONS
    elif key_length_tied(captured.graph):
        captured.recompute = _TIED
    return captured


def _unwrap_module_stack(graph: fx.Graph, prefix: str) -> None:
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


_ONE_LENGTH = "the graph holds for one sequence length only"
_NO_POSITIONS = "the forward takes no position_ids, so new tokens find their positions only from the whole prefix"
_TIED = "the graph ties the key length to the token count"


class _Specialized(Exception):
    """A relaxed capture that holds for too few lengths."""


def _context_length(model: PreTrainedModel) -> int | None:
    return getattr(model.config.get_text_config(), "max_position_embeddings", None)


def _relaxed_limit(ep: torch.export.ExportedProgram, context: int | None) -> int | None:
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
        raise _Specialized("the graph asserts a relation between the lengths")
    inputs = {n.name: n.meta["val"] for n in ep.graph.find_nodes(op="placeholder")}
    seq, keys = inputs["input_ids"].shape[1], inputs["attention_mask"].shape[1]
    for dim in (seq, keys):
        if not isinstance(dim, torch.SymInt):
            raise _Specialized(f"a token dimension is specialized to {dim}")
    shape_env = seq.node.shape_env
    s, kv = seq.node.expr, keys.node.expr
    guards = {str(e): e for g in shape_env.guards if (e := shape_env.replace(g.expr)).free_symbols & {s, kv}}
    valid = None
    for length in _PROBES:
        # queries at the end of the keys: as many as the keys, the fewest, or half of them
        for queries, key_length in {(length, length), (2, length), (length, 2 * length)}:
            if s == kv and queries != key_length:
                continue
            values = {s: queries, kv: key_length}
            for guard in guards.values():
                point = {x: sympy.Integer(values.get(x, 3)) for x in guard.free_symbols}  # 3: any batch
                if not bool(guard.xreplace(point)):
                    if valid is None or (context is not None and valid < context - 1):
                        raise _Specialized(f"the graph holds only up to {valid} positions ({guard})")
                    return valid
        valid = length
    return None


# Lengths at which a relaxed capture's guards are checked (see _relaxed_limit).
_PROBES = sorted({*range(2, 257), *(2**e + d for e in range(8, 21) for d in (-1, 0, 1))})


def _canonical_names(model: PreTrainedModel) -> dict[str, str]:
    """Each name a parameter or buffer is reachable by -> the one ``named_parameters()`` /
    ``named_buffers()`` report: a tied weight (embedding and LM head) has several, and export
    may lift it under any of them."""
    first: dict[int, str] = {}
    tensors = itertools.chain(
        model.named_parameters(remove_duplicate=False), model.named_buffers(remove_duplicate=False)
    )
    return {name: first.setdefault(id(t), name) for name, t in tensors}


def _to_get_attr_graph(
    ep: torch.export.ExportedProgram,
    canonical: dict[str, str] | None = None,
    recompute: str = _ONE_LENGTH,
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
