"""Gated activation ``act(gate) * up`` of gated MLPs: Triton kernel, PyTorch reference, custom op.

``gate`` and ``up`` are often the two halves of one fused gate-up projection (``torch.chunk``
views with a row stride twice their width), so the kernel takes a row stride for each and reads
them in place instead of copying. It computes in fp32 and rounds once, where the eager
``F.silu(gate) * up`` rounds the activation to the input dtype first: in bf16 the two differ by
about one ulp.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from afdc.codegen.rms_norm import as_rows
from afdc.codegen.triton_support import jit, launches, next_power_of_2, tl

ACTIVATIONS = ("silu", "gelu", "gelu_tanh")

# Columns per program: the op is elementwise, so a row is split over programs rather than held
# whole, which keeps wide intermediate sizes (tens of thousands of columns) cheap in registers.
_BLOCK = 1024


def _check(gate: torch.Tensor, up: torch.Tensor, activation: str) -> None:
    if activation not in ACTIVATIONS:
        raise ValueError(f"act_mul: unknown activation {activation!r}; expected one of {', '.join(ACTIVATIONS)}")
    if gate.shape != up.shape:
        raise ValueError(f"act_mul: gate {tuple(gate.shape)} and up {tuple(up.shape)} differ in shape")


def act_mul_reference(gate: torch.Tensor, up: torch.Tensor, activation: str) -> torch.Tensor:
    _check(gate, up, activation)
    if activation == "silu":
        return F.silu(gate) * up
    if activation == "gelu":
        return F.gelu(gate) * up
    return F.gelu(gate, approximate="tanh") * up


def _act_mul_kernel(
    gate_ptr,
    up_ptr,
    out_ptr,
    gate_row_stride,
    up_row_stride,
    n_cols,
    ACTIVATION: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    g = tl.load(gate_ptr + row * gate_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + row * up_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    if ACTIVATION == "silu":
        a = g * tl.sigmoid(g)
    elif ACTIVATION == "gelu":
        a = 0.5 * g * (1.0 + tl.math.erf(g * 0.7071067811865476))  # 1/sqrt(2)
    else:
        # 0.5 * (1 + tanh(z)) == sigmoid(2z): the tanh form without a tanh, and without the
        # cancellation of computing tanh as 2 * sigmoid(2z) - 1. 1.5957... is 2 * sqrt(2/pi).
        a = g * tl.sigmoid(1.5957691216057308 * (g + 0.044715 * g * g * g))
    tl.store(out_ptr + row * n_cols + cols, (a * u).to(out_ptr.dtype.element_ty), mask=mask)


def act_mul_triton(gate: torch.Tensor, up: torch.Tensor, activation: str) -> torch.Tensor:
    _check(gate, up, activation)
    out = torch.empty(gate.shape, dtype=torch.result_type(gate, up), device=gate.device)
    if out.numel() == 0:
        return out
    g2, u2 = as_rows(gate), as_rows(up)
    width = g2.shape[1]
    block = min(next_power_of_2(width), _BLOCK)
    grid = (g2.shape[0], (width + block - 1) // block)
    jit(_act_mul_kernel)[grid](g2, u2, out, g2.stride(0), u2.stride(0), width, ACTIVATION=activation, BLOCK=block)
    return out


@torch.library.custom_op("afdc::act_mul", mutates_args=())
def act_mul(gate: torch.Tensor, up: torch.Tensor, activation: str) -> torch.Tensor:
    """``act(gate) * up`` for ``activation`` in :data:`ACTIVATIONS` (``gelu``: exact erf form)."""
    if launches(gate, up):
        return act_mul_triton(gate, up, activation)
    return act_mul_reference(gate, up, activation)


@act_mul.register_fake
def _(gate, up, activation):
    _check(gate, up, activation)
    return gate.new_empty(gate.shape, dtype=torch.result_type(gate, up))
