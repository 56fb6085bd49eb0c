"""Checking a disaggregated model against the monolith it came from."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from afdc.runtime.model import DisaggregatedModel


@dataclass
class Equivalence:
    max_abs_diff: float  # over non-padding positions
    max_rel_diff: float  # max_abs_diff / max |reference logit|
    greedy_equal: bool
    new_tokens: int

    def ok(self, rtol: float = 1e-4) -> bool:
        return self.max_rel_diff <= rtol and self.greedy_equal

    def __str__(self) -> str:
        verdict = "OK" if self.ok() else "MISMATCH"
        return (
            f"equivalence {verdict}: logits max |diff| {self.max_abs_diff:.2e} "
            f"(relative {self.max_rel_diff:.2e}) at non-padding positions; "
            f"greedy {self.new_tokens}-token generation {'identical' if self.greedy_equal else 'DIFFERENT'}"
        )


@torch.no_grad()
def check(
    model: PreTrainedModel, dm: DisaggregatedModel, ids: torch.Tensor, mask: torch.Tensor, new_tokens: int = 16
) -> Equivalence:
    ref = model(input_ids=ids, attention_mask=mask).logits
    out = dm(input_ids=ids, attention_mask=mask).logits
    valid = mask.bool()
    diff = (ref - out).abs()[valid].max().item()
    scale = ref.abs()[valid].max().item()
    g_ref = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False)
    g_out = dm.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False)
    same = g_ref.shape == g_out.shape and bool((g_ref == g_out).all())
    return Equivalence(diff, diff / max(scale, 1e-30), same, new_tokens)
