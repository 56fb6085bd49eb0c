"""The disaggregated model: attention programs and FFN programs joined by connectors.

``dm(...)`` is a drop-in for the model's own call (prefill); ``dm.generate`` is greedy decoding
with the KV cache on the attention side. Both run only the programs and the connectors.

The batch's rows are split over the attention ranks, and each rank's rows into micro-batches
that run concurrently: while one micro-batch waits for an FFN layer's result, the next computes
its attention (ping-pong). The FFN side is in-process (loopback) until :meth:`launch` or
:meth:`connect` moves it to FFN servers reached through a transport.
"""

from __future__ import annotations

import contextlib
import enum
import functools
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
import torch.utils._pytree as pytree

from afdc.errors import AfdcError
from afdc.runtime import generation, kv_cache
from afdc.runtime import link as connectors
from afdc.runtime.attention_rank import AttentionRank, MicroBatch, run_concurrently
from afdc.runtime.exchange import AttentionEndpoint
from afdc.runtime.options import RuntimeOptions
from afdc.runtime.programs import AttentionProgram, FFNProgram, device_of
from afdc.runtime.rendezvous import Layout, Rendezvous
from afdc.runtime.tensor_parallel import TensorParallelAttention
from afdc.runtime.transport import ConnectorKind, transport_class


def default_position_ids(input_ids: torch.Tensor, past: int = 0) -> torch.Tensor:
    """What transformers uses when no position ids are given: positions count padding too."""
    b, s = input_ids.shape
    return torch.arange(past, past + s, device=input_ids.device).expand(b, s)


def positions_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that skip left padding, as transformers' ``generate`` computes them."""
    pos = attention_mask.long().cumsum(-1) - 1
    return pos.masked_fill(attention_mask == 0, 1)


class DefaultPositions(enum.Enum):
    """The positions a model's forward uses when it is called without ``position_ids``. The
    captured graph always takes them, so the disaggregated model supplies the model's own."""

    COUNT_PADDING = "count padding"  # transformers' default (cache positions)
    SKIP_PADDING = "skip padding"  # from the attention mask (OPT)
    FROM_PAD_TOKEN = "count from the pad token"  # RoBERTa-style: by token id, pads at the pad id
    OWN = "its own rule"  # none of the above: callers must pass position_ids

    def position_ids(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, pad_token_id: int | None = None
    ) -> torch.Tensor:
        if self is DefaultPositions.COUNT_PADDING:
            return default_position_ids(input_ids)
        if self is DefaultPositions.SKIP_PADDING:
            return positions_from_mask(attention_mask)[:, -input_ids.shape[1] :]
        if self is DefaultPositions.FROM_PAD_TOKEN and pad_token_id is not None:
            real = (input_ids != pad_token_id).long()
            return real.cumsum(-1) * real + pad_token_id
        raise AfdcError(
            "without position_ids this model numbers positions by its own rule (neither counting nor "
            "skipping padding, nor counting from its pad token), which the captured graph does not hold; "
            "pass position_ids"
        )


# Arguments of a transformers forward that do not change the logits.
_IGNORED_KWARGS = {"use_cache", "return_dict"}
_CACHE_KWARGS = ("cache", "past_key_values")  # transformers >= 5.24 names it cache


def _concat(outputs: list):
    """Outputs of the attention ranks, each for its rows of the batch, as one output."""
    if len(outputs) == 1:
        return outputs[0]
    flat = [pytree.tree_flatten(o) for o in outputs]
    by_leaf = zip(*(leaves for leaves, _ in flat))
    leaves = [torch.cat(parts) if isinstance(parts[0], torch.Tensor) else parts[0] for parts in by_leaf]
    return pytree.tree_unflatten(leaves, flat[0][1])


def _split(n: int, parts: int, start: int = 0) -> list[slice]:
    bounds = [start + n * i // parts for i in range(parts + 1)]
    return [slice(bounds[i], bounds[i + 1]) for i in range(parts)]


@dataclass(frozen=True)
class ModelTraits:
    """What a deployment keeps of the model it was split from, so that its calls behave as the
    model's own: the one contract between the two ways of getting one (``afdc.disaggregate``
    and loading an artifact)."""

    incremental: bool  # False: decode recomputes the prefix (see Report.decode_recomputes)
    report: object | None  # afdc.report.Report when split in this process (None: loaded)
    config: object | None = None  # the model's PretrainedConfig, as generate's processors read it
    generation_config: object | None = None  # what the model's own generate decodes with
    max_positions: int | None = None  # the longest key length the captured graph is valid for
    default_positions: DefaultPositions = DefaultPositions.COUNT_PADDING


class DisaggregatedModel:
    """``attention_ranks[i]`` is attention rank i (it runs its share of the batch's rows);
    ``ffn_ranks[j]`` is FFN rank j (each FFN layer's tokens go to the ranks its
    :class:`~afdc.runtime.programs.Dispatch` names and their outputs are combined)."""

    def __init__(
        self,
        *,
        attention: list[AttentionProgram],
        ffn: list[FFNProgram],
        traits: ModelTraits,
        micro_batches: int = 1,
        deployment: bytes = b"",
        ffn_source: Callable[[int], FFNProgram] | None = None,
        connector: ConnectorKind | str = ConnectorKind.GLOO,
    ):
        self.attention_ranks = attention
        self.ffn_ranks = ffn
        self.attention = attention[0]
        self.ffn = ffn[0]
        self.incremental = traits.incremental  # False: decode recomputes the prefix (see Report.decode_recomputes)
        self._report = traits.report
        self.generation_config = traits.generation_config
        self.config = traits.config  # the model's config, as generate's processors read it (None: defaults)
        self.micro_batches = micro_batches
        self.deployment = deployment  # the id every rank of a launched deployment checks
        # how a launched FFN server gets rank r's program (None: this process's, through shared memory)
        self.ffn_source = ffn_source
        self.connector = ConnectorKind.parse(connector)  # what launch() uses unless told otherwise
        self.max_positions = traits.max_positions  # the longest key length the programs are valid for (None: any)
        self.default_positions = traits.default_positions  # used when a call gives no position_ids
        dispatch = [self.ffn.dispatch(layer) for layer in range(len(self.ffn.layers))]
        beside = len(attention) > 1  # the ranks run in threads of this process: none may spin
        self.ranks = [AttentionRank(i, p, ffn, dispatch, beside=beside) for i, p in enumerate(attention)]
        self.last_traffic = connectors.Traffic()
        self._store_host: Rendezvous | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._paged = None  # generate over a paged cache, decode steps at static shapes (use_attention_graphs)

    @property
    def endpoints(self) -> list[AttentionEndpoint] | None:
        """Each attention rank's link to the FFN servers; None while the FFN layers run in-process."""
        if self.ranks[0].endpoint is None:
            return None
        return [r.endpoint for r in self.ranks]

    @property
    def layout(self) -> Layout:
        return Layout(len(self.attention_ranks), len(self.ffn_ranks))

    @property
    def device(self) -> torch.device:
        """Where inputs go: attention rank 0's device (as ``model.device``)."""
        return device_of(self.attention)

    def eval(self) -> DisaggregatedModel:
        """A no-op, as code written for the model calls it: the programs were captured from the
        model in eval mode and only run inference."""
        return self

    def report(self):
        """What was split, what crosses the cut, and how many bytes per token."""
        return self._report

    # -- where the FFN side runs -------------------------------------------------------------

    def connect(self, options: RuntimeOptions, host: bool = False) -> None:
        """Send the FFN layers to FFN servers (``afdc serve --role ffn``) at ``options.rendezvous``.

        ``host``: this process hosts the rendezvous store (as attention rank 0 does when the FFN
        servers were started by hand). Each attention rank gets its own endpoint; they join at the
        first call.
        """
        self.disconnect()
        if options.connector.in_process:
            return
        if host:
            self._store_host = Rendezvous(
                options.rendezvous, self.layout, self.deployment, options.token, host=True,
                connect_timeout=options.join_timeout, insecure_no_token=options.insecure_no_token,
            )
        for r in self.ranks:
            r.endpoint = AttentionEndpoint.connect(
                r.rank, self.layout, self.deployment, options, device=device_of(r.program)
            )
            if isinstance(r.program, TensorParallelAttention):  # TP ranks 1.. wait while rank 0 waits for the FFN side
                r.program.timeout = options.timeout + options.join_timeout

    def disconnect(self) -> None:
        """Leave the deployment; the FFN layers run in-process again. A store this process hosts
        closes: FFN servers wait ``join_timeout`` for one to come back at its address."""
        for r in self.ranks:
            r.close()
        self._store_host = None

    @contextlib.contextmanager
    def launch(self, connector: ConnectorKind | str | None = None, **options) -> Iterator:
        """Start every FFN rank as a local process and run the FFN layers there.

        Yields the :class:`afdc.runtime.local_cluster.LocalCluster` (to watch, kill or restart ranks);
        on exit the servers are stopped and the FFN side is in-process again.
        """
        from afdc.runtime.local_cluster import LocalCluster

        options = RuntimeOptions(connector=connector or self.connector, **options)
        transport_class(options.connector)  # the loopback connector has no processes to launch
        cluster = LocalCluster(self, options)
        try:
            self.connect(cluster.options)
            yield cluster
        finally:
            self.disconnect()
            cluster.stop()

    def metrics(self) -> list[dict]:
        """Per attention rank: exchange latency, bytes, errors (empty when in-process)."""
        return [e.metrics.snapshot() for e in self.endpoints or []]

    # -- running -------------------------------------------------------------------------------

    def _tasks(self, batch: int) -> dict[int, list[tuple[int, slice]]]:
        """Attention rank -> (micro-batch, rows) of its non-empty micro-batches, in row order."""
        tasks: dict[int, list[tuple[int, slice]]] = {}
        for rank, rows in enumerate(_split(batch, len(self.ranks))):
            for mb, sub in enumerate(_split(rows.stop - rows.start, self.micro_batches, rows.start)):
                if sub.stop > sub.start:
                    tasks.setdefault(rank, []).append((mb, sub))
        return tasks

    def _run(self, input_ids, attention_mask, position_ids, caches: dict | None):
        if self.max_positions is not None and attention_mask.shape[1] > self.max_positions:
            raise AfdcError(
                f"{attention_mask.shape[1]} positions (prompt and generated tokens) exceed the "
                f"{self.max_positions} this model's graph was captured for: its forward bounds the length "
                "(a position table or fixed mask buffer of that size); shorten the input"
            )
        def run_rank(rank: int, parts: list[tuple[int, slice]]):
            batches = [
                MicroBatch(
                    input_ids[rows], attention_mask[rows], position_ids[rows],
                    caches[rank, mb] if caches is not None else None,
                )
                for mb, rows in parts
            ]
            attention = self.ranks[rank]
            return attention.run(attention.begin_step(), batches)

        tasks = self._tasks(input_ids.shape[0])
        results, self._pool = run_concurrently(
            self._pool, [functools.partial(run_rank, rank, parts) for rank, parts in tasks.items()]
        )
        self.last_traffic = connectors.Traffic.total([t for _, t in results])
        return _concat([out for outs, _ in results for out in outs])

    def __call__(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        **kwargs,
    ):
        """The model's own call on token ids: the same output object (a tuple under
        ``return_dict=False``). Hidden states, attentions, labels and ``inputs_embeds`` are not
        available: the captured programs compute the logits from token ids."""
        if any(kwargs.get(name) is not None for name in _CACHE_KWARGS):
            raise ValueError("afdc keeps its KV cache on the attention side; use dm.generate for decoding")
        # False, like None, asks for nothing (output_hidden_states=False)
        asked = {k for k, v in kwargs.items() if v is not None and v is not False}
        unsupported = sorted(asked - _IGNORED_KWARGS)
        if input_ids is None or unsupported:
            raise TypeError(
                "the disaggregated model takes input_ids, attention_mask and position_ids"
                + (f"; got {unsupported}" if unsupported else "; input_ids is missing")
                + (" (compute a loss from .logits)" if "labels" in unsupported else "")
            )
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, tokens]; got shape {tuple(input_ids.shape)}")
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        if position_ids is None:
            pad = self.config.get_text_config().pad_token_id if self.config is not None else None
            position_ids = self.default_positions.position_ids(input_ids, attention_mask, pad)
        out = self._run(input_ids, attention_mask, position_ids, None)
        return out.to_tuple() if kwargs.get("return_dict") is False and hasattr(out, "to_tuple") else out

    def forward(self, *args, **kwargs):
        return self(*args, **kwargs)

    def use_attention_graphs(self, largest: int, max_length: int | None = None, block_size: int = 16) -> None:
        """From now on, :meth:`generate` decodes as afdc's vLLM worker steps: over a paged KV cache,
        each micro-batch's decode step padded to a power of two up to ``largest`` rows, on a GPU its
        pieces between two exchanges replayed from CUDA graphs (:mod:`afdc.runtime.paged_generation`);
        for prompts and new tokens of up to ``max_length`` (default: the model's position limit,
        else 4096). ``0`` goes back to the contiguous cache."""
        from afdc.runtime.paged_generation import PagedGeneration

        if largest < 0:
            raise ValueError(f"use_attention_graphs({largest}): the largest bucket is a count of rows, 0 for off")
        for rank in self.ranks:
            rank.decode = None
        longest = max_length or self.max_positions or 4096
        self._paged = PagedGeneration.of(self, largest, block_size, longest) if largest else None

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
        """``model.generate(input_ids, attention_mask=..., **kwargs)``: prompt and new tokens.

        The next token is chosen as transformers' ``generate`` chooses it, by its own logits
        processors and stopping criteria built from the model's generation config and the
        arguments (see :mod:`afdc.runtime.generation`): greedy, or sampling when asked
        (``do_sample``). What it cannot honour (beam search, guidance, dict outputs) it refuses by
        name. The KV cache stays on the attention side; a model captured non-incrementally
        recomputes the prefix each step."""
        rules = generation.decoding(self.config, self.generation_config, input_ids, attention_mask, kwargs)
        attention_mask = rules.attention_mask
        if self._paged is not None:
            return self._paged.generate(self, rules, input_ids, attention_mask)
        tasks = self._tasks(input_ids.shape[0])
        caches = (
            {(rank, mb): kv_cache.KVCache() for rank, parts in tasks.items() for mb, _ in parts}
            if self.incremental
            else None
        )
        tokens, mask = input_ids, attention_mask
        step_ids, step_pos = input_ids, positions_from_mask(mask)
        unfinished = torch.ones(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        while True:  # until the stopping criteria (max_length among them) end every row
            if not self.incremental:
                step_ids, step_pos = tokens, positions_from_mask(mask)
            logits = self._run(step_ids, mask, step_pos, caches).logits[:, -1, :]
            scores = rules.scores(tokens, logits)
            nxt = rules.choose(scores, unfinished)
            tokens = torch.cat([tokens, nxt[:, None]], dim=1)
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            step_ids, step_pos = nxt[:, None], step_pos[:, -1:] + 1
            unfinished = rules.unfinished(tokens, scores, unfinished)
            if not bool(unfinished.any()):
                break
        return tokens
