"""Experts modules that loop over the experts hit, captured as transformers' grouped-matmul experts.

transformers' experts contract is a module called as ``experts(hidden [.., H], top_k_index [T, k],
top_k_weights [T, k])`` returning the weighted sum of each token's chosen experts. Most classes
dispatch it through the ``ExpertsInterface`` (``@use_experts_implementation``), whose grouped-matmul
implementation is what capture records and :mod:`afdc.passes.moe_experts` recognises. Some keep
only their own forward, a Python loop over the experts that received tokens (``nonzero``,
``torch.where``): data-dependent control flow that ``torch.export`` cannot trace. Whatever the
loop's Python form, its math is the contract's; capture replaces such a module's forward by the
same grouped-matmul computation over the module's own weights, read in the interface's layout:

- a fused gate/up stack ``gate_up_proj [E', 2I, H]`` and ``down_proj [E, H, I]`` (the interface's
  names); ``E`` is the experts that compute, the down stack's count;
- or three 2-D stacks of ``E`` blocks ``[E·I, H]`` (``E`` the module's ``num_experts``, the
  interface's attribute): gate, up (``x @ W_e^T``) and down (``h @ W_e``), in the order the
  module registers them.

Ids at or past ``E`` name zero-computation experts when the module holds an ``nn.Identity``: they
add ``weight * x`` and do no matmul (their pairs sort past the last expert, so the grouped matmuls
skip them). A stack holding more experts than compute (rows no id reaches through a matmul) is
captured as its first ``E``: what the math reads. On real weights the replacement is checked
against the module's own forward before capture uses it.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
from collections.abc import Iterator
from dataclasses import dataclass, replace

import torch
from transformers import PreTrainedModel
from transformers.integrations.moe import _default_apply_gate, _grouped_linear, grouped_mm_experts_forward

from afdc.errors import UnsupportedModelError
from afdc.segment import RowView

CONTRACT = ("hidden_states", "top_k_index", "top_k_weights")


@dataclass(frozen=True)
class ExpertStacks:
    """An experts module's weights in the interface's layout (views of its own parameters)."""

    experts: int  # the experts that compute; ids from here on are identity experts (if ``identity``)
    gate_up: torch.Tensor | None  # [E, 2I, H] fused, or None: ``gate`` and ``up`` apart
    gate: torch.Tensor | None  # [E, I, H]
    up: torch.Tensor | None  # [E, I, H]
    down: torch.Tensor  # [E, H, I] (``down_input_major``: [E, I, H])
    down_input_major: bool
    identity: bool
    act: torch.nn.Module
    # parameter name -> the view capture exports it as (its leading dim the experts)
    exported: dict[str, torch.Tensor]


def loop_experts(model: PreTrainedModel) -> list[tuple[str, torch.nn.Module]]:
    """The modules of ``model`` that take the experts contract but dispatch no experts interface."""
    found = []
    for path, m in model.named_modules():
        params = list(inspect.signature(type(m).forward).parameters)[1:]
        interfaced = hasattr(m, "is_concatenated")  # set by @use_experts_implementation
        if tuple(params) == CONTRACT and not interfaced:
            found.append((path, m))
    return found


def _activation(module: torch.nn.Module) -> torch.nn.Module | None:
    """The module's activation: the one submodule that is an activation function."""
    acts = [m for _, m in module.named_modules() if type(m).__module__ in _ACTIVATION_MODULES]
    return acts[0] if len(acts) == 1 else None


_ACTIVATION_MODULES = ("transformers.activations", "torch.nn.modules.activation")


def stacks_of(path: str, module: torch.nn.Module) -> ExpertStacks:
    """``module``'s weights in the interface's layout; refuses a layout it does not find."""
    params = dict(module.named_parameters())
    identity = any(isinstance(m, torch.nn.Identity) for m in module.modules())
    act = _activation(module)
    if act is None:
        raise UnsupportedModelError(f"the experts module {path} loops over its experts with no one activation", path)
    fused, down = params.get("gate_up_proj"), params.get("down_proj")
    if fused is not None and down is not None and fused.dim() == down.dim() == 3:
        experts = down.shape[0]
        gate_up = fused[:experts] if fused.shape[0] > experts else fused
        return ExpertStacks(experts, gate_up, None, None, down, False, identity, act,
                            {"gate_up_proj": gate_up, "down_proj": down})
    experts = getattr(module, "num_experts", None)
    flat = [(n, p) for n, p in params.items() if p.dim() == 2]
    if isinstance(experts, int) and len(flat) == len(params) == 3 and len({p.shape for _, p in flat}) == 1:
        rows, hidden = flat[0][1].shape
        if rows % experts == 0:
            views = {n: p.view(experts, rows // experts, hidden) for n, p in flat}
            gate, up, down = views.values()
            return ExpertStacks(experts, None, gate, up, down, True, identity, act, views)
    raise UnsupportedModelError(
        f"the experts module {path} loops over its experts with weights afdc cannot read as stacked experts "
        f"({', '.join(f'{n} {tuple(p.shape)}' for n, p in params.items())}): expected a gate_up_proj [E, 2I, H] "
        "and a down_proj [E, H, I], or three [E*I, H] stacks with num_experts E",
        path,
    )


class _Interface:
    """What transformers' grouped-matmul experts function reads of an experts module."""

    has_gate, has_bias, is_transposed, has_post_expert_norm, _is_expert_parallel = True, False, False, False, False

    def __init__(self, stacks: ExpertStacks):
        self.num_experts = stacks.experts
        self.gate_up_proj, self.down_proj, self.act_fn = stacks.gate_up, stacks.down, stacks.act

    def _apply_gate(self, gate_up: torch.Tensor) -> torch.Tensor:
        return _default_apply_gate(self, gate_up)


def grouped_forward(stacks: ExpertStacks, hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor):
    """The experts contract over ``stacks``, by grouped matmuls (no data-dependent control flow)."""
    x = hidden.reshape(-1, hidden.shape[-1])
    if stacks.gate_up is not None and not stacks.identity:
        out = grouped_mm_experts_forward(_Interface(stacks), x, ids, weights)
    else:
        out = _own_grouped_forward(stacks, x, ids, weights)
    if stacks.identity:  # zero-computation experts: each adds its weight times the token
        picked = (weights * (ids >= stacks.experts)).sum(-1, keepdim=True)
        out = out + (picked * x).to(out.dtype)
    return out.view(hidden.shape)


def _own_grouped_forward(stacks: ExpertStacks, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor):
    """transformers' grouped-matmul experts where its function does not fit: gate and up as two
    stacks, or ids past the last expert (identity experts), whose rows the grouped matmuls leave
    unset and which are zeroed out of place (transformers' in-place masks would make the cut
    split an in-place write, and capture trace the model twice). Sort the (token, choice) pairs
    by expert, grouped matmuls, scale, unsort, sum the choices."""
    k = ids.shape[-1]
    flat_ids, flat_weights = ids.reshape(-1), weights.reshape(-1)
    sorted_ids, perm = torch.sort(flat_ids)
    rows = x[perm // k]
    counts = torch.histc(sorted_ids.float(), bins=stacks.experts, min=0, max=stacks.experts - 1)
    offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
    if stacks.gate_up is not None:
        gate, up = _grouped_linear(rows, stacks.gate_up, offsets).chunk(2, dim=-1)
    else:
        gate, up = _grouped_linear(rows, stacks.gate, offsets), _grouped_linear(rows, stacks.up, offsets)
    h = stacks.act(gate) * up
    out = _grouped_linear(h, stacks.down, offsets, is_transposed=stacks.down_input_major)
    if stacks.identity:
        out = out.masked_fill((sorted_ids >= stacks.experts).unsqueeze(-1), 0.0)
    out = out * flat_weights[perm].unsqueeze(-1)
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(perm.shape[0], device=perm.device)
    return out[inverse].view(x.shape[0], k, x.shape[-1]).sum(dim=1).to(x.dtype)


def check_against_own_forward(path: str, module: torch.nn.Module, stacks: ExpertStacks, hidden_size: int) -> None:
    """The replacement against the module's own forward, every expert (and one identity id) hit."""
    ids = torch.arange(stacks.experts + stacks.identity).repeat_interleave(2).view(-1, 2)
    ids = torch.cat([ids, ids.flip(0)], dim=-1)
    device = stacks.down.device
    ids = ids.to(device)
    x = torch.randn(ids.shape[0], hidden_size, generator=torch.Generator().manual_seed(0)).to(device, stacks.down.dtype)
    weights = torch.rand(ids.shape, generator=torch.Generator().manual_seed(1)).to(device, x.dtype)
    with torch.no_grad():
        want = type(module).forward(module, x, ids, weights).reshape(x.shape)
        got = grouped_forward(stacks, x, ids, weights)
    err, scale = (got - want).abs().max().item(), want.abs().max().item()
    if not err <= 1e-3 * scale + 1e-6:
        raise UnsupportedModelError(
            f"the experts module {path} loops over its experts in a form afdc does not read: its stacked-experts "
            f"reading differs from its own forward by {err:.3g} (max {scale:.3g})",
            path,
        )


@contextlib.contextmanager
def as_grouped_experts(model: PreTrainedModel) -> Iterator[dict[str, RowView]]:
    """Every loop-experts module of ``model`` computed by grouped matmuls while the block runs;
    stacks it holds beyond the experts that compute, or holds flat, exported as their views.
    Yields those views by parameter name, as rows of what the checkpoint stores."""
    hidden_size = model.config.get_text_config().hidden_size
    patched, views = [], {}
    try:
        for path, m in loop_experts(model):
            stacks = stacks_of(path, m)
            if not stacks.down.is_meta:
                check_against_own_forward(path, m, stacks, hidden_size)
            owners = {name: _owner(m, name) for name in stacks.exported}
            saved = {name: getattr(owner, leaf) for name, (owner, leaf) in owners.items()}
            for name, (owner, leaf) in owners.items():
                view = stacks.exported[name]
                setattr(owner, leaf, torch.nn.Parameter(view, requires_grad=False))
                if view.shape != saved[name].shape:
                    rows = view.numel() // math.prod(saved[name].shape[1:])
                    views[f"{path}.{name}" if path else name] = RowView(rows, tuple(view.shape))
            m.forward = functools.partial(_forward_of, m, stacks)
            patched.append((m, owners, saved))
        yield views
    finally:
        for m, owners, saved in patched:
            del m.forward
            for name, (owner, leaf) in owners.items():
                setattr(owner, leaf, saved[name])


def _forward_of(module: torch.nn.Module, stacks: ExpertStacks, hidden, ids, weights):
    """:func:`grouped_forward` over the module's parameters as they are now (the exported views),
    so that export lifts them by name."""
    current = {id(view): module.get_parameter(name) for name, view in stacks.exported.items()}
    resolved = replace(stacks, **{
        f: current.get(id(t), t) for f in ("gate_up", "gate", "up", "down") if (t := getattr(stacks, f)) is not None
    })
    return grouped_forward(resolved, hidden, ids, weights)


def _owner(module: torch.nn.Module, name: str) -> tuple[torch.nn.Module, str]:
    *path, leaf = name.split(".")
    return module.get_submodule(".".join(path)), leaf
