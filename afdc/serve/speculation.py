"""Speculative decoding in afdc's vLLM worker: n-gram prompt lookup, verified by vLLM's rejection sampler.

Under ``--speculative-config '{"method": "ngram", "num_speculative_tokens": k, ...}'`` the worker
proposes up to ``k`` draft tokens per request after each step with vLLM's own ``NgramProposer``
(the longest n-gram of the request's last tokens found earlier in its context, and what followed
it) and hands them to vLLM's scheduler (``take_draft_token_ids``). The scheduler runs each
decoding request's last token and its drafts in the next step: one pass of the attention program
and one exchange per layer for all ``k + 1`` tokens, whose logits vLLM's ``RejectionSampler``
turns into the drafts the model agrees with plus one token of its own. A greedy request's output
is the same as without speculation, token for token.

What afdc cannot run is refused when the server starts
(:func:`afdc.serve.speculative_config.refusal`), never ignored.

vLLM's rejection sampler runs Triton kernels, which vLLM disables without a GPU. There its greedy
acceptance kernel runs as the torch function below (the same rule: keep drafts while each equals
the target's argmax, then the target's token); requests that sample get no drafts, and a step
that still mixes drafts with them (a sampling request joined the batch) verifies none: each
request samples at its last real token, as without speculation (the same output; its drafts'
positions are recomputed next step).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from vllm.sampling_params import SamplingType
from vllm.triton_utils import HAS_TRITON
from vllm.v1.outputs import DraftTokenIds
from vllm.v1.sample import rejection_sampler
from vllm.v1.sample.metadata import SamplingMetadata
from vllm.v1.sample.rejection_sampler import RejectionSampler
from vllm.v1.sample.sampler import Sampler
from vllm.v1.spec_decode.metadata import SpecDecodeMetadata


def verify_metadata(drafts: list[list[int]], device: torch.device) -> SpecDecodeMetadata:
    """vLLM's :class:`SpecDecodeMetadata` for logits laid out as each request's draft positions
    then its last (bonus) position, request after request (what vLLM's runner computes, from the
    draft counts alone since afdc's step takes those rows only)."""
    counts = np.array([len(d) for d in drafts], dtype=np.int32)
    sampled = counts + 1
    cu_sampled = np.cumsum(sampled, dtype=np.int32)
    starts = cu_sampled - sampled
    target = np.concatenate([start + np.arange(n, dtype=np.int32) for start, n in zip(starts, counts)]
                            or [np.zeros(0, dtype=np.int32)])

    def tensor(values, dtype=torch.int32):
        return torch.as_tensor(np.asarray(values), dtype=dtype, device=device)

    return SpecDecodeMetadata(
        draft_token_ids=tensor([t for d in drafts for t in d]),
        num_draft_tokens=counts.tolist(),
        cu_num_draft_tokens=tensor(np.cumsum(counts, dtype=np.int32)),
        cu_num_sampled_tokens=tensor(cu_sampled),
        target_logits_indices=tensor(target),
        bonus_logits_indices=tensor(cu_sampled - 1),
        logits_indices=tensor(np.arange(cu_sampled[-1] if len(cu_sampled) else 0, dtype=np.int32)),
    )


def _greedy_accept(output_token_ids, cu_num_draft_tokens, draft_token_ids, target_argmax, bonus_token_ids,
                   is_greedy, max_spec_len, uniform_probs, synthetic_conditional_rates) -> None:
    """vLLM's ``rejection_greedy_sample_kernel`` in torch (no synthetic acceptance): per greedy
    request, the target's argmax at each draft position up to the first that differs from its
    draft; all agreeing, then the bonus token."""
    if synthetic_conditional_rates is not None:
        raise ValueError("synthetic acceptance rates need vLLM's Triton kernels (a GPU)")
    ends = cu_num_draft_tokens.tolist()
    for r, end in enumerate(ends):
        if is_greedy is not None and not bool(is_greedy[r]):
            continue
        start = ends[r - 1] if r else 0
        drafts, argmax = draft_token_ids[start:end].long(), target_argmax[start:end]
        wrong = (drafts != argmax).nonzero()
        kept = int(wrong[0]) + 1 if len(wrong) else end - start
        output_token_ids[r, :kept] = argmax[:kept].to(output_token_ids.dtype)
        if not len(wrong):
            output_token_ids[r, kept] = bonus_token_ids.reshape(-1)[r].to(output_token_ids.dtype)


class Verifier:
    """vLLM's rejection sampler over afdc's step logits (see the module's docstring on a CPU)."""

    def __init__(self, sampler: Sampler, spec_config=None, device: torch.device | None = None):
        self.sampler = RejectionSampler(sampler, spec_config, device)
        self.sampled = HAS_TRITON  # whether requests that sample are verified too
        if not HAS_TRITON:  # the one kernel with a torch twin
            rejection_sampler._rejection_greedy_sample = _greedy_accept

    def verifies(self, params: Sequence) -> bool:
        """Whether a step of requests with these ``SamplingParams`` verifies its drafts."""
        return self.sampled or all(p.sampling_type == SamplingType.GREEDY for p in params)

    @staticmethod
    def unverified(logits: torch.Tensor, drafts: list[list[int]]) -> torch.Tensor:
        """Each request's row at its last real token, its drafts' rows dropped."""
        starts = np.cumsum([0] + [len(d) + 1 for d in drafts])[:-1]
        return logits[torch.as_tensor(starts, device=logits.device)]

    def __call__(self, logits: torch.Tensor, drafts: list[list[int]],
                 metadata: SamplingMetadata) -> tuple[list[list[int]], object]:
        """The tokens each request keeps, and their logprobs (vLLM's lists) where asked, from
        ``logits``: per request its draft positions' rows, then its last position's."""
        out = self.sampler(verify_metadata(drafts, logits.device), None, logits, metadata)
        return RejectionSampler.parse_output(out.sampled_token_ids, logits.shape[-1],
                                             logprobs_tensors=out.logprobs_tensors)


class Speculation:
    """One worker's verifier, and its n-gram drafter (``method`` "ngram"; an MTP drafter, "mtp",
    runs programs of the artifact: :mod:`afdc.serve.mtp_drafter`)."""

    def __init__(self, vllm_config, sampler: Sampler, device: torch.device):
        from vllm.v1.spec_decode.ngram_proposer import NgramProposer

        config = vllm_config.speculative_config
        self.method = config.method
        self.k = config.num_speculative_tokens
        self.max_model_len = vllm_config.model_config.max_model_len
        self.proposer = NgramProposer(vllm_config) if self.method == "ngram" else None
        self.verifier = Verifier(sampler, config, device)

    def propose(self, req_ids: list[str], tokens: list[list[int]], sampled: list[list[int]], k: int,
                params: Sequence) -> DraftTokenIds:
        """Up to ``k`` drafts for the next step per request (from its ``tokens``, under its
        ``SamplingParams``): none where this step sampled nothing (a prefill chunk short of its
        prompt), nor for a request that samples where it would not be verified."""
        sampled = [s if self.verifier.verifies([p]) else [] for s, p in zip(sampled, params)]
        context = np.zeros((len(tokens), self.max_model_len), dtype=np.int32)
        for i, t in enumerate(tokens):
            context[i, :len(t)] = t[:self.max_model_len]
        lengths = np.array([len(t) for t in tokens], dtype=np.int32)
        drafts = self.proposer.propose(min(k, self.k), sampled, lengths, context)
        return DraftTokenIds(req_ids, drafts)
