"""The attention server's health gate: an ASGI middleware added to vLLM's OpenAI server.

The worker runs in vLLM's engine-core process (one per attention rank: vLLM's DP ranks) and
publishes its health in the deployment's rendezvous store (:class:`Health`). This middleware, in
the API-server process, reads it:

- **degraded** (an FFN rank is lost, and the worker holds its step until the rank is back, up to
  its recovery timeout): requests in flight wait, new ones are taken (they wait too), and
  ``/health`` answers 200 with ``{"status": "degraded", "problem": ...}`` and the header
  ``X-Afdc-Health: degraded``: a probe that reads only the status sees a live server, one
  that reads the body or the header sees the lost rank;
- **unavailable** (past the recovery timeout, or the store unreachable): ``/health`` answers 503
  with the problem, new API requests get a 503 naming it, and requests in flight are ended with
  a 503 (their cancellation aborts them in vLLM's engine).

Requests after the recovery are served as usual.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time

from afdc.runtime.rendezvous import DEGRADED, UNAVAILABLE, Health
from afdc.serve.settings import WorkerSettings, active

MIDDLEWARE = "afdc.serve.health.HealthGate"


class HealthGate:
    def __init__(self, app, poll: float = 0.25):
        self.app = app
        self.poll = poll
        self.settings = WorkerSettings.from_env() if active() else None
        self._rendezvous = None
        self._health, self._read_at = Health(), 0.0

    def _gated(self) -> bool:
        return self.settings is not None and not self.settings.runtime.connector.in_process

    def _read(self) -> Health:
        """The worst health of the attention ranks: vLLM's coordinator may send a request to any DP rank."""
        if self._rendezvous is None:
            self._rendezvous = self.settings.open_rendezvous()
        ranks = [self._rendezvous.health("attn", a) for a in range(self._rendezvous.layout.attention_ranks)]
        for state in (UNAVAILABLE, DEGRADED):
            a = next((a for a, h in enumerate(ranks) if h.state == state), None)
            if a is not None:
                return Health(state, f"attention rank {a}: {ranks[a].problem}")
        return Health()

    async def health(self) -> Health:
        """The attention ranks' health, read at most every ``poll`` s."""
        if time.monotonic() - self._read_at > self.poll:
            try:
                self._health = await asyncio.to_thread(self._read)
            except Exception as err:  # the store is hosted by attention rank 0: it may be gone
                self._health = Health(UNAVAILABLE, f"the deployment's rendezvous store is unreachable ({err})")
            self._read_at = time.monotonic()
        return self._health

    async def __call__(self, scope, receive, send):
        path = scope.get("path", "")
        if scope["type"] != "http" or not self._gated() or not (path == "/health" or path.startswith("/v1/")):
            return await self.app(scope, receive, send)
        health = await self.health()
        if health.state == UNAVAILABLE:
            return await _unavailable(send, health.problem)
        if path == "/health" and health.state == DEGRADED:
            return await _degraded(send, health.problem)
        if scope["method"] != "POST":
            return await self.app(scope, receive, send)

        started = False

        async def tracked(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        task = asyncio.ensure_future(self.app(scope, receive, tracked))
        while True:
            done, _ = await asyncio.wait({task}, timeout=self.poll)
            if done:
                return task.result()
            health = await self.health()
            if health.state == UNAVAILABLE:  # degraded: the step is held, the request waits
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
                if started:  # a stream under way: end it with an error event, as vLLM does
                    event = json.dumps({"error": _error(health.problem)})
                    await send({"type": "http.response.body", "body": f"data: {event}\n\n".encode()})
                    return None
                return await _unavailable(send, health.problem)


def _error(problem: str) -> dict:
    return {"message": f"the FFN side of this deployment is unavailable: {problem}",
            "type": "ServiceUnavailableError", "param": None, "code": 503}


async def _degraded(send, problem: str) -> None:
    body = json.dumps({"status": DEGRADED, "problem": problem}).encode()
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"application/json"), (b"x-afdc-health", DEGRADED.encode())]})
    await send({"type": "http.response.body", "body": body})


async def _unavailable(send, problem: str) -> None:
    body = json.dumps({"error": _error(problem)}).encode()
    await send({"type": "http.response.start", "status": 503,
                "headers": [(b"content-type", b"application/json"), (b"retry-after", b"5")]})
    await send({"type": "http.response.body", "body": body})
