"""What the ``afdc`` backend's passes put into every catalogued model, and that it changes nothing.

For each verified architecture: build it tiny, split it 1A1F, substitute afdc's kernels into the
attention program and the FFN segments (no Inductor, so the kernels alone are what changes), and
compare the logits of a left-padded batch with the monolith's. Kernels run where Triton runs:
set ``TRITON_INTERPRET=1`` on a CPU to run them in Triton's interpreter (about 4 minutes for the
whole catalog on two cores).

    TRITON_INTERPRET=1 python -m models_supported.kernels
"""

from __future__ import annotations

import collections
import time

import torch

import afdc
from afdc.lowering import backends
from afdc.runtime.model import positions_from_mask
from models_supported.catalog import ENTRIES, build

_KERNELS = ("fused_moe", "moe_route", "add_rms_norm", "rms_norm", "add_layer_norm", "layer_norm", "act_mul")


def _kernels(module: torch.fx.GraphModule) -> collections.Counter:
    return collections.Counter(
        n.target._opname for n in module.graph.nodes
        if isinstance(n.target, torch._ops.OpOverload) and n.target.namespace == "afdc"
        and n.target._opname in _KERNELS
    )


def _substituted(module: torch.fx.GraphModule) -> torch.fx.GraphModule:
    module = backends.copy_module(module)
    backends.substitute_kernels(module.graph)
    module.recompile()
    return module


def substitute_eagerly(dm) -> collections.Counter:
    """Put afdc's kernels into every program of ``dm``, run eagerly from the next call; returns
    how many of each kernel the attention program and the first FFN rank's segments hold."""
    found = collections.Counter()
    for attention in dict.fromkeys(dm.attention_ranks):
        attention.module = _substituted(attention.module)
        attention.use_backend("eager")
    found += _kernels(dm.attention_ranks[0].module)
    for rank, program in enumerate(dm.ffn_ranks):
        for i, segment in enumerate(program.segments):
            program.segments[i] = _substituted(segment)
            if rank == 0:
                found += _kernels(program.segments[i])
        program.use_backend("eager")
    return found


@torch.no_grad()
def check(entry) -> tuple[collections.Counter, float]:
    """The kernels put into ``entry``'s tiny model and the largest logit error relative to the
    monolith's largest logit."""
    model = build(entry)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, model.config.get_text_config().vocab_size, (3, 7), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    pos = positions_from_mask(mask)
    ref = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits[mask.bool()]
    dm = afdc.disaggregate(model, "1A1F")
    found = substitute_eagerly(dm)
    got = dm(ids, attention_mask=mask, position_ids=pos).logits[mask.bool()]
    return found, ((got - ref).abs().max() / ref.abs().max()).item()


def main() -> None:
    print("| Architecture | `model_type` | afdc kernels | relative logit error |")
    print("|---|---|---|---|")
    worst, start = 0.0, time.time()
    for entry in ENTRIES:
        found, err = check(entry)
        worst = max(worst, err)
        kernels = ", ".join(f"{k} x{found[k]}" for k in _KERNELS if found[k]) or "none"
        print(f"| {entry.name} | `{entry.model_type}` | {kernels} | {err:.1e} |", flush=True)
    print(f"\n{len(ENTRIES)} architectures, worst relative error {worst:.1e}, {time.time() - start:.0f} s")


if __name__ == "__main__":
    main()
