"""The aiohttp application: routes, error mapping and the lifecycles of its long-lived parts."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

import aiohttp
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from proxy import state as st
from proxy.config import Config
from proxy.errors import MethodNotAllowed, NotFound, ProxyError, RequestTooLarge
from proxy.metrics import Metrics
from proxy.relay import make_handler
from proxy.translators import TRANSLATORS
from proxy.upstream import Router, client_response_headers, upstream_request_headers

log = logging.getLogger("tokenmeter")

_OPEN_WARNING = (
    "tokenmeter is OPEN: no users are configured, so every request is accepted without a key "
    "and metered as user 'default'. Configure `users` to require keys."
)


def build_runtime(config: Config) -> st.Runtime:
    return st.Runtime(config=config, router=Router(config), open_mode=True)


@web.middleware
async def _errors(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    try:
        return await handler(request)
    except ProxyError as exc:
        return exc.to_response()
    except web.HTTPNotFound:
        return NotFound(f"Unknown request URL: {request.method} {request.path}.").to_response()
    except web.HTTPMethodNotAllowed:
        return MethodNotAllowed(f"{request.method} is not allowed on {request.path}.").to_response()
    except web.HTTPRequestEntityTooLarge:
        return RequestTooLarge("The request body is too large.").to_response()
    except web.HTTPException:
        raise
    except Exception:
        log.exception("unhandled error on %s %s", request.method, request.path)
        return ProxyError("The proxy failed to handle the request.").to_response()


async def _models(request: web.Request) -> web.StreamResponse:
    """GET /v1/models: the upstreams' own lists; with one upstream, its bytes unchanged."""
    runtime = request.app[st.RUNTIME_HOLDER].current
    session = request.app[st.SESSION]
    upstreams = list(runtime.router.upstreams.values())
    merged: list[object] = []
    for upstream in upstreams:
        headers = upstream_request_headers(request.headers, upstream)
        try:
            async with session.get(upstream.base_url + "/models", headers=headers) as up:
                body = await up.read()
                if len(upstreams) == 1:
                    return web.Response(
                        status=up.status, body=body, headers=client_response_headers(up.headers)
                    )
                if up.status == 200:
                    merged.extend(json.loads(body).get("data") or [])
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            log.warning("listing models of upstream %s failed: %s", upstream.name, exc)
    return web.json_response({"object": "list", "data": merged})


async def _metrics(request: web.Request) -> web.Response:
    body = generate_latest(request.app[st.METRICS].registry)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def _healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def _session_ctx(app: web.Application) -> AsyncIterator[None]:
    # One pooled session for the process; no total timeout (streams may be long), per-request
    # connect/read timeouts come from the upstream's config.
    connector = aiohttp.TCPConnector(limit=0, limit_per_host=0, ttl_dns_cache=60)
    async with aiohttp.ClientSession(
        connector=connector, auto_decompress=False, timeout=aiohttp.ClientTimeout(total=None)
    ) as session:
        app[st.SESSION] = session
        yield


async def _discover_models(app: web.Application) -> AsyncIterator[None]:
    """Learn model names the upstreams serve, so `model` labels can name them (a bounded set
    that clients cannot grow). Best effort and in the background: startup never waits on it."""
    runtime = app[st.RUNTIME_HOLDER].current
    if not runtime.config.metrics.discover_models:
        yield
        return

    async def discover() -> None:
        session = app[st.SESSION]
        for upstream in runtime.router.upstreams.values():
            try:
                async with session.get(
                    upstream.base_url + "/models",
                    headers=upstream_request_headers({}, upstream),
                    timeout=aiohttp.ClientTimeout(total=10),
                ) as up:
                    if up.status == 200:
                        data = (await up.json(content_type=None)).get("data") or []
                        runtime.router.add_model_labels(
                            str(m["id"]) for m in data if isinstance(m, dict) and "id" in m
                        )
            except (aiohttp.ClientError, TimeoutError, ValueError, AttributeError) as exc:
                log.warning("could not list models of upstream %s: %s", upstream.name, exc)

    task = asyncio.create_task(discover())
    yield
    task.cancel()


async def _drain_settling(app: web.Application) -> AsyncIterator[None]:
    yield
    pending = set(app[st.SETTLING].tasks)
    if pending:
        await asyncio.wait(pending, timeout=10)


def create_app(config: Config) -> web.Application:
    app = web.Application(
        middlewares=[_errors], client_max_size=int(config.server.max_body_mb * 1024 * 1024)
    )
    runtime = build_runtime(config)
    app[st.RUNTIME_HOLDER] = st.RuntimeHolder(runtime)
    metrics = Metrics()
    metrics.info.set(1 if runtime.open_mode else 0)
    app[st.METRICS] = metrics
    app[st.SETTLING] = st.Settling()
    app.cleanup_ctx.extend([_session_ctx, _discover_models, _drain_settling])
    for translator in TRANSLATORS:
        app.router.add_post("/v1" + translator.path, make_handler(translator))
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/metrics", _metrics)
    app.router.add_get("/healthz", _healthz)
    if runtime.open_mode:
        app.on_startup.append(_warn_open)
    return app


async def _warn_open(app: web.Application) -> None:
    log.warning(_OPEN_WARNING)
