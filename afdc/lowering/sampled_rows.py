"""Run the LM head on the sampled rows only.

A serving step samples one token per request, at its last scheduled token; the captured program
computes logits for every token of the step, so a long prefill pays the LM head (the widest
matmul of the model) and a ``[T, vocab]`` tensor for logits it throws away. This pass puts
``afdc::sampled_rows`` in front of the LM head: it keeps the rows the active step names
(``PagedBatch.logit_rows``) and passes everything through otherwise.

A program without an LM head that :func:`afdc.lowering.lm_head.lm_head` finds is left unchanged.
"""

from __future__ import annotations

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from afdc.lowering.lm_head import lm_head


def sample_rows_only(module: fx.GraphModule, out_spec: pytree.TreeSpec) -> bool:
    """Insert ``afdc::sampled_rows`` before ``module``'s LM head; False when none was found."""
    head = lm_head(module.graph, out_spec)
    if head is None:
        return False
    hidden = head.args[0]
    with module.graph.inserting_before(head):
        rows = module.graph.call_function(torch.ops.afdc.sampled_rows.default, (hidden,))
    head.replace_input_with(hidden, rows)
    module.recompile()
    return True
