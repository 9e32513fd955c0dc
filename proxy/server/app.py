"""The aiohttp application: routes, error mapping and the lifecycles of its long-lived parts."""

from __future__ import annotations

import asyncio
import functools
import gc
import hashlib
import hmac
import json
import logging
import os
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import aiohttp
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from proxy.auth import UserIndex, client_key
from proxy.budget.accounting import Budget
from proxy.budget.notify import Notifier
from proxy.budget.spool import SettleSpool
from proxy.budget.store import Store
from proxy.budget.store_factory import make_store
from proxy.cache.cache import ResponseCache
from proxy.cache.policy import hits_impossible
from proxy.cache.store import make_cache_store
from proxy.capture.store import CaptureStore, default_url
from proxy.capture.writer import CaptureWriter
from proxy.config.callers import CallerIndex
from proxy.config.load import Config, ConfigError
from proxy.config.tags import TagRules
from proxy.cost import price_version
from proxy.errors import (
    AuthenticationFailed,
    MethodNotAllowed,
    NotFound,
    ProxyError,
    RequestTooLarge,
    UpstreamRedirect,
    UpstreamUnavailable,
)
from proxy.ledger.ledger import Shipping, make_ledger
from proxy.pipeline import wings
from proxy.pipeline.handler import BODY_PARSER_SLOTS, BODY_PARSERS, REQUEST_ID, make_handler
from proxy.pipeline.relay import REQUEST_ID_HEADER
from proxy.pipeline.services import SERVICES, HttpClient, Runtime, RuntimeHolder, Services, Settling
from proxy.pipeline.watchdog import Watchdog
from proxy.protocol import tokenizer, upstream_errors
from proxy.protocol.translators import (
    TRANSLATORS,
    CountTokensTranslator,
    MessagesTranslator,
    Translator,
)
from proxy.reconcile.audit import Auditor
from proxy.routing.attempts import LatencyTracker
from proxy.routing.upstream import (
    Router,
    client_response_headers,
    redirect_refused,
    upstream_request_headers,
)
from proxy.server import state as st
from proxy.server.reload import ConfigWatcher, keep_running_store
from proxy.server.workers import budget_sharing_problem
from proxy.storage.urls import state_dir
from proxy.telemetry.metrics import Metrics
from proxy.telemetry.tracing import Tracing

log = logging.getLogger("tokenmeter")

_OPEN_WARNING = (
    "tokenmeter is OPEN: no users are configured, so every request is accepted without a key "
    "and metered as user 'default'. Configure `users` to require keys."
)


def build_runtime(config: Config) -> Runtime:
    tags = TagRules(config.tags)
    return Runtime(config=config, router=Router(config), users=UserIndex(config),
                   price_version=price_version(config.prices), tags=tags,
                   callers=CallerIndex(config, tags))


@web.middleware
async def _errors(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    try:
        return await handler(request)
    except ProxyError as exc:
        response = exc.to_response()
        if isinstance(exc, AuthenticationFailed):
            response.force_close()  # as on the metered routes (proxy.pipeline.handler.handle)
        return response
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
        request_id = request.get(REQUEST_ID)  # a metered request's row, if it is one
        response = ProxyError("The proxy failed to handle the request.").to_response(
            request_id=request_id)
        if request_id is not None:
            response.headers[REQUEST_ID_HEADER] = request_id
        return response


async def _models(request: web.Request) -> web.StreamResponse:
    """GET /v1/models: the upstreams' own lists; with one upstream, its bytes unchanged."""
    runtime = request.app[SERVICES].runtime.current
    principal = runtime.users.authenticate(request)  # same keys as every other endpoint
    session = request.app[SERVICES].http.session
    upstreams = list(runtime.router.upstreams.values())
    merged: list[object] = []
    failures = 0
    for upstream in upstreams:
        headers = upstream_request_headers(
            request.headers, upstream,
            client_key=client_key(request) if principal.forward_client_key else None,
        )
        timeout = aiohttp.ClientTimeout(
            total=upstream.first_byte_timeout_s, sock_connect=upstream.connect_timeout_s
        )
        try:
            # Never followed: a redirect would carry the key to another origin (see
            # redirect_refused), and a 3xx passed on would send the client there with its own.
            async with session.get(
                upstream.base_url + "/models", headers=headers, timeout=timeout,
                allow_redirects=False,
            ) as up:
                if (refused := redirect_refused(upstream, up.status)) is not None:
                    raise refused
                body = await up.read()
                if not 200 <= up.status < 300:  # as a metered request's error (relay)
                    body = upstream_errors.scrub(body, runtime.router.key_forms)
                if len(upstreams) == 1:
                    return web.Response(
                        status=up.status, body=body, headers=client_response_headers(up.headers)
                    )
                if up.status == 200:
                    merged.extend(json.loads(body).get("data") or [])
                else:
                    failures += 1
        except UpstreamRedirect as exc:
            if len(upstreams) == 1:
                raise
            failures += 1
            log.warning("listing models of upstream %s failed: %s", upstream.name, exc)
        except (aiohttp.ClientError, TimeoutError, ValueError, AttributeError) as exc:
            failures += 1
            log.warning("listing models of upstream %s failed: %s", upstream.name, exc)
    if failures == len(upstreams):
        raise UpstreamUnavailable("No upstream could list its models.")
    return web.json_response({"object": "list", "data": merged})


def _metrics_handler(main: web.Application) -> Callable[[web.Request], Awaitable[web.Response]]:
    async def metrics(request: web.Request) -> web.Response:
        token = main[SERVICES].runtime.current.config.metrics.token
        if token is not None:
            given = request.headers.get("Authorization", "")
            # Compared as digests: constant time, whatever the lengths.
            if not hmac.compare_digest(
                hashlib.sha256(given.encode()).digest(),
                hashlib.sha256(f"Bearer {token}".encode()).digest(),
            ):
                raise AuthenticationFailed(
                    "/metrics needs `Authorization: Bearer <metrics.token>`.", code="invalid_token"
                )
        metrics = main[SERVICES].metrics
        if metrics.shared:  # a worker: its own figures out, then every worker's files read
            metrics.publish()  # off the loop, as they are disk I/O
            body = await asyncio.to_thread(metrics.exposition)
        elif metrics.reads_files:  # its ledger shipper's figures: files, off the loop too
            body = await asyncio.to_thread(metrics.exposition)
        else:
            body = metrics.exposition()
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    return metrics


def create_metrics_app(main: web.Application) -> web.Application:
    """/metrics alone, for `metrics.port`: a listener that the firewall can keep private."""
    app = web.Application(middlewares=[_errors])
    app.router.add_get("/metrics", _metrics_handler(main))
    return app


async def _healthz(request: web.Request) -> web.Response:
    """Liveness: the process is up and its loop answers."""
    return web.json_response({"status": "ok"})


def _writable(directory: Path) -> bool:
    """Whether this process may create files in `directory`, or create it: access(2) answers
    for this process's uid and knows read-only mounts, so a volume the image's uid cannot
    write says no even while nothing has tried to write yet."""
    for candidate in (directory, *directory.parents):
        if candidate.exists():
            return candidate.is_dir() and os.access(candidate, os.W_OK | os.X_OK)
    return False


def _state_problem(svc: Services) -> str | None:
    """Why usage could not be kept on disk here: the ledger's spool (every row goes through
    it) or the settlement spool (what the store is owed during an outage) cannot be written.
    None when both can."""
    if svc.budget.spool is None:
        return "the settlement spool could not be opened (see the error log)"
    dirs = [svc.budget.spool.directory, *([svc.ledger.spool_dir] if svc.ledger else [])]
    for directory in dict.fromkeys(dirs):
        if not _writable(directory):
            return f"{directory} is not writable by uid {os.getuid()}"
    return None


async def _readyz(request: web.Request) -> web.Response:
    """Readiness: a configuration is loaded, the store answers (or the policy is fail_open:
    requests are then served without budgets, which beats refusing them all), and the state
    directory can be written. A replica that cannot write it would drop every ledger row and
    any settlement owed to the store: it is not ready, so that a misconfigured volume shows
    at the rollout instead of as missing books."""
    runtime = request.app[SERVICES].runtime.current
    policy = runtime.config.store.on_error
    svc = request.app[SERVICES]
    # Off the loop: a stat of a network volume can hang.
    if (problem := await asyncio.to_thread(_state_problem, svc)) is not None:
        return web.json_response({"status": "unavailable", "state_dir": problem}, status=503)
    # A broken ledger is reported, never a reason to stop serving: rows wait in its spool.
    # Off the loop: the shipper process's word is a file.
    ledger = await asyncio.to_thread(svc.ledger.health) if svc.ledger is not None else None
    books: dict[str, object] = {} if ledger is None else {
        "ledger": "ok" if ledger.ok else ledger.detail, "ledger_pending_rows": ledger.pending_rows,
    }
    if not await svc.budget.probe():
        ready = policy == "fail_open"
        return web.json_response(
            {"status": "degraded" if ready else "unavailable", "store": "unreachable",
             "on_error": policy, **books},
            status=200 if ready else 503,
        )
    status = "ok" if ledger is None or ledger.ok else "degraded"
    return web.json_response(
        {"status": status, "store": "ok", "mode": runtime.users.mode, **books}
    )


async def _session_ctx(app: web.Application) -> AsyncIterator[None]:
    # One pooled session for the process; no total timeout (streams may be long), per-request
    # connect/read timeouts come from the upstream's config.
    connector = aiohttp.TCPConnector(limit=0, limit_per_host=0, ttl_dns_cache=60)
    async with aiohttp.ClientSession(
        connector=connector, auto_decompress=False, timeout=aiohttp.ClientTimeout(total=None)
    ) as session:
        app[SERVICES].http.started(session)
        yield
        app[SERVICES].http.started(None)


async def _discover_models(app: web.Application) -> AsyncIterator[None]:
    """Learn model names the upstreams serve, so `model` labels can name them (a bounded set
    that clients cannot grow). Best effort and in the background: startup never waits on it."""
    runtime = app[SERVICES].runtime.current
    router = runtime.router if runtime.config.metrics.discover_models else None
    # Not held while the app runs: a reload frees the version it replaces once nothing does.
    del runtime

    async def discover(router: Router) -> None:
        session = app[SERVICES].http.session
        for upstream in router.upstreams.values():
            try:
                async with session.get(
                    upstream.base_url + "/models",
                    headers=upstream_request_headers({}, upstream),
                    timeout=aiohttp.ClientTimeout(total=10),
                    allow_redirects=False,  # the operator's key stays with its upstream
                ) as up:
                    if (refused := redirect_refused(upstream, up.status)) is not None:
                        raise refused
                    if up.status == 200:
                        data = (await up.json(content_type=None)).get("data") or []
                        router.add_model_labels(
                            str(m["id"]) for m in data if isinstance(m, dict) and "id" in m
                        )
            except (aiohttp.ClientError, TimeoutError, ValueError, AttributeError,
                    UpstreamRedirect) as exc:
                log.warning("could not list models of upstream %s: %s", upstream.name, exc)

    if router is None:
        yield
        return
    task = asyncio.create_task(discover(router))
    del router
    yield
    # Awaited, not only cancelled: the discovery has ended before the session it uses closes,
    # and a failure of it is logged, not left to the loop ("exception never retrieved").
    await stop_task(task)


async def stop_task(task: asyncio.Task[None]) -> None:
    """Cancel a background task and wait until it has ended, cancelling it again while it has
    not: a cancellation can be lost (Python 3.11's `asyncio.timeout` may turn one that arrives
    as its deadline passes into a TimeoutError, which a store call then handles as an outage),
    and one lost cancellation of a loop that runs forever would hang the shutdown."""
    for attempt in range(1, 1_000):
        task.cancel()
        done, _ = await asyncio.wait({task}, timeout=1.0)
        if done:
            if attempt > 1:
                log.warning("a background task ended only at cancellation %d", attempt)
            if not task.cancelled() and (exc := task.exception()) is not None:
                log.error("background task failed", exc_info=exc)
            return
    log.error("a background task would not end: left running")


async def _watchdog_ctx(app: web.Application) -> AsyncIterator[None]:
    task = asyncio.create_task(app[SERVICES].watchdog.run())
    yield
    await stop_task(task)


async def _tracing_ctx(app: web.Application) -> AsyncIterator[None]:
    """First in, last out: the spans settle ends (the last requests' included) are exported
    before the process exits. The SDK's parts are made here, in the process that serves."""
    tracing = app[SERVICES].tracing
    if tracing is None:
        yield
        return
    tracing.start()
    log.info("tracing: spans are exported over OTLP (%s)", tracing.protocol)
    yield
    await asyncio.to_thread(tracing.stop)


async def _ledger_ctx(app: web.Application) -> AsyncIterator[None]:
    """First in, last out: the ledger ships what the settling of the last requests wrote."""
    svc = app[SERVICES]
    ledger = svc.ledger
    if ledger is None:
        yield
        return
    await ledger.start()
    log.info("ledger: rows of replica %s go to %s (shipper process %s)", ledger.replica,
             ledger.location, ledger.shipper_pid or "of the supervisor")
    yield
    await ledger.stop(svc.runtime.current.config.server.drain_seconds)


def _response_cache(config: Config, holder: RuntimeHolder, metrics: Metrics,
                    clock: Callable[[], float]) -> ResponseCache:
    """Always made (a reload may enable the cache); its store follows the budget store's."""
    def memory_bytes() -> int:
        return int(holder.current.config.cache.memory_mb * 1024 * 1024)

    store = make_cache_store(config.store.url, config.store.prefix,
                             config.cache.lookup_timeout_ms / 1000, memory_bytes, clock)
    return ResponseCache(store, metrics.cache_failed, clock, lambda: holder.current.config.cache)


async def _cache_ctx(app: web.Application) -> AsyncIterator[None]:
    yield
    cache = app[SERVICES].cache
    if cache is not None:
        await cache.close()


def _capture_writer(config: Config, holder: RuntimeHolder, metrics: Metrics) -> CaptureWriter:
    """Always made (a reload may enable capture); its store is opened by the first capture.
    The store's location and the queue's size are the starting configuration's."""
    url = default_url(config.capture, config.ledger)

    def policy() -> tuple[bool, int]:
        capture = holder.current.config.capture
        return capture.enabled, capture.retention_days

    return CaptureWriter(lambda: CaptureStore.open(url), metrics, config.capture.queue_max,
                         policy)


async def _capture_ctx(app: web.Application) -> AsyncIterator[None]:
    """After settling has drained (cleanup runs in reverse), what is queued is written."""
    svc = app[SERVICES]
    writer = svc.capture
    if writer is None:
        yield
        return
    writer.start()
    yield
    await writer.stop(svc.runtime.current.config.server.drain_seconds)


async def _audit_ctx(app: web.Application) -> AsyncIterator[None]:
    svc = app[SERVICES]
    config = svc.runtime.current.config
    if svc.ledger is None or not config.ledger.reconcile_every_s:
        yield
        return
    auditor = Auditor(svc.budget.store, svc.metrics)
    task = asyncio.create_task(auditor.run(lambda: svc.runtime.current.config))
    yield
    await stop_task(task)
    await auditor.close()


async def _drain_settling(app: web.Application) -> AsyncIterator[None]:
    yield
    # Until none is left (a settle may start a capture task of its own), for 10 s at most.
    tasks = app[SERVICES].settling.tasks
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 10
    while tasks and (left := deadline - loop.time()) > 0:
        await asyncio.wait(set(tasks), timeout=left)


async def _store_ctx(app: web.Application) -> AsyncIterator[None]:
    budget = app[SERVICES].budget
    holder = app[SERVICES].runtime

    async def maintain() -> None:
        # Probe the store, replay what the spool holds once it answers, renew the leases of
        # streams still running.
        tick = 0
        while True:
            lease = holder.current.config.store.lease_seconds
            await asyncio.sleep(min(1.0, lease / 3))
            tick += 1
            if await budget.probe():
                await budget.replay()
                if tick % max(1, int(lease / 3)) == 0:
                    await budget.renew_leases(lease)
            budget.health.tick()

    if budget.spool is not None:
        try:
            if skipped := budget.spool.open():
                budget.metrics.settle_spool_bad_lines(skipped)
        except OSError as exc:
            log.error("the settlement spool cannot be opened in %s (%s): usage owed to the "
                      "store during an outage will be lost", budget.spool.directory, exc)
            budget.spool = None
        else:
            log.info("settlements the store cannot take are kept in %s", budget.spool.path)
    if not await budget.probe():  # StoreHealth has said so: add only what it cannot know
        log.warning("starting with the budget store unreachable (policy %s)",
                    holder.current.config.store.on_error)
    else:
        await budget.replay()
    task = asyncio.create_task(maintain())
    yield
    await stop_task(task)
    await budget.drain_background()
    if budget.health.up:
        await budget.replay()
    budget.health.tick(final=True)
    await budget.store.close()
    budget.close_spool()


def _watch_ctx(path: Path, workers: int) -> Callable[[web.Application], AsyncIterator[None]]:
    async def ctx(app: web.Application) -> AsyncIterator[None]:
        holder = app[SERVICES].runtime

        def prepare(config: Config) -> Runtime:
            """In the watcher's worker thread: everything but the swap. Builds run one at a
            time and only `install` (after this) swaps, so `holder.current` is stable here."""
            # The store is set up once at start: a changed prefix must not reset every budget.
            config = keep_running_store(config, holder.current.config)
            # Limits added on the in-process store would be kept by each worker on its own.
            if workers > 1 and (problem := budget_sharing_problem(config, workers)):
                raise ConfigError(problem)
            return build_runtime(config)

        def install(runtime: Runtime) -> Runtime:
            previous = holder.current
            # Names learned from the upstreams at start stay allowed as labels.
            runtime.router.add_model_labels(previous.router.discovered)
            holder.current = runtime
            _publish_config(app[SERVICES].metrics, runtime)
            return previous

        watcher = ConfigWatcher(path, prepare, install, st.release_runtime,
                                app[SERVICES].metrics)
        app[st.WATCHER] = watcher
        task = asyncio.create_task(watcher.run())
        yield
        # Awaited, not only cancelled: the watcher (a reload in flight included) has ended
        # before the services it installs into shut down, and a failure of it is logged.
        await stop_task(task)

    return ctx


def _publish_config(metrics: Metrics, runtime: Runtime) -> None:
    """The gauges that describe a configuration: set at start and by each reload."""
    metrics.open_mode(runtime.open_mode)
    metrics.user_teams({user: cfg.team for user, cfg in runtime.config.users.items()})


@dataclass(frozen=True)
class Placement:
    """This process's place among those serving one configuration (`serve --workers`)."""

    workers: int = 1  # how many processes serve it
    audit: bool = True  # whether this one runs the ledger's reconciliation (one: worker 0)
    ship: bool = True  # whether this one starts a ledger shipper (not a supervisor's worker)


def create_app(
    config: Config,
    *,
    config_path: Path | None = None,
    clock: Callable[[], float] = time.time,
    store: Store | None = None,
    placement: Placement = Placement(),
) -> web.Application:
    """`clock` (epoch seconds) decides budget days and minutes; tests inject one."""
    app = web.Application(
        middlewares=[_errors], client_max_size=int(config.server.max_body_mb * 1024 * 1024)
    )
    runtime = build_runtime(config)
    holder = RuntimeHolder(runtime)
    metrics = Metrics()
    _publish_config(metrics, runtime)
    http = HttpClient()
    notifier = Notifier(
        metrics,
        thresholds=lambda: holder.current.config.alerts.thresholds,
        webhook_url=lambda: holder.current.config.alerts.webhook_url,
        session=lambda: http.session if http.running else None,
    )
    spool_dir = Path(config.store.spool_dir) if config.store.spool_dir else state_dir()
    budget = Budget(store or make_store(config.store, clock), metrics, notifier, clock,
                    SettleSpool(spool_dir))
    rng = random.Random()
    capture = _capture_writer(config, holder, metrics)
    spans = Tracing.of(config.tracing)
    app[SERVICES] = Services(
        runtime=holder, metrics=metrics, budget=budget, http=http, latency=LatencyTracker(),
        rng=rng, settling=Settling(), watchdog=Watchdog(),
        ledger=make_ledger(config.ledger, metrics, ship=placement.ship,
                           shipping=Shipping(config.server.drain_seconds, config.timezone)),
        capture=capture,
        tracing=spans,
        cache=_response_cache(config, holder, metrics, clock),
        observers=(wings.capturing(capture, rng, metrics),
                   *(() if spans is None else (wings.tracing(spans),))),
    )
    app[BODY_PARSERS] = asyncio.Semaphore(BODY_PARSER_SLOTS)
    app.cleanup_ctx.extend(
        [_tracing_ctx, _ledger_ctx, _capture_ctx, _session_ctx, _store_ctx,
         *([_audit_ctx] if placement.audit else []), _watchdog_ctx, _discover_models,
         _cache_ctx, _drain_settling]
    )
    if config_path is not None:
        app.cleanup_ctx.append(_watch_ctx(config_path, placement.workers))
    shapes: tuple[type[Translator], ...] = (*TRANSLATORS, MessagesTranslator,
                                            CountTokensTranslator)
    for translator in shapes:
        app.router.add_post("/v1" + translator.path, make_handler(translator))
    app.router.add_get("/v1/models", _models)
    if config.metrics.port is None:
        app.router.add_get("/metrics", _metrics_handler(app))
    app.router.add_get("/healthz", _healthz)
    app.router.add_get("/readyz", _readyz)
    if runtime.open_mode:
        app.on_startup.append(_warn_open)
    if (never := hits_impossible(config.cache, config.effective_mode)) is not None:
        app.on_startup.append(functools.partial(_warn_cache, never))
    app.on_startup.append(_settle_heap)
    return app


async def _settle_heap(app: web.Application) -> None:
    """Load the tokenizers now (0.3 s of CPU, off the loop) instead of in the first request that
    needs an estimate, then move everything alive at startup out of the garbage collector's
    sight: its full collections would otherwise walk the 200k-entry BPE tables mid-stream."""
    try:
        await asyncio.to_thread(tokenizer.preload)
    except tokenizer.EncodingUnavailable as exc:
        log.error("token counting unavailable, estimates will fail: %s", exc)
    gc.freeze()


async def _warn_open(app: web.Application) -> None:
    log.warning(_OPEN_WARNING)


async def _warn_cache(never: str, app: web.Application) -> None:
    log.warning(never)
