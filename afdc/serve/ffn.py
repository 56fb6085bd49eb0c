"""An FFN rank of a compiled artifact as a server process (``afdc serve --role ffn``)."""

from __future__ import annotations

from pathlib import Path
from typing import NoReturn

from afdc.artifact.load import deployment_of, load
from afdc.runtime.options import RuntimeOptions
from afdc.runtime.server import serve_program


def serve_ffn_rank(
    directory: str | Path, rank: int, options: RuntimeOptions, device: str = "cpu", backend: str | None = None
) -> NoReturn:
    """Run FFN rank ``rank`` of a compiled artifact until stopped."""
    layout, deployment = deployment_of(directory)
    serve_program(load(directory, "ffn", rank, device, backend), layout, deployment, options)
