"""``afdc plan --plot``: throughput against context length and against the A:F ratio.

matplotlib is an optional dependency (``afdc[plot]``), imported only when a plot is asked for.
"""

from __future__ import annotations

from types import ModuleType

from afdc.errors import PlanError
from afdc.planner.result import PlanResult


def require_matplotlib() -> ModuleType:
    """pyplot on a file-only backend, or a PlanError saying how to install it."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:
        raise PlanError("--plot needs matplotlib: pip install 'afdc[plot]' (or pip install matplotlib)") from err
    return plt


def plot(
    result: PlanResult, points_by_context: dict[int, PlanResult], ratio_curve: list[tuple[float, float]], path: str
) -> None:
    """Throughput against context length (AFD and monolithic) and, at ``result``'s context and
    FFN pool, against the A:F ratio."""
    plt = require_matplotlib()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    contexts = sorted(points_by_context)
    afd = [points_by_context[c].afd.tokens_per_gpu_s if points_by_context[c].afd else float("nan") for c in contexts]
    left.plot(contexts, afd, "o-", label="AFD (best xAyF)")
    names = sorted({d.attention_hw for r in points_by_context.values() for d in r.monolithic})
    for hw in names:
        ys = [
            next((d.tokens_per_gpu_s for d in points_by_context[c].monolithic if d.attention_hw == hw), float("nan"))
            for c in contexts
        ]
        left.plot(contexts, ys, "s--", label=f"monolithic on {hw}")
    left.set_xscale("log", base=2)
    left.set_yscale("log")
    left.set_xlabel("context length (tokens)")
    left.set_ylabel("tokens / GPU / s")
    left.legend()
    left.grid(alpha=0.3)
    chosen = result.afd
    if ratio_curve:
        xs, ys = zip(*ratio_curve)
        right.plot(xs, ys, "o-" if len(xs) < 40 else "-", label="best batch at each ratio")
    if chosen is not None:
        right.axvline(chosen.attention_gpus / chosen.ffn_gpus, color="gray", ls=":", label=f"plan {chosen.name}")
        right.legend()
    right.set_xlabel(f"A:F ratio (attention GPUs per FFN GPU) at context {result.facts.context}")
    right.set_ylabel("tokens / GPU / s")
    right.grid(alpha=0.3)
    fig.suptitle(
        f"{result.facts.name}: {result.attention_hw.name} attention, {result.ffn_hw.name} FFN,"
        f" TPOT {result.tpot_target_ms:g} ms"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_comparison(comparison, path: str) -> None:
    """``--compare --plot``: AFD's margin over EP against the A:F ratio, a line per context, with
    the region where AFD loses (the dead zone) shaded; and the same as a ratio x context map."""
    plt = require_matplotlib()
    c = comparison
    contexts = c.contexts
    ratios = sorted({p.ratio for p in c.points})
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.4))
    lo = min([p.margin for p in c.points if p.margin is not None] + [-0.05])
    hi = max([p.margin for p in c.points if p.margin is not None] + [0.05])
    left.axhspan(100 * lo * 1.15 - 1, 0, color="tab:red", alpha=0.12, label="dead zone: AFD loses to EP")
    left.axhline(0, color="gray", lw=0.8)
    for context in contexts:
        pts = c.at(context)
        ys = [100 * p.margin if p.margin is not None else float("nan") for p in pts]
        left.plot([p.ratio for p in pts], ys, "o-", label=f"context {context}")
    left.set_ylim(100 * lo * 1.15 - 1, 100 * hi * 1.15 + 1)
    left.set_xlabel("A:F ratio (attention GPUs per FFN GPU)")
    left.set_ylabel("AFD over EP, tokens/GPU/s (%)")
    left.legend(fontsize=8)
    left.grid(alpha=0.3)
    grid = [[float("nan")] * len(ratios) for _ in contexts]
    for p in c.points:
        if p.margin is not None:
            grid[contexts.index(p.context)][ratios.index(p.ratio)] = 100 * p.margin
    bound = max(abs(100 * lo), abs(100 * hi))
    image = right.imshow(grid, cmap="RdBu", vmin=-bound, vmax=bound, aspect="auto", origin="lower")
    right.set_xticks(range(len(ratios)), [f"{r:g}" for r in ratios])
    right.set_yticks(range(len(contexts)), [str(x) for x in contexts])
    right.set_xlabel("A:F ratio")
    right.set_ylabel("context length (tokens)")
    for i, row in enumerate(grid):
        for j, value in enumerate(row):
            if value == value:  # not NaN
                right.text(j, i, f"{value:+.0f}%", ha="center", va="center", fontsize=7)
    fig.colorbar(image, ax=right, label="AFD over EP (%); red: dead zone")
    fig.suptitle(
        f"{c.model}: AFD ({c.attention_hw.name} attention, {c.ffn_hw.name} FFN) against EP,"
        f" TPOT {c.tpot_target_ms:g} ms"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
