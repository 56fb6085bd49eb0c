"""afdc: automatic Attention-FFN Disaggregation for Hugging Face decoder models."""

from afdc import equivalence  # afdc.equivalence.check(model, dm, ids, mask), as the README writes it
from afdc.api import disaggregate
from afdc.artifact.load import load, load_deployment
from afdc.compile import compile_model
from afdc.errors import AfdcError, PlanError, UnsupportedModelError
from afdc.plan import Plan
from afdc.runtime.options import RuntimeOptions
from afdc.runtime.rendezvous import JoinError, PeerLost
from afdc.version import __version__

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
