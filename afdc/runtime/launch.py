"""A deployment's FFN ranks as local processes, for ``dm.launch()``.

The launcher hosts the rendezvous store (on a free local port unless told otherwise), makes a
fresh deployment token unless one is given, and starts one FFN server process per FFN rank:
as the model's ``ffn_source`` makes it (an artifact's loader reads the files), otherwise from the
in-memory FFN programs (their weights travel through shared memory, not copies).
"""

from __future__ import annotations

import json
import logging
import multiprocessing as mp
import secrets
from collections.abc import Callable
from dataclasses import replace
from typing import NoReturn

from afdc.runtime.options import RuntimeOptions
from afdc.runtime.programs import FFNProgram
from afdc.runtime.rendezvous import Layout, Rendezvous, free_port
from afdc.runtime.server import serve_program

log = logging.getLogger("afdc.launch")


def serve_loaded(
    source: Callable[[int], FFNProgram], rank: int, layout: Layout, deployment: bytes, options: RuntimeOptions
) -> NoReturn:
    """Run FFN rank ``rank``, as ``source`` makes it in this process, until stopped."""
    serve_program(source(rank), layout, deployment, options)


class LocalCluster:
    def __init__(self, dm, options: RuntimeOptions):
        self.dm = dm
        self.layout: Layout = dm.layout
        self.options = replace(
            options,
            rendezvous=options.rendezvous or f"127.0.0.1:{free_port()}",
            token=options.token or secrets.token_hex(16),
        )
        # hosts the store for the deployment's lifetime; the servers and endpoints are its clients
        self.rendezvous = Rendezvous(self.options.rendezvous, self.layout, dm.deployment, self.options.token, host=True)
        self._ctx = mp.get_context("spawn")
        self.processes: list[mp.process.BaseProcess | None] = [None] * self.layout.ffn_ranks
        for rank in range(self.layout.ffn_ranks):
            self.start(rank)

    def start(self, rank: int) -> None:
        """Start (or restart) FFN rank ``rank``; the attention side regroups with it at its next step."""
        old = self.processes[rank]
        if old is not None and old.is_alive():
            raise RuntimeError(f"FFN rank {rank} is still running (pid {old.pid}); kill it first")
        if self.dm.ffn_source is not None:
            target, args = serve_loaded, (self.dm.ffn_source, rank, self.layout, self.dm.deployment, self.options)
        else:
            target, args = serve_program, (self.dm.ffn_ranks[rank], self.layout, self.dm.deployment, self.options)
        proc = self._ctx.Process(target=target, args=args, name=f"afdc-ffn-{rank}", daemon=True)
        proc.start()
        self.processes[rank] = proc

    def kill(self, rank: int) -> None:
        """SIGKILL FFN rank ``rank`` (for fault drills)."""
        proc = self.processes[rank]
        if proc is not None:
            proc.kill()
            proc.join()

    def metrics(self) -> dict[int, dict]:
        """The FFN servers' last published metrics, by FFN rank."""
        out = {}
        for rank in range(self.layout.ffn_ranks):
            key = f"metrics/ffn/{rank}"
            if self.rendezvous.store.check([key]):
                out[rank] = json.loads(self.rendezvous.store.get(key))
        return out

    def stop(self, timeout: float | None = None) -> None:
        """SIGTERM every server (they drain and exit); SIGKILL what is still up after ``timeout``."""
        timeout = self.options.timeout if timeout is None else timeout
        live = [p for p in self.processes if p is not None and p.is_alive()]
        for proc in live:
            proc.terminate()
        for proc in live:
            proc.join(timeout)
            if proc.is_alive():
                log.warning("FFN server pid %d did not stop within %g s; killing it", proc.pid, timeout)
                proc.kill()
                proc.join()
