"""Kubernetes manifests for a compiled artifact's plan (``afdc k8s``).

The attention ranks are vLLM's data-parallel ranks (:mod:`afdc.serve.data_parallel`): a
*head* StatefulSet of one pod runs ``afdc serve --role attn`` with vLLM's API server and DP
ranks ``0 .. L-1`` (attention rank 0 hosts the rendezvous store), a *workers* StatefulSet runs
the other DP ranks, ``L`` per pod, ``--headless`` with ``--data-parallel-start-rank`` from the
pod's index; an FFN StatefulSet runs one FFN rank per pod, its rank the pod's index, and with
``ffn_spares`` an FFN-spares StatefulSet runs that many hot spares (``afdc serve --role ffn
--spare``, :mod:`afdc.runtime.spare`), one per pod with the FFN ranks' resources: a spare takes
a lost rank over, and the rank's pod, restarted by Kubernetes, takes its rank back (the last start
wins; the spare leaves, and its pod restarts as a spare). Headless
Services give the pods stable names (the DP group and the FFN pool), a Service exposes the
OpenAI API, the deployment token is a Secret, the head is ready when ``/health`` answers 200,
and every pod mounts the artifact from a volume claim. Plain StatefulSets and Services: no
operator or custom resource (LeaderWorkerSet) is needed.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass
from pathlib import Path

from afdc.artifact.manifest import read_manifest
from afdc.errors import AfdcError

API_PORT = 8000
STORE_PORT = 29500  # the rendezvous store, in the head pod
DP_RPC_PORT = 13345  # vLLM's DP handshake with the headless engines
MOUNT = "/artifact"
_POD_INDEX = "metadata.labels['apps.kubernetes.io/pod-index']"  # Kubernetes >= 1.28


@dataclass(frozen=True)
class Cluster:
    """Where and how the plan runs on the cluster."""

    name: str  # prefix of every object's name
    image: str  # an image with afdc[serve] installed
    claim: str  # the PersistentVolumeClaim holding the artifact directory
    sub_path: str = ""  # the artifact's directory inside the claim's volume
    namespace: str | None = None
    attention_per_pod: int = 1  # DP ranks per attention pod (vLLM's --data-parallel-size-local)
    device: str = "cuda"  # cuda: one GPU per attention rank and per FFN rank; cpu: none
    connector: str = "gloo"  # between pods: gloo or nccl
    ffn_spares: int = 0  # hot spare FFN pods
    vllm_args: tuple[str, ...] = ()


def _dns_name(text: str) -> str:
    name = re.sub(r"[^a-z0-9-]+", "-", text.lower()).strip("-")[:40].strip("-")
    if not name:
        raise AfdcError(f"cannot make a Kubernetes name of {text!r}: give --name")
    return name


def _metadata(c: Cluster, name: str, component: str | None = None) -> dict:
    labels = {"app.kubernetes.io/name": "afdc", "app.kubernetes.io/instance": c.name}
    if component:
        labels["app.kubernetes.io/component"] = component
    meta = {"name": name, "labels": labels}
    if c.namespace:
        meta["namespace"] = c.namespace
    return meta


def _selector(c: Cluster, component: str) -> dict:
    return {"app.kubernetes.io/instance": c.name, "app.kubernetes.io/component": component}


def _headless_service(c: Cluster, name: str, selector: dict, ports: list[tuple[str, int]]) -> dict:
    return {
        "apiVersion": "v1", "kind": "Service", "metadata": _metadata(c, name),
        "spec": {"clusterIP": "None", "publishNotReadyAddresses": True, "selector": selector,
                 "ports": [{"name": n, "port": p} for n, p in ports]},
    }


def _container(c: Cluster, name: str, script: str, gpus: int, ports: list[tuple[str, int]]) -> dict:
    container = {
        "name": name, "image": c.image,
        "command": ["sh", "-c", script],
        "env": [
            {"name": "AFDC_TOKEN", "valueFrom": {"secretKeyRef": {"name": f"{c.name}-token", "key": "token"}}},
            {"name": "POD_INDEX", "valueFrom": {"fieldRef": {"fieldPath": _POD_INDEX}}},
        ],
        "ports": [{"name": n, "containerPort": p} for n, p in ports],
        "volumeMounts": [{"name": "artifact", "mountPath": MOUNT, "readOnly": True,
                          **({"subPath": c.sub_path} if c.sub_path else {})}],
    }
    if gpus:
        container["resources"] = {"limits": {"nvidia.com/gpu": str(gpus)}}
    return container


def _stateful_set(c: Cluster, name: str, component: str, replicas: int, service: str, container: dict) -> dict:
    labels = _metadata(c, name, component)["labels"]
    if service.endswith(("-attn", "-ffn")):  # both StatefulSets of a role have their pods in its Service
        labels["afdc.dev/pool"] = service
    return {
        "apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": _metadata(c, name, component),
        "spec": {
            "serviceName": service, "replicas": replicas, "podManagementPolicy": "Parallel",
            "selector": {"matchLabels": _selector(c, component)},
            "template": {
                "metadata": {"labels": labels},
                "spec": {
                    "containers": [container],
                    "volumes": [{"name": "artifact", "persistentVolumeClaim": {"claimName": c.claim,
                                                                               "readOnly": True}}],
                },
            },
        },
    }


def manifests(artifact: str | Path, c: Cluster) -> list[dict]:
    """The objects that deploy ``artifact``'s plan on a cluster, in the order to apply them."""
    plan = read_manifest(Path(artifact)).plan
    a, per_pod = plan.attention_ranks, c.attention_per_pod
    if per_pod < 1 or a % per_pod:
        raise AfdcError(
            f"the plan's {a} attention ranks do not split into pods of {per_pod} (--attention-per-pod): "
            f"give a divisor of {a}"
        )
    if c.connector not in ("gloo", "nccl"):
        raise AfdcError(f"--connector {c.connector}: pods reach each other over gloo or nccl")
    name = c.name
    dp_group, ffn_pool = f"{name}-attn", f"{name}-ffn"
    head_host = f"{name}-attn-head-0.{dp_group}"
    store = f"{head_host}:{STORE_PORT}"
    gpus = 1 if c.device.startswith("cuda") else 0
    serve = (f"afdc serve {MOUNT} --connector {c.connector} --rendezvous {store} --device {c.device} "
             f"--join-timeout 600")
    dp = (f"--data-parallel-size {a} --data-parallel-size-local {per_pod} --data-parallel-address {head_host} "
          f"--data-parallel-rpc-port {DP_RPC_PORT}")
    extra = " ".join(c.vllm_args)
    head = (f"exec {serve} --role attn --host 0.0.0.0 --port {API_PORT} -- {dp} {extra}").strip()
    workers = (f"exec {serve} --role attn -- {dp} --data-parallel-start-rank $(( (POD_INDEX + 1) * {per_pod} )) "
               f"--headless {extra}").strip()
    ffn = f"exec {serve} --role ffn --rank $POD_INDEX"
    attn_ports = [("store", STORE_PORT), ("dp-rpc", DP_RPC_PORT)]
    head_container = _container(c, "attention", head, gpus * per_pod, [("http", API_PORT), *attn_ports])
    head_container["readinessProbe"] = {"httpGet": {"path": "/health", "port": "http"},
                                        "periodSeconds": 5, "failureThreshold": 3}
    objects = [
        {"apiVersion": "v1", "kind": "Secret", "metadata": _metadata(c, f"{name}-token"), "type": "Opaque",
         "stringData": {"token": secrets.token_hex(16)}},
        _headless_service(c, dp_group, {"app.kubernetes.io/instance": name, "afdc.dev/pool": dp_group},
                          attn_ports),
        _headless_service(c, ffn_pool, {"app.kubernetes.io/instance": name, "afdc.dev/pool": ffn_pool}, []),
        {"apiVersion": "v1", "kind": "Service", "metadata": _metadata(c, name, "api"),
         "spec": {"selector": _selector(c, "attention-head"), "ports": [{"name": "http", "port": API_PORT,
                                                                         "targetPort": "http"}]}},
        _stateful_set(c, f"{name}-ffn", "ffn", plan.ffn_ranks, ffn_pool,
                      _container(c, "ffn", ffn, gpus, [])),
        _stateful_set(c, f"{name}-attn-head", "attention-head", 1, dp_group, head_container),
    ]
    if c.ffn_spares:
        objects.append(_stateful_set(c, f"{name}-ffn-spare", "ffn-spare", c.ffn_spares, ffn_pool,
                                     _container(c, "ffn", f"exec {serve} --role ffn --spare", gpus, [])))
    if a > per_pod:
        objects.append(_stateful_set(c, f"{name}-attn-workers", "attention-workers", a // per_pod - 1, dp_group,
                                     _container(c, "attention", workers, gpus * per_pod, attn_ports)))
    return objects


def write(objects: list[dict], directory: Path) -> list[Path]:
    """One JSON file per object (``kubectl apply -f DIR`` reads JSON as it reads YAML)."""
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, o in enumerate(objects):
        path = directory / f"{i:02d}-{o['kind'].lower()}-{o['metadata']['name']}.json"
        path.write_text(json.dumps(o, indent=1) + "\n")
        paths.append(path)
    return paths


def default_name(artifact: str | Path) -> str:
    return _dns_name(Path(artifact).resolve().name)
