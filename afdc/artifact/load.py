"""Loading a compiled artifact: each rank's program bound to its own weights, read from the files.

:func:`load` gives one rank, :func:`load_deployment` every rank in this process. The manifest's format version and the
SHA-256 of every file read are checked first (:mod:`afdc.artifact.manifest`).
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.utils._pytree as pytree
from safetensors.torch import load_file
from transformers import AutoConfig, GenerationConfig, PretrainedConfig

from afdc.artifact import manifest as mf
from afdc.artifact.program_format import load_program
from afdc.codegen import fp8_linear as _fp8_linear_op  # noqa: F401 (registers the quantized ops programs call)
from afdc.codegen import fused_moe_quant as _fused_moe_quant_ops  # noqa: F401
from afdc.codegen import packed_linear as _packed_linear_op  # noqa: F401
from afdc.runtime.exchange import deployment_id
from afdc.runtime.mixer_modules import Mixers
from afdc.runtime.model import DisaggregatedModel, ModelTraits
from afdc.runtime.programs import AttentionProgram, FFNProgram
from afdc.runtime.rendezvous import Layout
from afdc.runtime.tensor_parallel import TensorParallelAttention
from afdc.runtime.transport import ConnectorKind
from afdc.segment import SegmentBinding


def model_dir(directory: str | Path) -> Path:
    """The artifact's ``model/`` directory (config and tokenizer, for a serving engine), verified."""
    directory = Path(directory)
    manifest = mf.read_manifest(directory)
    if not manifest.model_files:
        raise mf.ArtifactError(
            f"{directory} holds no model config and tokenizer ({mf.MODEL_DIR}/): it was compiled without weights "
            "or by an older afdc; compile it again from the model directory to serve it"
        )
    mf.verify(directory, manifest, manifest.model_files)
    return directory / mf.MODEL_DIR





def _load_weights(
    directory: Path, manifest: mf.Manifest, role: str, rank: int, device, tp_rank: int = 0
) -> dict[str, torch.Tensor]:
    files = manifest.rank_files(role, rank, tp_rank).weights
    if not manifest.weights_included:
        raise mf.ArtifactError(
            f"{directory} was compiled with --no-weights (a plan only); compile it again with weights to run it"
        )
    mf.verify(directory, manifest, files)
    tensors: dict[str, torch.Tensor] = {}
    for rel in files:
        state = rel.endswith("-state.safetensors")
        for name, t in load_file(directory / rel, device=str(device)).items():
            tensors[name] = t if state else torch.nn.Parameter(t, requires_grad=False)
    return tensors


def load(
    directory: str | Path,
    role: str,
    rank: int = 0,
    device: str | torch.device = "cpu",
    backend: str | None = None,
    tp_rank: int | None = None,
) -> AttentionProgram | TensorParallelAttention | FFNProgram:
    """Rank ``rank`` of role ``attn`` or ``ffn`` of a compiled artifact, with only its own weights,
    on ``device``, run by ``backend`` (default: the one the artifact was compiled with).

    Under ``--attn-tp N`` an attention rank is N TP ranks: all of them, run as threads of this
    process, or with ``tp_rank`` only that one (it then runs inside a TP group, see
    :mod:`afdc.runtime.tensor_parallel`). The manifest's format version and the SHA-256 of every
    file read are checked first.
    """
    directory = Path(directory)
    manifest = mf.read_manifest(directory)
    tp = manifest.plan.attention_tp if role == "attn" else 1
    shards = [tp_rank] if tp_rank is not None else list(range(tp))
    programs = [_load(directory, manifest, role, rank, torch.device(device), t) for t in shards]
    program = programs[0] if len(programs) == 1 else TensorParallelAttention(programs)
    program.use_backend(backend or manifest.plan.backend)
    return program


def _load(
    directory: Path, manifest: mf.Manifest, role: str, rank: int, device: torch.device, tp_rank: int
) -> AttentionProgram | FFNProgram:
    manifest.rank_files(role, rank, tp_rank)  # a clear error for a role or rank the plan does not have
    weights = _load_weights(directory, manifest, role, rank, device, tp_rank)
    if role == "attn":
        return _attention(directory, manifest, weights, device)
    mf.verify(directory, manifest, [s.program for s in manifest.segments])
    segments = [s.segment(load_program(directory / s.program, {}, device).graph) for s in manifest.segments]
    layers = [SegmentBinding(lay.segment, lay.weights) for lay in manifest.layers]
    return FFNProgram(segments=segments, layers=layers, weights=weights, rank=rank)


# A model's own output class (a multimodal wrapper's, e.g. Qwen3VLMoeCausalLMOutputWithPast) is
# registered with pytree when its transformers module is imported, which a fresh process (a serving
# worker) has not done: only such a module, named as transformers names them, is imported.
_MODEL_OUTPUT = re.compile(r"(transformers\.models\.[a-z0-9_]+\.modeling_[a-z0-9_]+)\.[A-Za-z0-9_]+")


def output_spec(text: str) -> pytree.TreeSpec:
    """The program's output structure from the manifest, its model output classes registered first."""
    def types(node) -> list[str]:
        if not isinstance(node, dict):
            return []
        return [str(node.get("type"))] + [t for child in node.get("children_spec") or [] for t in types(child)]

    try:
        spec = json.loads(text)
    except json.JSONDecodeError as err:
        raise mf.ArtifactError(f"the manifest's output_spec is not JSON: {err}") from None
    for name in types(spec[1] if isinstance(spec, list) and len(spec) == 2 else None):
        module = _MODEL_OUTPUT.fullmatch(name)
        if module and _installed(module.group(1)):
            importlib.import_module(module.group(1))
    try:
        return pytree.treespec_loads(text)
    except (NotImplementedError, ValueError, TypeError) as err:
        raise mf.ArtifactError(f"the manifest's output_spec cannot be read here: {err}") from None


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # its model package is not in this transformers
        return False


def _attention(directory: Path, manifest: mf.Manifest, weights: dict[str, torch.Tensor],
               device: torch.device) -> AttentionProgram:
    mf.verify(directory, manifest, [manifest.attention_program])
    module = load_program(directory / manifest.attention_program, weights, device)
    return AttentionProgram(module, output_spec(manifest.output_spec), _mixers(directory, manifest))


def load_with_drafter(
    directory: str | Path, rank: int = 0, device: str | torch.device = "cpu", backend: str | None = None
) -> tuple[AttentionProgram, AttentionProgram | None]:
    """Attention rank ``rank`` (one TP rank) and the artifact's drafter (its model's MTP layer,
    :mod:`afdc.mtp`; None when it has none), both reading the rank's weights, loaded once: its
    file holds both programs' weights."""
    directory, device = Path(directory), torch.device(device)
    manifest = mf.read_manifest(directory)
    if manifest.drafter is None:
        return load(directory, "attn", rank, device, backend), None
    if manifest.plan.attention_tp != 1:
        raise mf.ArtifactError(f"{directory}: its drafter runs on one attention TP rank; the plan has "
                               f"{manifest.plan.attention_tp}")
    weights = _load_weights(directory, manifest, "attn", rank, device)
    program = _attention(directory, manifest, weights, device)
    mf.verify(directory, manifest, [manifest.drafter.program])
    drafter = AttentionProgram(load_program(directory / manifest.drafter.program, weights, device),
                               output_spec(manifest.drafter.output_spec))
    for p in (program, drafter):
        p.use_backend(backend or manifest.plan.backend)
    return program, drafter


def _mixers(directory: Path, manifest: mf.Manifest) -> Mixers | None:
    """The stateful mixers' modules, rebuilt from the model's config with no weights of their own:
    each call runs its module's code with the weights the op passes."""
    if not manifest.mixers:
        return None
    config = _config(directory)
    if config is None:
        raise mf.ArtifactError(f"{directory} holds no model config ({mf.MODEL_DIR}/config.json): its mixers need it")
    return Mixers.from_config(manifest.mixers, config)


def _config(directory: Path) -> PretrainedConfig | None:
    """The model's config; None for an artifact compiled without weights (no model files)."""
    files = directory / mf.MODEL_DIR
    return AutoConfig.from_pretrained(files) if (files / "config.json").is_file() else None


def _generation_config(directory: Path, config: PretrainedConfig | None) -> GenerationConfig | None:
    """What the model's own ``generate`` decodes with: its checkpoint's generation config, else
    ``config``'s defaults; None without either."""
    files = directory / mf.MODEL_DIR
    if (files / "generation_config.json").is_file():
        return GenerationConfig.from_pretrained(files)
    return GenerationConfig.from_model_config(config) if config is not None else None


def deployment_of(directory: str | Path) -> tuple[Layout, bytes]:
    """The slots of an artifact's plan and the id its ranks check on every message (from the
    manifest's bytes, so ranks of different compiles never mix)."""
    manifest = mf.read_manifest(Path(directory))
    raw = (Path(directory) / mf.MANIFEST).read_bytes()
    return Layout(manifest.plan.attention_ranks, manifest.plan.ffn_ranks), deployment_id(raw)


def load_deployment(
    directory: str | Path,
    device: str | torch.device = "cpu",
    connector: ConnectorKind | str = ConnectorKind.GLOO,
    backend: str | None = None,
) -> DisaggregatedModel:
    """Every rank of an artifact in this process, joined by the loopback connector;
    ``dm.launch()`` moves the FFN ranks to server processes over ``connector``."""
    directory = Path(directory)
    manifest = mf.read_manifest(directory)
    plan = manifest.plan
    attention = [load(directory, "attn", a, device, backend) for a in range(plan.attention_ranks)]
    ffn = [load(directory, "ffn", r, device, backend) for r in range(plan.ffn_ranks)]
    config = _config(directory)
    traits = ModelTraits(
        incremental=manifest.incremental_decode,
        report=None,
        config=config,
        generation_config=_generation_config(directory, config),
        max_positions=manifest.max_positions,
    )
    return DisaggregatedModel(
        attention=attention,
        ffn=ffn,
        traits=traits,
        micro_batches=plan.micro_batches,
        deployment=deployment_of(directory)[1],
        ffn_source=FFNRankLoader(directory, str(ffn[0].device), ffn[0].backend),
        connector=connector,
    )


@dataclass(frozen=True)
class FFNRankLoader:
    """Loads FFN rank ``r`` of an artifact (``loader(r)``): what a launched FFN server process runs,
    so that it reads its weights from the files rather than from this process."""

    directory: Path
    device: str
    backend: str

    def __call__(self, rank: int) -> FFNProgram:
        return load(self.directory, "ffn", rank, self.device, self.backend)
