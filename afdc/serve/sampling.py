"""Sampling for the afdc worker: vLLM's own sampler and logits processors, over one step's requests.

vLLM's :class:`~vllm.v1.sample.sampler.Sampler` does greedy, temperature, top-k/top-p, seeded
generators, penalties, allowed and bad words and logprobs; its built-in logits processors
(``min_p``, ``logit_bias``, ``min_tokens``) and any custom ones configured on the server are
kept in step with the batch through vLLM's ``BatchUpdate`` protocol. This module only builds the
:class:`~vllm.v1.sample.metadata.SamplingMetadata` from the requests' ``SamplingParams``, which
vLLM's persistent input batch would otherwise do. What the worker cannot apply is refused up
front with a 400 rather than silently ignored.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from vllm.exceptions import VLLMValidationError
from vllm.sampling_params import SamplingParams, SamplingType
from vllm.v1.outputs import SamplerOutput
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessors, build_logitsprocs
from vllm.v1.sample.metadata import SamplingMetadata
from vllm.v1.sample.sampler import Sampler

# SamplingParams field -> its "off" value; afdc's worker does not apply these yet
_UNSUPPORTED = {"thinking_token_budget": None}


def refuse_unsupported(params) -> None:
    """Raise vLLM's validation error (an HTTP 400) for what the worker cannot apply."""
    if not isinstance(params, SamplingParams):
        raise VLLMValidationError("afdc serves text generation only (no pooling or embedding requests)")
    used = [name for name, off in _UNSUPPORTED.items() if getattr(params, name, off) not in (off, [], {})]
    if used:
        raise VLLMValidationError(
            f"afdc's vLLM worker does not support {', '.join(used)} yet; leave them unset", parameter=used[0]
        )
    if params.prompt_logprobs is not None and params.skip_reading_prefix_cache is False:
        raise VLLMValidationError(
            "prompt_logprobs with skip_reading_prefix_cache=False: the cached prefix's positions run in no step, so "
            "their logprobs would not be computed; leave skip_reading_prefix_cache unset",
            parameter="skip_reading_prefix_cache",
        )


@dataclass
class SamplingRequest:
    """What the sampler needs of one request."""

    params: SamplingParams
    prompt: list[int]
    output: list[int]  # sampled so far (a live list)
    generator: torch.Generator | None


def new_generator(params: SamplingParams, device: torch.device) -> torch.Generator | None:
    if params.sampling_type != SamplingType.RANDOM_SEED:
        return None
    return torch.Generator(device=device).manual_seed(params.seed)


class StepSampler:
    """Samples one token per request of a step, rows in the order the requests are given."""

    def __init__(self, vllm_config, device: torch.device):
        self.device = device
        self.sampler = Sampler(logprobs_mode=vllm_config.model_config.logprobs_mode)
        self.logitsprocs = build_logitsprocs(
            vllm_config, device, False, False, vllm_config.model_config.logits_processors or ()
        )
        self._rows = 0  # rows of the previous step, as the logits processors hold them

    def __call__(self, logits: torch.Tensor, requests: list[SamplingRequest]) -> SamplerOutput:
        return self.sampler(logits, self.metadata(requests, logits.shape[-1]))

    def metadata(self, requests: list[SamplingRequest], vocab: int) -> SamplingMetadata:
        """The step's sampling metadata, the logits processors brought up to its requests."""
        # every row is (re)added at its index each step and the rows past this step's are removed:
        # the processors keep no state that the params and the live output lists do not give back
        update = BatchUpdate(
            batch_size=len(requests),
            removed=list(range(len(requests), self._rows)),
            added=[(i, r.params, r.prompt, r.output) for i, r in enumerate(requests)],
            moved=[],
        )
        for processor in self.logitsprocs.all:
            processor.update_state(update)
        self._rows = len(requests)
        return sampling_metadata(requests, vocab, self.device, self.logitsprocs)


def sampling_metadata(
    requests: list[SamplingRequest], vocab: int, device: torch.device, logitsprocs: LogitsProcessors
) -> SamplingMetadata:
    """Metadata for sampling one token per request, rows in ``requests`` order."""
    params = [r.params for r in requests]
    greedy = [p.sampling_type == SamplingType.GREEDY for p in params]
    penalties = [p.frequency_penalty != 0 or p.presence_penalty != 0 or p.repetition_penalty != 1 for p in params]
    top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    logprobs = [vocab if p.logprobs == -1 else p.logprobs for p in params if p.logprobs is not None]

    def tensor(values, dtype=torch.float32):
        return torch.tensor(values, dtype=dtype, device=device)

    allowed = None
    if any(p.allowed_token_ids for p in params):
        allowed = torch.zeros(len(params), vocab, dtype=torch.bool, device=device)  # True: not allowed
        for i, p in enumerate(params):
            if p.allowed_token_ids:
                allowed[i] = True
                allowed[i, p.allowed_token_ids] = False
    bad_words = {i: p.bad_words_token_ids for i, p in enumerate(params) if p.bad_words_token_ids}
    prompts = None
    if any(penalties):
        width = max(len(r.prompt) for r in requests)
        # vocab pads, as vLLM does: it is no token id
        prompts = tensor([r.prompt + [vocab] * (width - len(r.prompt)) for r in requests], torch.int64)
    return SamplingMetadata(
        temperature=None if all(greedy) else tensor([0.0 if g else p.temperature for g, p in zip(greedy, params)]),
        all_greedy=all(greedy),
        all_random=not any(greedy),
        top_p=tensor([p.top_p for p in params]) if any(p.top_p < 1 for p in params) else None,
        top_k=tensor(top_k, torch.int32) if any(k < vocab for k in top_k) else None,
        generators={i: r.generator for i, r in enumerate(requests) if r.generator is not None},
        max_num_logprobs=max(logprobs) if logprobs else None,
        no_penalties=not any(penalties),
        prompt_token_ids=prompts,
        frequency_penalties=tensor([p.frequency_penalty for p in params]),
        presence_penalties=tensor([p.presence_penalty for p in params]),
        repetition_penalties=tensor([p.repetition_penalty for p in params]),
        output_token_ids=[r.output for r in requests] if any(penalties) or bad_words else [],
        allowed_token_ids_mask=allowed,
        bad_words_token_ids=bad_words,
        logitsprocs=logitsprocs,
    )
