"""`afdc compile --no-weights` on every real config in ../shared/configs: time and peak memory.

Each compile runs in its own process (as a user would run it), so the peak RSS is that
compile's alone. Targets (issue 3): under 60 s and under 4 GB per config.

    python benchmarks/bench_compile.py [--plan 2A2F] [--attn-tp N] [--configs DIR]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TARGET_S, TARGET_GB = 60.0, 4.0


def run(config: Path, plan: str, attn_tp: int, out: Path) -> tuple[float, float, int, str]:
    """(seconds, peak RSS in GB, exit code, last line of output) of one compile."""
    cmd = [sys.executable, "-m", "afdc.cli", "compile", str(config), "--plan", plan, "--attn-tp", str(attn_tp),
           "--no-weights", "--quiet", "-o", str(out)]
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    output = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - start
    lines = [line for line in output.splitlines() if line.strip()]
    return seconds, usage.ru_maxrss / 2**20, os.waitstatus_to_exitcode(status), lines[-1] if lines else ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plan", default="2A2F")
    parser.add_argument("--attn-tp", type=int, default=1, help="tensor parallelism inside each attention rank")
    parser.add_argument("--configs", type=Path, default=Path(__file__).resolve().parents[2] / "shared" / "configs")
    args = parser.parse_args()
    configs = sorted(args.configs.glob("*.json"))
    print(f"afdc compile --plan {args.plan} --attn-tp {args.attn_tp} --no-weights, one process per config; "
          f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    print(f"{'config':28s} {'seconds':>8s} {'peak GB':>8s}  result")
    worst_s = worst_gb = 0.0
    failed = 0
    with tempfile.TemporaryDirectory() as tmp:
        for config in configs:
            out = Path(tmp) / config.stem
            seconds, gb, code, last = run(config, args.plan, args.attn_tp, out)
            shutil.rmtree(out, ignore_errors=True)
            worst_s, worst_gb = max(worst_s, seconds), max(worst_gb, gb)
            failed += code != 0
            print(f"{config.stem:28s} {seconds:8.1f} {gb:8.2f}  {'ok' if code == 0 else 'FAILED'}: {last[:90]}",
                  flush=True)
    print(f"worst: {worst_s:.1f} s (target < {TARGET_S:.0f} s: {'met' if worst_s < TARGET_S else 'MISSED'}), "
          f"{worst_gb:.2f} GB (target < {TARGET_GB:.0f} GB: {'met' if worst_gb < TARGET_GB else 'MISSED'}), "
          f"{failed} failed")


if __name__ == "__main__":
    main()
