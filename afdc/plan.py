"""Deployment plans: ``xAyF`` is x attention ranks and y FFN ranks, plus how they split the work."""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

import torch

from afdc.errors import PlanError

_PLAN = re.compile(r"^\s*(\d+)\s*[aA]\s*(\d+)\s*[fF]\s*$")

FFN_PARALLEL = ("auto", "ep", "tp")  # auto: ep for mixture-of-experts models, tp for dense ones
# How the F ranks hold the FFN layers that have no experts (dense layers): "tp" shards their
# weights and every rank sees every token; "replicate" keeps them whole on every rank and gives
# each rank its own share of the tokens (no partial sums: F times less traffic, F times the memory).
DENSE_FFN = ("tp", "replicate")
ROUTERS = ("ffn", "attn")
TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
DTYPES = tuple(TORCH_DTYPES)
_DTYPE_NAMES = {dt: name for name, dt in TORCH_DTYPES.items()}  # dtype=torch.bfloat16 from Python
BACKENDS = ("auto", "afdc", "inductor", "eager")  # afdc.lowering.backends says what each runs


@dataclass(frozen=True)
class Plan:
    attention_ranks: int
    ffn_ranks: int
    ffn_parallel: str = "auto"  # how the FFN ranks split each FFN layer: "ep", "tp" or "auto"
    dense_ffn: str = "tp"  # how the FFN ranks hold dense FFN layers: "tp" or "replicate"
    attention_tp: int = 1  # tensor parallelism inside one attention rank
    router: str = "ffn"  # which side computes the MoE router ("attn" sends top-k ids and weights)
    micro_batches: int = 1  # micro-batches the attention side ping-pongs per step
    dtype: str | None = None  # weights and activations; None keeps the model's own
    backend: str = "auto"  # what runs the programs: afdc's kernels + Inductor, Inductor, eager

    def __post_init__(self) -> None:
        if self.attention_ranks < 1 or self.ffn_ranks < 1:
            raise PlanError(f"plan {self.shape} needs at least one attention and one FFN rank")
        _choice("--ffn-parallel", self.ffn_parallel, FFN_PARALLEL)
        _choice("--router", self.router, ROUTERS)
        _choice("--dense-ffn", self.dense_ffn, DENSE_FFN)
        _choice("--backend", self.backend, BACKENDS)
        if self.dtype is not None:
            object.__setattr__(self, "dtype", _DTYPE_NAMES.get(self.dtype, self.dtype))
            _choice("--dtype", self.dtype, DTYPES)
        if self.micro_batches < 1:
            raise PlanError(f"--micro-batches must be at least 1, got {self.micro_batches}")
        if self.attention_tp < 1:
            raise PlanError(f"--attn-tp (attention_tp) must be at least 1, got {self.attention_tp}")

    @classmethod
    def parse(cls, text: str | Plan, **options) -> Plan:
        """``"2A2F"`` plus keyword options (``ffn_parallel="ep"`` ...); a Plan passes through,
        with the options applied on top."""
        if isinstance(text, Plan):
            return replace(text, **options) if options else text
        m = _PLAN.match(str(text))
        if not m:
            raise PlanError(f"plan {text!r} is not of the form xAyF (e.g. 1A1F, 2A2F, 4A2F)")
        return cls(int(m.group(1)), int(m.group(2)), **options)

    @property
    def shape(self) -> str:
        return f"{self.attention_ranks}A{self.ffn_ranks}F"

    def __str__(self) -> str:
        return self.shape


def _choice(flag: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise PlanError(f"{flag} {value!r} is not one of {', '.join(allowed)}")
