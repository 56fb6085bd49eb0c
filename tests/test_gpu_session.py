"""benchmarks/gpu_session.sh, the next GPU session's one device call, kept from rotting where no GPU
is lent: its dry run runs every section on this CPU at tiny sizes, and its plan fits one call."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow  # the dry run, a minute of subprocesses: run first (tests/conftest.py)
ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_session.sh"
SECTIONS = ["served", "model", "kernels", "transports", "transports-nomps"]  # most valuable first (issue 51)
DEVICE_CALL_S = 480  # one device call of at most 8 minutes


def _session(out: Path, *args: str, timeout: float, **env: str) -> subprocess.CompletedProcess:
    env = {**os.environ, **env, "OUT": str(out), "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    return subprocess.run(["bash", str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=timeout)


def _plan(*args: str) -> list[tuple[str, int, list[str]]]:
    done = _session(ROOT / "unused", "--plan", *args, timeout=30)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = [line.split() for line in done.stdout.splitlines()]
    return [(name, int(limit), cmd) for name, limit, *cmd in rows]


def test_the_session_fits_one_device_call_and_reads_only_the_repository():
    plan = _plan()
    assert [name for name, _, _ in plan] == SECTIONS
    # each section's limit, and the 2 s the script grants a section to stop after it
    assert sum(limit + 2 for _, limit, _ in plan) <= DEVICE_CALL_S
    for _, _, cmd in plan:
        assert cmd[0] == "python3" and (ROOT / cmd[1]).is_file(), cmd
        assert not any("shared" in arg for arg in cmd), cmd  # ../shared does not travel to the device
    commands = {name: cmd for name, _, cmd in plan}
    assert commands["transports-nomps"] == commands["transports"]  # only MPS differs: the dry run skips it
    kernels = commands["kernels"]
    configs = ROOT / kernels[kernels.index("--configs") + 1]
    models = kernels[kernels.index("--models") + 1: kernels.index("--skip-compile")]
    assert models and all((configs / f"{m}.json").is_file() for m in models)


def _served(out: Path) -> None:
    served = json.loads((out / "served.json").read_text())
    assert served["failed"] == [] and served["afd_ids_equal_monolithic"], served
    # the demo in fp32 on the CPU: every served prompt's ids are dm.generate's
    assert served["ids_equal_dm_generate"] == {"monolithic": 4, "afd": 4}
    assert served["afd"]["c1"]["completed"] >= 4 and served["monolithic"]["c1"]["median_tpot_ms"] > 0


def _model(out: Path) -> None:
    row = json.loads((out / "model.json").read_text())["model/moe/fp32/auto"]
    assert row["ok"] and row["backend"] == "eager" and row["dm_greedy_equal"], row
    assert row["dm_rel_diff"] <= 1e-4 and row["eager"]["per_token_ms"] is not None


def _kernels(out: Path) -> None:
    kernels = json.loads((out / "kernels.json").read_text())
    assert {r["model"] for r in kernels["moe"]} == {"qwen3-30b-a3b", "deepseek-v3"}
    assert all(r["check"] in ("ok", "n/a") for r in kernels["moe"] + kernels["rows"])


def _transports(out: Path) -> None:
    transports = (out / "transports.log").read_text()
    assert [line.split()[1] for line in transports.splitlines() if line.startswith("shm ")] == ["1", "16", "256"]


def _interleave(out: Path) -> None:
    interleave = json.loads((out / "interleave.json").read_text())["interleave/moe/fp32/eager/shm"]
    assert interleave["ok"], interleave
    assert interleave["served_m1_greedy_equal"] and interleave["served_m2_greedy_equal"]


CHECKS = {"served": _served, "model": _model, "kernels": _kernels, "transports": _transports, "interleave": _interleave}


# every section of the plan but transports-nomps (the transports command again, MPS stopped first,
# and a CPU has no MPS: the plan test checks it), and interleave, which runs by name only on a GPU
# and must not rot either; the three the next GPU call needs most in CI's run, the rest with --sweep
@pytest.mark.parametrize(
    "sections", [pytest.param(("served", "model", "kernels"), id="first"),
                 pytest.param(("transports", "interleave"), id="rest", marks=pytest.mark.sweep)]
)
def test_dry_run_runs_every_section_on_the_cpu(tmp_path, sections):
    assert set(CHECKS) == {s for s in SECTIONS if s != "transports-nomps"} | {"interleave"}
    timeout = sum(limit for _, limit, _ in _plan("--dry-run", *sections)) + 60
    done = _session(tmp_path, "--dry-run", *sections, timeout=timeout)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr
    assert f"=== all {len(sections)} sections ok" in done.stdout
    for section in sections:
        CHECKS[section](tmp_path)


def test_a_section_out_of_time_fails_the_session_and_says_so(tmp_path):
    done = _session(tmp_path, "--dry-run", "transports", timeout=60, TRANSPORTS_S="1")
    assert done.returncode == 1, done.stdout
    assert "=== transports: FAILED (out of time after 1s)" in done.stdout
    assert "=== 1 of 1 sections FAILED: transports" in done.stdout


def test_bench_gpu_exits_non_zero_when_a_check_fails(capsys, monkeypatch):
    spec = importlib.util.spec_from_file_location("bench_gpu", ROOT / "benchmarks" / "bench_gpu.py")
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "bench_gpu", bench)  # its dataclasses look their module up
    spec.loader.exec_module(bench)
    setup = bench.Setup.of(bench.parse(["--dry-run"]))
    results: dict = {"device": "cpu"}
    bench.section(results, "model/moe/fp32/tensorrt", bench.in_model, "moe", "tensorrt", torch.float32, setup)
    assert bench.report(results) == 1
    assert "model/moe/fp32/tensorrt: ValueError: backend 'tensorrt' is not one of" in capsys.readouterr().out
    results["model/moe/fp32/tensorrt"] = {"ok": True}
    assert bench.report(results) == 0
