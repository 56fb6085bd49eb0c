"""A plan's result: the recommended AFD deployment, its monolithic rivals, and its JSON and text forms."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from afdc.planner.deployment import Deployment, better
from afdc.planner.facts import ModelFacts
from afdc.planner.hardware import HardwareProfile
from afdc.planner.roofline import Assumptions, Balance


@dataclass(frozen=True)
class Shortfall:
    """Why a deployment cannot meet the target, and by how much."""

    deployment: str
    reason: str


@dataclass(frozen=True)
class PlanResult:
    """The cheapest AFD deployment meeting the TPOT target (None: none does), the best monolithic one
    on each chip, and why (``explanation``; ``shortfalls``: the deployments that cannot meet it)."""

    facts: ModelFacts
    attention_hw: HardwareProfile
    ffn_hw: HardwareProfile
    tpot_target_ms: float
    afd: Deployment | None
    monolithic: tuple[Deployment, ...]
    balance: Balance | None
    explanation: tuple[str, ...]
    shortfalls: tuple[Shortfall, ...] = ()
    assumptions: Assumptions = field(default_factory=Assumptions)

    @property
    def best_monolithic(self) -> Deployment | None:
        best = None
        for d in self.monolithic:
            if better(d, best):
                best = d
        return best

    def to_dict(self) -> dict:
        c = self.facts.cost
        return {
            "model": self.facts.name,
            "context": self.facts.context,
            "kv_dtype": self.facts.kv_dtype,
            "weight_dtype": self.facts.weight_dtype,
            "weights_as_stored": self.facts.weights_as_stored,
            "formulation": c.formulation,
            "kv_bytes": c.kv_bytes,
            "kv_read_bytes": c.kv_read_bytes,
            "attention_flops": c.attention_flops,
            "linear_flops": c.linear_flops,
            "ffn_flops": c.ffn_flops,
            "cut_bytes_to_ffn": c.cut_bytes_to_ffn,
            "cut_bytes_to_attn": c.cut_bytes_to_attn,
            "attention_weight_bytes": self.facts.attention_weight_bytes,
            "ffn_weight_bytes": self.facts.ffn_weight_bytes,
            "plan": {
                "attention_hw": self.attention_hw.name,
                "ffn_hw": self.ffn_hw.name,
                "tpot_target_ms": self.tpot_target_ms,
                "afd": _deployment_dict(self.afd),
                "balance": asdict(self.balance) if self.balance else None,
                "monolithic": [_deployment_dict(d) for d in self.monolithic],
                "explanation": list(self.explanation),
                "shortfalls": [asdict(s) for s in self.shortfalls],
                "assumptions": asdict(self.assumptions),
            },
        }

    def __str__(self) -> str:
        return render(self)


def _deployment_dict(d: Deployment | None) -> dict | None:
    if d is None:
        return None
    out = asdict(d)
    out["name"] = d.name
    out["gpus"] = d.gpus
    return out


def format_bytes(x: float) -> str:
    """``x`` bytes in the largest decimal unit (kB to TB) it reaches, to 3 significant digits."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6)):
        if x >= scale:
            return f"{x / scale:.3g} {unit}"
    return f"{x / 1e3:.3g} kB"


def format_ms(x: float) -> str:
    """``x`` milliseconds, to two decimals, or to two significant digits below 0.1 ms (a tiny
    model's FFN reads 0.00 ms otherwise) or in microseconds below 1 us."""
    if x >= 0.1 or x == 0:
        return f"{x:.2f} ms"
    return f"{x:.2g} ms" if x >= 1e-3 else f"{x * 1e3:.2g} us"


def render(r: PlanResult) -> str:
    """The plan as ``afdc plan`` prints it: what a token costs, each deployment, and why."""
    f, c = r.facts, r.facts.cost
    lines = [
        f"model {f.name}  context {f.context}  weights "
        f"{'as stored, FLOPs at ' if f.weights_as_stored else ''}{f.weight_dtype}  KV {f.kv_dtype}"
        f"  TPOT target {r.tpot_target_ms:g} ms",
        "",
        f"what one decoded token costs ({f.layer_count} layers, whole model)",
        f"  {'':<30}{'attention side':>18}{'FFN side':>18}",
        f"  {'KV cache read':<30}{format_bytes(c.kv_read_bytes):>18}{'':>18}",
        *([f"  {'KV cache held':<30}{format_bytes(c.kv_bytes):>18}{'':>18}"] if c.kv_read_bytes != c.kv_bytes else []),
        f"  {'attention FLOPs (QK, PV)':<30}{_flops(c.attention_flops):>18}{'':>18}",
        f"  {'linear FLOPs (projections, head)':<30}{_flops(c.linear_flops):>18}{'':>18}",
        f"  {'FFN FLOPs (activated)':<30}{'':>18}{_flops(c.ffn_flops):>18}",
        f"  {'weights held':<30}{format_bytes(f.attention_weight_bytes):>18}{format_bytes(f.ffn_weight_bytes):>18}",
        f"  {'weights one token reads':<30}{format_bytes(f.attention_read_bytes):>18}"
        f"{format_bytes(f.ffn_activated_bytes):>18}",
        f"  {'sent across the cut':<30}{format_bytes(c.cut_bytes_to_ffn) + ' out':>18}"
        f"{format_bytes(c.cut_bytes_to_attn) + ' back':>18}",
        f"  attention formulation: {c.formulation}",
        "",
    ]
    if r.afd is not None:
        lines += _deployment_lines("recommended AFD", r.afd, r.attention_hw, r.ffn_hw)
    for d in r.monolithic:
        lines += _deployment_lines("monolithic", d, None, None)
    lines += [f"{s.deployment}: {s.reason}" for s in r.shortfalls]
    if lines[-1]:
        lines.append("")
    lines += ["why:"] + [f"- {line}" for line in r.explanation]
    lines.append("(prices are indicative; edit them with --hw-file)")
    return "\n".join(line.rstrip() for line in lines)


def _flops(x: float) -> str:
    return f"{x / 1e9:.3g} GFLOP" if x >= 1e8 else f"{x / 1e6:.3g} MFLOP" if x >= 1e5 else f"{x:.0f} FLOP"


def _deployment_lines(
    title: str, d: Deployment, hw_a: HardwareProfile | None, hw_f: HardwareProfile | None
) -> list[str]:
    if d.kind == "afd":
        head = f"{title}: {d.name} = {d.attention_gpus} x {hw_a.name} attention + {d.ffn_gpus} x {hw_f.name} FFN"
    else:
        head = f"{title}: {d.name} on {d.gpus} x {d.attention_hw} (DP attention + EP FFN on every GPU)"
    cost = f"${d.cost_per_million_tokens:.3g} per million output tokens" if d.cost_per_million_tokens else "no price"
    t = d.times_ms
    return [
        head,
        f"  batch per attention GPU   {d.batch_per_gpu} (memory allows {d.max_batch_memory}; bound by {d.batch_limit})",
        f"  micro-batches             {d.micro_batches}"
        + (f" (needs >= 2(1 + Tc/Tf) = {d.micro_batches_needed:.2f})" if d.kind == "afd" else ""),
        f"  per micro-batch, all layers: attention {format_ms(t.attention)}, FFN {format_ms(t.ffn)},"
        f" transfer {format_ms(t.to_ffn)} + {format_ms(t.to_attn)} ({d.link})",
        f"  predicted TPOT            {d.tpot_ms:.1f} ms",
        f"  throughput                {d.tokens_per_gpu_s:.0f} tokens/GPU/s"
        f" ({d.tokens_per_s:.0f} tokens/s on {d.gpus} GPUs)",
        f"  cost                      {cost}",
        f"  memory per GPU            attention {d.attention_memory_gb:.1f} GB"
        + (f", FFN {d.ffn_memory_gb:.1f} GB" if d.kind == "afd" else ""),
        "",
    ]
