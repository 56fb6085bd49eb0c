"""afdc's Triton kernels against torch eager, torch.compile and transformers, measured in one run on one GPU.

(1) Fused MoE (``afdc.codegen.fused_moe.fused_moe_triton``) at the routed-expert shapes of
    Qwen3-30B-A3B, DeepSeek-V3 and Mixtral-8x7B, read from their configs (``--configs``: hidden_size,
    moe_intermediate_size or intermediate_size, routed experts, experts per token): bf16, one rank
    holding every expert, 1 / 64 / 512 / 4096 tokens, uniform random top-k routing (the same for every
    implementation). Against the PyTorch reference (``fused_moe_reference``, transformers' loop over
    the experts hit) in eager mode, torch.compile (Inductor) of that reference, and transformers'
    ``grouped_mm`` experts implementation (``transformers.integrations.moe.grouped_mm_experts_forward``
    called on the model's own experts module; "n/a" where this transformers lacks it).
    Printed: median time, TFLOP/s with FLOPs = 2 T K (H 2I + I H), the fraction of the device's dense
    bf16 peak, the weight bytes of the experts hit (+ input and output) per second as a fraction of
    HBM bandwidth (the bound at decode sizes), and the speed-up over eager.
    Target: afdc >= 60% of the bf16 dense peak at 4096 tokens.
    ``--models gpt-oss-120b`` adds gpt-oss's expert format (input-major weights, interleaved gate/up,
    per-expert biases, clamped swigluoai with the config's swiglu_limit), which fused_moe takes as
    options; transformers' grouped_mm then runs gpt-oss's own experts module with the same biases.
    A model with shared experts (DeepSeek-V3: n_shared_experts x moe_intermediate_size) adds two rows:
    afdc's fused MoE with the shared expert inside its launches ("+shared fused") and the fused MoE
    plus the shared MLP as separate torch ops ("+shared apart"); the note gives apart / fused.
(2) Row kernels (rms_norm, add_rms_norm, layer_norm, act_mul with silu) at [tokens, hidden] 4096x4096,
    4096x7168 and 16384x4096, bf16: effective GB/s (the bytes the op must read and write, the same count
    for every implementation) as a fraction of HBM bandwidth, against eager and torch.compile of the
    references. act_mul reads gate and up in place as the two halves of one [tokens, 2 hidden] tensor.
    Target: >= 80% of HBM bandwidth.

(3) Quantized kernels (``--skip-quant`` leaves them out), per model at the same token counts, the weights
    quantized from the bf16 ones: fp8 block-scaled [128, 128] experts (``afdc::fused_moe_fp8``)
    weight-only, and w8a8 where the GPU has fp8 tensor cores (compute capability >= 8.9); gpt-oss's
    MXFP4 experts (``afdc::fused_moe_mxfp4``); and a DeepSeek-V3-sized dense fp8 linear
    (``afdc::fp8_linear``, 7168 -> 18432). Each against the dequantize-then-bf16 path (the format's
    dequantization, then the bf16 kernel: what running a quantized checkpoint widened costs per call)
    and against the bf16 kernel alone on the widened weights. Printed: median ms, and the ratios
    quantized / bf16 and (dequantize + bf16) / quantized, measured in the same run. Each model keeps
    at most QUANT_EXPERTS of its experts here (its per-expert sizes and top-k), for the widened copies'
    memory.

Peaks come from afdc's hardware table (afdc/data/hardware.json), matched on torch.cuda.get_device_name();
override them with --peak-tflops / --hbm-gbps. Every implementation's output is checked against the
eager reference (column "check"); a mismatch is printed, not hidden.

Timing: CUDA events around each call, after --warmup untimed calls (which also compile); the L2 cache
is flushed (a 256 MB write, outside the events) before each timed call; the median of --repeats.
afdc's fused MoE tunes its tile sizes on CUDA by default (afdc.codegen.autotune; AFDC_AUTOTUNE=0 turns
it off): the tuning runs in the first, untimed call of each shape, and the header says which cache it used.

The reference loops over the experts hit with data-dependent shapes (unique, where, tolist), so Dynamo
breaks its graph there and Inductor compiles the pieces between the breaks: its figure is what
torch.compile makes of that code, not of an ideal MoE. Its compiles dominate the run time (tens of
seconds per MoE case); the JSON is rewritten after each model, and a run can be split with --models,
--tokens, --skip-moe, --skip-norm or shortened with --skip-compile. DeepSeek-V3's experts take 22.5 GB.

Run:  python benchmarks/bench_kernels.py [--json out.json] [--models deepseek-v3] [--skip-norm] ...
      python benchmarks/bench_kernels.py --smoke    (any machine: every path once at tiny shapes, in
          Triton's interpreter without a GPU, checked against the references; prints no timings)
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import io
import json
import math
import os
import re
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

MODELS = ("qwen3-30b-a3b", "deepseek-v3", "mixtral-8x7b")
TOKENS = (1, 64, 512, 4096)
ROW_SHAPES = ((4096, 4096), (4096, 7168), (16384, 4096))
TARGET_MOE = 0.60  # of the bf16 dense peak, afdc at the largest token count
TARGET_ROW = 0.80  # of HBM bandwidth
DEFAULT_CONFIGS = Path(__file__).resolve().parents[2] / "shared" / "configs"
# transformers' hidden_act -> afdc's activation names
ACTIVATIONS = {
    "silu": "silu",
    "swish": "silu",
    "gelu": "gelu",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_new": "gelu_tanh",
}
TOL = {"atol": 2e-2, "rtol": 2e-2}  # bf16 outputs, fp32 accumulation in a different order
# --smoke: tiny shapes the interpreter runs in seconds; sizes are multiples of no block size
SMOKE_TOKENS = (48,)  # x top-3 (Qwen, DeepSeek): 64-row blocks; x top-2 (Mixtral): 16-row blocks
SMOKE_MOE = {"hidden": 40, "inter": 24, "experts": 8, "top_k": 3}
SMOKE_ROWS = ((5, 72),)
SMOKE_QUANT = {"hidden": 256, "inter": 128, "experts": 4, "top_k": 2}  # whole 128-blocks (MXFP4 needs 32s)
SMOKE_LINEAR = (200, 136)

torch = None  # imported in main(), after TRITON_INTERPRET is settled


# -- configs ---------------------------------------------------------------------------------------


@dataclass
class MoeShape:
    """The routed experts of one model; ``keys`` names the config field each size was read from."""

    model: str
    model_type: str
    hidden: int
    inter: int
    experts: int
    top_k: int
    activation: str
    keys: dict[str, str]
    raw: dict
    gpt_oss: bool = False  # gpt-oss's expert format (see the module docstring)
    shared_inter: int = 0  # the shared experts' intermediate size, 0 without

    def scaled(self, hidden: int, inter: int, experts: int, top_k: int) -> MoeShape:
        """The same model at other sizes (for --smoke); ``raw`` is edited to match."""
        sizes = {"hidden": hidden, "inter": inter, "experts": min(experts, self.experts), "top_k": 0}
        sizes["top_k"] = min(top_k, self.top_k, sizes["experts"])
        raw = dict(self.raw)
        for name, value in sizes.items():
            raw[self.keys[name]] = value
        return MoeShape(self.model, self.model_type, **sizes, activation=self.activation, keys=self.keys, raw=raw,
                        gpt_oss=self.gpt_oss, shared_inter=2 * sizes["inter"] if self.shared_inter else 0)


def _pick(cfg: dict, path: Path, *names: str) -> tuple[str, int]:
    for name in names:
        if cfg.get(name) is not None:
            return name, int(cfg[name])
    raise SystemExit(f"{path}: none of {', '.join(names)} is set")


def read_moe_shape(path: Path) -> MoeShape:
    if not path.is_file():
        raise SystemExit(f"config {path} not found (pass --configs DIR)")
    raw = json.loads(path.read_text())
    keys, sizes = {}, {}
    for name, fields in (
        ("hidden", ("hidden_size",)),
        ("inter", ("moe_intermediate_size", "intermediate_size")),
        ("experts", ("num_experts", "n_routed_experts", "num_local_experts")),
        ("top_k", ("num_experts_per_tok",)),
    ):
        keys[name], sizes[name] = _pick(raw, path, *fields)
    if raw["model_type"] == "gpt_oss":  # its experts ignore hidden_act
        return MoeShape(path.stem, "gpt_oss", **sizes, activation="swigluoai", keys=keys, raw=raw, gpt_oss=True)
    act = raw.get("hidden_act", "silu")
    if act not in ACTIVATIONS:
        raise SystemExit(f"{path}: hidden_act {act!r} is not one of {', '.join(ACTIVATIONS)}")
    shared = (raw.get("n_shared_experts") or 0) * sizes["inter"] or raw.get("shared_expert_intermediate_size") or 0
    return MoeShape(path.stem, raw["model_type"], **sizes, activation=ACTIVATIONS[act], keys=keys, raw=raw,
                    shared_inter=shared)


def expert_weights(shape: MoeShape, device: str, gen) -> tuple[tuple, dict]:
    """``(w_gate_up, w_down)`` in the model's own layout, and ``fused_moe``'s options for it
    (gpt-oss: input-major, interleaved, biased, its activation's alpha and limit)."""
    E, H, inter, dtype = shape.experts, shape.hidden, shape.inter, torch.bfloat16
    # N(0, 1/fan_in) weights keep the gate/up and down outputs of order 1 for N(0, 1) inputs
    w_gate_up = torch.randn(E, 2 * inter, H, generator=gen, device=device, dtype=dtype).mul_(H**-0.5)
    w_down = torch.randn(E, H, inter, generator=gen, device=device, dtype=dtype).mul_(inter**-0.5)
    if not shape.gpt_oss:
        return (w_gate_up, w_down), {}
    options = {
        "b_gate_up": torch.randn(E, 2 * inter, generator=gen, device=device, dtype=dtype).mul_(0.1),
        "b_down": torch.randn(E, H, generator=gen, device=device, dtype=dtype).mul_(0.1),
        "transposed": True,
        "interleaved": True,
        "alpha": 1.702,  # fixed in transformers' GptOssExperts
        "limit": float(shape.raw.get("swiglu_limit", 7.0)),
    }
    return (w_gate_up.transpose(1, 2).contiguous(), w_down.transpose(1, 2).contiguous()), options


# -- hardware --------------------------------------------------------------------------------------


def _key(name: str) -> str:
    return re.sub(r"[^a-z0-9]", "", name.lower())


def device_profile(device_name: str):
    """afdc's hardware profile whose name or alias is a word of ``device_name``
    ("NVIDIA H100 80GB HBM3" -> H100, "NVIDIA A100-SXM4-80GB" -> A100); None when none is."""
    from afdc.planner.hardware import load_profiles

    words = {_key(w) for w in re.split(r"[\s_\-/]+", device_name)} | {_key(device_name)}
    best, best_len = None, 0
    for profile in load_profiles().values():
        for key in {_key(profile.name), *(_key(a) for a in profile.aliases)}:
            if key in words and len(key) > best_len:
                best, best_len = profile, len(key)
    return best


# -- timing ----------------------------------------------------------------------------------------


class CudaTimer:
    """Median milliseconds of ``fn()`` by CUDA events, after warm-up calls, L2 flushed before each call."""

    def __init__(self, warmup: int, repeats: int, flush_mb: int):
        self.warmup, self.repeats = warmup, repeats
        self.flush = torch.empty(flush_mb << 20, dtype=torch.uint8, device="cuda") if flush_mb else None

    def __call__(self, fn: Callable[[], object]) -> float:
        for _ in range(self.warmup):
            fn()
        torch.cuda.synchronize()
        events = []
        for _ in range(self.repeats):
            if self.flush is not None:
                self.flush.zero_()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            events.append((start, end))
        torch.cuda.synchronize()
        return statistics.median(start.elapsed_time(end) for start, end in events)


def _as_tuple(out) -> tuple:
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


def check(out, expected) -> tuple[bool, float]:
    """(within bf16 tolerance of the reference, max abs difference)."""
    outs, exps = _as_tuple(out), _as_tuple(expected)
    ok, worst = len(outs) == len(exps), 0.0
    for a, b in zip(outs, exps):
        if a.shape != b.shape or a.dtype != b.dtype:
            return False, math.inf
        worst = max(worst, (a.float() - b.float()).abs().max().item() if a.numel() else 0.0)
        ok = ok and torch.allclose(a.float(), b.float(), **TOL)
    return ok, worst


@dataclass
class Run:
    """One implementation on one case: its timing (None in --smoke or when it failed) and check."""

    impl: str
    ms: float | None = None
    check: str = "n/a"
    note: str = ""


def run_impl(impl: str, fn: Callable | None, expected, timer: CudaTimer | None, strict: bool, why_na: str = "") -> Run:
    """Call ``fn`` once and check it against ``expected``; then time it when ``timer`` is given.

    ``strict`` (--smoke): a mismatch or an error raises. Otherwise both are recorded in the row, so one
    failing implementation does not lose the rest of the run.
    """
    if fn is None:
        return Run(impl, check="n/a", note=why_na[:160])
    try:
        ok, worst = check(fn(), expected)
        if strict and not ok:
            raise AssertionError(f"{impl}: max abs difference {worst:.3g} from the reference (tolerance {TOL})")
        run = Run(impl, check="ok" if ok else f"DIFF {worst:.2g}")
        if timer is not None:
            run.ms = timer(fn)
        return run
    except Exception as err:
        if strict:
            raise
        if torch.cuda.is_available() and isinstance(err, torch.cuda.OutOfMemoryError):
            torch.cuda.empty_cache()
        first_line = str(err).strip().splitlines()[0][:100] if str(err).strip() else ""
        return Run(impl, check="error", note=f"{type(err).__name__}: {first_line}")


def autotune_state(device: str) -> str:
    """Whether afdc tunes the fused MoE's tile sizes here (afdc.codegen.autotune, AFDC_AUTOTUNE), and its cache."""
    try:
        from afdc.codegen import autotune

        if not autotune.enabled(torch.empty(0, device=device)):
            return "off (default block sizes)"
        path = Path(autotune.tuner().path)
        cached = "read from" if path.is_file() else "new:"
        return f"on, tuned in the first (untimed) call of each shape bucket; cache {cached} {path}"
    except Exception as err:  # afdc without the autotune module, or a changed one
        return f"unknown ({type(err).__name__}: {err})"


def compiled(fn: Callable) -> Callable:
    """torch.compile (Inductor, static shapes) of ``fn``; the caches are reset per case by the callers."""
    return torch.compile(fn, dynamic=False)


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _num(x: float | None, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


# -- (1) fused MoE ---------------------------------------------------------------------------------


def hf_grouped_mm(shape: MoeShape, w_gate_up, w_down, options: dict) -> tuple[Callable | None, str]:
    """``(fn(x, topk_ids, topk_weights), why_not)``: transformers' grouped_mm experts forward, called
    as transformers' experts dispatch calls it, on the model's own experts module holding our weights."""
    try:
        from transformers import AutoConfig
        from transformers.integrations import moe as hf_moe
    except ImportError as err:
        return None, f"transformers.integrations.moe: {err}"
    forward = getattr(hf_moe, "grouped_mm_experts_forward", None)
    if forward is None:
        return None, "this transformers has no grouped_mm_experts_forward"
    mt = shape.model_type
    try:
        modeling = importlib.import_module(f"transformers.models.{mt}.modeling_{mt}")
    except ImportError as err:
        return None, f"no modeling_{mt}: {err}"
    nn = torch.nn
    classes = [
        v
        for k, v in vars(modeling).items()
        if k.endswith("Experts") and isinstance(v, type) and issubclass(v, nn.Module) and hasattr(v, "_apply_gate")
    ]
    if not classes:
        return None, f"modeling_{mt} has no experts class using use_experts_implementation"
    fields = {k: v for k, v in shape.raw.items() if k not in ("model_type", "transformers_version", "auto_map")}
    try:
        config = AutoConfig.for_model(mt, **fields)
        config._experts_implementation = "grouped_mm"
        with torch.device("meta"):  # no memory: the parameters are replaced by ours below
            experts = classes[0](config)
    except Exception as err:
        return None, f"cannot build {classes[0].__name__}: {type(err).__name__}: {err}"
    if tuple(experts.gate_up_proj.shape) != tuple(w_gate_up.shape):
        return None, f"{classes[0].__name__}.gate_up_proj is {tuple(experts.gate_up_proj.shape)}"
    experts.gate_up_proj = nn.Parameter(w_gate_up, requires_grad=False)
    experts.down_proj = nn.Parameter(w_down, requires_grad=False)
    if shape.gpt_oss:
        experts.gate_up_proj_bias = nn.Parameter(options["b_gate_up"], requires_grad=False)
        experts.down_proj_bias = nn.Parameter(options["b_down"], requires_grad=False)
    experts.eval()
    return functools.partial(forward, experts), ""


def moe_flops(tokens: int, shape: MoeShape, shared: bool = False) -> float:
    routed = 2.0 * tokens * shape.top_k * 3 * shape.hidden * shape.inter
    return routed + (2.0 * tokens * 3 * shape.hidden * shape.shared_inter if shared else 0.0)


def shared_expert_runs(shape: MoeShape, args: tuple, options: dict, shared: dict, timer, strict: bool) -> list:
    """The fused MoE with the shared expert inside its launches, and beside them as torch ops."""
    from afdc.codegen.act_mul import act_mul_reference
    from afdc.codegen.fused_moe import fused_moe_reference, fused_moe_triton

    x, F = args[0], torch.nn.functional

    def apart():
        gate, up = F.linear(x, shared["s_gate"]), F.linear(x, shared["s_up"])
        return fused_moe_triton(*args, **options) + F.linear(act_mul_reference(gate, up, shape.activation),
                                                             shared["s_down"])

    expected = fused_moe_reference(*args, **options, **shared)
    fused = run_impl("+shared fused", functools.partial(fused_moe_triton, *args, **options, **shared), expected,
                     timer, strict)
    return [fused, run_impl("+shared apart", apart, expected, timer, strict)]


def bench_moe_model(shape: MoeShape, tokens_list, timer, device, strict: bool, skip_compile: bool) -> list[dict]:
    from afdc.codegen.fused_moe import fused_moe_reference, fused_moe_triton

    dtype = torch.bfloat16
    E, H, inter, K = shape.experts, shape.hidden, shape.inter, shape.top_k
    gen = torch.Generator(device=device).manual_seed(0)
    (w_gate_up, w_down), options = expert_weights(shape, device, gen)
    hf_fn, hf_why = hf_grouped_mm(shape, w_gate_up, w_down, options)
    shared = {}
    if shape.shared_inter:
        Is = shape.shared_inter
        shared = {
            "s_gate": torch.randn(Is, H, generator=gen, device=device, dtype=dtype).mul_(H**-0.5),
            "s_up": torch.randn(Is, H, generator=gen, device=device, dtype=dtype).mul_(H**-0.5),
            "s_down": torch.randn(H, Is, generator=gen, device=device, dtype=dtype).mul_(Is**-0.5),
        }
    act = shape.activation
    rows = []
    for tokens in tokens_list:
        x = torch.randn(tokens, H, generator=gen, device=device, dtype=dtype)
        # uniform top-k: the K largest of E uniform draws are a uniformly random K-subset of the experts
        ids = torch.rand(tokens, E, generator=gen, device=device).topk(K, dim=-1).indices
        weights = torch.rand(tokens, K, generator=gen, device=device)
        weights = (weights / weights.sum(-1, keepdim=True)).to(dtype)  # routers hand transformers' experts bf16
        args = (x, w_gate_up, w_down, weights, ids, 0, act)
        torch.compiler.reset()
        with torch.no_grad():
            expected = fused_moe_reference(*args, **options)
            ref_c = None if skip_compile else compiled(fused_moe_reference)
            runs = [
                run_impl("afdc triton", functools.partial(fused_moe_triton, *args, **options), expected, timer, strict),
                run_impl(
                    "torch eager", functools.partial(fused_moe_reference, *args, **options), expected, timer, strict
                ),
                run_impl(
                    "torch.compile", ref_c and functools.partial(ref_c, *args, **options), expected, timer, strict,
                    "skipped",
                ),
                run_impl(
                    "hf grouped_mm",
                    hf_fn and functools.partial(hf_fn, x, ids, weights),
                    expected,
                    timer,
                    strict,
                    hf_why,
                ),
            ]
            with_shared = shared_expert_runs(shape, args, options, shared, timer, strict) if shared else []
        hit = int(ids.unique().numel())
        moved = (hit * 3 * H * inter + 2 * tokens * H) * w_down.element_size()
        eager_ms = runs[1].ms
        if len(with_shared) == 2 and with_shared[0].ms and with_shared[1].ms:
            with_shared[0].note = f"apart / fused x{with_shared[1].ms / with_shared[0].ms:.2f}"
        for extra, r in [(False, r) for r in runs] + [(True, r) for r in with_shared]:
            rows.append(
                {
                    "model": shape.model,
                    "hidden": H,
                    "inter": inter,
                    "experts": E,
                    "top_k": K,
                    "tokens": tokens,
                    "experts_hit": hit,
                    "impl": r.impl,
                    "ms": r.ms,
                    "flops": moe_flops(tokens, shape, shared=extra),
                    "bytes": moved + (3 * H * shape.shared_inter * w_down.element_size() if extra else 0),
                    "speedup_vs_eager": eager_ms / r.ms if r.ms and eager_ms and not extra else None,
                    "check": r.check,
                    "note": r.note,
                }
            )
        del x, ids, weights, args, expected, ref_c
    del w_gate_up, w_down, options, shared, hf_fn  # DeepSeek-V3's are 22.5 GB: give them back before the next model
    torch.compiler.reset()
    if device == "cuda":
        torch.cuda.empty_cache()
    return rows


def print_moe(rows: list[dict], peak_flops: float | None, hbm: float | None) -> None:
    head = (
        f"{'model':<15}{'tokens':>7} {'impl':<15}{'ms':>10}{'TFLOP/s':>9}{'% peak':>8}{'% HBM':>8}{'x eager':>9}  check"
    )
    print(head)
    last = None
    for r in rows:
        if last is not None and (r["model"], r["tokens"]) != last:
            print()
        last = (r["model"], r["tokens"])
        ms = r["ms"]
        tflops = r["flops"] / (ms * 1e-3) / 1e12 if ms else None
        r["tflops"] = tflops
        r["frac_peak"] = tflops * 1e12 / peak_flops if tflops and peak_flops else None
        r["frac_hbm"] = r["bytes"] / (ms * 1e-3) / hbm if ms and hbm else None
        note = f"  {r['note']}" if r["note"] else ""
        print(
            f"{r['model']:<15}{r['tokens']:>7} {r['impl']:<15}{_num(ms, '.3f'):>10}{_num(tflops, '.1f'):>9}"
            f"{_pct(r['frac_peak']):>8}{_pct(r['frac_hbm']):>8}{_num(r['speedup_vs_eager'], '.2f'):>9}"
            f"  {r['check']}{note}"
        )


# -- (2) row kernels -------------------------------------------------------------------------------


def row_cases(tokens: int, hidden: int, device: str, gen) -> list[tuple]:
    """``(name, triton fn, reference fn, args, bytes read + written)`` for one [tokens, hidden] shape."""
    from afdc.codegen.act_mul import act_mul_reference, act_mul_triton
    from afdc.codegen.layer_norm import layer_norm_reference, layer_norm_triton
    from afdc.codegen.rms_norm import (
        add_rms_norm_reference,
        add_rms_norm_triton,
        rms_norm_reference,
        rms_norm_triton,
    )

    bf16 = torch.bfloat16

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=device, dtype=bf16)

    x, residual = randn(tokens, hidden), randn(tokens, hidden)
    weight, bias = randn(hidden).mul_(0.1).add_(1.0), randn(hidden).mul_(0.1)
    gate, up = randn(tokens, 2 * hidden).chunk(2, dim=-1)  # the halves of a fused gate-up projection
    n, e = tokens * hidden, 2  # bf16 elements per [tokens, hidden] tensor, bytes per element
    return [
        ("rms_norm", rms_norm_triton, rms_norm_reference, (x, weight, 1e-6, 0.0, bf16), (2 * n + hidden) * e),
        (
            "add_rms_norm",
            add_rms_norm_triton,
            add_rms_norm_reference,
            (x, residual, weight, 1e-6, 0.0, bf16),
            (4 * n + hidden) * e,
        ),
        (
            "layer_norm",
            layer_norm_triton,
            layer_norm_reference,
            (x, weight, bias, 1e-5, bf16),
            (2 * n + 2 * hidden) * e,
        ),
        ("act_mul", act_mul_triton, act_mul_reference, (gate, up, "silu"), 3 * n * e),
    ]


def bench_rows(shapes, timer, device, strict: bool, skip_compile: bool) -> list[dict]:
    gen = torch.Generator(device=device).manual_seed(1)
    rows = []
    for tokens, hidden in shapes:
        for name, kernel, reference, args, moved in row_cases(tokens, hidden, device, gen):
            torch.compiler.reset()
            with torch.no_grad():
                expected = reference(*args)
                ref_c = None if skip_compile else compiled(reference)
                runs = [
                    run_impl("afdc triton", functools.partial(kernel, *args), expected, timer, strict),
                    run_impl("torch eager", functools.partial(reference, *args), expected, timer, strict),
                    run_impl(
                        "torch.compile", ref_c and functools.partial(ref_c, *args), expected, timer, strict, "skipped"
                    ),
                ]
            eager_ms = runs[1].ms
            for r in runs:
                rows.append(
                    {
                        "op": name,
                        "tokens": tokens,
                        "hidden": hidden,
                        "impl": r.impl,
                        "ms": r.ms,
                        "bytes": moved,
                        "speedup_vs_eager": eager_ms / r.ms if r.ms and eager_ms else None,
                        "check": r.check,
                        "note": r.note,
                    }
                )
            del args, expected, ref_c
    torch.compiler.reset()
    if device == "cuda":
        torch.cuda.empty_cache()
    return rows


def print_rows(rows: list[dict], hbm: float | None) -> None:
    print(f"{'op':<14}{'shape':>12} {'impl':<15}{'ms':>9}{'GB/s':>9}{'% HBM':>8}{'x eager':>9}  check")
    last = None
    for r in rows:
        if last is not None and (r["op"], r["tokens"], r["hidden"]) != last:
            print()
        last = (r["op"], r["tokens"], r["hidden"])
        ms = r["ms"]
        gbps = r["bytes"] / (ms * 1e-3) / 1e9 if ms else None
        r["gbps"] = gbps
        r["frac_hbm"] = gbps * 1e9 / hbm if gbps and hbm else None
        note = f"  {r['note']}" if r["note"] else ""
        shape = f"{r['tokens']}x{r['hidden']}"
        print(
            f"{r['op']:<14}{shape:>12} "
            f"{r['impl']:<15}{_num(ms, '.4f'):>9}{_num(gbps, '.0f'):>9}{_pct(r['frac_hbm']):>8}"
            f"{_num(r['speedup_vs_eager'], '.2f'):>9}  {r['check']}{note}"
        )


# -- main ------------------------------------------------------------------------------------------


def summary(moe_rows: list[dict], row_rows: list[dict]) -> None:
    """afdc's figure against each target: at the largest token count for the MoE, at every row-kernel case."""
    print("\n== targets (afdc triton)")
    if moe_rows:
        largest = max(r["tokens"] for r in moe_rows)
        for r in moe_rows:
            if r["impl"] == "afdc triton" and r["tokens"] == largest:
                frac = r.get("frac_peak")
                verdict = "n/a" if frac is None else ("met" if frac >= TARGET_MOE else "MISSED")
                print(
                    f"  fused MoE {r['model']:<15} {largest} tokens: {_pct(frac):>7} of bf16 peak "
                    f"(target >= {TARGET_MOE:.0%}: {verdict})"
                )
    if row_rows:
        for op in dict.fromkeys(r["op"] for r in row_rows):
            fracs = [r.get("frac_hbm") for r in row_rows if r["op"] == op and r["impl"] == "afdc triton"]
            known = [f for f in fracs if f is not None]
            if not known:
                print(f"  {op:<14} n/a")
                continue
            worst = min(known)
            verdict = "met" if worst >= TARGET_ROW and len(known) == len(fracs) else "MISSED"
            print(
                f"  {op:<14} {_pct(worst):>7} of HBM bandwidth at worst over {len(fracs)} shapes "
                f"(target >= {TARGET_ROW:.0%}: {verdict})"
            )


# -- (3) quantized kernels ---------------------------------------------------------------------------

QUANT_LINEAR = (7168, 18432)  # DeepSeek-V3's hidden size -> its dense MLP's intermediate size
QUANT_BLOCK = (128, 128)  # DeepSeek-V3's and Qwen3-FP8's weight_block_size
QUANT_EXPERTS = 32


def _quant_case(tokens: int, cases: list[tuple[str, Callable]], expected, timer, strict: bool, tol: float) -> list:
    """Every implementation of one case, checked against ``expected`` within ``tol`` of its largest value."""
    runs = []
    for impl, fn in cases:
        try:
            out = fn()
            worst = (out.float() - expected.float()).abs().max().item()
            ok = worst <= tol * expected.float().abs().max().item()
            if strict and not ok:
                raise AssertionError(f"{impl}: max abs difference {worst:.3g} from the dequantized reference")
            runs.append(Run(impl, timer(fn) if timer else None, "ok" if ok else f"DIFF {worst:.2g}"))
        except Exception as err:
            if strict:
                raise
            runs.append(Run(impl, check="error", note=f"{type(err).__name__}: {str(err).strip()[:100]}"))
    return runs


def quant_moe_cases(shape: MoeShape, tokens: int, device: str, gen, w8a8: bool):
    """``(name, [(impl, fn)], expected)`` for one model's experts in its shipping format."""
    from afdc.codegen.fused_moe import fused_moe_triton
    from afdc.codegen.fused_moe_quant import fused_moe_fp8_triton, fused_moe_mxfp4_triton
    from afdc.quant.formats import Fp8Block, Mxfp4

    (w_gate_up, w_down), options = expert_weights(shape, device, gen)
    x = torch.randn(tokens, shape.hidden, generator=gen, device=device, dtype=torch.bfloat16)
    weights = torch.rand(tokens, shape.top_k, generator=gen, device=device)
    ids = torch.rand(tokens, shape.experts, generator=gen, device=device).topk(shape.top_k, dim=-1).indices
    if shape.gpt_oss:  # output-major for the quantizer: gpt-oss ships [E, 2I, H/32, 16] blocks
        fmt, extra = Mxfp4(), {k: v for k, v in options.items() if k != "transposed"}
        (gb, gs), (db, ds) = fmt.quantize(w_gate_up.transpose(1, 2)), fmt.quantize(w_down.transpose(1, 2))
        del w_gate_up, w_down

        def widened():
            return fmt.dequantize(gb, gs, torch.bfloat16), fmt.dequantize(db, ds, torch.bfloat16)

        impls = [("mxfp4", lambda: fused_moe_mxfp4_triton(x, gb, db, weights, ids, 0, shape.activation, gs, ds,
                                                           **extra))]
    else:
        fmt, extra = Fp8Block(*QUANT_BLOCK), options
        inter = shape.inter
        (gq, gsc), (uq, usc) = fmt.quantize(w_gate_up[:, :inter]), fmt.quantize(w_gate_up[:, inter:])
        gb, gs, (db, ds) = torch.cat([gq, uq], 1), torch.cat([gsc, usc], 1), fmt.quantize(w_down)
        del w_gate_up, w_down, gq, uq

        def widened():
            return (torch.cat([fmt.dequantize(gb[:, :inter], gs[:, : gs.shape[1] // 2], torch.bfloat16),
                               fmt.dequantize(gb[:, inter:], gs[:, gs.shape[1] // 2 :], torch.bfloat16)], 1),
                    fmt.dequantize(db, ds, torch.bfloat16))

        def fp8(a8: bool):
            return lambda: fused_moe_fp8_triton(x, gb, db, weights, ids, 0, shape.activation, gs, ds, *QUANT_BLOCK,
                                                a8, **extra)

        impls = [("fp8 weight-only", fp8(False))] + ([("fp8 w8a8", fp8(True))] if w8a8 else [])
    dense = widened()
    expected = fused_moe_triton(x, *dense, weights, ids, 0, shape.activation, **extra)
    impls += [("dequantize+bf16", lambda: fused_moe_triton(x, *widened(), weights, ids, 0, shape.activation, **extra)),
              ("bf16 fused_moe", lambda: fused_moe_triton(x, *dense, weights, ids, 0, shape.activation, **extra))]
    return impls, expected


def quant_linear_cases(tokens: int, k: int, n: int, device: str, gen, w8a8: bool):
    import torch.nn.functional as F

    from afdc.codegen.fp8_linear import fp8_linear_triton
    from afdc.quant.formats import Fp8Block

    fmt = Fp8Block(*QUANT_BLOCK)
    weight, scale = fmt.quantize(torch.randn(n, k, generator=gen, device=device).mul_(k**-0.5))
    x = torch.randn(tokens, k, generator=gen, device=device, dtype=torch.bfloat16)
    dense = fmt.dequantize(weight, scale, torch.bfloat16)
    impls = [("fp8 weight-only", lambda: fp8_linear_triton(x, weight, scale, *QUANT_BLOCK))]
    if w8a8:
        impls.append(("fp8 w8a8", lambda: fp8_linear_triton(x, weight, scale, *QUANT_BLOCK, None, True)))
    impls += [("dequantize+bf16", lambda: F.linear(x, fmt.dequantize(weight, scale, torch.bfloat16))),
              ("bf16 linear", lambda: F.linear(x, dense))]
    return impls, F.linear(x, dense)


def bench_quant(shapes, tokens_list, linear: tuple[int, int], timer, device, strict: bool) -> list[dict]:
    """Section (3): one row per (case, tokens, implementation)."""
    w8a8 = device == "cuda" and torch.cuda.get_device_capability() >= (8, 9)
    gen = torch.Generator(device=device).manual_seed(0)
    rows = []
    few = [s.scaled(s.hidden, s.inter, min(s.experts, QUANT_EXPERTS), s.top_k) for s in shapes]
    cases = [(f"{s.model} ({s.experts} experts)", functools.partial(quant_moe_cases, s)) for s in few]
    cases.append((f"linear {linear[0]}->{linear[1]}", lambda t, d, g, a: quant_linear_cases(t, *linear, d, g, a)))
    for name, make in cases:
        for tokens in tokens_list:
            impls, expected = make(tokens, device, gen, w8a8)
            # w8a8 rounds the activations to fp8 too: 3 mantissa bits
            for run in _quant_case(tokens, impls, expected, timer, strict, tol=0.1):
                rows.append({"case": name, "tokens": tokens, **run.__dict__})
            del impls, expected
            if device == "cuda":
                torch.cuda.empty_cache()
    return rows


def print_quant(rows: list[dict]) -> None:
    print(f"{'case':<26} {'tokens':>6} {'impl':<16} {'ms':>9} {'check':<10} {'/ bf16':>7} {'dequant+bf16 /':>15}")
    for row in rows:
        same = {r["impl"]: r["ms"] for r in rows if (r["case"], r["tokens"]) == (row["case"], row["tokens"])}
        bf16 = next((ms for impl, ms in same.items() if impl.startswith("bf16")), None)
        widened = same.get("dequantize+bf16")
        quantized = row["impl"].startswith(("fp8", "mxfp4"))
        vs_bf16 = row["ms"] / bf16 if quantized and row["ms"] and bf16 else None
        vs_widened = widened / row["ms"] if quantized and row["ms"] and widened else None
        print(f"{row['case']:<26} {row['tokens']:>6} {row['impl']:<16} {_num(row['ms'], '.3f'):>9} "
              f"{row['check']:<10} {_num(vs_bf16, '.2f'):>7} {_num(vs_widened, '.2f'):>15} {row['note']}")


def smoke(args, device: str, shapes: list[MoeShape]) -> int:
    """Every path once at tiny shapes, each output checked against the reference; no timings."""
    start = time.perf_counter()
    mode = "CUDA" if device == "cuda" else "CPU, Triton interpreter (TRITON_INTERPRET=1)"
    print(f"smoke run on {mode}: tiny shapes, no timings")
    moe_rows = []
    for shape in shapes:
        small = shape.scaled(**SMOKE_MOE)
        rows = bench_moe_model(small, SMOKE_TOKENS, None, device, strict=True, skip_compile=args.skip_compile)
        moe_rows += rows
        for tokens in SMOKE_TOKENS:
            done = [f"{r['impl']} {r['check']}" for r in rows if r["tokens"] == tokens]
            na = [f"{r['impl']}: {r['note']}" for r in rows if r["tokens"] == tokens and r["check"] == "n/a"]
            print(
                f"  moe {shape.model} (H {small.hidden}, I {small.inter}, E {small.experts}, top-{small.top_k}, "
                f"{small.activation}) {tokens} tokens: {', '.join(done)}" + (f"  [{'; '.join(na)}]" if na else "")
            )
    row_rows = []
    if not args.skip_norm:
        row_rows = bench_rows(SMOKE_ROWS, None, device, strict=True, skip_compile=args.skip_compile)
        for case in dict.fromkeys((r["op"], r["tokens"], r["hidden"]) for r in row_rows):
            done = [f"{r['impl']} {r['check']}" for r in row_rows if (r["op"], r["tokens"], r["hidden"]) == case]
            print(f"  {case[0]} {case[1]}x{case[2]}: {', '.join(done)}")
    quant_rows = []
    if not args.skip_quant:
        small = [s.scaled(**SMOKE_QUANT) for s in shapes]
        quant_rows = bench_quant(small, SMOKE_TOKENS, SMOKE_LINEAR, None, device, strict=True)
        for case in dict.fromkeys(r["case"] for r in quant_rows):
            done = [f"{r['impl']} {r['check']}" for r in quant_rows if r["case"] == case]
            print(f"  quantized {case}: {', '.join(done)}")
    # the report paths too, silently: tables, targets and JSON of untimed rows, and the peak lookup
    with contextlib.redirect_stdout(io.StringIO()):
        print_quant(quant_rows)
        print_moe(moe_rows, None, None)
        print_rows(row_rows, None)
        summary(moe_rows, row_rows)
    untimed = json.dumps({"moe": moe_rows, "rows": row_rows})
    if args.json:
        args.json.write_text(untimed)
    profile = device_profile("NVIDIA H100 80GB HBM3")
    assert profile is not None and profile.name == "H100", profile
    print(f"smoke ok ({time.perf_counter() - start:.0f} s)")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", type=Path, default=DEFAULT_CONFIGS, help="directory of the model configs")
    p.add_argument("--models", nargs="+", default=list(MODELS), help="config names (file stems) in --configs")
    p.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS))
    p.add_argument(
        "--shapes",
        nargs="+",
        default=[f"{t}x{h}" for t, h in ROW_SHAPES],
        help="[tokens]x[hidden] shapes of the row kernels",
    )
    p.add_argument("--warmup", type=int, default=3, help="untimed calls before timing (the first compiles)")
    p.add_argument("--repeats", type=int, default=20, help="timed calls per measurement (median)")
    p.add_argument("--flush-mb", type=int, default=256, help="L2 flush size before each timed call (0: none)")
    p.add_argument("--peak-tflops", type=float, help="dense bf16 TFLOP/s (default: afdc's hardware table)")
    p.add_argument("--hbm-gbps", type=float, help="HBM bandwidth in GB/s (default: afdc's hardware table)")
    p.add_argument("--skip-moe", action="store_true")
    p.add_argument("--skip-norm", action="store_true")
    p.add_argument("--skip-compile", action="store_true", help="leave out torch.compile")
    p.add_argument("--skip-quant", action="store_true", help="leave out the quantized kernels (section 3)")
    p.add_argument("--json", type=Path, help="also write the results here")
    p.add_argument(
        "--smoke",
        action="store_true",
        help="each path once at tiny shapes, checked against the references, no timings "
        "(without a GPU: in Triton's interpreter)",
    )
    args = p.parse_args(argv)
    try:
        row_shapes = [tuple(int(v) for v in s.lower().split("x")) for s in args.shapes]
        assert all(len(s) == 2 for s in row_shapes)
    except (ValueError, AssertionError):
        p.error(f"--shapes: expected TOKENSxHIDDEN, got {args.shapes}")

    global torch
    import torch

    cuda = torch.cuda.is_available()
    if not cuda:
        if not args.smoke:
            print(
                "bench_kernels.py measures GPU kernels and needs a CUDA GPU; none is visible here.\n"
                "Use --smoke to check every benchmark path at tiny shapes in Triton's interpreter.",
                file=sys.stderr,
            )
            return 2
        # Triton reads TRITON_INTERPRET when it is imported: set it before anything imports triton
        if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
            print(
                "triton was imported before TRITON_INTERPRET=1 could be set; run with TRITON_INTERPRET=1",
                file=sys.stderr,
            )
            return 2
        os.environ["TRITON_INTERPRET"] = "1"
    device = "cuda" if cuda else "cpu"

    import transformers

    from afdc.codegen import triton_support

    if not triton_support.available():
        print("triton is not installed: afdc's kernels cannot run (pip install afdc[kernels])", file=sys.stderr)
        return 2
    triton = triton_support.triton
    shapes = [read_moe_shape(args.configs / f"{m}.json") for m in args.models] if not args.skip_moe else []

    name = torch.cuda.get_device_name() if cuda else "CPU (no CUDA)"
    print(f"afdc bench_kernels  {time.strftime('%Y-%m-%d %H:%M')}  device: {name}")
    cuda_v = f"  CUDA {torch.version.cuda}" if cuda else ""
    print(
        f"torch {torch.__version__}  triton {triton.__version__}  transformers {transformers.__version__}{cuda_v}  "
        f"python {sys.version.split()[0]}"
    )
    if args.smoke:
        return smoke(args, device, shapes)

    profile = device_profile(name)
    peak = args.peak_tflops * 1e12 if args.peak_tflops else (profile.flops("bf16") if profile else None)
    hbm = args.hbm_gbps * 1e9 if args.hbm_gbps else (profile.hbm_bandwidth if profile else None)
    source = f"afdc hardware table: {profile.name} ({profile.description})" if profile else "no afdc profile matches"
    print(
        f"peaks: bf16 dense {_num(peak and peak / 1e12, '.1f')} TFLOP/s"
        f"{' (--peak-tflops)' if args.peak_tflops else ''}, HBM {_num(hbm and hbm / 1e9, '.0f')} GB/s"
        f"{' (--hbm-gbps)' if args.hbm_gbps else ''}; {source}"
    )
    if profile and any(form in name.lower() for form in ("pcie", "nvl")):
        print("  note: the table's figures are for the SXM part; pass --peak-tflops / --hbm-gbps for this card")
    if peak is None or hbm is None:
        print("  fractions of peak are printed as '-': pass --peak-tflops and --hbm-gbps")
    tuning = autotune_state(device)
    print(f"afdc fused MoE tile sizes: autotune {tuning}")
    timer = CudaTimer(args.warmup, args.repeats, args.flush_mb)
    print(
        f"timing: CUDA events, {args.warmup} warm-up calls, median of {args.repeats}, "
        f"{args.flush_mb} MB L2 flush before each call; bf16; outputs checked against the eager reference "
        f"(atol {TOL['atol']}, rtol {TOL['rtol']})"
    )

    results: dict = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "device": name,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "transformers": transformers.__version__,
        "cuda": torch.version.cuda,
        "peak_bf16_flops": peak,
        "hbm_bytes_per_s": hbm,
        "profile": profile.name if profile else None,
        "fused_moe_autotune": tuning,
        "settings": {"warmup": args.warmup, "repeats": args.repeats, "flush_mb": args.flush_mb},
        "moe": [],
        "rows": [],
        "quant": [],
    }

    def save() -> None:  # after each part, so that a run cut short keeps what it measured
        if args.json:
            args.json.write_text(json.dumps(results, indent=2))

    if shapes:
        print(
            f"\n== (1) fused MoE, bf16, all experts on one GPU, uniform random top-k routing; "
            f"% peak: of bf16 dense; % HBM: expert weights hit + input + output per second "
            f"(target afdc >= {TARGET_MOE:.0%} of peak at {max(args.tokens)} tokens)"
        )
        for shape in shapes:
            print(
                f"-- {shape.model}: hidden {shape.hidden}, expert intermediate {shape.inter}, "
                f"{shape.experts} experts, top-{shape.top_k}, {shape.activation}",
                flush=True,
            )
            rows = bench_moe_model(shape, args.tokens, timer, device, strict=False, skip_compile=args.skip_compile)
            print_moe(rows, peak, hbm)
            results["moe"] += rows
            save()
            sys.stdout.flush()
    if not args.skip_norm:
        print(
            f"\n== (2) row kernels, bf16; GB/s: the bytes each op must read + write "
            f"(target afdc >= {TARGET_ROW:.0%} of HBM bandwidth)",
            flush=True,
        )
        rows = bench_rows(row_shapes, timer, device, strict=False, skip_compile=args.skip_compile)
        print_rows(rows, hbm)
        results["rows"] = rows
        save()
    if not args.skip_quant:
        print("\n== (3) quantized kernels against dequantize-then-bf16 and bf16 (ratios of medians in this run)",
              flush=True)
        results["quant"] = bench_quant(shapes, args.tokens, QUANT_LINEAR, timer, device, strict=False)
        print_quant(results["quant"])
        save()
    summary(results["moe"], results["rows"])
    if args.json:
        print(f"wrote {args.json}")
    # a failed check fails the run (gpu_session.sh says so); another library's error is only noted
    afdc_impls = ("afdc triton", "+shared fused", "+shared apart")
    wrong = [r for r in results["moe"] + results["rows"]
             if r["check"].startswith("DIFF") or (r["check"] == "error" and r["impl"] in afdc_impls)]
    for r in wrong:
        print(f"FAILED: {r['impl']} at {r['tokens']} tokens of {r.get('model') or r.get('op')}: {r['check']}")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
