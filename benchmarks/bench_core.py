"""Core afdc benchmarks, measured in one run.

(a) CPU, fp32: the in-process disaggregated model (attention program + FFN program joined by the
    loopback connector) against the monolithic Hugging Face model, for a ~100M-parameter dense
    Llama-shaped model and a ~100M-parameter Qwen3-MoE-shaped model: prefill forward time and
    greedy decode time per token. Target: disaggregated / monolithic <= 1.10.
(b) ``afdc.disaggregate`` of the full DeepSeek-V3 config (61 layers, 671B parameters) built on the
    meta device: wall time and peak RSS, measured in a fresh subprocess so the peak belongs to that
    phase alone. Targets: < 60 s, < 4 GB. Also prints the split report summary.

Run:  python benchmarks/bench_core.py            (everything; about 10 minutes on 2 cores)
      python benchmarks/bench_core.py --skip-meta / --skip-cpu / --help

Timing method: monolith and disaggregated runs are interleaved (alternating order each repeat)
after warm-up, so a machine whose load drifts affects both sides alike; the ratio is of medians,
and the median of per-pair ratios is printed too. Per-token decode time is
``(generate(N + 1 tokens) - generate(1 token)) / N``, i.e. prefill excluded.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

TARGET_RATIO = 1.10
TARGET_META_SECONDS = 60.0
TARGET_META_GB = 4.0
DEFAULT_META_CONFIG = Path("/work/shared/configs/deepseek-v3.json")


# -- models ----------------------------------------------------------------------------------------


def dense_config():
    """Llama-shaped, ~110M parameters (embeddings tied)."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=32000,
        hidden_size=768,
        intermediate_size=2048,
        num_hidden_layers=12,
        num_attention_heads=12,
        num_key_value_heads=12,
        tie_word_embeddings=True,
    )


def moe_config():
    """Qwen3-MoE-shaped, ~98M parameters total (8 experts, top-2, GQA 8/4, embeddings tied)."""
    from transformers import AutoConfig

    return AutoConfig.for_model(
        "qwen3_moe",
        vocab_size=32000,
        hidden_size=512,
        intermediate_size=1536,
        moe_intermediate_size=768,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
        num_experts=8,
        num_experts_per_tok=2,
        tie_word_embeddings=True,
    )


def load_config_json(path: Path):
    import transformers

    d = json.loads(path.read_text())
    return transformers.CONFIG_MAPPING[d["model_type"]](**{k: v for k, v in d.items() if k != "model_type"})


# -- timing ----------------------------------------------------------------------------------------


@dataclass
class Pair:
    """Interleaved timings of the monolith (a) and the disaggregated model (b), seconds."""

    wall_a: list[float]
    wall_b: list[float]
    cpu_a: list[float]
    cpu_b: list[float]

    def median(self, kind: str) -> tuple[float, float]:
        a, b = (self.wall_a, self.wall_b) if kind == "wall" else (self.cpu_a, self.cpu_b)
        return statistics.median(a), statistics.median(b)

    def ratio(self, kind: str) -> float:
        a, b = self.median(kind)
        return b / a

    def pairwise(self) -> float:
        return statistics.median(b / a for a, b in zip(self.wall_a, self.wall_b))

    def min_ratio(self) -> float:
        return min(self.wall_b) / min(self.wall_a)

    def minus(self, other: Pair, n: int) -> Pair:
        """Per-item time of ``(self - other) / n`` from medians (for per-token decode time)."""
        d = [(statistics.median(x) - statistics.median(y)) / n for x, y in zip(self._lists(), other._lists())]
        return Pair([d[0]], [d[1]], [d[2]], [d[3]])

    def _lists(self):
        return self.wall_a, self.wall_b, self.cpu_a, self.cpu_b


def interleaved(fa: Callable, fb: Callable, warmup: int, repeats: int, setup_a=None, setup_b=None) -> Pair:
    """Time ``fa`` and ``fb`` alternately (order flipped each repeat) after ``warmup`` calls each.

    ``setup_x`` (untimed) runs before each call and its result is passed to ``fx``. Records wall
    time and process CPU time: on a loaded machine with one torch thread the CPU time is the work
    itself, without the time the process waited for a core.
    """

    def call(f, setup, wall, cpu):
        arg = () if setup is None else (setup(),)
        c0, t0 = time.process_time(), time.perf_counter()
        f(*arg)
        t1, c1 = time.perf_counter(), time.process_time()
        wall.append(t1 - t0)
        cpu.append(c1 - c0)

    scratch: list[float] = []
    for _ in range(warmup):
        call(fa, setup_a, scratch, scratch)
        call(fb, setup_b, scratch, scratch)
    res = Pair([], [], [], [])
    for i in range(repeats):
        a = (fa, setup_a, res.wall_a, res.cpu_a)
        b = (fb, setup_b, res.wall_b, res.cpu_b)
        for f, setup, wall, cpu in (a, b) if i % 2 == 0 else (b, a):
            call(f, setup, wall, cpu)
    return res


def verdict(ratio: float) -> str:
    return f"(target <= {TARGET_RATIO:.2f}: {'ok' if ratio <= TARGET_RATIO else 'MISSED'})"


def record(rows: list[dict], model: str, label: str, p: Pair, unit: str = "ms", detail: bool = True) -> None:
    wa, wb = p.median("wall")
    ca, cb = p.median("cpu")
    rows.append(
        dict(
            model=model,
            what=label,
            mono_wall_s=wa,
            dm_wall_s=wb,
            ratio_wall=wb / wa,
            mono_cpu_s=ca,
            dm_cpu_s=cb,
            ratio_cpu=cb / ca,
            pairwise_wall=p.pairwise() if detail else None,
            min_ratio_wall=p.min_ratio() if detail else None,
        )
    )
    extra = f"  [wall pairwise {p.pairwise():.3f}, min/min {p.min_ratio():.3f}]" if detail else ""
    print(
        f"  {label:<26} wall: mono {wa * 1e3:7.1f} dm {wb * 1e3:7.1f} {unit} ratio {wb / wa:.3f} {verdict(wb / wa)}"
        f" | cpu: mono {ca * 1e3:7.1f} dm {cb * 1e3:7.1f} ratio {cb / ca:.3f} {verdict(cb / ca)}{extra}"
    )


def bench_cpu_model(name: str, config, args) -> list[dict]:
    from transformers import AutoModelForCausalLM

    import afdc

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # decode exactly N tokens on both sides
    model.generation_config.pad_token_id = 0
    n_params = sum(p.numel() for p in model.parameters())
    t0 = time.perf_counter()
    dm = afdc.disaggregate(model)
    t_split = time.perf_counter() - t0
    report = dm.report()
    kinds = sorted({layer.kind for layer in report.layers})
    print(
        f"\n[{name}] {type(model).__name__}: {n_params / 1e6:.1f}M parameters, fp32, "
        f"attn_implementation={model.config._attn_implementation}, {len(report.layers)} FFN layers "
        f"({'/'.join(kinds)}), disaggregate {t_split:.1f} s"
    )

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, config.vocab_size, (args.batch, args.seq), generator=g)
    mask = torch.ones_like(ids)
    rows: list[dict] = []
    with torch.inference_mode():
        ref = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        out = dm(ids, attention_mask=mask).logits
        print(f"  prefill logits max |mono - dm| = {(ref - out).abs().max().item():.2e}")

        def mono_prefill():
            return model(input_ids=ids, attention_mask=mask, use_cache=False)

        def dm_prefill():
            return dm(ids, attention_mask=mask)

        p = interleaved(mono_prefill, dm_prefill, args.warmup, args.repeats)
        record(rows, name, f"prefill {args.batch}x{args.seq}", p)

        # decode: greedy, KV cache on both sides (HF DynamicCache vs afdc's attention-side cache)
        dids = ids[:, : args.decode_prompt]
        dmask = torch.ones_like(dids)
        n = args.decode_tokens
        g_mono = model.generate(dids, attention_mask=dmask, max_new_tokens=n, do_sample=False)
        g_dm = dm.generate(dids, attention_mask=dmask, max_new_tokens=n)
        print(f"  greedy {n} tokens identical mono vs dm: {torch.equal(g_mono, g_dm)}")

        # one decode step against a cache of decode_prompt positions, the cache copied untimed before
        # each call: HF DynamicCache through model(..., past_key_values=) vs afdc's attention-side cache
        step = decode_step(model, dm, dids, dmask, args)
        if step:
            record(rows, name, f"decode step {args.batch}x1 @ctx{args.decode_prompt}", step)

        def mono_gen(k):
            return lambda: model.generate(dids, attention_mask=dmask, max_new_tokens=k, do_sample=False)

        def dm_gen(k):
            return lambda: dm.generate(dids, attention_mask=dmask, max_new_tokens=k)

        g1 = interleaved(mono_gen(1), dm_gen(1), args.warmup, args.repeats)
        gn = interleaved(mono_gen(n + 1), dm_gen(n + 1), args.warmup, args.repeats)
        record(rows, name, "generate 1 tok (prefill)", g1)
        record(rows, name, "generate: per new token", gn.minus(g1, n), "ms/tok", detail=False)
        record(rows, name, f"generate {n + 1} tok (total)", gn)
    return rows


def decode_step(model, dm, ids, mask, args) -> Pair | None:
    """Time one greedy decode step with a KV cache on both sides; None if the runtime lacks the hooks.

    The monolith runs ``model(next, past_key_values=DynamicCache)`` as ``generate`` does; the
    disaggregated side runs its attention program with an ``afdc.runtime.kv_cache.KVCache`` active
    (``DisaggregatedModel._run``, what ``dm.generate`` runs per step).
    """
    import copy

    try:
        from afdc.runtime import kv_cache
        from afdc.runtime.model import positions_from_mask

        run_step = dm._run
    except (ImportError, AttributeError) as err:
        print(f"  decode step: skipped ({err})")
        return None

    def run(ids, mask, pos, cache):  # one attention rank of one micro-batch: its cache is caches[0, 0]
        return run_step(ids, mask, pos, {(0, 0): cache})

    # Steady state: prefill all but the last prompt token, then decode that one on both sides, then
    # time the step after it. (The step right after prefill also pays for how prefill left the cache.)
    b, _ = ids.shape
    pre_ids, pre_mask, last = ids[:, :-1], mask[:, :-1], ids[:, -1:]
    last_pos = positions_from_mask(mask)[:, -1:]
    nxt = torch.zeros(b, 1, dtype=ids.dtype)
    step_mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
    pos = positions_from_mask(step_mask)[:, -1:]

    hf_cache = model(input_ids=pre_ids, attention_mask=pre_mask, use_cache=True).past_key_values
    hf_cache = model(
        input_ids=last, attention_mask=mask, position_ids=last_pos, past_key_values=hf_cache, use_cache=True
    ).past_key_values
    afdc_cache = kv_cache.KVCache()
    run(pre_ids, pre_mask, positions_from_mask(pre_mask), afdc_cache)
    run(last, mask, last_pos, afdc_cache)
    ref = model(input_ids=nxt, attention_mask=step_mask, position_ids=pos, past_key_values=copy.deepcopy(hf_cache))
    out = run(nxt, step_mask, pos, copy.deepcopy(afdc_cache))
    print(f"  decode step logits max |mono - dm| = {(ref.logits - out.logits).abs().max().item():.2e}")

    def mono(cache):
        return model(input_ids=nxt, attention_mask=step_mask, position_ids=pos, past_key_values=cache, use_cache=True)

    def disagg(cache):
        return run(nxt, step_mask, pos, cache)

    return interleaved(
        mono,
        disagg,
        args.warmup,
        args.repeats * 3,
        setup_a=lambda: copy.deepcopy(hf_cache),
        setup_b=lambda: copy.deepcopy(afdc_cache),
    )


# -- meta-device capture + partition (run in a child process) ------------------------------------


def _rss_gb() -> float:
    """Peak resident set of this process so far, GB (1e9 bytes).

    VmHWM, not ru_maxrss: Linux carries ru_maxrss across fork+exec, so a child's ru_maxrss starts
    at the parent's resident size (here the parent holds the CPU benchmark models).
    """
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024 / 1e9  # kB -> GB
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9  # KiB on Linux


def meta_child(config_path: Path, layers: int | None) -> dict:
    """Build the config on the meta device and disaggregate it; returns timings and memory."""
    from transformers import AutoModelForCausalLM

    import afdc
    import afdc.api as api
    import afdc.capture

    import_rss = _rss_gb()
    config = load_config_json(config_path)
    if layers:
        config.num_hidden_layers = layers
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or torch.bfloat16
    t0 = time.perf_counter()
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    t_build = time.perf_counter() - t0
    n_params = sum(p.numel() for p in model.parameters())
    build_rss = _rss_gb()

    # per-phase wall time: wrap the pipeline's steps where afdc.api looks them up (if present)
    phases: dict[str, float] = {}

    def timed(label, fn):
        def wrapper(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                phases[label] = phases.get(label, 0.0) + time.perf_counter() - t

        return wrapper

    afdc.capture.capture = timed("capture", afdc.capture.capture)
    ep_cls = torch.export.ExportedProgram
    ep_cls.run_decompositions = timed("run_decompositions", ep_cls.run_decompositions)
    for attr, label in [
        ("strip_assertions", "cleanup"),
        ("classify", "classify"),
        ("select_cuts", "min-cut"),
        ("layer_report", "report"),
        ("partition", "partition"),
        ("FFNProgram", "FFNProgram"),
    ]:
        if hasattr(api, attr):
            setattr(api, attr, timed(label, getattr(api, attr)))
    api.Built.attention_program = timed("AttentionProgram", api.Built.attention_program)

    t0 = time.perf_counter()
    dm = afdc.disaggregate(model)
    t_split = time.perf_counter() - t0
    peak = _rss_gb()

    report = dm.report()
    weights = [*dm.attention.module.parameters(), *dm.attention.module.buffers()]
    weights += dm.ffn.parameters_of(dm.ffn.parameter_names())
    on_meta = all(w.device.type == "meta" for w in weights)
    moe = [layer for layer in report.layers if layer.kind == "moe"]
    return dict(
        config=str(config_path),
        layers=config.num_hidden_layers,
        parameters=n_params,
        dtype=str(dtype),
        build_s=t_build,
        disaggregate_s=t_split,
        phases=phases,
        rss_after_imports_gb=import_rss,
        rss_after_build_gb=build_rss,
        peak_rss_gb=peak,
        weights_on_meta=on_meta,
        report=dict(
            ffn_layers=len(report.layers),
            moe_layers=len(moe),
            dense_layers=len(report.layers) - len(moe),
            experts=sorted({(m.experts, m.top_k) for m in moe}),
            attention_calls=report.attention_calls,
            attention_parameters=report.attention_parameters,
            ffn_parameters=report.ffn_parameters,
            segment_graphs=report.segment_graphs,
            incremental_decode=report.incremental_decode,
            bytes_per_token_to_ffn=report.bytes_to_ffn,
            bytes_per_token_to_attn=report.bytes_to_attn,
            per_layer_first=str(report).splitlines()[:9],
        ),
    )


def run_meta(config_path: Path, layers: int | None) -> dict | None:
    cmd = [sys.executable, __file__, "--_meta-child", str(config_path)]
    if layers:
        cmd += ["--_meta-layers", str(layers)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    last = proc.stdout.strip().splitlines()[-1:] if proc.stdout.strip() else []
    if proc.returncode != 0 or not last or not last[0].startswith("{"):
        print(f"  FAILED (exit {proc.returncode}) after {wall:.1f} s; stderr tail:")
        print("\n".join("    " + line for line in proc.stderr.strip().splitlines()[-25:]))
        return None
    res = json.loads(last[0])
    res["process_wall_s"] = wall
    return res


def print_meta(res: dict, full: bool) -> None:
    r = res["report"]
    t_ok = res["disaggregate_s"] < TARGET_META_SECONDS
    m_ok = res["peak_rss_gb"] < TARGET_META_GB
    print(
        f"  {res['layers']} layers, {res['parameters'] / 1e9:.1f}B parameters ({res['dtype']}), "
        f"built on meta in {res['build_s']:.2f} s"
    )
    print(
        f"  afdc.disaggregate: {res['disaggregate_s']:.1f} s"
        + (f" (target < {TARGET_META_SECONDS:.0f} s: {'ok' if t_ok else 'MISSED'})" if full else "")
    )
    phases = dict(res["phases"])
    capture = phases.pop("capture", None)
    decomp = phases.pop("run_decompositions", None)
    head = [f"capture {capture:.1f} s" + (f" (of which run_decompositions {decomp:.1f} s)" if decomp else "")]
    print("    " + ", ".join(head + [f"{k} {v:.1f} s" for k, v in phases.items()]))
    print(
        f"  peak RSS {res['peak_rss_gb']:.2f} GB"
        + (f" (target < {TARGET_META_GB:.0f} GB: {'ok' if m_ok else 'MISSED'})" if full else "")
        + f"  [after imports {res['rss_after_imports_gb']:.2f} GB, after meta build {res['rss_after_build_gb']:.2f} GB;"
        f" subprocess wall incl. imports {res['process_wall_s']:.1f} s]"
    )
    print(f"  weights left on meta (none materialized): {res['weights_on_meta']}")
    if full:
        experts = ", ".join(f"{e} experts top-{k}" for e, k in r["experts"]) or "-"
        print(
            f"  report: {r['ffn_layers']} FFN layers = {r['moe_layers']} MoE ({experts}) + {r['dense_layers']} dense; "
            f"{r['segment_graphs']} distinct segment graphs; {r['attention_calls']} attention calls; "
            f"incremental decode {r['incremental_decode']}"
        )
        print(
            f"          parameters: attention side {r['attention_parameters'] / 1e9:.2f}B, "
            f"FFN side {r['ffn_parameters'] / 1e9:.2f}B"
        )
        print(
            f"          bytes per token crossing: {r['bytes_per_token_to_ffn']:,.0f} to FFN + "
            f"{r['bytes_per_token_to_attn']:,.0f} to attention "
            f"({r['bytes_per_token_to_ffn'] / max(r['ffn_layers'], 1):,.0f} B/layer each way)"
        )
        for line in r["per_layer_first"]:
            print("    | " + line)


# -- main ------------------------------------------------------------------------------------------


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch.set_num_threads for every CPU measurement (default 1: on a small shared box,\n"
        "2 OpenMP threads collapse when another process takes a core; use 2+ on an idle machine)",
    )
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=128, help="prefill tokens per sequence")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=7, help="timed runs per side (median)")
    p.add_argument("--decode-prompt", type=int, default=128, help="prompt length before decoding")
    p.add_argument("--decode-tokens", type=int, default=32, help="N in the per-token decode measurement")
    p.add_argument("--meta-config", type=Path, default=DEFAULT_META_CONFIG)
    p.add_argument("--meta-small-layers", type=int, default=4, help="also time a truncated config (0: skip)")
    p.add_argument("--skip-cpu", action="store_true")
    p.add_argument("--skip-meta", action="store_true")
    p.add_argument("--only", choices=["dense", "moe"], help="run only one CPU model")
    p.add_argument("--json", type=Path, help="also write all results here")
    p.add_argument("--_meta-child", dest="meta_child", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--_meta-layers", dest="meta_layers", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    torch.set_num_threads(args.threads)
    if args.meta_child:
        print(json.dumps(meta_child(args.meta_child, args.meta_layers)))
        return 0

    import transformers

    import afdc  # noqa: F401  (fail early if the package is broken)

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    print(
        f"afdc bench_core  {time.strftime('%Y-%m-%d %H:%M')}  torch {torch.__version__}  "
        f"transformers {transformers.__version__}  python {platform.python_version()}"
    )
    print(
        f"CPU: {cpu}, {os.cpu_count()} logical cores, torch threads {torch.get_num_threads()}, "
        f"load average {os.getloadavg()[0]:.2f}"
    )
    results: dict = {"cpu": [], "meta": {}}

    if not args.skip_cpu:
        print(
            f"\n== (a) CPU fp32: disaggregated (loopback) vs monolithic; warmup {args.warmup}, "
            f"median of {args.repeats} interleaved runs"
        )
        models = [("dense", dense_config), ("moe", moe_config)]
        for name, make in models:
            if args.only and args.only != name:
                continue
            results["cpu"] += bench_cpu_model(name, make(), args)
        print(f"  load average after CPU runs: {os.getloadavg()[0]:.2f}")

    if not args.skip_meta:
        print(f"\n== (b) capture + partition on the meta device: {args.meta_config}  (fresh subprocess each)")
        res = run_meta(args.meta_config, None)
        if res:
            print_meta(res, full=True)
            results["meta"]["full"] = res
        if args.meta_small_layers:
            print(f"  -- same config truncated to {args.meta_small_layers} layers, for scale:")
            res = run_meta(args.meta_config, args.meta_small_layers)
            if res:
                print_meta(res, full=False)
                results["meta"]["small"] = res

    if results["cpu"]:
        print(f"\n== summary: dm / mono (target <= {TARGET_RATIO:.2f})")
        print(f"  {'model':<6} {'measurement':<26} {'wall':>6} {'cpu':>6}")
        for r in results["cpu"]:
            print(f"  {r['model']:<6} {r['what']:<26} {r['ratio_wall']:6.3f} {r['ratio_cpu']:6.3f}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
