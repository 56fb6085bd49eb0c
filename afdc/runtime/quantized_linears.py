"""A stateful mixer's linears on weights the checkpoint stores quantized, run by afdc's quantized ops.

A mixer runs its module's own code (:mod:`afdc.runtime.mixer_modules`); where that code calls an
``nn.Linear`` whose weight the checkpoint stores quantized (DeepSeek-V4's attention projections,
fp8 in blocks), the op passes the stored data and scales (:mod:`afdc.lowering.quantized`) and the
site names the linear and the op (:class:`afdc.mixer_site.QuantizedLinear`). The module rebuilt from
the config has a bf16 ``nn.Linear`` there, which would multiply by the stored bytes as if they
were values: it is swapped for an :class:`OpLinear`, which holds the stored tensors as its
parameters and calls the op the attention program calls for the same weight outside a mixer (the
Triton kernel on a GPU, the format's reference elsewhere).
"""

from __future__ import annotations

import torch
from torch import nn

from afdc.codegen.fp8_linear import Fp8LinearCall
from afdc.codegen.packed_linear import PackedLinearCall
from afdc.errors import AfdcError, UnsupportedModelError
from afdc.mixer_site import QuantizedLinear

# the ops a site may name (read from an artifact: nothing else is looked up)
_OPS = {call.OP._schema.name.split("::")[1]: call.OP for call in (Fp8LinearCall, PackedLinearCall)}
_GIVEN = ("x", "bias")  # the op's arguments the linear's own call supplies


class OpLinear(nn.Linear):
    """``linear`` with its weight as stored: ``spec``'s op over the tensors the mixer's op passes."""

    def __init__(self, linear: nn.Linear, spec: QuantizedLinear):
        with torch.device("meta"):  # the mixer's op passes every tensor (functional_call)
            super().__init__(linear.in_features, linear.out_features, bias=linear.bias is not None)
        self.op = _checked_op(spec)
        self.tensors = dict(spec.tensors)
        self.constants = dict(spec.constants)
        for name in self.tensors.values():
            if name != "weight":
                self.register_parameter(name, nn.Parameter(torch.empty(0, device="meta"), requires_grad=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tensors = {arg: getattr(self, name) for arg, name in self.tensors.items()}
        return self.op(x, **tensors, **self.constants, bias=self.bias)


def quantized_linear(module: nn.Module, spec: QuantizedLinear) -> nn.Linear:
    """The linear ``spec`` names in ``module``; refused where the module's code would not call it as
    a linear (a subclass of ``nn.Linear`` with a forward of its own reads the weight itself)."""
    try:
        linear = module.get_submodule(spec.module)
    except AttributeError as err:
        raise AfdcError(f"{type(module).__name__} has no linear {spec.module!r} for its quantized weight") from err
    if not isinstance(linear, nn.Linear) or type(linear).forward is not nn.Linear.forward:
        raise UnsupportedModelError(
            f"{type(module).__name__}.{spec.module} ({type(linear).__name__}) reads its weight in code of its own, "
            "not as nn.Linear does: afdc cannot run it on the weight as stored quantized; use the model's bf16 "
            "checkpoint"
        )
    return linear


def with_quantized_linears(module: nn.Module, specs: tuple[QuantizedLinear, ...]) -> nn.Module:
    """``module`` with each linear ``specs`` names swapped for its :class:`OpLinear` (in place)."""
    for spec in specs:
        module.set_submodule(spec.module, OpLinear(quantized_linear(module, spec), spec))
    return module


def _checked_op(spec: QuantizedLinear) -> torch._ops.OpOverload:
    op = _OPS.get(spec.op)
    if op is None:
        raise AfdcError(f"{spec.module}: {spec.op!r} is not a quantized linear op ({', '.join(_OPS)})")
    names = {a.name for a in op._schema.arguments} - set(_GIVEN)
    given = [arg for arg, _ in (*spec.tensors, *spec.constants)]
    unknown = [arg for arg in given if arg not in names]
    if unknown or len(set(given)) != len(given) or dict(spec.tensors).get("weight") != "weight":
        raise AfdcError(f"{spec.module}: {spec.op} takes {', '.join(sorted(names))} (weight as the linear's "
                        f"weight), not {', '.join(given)}")
    if not all(name.isidentifier() and name != "bias" for _, name in spec.tensors):
        raise AfdcError(f"{spec.module}: {[n for _, n in spec.tensors]} are not names of a linear's tensors")
    if not all(isinstance(v, (bool, int, str)) for _, v in spec.constants):
        raise AfdcError(f"{spec.module}: {spec.op}'s constants {dict(spec.constants)} are not numbers or names")
    return op
