"""One closed set of error classes: the enum, the one classifier of upstream answers, the one map
of aiohttp/asyncio exceptions, and the dashboards and alert rules held to the enum's values."""

from __future__ import annotations

import ast
import asyncio
import json
import random
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from aiohttp import web
from multidict import CIMultiDict

from proxy.bench.client import BenchError, classify_status
from proxy.config.load import RetryConfig, UpstreamConfig
from proxy.errors import (
    BudgetExceeded,
    ConnectTimeout,
    ErrorClass,
    FirstByteTimeout,
    IdleTimeout,
    ProxyError,
    TotalTimeout,
    UpstreamIncomplete,
    UpstreamRedirect,
    UpstreamReset,
    UpstreamTimeout,
    UpstreamUnavailable,
    UpstreamUnreachable,
)
from proxy.routing import attempts
from proxy.routing.exceptions_map import Phase, map_upstream_exceptions, upstream_failure
from proxy.routing.upstream import Upstream
from tests.helpers import ROOT

MEMBERS = frozenset(ErrorClass)

# --- dashboards and alert rules ------------------------------------------------------------------

# `error_class="x"`, `!=`, `=~`, `!~`, in PromQL as it reads once JSON/YAML quoting is undone.
_MATCHER = re.compile(r'error_class\s*(=~|!~|!=|=)\s*"((?:[^"\\]|\\.)*)"')
_LITERAL = re.compile(r"[a-z0-9_]+")


def _strings(node: Any) -> Iterator[str]:
    if isinstance(node, str):
        yield node
    elif isinstance(node, dict):
        for value in node.values():
            yield from _strings(value)
    elif isinstance(node, list):
        for value in node:
            yield from _strings(value)


def _matcher_problems(text: str) -> tuple[list[str], list[str]]:
    """(every value matched, the ones that are not the enum's). A regex matcher must be an
    alternation whose literal alternatives are members and whose other alternatives match at
    least one member."""
    seen: list[str] = []
    bad: list[str] = []
    for op, value in _MATCHER.findall(text):
        alternatives = value.split("|") if op in ("=~", "!~") else [value]
        for alt in alternatives:
            seen.append(alt)
            if alt.startswith("$"):  # a Grafana variable: its own query is checked where it is
                continue
            if _LITERAL.fullmatch(alt) or op in ("=", "!="):
                if alt not in MEMBERS:
                    bad.append(alt)
            elif not any(re.fullmatch(alt, m) for m in MEMBERS):
                bad.append(alt)
    return seen, bad


def _monitoring_files() -> list[Path]:
    return sorted((ROOT / "grafana" / "dashboards").glob("*.json")) + sorted(
        (ROOT / "deploy" / "prometheus" / "rules").glob("*.yml")
    )


def test_dashboards_and_alert_rules_use_only_error_class_values() -> None:
    files = _monitoring_files()
    assert any(f.suffix == ".json" for f in files) and any(f.suffix == ".yml" for f in files)
    seen_all: list[str] = []
    problems: dict[str, list[str]] = {}
    for path in files:
        text = path.read_text(encoding="utf-8")
        doc = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
        for s in _strings(doc):
            seen, bad = _matcher_problems(s)
            seen_all += seen
            if bad:
                problems.setdefault(path.name, []).extend(bad)
    assert not problems, f"error_class values that are not ErrorClass members: {problems}"
    # Not vacuous: the rules and the overview dashboard do match on error_class.
    assert {"none", "client_disconnect", "upstream_5xx", "rate_limit"} <= set(seen_all)


@pytest.mark.parametrize(
    ("expr", "bad"),
    [
        ('rate(x{error_class="upstream_5xxx"}[5m])', ["upstream_5xxx"]),
        ('x{error_class!="client_disconnected"}', ["client_disconnected"]),
        ('x{error_class=~"rate_limit|timeout"}', ["timeout"]),
        ('x{error_class!~"upstream_.*|nope_.+"}', ["nope_.+"]),
        ('x{error_class=~"upstream_.*|auth", status!~"2.."}', []),
        ("sum by (error_class) (x)  {{error_class}}", []),
    ],
)
def test_the_matcher_check_catches_values_outside_the_enum(expr: str, bad: list[str]) -> None:
    assert _matcher_problems(expr)[1] == bad


# --- the enum and the error tree ------------------------------------------------------------------


def test_error_class_is_a_str_enum_of_todays_labels() -> None:
    member: str = ErrorClass.UPSTREAM_5XX  # as a str: mypy would call the comparison impossible
    assert member == "upstream_5xx" and f"{ErrorClass.NONE}" == "none"
    assert {"upstream_5xx": 1}[ErrorClass.UPSTREAM_5XX] == 1  # hashes as its value
    assert {
        "none", "client_disconnect", "client_timeout", "body_timeout", "internal",
        "budget_exceeded", "upstream_5xx", "rate_limit", "auth", "bad_request",
        "context_length", "connect_timeout", "first_byte_timeout", "idle_timeout",
        "total_timeout", "upstream_unreachable", "upstream_reset", "upstream_incomplete",
        "upstream_timeout", "invalid_request", "invalid_type", "integer_below_min_value",
        "invalid_value", "unknown_url", "method_not_allowed", "invalid_api_key",
        "invalid_token", "request_too_large", "service_unavailable", "model_not_found",
        "request_timeout", "too_many_connections", "server_error", "upstream_redirect",
        "unsupported_content_encoding",
    } == {m.value for m in ErrorClass}


def _proxy_error_names(trees: list[ast.Module]) -> set[str]:
    names = {"ProxyError"}
    while True:
        more = {
            node.name
            for tree in trees for node in ast.walk(tree)
            if isinstance(node, ast.ClassDef)
            and any(isinstance(b, ast.Name) and b.id in names for b in node.bases)
        }
        if more <= names:
            return names
        names |= more


def test_every_code_the_proxy_raises_is_a_class() -> None:
    """Every `code=` given to a ProxyError (and every subclass's `code`) is a member, so no
    raiser can put a label outside the set; BudgetExceeded's codes are not classes (its class
    is always budget_exceeded)."""
    sources = {p: p.read_text(encoding="utf-8") for p in (ROOT / "proxy").rglob("*.py")
               if "bench" not in p.parts and not p.name.startswith("mock_")}
    trees = [ast.parse(text) for text in sources.values()]
    errors = _proxy_error_names(trees) - {"BudgetExceeded"}
    codes: dict[object, str] = {}  # any constant: a non-str code must show up, not be skipped
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                func = node.func
                name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", "")
                if name not in errors:
                    continue
                for kw in node.keywords:
                    if kw.arg == "code" and isinstance(kw.value, ast.Constant):
                        codes[kw.value.value] = name
            elif isinstance(node, ast.ClassDef) and node.name in errors:
                for stmt in node.body:
                    if (isinstance(stmt, ast.Assign) and isinstance(stmt.value, ast.Constant)
                            and any(isinstance(t, ast.Name) and t.id == "code"
                                    for t in stmt.targets)):
                        codes[stmt.value.value] = node.name
    assert {"idle_timeout", "invalid_type", "too_many_connections", "request_timeout",
            "model_not_found", "upstream_reset"} <= set(codes)  # the scan sees the raisers
    assert {c: n for c, n in codes.items() if c not in MEMBERS} == {}
    # The labels set by hand (client gone, internal, ...) are members too.
    literal = re.compile(r'error_class\s*(?:=|==|!=)\s*"([^"]+)"')
    hand_set = {v for text in sources.values() for v in literal.findall(text)}
    assert hand_set <= MEMBERS, hand_set - MEMBERS


@pytest.mark.parametrize(
    ("error", "status", "code", "cls"),
    [
        (ConnectTimeout("m"), 504, "connect_timeout", ErrorClass.CONNECT_TIMEOUT),
        (FirstByteTimeout("m"), 504, "first_byte_timeout", ErrorClass.FIRST_BYTE_TIMEOUT),
        (IdleTimeout("m"), 504, "idle_timeout", ErrorClass.IDLE_TIMEOUT),
        (TotalTimeout("m"), 504, "total_timeout", ErrorClass.TOTAL_TIMEOUT),
        (UpstreamTimeout("m"), 504, "upstream_timeout", ErrorClass.UPSTREAM_TIMEOUT),
        (UpstreamUnreachable("m"), 502, "upstream_unreachable", ErrorClass.UPSTREAM_UNREACHABLE),
        (UpstreamReset("m"), 502, "upstream_reset", ErrorClass.UPSTREAM_RESET),
        (UpstreamIncomplete("m"), 502, "upstream_incomplete", ErrorClass.UPSTREAM_INCOMPLETE),
        (UpstreamRedirect("m"), 502, "upstream_redirect", ErrorClass.UPSTREAM_REDIRECT),
        (ProxyError("m"), 500, None, ErrorClass.SERVER_ERROR),
        (ProxyError("m", code="internal"), 500, "internal", ErrorClass.INTERNAL),
    ],
)
def test_each_kind_has_its_wire_code_and_class(
    error: ProxyError, status: int, code: str | None, cls: ErrorClass
) -> None:
    assert (error.status, error.code, error.error_class) == (status, code, cls)
    assert type(error.error_class) is ErrorClass


@pytest.mark.parametrize(
    ("old", "new"),
    [
        (UpstreamTimeout("m", code="connect_timeout"), ConnectTimeout("m")),
        (UpstreamTimeout("m", code="first_byte_timeout"), FirstByteTimeout("m")),
        (UpstreamTimeout("m", code="idle_timeout"), IdleTimeout("m")),
        (UpstreamTimeout("m", code="total_timeout"), TotalTimeout("m")),
        (UpstreamUnavailable("m"), UpstreamUnreachable("m")),
        (UpstreamUnavailable("m", code="upstream_reset"), UpstreamReset("m")),
        (UpstreamUnavailable("m", code="upstream_incomplete"), UpstreamIncomplete("m")),
    ],
)
def test_the_old_code_argument_gives_the_same_wire_error_and_class(
    old: ProxyError, new: ProxyError
) -> None:
    assert isinstance(new, type(old))  # `except UpstreamTimeout` still catches every kind
    assert (old.status, old.to_body(), old.error_class) == (new.status, new.to_body(),
                                                           new.error_class)


def test_budget_and_unknown_codes_stay_inside_the_set() -> None:
    refused = BudgetExceeded("m", type_="tokens", code="daily_quota_exceeded", limit="day",
                             headers={})
    assert refused.error_class is ErrorClass.BUDGET_EXCEEDED
    assert refused.to_body()["error"]["code"] == "daily_quota_exceeded"  # the wire keeps it
    assert ProxyError("m", code="no_such_code").error_class is ErrorClass.INTERNAL


def test_the_protocol_layer_imports_no_aiohttp() -> None:
    """proxy/protocol is sans-I/O: the classifier, the SSE decoder, the tap and the API shapes
    import no aiohttp (so they can be reused, and unit-tested, without a network stack)."""
    out = subprocess.run(
        [sys.executable, "-c",
         "import sys, pkgutil, importlib, proxy.protocol\n"
         "for m in pkgutil.iter_modules(proxy.protocol.__path__, 'proxy.protocol.'):\n"
         "    importlib.import_module(m.name)\n"
         "print('aiohttp' in sys.modules)"],
        capture_output=True, text=True, check=True, cwd=ROOT, timeout=60,
    )
    assert out.stdout.strip() == "False"


# --- the bench reads answers with the classifier (tests/protocol/test_upstream_errors.py tests it) -


def _openai(type_: str, code: str | None = None, message: str = "m") -> bytes:
    return json.dumps({"error": {"message": message, "type": type_, "param": None,
                                 "code": code}}).encode()


# vLLM's own shape: flat, `object: error`, an integer code.
VLLM_CONTEXT = json.dumps({
    "object": "error", "type": "BadRequestError", "param": None, "code": 400,
    "message": "This model's maximum context length is 4096 tokens. However, you requested "
               "5000 tokens (4000 in the messages, 1000 in the completion).",
}).encode()


@pytest.mark.parametrize(
    ("status", "body", "cls"),
    [
        (500, _openai("server_error"), BenchError.SERVER_ERROR),
        (503, b"busy", BenchError.SERVER_ERROR),
        (408, b"", BenchError.SERVER_ERROR),
        (429, _openai("requests"), BenchError.RATE_LIMIT),
        (403, b"", BenchError.AUTH),
        (400, _openai("invalid_request_error", "context_length_exceeded"),
         BenchError.CONTEXT_LENGTH),
        (400, VLLM_CONTEXT, BenchError.CONTEXT_LENGTH),
        (404, b"", BenchError.BAD_REQUEST),
        (500, _openai("invalid_request_error", "invalid_value"), BenchError.BAD_REQUEST),
        (201, b"", BenchError.SERVER_ERROR),
    ],
)
def test_bench_reads_answers_with_the_same_classifier(
    status: int, body: bytes, cls: BenchError
) -> None:
    got, message = classify_status(status, body)
    assert got is cls
    assert isinstance(message, str) and len(message) <= 200


# --- the exception map ---------------------------------------------------------------------------


def _upstream(base_url: str = "http://127.0.0.1:9", **retry: Any) -> Upstream:
    return Upstream.of("u", UpstreamConfig(
        base_url=base_url, connect_timeout_s=1.5, first_byte_timeout_s=2.5, idle_timeout_s=3.5,
        total_timeout_s=4.5, retry=RetryConfig(**{"initial_backoff_ms": 1, "max_backoff_ms": 2,
                                                   **retry}),
    ))


@pytest.mark.parametrize(
    ("exc", "phase", "kind", "setting"),
    [
        (aiohttp.ConnectionTimeoutError(), Phase.CONNECT, ConnectTimeout, "connect_timeout_s"),
        (TimeoutError(), Phase.CONNECT, FirstByteTimeout, "first_byte_timeout_s"),
        (aiohttp.SocketTimeoutError(), Phase.CONNECT, FirstByteTimeout, "first_byte_timeout_s"),
        (aiohttp.ServerDisconnectedError(), Phase.CONNECT, UpstreamUnreachable, "unreachable"),
        (aiohttp.ClientOSError(), Phase.CONNECT, UpstreamUnreachable, "unreachable"),
        (aiohttp.ClientConnectionResetError(), Phase.CONNECT, UpstreamUnreachable, "unreach"),
        (TimeoutError(), Phase.TOTAL, TotalTimeout, "total_timeout_s"),
        (aiohttp.ConnectionTimeoutError(), Phase.TOTAL, TotalTimeout, "total_timeout_s"),
        (aiohttp.ClientPayloadError("x"), Phase.TOTAL, UpstreamUnreachable, "broke"),
        (TimeoutError(), Phase.IDLE, IdleTimeout, "stopped sending"),
        (aiohttp.ServerDisconnectedError(), Phase.IDLE, UpstreamUnreachable, "broke"),
        (aiohttp.ClientPayloadError("x"), Phase.STREAM, UpstreamReset, "mid-stream"),
        (TimeoutError(), Phase.STREAM, UpstreamReset, "mid-stream"),
    ],
)
def test_exceptions_map_by_phase(
    exc: BaseException, phase: Phase, kind: type[ProxyError], setting: str
) -> None:
    failure = upstream_failure(exc, _upstream(), phase)
    assert failure is not None and type(failure) is kind
    assert setting in failure.message


def test_a_silent_stream_is_an_idle_timeout_whatever_was_raised() -> None:
    for exc in (TimeoutError(), aiohttp.ClientPayloadError("x")):
        failure = upstream_failure(exc, _upstream(), Phase.STREAM, silent=lambda: True)
        assert isinstance(failure, IdleTimeout) and "3.5 s (idle_timeout_s)" in failure.message


@pytest.mark.parametrize(
    ("exc", "phase"),
    [
        (ValueError("a bug"), Phase.CONNECT),
        (asyncio.CancelledError(), Phase.CONNECT),
        (IdleTimeout("already ours"), Phase.TOTAL),
        # Writes to a client that left: the relay counts those as client_disconnect.
        (aiohttp.ClientConnectionResetError(), Phase.STREAM),
        (BrokenPipeError(), Phase.STREAM),
    ],
)
def test_what_is_not_an_upstream_failure_passes_through(exc: BaseException, phase: Phase) -> None:
    with pytest.raises(type(exc)) as caught, map_upstream_exceptions(_upstream(), phase):
        raise exc
    assert caught.value is exc


def test_the_map_raises_the_proxy_error_without_chaining() -> None:
    with pytest.raises(FirstByteTimeout) as caught, map_upstream_exceptions(
        _upstream(), Phase.CONNECT
    ):
        raise TimeoutError
    assert caught.value.__suppress_context__  # no aiohttp traceback in the error log


# --- call_upstream and answer_class over real sockets ---------------------------------------------


async def _call(upstream: Upstream, reasons: list[str]) -> attempts.Answer:
    async with aiohttp.ClientSession() as session:
        answer = await attempts.call_upstream(
            session, upstream, attempts.Call("/chat/completions", b"{}", CIMultiDict()),
            attempts.Retrying(lambda _u, reason: reasons.append(reason), random.Random(1)),
        )
        await answer.response.read()
        return answer


async def test_call_upstream_maps_a_dropped_connection_and_retries_it() -> None:
    """A server that accepts and closes at once: ServerDisconnectedError each time, retried,
    then raised as UpstreamUnreachable (502, upstream_unreachable)."""

    async def drop(_r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        w.close()

    server = await asyncio.start_server(drop, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    reasons: list[str] = []
    try:
        async with asyncio.timeout(30):
            with pytest.raises(UpstreamUnreachable) as caught:
                await _call(_upstream(f"http://127.0.0.1:{port}", max_attempts=2), reasons)
    finally:
        server.close()
        await server.wait_closed()
    assert caught.value.error_class is ErrorClass.UPSTREAM_UNREACHABLE
    assert caught.value.status == 502 and reasons == ["upstream_unreachable"]


async def test_call_upstream_maps_silence_to_first_byte_timeout_without_retry() -> None:
    started = asyncio.Event()
    release = asyncio.Event()

    async def hold(_r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        started.set()
        await release.wait()
        w.close()

    server = await asyncio.start_server(hold, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    up = Upstream.of("u", UpstreamConfig(
        base_url=f"http://127.0.0.1:{port}", connect_timeout_s=5, first_byte_timeout_s=0.2,
        idle_timeout_s=5, total_timeout_s=5, retry=RetryConfig(max_attempts=3)))
    reasons: list[str] = []
    try:
        async with asyncio.timeout(30):
            with pytest.raises(FirstByteTimeout) as caught:
                await _call(up, reasons)
    finally:
        release.set()
        server.close()
        await server.wait_closed()
    assert started.is_set() and reasons == []  # it may be running: never sent twice
    assert caught.value.to_body()["error"]["code"] == "first_byte_timeout"


async def test_retry_reasons_are_classes_and_a_blaming_500_is_not_retried(
    aiohttp_server: Any,
) -> None:
    answers = [
        (408, b"{}"),
        (503, _openai("server_error")),
        (500, _openai("invalid_request_error", "invalid_value")),
    ]
    served: list[int] = []

    async def handler(_request: web.Request) -> web.Response:
        status, body = answers[len(served)]
        served.append(status)
        return web.Response(status=status, body=body, content_type="application/json")

    app = web.Application()
    app.router.add_post("/chat/completions", handler)
    server = await aiohttp_server(app)
    up = _upstream(str(server.make_url("")).rstrip("/"), max_attempts=5,
                   on_status=[408, 500, 503])
    reasons: list[str] = []
    async with asyncio.timeout(30):
        answer = await _call(up, reasons)
    # 408 and 503 were retried under their classes; the 500 blaming the request came back,
    # with the class that decided it (the relay and the record read that one).
    assert served == [408, 503, 500] and answer.response.status == 500
    assert answer.error_class is ErrorClass.BAD_REQUEST
    assert reasons == ["upstream_timeout", "upstream_5xx"]
    assert all(type(r) is ErrorClass for r in reasons)


@pytest.mark.parametrize("status", [500, 400])
async def test_answer_class_reads_an_error_body_and_leaves_it_for_the_relay(
    aiohttp_server: Any, status: int,
) -> None:
    """Some servers answer a bad request with a 500; a 400's body tells `context_length` from
    `bad_request`. The class is decided here, once, and the body is still there to relay."""
    body = _openai("invalid_request_error", "context_length_exceeded")

    async def handler(_request: web.Request) -> web.Response:
        return web.Response(status=status, body=body, content_type="application/json")

    app = web.Application()
    app.router.add_post("/x", handler)
    server = await aiohttp_server(app)
    async with asyncio.timeout(30), aiohttp.ClientSession() as session, session.post(
        server.make_url("/x"), data=b"{}"
    ) as response:
        assert await attempts.answer_class(response) is ErrorClass.CONTEXT_LENGTH
        assert await response.read() == body
