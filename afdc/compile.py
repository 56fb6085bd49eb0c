"""``afdc compile``: a deployable artifact for one plan, and ``afdc.load`` to run a rank of it.

The model is built on the meta device and captured there, so compiling a plan needs no weights
and no memory for them. With weights, the checkpoint is streamed tensor by tensor into one
safetensors file per rank, each holding only what that rank runs. Everything is written to a
temporary directory that is renamed into place once complete; the manifest is written last.

Layout (see docs/artifact.md)::

    manifest.json                 plan, boundary specs, ranks -> files, SHA-256 of every file
    programs/attention.json       the attention program (its FX graph as data)
    programs/ffn_segment_<i>.json FFN segment programs, shared by layers of the same structure
    weights/attn.safetensors      attention-side weights (every attention rank loads it)
    weights/attn-tp<t>.safetensors  instead, under --attn-tp N: TP rank t's heads (and the whole rest)
    weights/ffn-<r>.safetensors   FFN rank r's experts (EP) or shards (TP)
    weights/*-state.safetensors   buffers no checkpoint holds (rotary tables), computed from the config
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.utils._pytree as pytree
from safetensors.torch import save_file
from transformers import PretrainedConfig, PreTrainedModel

from afdc.api import Built, build, mixer_table
from afdc.artifact import manifest as mf
from afdc.artifact.checkpoint import Checkpoint
from afdc.artifact.program_format import write_program
from afdc.artifact.reshard import FileDigest, TargetFile, TargetTensor, reshard
from afdc.errors import AfdcError, UnsupportedModelError
from afdc.mtp import backbone as mtp_backbone
from afdc.mtp import drafter as mtp_drafter
from afdc.mtp import mtp_layers
from afdc.ops import RecvCall, SendCall
from afdc.plan import TORCH_DTYPES, Plan
from afdc.quant.scheme import QuantScheme, recognise, scheme_from_config
from afdc.report import Crossing as ReportCrossing
from afdc.segment import Split
from afdc.source import empty_model, load_config
from afdc.version import __version__

# What a serving engine reads besides the programs: the model's config and its tokenizer.
HF_FILES = (
    "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
    "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "chat_template.json",
)


def _config_sha256(config: PretrainedConfig) -> str:
    return hashlib.sha256(json.dumps(config.to_dict(), sort_keys=True, default=str).encode()).hexdigest()


def _checkpoint_dir(source: str, revision: str | None) -> Path:
    path = Path(source)
    if path.is_dir():
        return path
    if path.is_file():
        raise AfdcError(f"{source} is a config file, which holds no weights: pass --no-weights, or a model directory")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:  # the standard Hugging Face cache; honours HF_HUB_OFFLINE
        return Path(snapshot_download(source, revision=revision, allow_patterns=["*.safetensors", *HF_FILES]))
    except (LocalEntryNotFoundError, HfHubHTTPError, OSError) as err:
        raise AfdcError(
            f"cannot get the weights of {source!r} ({err}); download them into the Hugging Face cache, "
            "pass a local model directory, or compile with --no-weights"
        ) from err


def _computed_state(
    model: PreTrainedModel, names: set[str], captured: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """Buffers the programs read that no checkpoint holds (rotary tables, embedding scales), computed
    the way ``from_pretrained`` does after a meta-device load: real storage, then the model's own
    ``_init_weights`` on the modules that own them; and the constants the forward creates, as
    captured (on the meta device only those made from Python numbers keep their value)."""
    buffers = dict(model.named_buffers(remove_duplicate=False))
    constants = {n: captured[n] for n in names if n not in buffers}
    lost = sorted(n for n, c in constants.items() if c.is_meta)
    if lost:
        raise UnsupportedModelError(
            f"the forward creates tensor constants ({', '.join(lost[:4])}) from data a meta-device capture does "
            "not hold; afdc compile cannot write this model (afdc.disaggregate on the loaded model still works)"
        )
    names = names - constants.keys()
    owners = {}
    for name in sorted(names):
        owner, _, leaf = name.rpartition(".")
        module = model.get_submodule(owner)
        value = torch.empty_like(buffers[name], device="cpu")
        if value.is_floating_point():
            value.fill_(float("nan"))  # so that a buffer the init leaves alone is caught below
        module.register_buffer(leaf, value, persistent=False)
        owners[owner] = module
    with torch.no_grad():
        for owner, module in owners.items():
            _initializer(model, owner)._init_weights(module)
    state = {n: model.get_buffer(n) for n in sorted(names)}
    unset = [n for n, v in state.items() if v.is_floating_point() and v.isnan().any()]
    if unset:
        raise UnsupportedModelError(f"the model's _init_weights does not compute {', '.join(unset)}; cannot write it")
    return {**state, **constants}


def _initializer(model: PreTrainedModel, owner: str) -> PreTrainedModel:
    """The innermost pretrained model holding module ``owner`` (the module itself included): whose
    ``_init_weights`` ``from_pretrained`` runs on it (Gemma 3n's text model reads its own
    ``hidden_size`` there, which the causal-LM wrapper does not have)."""
    parts = owner.split(".") if owner else []
    for end in range(len(parts), 0, -1):
        module = model.get_submodule(".".join(parts[:end]))
        if isinstance(module, PreTrainedModel):
            return module
    return model


def _refuse_taken(out: Path, force: bool) -> None:
    if out.exists() and not force:
        raise AfdcError(f"{out} already exists; choose another output directory or pass --force to replace it")


@contextlib.contextmanager
def _staging(out: Path, force: bool) -> Iterator[Path]:
    """A temporary directory beside ``out`` that becomes ``out`` only if the block completes."""
    _refuse_taken(out, force)  # again: it may have been taken while this compiled
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _crossings(crossings: list[ReportCrossing], reduce: list[str] | None = None) -> list[mf.Crossing]:
    return [
        mf.Crossing(c.name, c.shape_per_token, c.dtype, reduce[i] if reduce else "") for i, c in enumerate(crossings)
    ]


def _unpageable(built: Built, model: PreTrainedModel) -> str:
    """Why serving's paged KV cache cannot run the attention program ("": it may; the worker
    checks each attention call's mask when it loads), found when compiling so that ``afdc
    serve`` refuses before vLLM starts: decode that recomputes the prefix, or a stateful mixer
    whose growing state serving has no fixed-size form for (the worker's own check, run here on
    the meta-device modules)."""
    if built.recompute:
        return f"this model's decode recomputes the prefix ({built.recompute})"
    mixers = mixer_table(model, built.mixers)
    if mixers:
        try:
            mixers.bound(_BOUND_PROBE, torch.float32)
        except UnsupportedModelError as err:
            return str(err)
    return ""


# a context to size bounded mixer states with when checking that serving can hold them: any does
_BOUND_PROBE = 1024


def _attention_file(tp_rank: int, tp: int) -> str:
    return "attn" if tp == 1 else f"attn-tp{tp_rank}"


def _numbered_after(drafter: Built, target: Built) -> Built:
    """``drafter``'s FFN layers and segments numbered after ``target``'s: one FFN program serves
    both, the drafter's layers as its last ones (its segments are then the target's and its own)."""
    layers, segments = len(target.layers), len(target.segments)
    for node in drafter.attention_graph.nodes:
        if node.op == "call_function" and node.target in (SendCall.OP, RecvCall.OP):
            node.args = (node.args[0], node.args[1] + layers, *node.args[2:])
    numbered = [dataclasses.replace(lay, index=lay.index + layers, segment=lay.segment + segments)
                for lay in drafter.report.layers]
    report = dataclasses.replace(drafter.report, layers=numbered)
    return dataclasses.replace(drafter, report=report, segments=target.segments + drafter.segments, layers=[
        dataclasses.replace(b, segment=b.segment + segments) for b in drafter.layers
    ])


def _no_drafter(model: PreTrainedModel, built: Built, scheme: QuantScheme | None, checkpoint: Path | None) -> str:
    """Why a model with MTP layers gets no drafter compiled beside it, every reason ("": it gets
    one); serving refuses ``--speculative-config`` MTP with them. afdc's drafter runs on one
    attention TP rank and on a flat batch (steps of a model with sparse-attention indexers run as
    rows of a padded batch, which its passes do not), from the checkpoint's unquantized MTP weights."""
    why = []
    if built.plan.attention_tp > 1:
        why.append(f"the plan has --attn-tp {built.plan.attention_tp} and afdc runs the MTP drafter on one "
                   "attention TP rank (compile without --attn-tp to serve it)")
    if built.attention_graph.find_nodes(op="call_function", target=torch.ops.afdc.cached_keys.default):
        why.append("the model's attention has sparse-attention indexers, which afdc's MTP drafter does not run yet")
    if scheme is not None:
        why.append(f"the checkpoint is quantized ({scheme.method}) and afdc does not compile a quantized MTP "
                   "layer yet")
    try:
        mtp_backbone(model)
    except UnsupportedModelError as err:  # a multimodal wrapper's language model (GLM-4.5V's)
        why.append(str(err))
    if checkpoint is None:
        why.append("it was compiled without weights (plan only)")
    else:
        prefix = f"layers.{model.config.get_text_config().num_hidden_layers}."
        if not any(prefix in key for key in Checkpoint.discover(checkpoint).tensors):
            why.append("the checkpoint ships no weights of its MTP layers")
    return "; ".join(why)


def _build_drafter(model: PreTrainedModel, built: Built, scheme: QuantScheme | None,
                   checkpoint: Path | None) -> tuple[Built | None, str]:
    """The model's MTP drafter (:mod:`afdc.mtp`) built for the same plan, its FFN layers after the
    model's, or None and why not (the model compiled alone; "" for a model without MTP layers)."""
    if not mtp_layers(model.config):
        return None, ""
    why = _no_drafter(model, built, scheme, checkpoint)
    return (None, why) if why else (_numbered_after(build(mtp_drafter(model), built.plan), built), "")


def _rank_targets(built: Built, drafter: Built | None = None) -> dict[str, list[TargetTensor]]:
    """Weight file name -> the tensors it holds (the drafter's beside the model's)."""
    targets: dict[str, list[TargetTensor]] = {}
    y, tp = built.plan.ffn_ranks, built.plan.attention_tp
    whole = Split()
    programs = [built, drafter] if drafter is not None else [built]
    attention_splits = {n: s for b in programs for n, s in b.attention_splits.items()}
    view = {n: v for b in programs for n, v in b.views.items()}.get
    names = sorted({n for b in programs for n in b.attention_names()})
    for t in range(tp):
        targets[_attention_file(t, tp)] = [
            TargetTensor(n, attention_splits.get(n, whole).slice(t, tp), view(n)) for n in names
        ]
    splits = {n: s for b in programs for n, s in b.ffn_splits().items()}
    for r in range(y):
        targets[f"ffn-{r}"] = [TargetTensor(n, s.slice(r, y), view(n)) for n, s in sorted(splits.items())]
    return targets


def compile_model(
    source: str,
    plan: str | Plan,
    out: str | Path,
    *,
    weights: bool = True,
    revision: str | None = None,
    force: bool = False,
    progress: bool = True,
) -> mf.Manifest:
    """Compile ``source`` (hub id, model directory or config file) for ``plan`` into ``out``."""
    plan = Plan.parse(plan)
    out = Path(out)
    _refuse_taken(out, force)  # before the compile, not after it
    config = load_config(source)
    dtype = TORCH_DTYPES[plan.dtype] if plan.dtype else None
    model = empty_model(config, dtype)
    checkpoint = _checkpoint_dir(source, revision) if weights else None
    scheme = quant_scheme(config, model, checkpoint)
    built = build(model, plan, scheme)
    drafter, no_drafter = _build_drafter(model, built, scheme, checkpoint)
    checkpointed = set(model.state_dict()) | (set(built.quant.tensors()) if built.quant else set())
    targets = _rank_targets(built, drafter)
    programs = [built, drafter] if drafter is not None else [built]
    all_segments = programs[-1].segments
    attrs = {n: t for b in programs for n, t in b.attrs.items()}
    state = _computed_state(model, {t.name for ts in targets.values() for t in ts} - checkpointed, attrs)

    with _staging(out, force) as tmp:
        (tmp / "programs").mkdir()
        (tmp / "weights").mkdir()
        written = ["programs/attention.json"]
        write_program(built.attention_graph, tmp / written[0])
        if drafter is not None:
            written.append("programs/drafter.json")
            write_program(drafter.attention_graph, tmp / written[-1])
        segments = []
        for i, seg in enumerate(all_segments):
            rel = f"programs/ffn_segment_{i}.json"
            write_program(seg.graph, tmp / rel)
            written.append(rel)
            segments.append(mf.SegmentSpec.of(rel, seg))

        files: dict[str, list[str]] = {}
        to_stream = []
        for name, tensors in targets.items():
            files[name] = []
            own = [t for t in tensors if t.name in state]
            if own:
                rel = f"weights/{name}-state.safetensors"
                save_file({t.name: t.slice.take(state[t.name]).contiguous() for t in own}, tmp / rel)
                files[name].append(rel)
            streamed = [t for t in tensors if t.name not in state]
            if weights and streamed:
                rel = f"weights/{name}.safetensors"
                to_stream.append(TargetFile(tmp / rel, streamed))
                files[name].append(rel)
        # The resharder hashes as it writes; only the small files are hashed here.
        stored = built.quant.tensors() if built.quant else {}
        digests = reshard(checkpoint, model, to_stream, dtype, progress, stored) if to_stream else {}
        written += [rel for rels in files.values() for rel in rels]
        model_files = _copy_hf_files(checkpoint, tmp) if checkpoint is not None else []
        written += model_files

        ranks = [
            mf.RankFiles("attn", a, files[_attention_file(t, plan.attention_tp)], t)
            for a in range(plan.attention_ranks)
            for t in range(plan.attention_tp)
        ]
        ranks += [mf.RankFiles("ffn", r, files[f"ffn-{r}"]) for r in range(plan.ffn_ranks)]
        manifest = mf.Manifest(
            afdc_version=__version__,
            source=mf.Source(source, revision, config.model_type, _config_sha256(config)),
            plan=plan,
            weights_included=weights,
            decode_recomputes=built.recompute,
            attention_program=written[0],
            output_spec=pytree.treespec_dumps(built.out_spec),
            segments=segments,
            layers=[
                mf.LayerSpec(
                    index=lr.index,
                    module=lr.module,
                    kind=lr.kind,
                    segment=lr.segment,
                    ffn_split=lr.ffn_split,
                    weights=binding.weights,
                    to_ffn=_crossings(lr.to_ffn),
                    to_attn=_crossings(lr.to_attn, all_segments[lr.segment].reduce),
                )
                for b in programs
                for lr, binding in zip(b.report.layers, b.layers)
            ],
            ranks=ranks,
            files=[_file_entry(tmp, rel, digests) for rel in written],
            model_files=model_files,
            attention_splits=built.attention_splits,
            mixers=built.mixers,
            unpageable=_unpageable(built, model),
            max_positions=built.max_positions,
            quant=mf.QuantSpec.of(built.quant) if built.quant else None,
            drafter=mf.DrafterSpec("mtp", "programs/drafter.json", pytree.treespec_dumps(drafter.out_spec),
                                   [lay.index for lay in drafter.report.layers]) if drafter is not None else None,
            no_drafter=no_drafter,
        )
        (tmp / mf.MANIFEST).write_text(manifest.to_json())
    return manifest


def quant_scheme(config: PretrainedConfig, model: PreTrainedModel, checkpoint: Path | None) -> QuantScheme | None:
    """The checkpoint's quantization, recognised from its safetensors headers (from the config
    alone for a plan compiled without weights); None for an unquantized model."""
    if checkpoint is None:
        return scheme_from_config(config, model)
    return recognise(config, Checkpoint.discover(checkpoint).tensors, model)


def quant_note(manifest: mf.Manifest) -> str:
    """What the compile did with a quantized checkpoint: the scheme, that ``--dtype`` converts only
    the unquantized tensors, and the bytes each FFN rank holds (quantized weights with their scales)."""
    quant = manifest.quant
    if quant is None:
        return ""
    kept = f"{len({t.parameter for t in quant.tensors.values()})} quantized weights and their scales stay as stored"
    dtype = manifest.plan.dtype
    note = f"quantized checkpoint ({quant.summary}): " + (
        f"--dtype {dtype} converts the unquantized tensors only; {kept}" if dtype else kept
    )
    sizes = {f.path: f.bytes for f in manifest.files}
    ffn = [sum(sizes.get(rel, 0) for rel in r.weights) for r in manifest.ranks if r.role == "ffn"]
    if manifest.weights_included:
        note += "; FFN rank files " + ", ".join(f"{b / 1e6:,.2f} MB" for b in ffn)
    return note


def _copy_hf_files(checkpoint: Path, out: Path) -> list[str]:
    (out / mf.MODEL_DIR).mkdir()
    copied = []
    for name in HF_FILES:
        if (checkpoint / name).is_file():
            shutil.copyfile(checkpoint / name, out / mf.MODEL_DIR / name)
            copied.append(f"{mf.MODEL_DIR}/{name}")
    return copied


def _file_entry(directory: Path, rel: str, digests: dict[Path, FileDigest]) -> mf.FileEntry:
    digest = digests.get(directory / rel)
    if digest is not None:
        return mf.FileEntry(rel, digest.sha256, digest.size)
    return mf.FileEntry(rel, mf.sha256_file(directory / rel), (directory / rel).stat().st_size)
