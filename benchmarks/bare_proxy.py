#!/usr/bin/env python3
"""The baseline every per-request figure is a ratio to: a bare aiohttp pass-through proxy.

    python benchmarks/bare_proxy.py --port 8090 --upstream http://127.0.0.1:9000

One long-lived ClientSession, the request body forwarded whole, the response streamed back
chunk by chunk as it arrives. No auth, no metering, no budgets, no logging: what any aiohttp
proxy costs at least.
"""

from __future__ import annotations

import argparse
from collections.abc import AsyncIterator

from aiohttp import ClientSession, ClientTimeout, TCPConnector, web

HOP = {"host", "content-length", "transfer-encoding", "connection", "keep-alive"}
SESSION = web.AppKey("session", ClientSession)


async def handle(request: web.Request) -> web.StreamResponse:
    session = request.app[SESSION]
    headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP}
    body = await request.read()
    async with session.request(request.method, request.app[UPSTREAM] + request.path_qs,
                               data=body, headers=headers) as upstream:
        response = web.StreamResponse(status=upstream.status, headers={
            k: v for k, v in upstream.headers.items() if k.lower() not in HOP})
        await response.prepare(request)
        async for chunk in upstream.content.iter_any():
            await response.write(chunk)
        await response.write_eof()
        return response


UPSTREAM = web.AppKey("upstream", str)


async def session_ctx(app: web.Application) -> AsyncIterator[None]:
    app[SESSION] = ClientSession(connector=TCPConnector(limit=0),
                                 timeout=ClientTimeout(total=None), auto_decompress=False)
    yield
    await app[SESSION].close()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--upstream", required=True, help="e.g. http://127.0.0.1:9000")
    args = parser.parse_args()
    app = web.Application()
    app[UPSTREAM] = args.upstream.rstrip("/")
    app.cleanup_ctx.append(session_ctx)
    app.router.add_route("*", "/{tail:.*}", handle)
    web.run_app(app, host=args.host, port=args.port, access_log=None, print=None)


if __name__ == "__main__":
    main()
