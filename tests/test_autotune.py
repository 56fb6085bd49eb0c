"""Autotuning: configs timed on real kernel runs (Triton's interpreter here), kept on disk, reused."""

from __future__ import annotations

import json

import pytest
import torch

from afdc.codegen import autotune
from afdc.codegen.fused_moe import candidate_block_sizes, fused_moe_reference, fused_moe_triton

pytestmark = pytest.mark.usefixtures("triton_interpret")


def _moe(tokens: int = 5, experts: int = 4, hidden: int = 32, inter: int = 16, k: int = 2):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, hidden, generator=g)
    w_gate_up = torch.randn(experts, 2 * inter, hidden, generator=g) / hidden**0.5
    w_down = torch.randn(experts, hidden, inter, generator=g) / inter**0.5
    ids = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(tokens)])
    weights = torch.rand(tokens, k, generator=g)
    return x, w_gate_up, w_down, weights, ids, 0, "silu"


def test_tuned_config_is_measured_cached_and_reused(tmp_path):
    args = _moe()
    key = autotune.TuneKey.of("fused_moe", args[1], (16, 4, 32, 16))
    candidates = [(16, 16, 16), (16, 16, 32)]
    runs = []

    def run(tiles):
        runs.append(tiles)
        return fused_moe_triton(*args, block_m=tiles[0], block_n=tiles[1], block_k=tiles[2])

    path = tmp_path / "cache" / "autotune.json"
    best = autotune.Autotuner(path).best(key, candidates, run, args[0])
    assert best in candidates
    assert set(runs) == set(candidates) and len(runs) == 4 * len(candidates)  # warmup + 3 timed each
    assert json.loads(path.read_text()) == {str(key): list(best)}

    runs.clear()  # another process: the cache answers, nothing is timed again
    assert autotune.Autotuner(path).best(key, candidates, run, args[0]) == best and runs == []
    torch.testing.assert_close(run(best), fused_moe_reference(*args), atol=1e-5, rtol=1e-5)


def test_failing_configs_are_skipped_and_a_broken_cache_is_retuned(tmp_path):
    args = _moe(tokens=1)
    key = autotune.TuneKey.of("fused_moe", args[1], (2, 4, 32, 16))
    path = tmp_path / "autotune.json"
    path.write_text("{not json")

    def run(tiles):
        if tiles[0] == 8:
            raise ValueError("tl.dot needs tiles of at least 16")
        return fused_moe_triton(*args, block_m=tiles[0], block_n=tiles[1], block_k=tiles[2])

    assert autotune.Autotuner(path).best(key, [(8, 16, 16), (16, 16, 16)], run, args[0]) == (16, 16, 16)
    assert json.loads(path.read_text()) == {str(key): [16, 16, 16]}  # the broken file was replaced
    with pytest.raises(RuntimeError, match="every candidate config failed"):
        autotune.Autotuner(tmp_path / "other.json").best(key, [(8, 16, 16)], run, args[0])


def test_fused_moe_tunes_itself_when_enabled(tmp_path, monkeypatch):
    monkeypatch.setenv("AFDC_AUTOTUNE", "1")
    monkeypatch.setattr(autotune, "tuner", lambda: tuner)
    tuner = autotune.Autotuner(tmp_path / "autotune.json")
    args = _moe(hidden=16, inter=16)
    torch.testing.assert_close(fused_moe_triton(*args), fused_moe_reference(*args), atol=1e-5, rtol=1e-5)
    (key,) = json.loads((tmp_path / "autotune.json").read_text())
    assert key == "fused_moe|cpu|float32|16,4,16,16"
    assert tuple(tuner.cached(autotune.TuneKey("fused_moe", "cpu", "float32", (16, 4, 16, 16)))) in (
        candidate_block_sizes(16, 16)
    )
    monkeypatch.setenv("AFDC_AUTOTUNE", "0")
    assert not autotune.enabled(args[0])
    monkeypatch.delenv("AFDC_AUTOTUNE")
    assert not autotune.enabled(args[0])  # by default only CUDA tunes


def test_the_nearest_tuned_config_is_taken_by_sizes_then_tokens():
    h200 = "fused_moe|NVIDIA H200|bfloat16|"
    table = autotune.TunedTable({autotune.TuneKey.parse(h200 + shape): config for shape, config in [
        ("1,128,2048,768", (16, 64, 128)), ("64,128,2048,768", (16, 128, 64)), ("4096,128,2048,768", (128, 128, 64)),
        ("4096,256,7168,2048", (64, 256, 64)),
    ]})
    key = autotune.TuneKey.parse(h200 + "2,128,2048,768")
    assert table.nearest(key) == (16, 64, 128)  # the sizes tuned, the nearest token bucket
    assert table.nearest(autotune.TuneKey.parse(h200 + "1024,128,2048,768")) == (128, 128, 64)
    assert table.nearest(autotune.TuneKey.parse(h200 + "512,128,2048,1024")) == (16, 128, 64)  # near sizes
    assert table.nearest(autotune.TuneKey.parse(h200 + "512,8,512,256")) is None  # far from every tuned shape
    assert table.nearest(autotune.TuneKey.parse("fused_moe|NVIDIA H100 80GB HBM3|bfloat16|1,128,2048,768")) is None
    assert table.nearest(autotune.TuneKey.parse("fused_moe_fp8|NVIDIA H200|bfloat16|1,128,2048,768")) is None


@pytest.mark.parametrize("text", ['{"fused_moe|cpu|float32|16,4": [16, "x", 16]}', "[1, 2]",
                                  '{"fused_moe|cpu|float32|0,4": [16, 16, 16]}', '{"fused_moe|cpu": [16]}'])
def test_a_malformed_table_is_refused_by_entry(tmp_path, text):
    path = tmp_path / "autotuned.json"
    path.write_text(text)
    with pytest.raises(ValueError):
        autotune.TunedTable.read(path)


def test_fused_moe_takes_the_shipped_config_before_tuning(tmp_path, monkeypatch):
    path = tmp_path / "autotuned.json"
    path.write_text(json.dumps({"fused_moe|cpu|float32|16,4,32,16": [16, 16, 32]}))
    monkeypatch.setenv("AFDC_TUNED_CONFIGS", str(path))
    monkeypatch.setenv("AFDC_AUTOTUNE", "1")
    autotune.shipped.cache_clear()

    def no_tuning():
        raise AssertionError("a shape the shipped table covers was tuned again")

    monkeypatch.setattr(autotune, "tuner", no_tuning)
    try:
        near = autotune.TuneKey("fused_moe", "cpu", "float32", (8, 4, 32, 16))
        assert autotune.shipped().nearest(near) == (16, 16, 32)
        args = _moe()  # 5 tokens x top-2: the bucket of 16 pairs
        torch.testing.assert_close(fused_moe_triton(*args), fused_moe_reference(*args), atol=1e-5, rtol=1e-5)
    finally:
        autotune.shipped.cache_clear()
