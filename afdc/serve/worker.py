"""afdc's vLLM worker: it executes each step vLLM's scheduler hands it with afdc's programs.

vLLM's engine core calls it in this order: ``init_device``, ``load_model``,
``get_kv_cache_spec``, ``determine_available_memory``, ``initialize_from_config``, then per
step ``execute_model(scheduler_output)`` and ``sample_tokens(grammar_output)``.

A step runs the attention program of this attention rank on the step's flat token batch over
a paged KV cache laid out on vLLM's block tables (:mod:`afdc.runtime.paged`), its requests
split into micro-batches that ping-pong with the FFN ranks (:class:`AttentionRank`); a program
with sparse-attention indexers runs on rows of a padded batch instead (:class:`PagedRows`). With the
``loopback`` connector the FFN programs run in this process: the monolithic baseline served
by the same worker. Sampling is vLLM's own sampler.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheSpec, MambaSpec
from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, DraftTokenIds, ModelRunnerOutput
from vllm.v1.structured_output.utils import apply_grammar_bitmask
from vllm.v1.worker.worker_base import CompilationTimes, WorkerBase

from afdc.artifact import manifest as mf
from afdc.artifact.load import deployment_of, load, load_with_drafter
from afdc.errors import UnsupportedModelError
from afdc.runtime.attention_rank import AttentionRank, MicroBatch
from afdc.runtime.decode_graphs import DecodeGraphs
from afdc.runtime.exchange import AttentionEndpoint
from afdc.runtime.flat_batches import prepare_for_flat_batches
from afdc.runtime.metrics import Metrics
from afdc.runtime.paged import (
    MixerStateStore,
    PagedBatch,
    PagedKVStore,
    PagedRows,
)
from afdc.runtime.rendezvous import DEGRADED, SERVING, UNAVAILABLE, Health, PeerLost, Rendezvous, RendezvousError
from afdc.serve.cores import Placement
from afdc.serve.mtp_drafter import MtpDrafts, first_pass
from afdc.serve.platform import read_config_as_compiled
from afdc.serve.prompt_logprobs import PromptLogprobs
from afdc.serve.sampling import SamplingRequest, StepSampler, new_generator
from afdc.serve.settings import WorkerSettings
from afdc.serve.speculation import Speculation
from afdc.serve.up import check_servable

logger = logging.getLogger("vllm.afdc.worker")  # vLLM prints plugin logs under its own hierarchy


def layer_name(slot: int) -> str:
    return f"afdc.attention.{slot}"


def mixer_layer_name(slot: int) -> str:
    return f"afdc.mixer.{slot}"


def drafter_layer_name(slot: int) -> str:
    return f"afdc.drafter.attention.{slot}"


@dataclass
class Request:
    """What the worker remembers of a request between steps (vLLM sends only the changes)."""

    id: str
    tokens: list[int]  # prompt, then the sampled tokens (also in ``sampling.output``)
    sampling: SamplingRequest
    block_ids: list[list[int]]  # per KV-cache group (attention; each stateful mixer's state blocks)
    computed: int  # tokens whose keys and values are in the cache
    scheduled: int = 0  # tokens run in the current step
    prompt_logprobs: PromptLogprobs | None = None  # asked for, until the prefill returns them
    logits: int = 1  # logit rows it takes from the current step: its last token's and drafts', or all (prompt logprobs)
    drafts: list[int] = field(default_factory=list)  # draft tokens the current step verifies (speculative decoding)


def _row_groups(sizes: list[int], parts: int) -> list[list[int]]:
    """Requests of a :class:`PagedRows` step: those with one token this step in ``parts`` groups
    (rows of one batch each), every other one alone."""
    single = [i for i, n in enumerate(sizes) if n == 1]
    groups = [single[g] for g in _micro_batches([1] * len(single), parts)] if single else []
    return groups + [[i] for i, n in enumerate(sizes) if n != 1]


def _step_tokens(r: Request) -> list[int]:
    """The tokens ``r`` runs in the current step: known ones, then its drafts. vLLM pads a new
    decode's drafts with -1 (one step shape for CUDA graphs); they run as token 0, and the
    verifier rejects them."""
    known = r.tokens[r.computed:r.computed + r.scheduled]
    return known + [max(t, 0) for t in r.drafts] if r.drafts else known


def _logit_rows(requests: list[Request], rows: bool) -> torch.Tensor | None:
    """The token rows of a micro-batch whose logits its requests take (``Request.logits`` each);
    None for the default, each request's last. ``rows``: a :class:`PagedRows` step, whose requests
    with more than one token run alone."""
    if all(r.logits == 1 for r in requests):
        return None
    if rows:
        return torch.arange(requests[0].scheduled)
    ends = itertools.accumulate(r.scheduled for r in requests)
    return torch.tensor([i for r, end in zip(requests, ends) for i in range(end - r.logits, end)])


def _micro_batches(sizes: list[int], parts: int) -> list[slice]:
    """Contiguous groups of requests with about equal token counts, none empty."""
    total, bounds, acc = sum(sizes), [0], 0
    for i, n in enumerate(sizes):
        acc += n
        if len(bounds) < parts and acc >= total * len(bounds) / parts and i + 1 < len(sizes):
            bounds.append(i + 1)
    bounds.append(len(sizes))
    return [slice(a, b) for a, b in itertools.pairwise(bounds)]


class AfdcWorker(WorkerBase):
    def __init__(self, vllm_config, local_rank: int, rank: int, distributed_init_method: str,
                 is_driver_worker: bool = False, **kwargs):
        super().__init__(vllm_config, local_rank, rank, distributed_init_method, is_driver_worker)
        read_config_as_compiled()
        self.settings = WorkerSettings.from_env()
        # vLLM's global DP rank (data_parallel_rank itself is reset to 0 for an engine without experts)
        self.rank = vllm_config.parallel_config.data_parallel_index
        self.requests: dict[str, Request] = {}
        # (scheduler output, requests, their sampling logits, prompt logprobs to return) awaiting sampling
        self._pending: tuple | None = None
        self._store_host: Rendezvous | None = None
        self._health = Health()  # as last reported
        self._lost_at: float | None = None  # when the current loss of an FFN rank was first seen
        self._step_lock = threading.Lock()  # a step and the idle rank's regrouping take turns at the endpoint
        self._stepped_at = 0.0  # when the last step ended
        self._holding = False  # whether a step runs (or is held for a lost FFN rank)
        self._sampled: set[str] = set()  # the requests of the last step
        self._sampled_at = 0.0  # when its sampling ended
        self._stop = threading.Event()
        s = self.settings  # the step thread's cores: vLLM runs steps on its engine core's main thread
        self._placement = Placement(s.cpus, s.pin_tokens, f"attention rank {self.rank}", logger) if s.cpus else None

    # -- start-up ----------------------------------------------------------------------------

    def init_device(self) -> None:
        if self.settings.threads:
            torch.set_num_threads(self.settings.threads)
        self.device = torch.device(self.settings.device)
        if self.device.type == "cuda" and self.device.index is None:  # a host's DP ranks: a GPU each
            self.device = torch.device("cuda", self.vllm_config.parallel_config.data_parallel_rank_local or 0)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.sampler = StepSampler(self.vllm_config, self.device)
        spec = self.vllm_config.speculative_config is not None
        self.speculation = Speculation(self.vllm_config, self.sampler.sampler, self.device) if spec else None
        self._drafts = None  # the drafts proposed after the last step, until vLLM takes them

    def load_model(self, *, load_dummy_weights: bool = False) -> None:
        directory = Path(self.settings.artifact)
        manifest = mf.read_manifest(directory)
        check_servable(manifest)
        self.mixers = manifest.mixers
        program = self._load_programs(directory, manifest)
        self._prepare(program, manifest)
        if not self.settings.runtime.connector.in_process:
            self._join_deployment(directory)
        self._start_metrics()
        r = self.settings.runtime
        logger.info(
            "afdc: attention rank %d of %s loaded (%d attention layers, %d TP ranks, %d micro-batches, backend %s, "
            "FFN %s)", self.rank, directory, len(self.slots), self.tp_ranks, self.micro_batches,
            self.backend, "in this process" if r.connector.in_process else f"over {r.connector} at {r.rendezvous}",
        )

    def _load_programs(self, directory: Path, manifest: mf.Manifest):
        """This rank's attention program, and its FFN side: the FFN programs in this process
        (loopback), or none (the FFN ranks' servers run them)."""
        s = self.settings
        if self.speculation is not None and self.speculation.method == "mtp":
            program, drafter = load_with_drafter(directory, self.rank, self.device, backend="eager")
            self._prepare_drafter(directory, drafter)
        else:
            program = load(directory, "attn", self.rank, self.device, backend="eager")
            self.drafter = self.drafter_slots = None
        dispatch = [manifest.segments[lay.segment].dispatch() for lay in manifest.layers]
        in_process = s.runtime.connector.in_process
        ranks = range(manifest.plan.ffn_ranks) if in_process else ()
        self.attention = AttentionRank(self.rank, program, [load(directory, "ffn", r, self.device, s.backend)
                                                            for r in ranks], dispatch)
        return program

    def _prepare_drafter(self, directory: Path, drafter) -> None:
        """The artifact's MTP drafter, prepared for vLLM's steps as the model's program is."""
        if drafter is None:  # afdc serve refused this before vLLM started; vllm serve by hand gets here
            raise UnsupportedModelError(f"{directory} holds no MTP drafter: the checkpoint it was compiled from has "
                                        "no MTP layers")
        s = self.settings
        prepared = prepare_for_flat_batches(drafter, s.backend or mf.read_manifest(directory).plan.backend,
                                            self.device, mixers=[])
        if prepared.rows or not prepared.rows_only:
            raise UnsupportedModelError("MTP drafting needs the drafter's LM head and its attention on a flat batch")
        self.drafter, self.drafter_slots = drafter, prepared.slots

    def _prepare(self, program, manifest: mf.Manifest) -> None:
        """The program rewritten for vLLM's steps, and what the cache and steps take from it."""
        s = self.settings
        prepared = prepare_for_flat_batches(program, s.backend or manifest.plan.backend, self.device,
                                            mixers=self.mixers)
        self.slots, self.key_slots, self.tp_ranks = prepared.slots, prepared.key_slots, prepared.tp_ranks
        self.rows, self.rows_only = prepared.rows, prepared.rows_only
        if self.drafter is not None and (self.rows or not self.rows_only or self.tp_ranks > 1):
            raise UnsupportedModelError(
                "MTP drafting needs the model's LM head found (its input is what the drafter continues from) and "
                "its attention on a flat batch (no sparse-attention indexers), on one TP rank (no --attn-tp)")
        self.backend, self.dtype = prepared.backend, prepared.dtype
        if any(not m.fixed_state for m in self.mixers):
            # a state that grows with the sequence, held in fixed tensors sized for the longest one
            self.mixers = program.mixers.bound(self.model_config.max_model_len, self.dtype)
        if self.tp_ranks > 1:  # TP ranks 1.. wait while rank 0 waits for the FFN side
            program.timeout = s.runtime.timeout + s.runtime.join_timeout
        self.micro_batches = s.micro_batches or manifest.plan.micro_batches

    def _join_deployment(self, directory: Path) -> None:
        """Reach the FFN ranks: host the deployment's store (attention rank 0), connect, and keep
        this rank's membership while it is idle."""
        options = self.settings.runtime
        layout, deployment = deployment_of(directory)
        if self.rank == 0:
            self._store_host = self.settings.open_rendezvous(host=True)
        self.attention.endpoint = AttentionEndpoint.connect(self.rank, layout, deployment, options, self.device)
        threading.Thread(target=self._keep_membership, args=(options.poll_interval,), daemon=True,
                         name="afdc-membership").start()

    def _start_metrics(self) -> None:
        """The endpoint's sends and waits (in process: the FFN runs) and the step's own phases in one record."""
        if self.settings.runtime.connector.in_process:
            self.metrics = Metrics("attn", self.rank)
            self.attention.phases = self.metrics.phases
        else:
            self.metrics = self.attention.endpoint.metrics
        self._stop_logging = self.metrics.log_every(self.settings.runtime.log_interval, logger=logger)

    def get_model(self) -> torch.nn.Module:
        return self.attention.program

    def get_kv_cache_spec(self) -> dict[str, KVCacheSpec]:
        block_size = self.vllm_config.cache_config.block_size
        specs = {
            layer_name(i): FullAttentionSpec(
                block_size=block_size,
                num_kv_heads=s.kv_heads,
                head_size=s.head_dim,
                head_size_v=s.value_dim,
                dtype=self.dtype,
                # vLLM keeps every block of a sliding or chunked layer (one cache group); the
                # window is applied by the attention op
                sliding_window=s.window if s.window and not s.chunked else None,
                attention_chunk_size=s.window if s.chunked else None,
            )
            for i, s in enumerate(self.slots)
        }
        for i, s in enumerate(self.drafter_slots or []):  # the MTP drafter's attention: a layer of its own
            specs[drafter_layer_name(i)] = replace(specs[layer_name(0)], num_kv_heads=s.kv_heads, head_size=s.head_dim,
                                                   head_size_v=s.value_dim, sliding_window=None,
                                                   attention_chunk_size=None)
        # an indexer's keys sit in the attention layers' blocks (same block ids and token slots):
        # each attention page is padded by its share of them, so that vLLM counts their memory
        key_bytes = sum(block_size * k.head_dim * self.dtype.itemsize for k in self.key_slots)
        if key_bytes:
            extra = -(-key_bytes // len(specs))
            specs = {name: replace(spec, page_size_padded=spec.page_size_bytes + extra) for name, spec in specs.items()}
        pages = {spec.page_size_bytes for spec in specs.values()}
        if len(pages) > 1:
            raise UnsupportedModelError(
                "the model's attention layers have different KV shapes (heads x head size): vLLM would need "
                "one KV-cache group per shape, which afdc's worker does not lay out yet"
            )
        if self.mixers and any(s.window for s in self.slots):
            raise UnsupportedModelError(
                "a model with stateful mixers and sliding-window or chunked attention: vLLM's hybrid cache "
                "manager would free the window's old blocks, which afdc's paged attention still reads"
            )
        # a stateful mixer's state, as vLLM's own hybrid models declare it: one block per request
        # (the block spans the whole context), no prefix caching of it (see afdc.serve.platform)
        for site in self.mixers:
            specs[mixer_layer_name(site.slot)] = MambaSpec(
                block_size=self.model_config.max_model_len,
                shapes=tuple(t.shape for t in site.state),
                dtypes=tuple(getattr(torch, t.dtype) for t in site.state),
            )
        return specs

    def get_supported_kv_cache_layouts(self) -> list[str]:
        return ["NHD"]

    def determine_available_memory(self) -> int:
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            return int(free * self.cache_config.gpu_memory_utilization)
        return self.settings.kv_cache_bytes

    def initialize_from_config(self, kv_cache_config: KVCacheConfig) -> None:
        group_of = {name: i for i, g in enumerate(kv_cache_config.kv_cache_groups) for name in g.layer_names}
        self.groups = len(kv_cache_config.kv_cache_groups)
        # none where every attention is a stateful mixer's (DeepSeek-V4): only state groups then
        self.attention_group = group_of.get(layer_name(0))
        # vLLM may have grown the attention block to the mixers' state page (one page size per pool)
        self.block_size = (self.cache_config.block_size if self.attention_group is None else
                           kv_cache_config.kv_cache_groups[self.attention_group].kv_cache_spec.block_size)
        self.state_groups = {site.slot: group_of[mixer_layer_name(site.slot)] for site in self.mixers}
        num_blocks = kv_cache_config.num_blocks
        self.store = PagedKVStore(
            self.slots, num_blocks, self.block_size, self.dtype, self.device, tp_ranks=self.tp_ranks
        )
        self.states = MixerStateStore(self.mixers, num_blocks, self.device) if self.mixers else None
        self.drafts = None
        if self.drafter is not None:  # on the same block ids as the model's cache
            store = PagedKVStore(self.drafter_slots, num_blocks, self.block_size, self.dtype, self.device)
            self.drafts = MtpDrafts(self.drafter, store, self.speculation.k)
        self.keys = (
            PagedKVStore(self.key_slots, num_blocks, self.block_size, self.dtype, self.device) if self.rows else None
        )
        self._use_decode_graphs()
        logger.info(
            "afdc: KV cache of %d blocks x %d tokens%s", num_blocks, self.block_size,
            f", state blocks for {len(self.mixers)} stateful mixers" if self.mixers else "",
        )

    def _use_decode_graphs(self) -> None:
        """``attention_graphs``: decode steps padded to buckets, their pieces CUDA graphs on a GPU
        (:mod:`afdc.runtime.decode_graphs`), where the steps are plain flat batches."""
        largest = self.settings.attention_graphs
        if not largest:
            return
        if self.rows or self.mixers or self.tp_ranks > 1:
            logger.warning("afdc: --attention-graphs is off for this model: its steps run rows of a padded batch, "
                           "stateful mixers or attention TP, which are not padded")
            return
        width = -(-self.model_config.max_model_len // self.block_size)
        graphs = self.device.type == "cuda"
        self.attention.decode = DecodeGraphs(self.attention.program, self.attention.dispatch, largest, width, graphs)
        logger.info("afdc: decode steps padded to powers of two up to %d requests per micro-batch%s", largest,
                    ", each piece a CUDA graph per bucket" if graphs else " (no CUDA graphs on a CPU)")

    def compile_or_warm_up_model(self) -> CompilationTimes:
        """Under a compiling backend, or with the attention decode step in CUDA graphs, run the
        programs before any request on the step shapes that take graphs of their own (each
        decode bucket's, for the latter), so that no step compiles or captures mid-serving.
        Dynamo specializes a size of 1 and compiles every other size into one graph: a step of
        micro-batches of one token (decode of one request, or m of them), and one of two. Their
        keys and values go into the null block (block 0), which vLLM never hands a request. Under ``inductor`` the first
        one-token step compiled mid-serving otherwise: a 192 ms p99 TPOT on the demo model, and
        a compile per program piece on a real one."""
        decode = self.attention.decode
        graphs = decode is not None and decode.graphs
        if self.backend == "eager" and not graphs:
            return CompilationTimes(0.0, 0.0)
        start = time.monotonic()
        counts = sorted({1, self.micro_batches})
        shapes = [(2, 1, self.micro_batches), *((1, 1, m) for m in counts)] if self.backend != "eager" else []
        if graphs:  # every bucket's graphs captured now, not at its first step (see afdc.runtime.decode_graphs)
            shapes += [(1, 1 << i, self.micro_batches) for i in range((decode.largest - 1).bit_length() + 1)]
        for tokens, requests, parts in shapes:
            warm_up = Request("afdc-warm-up", [0] * tokens, None, [[0]] * self.groups, 0, tokens)
            self._run([self._micro_batch([warm_up] * requests) for _ in range(parts)])
        seconds = time.monotonic() - start
        logger.info("afdc: programs compiled for every step shape before serving, in %.1f s", seconds)
        return CompilationTimes(seconds, 0.0)

    def get_supported_tasks(self) -> tuple[str, ...]:
        return ("generate",)

    # -- steps -------------------------------------------------------------------------------

    def _update(self, so) -> None:
        """Apply what the scheduler changed: finished, new, resumed and continuing requests."""
        for rid in so.finished_req_ids:
            self.requests.pop(rid, None)
        stores = [self.store] + ([self.keys] if self.keys is not None else [])
        stores += [self.drafts.store] if self.drafts is not None else []
        for store in stores:
            if so.new_block_ids_to_zero:
                store.zero_blocks(so.new_block_ids_to_zero)
            if so.kv_cache_block_copies:
                store.copy_blocks([(c.src_block_id, c.dst_block_id) for c in so.kv_cache_block_copies])
        for new in so.scheduled_new_reqs:
            params = new.sampling_params
            prompt = list(new.prompt_token_ids)
            sampling = SamplingRequest(params, prompt, [], new_generator(params, self.device))
            self.requests[new.req_id] = Request(
                new.req_id, list(prompt), sampling, [list(g) for g in new.block_ids], new.num_computed_tokens,
                prompt_logprobs=PromptLogprobs.of(params, prompt, self.model_config.get_vocab_size(),
                                                  self.model_config.logprobs_mode, self.device),
            )
        cached = so.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            r = self.requests[rid]
            r.computed = cached.num_computed_tokens[i]
            keep = cached.num_output_tokens[i]
            del r.tokens[len(r.sampling.prompt) + keep:]
            del r.sampling.output[keep:]
            blocks = cached.new_block_ids[i]
            if rid in cached.resumed_req_ids:
                r.block_ids = [list(g) for g in blocks]
            elif blocks is not None:
                for mine, new in zip(r.block_ids, blocks):
                    mine.extend(new)
        for rid, groups in (so.block_table_updates or {}).items():
            self.requests[rid].block_ids = [list(g) for g in groups]

    def execute_model(self, scheduler_output, intermediate_tensors=None):
        started, cpu = time.perf_counter(), time.thread_time()
        so = scheduler_output
        # vLLM's scheduler and output processing between two steps: where a request goes on from
        # the last step, the engine had work all along (it blocks for input only without any)
        if any(rid in self._sampled for rid in so.scheduled_cached_reqs.req_ids):
            self.metrics.phases.add("engine", started - self._sampled_at)
        self._update(so)
        if so.total_num_scheduled_tokens == 0:
            return EMPTY_MODEL_RUNNER_OUTPUT
        scheduled = [self.requests[rid] for rid in so.num_scheduled_tokens]
        for r in scheduled:
            r.scheduled = so.num_scheduled_tokens[r.id]
            r.drafts = list(so.scheduled_spec_decode_tokens.get(r.id, ()))
            wanted = r.prompt_logprobs is not None and r.prompt_logprobs.rows(r.computed, r.scheduled) > 0
            r.logits = r.scheduled if wanted else 1 + len(r.drafts)
        sizes = [r.scheduled for r in scheduled]
        if self.rows:
            groups = [[scheduled[i] for i in g] for g in _row_groups(sizes, self.micro_batches)]
        else:
            groups = [scheduled[g] for g in _micro_batches(sizes, self.micro_batches)]
        batches = [self._micro_batch(g) for g in groups]
        for batch in batches:  # the MTP drafter continues from the LM head's input at every token
            batch.cache.keep_hidden = self.drafts is not None
        if self._placement is not None:  # by the size the FFN ranks hear in the step's plan
            self._placement.step(sum(b.input_ids.numel() for b in batches))
        self.metrics.phases.add("prepare", time.perf_counter() - started, time.thread_time() - cpu)
        with self.metrics.phases.timed("step"):
            outputs = self._run(batches)
        logits = torch.cat([self._taken(out.logits, batch) for batch, out in zip(batches, outputs)])
        requests = [r for g in groups for r in g]
        prompt_logprobs = {}
        if any(r.logits > 1 for r in requests):
            taken = logits.split([r.logits for r in requests])
            # where each request samples: its last token's row, after its drafts' (verified) rows
            logits = torch.cat([rows[len(rows) - 1 - len(r.drafts):] for r, rows in zip(requests, taken)])
            prompt_logprobs = self._prompt_logprobs(requests, taken)
        hidden = torch.cat([b.cache.hidden[0] for b in batches]) if self.drafts is not None else None
        self._pending = (so, requests, logits, prompt_logprobs, hidden)
        return None

    def _taken(self, logits: torch.Tensor, batch: MicroBatch) -> torch.Tensor:
        """The logit rows a micro-batch's requests take (``Request.logits`` each, in order), ``[rows, vocab]``."""
        if not self.rows_only:  # the program computed every token's
            logits = logits.index_select(1, batch.cache.logit_rows)
        return logits.flatten(0, 1)  # flat: one row; PagedRows: a row per request

    def _prompt_logprobs(self, requests: list[Request], taken: list[torch.Tensor]) -> dict:
        """Each request's prompt logprobs from the step's logits; those of the requests whose prefill
        the step ends, to return (vLLM's ``prompt_logprobs_dict``)."""
        done = {}
        for r, rows in zip(requests, taken):
            asked = r.prompt_logprobs
            if asked is None:
                continue
            asked.add(rows[:asked.rows(r.computed, r.scheduled)], r.computed)
            if asked.completes(r.computed, r.scheduled):
                done[r.id], r.prompt_logprobs = asked.tensors, None
        return done

    def _run(self, batches: list[MicroBatch], program=None) -> list:
        """Run the step. While an FFN rank is lost the step is held: no token is sampled and no
        state committed; this rank reports itself degraded, waits for the rank's return, and runs
        the same step again (a rerun rewrites the same cache slots with the same keys and values,
        so a step cut short at any layer is safe to repeat). Past ``recovery_timeout`` it reports
        itself unavailable: the HTTP side (:mod:`afdc.serve.health`) then fails the requests with
        a 503 naming the rank, and their aborts reach the scheduler once the step went through;
        the step goes on waiting, so serving resumes when the rank is back."""
        self._holding = True  # the idle rank's regrouping stays away: the held step regroups, within its hold
        try:
            return self._run_held(batches, program)
        finally:
            self._holding = False

    def _run_held(self, batches: list[MicroBatch], program=None) -> list:
        while True:
            options = self.settings.runtime
            # while degraded, a regrouping waits no longer than the hold has left
            left = self._left()
            join_timeout = min(options.join_timeout, left) if left is not None and left > 0 else None
            try:
                with self._step_lock:
                    outputs, _ = self.attention.run(self.attention.begin_step(join_timeout), batches, program)
                    self._stepped_at = time.monotonic()
                for batch in batches:
                    batch.cache.commit_states()
            except (PeerLost, RendezvousError) as err:
                self._lost(err)
                time.sleep(options.poll_interval)
                continue
            self._serving()
            return outputs

    def _keep_membership(self, interval: float) -> None:
        """Join the deployment, and regroup with it whenever it regroups, while no step runs.

        vLLM runs each attention rank's engine on its own (see :mod:`afdc.serve.platform`), so a
        rank without requests makes no step; but a regrouping (an FFN rank restarted) waits for
        every rank to join, and would wait for an idle one until it timed out. Regrouping is
        :meth:`AttentionEndpoint.begin_step` without a step: it sends nothing to the FFN ranks."""
        while not self._stop.wait(interval):
            with self._step_lock:
                if self._stop.is_set() or self._holding or time.monotonic() - self._stepped_at < interval:
                    continue  # serving: the steps regroup
                try:
                    self.attention.begin_step()
                except (PeerLost, RendezvousError) as err:
                    self._lost(err)
                    continue
            self._serving()

    def _left(self) -> float | None:
        """Seconds the current loss of an FFN rank may still be waited out (None: none is lost;
        negative: past ``recovery_timeout``)."""
        if self._lost_at is None:
            return None
        return self._lost_at + self.settings.recovery_timeout - time.monotonic()

    def _lost(self, err: Exception) -> None:
        if self._lost_at is None:
            self._lost_at = time.monotonic()
        timeout = self.settings.recovery_timeout
        if self._left() > 0:
            self._report(Health(DEGRADED, f"{err}; requests are held up to {timeout:g} s for it to come back"))
        else:
            self._report(Health(UNAVAILABLE, f"{err}; not back within {timeout:g} s"))

    def _serving(self) -> None:
        self._lost_at = None
        self._report(Health())

    def _report(self, health: Health) -> None:
        if health != self._health:
            if health.state == SERVING:
                logger.info("afdc: attention rank %d reaches every FFN rank again", self.rank)
            else:
                logger.error("afdc: attention rank %d is %s: %s", self.rank, health.state, health.problem)
            self.attention.endpoint.rendezvous.report_health("attn", self.rank, health)
            self._health = health

    def _micro_batch(self, requests: list[Request]) -> MicroBatch:
        tokens = [_step_tokens(r) for r in requests]
        attention = [r.block_ids[self.attention_group] if self.attention_group is not None else [] for r in requests]
        width = max(len(b) for b in attention)
        table = torch.tensor([b + [0] * (width - len(b)) for b in attention], dtype=torch.long)
        computed = torch.tensor([r.computed for r in requests])
        logit_rows = _logit_rows(requests, self.rows)
        state_blocks = {
            slot: torch.tensor([r.block_ids[group][0] for r in requests]) for slot, group in self.state_groups.items()
        }
        if self.rows:
            rows = PagedRows(self.store, table, computed, requests[0].scheduled, self.keys, logit_rows, self.states,
                             state_blocks)
            ids = torch.tensor(tokens, device=self.device)
            return MicroBatch(ids, rows.attention_mask, rows.positions, rows)
        ids = torch.tensor([t for row in tokens for t in row])[None]
        paged = PagedBatch(
            self.store, table, computed, torch.tensor([r.scheduled for r in requests]), self.states, state_blocks,
            logit_rows,
        )
        ids = ids.to(self.device)
        return MicroBatch(ids, torch.ones_like(ids), paged.positions, paged)

    def sample_tokens(self, grammar_output) -> ModelRunnerOutput:
        with self.metrics.phases.timed("sample"):
            out = self._sample(grammar_output)
        self._sampled, self._sampled_at = set(out.req_ids), time.perf_counter()
        return out

    def _sample(self, grammar_output) -> ModelRunnerOutput:
        so, scheduled, logits, prompt_logprobs, hidden = self._pending
        self._pending = None
        if grammar_output is not None:
            apply_grammar_bitmask(so, grammar_output, _Batch([r.id for r in scheduled]), logits)
        # a chunk that stops short of the request's known tokens samples nothing; its seeded
        # generator must not advance either
        complete = [r.computed + r.scheduled >= len(r.tokens) for r in scheduled]
        saved = {i: r.sampling.generator.get_state() for i, r in enumerate(scheduled)
                 if not complete[i] and r.sampling.generator is not None}
        requests, drafts = [r.sampling for r in scheduled], [r.drafts for r in scheduled]
        verifier = self.speculation.verifier if self.speculation is not None else None
        if any(drafts) and verifier.verifies([r.params for r in requests]):
            metadata = replace(self.sampler.metadata(requests, logits.shape[-1]), spec_token_ids=drafts)
            tokens, logprobs = verifier(logits, drafts, metadata)
        else:
            if any(drafts):
                logits = verifier.unverified(logits, drafts)
            out = self.sampler(logits, requests)
            tokens = out.sampled_token_ids.tolist()
            logprobs = out.logprobs_tensors.tolists() if out.logprobs_tensors is not None else None
        for i, state in saved.items():
            scheduled[i].sampling.generator.set_state(state)
        sampled: list[list[int]] = []
        for r, kept, done in zip(scheduled, tokens, complete):
            if done:
                r.tokens.extend(kept)
                r.sampling.output.extend(kept)
            sampled.append(kept if done else [])
        if self.drafts is not None:
            self._drafts = self._mtp_drafts(scheduled, sampled, complete, hidden, so.num_spec_tokens_to_schedule)
        elif self.speculation is not None:
            self._drafts = self.speculation.propose(
                [r.id for r in scheduled], [r.tokens for r in scheduled], sampled, so.num_spec_tokens_to_schedule,
                [r.params for r in requests],
            )
        return ModelRunnerOutput(
            req_ids=[r.id for r in scheduled],
            req_id_to_index={r.id: i for i, r in enumerate(scheduled)},
            sampled_token_ids=sampled,
            logprobs=logprobs,
            prompt_logprobs_dict=prompt_logprobs,
        )

    def _mtp_drafts(self, scheduled: list[Request], sampled: list[list[int]], complete: list[bool],
                    hidden: torch.Tensor, k: int) -> DraftTokenIds:
        """The MTP drafter's passes after a step (:mod:`afdc.serve.mtp_drafter`): its cache
        written at the step's positions, and up to ``k`` drafts per request that may take them."""
        with self.metrics.phases.timed("draft"):
            rows = first_pass(
                [r.computed for r in scheduled], [r.scheduled for r in scheduled], [len(r.drafts) for r in scheduled],
                [r.tokens for r in scheduled], [s if done else None for s, done in zip(sampled, complete)],
                [self.speculation.verifier.verifies([r.sampling.params]) for r in scheduled],
            )
            offsets = list(itertools.accumulate([r.scheduled for r in scheduled], initial=0))
            tables = [r.block_ids[self.attention_group] for r in scheduled]
            drafts = self.drafts.propose(rows, hidden, offsets, tables, k, self._run)
        return DraftTokenIds([r.id for r in scheduled], [drafts.get(i, []) for i in range(len(scheduled))])

    # -- the rest of vLLM's worker interface -------------------------------------------------

    def take_draft_token_ids(self):
        """The drafts proposed after the last step (speculative decoding), for vLLM's scheduler."""
        drafts, self._drafts = self._drafts, None
        return drafts

    def update_max_model_len(self, max_model_len: int) -> None:
        self.model_config.max_model_len = max_model_len

    def reset_encoder_cache(self) -> None:
        """No encoder: text decoders only."""

    def execute_dummy_batch(self) -> None:
        """vLLM's MoE lockstep step, which afdc's platform turns off (the served program has no
        experts); were it called, it must cost no FFN work and enter no FFN batch, so it does nothing."""

    def shutdown(self) -> None:
        self._stop.set()
        self._stop_logging.set()
        with self._step_lock:
            self.attention.close()


@dataclass
class _Batch:
    """The one thing vLLM's grammar-bitmask helper reads of a model runner's batch."""

    req_ids: list[str]
