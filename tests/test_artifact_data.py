"""Programs are stored as data: an artifact's programs read back as the graphs afdc built, and a
program changed together with its manifest hash cannot run code when loaded (the file its code
would write is never written)."""

from __future__ import annotations

import json
import operator
import re
import shutil
from pathlib import Path

import pytest
import torch

import afdc
from afdc.artifact import manifest as mf
from afdc.artifact.program_format import load_program, write_program
from afdc.demo import demo_batch
from models_supported import catalog

# dense, MoE, a hybrid whose conv layers are afdc::mixer calls (sparse attention, the slowest to
# capture, is loaded against the monolith by test_compile's HY-V4)
ARCHITECTURES = {"llama": None, "qwen3_moe": "afdc.grouped_mm_local", "lfm2": "afdc.mixer"}


def _model(model_type: str):
    return catalog.build(next(e for e in catalog.ENTRIES if e.model_type == model_type))


def _compiled(model, directory: Path, plan: str = "1A2F") -> Path:
    model.save_pretrained(directory / "src")
    afdc.compile_model(str(directory / "src"), plan, directory / "art", progress=False)
    return directory / "art"


@pytest.fixture(scope="module")
def llama_artifact(tmp_path_factory) -> Path:
    return _compiled(_model("llama"), tmp_path_factory.mktemp("llama"), "1A1F")


@pytest.fixture
def artifact(llama_artifact, tmp_path) -> Path:
    """A copy of a compiled artifact, free to tamper with."""
    return Path(shutil.copytree(llama_artifact, tmp_path / "art"))


@pytest.mark.parametrize("model_type", ARCHITECTURES)
def test_loaded_programs_compute_what_the_in_process_model_computes(tmp_path, model_type):
    model = _model(model_type)
    art = _compiled(model, tmp_path)
    manifest = mf.read_manifest(art)
    texts = [(art / p).read_text() for p in [manifest.attention_program, *(s.program for s in manifest.segments)]]
    assert all(json.loads(t)["format"] == "afdc-fx-graph/1" for t in texts)
    if ARCHITECTURES[model_type]:
        assert any(f'"{ARCHITECTURES[model_type]}.' in t for t in texts)

    ids, mask = demo_batch(model.config.vocab_size, seed=0, shape=(2, 7), pads=(3,))
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    expected = afdc.disaggregate(model, "1A2F")(ids, attention_mask=mask, position_ids=pos).logits
    got = afdc.load_deployment(art)(ids, attention_mask=mask, position_ids=pos).logits
    assert torch.equal(got, expected)


def test_a_program_reads_back_as_the_graph_written(tmp_path):
    """Node for node: names, ops, targets and typed literals (dtypes, tuples, non-finite floats,
    keywords); every device becomes the run's device."""
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    n = graph.call_function(torch.ops.aten.sym_size.int, (x, 0))
    full = graph.call_function(
        torch.ops.aten.full.default, ([n, 2], float("-inf")),
        {"dtype": torch.bfloat16, "layout": torch.strided, "device": torch.device("meta"), "pin_memory": False},
    )
    split = graph.call_function(torch.ops.aten.split_with_sizes.default, (full, (1, 1), -1))
    first = graph.call_function(operator.getitem, (split, 0))
    graph.output((first, graph.call_function(operator.mul, (n, 2))))
    write_program(graph, tmp_path / "p.json")

    read = load_program(tmp_path / "p.json", {}, torch.device("cpu")).graph
    assert [(r.name, r.op, r.target) for r in read.nodes] == [(w.name, w.op, w.target) for w in graph.nodes]
    (full_read,) = read.find_nodes(op="call_function", target=torch.ops.aten.full.default)
    assert full_read.args[1] == float("-inf") and full_read.kwargs["device"] == torch.device("cpu")
    assert full_read.kwargs["dtype"] is torch.bfloat16 and full_read.kwargs["layout"] is torch.strided
    (split_read,) = read.find_nodes(op="call_function", target=torch.ops.aten.split_with_sizes.default)
    assert split_read.args[1] == (1, 1)


def _rewrite(art: Path, rel: str, text: str) -> None:
    """Replace an artifact file and record its new hash in the manifest, as a tamperer would."""
    (art / rel).write_text(text)
    data = json.loads((art / mf.MANIFEST).read_text())
    for entry in data["files"]:
        if entry["path"] == rel:
            entry["sha256"], entry["bytes"] = mf.sha256_file(art / rel), (art / rel).stat().st_size
    (art / mf.MANIFEST).write_text(json.dumps(data))


def _tamper_first_call(art: Path, target: str, args: list) -> str:
    """Make the attention program's first call ``target(*args)``; returns the program's path."""
    rel = mf.read_manifest(art).attention_program
    program = json.loads((art / rel).read_text())
    node = next(n for n in program["nodes"] if n["op"] == "call_function")
    node["target"], node["args"] = target, args
    _rewrite(art, rel, json.dumps(program))
    return rel


@pytest.mark.parametrize(
    ("target", "args"),
    [
        ("builtins.exec", ["open({marker!r}, 'w').write('ran')"]),
        ("os.system", ["touch {marker}"]),
        ("pathlib.Path.write_text", ["{marker}", "ran"]),
        ("aten.from_file", ["{marker}", True, 16]),  # an aten op, but one that creates a file by name
        ("aten.__init__.__globals__", []),  # a Python attribute reached through an op namespace
    ],
)
def test_a_call_outside_the_allow_list_is_refused_by_name(artifact, tmp_path, target, args):
    marker = tmp_path / "marker"
    args = [a.format(marker=str(marker)) if isinstance(a, str) else a for a in args]
    rel = _tamper_first_call(artifact, target, args)
    with pytest.raises(mf.ArtifactError) as err:
        afdc.load(artifact, "attn", 0)
    assert target in str(err.value) and rel in str(err.value)
    assert not marker.exists()


def test_python_source_in_place_of_a_program_never_runs(artifact, tmp_path):
    """The old format's Python, changed to write a file, with the manifest's hash updated."""
    marker = tmp_path / "marker"
    rel = mf.read_manifest(artifact).attention_program
    _rewrite(artifact, rel, f"open({str(marker)!r}, 'w').write('ran')\ndef forward(self, x):\n    return (x,)\n")
    with pytest.raises(mf.ArtifactError, match=rf"{rel}.*not an afdc program.*recompile"):
        afdc.load(artifact, "attn", 0)
    assert not marker.exists()


@pytest.mark.parametrize("field", ["name", "kwarg", "weight"])
def test_code_in_names_is_refused(artifact, tmp_path, field):
    """FX turns the graph into Python before it runs: no name may carry code into that source."""
    marker = tmp_path / "marker"
    code = f"x = open({str(marker)!r}, 'w')"
    rel = mf.read_manifest(artifact).attention_program
    program = json.loads((artifact / rel).read_text())
    if field == "weight":
        node = next(n for n in program["nodes"] if n["op"] == "get_attr")
        node["target"] = f'model"); {code}; ("'
    else:
        node = next(n for n in program["nodes"] if n["op"] == "call_function")
        if field == "name":
            node["name"] = code
        else:
            node["kwargs"] = {code: 1}
    _rewrite(artifact, rel, json.dumps(program))
    with pytest.raises(mf.ArtifactError, match=re.escape(rel)):
        afdc.load(artifact, "attn", 0)
    assert not marker.exists()


def test_a_string_literal_stays_data(artifact, tmp_path):
    """A string argument reaches the op as that string: FX writes it as a literal, never as code."""
    marker = tmp_path / "marker"
    code = f"'); open({str(marker)!r}, 'w').write('ran'); ('"
    rel = mf.read_manifest(artifact).attention_program
    program = json.loads((artifact / rel).read_text())
    node = next(n for n in program["nodes"] if n["op"] == "call_function" and n["target"] == "aten.mul.Tensor")
    node["target"], node["kwargs"] = "aten.div.Tensor_mode", {"rounding_mode": code}
    _rewrite(artifact, rel, json.dumps(program))
    module = afdc.load(artifact, "attn", 0).module
    (div,) = module.graph.find_nodes(op="call_function", target=torch.ops.aten.div.Tensor_mode)
    assert div.kwargs["rounding_mode"] == code
    assert not marker.exists()


def test_an_artifact_of_the_previous_format_is_refused(artifact):
    data = json.loads((artifact / mf.MANIFEST).read_text())
    data["format_version"] = 4
    (artifact / mf.MANIFEST).write_text(json.dumps(data))
    refusal = rf"artifact format 4 is not {mf.FORMAT_VERSION}.*recompile it with this afdc"
    with pytest.raises(mf.ArtifactError, match=refusal):
        afdc.load(artifact, "attn", 0)


def test_index_bounds_are_read_as_bounded_data(artifact):
    """A segment's index bounds (the inputs its FFN side indexes with, and their ranges) must name
    an input of the segment and a range of at least one value; an artifact written before they
    were recorded loads with none."""
    data = json.loads((artifact / mf.MANIFEST).read_text())
    spec = data["segments"][0]
    for bounds in ([{"input": len(spec["inputs"]), "size": 8}], [{"input": 0, "size": 0}],
                   [{"input": 0, "size": 8}, {"input": 0, "size": 9}], [{"input": 0, "size": "8"}], [{"input": 0}]):
        spec["index_bounds"] = bounds
        (artifact / mf.MANIFEST).write_text(json.dumps(data))
        with pytest.raises(mf.ArtifactError, match=r"not a valid afdc manifest \((IndexBound|index bounds)"):
            afdc.load(artifact, "ffn", 0)
    del spec["index_bounds"]  # as written before this field
    (artifact / mf.MANIFEST).write_text(json.dumps(data))
    assert afdc.load(artifact, "ffn", 0).dispatch(0).index_bounds == ()


def test_the_output_spec_imports_only_transformers_model_modules():
    """The program's output structure names its output class; a transformers model's own module
    (where a multimodal wrapper's output class lives) is imported so that the class is known in a
    fresh process. Any other module named there is never imported: a spec naming one, an unknown
    model, or no JSON at all, is an error naming the manifest's field."""
    import sys

    from afdc.artifact.load import output_spec

    def spec(type_name: str) -> str:
        leaf = {"type": None, "context": None, "children_spec": []}
        return json.dumps([1, {"type": type_name, "context": '["logits"]', "children_spec": [leaf]}])

    known = "transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe.Qwen3VLMoeCausalLMOutputWithPast"
    assert output_spec(spec(known)).num_leaves == 1
    assert "transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe" in sys.modules
    for name in ["antigravity.Fly", "transformers.models.no_such_model.modeling_no_such_model.Output",
                 "transformers.models.llama.modeling_llama.os.Output"]:
        with pytest.raises(mf.ArtifactError, match="output_spec cannot be read here"):
            output_spec(spec(name))
    assert "antigravity" not in sys.modules
    with pytest.raises(mf.ArtifactError, match="output_spec is not JSON"):
        output_spec("[1, {")
