"""`afdc up --ray` on a real local Ray cluster of two nodes started by the test: the attention
node (resource ``afdc_attn``) and the FFN node (``afdc_ffn``, its own address and raylet).

The demo compiled 2A2F: greedy text through the official ``openai`` client equals
``dm.generate``; the FFN actors and a spare's (``--ffn-spares 1``) ran on the FFN node; killing
an FFN actor's process holds the request it served until the spare has taken the rank over, and
the request then completes with equal tokens (docs/serving.md's Faults); Ray restarts the lost
actor (as a spare). Skipped where Ray is not installed (``pip install -e ".[ray]"``).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

ray = pytest.importorskip("ray", reason='Ray is not installed: pip install -e ".[ray]"')
pytest.importorskip("vllm")
openai = pytest.importorskip("openai")
TOKEN = "ray-test-token"  # given to afdc up: the test reads the deployment's store with it
pytestmark = pytest.mark.slow  # a Ray cluster and vLLM: run first (tests/conftest.py)

from ray.cluster_utils import Cluster  # noqa: E402
from test_serve import PROMPTS, STARTUP, _complete, _reference, _until_ready, _until_running  # noqa: E402

from afdc.artifact.load import deployment_of  # noqa: E402
from afdc.compile import compile_model  # noqa: E402
from afdc.demo import save_demo  # noqa: E402
from afdc.runtime.rendezvous import Rendezvous, free_port  # noqa: E402
from afdc.runtime.spare import Slots  # noqa: E402
from afdc.serve.ray_cluster import NAMESPACE, FfnRank, actor_name, resource_demand  # noqa: E402


@pytest.fixture
def cluster():
    """A head node with two attention ranks' worth of afdc_attn (and a CPU per DP engine actor),
    and a second node at another address with two FFN ranks' and a spare's worth of afdc_ffn."""
    c = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 2, "resources": {"afdc_attn": 2}, "include_dashboard": False})
    ffn_node = c.add_node(num_cpus=1, resources={"afdc_ffn": 3}, node_ip_address="127.0.0.1")
    c.wait_for_nodes()
    try:
        yield c, ffn_node
    finally:
        c.shutdown()


def test_up_on_a_ray_cluster_places_ffn_actors_and_a_spare_takes_a_lost_one_over(cluster, tmp_path):
    c, ffn_node = cluster
    save_demo(tmp_path / "moe")
    artifact = tmp_path / "moe-2a2f"
    compile_model(str(tmp_path / "moe"), "2A2F", artifact, progress=False)
    ref = _reference(artifact, PROMPTS * 2)
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "afdc.cli", "up", str(artifact), "--ray", c.address, "--port", str(port),
         "--startup-timeout", str(STARTUP), "--log-dir", str(tmp_path / "logs"), "--ffn-spares", "1", "--",
         "--max-model-len", "128", "--api-server-count", "1", "--return-tokens-as-token-ids"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, "AFDC_TOKEN": TOKEN},
    )
    out = ""
    try:
        out = _until_ready(proc, port)
        url = f"http://127.0.0.1:{port}"
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", timeout=120, max_retries=0)
        with ThreadPoolExecutor(8) as pool:
            assert list(pool.map(lambda p: _complete(client, p), PROMPTS * 2)) == ref

        # the FFN ranks are actors on the node with the afdc_ffn resource
        ray.init(address=c.address, namespace=NAMESPACE)
        names = re.findall(r"placing FFN rank \d of 2 \(Ray actor '([^']+)'", out)
        store = re.search(r"-ffn-0@(\S+)$", names[0]).group(1)
        assert names == [actor_name(artifact, store, f"ffn-{r}") for r in range(2)], out
        ffn = [ray.get_actor(name) for name in names]
        spare = ray.get_actor(actor_name(artifact, store, "spare-0"))
        where = [ray.get(a.where.remote(), timeout=60) for a in [*ffn, spare]]
        assert {node for node, _ in where} == {ffn_node.node_id}, where
        assert f"ffn-0: Ray node {ffn_node.node_id}, pid {where[0][1]}" in out
        # the attention ranks are vLLM's Ray DP engines, each in a placement group holding one afdc_attn
        free = ray.available_resources()
        assert free.get("afdc_attn", 0) == 0 and free.get("afdc_ffn", 0) == 0, free
        # a second deployment of this artifact on the cluster (its own store) names its FFN actors
        # apart: Ray takes them beside these (they wait for an afdc_ffn unit here)
        second = ray.remote(FfnRank).options(name=actor_name(artifact, f"127.0.0.1:{free_port()}", "ffn-0"),
                                             **resource_demand("afdc_ffn")).remote(str(artifact), 0, None, "cpu", None)
        ray.kill(second, no_restart=True)

        # a lost FFN actor: the request it served is held until the spare took its rank over, then
        # completes; Ray restarts the lost actor as a spare
        long_ref = _reference(artifact, [PROMPTS[0]], 40)[0]
        with ThreadPoolExecutor(1) as pool:
            long = pool.submit(_complete, client, PROMPTS[0], 40)
            _until_running(url)
            os.kill(where[0][1], signal.SIGKILL)
            assert long.result(timeout=STARTUP) == long_ref
        layout, deployment = deployment_of(artifact)
        owner, _ = Slots(Rendezvous(store, layout, deployment, TOKEN)).owner(layout.slot("ffn", 0))
        assert owner.pid == where[2][1], (owner, where)  # the spare serves rank 0
        deadline = time.monotonic() + STARTUP
        while True:  # the spare served while Ray restarted the lost actor
            try:
                node, pid = ray.get(ffn[0].where.remote(), timeout=STARTUP)
                break
            except ray.exceptions.ActorUnavailableError:
                assert time.monotonic() < deadline, "Ray did not restart the lost FFN actor"
                time.sleep(1)
        assert node == ffn_node.node_id and pid != where[0][1]  # a new process, placed by resource again
        assert ray.get(ffn[0].started_as.remote(), timeout=60) is None  # as a spare: the spare keeps rank 0
        assert _complete(client, PROMPTS[0]) == ref[0]
    finally:
        proc.send_signal(signal.SIGINT)
        rest, _ = proc.communicate(timeout=120)
        if ray.is_initialized():
            ray.shutdown()
    assert proc.returncode == 0, out + rest
    assert "stopping every role" in rest
    log = (tmp_path / "logs" / "attn.log").read_text()  # complete once vllm serve exited (its output is buffered)
    for a in range(2):
        assert re.search(rf"EngineCoreActor pid=\d+\).*afdc: attention rank {a} of ", log), log[-3000:]
