"""The planner's predictions beside published AFD results (issue 57), one line per scenario.

Each scenario (``afdc.planner.published``) is built from its source's stated setup; what the
source leaves out is printed as assumed. The models are captured from ``benchmarks/configs`` on
the meta device (no GPU, no weights): ``python benchmarks/bench_planner.py [--verbose]``.

Each prediction is the product of three factors (``afdc.planner.compare.factors``): sequences per
AFD attention GPU over per baseline GPU (batch), the baseline's step time over AFD's (step), and
the share of AFD's GPUs that decode (share). The last column is the step ratio the published
figure needs at the model's batch and share.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from afdc.planner.hardware import get_profile
from afdc.planner.published import config_facts, scenarios

CONFIGS = Path(__file__).resolve().parent / "configs"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--verbose", action="store_true", help="print each scenario's deployments and assumptions")
    args = parser.parse_args()
    facts = {}
    rows = []
    for model, s in scenarios(get_profile):
        if model.key not in facts:
            start = time.perf_counter()
            facts[model.key] = config_facts(str(CONFIGS / model.config), model.overrides, model.weight_dtype)
            print(f"captured {model.config} ({model.weight_dtype}) in {time.perf_counter() - start:.0f} s")
        predicted = s.predict(facts[model.key])
        rows.append((s, predicted, s.gap(facts[model.key])))
        if args.verbose:
            afd, base = s.deployments(facts[model.key](s.context))
            for d in (afd, base):
                if d is not None:
                    print(
                        f"  {s.name}: {d.name} batch {d.batch_per_gpu} ({d.batch_limit}), TPOT {d.tpot_ms:.1f} ms,"
                        f" {d.tokens_per_gpu_s:.0f} tokens/GPU/s"
                    )
            print(f"  model: {model.note}\n  stated: {s.stated}\n  assumed: {s.assumed}")
    # predicted = batch x step x share; the published figure at the model's batch and share needs
    # the step ratio in the last column: the distance between the two step columns is the miss
    print(f"\n{'scenario':<46} {'predicted':>9} {'published':>9} {'gap':>8} {'batch':>6} {'share':>6}"
          f" {'step':>6} {'needed':>6}  source")
    for s, predicted, g in rows:
        gap = f"{(predicted - s.published) * 100:+.1f}pp"
        split = f"{g.batch:>6.2f} {g.share:>6.2f} {g.step:>6.2f} {g.implied_step:>6.2f}" if g else f"{'-':>27}"
        print(f"{s.name:<46} {predicted:>9.3f} {s.published:>9.3f} {gap:>8} {split}  {s.source}")


if __name__ == "__main__":
    main()
