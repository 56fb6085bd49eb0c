"""A deployment's FFN ranks as local processes, for ``dm.launch()``.

The launcher hosts the rendezvous store (on a free local port unless told otherwise), makes a
fresh deployment token unless one is given, and starts one FFN server process per FFN rank:
as the model's ``ffn_source`` makes it (an artifact's loader reads the files), otherwise from the
in-memory FFN programs (their weights travel through shared memory, not copies).

Each server's stderr comes through a pipe that a thread of the launcher relays to the launcher's
own stderr, keeping its last lines. When a server exits (other than by :meth:`LocalCluster.stop`),
that thread records the exit code and those lines in the store (:meth:`Rendezvous.record_exit`):
an attention rank waiting for the rank to join raises :class:`JoinError` with them at once, not
after ``join_timeout``.
"""

from __future__ import annotations

import collections
import json
import logging
import multiprocessing as mp
import multiprocessing.connection
import os
import secrets
import select
import signal
import sys
import threading
from collections.abc import Callable
from dataclasses import replace
from typing import NoReturn

import torch

from afdc.errors import AfdcError
from afdc.runtime.options import RuntimeOptions, share_of_cores
from afdc.runtime.programs import FFNProgram
from afdc.runtime.rendezvous import Layout, Rendezvous, free_port, read_key
from afdc.runtime.server import serve_program

log = logging.getLogger("afdc.launch")
_TAIL_LINES = 20  # the last lines of a server's stderr that its exit report quotes
_REDIRECTING = threading.Lock()  # held while this process's fd 2 is a starting server's pipe


def serve_loaded(
    source: Callable[[int], FFNProgram], rank: int, layout: Layout, deployment: bytes, options: RuntimeOptions
) -> NoReturn:
    """Run FFN rank ``rank``, as ``source`` makes it in this process, until stopped."""
    serve_program(source(rank), layout, deployment, options)


def _refuse_while_bootstrapping() -> None:
    """The spawn start method runs the main script again in each server process before the
    server's own code: a script that launches at import time would launch from every server."""
    if getattr(mp.current_process(), "_inheriting", False):  # what multiprocessing itself checks
        raise AfdcError(
            "dm.launch() ran while this process was starting as an FFN server: the spawn start method "
            "runs the main script again in each server process, so the script must launch under "
            "`if __name__ == \"__main__\":` (see 'Safe importing of main module' in Python's "
            "multiprocessing docs)"
        )


def _exit_status(pid: int, code: int | None) -> str:
    how = f"exited with code {code}" if code is not None else "exited"
    if code is not None and code < 0:
        try:
            how = f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            how = f"was killed by signal {-code}"
    return f"its server process (pid {pid}) {how}"


def _quoted(lines: list[str]) -> str:
    return "; the last lines it printed:" + "".join(f"\n    {line}" for line in lines) if lines else ""


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        try:
            view = view[os.write(fd, view):]
        except OSError:  # this process's stderr went away: the lines are still kept
            return


class _StderrRelay:
    """A server's stderr, read from a pipe by a thread of its own from before the server starts:
    copied to this process's stderr as it comes, its last lines kept."""

    def __init__(self, pipe: int, out: int, name: str):
        self.pipe, self.out = pipe, out
        self.tail: collections.deque[str] = collections.deque(maxlen=_TAIL_LINES)
        self.pending = b""
        self.ended = False
        self.lock = threading.Lock()
        os.set_blocking(pipe, False)
        threading.Thread(target=self._run, name=name, daemon=True).start()

    def _run(self) -> None:
        """Relay until the pipe ends (every process holding its write end exited)."""
        while not self.ended:
            select.select([self.pipe], [], [])
            with self.lock:
                self._drain()
        os.close(self.pipe)
        os.close(self.out)

    def _drain(self) -> None:
        """Relay what the pipe holds now (under ``lock``)."""
        while not self.ended:
            try:
                data = os.read(self.pipe, 1 << 16)
            except BlockingIOError:
                return
            if not data:
                self.ended = True
                return
            _write_all(self.out, data)
            *lines, self.pending = (self.pending + data).split(b"\n")
            self.tail.extend(line.decode(errors="replace").rstrip() for line in lines)

    def last_lines(self) -> list[str]:
        """Its last lines; once its process exited, all it wrote before is in the pipe and among them."""
        with self.lock:
            self._drain()
            last = [self.pending.decode(errors="replace").rstrip()] if self.pending.strip() else []
            return [*self.tail, *last][-_TAIL_LINES:]


class LocalCluster:
    """A deployment's FFN servers as processes of this machine; see the module's text."""

    def __init__(self, dm, options: RuntimeOptions):
        _refuse_while_bootstrapping()
        self.dm = dm
        self.layout: Layout = dm.layout
        # this process computes the attention side beside the servers: each gets a share of the cores
        threads = options.threads or share_of_cores(self.layout.ffn_ranks + 1)
        self.options = replace(
            options,
            rendezvous=options.rendezvous or f"127.0.0.1:{free_port()}",
            token=options.token or secrets.token_hex(16),
            threads=threads,
        )
        if torch.get_num_threads() > threads:
            log.warning(
                "this process computes with %d torch threads beside %d FFN server(s) of %d on %d cores: their "
                "thread pools stall each other; torch.set_num_threads(%d) here keeps each process to its share",
                torch.get_num_threads(), self.layout.ffn_ranks, threads, len(os.sched_getaffinity(0)), threads,
            )
        # hosts the store for the deployment's lifetime; the servers and endpoints are its clients
        self.rendezvous = Rendezvous(self.options.rendezvous, self.layout, dm.deployment, self.options.token, host=True)
        self._ctx = mp.get_context("spawn")
        self._lock = threading.Lock()  # orders a server's exit record against its restart and stop()
        self._stopping = False
        self.processes: list[mp.process.BaseProcess | None] = [None] * self.layout.ffn_ranks
        try:
            for rank in range(self.layout.ffn_ranks):
                self.start(rank)
        except BaseException:
            self.stop()
            raise

    def start(self, rank: int) -> None:
        """Start (or restart) FFN rank ``rank``; the attention side regroups with it at its next step."""
        if self.dm.ffn_source is not None:
            target, args = serve_loaded, (self.dm.ffn_source, rank, self.layout, self.dm.deployment, self.options)
        else:
            target, args = serve_program, (self.dm.ffn_ranks[rank], self.layout, self.dm.deployment, self.options)
        proc = self._ctx.Process(target=target, args=args, name=f"afdc-ffn-{rank}", daemon=True)
        with self._lock:  # the watcher reaps a process that exits under it: poll it here the same way
            old = self.processes[rank]
            if old is not None and old.is_alive():
                raise RuntimeError(f"FFN rank {rank} is still running (pid {old.pid}); kill it first")
            self.rendezvous.clear_exit(self.layout.slot("ffn", rank))
            self.processes[rank] = proc
        relay = self._spawn(proc, f"afdc-ffn-{rank}-stderr")
        watch = threading.Thread(target=self._watch, args=(rank, proc, relay), name=f"afdc-ffn-{rank}-watch")
        watch.daemon = True
        watch.start()

    @staticmethod
    def _spawn(proc: mp.process.BaseProcess, name: str) -> _StderrRelay | None:
        """Start ``proc`` with its stderr on a new pipe that this process relays (None where this
        process has no stderr to relay it to)."""
        try:
            out = os.dup(2)
        except OSError:
            proc.start()
            return None
        read, write = os.pipe()
        relay = _StderrRelay(read, out, name)  # reads already: a server dying as it starts is heard
        with _REDIRECTING:  # the child inherits fd 2 as it is while it is spawned
            if sys.stderr is not None:
                sys.stderr.flush()
            os.dup2(write, 2)
            try:
                proc.start()
            finally:
                if sys.stderr is not None:
                    sys.stderr.flush()
                os.dup2(out, 2)
                os.close(write)
        return relay

    def _watch(self, rank: int, proc: mp.process.BaseProcess, relay: _StderrRelay | None) -> None:
        """When ``proc`` exits, record how in the store (unless it was stopped or replaced), with
        the last lines it printed."""
        multiprocessing.connection.wait([proc.sentinel])
        lines = relay.last_lines() if relay is not None else []
        with self._lock:
            if self.processes[rank] is proc and not self._stopping:
                proc.join()
                status = _exit_status(proc.pid, proc.exitcode)
                log.warning("FFN rank %d: %s", rank, status)
                self.rendezvous.record_exit(self.layout.slot("ffn", rank), proc.pid, status + _quoted(lines))

    def kill(self, rank: int) -> None:
        """SIGKILL FFN rank ``rank`` (for fault drills)."""
        proc = self.processes[rank]
        if proc is not None:
            with self._lock:  # one thread reaps it (two waitpid calls race)
                proc.kill()
                proc.join()

    def metrics(self) -> dict[int, dict]:
        """The FFN servers' last published metrics, by FFN rank."""
        out = {}
        for rank in range(self.layout.ffn_ranks):
            raw = read_key(self.rendezvous.store, f"metrics/ffn/{rank}")
            if raw is not None:
                out[rank] = json.loads(raw)
        return out

    def stop(self, timeout: float | None = None) -> None:
        """SIGTERM every server (they drain and exit); SIGKILL what is still up after ``timeout``."""
        timeout = self.options.timeout if timeout is None else timeout
        with self._lock:
            self._stopping = True
        live = [p for p in self.processes if p is not None and p.is_alive()]
        for proc in live:
            proc.terminate()
        for proc in live:
            proc.join(timeout)
            if proc.is_alive():
                log.warning("FFN server pid %d did not stop within %g s; killing it", proc.pid, timeout)
                proc.kill()
                proc.join()
