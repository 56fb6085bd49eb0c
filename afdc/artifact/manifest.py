"""``manifest.json``: what an artifact holds, for which plan, and the hash of every file.

The manifest is written last, after every other file is complete and hashed: an artifact
directory with a manifest is whole. Loading checks the format version and each file's size and
SHA-256 before anything is used.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path, PurePosixPath

import torch.fx as fx

from afdc.errors import AfdcError
from afdc.mixer_site import MixerSite, QuantizedLinear, StateTensor
from afdc.plan import Plan
from afdc.quant.stored import QuantizedTensors
from afdc.segment import Dispatch, ExpertRouting, IndexBound, Segment, Split, check_index_bounds

# 6: the quantization scheme per stored tensor (``quant``); 5: programs as graph data (4 and before:
# Python source, executed on load)
FORMAT_VERSION = 6
MANIFEST = "manifest.json"
MODEL_DIR = "model"  # the model's config and tokenizer files, as a serving engine reads them
VOCABULARY_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")  # a tokenizer has one of them


class ArtifactError(AfdcError):
    """An artifact directory is missing, incomplete, corrupted or from another format."""


@dataclass
class FileEntry:
    path: str  # relative to the artifact directory
    sha256: str
    bytes: int


@dataclass
class Crossing:
    """A value crossing the cut, per token."""

    name: str
    shape_per_token: list[int] | None
    dtype: str
    reduce: str = ""  # FFN outputs: how the FFN ranks' copies combine ("sum", "first" or "rows")


@dataclass(kw_only=True)
class LayerSpec:
    """One FFN layer: where it sits, which segment program runs it, what crosses each way."""

    index: int
    module: str
    kind: str  # "dense" or "moe"
    segment: int
    ffn_split: str  # "ep", "tp" or "replicated"
    weights: list[str]  # bound, in order, to the segment program's weight inputs
    to_ffn: list[Crossing]
    to_attn: list[Crossing]


@dataclass
class SegmentSpec:
    program: str  # file of the segment program
    splits: list[Split]  # per weight input: how the FFN ranks hold it
    reduce: list[str]  # per output
    inputs: list[list[int] | None]  # per activation input: shape at batch 1 and T tokens (-k: k*T)
    routing: ExpertRouting | None = None  # expert-parallel: tokens go only to their experts' ranks
    # the inputs the segment indexes with and their ranges (an artifact compiled before them has none)
    index_bounds: list[IndexBound] = field(default_factory=list)

    def __post_init__(self):
        check_index_bounds(self.index_bounds, len(self.inputs))

    @classmethod
    def from_dict(cls, d: dict) -> SegmentSpec:
        routing = ExpertRouting(**d["routing"]) if d.get("routing") else None
        bounds = [IndexBound(**b) for b in d.get("index_bounds", [])]
        return cls(d["program"], [Split(**s) for s in d["splits"]], d["reduce"], d["inputs"], routing, bounds)

    @classmethod
    def of(cls, program: str, segment: Segment) -> SegmentSpec:
        """The spec of ``segment``, whose graph is written to ``program``."""
        return cls(program, list(segment.splits), list(segment.reduce), list(segment.inputs), segment.routing,
                   list(segment.index_bounds))

    def segment(self, graph: fx.Graph) -> Segment:
        """The segment this spec describes, running ``graph`` (its program, read back)."""
        return Segment(
            graph=graph, splits=tuple(self.splits), reduce=tuple(self.reduce), inputs=tuple(self.inputs),
            routing=self.routing, index_bounds=tuple(self.index_bounds),
        )

    def dispatch(self) -> Dispatch:
        """How an attention rank sends this segment's tokens and combines its replies."""
        return Dispatch(tuple(self.reduce), tuple(self.inputs), self.routing, tuple(self.index_bounds))


@dataclass
class QuantTensor:
    """A stored tensor of a quantized parameter: which parameter, what part of it, in which format."""

    parameter: str
    role: str  # "data", "scale" or "input_scale"
    format: str  # afdc.quant.scheme.QuantFormat's value: fp8-block, fp8-channel, fp8-tensor, mxfp4
    block: list[int]  # elements of the parameter one scale covers, along each of its dims
    shape: list[int]  # the stored tensor's full shape
    dtype: str


@dataclass
class QuantSpec:
    """The checkpoint's quantization as the artifact keeps it (the checkpoint's bytes, nothing widened)."""

    method: str  # quant_method: fp8, compressed-tensors, mxfp4
    activation_scheme: str
    summary: str
    tensors: dict[str, QuantTensor]  # by stored name

    @classmethod
    def of(cls, quant: QuantizedTensors) -> QuantSpec:
        scheme = quant.scheme
        tensors = {
            t.name: QuantTensor(t.parameter, t.role.value, t.format.value, list(scheme.parameter(t.parameter).block),
                                list(t.shape), str(t.dtype).removeprefix("torch."))
            for t in quant.tensors().values()
        }  # fmt: skip
        return cls(scheme.method, scheme.activation_scheme, scheme.describe(), tensors)

    @classmethod
    def from_dict(cls, d: dict) -> QuantSpec:
        return cls(d["method"], d["activation_scheme"], d["summary"],
                   {n: QuantTensor(**t) for n, t in d["tensors"].items()})


@dataclass
class DrafterSpec:
    """The drafter of speculative decoding compiled into the artifact: the model's own MTP layer
    (:mod:`afdc.mtp`), an attention program of its own whose FFN layers are the manifest's last."""

    method: str  # "mtp"
    program: str  # its attention program
    output_spec: str  # pytree spec of its result (``treespec_dumps``)
    layers: list[int]  # its FFN layers' indices in ``Manifest.layers``


@dataclass
class RankFiles:
    role: str  # "attn" or "ffn"
    rank: int
    weights: list[str]  # safetensors files this rank loads (all of them, nothing else)
    tp_rank: int = 0  # under --attn-tp N, an attention rank has one entry per TP rank


@dataclass
class Source:
    model: str  # hub id, directory or config file as given
    revision: str | None
    model_type: str
    config_sha256: str  # of the config as JSON with sorted keys


@dataclass(kw_only=True)
class Manifest:
    afdc_version: str
    source: Source
    plan: Plan
    weights_included: bool
    decode_recomputes: str  # why decode recomputes the prefix ("": it decodes against the KV cache)
    attention_program: str
    output_spec: str  # pytree spec of the attention program's result (``treespec_dumps``)
    segments: list[SegmentSpec]
    layers: list[LayerSpec]
    ranks: list[RankFiles]
    files: list[FileEntry] = field(default_factory=list)
    model_files: list[str] = field(default_factory=list)  # config and tokenizer files under MODEL_DIR
    attention_splits: dict[str, Split] = field(default_factory=dict)  # --attn-tp: split attention weights
    max_positions: int | None = None  # the longest key length the programs are valid for (None: any)
    # the attention program's stateful mixers: the modules they run (rebuilt from the model's config)
    # and the state each keeps per sequence
    mixers: list[MixerSite] = field(default_factory=list)
    unpageable: str = ""  # why a paged KV cache (vLLM serving) cannot run the attention program ("": it can)
    quant: QuantSpec | None = None  # a quantized checkpoint's stored tensors (None: not quantized)
    drafter: DrafterSpec | None = None  # the model's MTP drafter (None: the checkpoint has none)
    no_drafter: str = ""  # why a model with MTP layers has no drafter compiled ("": it has, or has no MTP layers)
    format_version: int = FORMAT_VERSION

    @property
    def incremental_decode(self) -> bool:
        return not self.decode_recomputes

    @property
    def has_tokenizer(self) -> bool:
        return any(PurePosixPath(f).name in VOCABULARY_FILES for f in self.model_files)

    def rank_files(self, role: str, rank: int, tp_rank: int = 0) -> RankFiles:
        for r in self.ranks:
            if r.role == role and r.rank == rank and r.tp_rank == tp_rank:
                return r
        count = len({r.rank for r in self.ranks if r.role == role})
        if role not in ("attn", "ffn"):
            raise ArtifactError(f"role {role!r} is not 'attn' or 'ffn'")
        if 0 <= rank < count:
            tp = self.plan.attention_tp if role == "attn" else 1
            raise ArtifactError(
                f"plan {self.plan} has {tp} TP ranks per {role} rank (0..{tp - 1}); {tp_rank} is not one"
            )
        raise ArtifactError(f"plan {self.plan} has {count} {role} ranks (0..{count - 1}); rank {rank} is not one")

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> Manifest:
        d = json.loads(text)
        if d.get("format_version") != FORMAT_VERSION:
            raise ArtifactError(
                f"artifact format {d.get('format_version')} is not {FORMAT_VERSION}, the format this afdc reads; "
                "recompile it with this afdc"
            )
        return cls(
            afdc_version=d["afdc_version"],
            source=Source(**d["source"]),
            plan=Plan(**d["plan"]),
            weights_included=d["weights_included"],
            decode_recomputes=d["decode_recomputes"],
            attention_program=d["attention_program"],
            output_spec=d["output_spec"],
            segments=[SegmentSpec.from_dict(s) for s in d["segments"]],
            layers=[
                LayerSpec(**{**lay, "to_ffn": [Crossing(**c) for c in lay["to_ffn"]],
                             "to_attn": [Crossing(**c) for c in lay["to_attn"]]})
                for lay in d["layers"]
            ],
            ranks=[RankFiles(**r) for r in d["ranks"]],
            files=[FileEntry(**f) for f in d["files"]],
            model_files=d.get("model_files", []),
            attention_splits={name: Split(**split) for name, split in d.get("attention_splits", {}).items()},
            max_positions=d.get("max_positions"),
            mixers=[_mixer_site(m) for m in d.get("mixers", [])],
            unpageable=d.get("unpageable", ""),
            quant=QuantSpec.from_dict(d["quant"]) if d.get("quant") else None,
            drafter=DrafterSpec(**d["drafter"]) if d.get("drafter") else None,
            no_drafter=d.get("no_drafter", ""),
        )


def _mixer_site(d: dict) -> MixerSite:
    return MixerSite(**{
        **d,
        "weights": tuple(d["weights"]),
        "constants": tuple(tuple(c) for c in d["constants"]),
        "state": tuple(StateTensor(t["name"], tuple(t["shape"]), t["dtype"]) for t in d["state"]),
        "inputs": tuple(str(i) for i in d.get("inputs", ())),
        "linears": tuple(
            QuantizedLinear(str(q["module"]), str(q["op"]), tuple((str(a), str(n)) for a, n in q["tensors"]),
                            tuple((str(a), v) for a, v in q["constants"]))
            for q in d.get("linears", ())
        ),
    })


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(16 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def read_manifest(directory: Path) -> Manifest:
    path = directory / MANIFEST
    if not directory.is_dir():
        raise ArtifactError(f"{directory} is not a directory; give the output directory of `afdc compile`")
    if not path.is_file():
        raise ArtifactError(f"{directory} has no {MANIFEST}: it is not an afdc artifact, or its compile did not finish")
    try:
        return Manifest.from_json(path.read_text())
    except (ValueError, KeyError, TypeError) as err:
        raise ArtifactError(f"{path} is not a valid afdc manifest ({err}); recompile the artifact") from err


def verify(directory: Path, manifest: Manifest, paths: list[str]) -> None:
    """Check the listed files against the manifest's sizes and hashes."""
    entries = {f.path: f for f in manifest.files}
    for rel in paths:
        entry = entries.get(rel)
        path = directory / rel
        if entry is None:
            raise ArtifactError(f"{rel} is not listed in {directory / MANIFEST}")
        if not path.is_file():
            raise ArtifactError(f"{path} is missing from the artifact")
        size = path.stat().st_size
        if size != entry.bytes:
            raise ArtifactError(f"{path} is {size} bytes, the manifest says {entry.bytes}: truncated or replaced")
        if sha256_file(path) != entry.sha256:
            raise ArtifactError(f"{path} does not match its SHA-256 in the manifest: the file is corrupted")
