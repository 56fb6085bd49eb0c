"""One OpenAI URL in front of a plan's attention ranks (``afdc up`` with more than one).

Each attention rank is its own vLLM engine with its own KV cache; a request goes to the rank
with the fewest requests in flight, and its response (streamed or not) is passed through
unchanged. ``/health`` is 200 only when every rank's is, otherwise 503 with their answers.

Run:  python -m afdc.serve.router --port 8000 --backend http://127.0.0.1:8001 --backend ...
"""

from __future__ import annotations

import argparse
import asyncio

import aiohttp
from aiohttp import web

# hop-by-hop and length headers that aiohttp recomputes for the forwarded response
_DROP = {"content-length", "transfer-encoding", "connection", "content-encoding", "keep-alive"}


class Router:
    def __init__(self, backends: list[str], timeout: float):
        self.backends = backends
        self.in_flight = dict.fromkeys(backends, 0)
        self.timeout = aiohttp.ClientTimeout(total=None, sock_connect=timeout)
        self.session: aiohttp.ClientSession | None = None

    async def start(self, app: web.Application) -> None:
        self.session = aiohttp.ClientSession(timeout=self.timeout, auto_decompress=False)

    async def close(self, app: web.Application) -> None:
        await self.session.close()

    async def health(self, request: web.Request) -> web.Response:
        async def one(backend: str) -> tuple[int, str]:
            try:
                async with self.session.get(f"{backend}/health") as r:
                    return r.status, (await r.text())[:500]
            except aiohttp.ClientError as err:
                return 503, f"unreachable: {err}"

        answers = await asyncio.gather(*(one(b) for b in self.backends))
        if all(status == 200 for status, _ in answers):
            return web.Response(status=200)
        text = "\n".join(f"attention rank {i}: {s} {body}" for i, (s, body) in enumerate(answers) if s != 200)
        return web.Response(status=503, text=text)

    async def forward(self, request: web.Request) -> web.StreamResponse:
        backend = min(self.backends, key=self.in_flight.__getitem__)
        self.in_flight[backend] += 1
        try:
            headers = {k: v for k, v in request.headers.items() if k.lower() not in _DROP | {"host"}}
            async with self.session.request(
                request.method, backend + request.path_qs, headers=headers, data=await request.read()
            ) as upstream:
                response = web.StreamResponse(
                    status=upstream.status,
                    headers={k: v for k, v in upstream.headers.items() if k.lower() not in _DROP},
                )
                await response.prepare(request)
                async for chunk in upstream.content.iter_any():
                    await response.write(chunk)
                await response.write_eof()
                return response
        except aiohttp.ClientError as err:
            return web.json_response(
                {"error": {"message": f"attention rank at {backend} is unreachable: {err}",
                           "type": "ServiceUnavailableError", "code": 503}},
                status=503,
            )
        finally:
            self.in_flight[backend] -= 1


def app(backends: list[str], timeout: float = 10.0) -> web.Application:
    router = Router(backends, timeout)
    application = web.Application(client_max_size=64 << 20)
    application.on_startup.append(router.start)
    application.on_cleanup.append(router.close)
    application.router.add_get("/health", router.health)
    application.router.add_route("*", "/{tail:.*}", router.forward)
    return application


def main() -> None:
    ap = argparse.ArgumentParser(description="One OpenAI URL in front of afdc attention ranks")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--backend", action="append", required=True, help="an attention rank's URL (repeat)")
    args = ap.parse_args()
    web.run_app(app(args.backend), host=args.host, port=args.port, print=None)


if __name__ == "__main__":
    main()
