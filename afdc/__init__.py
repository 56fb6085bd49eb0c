"""afdc: automatic Attention-FFN Disaggregation for Hugging Face decoder models.

The public names are imported at first use (PEP 562): every process a deployment starts imports
this package first, and an FFN server or a vLLM worker need not pay for the compiler and the
equivalence checker (transformers' quantizers, Dynamo) that these names bring in.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from afdc.version import __version__

# public name -> the module that defines it
_EXPORTS = {
    "AfdcError": "afdc.errors",
    "PlanError": "afdc.errors",
    "UnsupportedModelError": "afdc.errors",
    "JoinError": "afdc.runtime.rendezvous",
    "PeerLost": "afdc.runtime.rendezvous",
    "Plan": "afdc.plan",
    "RuntimeOptions": "afdc.runtime.options",
    "compile_model": "afdc.compile",
    "disaggregate": "afdc.api",
    "load": "afdc.artifact.load",
    "load_deployment": "afdc.artifact.load",
}
_SUBMODULES = {"equivalence"}  # afdc.equivalence.check(model, dm, ids, mask), as the README writes it

__all__ = [
    "AfdcError",
    "JoinError",
    "PeerLost",
    "Plan",
    "PlanError",
    "RuntimeOptions",
    "UnsupportedModelError",
    "__version__",
    "compile_model",
    "disaggregate",
    "equivalence",
    "load",
    "load_deployment",
]

if TYPE_CHECKING:
    from afdc import equivalence
    from afdc.api import disaggregate
    from afdc.artifact.load import load, load_deployment
    from afdc.compile import compile_model
    from afdc.errors import AfdcError, PlanError, UnsupportedModelError
    from afdc.plan import Plan
    from afdc.runtime.options import RuntimeOptions
    from afdc.runtime.rendezvous import JoinError, PeerLost


def __getattr__(name: str) -> object:
    if name in _SUBMODULES:
        return importlib.import_module(f"afdc.{name}")
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value  # looked up once
        return value
    raise AttributeError(f"module 'afdc' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
