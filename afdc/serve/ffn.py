"""An FFN rank of a compiled artifact as a server process (``afdc serve --role ffn``)."""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path
from typing import NoReturn

from afdc.artifact.load import deployment_of, load
from afdc.runtime.options import RuntimeOptions
from afdc.runtime.server import serve_program, serve_spare
from afdc.serve.cores import Placement, pin_thread


def serve_ffn_rank(
    directory: str | Path, rank: int, options: RuntimeOptions, device: str = "cpu", backend: str | None = None,
    cpus: Collection[int] | None = None, pin_tokens: int = 0,
) -> NoReturn:
    """Run FFN rank ``rank`` of a compiled artifact until stopped, on ``cpus`` if given: every
    thread of the server (they start after this), or with ``pin_tokens`` the serving thread
    while the attention ranks' steps hold that many tokens or more (:class:`Placement`)."""
    on_step = None
    if cpus and pin_tokens:
        on_step = Placement(cpus, pin_tokens, f"ffn rank {rank}").step
    elif cpus:
        pin_thread(cpus)
    layout, deployment = deployment_of(directory)
    try:
        program = load(directory, "ffn", rank, device, backend)
    except KeyboardInterrupt:  # Ctrl-C reaches every process of the terminal's group: said, not a trace
        raise SystemExit(f"ffn rank {rank}: stopped while loading (asked for by SIGINT)") from None
    serve_program(program, layout, deployment, options, on_step)


def serve_ffn_spare(directory: str | Path, options: RuntimeOptions, device: str = "cpu",
                    backend: str | None = None) -> NoReturn:
    """Wait as a hot spare of a compiled artifact's FFN ranks; serve the first one lost (:mod:`afdc.runtime.spare`)."""
    layout, deployment = deployment_of(directory)
    serve_spare(lambda rank: load(directory, "ffn", rank, device, backend), layout, deployment, options)
