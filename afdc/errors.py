"""Errors afdc raises on purpose: each names the problem and what to do about it."""


class AfdcError(Exception):
    """Base class of every error afdc raises deliberately."""


class UnsupportedModelError(AfdcError):
    """The model cannot be split into an attention and an FFN program.

    ``layer`` names the layer (as in the model's module tree) where that was found, when known.
    """

    def __init__(self, reason: str, layer: str | None = None):
        self.layer = layer
        self.reason = reason
        where = f"{layer}: " if layer else ""
        super().__init__(f"{where}{reason}")


class PlanError(AfdcError, ValueError):
    """A deployment plan string or option is malformed or does not fit the model."""
