"""What a stateful token mixer call site is: the contract between capture, the artifact and the runtime.

Capture finds the modules whose forward reads or writes the per-layer state of the model's own
cache (a convolution window, an SSM or linear-attention state) and makes each call one
``afdc::mixer`` op; a :class:`MixerSite` says how to run that module again (its path in the model,
the names of the weights the op passes, the arguments its forward takes) and what state it keeps
per sequence, for the report and the manifest.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class StateTensor:
    """One tensor of a mixer's per-sequence state."""

    # "conv.0", "recurrent.0": the kind of state in a transformers cache layer, and its index;
    # "@linear_cache": a per-layer list field of the model's own cache class
    name: str
    shape: tuple[int, ...]  # per sequence (the batch dimension left out)
    dtype: str

    @property
    def bytes(self) -> int:
        return math.prod(self.shape) * getattr(torch, self.dtype).itemsize


@dataclass(frozen=True)
class QuantizedLinear:
    """A linear of a mixer's module whose weight the checkpoint stores quantized: the rebuilt module
    runs one of afdc's quantized linear ops there (the op the attention program runs for the same
    weight outside a mixer), given the stored tensors as parameters of that linear."""

    module: str  # the linear's path in the mixer's module ("q_a_proj")
    op: str  # the op, by its name in ``torch.ops.afdc`` ("fp8_linear", "packed_linear")
    # each tensor argument of the op and the linear's own name of the stored tensor it takes
    # (("weight", "weight"), ("weight_scale", "weight_scale")); the site's weights name them in full
    tensors: tuple[tuple[str, str], ...]
    constants: tuple[tuple[str, bool | int | str], ...] = ()  # the op's other arguments (its block, format)


@dataclass(frozen=True)
class MixerSite:
    """One ``afdc::mixer`` call site (its ``slot``) and the module it runs."""

    slot: int
    module: str  # the module's path in the model
    weights: tuple[str, ...]  # the module's own names of the op's weights, in order
    cache_argument: str  # the forward's argument that takes the model's cache
    mask_argument: str | None  # ... that takes the 2-D padding mask (None: it takes none)
    constants: tuple[tuple[str, bool | int | float | str | None], ...] = ()  # other arguments, as traced
    # the last dim of its first argument, as traced: the model's hidden size for most mixers, not for
    # one that mixes keys or values of another width (Inkling's short convolutions of K and V)
    width: int | None = None
    layer: int | None = None  # the layer of the model's cache that holds its state
    state: tuple[StateTensor, ...] = field(default=())
    # other tensors its forward takes (position ids, RoPE tables, a 4-D attention mask), passed by the
    # op after the weights: each a path "argument" or "argument/key/index" into the argument's
    # nesting of dicts and tuples (DeepSeek-V4's attention takes {"main": (cos, sin), ...})
    inputs: tuple[str, ...] = ()
    linears: tuple[QuantizedLinear, ...] = ()  # its linears on weights the checkpoint stores quantized

    @property
    def fixed_state(self) -> bool:
        """Whether its state is known as fixed-size tensors per sequence (what serving can hold
        in a block per request), found by running it on the hidden states alone. A mixer that
        takes other inputs is an attention of its own (DeepSeek-V4's, with compressors): its keys
        and compressed entries, in its cache layer, grow with the sequence."""
        return not self.inputs

    @property
    def state_bytes(self) -> int:
        """Bytes of state per sequence."""
        return sum(t.bytes for t in self.state)
