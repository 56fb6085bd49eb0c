"""The ``afdc`` command line."""

from __future__ import annotations

import dataclasses
import json
import sys

import click

import afdc
from afdc.errors import AfdcError
from afdc.plan import BACKENDS
from afdc.runtime.transport import ConnectorKind
from afdc.runtime.transport.base import Pacing, WaitPolicy
from afdc.runtime.transport.spin_budget import BudgetSettings


class _Commands(click.Group):
    """Every command's afdc errors as one line and exit code 2, not a traceback."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except AfdcError as err:
            click.echo(f"error: {err}", err=True)
            sys.exit(2)


_CONNECTORS = click.Choice([k.value for k in ConnectorKind])


@click.group(cls=_Commands)
@click.version_option(afdc.__version__, prog_name="afdc")
def main() -> None:
    """afdc: automatic Attention-FFN Disaggregation for Hugging Face decoder models."""


@main.command()
@click.argument("model", required=False)
@click.option("--demo", is_flag=True, help="Use the built-in tiny random MoE model (no downloads).")
@click.option("--plan", default="1A1F", show_default=True, help="Deployment plan xAyF.")
@click.option("--router", type=click.Choice(["ffn", "attn"]), default="ffn", show_default=True,
              help="Which side runs the MoE router.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def inspect(model: str | None, demo: bool, plan: str, router: str, as_json: bool) -> None:
    """Split MODEL (hub id, model directory or config.json) and print what crosses the cut.

    MODEL is built on the meta device: no weights are read. With --demo a tiny random MoE model
    is built and the disaggregated model is also checked against it.
    """
    if demo == (model is not None):
        raise click.UsageError("give either MODEL or --demo")
    if demo:
        _inspect_demo(plan, router, as_json)
    else:
        from afdc.api import build
        from afdc.quant.scheme import scheme_from_config
        from afdc.source import empty_model, load_config

        config = load_config(model)
        meta = empty_model(config)
        # a quantized checkpoint's weights in the report at their stored bytes
        scheme = scheme_from_config(config, meta)
        report = build(meta, afdc.Plan.parse(plan, router=router), scheme, rewrite=False).report
        report.model = model
        click.echo(report.to_json() if as_json else str(report))


@main.command(name="compile")
@click.argument("model")
@click.option("--plan", "plan_text", default="1A1F", show_default=True, help="Deployment plan xAyF.")
@click.option("-o", "--output", required=True, type=click.Path(), help="Artifact directory to write.")
@click.option("--ffn-parallel", type=click.Choice(["auto", "ep", "tp"]), default="auto", show_default=True,
              help="How the FFN ranks split each FFN layer: experts (ep), weight shards (tp); auto: ep for MoE.")
@click.option("--dense-ffn", type=click.Choice(["tp", "replicate"]), default="tp", show_default=True,
              help="Dense FFN layers: sharded over the FFN ranks (tp), or whole on each rank, which serves its "
                   "own share of the tokens (replicate).")
@click.option("--attn-tp", type=int, default=1, show_default=True, help="Tensor parallelism inside an attention rank.")
@click.option("--router", type=click.Choice(["ffn", "attn"]), default="ffn", show_default=True,
              help="Which side runs the MoE router.")
@click.option("--micro-batches", type=int, default=1, show_default=True,
              help="Micro-batches the attention side ping-pongs per step (recorded for the runtime).")
@click.option("--dtype", type=click.Choice(["bf16", "fp16", "fp32"]), default=None,
              help="Weights and activations dtype (default: the model's own).")
@click.option("--backend", type=click.Choice(BACKENDS), default="auto", show_default=True,
              help="What runs the programs: afdc's Triton kernels + Inductor, Inductor, or eager "
                   "(auto: afdc on a GPU, eager on a CPU). afdc serve --backend overrides it.")
@click.option("--no-weights", is_flag=True, help="Compile the plan only: programs and manifest, no weight files.")
@click.option("--revision", default=None, help="Hub revision of MODEL.")
@click.option("--force", is_flag=True, help="Replace OUTPUT if it exists.")
@click.option("--quiet", is_flag=True, help="No progress bar.")
def compile_cmd(model, plan_text, output, ffn_parallel, dense_ffn, attn_tp, router, micro_batches, dtype, backend,
                no_weights, revision, force, quiet) -> None:
    """Compile MODEL (hub id, model directory or config file) into a deployable artifact.

    The model is captured on the meta device; with weights, the checkpoint is streamed into one
    safetensors file per rank holding only that rank's weights.
    """
    from afdc.compile import compile_model, quant_note

    plan = afdc.Plan.parse(plan_text, ffn_parallel=ffn_parallel, dense_ffn=dense_ffn, attention_tp=attn_tp,
                           router=router, micro_batches=micro_batches, dtype=dtype, backend=backend)
    manifest = compile_model(model, plan, output, weights=not no_weights, revision=revision, force=force,
                             progress=not quiet)
    splits = sorted({lay.ffn_split for lay in manifest.layers})
    size = sum(f.bytes for f in manifest.files)
    click.echo(
        f"wrote {output}: plan {plan}, {len(manifest.layers)} FFN layers ({', '.join(splits)}), "
        f"{len(manifest.segments)} segment programs, {len(manifest.files)} files, {size / 1e6:,.1f} MB"
        + ("" if manifest.weights_included else " (no weights)")
        + (f"; attention TP {plan.attention_tp}: {len(manifest.attention_splits)} attention weights split by heads, "
           "the rest whole" if plan.attention_tp > 1 else "")
    )
    if manifest.quant:
        click.echo(quant_note(manifest))


_VLLM_ARGS = {"ignore_unknown_options": True}

_recovery_option = click.option(
    "--ffn-recovery-timeout", type=float, default=300.0, show_default=True,
    help="Attention: seconds a step is held while an FFN rank is lost, waiting for it to come back (requests "
         "see latency, /health says degraded); past them requests get a 503 naming the rank until it is back.",
)


def _serving_options(threads_default: str):
    """The options of how a serving process spends its cores, shared by ``serve`` and ``up``."""

    def add(command):
        for option in reversed([
            click.option("--spin", type=float, default=None,
                         help="Seconds a wait for a peer's message polls before it blocks on a futex (shm, "
                              "cuda-ipc), for every role; overrides --wait."),
            click.option("--wait", type=click.Choice([w.value for w in WaitPolicy]), default="adaptive",
                         show_default=True,
                         help="How a wait for a peer's message (shm, cuda-ipc) chooses between polling and "
                              "sleeping on a futex: adaptive polls, yielding the core, only while the peer's "
                              "answer is likely soon (learned per link and layer from its recent answers, at "
                              "most --spin-cap); cores is the earlier fixed policy (an attention rank polls 2 ms, "
                              "an FFN server only on a host of 8 cores or more)."),
            click.option("--spin-cap", type=click.FloatRange(min=0), default=BudgetSettings.cap, show_default=True,
                         help="--wait adaptive: the longest a learned poll lasts, in seconds; a peer that "
                              "typically answers later is waited for asleep from the start."),
            click.option("--yield-late", type=click.FloatRange(min=0), default=Pacing.yield_late, show_default=True,
                         help="--wait adaptive: a poll that comes back this many seconds late from yielding its "
                              "core ends the poll (another task wanted the core); 0: never."),
            click.option("--threads", type=int, default=None, help=f"Torch threads per process ({threads_default})."),
            click.option("--log-interval", type=float, default=30.0, show_default=True,
                         help="Seconds between each rank's metrics log lines: where its time went, its CPU "
                              "time (0: never)."),
        ]):
            command = option(command)
        return command

    return add



@main.command(context_settings=_VLLM_ARGS)
@click.argument("artifact", type=click.Path(file_okay=False))
@click.option("--role", type=click.Choice(["ffn", "attn"]), required=True, help="Which role this process runs.")
@click.option("--rank", type=int, default=0, show_default=True,
              help="FFN: rank within the role (attention ranks are vLLM's data-parallel ranks: see below).")
@click.option("--spare", is_flag=True,
              help="FFN: wait as a hot spare, holding no rank; take over the first FFN rank that is lost (claimed "
                   "through the store: one spare wins), loading its weights then.")
@click.option("--rendezvous", help="HOST:PORT of the deployment's store (hosted by attention rank 0); "
              "required unless --connector loopback.")
@click.option("--connector", type=_CONNECTORS, default="gloo",
              show_default=True,
              help="Transport between the roles (nccl: GPU to GPU, one GPU per rank, with --device cuda:N; shm: "
                   "same host only; cuda-ipc: same host, GPU to GPU through shared device memory, --device cuda; "
                   "loopback: attention only, the FFN layers run in the attention process, i.e. monolithic).")
@click.option("--token", default=None, help="Shared deployment secret (default: $AFDC_TOKEN).")
@click.option("--insecure-no-token", is_flag=True,
              help="Run without a token: any process that reaches the rendezvous store can join (refused otherwise).")
@click.option("--timeout", type=float, default=30.0, show_default=True, help="Seconds before a silent peer is lost.")
@click.option("--join-timeout", type=float, default=60.0, show_default=True,
              help="Seconds to reach the rendezvous store and for every rank to join.")
@_recovery_option
@click.option("--device", default="cpu", show_default=True, help="Device the program runs on.")
@click.option("--host", default="127.0.0.1", show_default=True, help="Attention: address the OpenAI server binds.")
@click.option("--port", type=int, default=8000, show_default=True, help="Attention: port of the OpenAI server.")
@click.option("--micro-batches", type=int, default=None,
              help="Attention: micro-batches per step (default: the plan's).")
@click.option("--kv-cache-mb", type=int, default=256, show_default=True,
              help="Attention on a CPU device: size of the paged KV cache.")
@click.option("--backend", type=click.Choice(BACKENDS), default=None,
              help="What runs the programs (default: the artifact's): afdc kernels + Inductor, Inductor, eager.")
@click.option("--token-buckets", type=int, default=0, show_default=True,
              help="FFN: pad each layer's batch to a power of two up to this many tokens, so the FFN runs at a few "
                   "shapes; on a GPU each is captured in a CUDA graph and replayed (0: off).")
@click.option("--attention-graphs", type=click.IntRange(min=0), default=0, show_default=True,
              help="Attention: pad decode steps to a power of two up to this many requests per micro-batch; on a "
                   "GPU each piece of the step between two exchanges with the FFN side is a CUDA graph per bucket "
                   "(0: off; not yet proven on a GPU).")
@click.option("--cpus", default=None, metavar="LIST",
              help="Cores this rank computes on, as taskset lists them (1, 0-3,6): an FFN rank's whole server, an "
                   "attention rank's step thread (each of this host's DP ranks'). Default: any.")
@click.option("--pin-tokens", type=click.IntRange(min=0), default=0, show_default=True,
              help="With --cpus: compute there only while steps hold this many tokens or more, and on this "
                   "process's other cores while they hold fewer (1A1F's pair on a small host, see `afdc up --pin`); "
                   "0: always there.")
@_serving_options("default: torch's, a thread per core")
@click.argument("vllm_args", nargs=-1, type=click.UNPROCESSED)
def serve(artifact, role, rank, spare, rendezvous, connector, token, insecure_no_token, timeout, join_timeout,
          ffn_recovery_timeout, device, host, port, micro_batches, kv_cache_mb, backend, token_buckets,
          attention_graphs, cpus, pin_tokens, spin, wait, spin_cap, yield_late, threads, log_interval,
          vllm_args) -> None:
    """Serve one rank of a compiled ARTIFACT until SIGTERM.

    An FFN rank loads only its FFN program and weights, joins the deployment at --rendezvous, and
    answers every attention rank, one batched FFN run per layer for all that arrived.

    The attention role is vLLM's OpenAI server (vLLM's scheduler, paged KV blocks, sampling) whose
    steps run the attention program; each attention rank is one vLLM data-parallel rank (the plan's
    A is passed as --data-parallel-size unless given), attention rank 0 hosts the rendezvous store.
    Arguments after `--` go to `vllm serve` (e.g. -- --max-num-seqs 64 --enable-prefix-caching;
    on a further host: -- --data-parallel-size-local N --data-parallel-start-rank R --headless
    --data-parallel-address HEAD --data-parallel-rpc-port PORT).
    """
    connector = ConnectorKind(connector)
    if cpus is not None:
        from afdc.serve.cores import check_usable, parse_cpus

        cpus = parse_cpus(cpus)
        check_usable(cpus)
    elif pin_tokens:
        raise click.UsageError("--pin-tokens says when a rank computes on --cpus: give --cpus too")
    if not connector.in_process and not rendezvous:
        raise click.UsageError(
            "--rendezvous HOST:PORT is required (or --connector loopback for a monolithic attention rank)"
        )
    from afdc.runtime.options import RuntimeOptions

    options = RuntimeOptions(connector=connector, rendezvous=rendezvous, token=token, timeout=timeout,
                             join_timeout=join_timeout, log_interval=log_interval, token_buckets=token_buckets,
                             insecure_no_token=insecure_no_token, spin=spin, wait=wait, spin_cap=spin_cap,
                             yield_late=yield_late)
    if role == "attn":
        from afdc.serve.settings import WorkerSettings
        from afdc.serve.up import serve_attention

        if spare:
            raise click.UsageError("--spare is for FFN ranks: a spare waits to take over a lost FFN rank")
        if rank:
            raise click.UsageError(
                "attention ranks are vLLM's data-parallel ranks, not --rank: -- --data-parallel-size A serves all "
                "A; on further hosts add --data-parallel-size-local N --data-parallel-start-rank R --headless"
            )
        settings = WorkerSettings(
            artifact, options, recovery_timeout=ffn_recovery_timeout, micro_batches=micro_batches,
            kv_cache_bytes=kv_cache_mb << 20, device=device, backend=backend, threads=threads, cpus=cpus,
            attention_graphs=attention_graphs,
            pin_tokens=pin_tokens,
        )
        serve_attention(settings, host, port, vllm_args)
    if connector.in_process:
        raise click.UsageError("an FFN rank serves attention ranks over gloo or shm, not loopback")
    if vllm_args:
        raise click.UsageError(f"unexpected arguments for an FFN rank: {' '.join(vllm_args)}")
    from afdc.runtime.rendezvous import deployment_token
    from afdc.serve.ffn import serve_ffn_rank, serve_ffn_spare

    deployment_token(token, insecure_no_token)  # refused before the artifact loads
    options = dataclasses.replace(options, threads=threads or None)  # the server takes them (afdc.runtime.server)
    if spare:
        serve_ffn_spare(artifact, options, device, backend)
    serve_ffn_rank(artifact, rank, options, device, backend, cpus, pin_tokens)


@main.command(context_settings=_VLLM_ARGS)
@click.argument("artifact", required=False, type=click.Path(file_okay=False))
@click.option("--demo", is_flag=True, help="Build the tiny demo MoE model, compile it 1A1F and serve it.")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address the OpenAI servers bind.")
@click.option("--port", type=int, default=8000, show_default=True,
              help="Port of the OpenAI API (vLLM balances requests over the attention ranks, its DP ranks).")
@click.option("--connector", type=_CONNECTORS, default=None,
              help="Transport between the roles [default: shm; gloo with --ray] (cuda-ipc: with --device cuda; "
                   "loopback: monolithic, no FFN processes).")
@click.option("--ray", "ray_address", is_flag=False, flag_value="auto", default=None, metavar="[ADDRESS]",
              help="Deploy onto an existing Ray cluster (ADDRESS: ray.init's; default $RAY_ADDRESS or this node's): "
                   "FFN ranks as Ray actors, attention ranks as vLLM's Ray DP engines. Run it on a node of the "
                   "cluster: local attention ranks go on this node.")
@click.option("--ray-attn-resource", default="afdc_attn", show_default=True,
              help="With --ray: the Ray resource each attention rank takes one unit of (GPU, CPU or a custom one).")
@click.option("--ray-ffn-resource", default="afdc_ffn", show_default=True,
              help="With --ray: the Ray resource each FFN rank takes one unit of.")
@click.option("--device", default="cpu", show_default=True, help="Device every role runs on.")
@click.option("--micro-batches", type=int, default=None, help="Micro-batches per step (default: the plan's).")
@click.option("--kv-cache-mb", type=int, default=256, show_default=True, help="KV cache per attention rank on CPU.")
@click.option("--timeout", type=float, default=30.0, show_default=True, help="Seconds before a silent peer is lost.")
@click.option("--startup-timeout", type=float, default=300.0, show_default=True,
              help="Seconds for every role to become ready.")
@_recovery_option
@click.option("--ffn-spares", type=click.IntRange(min=0), default=0, show_default=True,
              help="Standby FFN processes (with --ray: actors) that take over a lost FFN rank (one claims it "
                   "through the store and loads its weights); an FFN process that exits comes back as a spare.")
@click.option("--stop-timeout", type=float, default=10.0, show_default=True,
              help="Seconds each role has to exit after its SIGTERM when stopping (then it is killed).")
@click.option("--log-dir", type=click.Path(file_okay=False), default=None,
              help="Write each role's output to a file there instead of this terminal.")
@click.option("--backend", type=click.Choice(BACKENDS), default=None,
              help="What runs the programs (default: the artifact's): afdc kernels + Inductor, Inductor, eager.")
@click.option("--token-buckets", type=int, default=0, show_default=True,
              help="As `afdc serve --token-buckets`, for every FFN rank (on a GPU: its layers in CUDA graphs).")
@click.option("--attention-graphs", type=click.IntRange(min=0), default=0, show_default=True,
              help="As `afdc serve --attention-graphs`, for every attention rank (on a GPU: its decode steps in "
                   "CUDA graphs).")
@click.option("--pin/--no-pin", default=None,
              help="Put 1A1F's attention engine (its step thread) and FFN server on one core: they take turns, and "
                   "a host of few cores then keeps its other cores for vLLM's API server and the clients. Default: "
                   "on a CPU host of fewer than 4 cores with one micro-batch, while steps hold 8 tokens or more "
                   "(smaller ones float); --pin: always, --no-pin: never.")
@_serving_options("default on a CPU: this host's cores less one, shared by the attention engines and FFN servers")
@click.argument("vllm_args", nargs=-1, type=click.UNPROCESSED)
def up(artifact, demo, host, port, connector, ray_address, ray_attn_resource, ray_ffn_resource, device,
       micro_batches, kv_cache_mb, timeout, startup_timeout, ffn_recovery_timeout, ffn_spares, stop_timeout, log_dir,
       backend, token_buckets, attention_graphs, pin, spin, wait, spin_cap, yield_late, threads, log_interval,
       vllm_args) -> None:
    """Start every role of ARTIFACT's plan on this machine (or a Ray cluster) and serve the OpenAI
    API until Ctrl-C.

    Arguments after `--` go to the attention ranks' `vllm serve --data-parallel-size A`.
    """
    import signal
    import time
    from pathlib import Path

    from afdc.runtime.options import RuntimeOptions
    from afdc.runtime.rendezvous import free_port
    from afdc.serve.settings import WorkerSettings
    from afdc.serve.up import Deployment, check_serving_environment

    if demo and artifact is not None:  # `up --demo -- ARGS`: click fills the optional ARTIFACT first
        artifact, vllm_args = None, (artifact, *vllm_args)
    if demo == (artifact is not None):
        raise click.UsageError("give either ARTIFACT or --demo")
    connector = ConnectorKind(connector or ("gloo" if ray_address else "shm"))
    if ray_address and connector not in (ConnectorKind.GLOO, ConnectorKind.NCCL):
        raise click.UsageError(f"--connector {connector.value} cannot join ranks on different nodes, and Ray "
                               "places them on any node: --connector gloo (or nccl between GPUs)")
    if ray_address and pin:
        raise click.UsageError("--pin shares a core of this host; with --ray the ranks are on any node")
    check_serving_environment()
    if demo:
        from afdc.demo import demo_artifact

        artifact = demo_artifact(say=click.echo)
    options = RuntimeOptions(connector=connector, rendezvous=f"{host}:{free_port()}", timeout=timeout,
                             log_interval=log_interval, spin=spin, wait=wait, spin_cap=spin_cap, yield_late=yield_late)
    settings = WorkerSettings(
        str(artifact), options, recovery_timeout=ffn_recovery_timeout, micro_batches=micro_batches,
        kv_cache_bytes=kv_cache_mb << 20, device=device, backend=backend, threads=threads,
        attention_graphs=attention_graphs,
    )
    if log_dir:
        Path(log_dir).mkdir(parents=True, exist_ok=True)
    kind, placement = Deployment, {}
    if ray_address:
        from afdc.serve.ray_cluster import RayDeployment, RayPools

        kind, placement = RayDeployment, {"pools": RayPools(ray_address, ray_attn_resource, ray_ffn_resource)}
    deployment = kind(Path(artifact), settings, host, port, vllm_args, Path(log_dir) if log_dir else None,
                      token_buckets, pin, ffn_spares, **placement)
    asked: list[str] = []  # the signal that asked for the stop

    def ask(signum: int, _frame) -> None:
        asked.append(signal.Signals(signum).name)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, ask)
    try:
        url = deployment.start(startup_timeout, click.echo, lambda: asked[0] if asked else "")
        click.echo(f"ready: OpenAI API at {url}/v1")
        click.echo("Ctrl-C stops every role")
        while not asked:
            gone = deployment.failed()
            if gone is not None and not gone.startswith(("ffn", "spare")):
                raise AfdcError(f"{gone} exited; stopping the other roles")
            if gone is not None:  # stateless: the attention ranks regroup with the new process
                how = " as a spare" if ffn_spares else ""
                click.echo(f"{gone} exited (code {deployment.processes[gone].returncode}); restarting it{how}")
                deployment.restart(gone)
            time.sleep(0.2)
    except AfdcError:
        if not asked:  # a failure; after a stop was asked for, a role's exit is that stop's doing
            raise
    finally:
        click.echo("stopping every role" + (f" (asked for by {asked[0]})" if asked else ""))
        deployment.stop(stop_timeout)


@main.command(context_settings=_VLLM_ARGS)
@click.argument("artifact", type=click.Path(exists=True, file_okay=False))
@click.option("-o", "--output", type=click.Path(file_okay=False), default="k8s", show_default=True,
              help="Directory the manifests are written to (kubectl apply -f DIR).")
@click.option("--name", default=None, help="Prefix of every object's name (default: the artifact's directory name).")
@click.option("--image", required=True, help="Container image with afdc[serve] installed.")
@click.option("--claim", required=True, help="PersistentVolumeClaim whose volume holds the artifact.")
@click.option("--sub-path", default="", help="The artifact's directory inside that volume.")
@click.option("--namespace", default=None, help="Namespace of every object (default: kubectl's).")
@click.option("--attention-per-pod", type=int, default=1, show_default=True,
              help="Attention ranks (vLLM DP ranks, one GPU each) per attention pod.")
@click.option("--device", default="cuda", show_default=True, help="cuda: one GPU per rank; cpu: none.")
@click.option("--connector", type=click.Choice(["gloo", "nccl"]), default="gloo", show_default=True,
              help="Transport between the pods.")
@click.option("--ffn-spares", type=click.IntRange(min=0), default=0, show_default=True,
              help="Hot spare FFN pods (a StatefulSet of `afdc serve --role ffn --spare`): one takes a lost FFN "
                   "rank over until the rank's pod is back.")
@click.argument("vllm_args", nargs=-1, type=click.UNPROCESSED)
def k8s(artifact, output, name, image, claim, sub_path, namespace, attention_per_pod, device, connector,
        ffn_spares, vllm_args) -> None:
    """Write Kubernetes manifests that deploy ARTIFACT's plan (StatefulSets, Services, a Secret).

    Arguments after `--` go to the attention ranks' `vllm serve`. Not run in a cluster by afdc's
    tests: the manifests are checked against the Kubernetes API's schemas only.
    """
    from pathlib import Path

    from afdc.serve import k8s as kube

    cluster = kube.Cluster(name or kube.default_name(artifact), image, claim, sub_path, namespace,
                           attention_per_pod, device, connector, ffn_spares, tuple(vllm_args))
    for path in kube.write(kube.manifests(artifact, cluster), Path(output)):
        click.echo(f"wrote {path}")
    click.echo(f"deploy: kubectl apply -f {output}   (the OpenAI API: Service {cluster.name}, port {kube.API_PORT})")


def _inspect_demo(plan: str, router: str, as_json: bool) -> None:
    from afdc.demo import demo_batch, demo_model
    from afdc.equivalence import check

    model = demo_model()
    dm = afdc.disaggregate(model, plan=plan, router=router)
    result = check(model, dm, *demo_batch(model.config.vocab_size))
    if as_json:
        click.echo(json.dumps({"report": dm.report().to_dict(), "equivalence": vars(result)}, indent=2))
    else:
        click.echo(str(dm.report()))
        click.echo("")
        click.echo(str(result))
    if not result.ok():
        sys.exit(1)


@main.command()
@click.argument("model")
@click.option("--context", type=click.IntRange(min=1), default=8192, show_default=True, help="Context length (tokens).")
@click.option("--attn-hw", default="H100", show_default=True, help="Attention-side hardware profile.")
@click.option("--ffn-hw", default="H100", show_default=True, help="FFN-side hardware profile.")
@click.option("--tpot-ms", type=float, default=50.0, show_default=True, help="Time-per-output-token target (ms).")
@click.option("--kv-dtype", type=click.Choice(["bf16", "fp8", "int8"]), default="bf16", show_default=True)
@click.option("--weight-dtype", type=click.Choice(["bf16", "fp8", "int8"]),
              help="Price every weight at this dtype [default: a quantized checkpoint's weights at their stored "
                   "bytes (fp8, MXFP4, scales included), else bf16].")
@click.option("--dense-ffn", type=click.Choice(["tp", "replicate"]), default="tp", show_default=True,
              help="How the FFN GPUs hold dense FFN layers (as afdc compile --dense-ffn).")
@click.option("--hw-file", type=click.Path(dir_okay=False), help="Extra hardware profiles (JSON, same schema).")
@click.option("--json", "as_json", is_flag=True, help="Print the per-token cost and the plan as JSON.")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False),
              help="Draw throughput vs context and A:F ratio (with --compare: AFD's margin over EP, dead zone shaded).")
@click.option("--compare", is_flag=True, help="AFD against the EP baseline over --ratios and --contexts.")
@click.option("--ratios", default="0.5,1,2,3,4,6,8", show_default=True, help="--compare: A:F ratios, comma-separated.")
@click.option("--contexts", default="4096,16384,32768", show_default=True,
              help="--compare: context lengths, comma-separated.")
@click.option("--ffn-gpus", type=click.IntRange(min=1),
              help="--compare: FFN pool size [default: the best of the pools the plan search tries].")
@click.option("--ep-gpus", type=click.IntRange(min=1), help="--compare: EP baseline size [default: the best found].")
@click.option("--micro-batches", type=click.IntRange(min=1),
              help="AFD micro-batches [default: the least m >= 2(1 + Tc/Tf)].")
@click.option("--expert-skew", type=click.FloatRange(min=1.0), default=1.0, show_default=True,
              help="Tokens the busiest expert GPU gets over the mean (1: balanced).")
@click.option("--dispatch-dtype", type=click.Choice(["bf16", "fp8", "int8"]),
              help="Dtype hidden states travel to the FFN in [default: the model's].")
@click.option("--scale-up-domain", type=click.IntRange(min=1),
              help="GPUs per scale-up domain (NVLink/UB), overriding the profiles'.")
@click.option("--two-stage-exchange", is_flag=True,
              help="AFD exchange in two stages: one NIC copy per FFN scale-up domain, fanned out over its "
                   "interconnect (Baidu's production AFD) [default: one copy per FFN GPU].")
def plan(model, context, attn_hw, ffn_hw, tpot_ms, kv_dtype, weight_dtype, dense_ffn, hw_file, as_json,
         plot_path, compare, ratios, contexts, ffn_gpus, ep_gpus, micro_batches, expert_skew, dispatch_dtype,
         scale_up_domain, two_stage_exchange) -> None:
    """Per-token decode cost of MODEL and a recommended AFD deployment against the monolithic one.

    MODEL (hub id, model directory or config.json) is built on the meta device: no weights are read.
    """
    from afdc import planner
    from afdc.planner.hardware import get_profile, load_profiles
    from afdc.quant.scheme import planned_weight_dtype, scheme_from_config
    from afdc.source import empty_model, load_config

    if plot_path:
        planner.require_matplotlib()  # before the capture, not after
    profiles = load_profiles(hw_file)
    hw_a, hw_f = get_profile(attn_hw, profiles), get_profile(ffn_hw, profiles)
    if scale_up_domain:
        hw_a, hw_f = (dataclasses.replace(hw, scale_up_domain=scale_up_domain) for hw in (hw_a, hw_f))
    sweep = (_numbers(ratios, float, "--ratios"), _numbers(contexts, int, "--contexts")) if compare else None
    config = load_config(model)
    meta = empty_model(config)
    # a quantized checkpoint's weights are priced at their stored bytes unless --weight-dtype says otherwise
    scheme = scheme_from_config(config, meta) if weight_dtype is None else None
    weight_dtype = weight_dtype or planned_weight_dtype(config) or "bf16"
    built, layers = planner.split_for_planning(meta, scheme)
    assumptions = planner.Assumptions(dense_ffn=dense_ffn, micro_batches=micro_batches, expert_skew=expert_skew,
                                      dispatch_dtype=dispatch_dtype, two_stage_exchange=two_stage_exchange)

    def facts_at(ctx: int) -> planner.ModelFacts:
        return planner.model_facts(built, ctx, weight_dtype, kv_dtype, name=model, layers=layers,
                                   stored=scheme is not None)

    if sweep is not None:
        comparison = planner.compare({c: facts_at(c) for c in sweep[1]}, hw_a, hw_f, sweep[0], tpot_ms, assumptions,
                                     ffn_gpus=ffn_gpus, ep_gpus=ep_gpus)
        click.echo(json.dumps(comparison.to_dict(), indent=2) if as_json else str(comparison))
        if plot_path:
            planner.plot_comparison(comparison, plot_path)
            click.echo(f"plot written to {plot_path}", err=as_json)
        return

    def plan_at(ctx: int) -> planner.PlanResult:
        return planner.plan(facts_at(ctx), hw_a, hw_f, tpot_ms, assumptions)

    result = plan_at(context)
    click.echo(json.dumps(result.to_dict(), indent=2) if as_json else str(result))
    if plot_path:
        _plot(planner, result, plan_at, plot_path)
        click.echo(f"plot written to {plot_path}", err=as_json)


def _numbers(text: str, kind, option: str) -> list:
    try:
        values = [kind(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise click.BadParameter(f"{text!r} is not a comma-separated list of numbers", param_hint=option) from None
    if not values or min(values) <= 0:
        raise click.BadParameter(f"{text!r}: give positive numbers, e.g. 1,2,4", param_hint=option)
    return values


def _plot(planner, result, plan_at, path: str) -> None:
    by_context = {result.facts.context: result}
    for ctx in (1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072):
        if ctx not in by_context:
            try:
                by_context[ctx] = plan_at(ctx)
            except AfdcError:
                continue  # the target cannot be met at this context: a gap in the curve
    y = result.afd.ffn_gpus if result.afd else 1
    curve = planner.ratio_curve(result.facts, result.attention_hw, result.ffn_hw, y, result.tpot_target_ms)
    planner.plot(result, by_context, curve, path)


if __name__ == "__main__":
    main()
