"""The figures a GPU session exists for, in one table, from the JSON its sections wrote.

Reads what ``benchmarks/gpu_session.sh`` left in ``OUT`` (served.json, model.json, kernels.json;
a section that did not run or wrote nothing is named as missing) and prints: the served setups'
correctness and tok/s and TPOT ratios (AFD over the monolith), the model section's correctness
and speed ratios, and the fused MoE's share of the GPU's peak against transformers' grouped_mm.

Run:  python benchmarks/gpu_summary.py OUT
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def _read(out: Path, name: str) -> dict | None:
    try:
        return json.loads((out / f"{name}.json").read_text())
    except (OSError, ValueError):
        print(f"{name}: no results (the section did not run, or failed before writing them)")
        return None


def ratio_table(mono: dict, afd: dict) -> list[str]:
    """AFD's figures against the monolith's at each concurrency both measured (``bench_gpu_serve``
    prints it too; defined here, where nothing heavy is imported, so the summary starts at once)."""
    rows = [f"{'in flight':>9} {'mono tok/s':>11} {'AFD tok/s':>10} {'ratio':>6} {'mono TPOT':>10} "
            f"{'AFD TPOT':>9} {'ratio':>6} {'mono TTFT':>10} {'AFD TTFT':>9}"]
    for key in sorted((k for k in mono if k[:1] == "c" and k[1:].isdigit() and k in afd), key=lambda k: int(k[1:])):
        m, a = mono[key], afd[key]
        rows.append(f"{key[1:]:>9} {m['output_throughput']:>11.0f} {a['output_throughput']:>10.0f} "
                    f"{a['output_throughput'] / m['output_throughput']:>6.2f} {m['median_tpot_ms']:>10.2f} "
                    f"{a['median_tpot_ms']:>9.2f} {a['median_tpot_ms'] / m['median_tpot_ms']:>6.2f} "
                    f"{m['median_ttft_ms']:>10.1f} {a['median_ttft_ms']:>9.1f}")
    return rows


def served(data: dict) -> None:
    if not {"monolithic", "afd", "failed"} <= data.keys():
        print("served: not bench_gpu_serve.py's results")
        return
    if data["failed"]:
        print(f"served on {data.get('device')}: FAILED: {'; '.join(data['failed'])}")
        return
    print(f"served on {data['device']} ({data['layers']} layers): AFD ids == monolith ids "
          f"{data['afd_ids_equal_monolithic']}; prompts equal to dm.generate's {data['ids_equal_dm_generate']}")
    print("\n".join("  " + row for row in ratio_table(data["monolithic"], data["afd"])))
    if "afd_graphs" in data:
        print(f"  with attention graphs (AFD ids == monolith ids {data['afd_graphs_ids_equal_monolithic']}):")
        print("\n".join("  " + row for row in ratio_table(data["monolithic"], data["afd_graphs"])))


def model(data: dict) -> None:
    for key, row in data.items():
        if not isinstance(row, dict) or "dm_greedy_equal" not in row:
            continue
        speed = row.get("afdc") or row.get("eager") or {}
        per_token, prefill = (speed.get(k, float("nan")) for k in ("per_token_ratio", "prefill_ratio"))
        print(f"{key}: ok {row.get('ok')}, greedy equal {row['dm_greedy_equal']}, logits rel {row['dm_rel_diff']:.3g}, "
              f"per token x{per_token:.2f}, prefill x{prefill:.2f} the monolith's time")


def kernels(data: dict) -> None:
    rows = {}
    for r in data.get("moe", []):
        rows.setdefault((r["model"], r["tokens"]), {})[r["impl"]] = r
    for (name, tokens), impls in rows.items():
        ours, hf = impls.get("afdc triton"), impls.get("hf grouped_mm")
        if ours is None or ours.get("ms") is None:
            continue
        vs = f", x{hf['ms'] / ours['ms']:.2f} grouped_mm's speed" if hf and hf.get("ms") else ""
        print(f"fused MoE {name} T={tokens}: {100 * (ours.get('frac_peak') or 0):.1f}% of bf16 peak, "
              f"{100 * (ours.get('frac_hbm') or 0):.0f}% of HBM{vs}")


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        raise SystemExit("usage: python benchmarks/gpu_summary.py OUT")
    out = Path(argv[0])
    for name, show in (("served", served), ("model", model), ("kernels", kernels)):
        data = _read(out, name)
        if data is not None:
            show(data)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
