"""Prompt logprobs, as vLLM's own GPU model runner computes them.

A request with ``prompt_logprobs = k`` wants, for each prompt token after the first, its
logprob given the tokens before it, its rank, and the top ``k`` tokens there: the logits of
every prompt position but the last, which its prefill steps compute. A chunked prefill
computes them chunk by chunk; they go back to vLLM whole, with the step that ends the prefill
(vLLM's engine returns no partial prefill output), then the request is an ordinary one.

vLLM's scheduler never reads the prefix cache for such a request (``SamplingParams``' default
``skip_reading_prefix_cache``): a cached prefix's positions have no hidden states in any step,
so the prefill recomputes them, and the step that prefills them computes their logprobs.
:func:`afdc.serve.sampling.refuse_unsupported` refuses a request that overrides this.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from vllm.sampling_params import SamplingParams
from vllm.v1.outputs import LogprobsTensors
from vllm.v1.sample.sampler import Sampler


@dataclass
class PromptLogprobs:
    """One request's prompt logprobs while its prefill computes them."""

    top: int  # how many of the most likely tokens each position reports
    targets: torch.Tensor  # the prompt tokens after the first (int64, on the device): what each position predicts
    tensors: LogprobsTensors  # [prompt - 1, top + 1] on the CPU, as vLLM's output processor takes them
    mode: str  # vLLM's logprobs_mode: raw logprobs, or the raw logits
    filled: int = 0  # positions 0 .. filled - 1 are computed

    @classmethod
    def of(cls, params: SamplingParams, prompt: list[int], vocab: int, mode: str,
           device: torch.device) -> PromptLogprobs | None:
        """What ``params`` asks of the prompt ``prompt``; None when it asks none."""
        if params.prompt_logprobs is None:
            return None
        top = vocab if params.prompt_logprobs == -1 else params.prompt_logprobs
        targets = torch.tensor(prompt[1:], dtype=torch.int64, device=device)
        return cls(top, targets, LogprobsTensors.empty_cpu(len(prompt) - 1, top + 1), mode)

    def rows(self, computed: int, scheduled: int) -> int:
        """How many of a step's ``scheduled`` tokens, the first at position ``computed``, predict
        a prompt token: the logit rows the step must compute for them."""
        return max(0, min(scheduled, len(self.targets) - computed))

    def completes(self, computed: int, scheduled: int) -> bool:
        """Whether the step goes past the prompt's last position but one: the prefill's last step,
        whose output returns them. As vLLM's runner does, a step that ends exactly there leaves
        them to the next one (the first with a sampled token to return)."""
        return scheduled > len(self.targets) - computed

    def add(self, logits: torch.Tensor, computed: int) -> None:
        """Positions ``computed ..`` from their logits ``[rows, vocab]``, with vLLM's sampler's
        log-softmax and gather (a prompt token passes no logits processor, so its raw and
        processed scores are the same)."""
        if computed > self.filled:  # vLLM's runner would return uninitialized memory for them
            raise ValueError(f"a step of a request with prompt logprobs starts at position {computed}, past the "
                             f"{self.filled} it computed: the positions between were read from the prefix cache")
        if not len(logits):
            return
        if computed + len(logits) > len(self.targets):
            raise ValueError(f"{len(logits)} prompt logit rows from position {computed} run past the "
                             f"prompt's {len(self.targets)} predicting positions")
        scores = logits.float() if self.mode in ("raw_logits", "processed_logits") else Sampler.compute_logprobs(logits)
        ids, logprobs, ranks, *_ = Sampler.gather_logprobs(
            scores, self.top, self.targets[computed:computed + len(logits)]
        )
        rows = slice(computed, computed + len(logits))
        self.tensors.logprob_token_ids[rows].copy_(ids)
        self.tensors.logprobs[rows].copy_(logprobs)
        self.tensors.selected_token_ranks[rows].copy_(ranks)
        self.filled = max(self.filled, rows.stop)
