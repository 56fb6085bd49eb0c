"""`afdc k8s` manifests checked against the Kubernetes API's schemas: the official ``kubernetes``
client's models (every object deserialized into its model class, which refuses a missing
required field or a wrong type, and every key checked against the model's fields, which the
deserializer alone would drop). Not applied to a cluster here."""

from __future__ import annotations

import json
import re

import pytest
from click.testing import CliRunner

kubernetes = pytest.importorskip("kubernetes")

from afdc.cli import main  # noqa: E402
from afdc.compile import compile_model  # noqa: E402

MODELS = {("v1", "Secret"): "V1Secret", ("v1", "Service"): "V1Service", ("apps/v1", "StatefulSet"): "V1StatefulSet"}


def _unknown_keys(data, type_name: str, path: str = "") -> list[str]:
    """Keys of ``data`` that the model ``type_name`` (a client type string) has no field for."""
    inner = re.fullmatch(r"(?:List|list)\[(.+)\]", type_name)
    if inner:
        return [k for i, x in enumerate(data) for k in _unknown_keys(x, inner.group(1), f"{path}[{i}]")]
    model = getattr(kubernetes.client, type_name, None)
    if model is None or not hasattr(model, "attribute_map"):  # a primitive or a free-form map
        return []
    fields = {json_key: name for name, json_key in model.attribute_map.items()}
    unknown = [f"{path}.{k}" for k in data if k not in fields]
    return unknown + [k for key, value in data.items() if key in fields
                      for k in _unknown_keys(value, model.openapi_types[fields[key]], f"{path}.{key}")]


def _validate(obj: dict) -> None:
    type_name = MODELS[(obj["apiVersion"], obj["kind"])]
    kubernetes.client.ApiClient().deserialize(json.dumps(obj), type_name, "application/json")
    unknown = _unknown_keys(obj, type_name)
    if unknown:
        raise ValueError(f"{obj['kind']} {obj['metadata']['name']}: unknown fields {unknown}")


@pytest.fixture(scope="module")
def plan_4a2f(tmp_path_factory):
    from transformers import LlamaConfig

    root = tmp_path_factory.mktemp("k8s")
    LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2).save_pretrained(root / "model")
    compile_model(str(root / "model" / "config.json"), "4A2F", root / "tiny-4a2f", weights=False, progress=False)
    return root / "tiny-4a2f"


def _k8s(*args: str):
    result = CliRunner().invoke(main, ["k8s", *args])
    return result.exit_code, result.output


def test_manifests_for_4a2f_validate_against_the_api_schemas(plan_4a2f, tmp_path):
    out = tmp_path / "manifests"
    code, text = _k8s(str(plan_4a2f), "-o", str(out), "--image", "registry.example/afdc:1", "--claim", "models",
                      "--attention-per-pod", "2", "--ffn-spares", "1", "--", "--max-num-seqs", "64")
    assert code == 0, text
    objects = [json.loads(p.read_text()) for p in sorted(out.glob("*.json"))]
    for obj in objects:
        _validate(obj)
    by_name = {o["metadata"]["name"]: o for o in objects}
    assert sorted(by_name) == ["tiny-4a2f", "tiny-4a2f-attn", "tiny-4a2f-attn-head", "tiny-4a2f-attn-workers",
                               "tiny-4a2f-ffn", "tiny-4a2f-ffn-spare", "tiny-4a2f-token"]
    assert objects[0]["kind"] == "Secret"  # applied first: the pods read it
    ffn, spare, head, workers = (by_name[f"tiny-4a2f-{n}"] for n in ("ffn", "ffn-spare", "attn-head", "attn-workers"))
    assert [s["spec"]["replicas"] for s in (ffn, spare, head, workers)] == [2, 1, 1, 1]
    head_c, workers_c, ffn_c, spare_c = (
        s["spec"]["template"]["spec"]["containers"][0] for s in (head, workers, ffn, spare))
    assert head_c["readinessProbe"]["httpGet"]["path"] == "/health"
    store = "--rendezvous tiny-4a2f-attn-head-0.tiny-4a2f-attn:29500"
    for c in (head_c, workers_c, ffn_c, spare_c):  # every role meets at attention rank 0's store, with the token
        assert store in c["command"][2]
        assert c["env"][0]["valueFrom"]["secretKeyRef"] == {"name": "tiny-4a2f-token", "key": "token"}
        assert c["volumeMounts"][0]["mountPath"] == "/artifact"
    assert "--data-parallel-size 4 --data-parallel-size-local 2" in head_c["command"][2]
    assert "--headless" not in head_c["command"][2] and "--max-num-seqs 64" in head_c["command"][2]
    assert "--data-parallel-start-rank $(( (POD_INDEX + 1) * 2 )) --headless" in workers_c["command"][2]
    assert "--role ffn --rank $POD_INDEX" in ffn_c["command"][2]
    assert spare_c["command"][2].endswith("--role ffn --spare") and "--rank" not in spare_c["command"][2]
    assert [c["resources"]["limits"]["nvidia.com/gpu"] for c in (head_c, workers_c, ffn_c, spare_c)] == [
        "2", "2", "1", "1"]
    # the Services select the pods they name
    dp_group = by_name["tiny-4a2f-attn"]["spec"]["selector"]
    for s in (head, workers):
        assert dp_group.items() <= s["spec"]["template"]["metadata"]["labels"].items()
    ffn_pool = next(o for o in objects if o["kind"] == "Service" and o["metadata"]["name"] == "tiny-4a2f-ffn")
    for s in (ffn, spare):  # the FFN ranks' and the spares' pods in the FFN pool's Service, apart as StatefulSets
        assert ffn_pool["spec"]["selector"].items() <= s["spec"]["template"]["metadata"]["labels"].items()
    assert ffn["spec"]["selector"] != spare["spec"]["selector"]
    api = by_name["tiny-4a2f"]["spec"]["selector"]
    assert api.items() <= head["spec"]["template"]["metadata"]["labels"].items()
    assert not api.items() <= workers["spec"]["template"]["metadata"]["labels"].items()


def test_the_schema_check_catches_bad_manifests(plan_4a2f, tmp_path):
    out = tmp_path / "m"
    assert _k8s(str(plan_4a2f), "-o", str(out), "--image", "i", "--claim", "c")[0] == 0
    ffn = json.loads(next(out.glob("*statefulset-tiny-4a2f-ffn.json")).read_text())
    _validate(ffn)
    misspelt = json.loads(json.dumps(ffn))
    misspelt["spec"]["template"]["spec"]["containers"][0]["volumeMount"] = []
    with pytest.raises(ValueError, match=r"unknown fields \['.spec.template.spec.containers\[0\].volumeMount'\]"):
        _validate(misspelt)
    missing = json.loads(json.dumps(ffn))
    del missing["spec"]["template"]["spec"]["containers"][0]["name"]  # required
    with pytest.raises(Exception, match="name"):
        _validate(missing)
    code, text = _k8s(str(plan_4a2f), "--image", "i", "--claim", "c", "--attention-per-pod", "3")
    assert code != 0 and "do not split into pods of 3" in text
