"""The attention server's health gate: an ASGI middleware added to vLLM's OpenAI server.

The worker runs in vLLM's engine-core process (one per attention rank: vLLM's DP ranks) and,
while an FFN rank is lost, keeps retrying its step; it publishes the problem in the
deployment's rendezvous store. This middleware, in
the API-server process, reads it: ``/health`` answers 503 with the problem until the rank is
back, new API requests get a 503 naming it, and requests in flight when it happens are ended
with a 503 (their cancellation aborts them in vLLM's engine). Requests after the recovery are
served as usual.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time

from afdc.serve.settings import WorkerSettings, active

MIDDLEWARE = "afdc.serve.health.HealthGate"


class HealthGate:
    def __init__(self, app, poll: float = 0.25):
        self.app = app
        self.poll = poll
        self.settings = WorkerSettings.from_env() if active() else None
        self._rendezvous = None
        self._problem, self._read_at = "", 0.0

    def _gated(self) -> bool:
        return self.settings is not None and not self.settings.runtime.connector.in_process

    def _read(self) -> str:
        """The first attention rank's problem: vLLM's coordinator may send a request to any DP rank."""
        if self._rendezvous is None:
            self._rendezvous = self.settings.open_rendezvous()
        problems = (self._rendezvous.health("attn", a) for a in range(self._rendezvous.layout.attention_ranks))
        return next((f"attention rank {a}: {p}" for a, p in enumerate(problems) if p), "")

    async def problem(self) -> str:
        """The worker's last reported problem ("" when serving), read at most every ``poll`` s."""
        if time.monotonic() - self._read_at > self.poll:
            try:
                self._problem = await asyncio.to_thread(self._read)
            except Exception as err:  # the store is hosted by attention rank 0: it may be gone
                self._problem = f"the deployment's rendezvous store is unreachable ({err})"
            self._read_at = time.monotonic()
        return self._problem

    async def __call__(self, scope, receive, send):
        path = scope.get("path", "")
        if scope["type"] != "http" or not self._gated() or not (path == "/health" or path.startswith("/v1/")):
            return await self.app(scope, receive, send)
        problem = await self.problem()
        if problem:
            return await _unavailable(send, problem)
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
            problem = await self.problem()
            if problem:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
                if started:  # a stream under way: end it with an error event, as vLLM does
                    event = json.dumps({"error": _error(problem)})
                    await send({"type": "http.response.body", "body": f"data: {event}\n\n".encode()})
                    return None
                return await _unavailable(send, problem)


def _error(problem: str) -> dict:
    return {"message": f"the FFN side of this deployment is unavailable: {problem}",
            "type": "ServiceUnavailableError", "param": None, "code": 503}


async def _unavailable(send, problem: str) -> None:
    body = json.dumps({"error": _error(problem)}).encode()
    await send({"type": "http.response.start", "status": 503,
                "headers": [(b"content-type", b"application/json"), (b"retry-after", b"5")]})
    await send({"type": "http.response.body", "body": body})
