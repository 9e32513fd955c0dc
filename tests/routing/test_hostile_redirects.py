"""Upstream redirects are never followed (issue 20, item 17).

Two real aiohttp servers on loopback: a `redirector` configured as the upstream, answering every
request with a redirect to `elsewhere`, which records whatever reaches it. The operator's key and
the client's prompt must never reach `elsewhere`; the client gets a 502 `upstream_redirect`,
and the redirecting upstream is asked once, not once per hop and retry."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import anthropic
import openai
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from proxy.config.load import Config
from proxy.server.app import create_app
from tests.helpers import MESSAGES, UPSTREAM_KEY, ServerFactory, make_config, sdk

pytestmark = pytest.mark.timeout(60)


@dataclass
class Recorder:
    """Every request a server saw: (method, path, headers)."""

    seen: list[tuple[str, str, dict[str, str]]] = field(default_factory=list)
    arrived: asyncio.Event = field(default_factory=asyncio.Event)

    def record(self, request: web.Request) -> None:
        self.seen.append((request.method, request.path, dict(request.headers)))
        self.arrived.set()


@dataclass
class Origins:
    redirector: TestServer
    elsewhere: TestServer
    redirected: Recorder  # what the redirector saw
    leaked: Recorder  # what reached the other origin: must stay empty


def _recording_app(recorder: Recorder, answer: web.Response | None = None) -> web.Application:
    async def handle(request: web.Request) -> web.Response:
        recorder.record(request)
        await request.read()
        return answer or web.json_response({"object": "list", "data": [{"id": "elsewhere"}]})

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handle)
    return app


async def _origins(aiohttp_server: ServerFactory, status: int, *, loop: bool) -> Origins:
    leaked, redirected = Recorder(), Recorder()
    elsewhere = await aiohttp_server(_recording_app(leaked))
    holder: list[TestServer] = []

    async def redirect(request: web.Request) -> web.Response:
        redirected.record(request)
        await request.read()
        target = holder[0] if loop else elsewhere  # a loop points back at itself
        location = str(target.make_url(request.path_qs))
        return web.Response(status=status, headers={"Location": location})

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", redirect)
    redirector = await aiohttp_server(app)
    holder.append(redirector)
    return Origins(redirector, elsewhere, redirected, leaked)


@pytest.fixture(params=[301, 302, 303, 307, 308])
async def origins(aiohttp_server: ServerFactory,
                  request: pytest.FixtureRequest) -> AsyncIterator[Origins]:
    yield await _origins(aiohttp_server, request.param, loop=False)


def _config(base: str, *, api: str = "openai", **extra: Any) -> Config:
    # Retries on: a redirect must still be asked once, not once per attempt.
    return make_config(base, api_key=UPSTREAM_KEY, api=api,
                       retry={"max_attempts": 3, "initial_backoff_ms": 1, "max_backoff_ms": 5},
                       extra=extra)


async def test_chat_is_not_redirected_and_the_key_stays(
    aiohttp_server: ServerFactory, origins: Origins
) -> None:
    proxy = await aiohttp_server(create_app(_config(str(origins.redirector.make_url("/v1")))))
    async with sdk(proxy) as client:
        with pytest.raises(openai.APIStatusError) as caught:
            await client.chat.completions.create(model="mock-gpt", messages=MESSAGES)
    assert caught.value.status_code == 502
    body = caught.value.body
    assert isinstance(body, dict) and body["code"] == "upstream_redirect", body
    assert origins.leaked.seen == []
    assert [(m, p) for m, p, _ in origins.redirected.seen] == [("POST", "/v1/chat/completions")]


async def test_anthropic_key_never_reaches_another_origin(
    aiohttp_server: ServerFactory, origins: Origins
) -> None:
    config = _config(str(origins.redirector.make_url("/v1")), api="anthropic")
    proxy = await aiohttp_server(create_app(config))
    async with anthropic.AsyncAnthropic(base_url=str(proxy.make_url("")), api_key="x",
                                        max_retries=0) as client:
        with pytest.raises(anthropic.APIStatusError) as caught:
            await client.messages.create(model="mock-gpt", max_tokens=9,
                                         messages=[{"role": "user", "content": "hi"}])
    assert caught.value.status_code == 502
    assert origins.leaked.seen == []
    assert len(origins.redirected.seen) == 1
    assert origins.redirected.seen[0][2]["x-api-key"] == UPSTREAM_KEY  # it went where configured


async def test_a_redirect_loop_is_asked_once(aiohttp_server: ServerFactory) -> None:
    loop = await _origins(aiohttp_server, 307, loop=True)
    proxy = await aiohttp_server(create_app(_config(str(loop.redirector.make_url("/v1")))))
    async with sdk(proxy) as client:
        with pytest.raises(openai.APIStatusError) as caught:
            await client.chat.completions.create(model="mock-gpt", messages=MESSAGES,
                                                 stream=True)
    assert caught.value.status_code == 502
    assert len(loop.redirected.seen) == 1


async def test_models_listing_of_one_upstream_is_not_redirected(
    aiohttp_server: ServerFactory, origins: Origins
) -> None:
    proxy = await aiohttp_server(create_app(_config(str(origins.redirector.make_url("/v1")))))
    async with aiohttp.ClientSession() as session, session.get(proxy.make_url("/v1/models")) as r:
        body = await r.json()
        # Not the 3xx passed on either: the client would follow it with its own key.
        assert r.status == 502 and "Location" not in r.headers
    assert body["error"]["code"] == "upstream_redirect"
    assert origins.leaked.seen == []
    assert [p for _, p, _ in origins.redirected.seen] == ["/v1/models"]


async def test_models_listing_merges_only_the_upstreams_that_answered(
    aiohttp_server: ServerFactory, origins: Origins
) -> None:
    good = await aiohttp_server(_recording_app(Recorder(), web.json_response(
        {"object": "list", "data": [{"id": "good-model"}]})))
    config = make_config(
        str(origins.redirector.make_url("/v1")), api_key=UPSTREAM_KEY,
        extra={"upstreams": {
            "mock": {"base_url": str(origins.redirector.make_url("/v1")),
                     "api_key": UPSTREAM_KEY},
            "good": {"base_url": str(good.make_url("/v1"))},
        }},
    )
    proxy = await aiohttp_server(create_app(config))
    async with aiohttp.ClientSession() as session, session.get(proxy.make_url("/v1/models")) as r:
        assert r.status == 200
        assert [m["id"] for m in (await r.json())["data"]] == ["good-model"]
    assert origins.leaked.seen == []


async def test_model_discovery_is_not_redirected(
    aiohttp_server: ServerFactory, origins: Origins
) -> None:
    # Discovery asks the upstreams in order: once the second has been asked, the first's
    # answer (the redirect) has been handled.
    after = Recorder()
    second = await aiohttp_server(_recording_app(after))
    base = str(origins.redirector.make_url("/v1"))
    config = make_config(
        base, api_key=UPSTREAM_KEY,
        extra={
            "upstreams": {"mock": {"base_url": base, "api_key": UPSTREAM_KEY},
                          "second": {"base_url": str(second.make_url("/v1"))}},
            "metrics": {"discover_models": True},
        },
    )
    await aiohttp_server(create_app(config))
    async with asyncio.timeout(10):
        await after.arrived.wait()
    assert [p for _, p, _ in origins.redirected.seen] == ["/v1/models"]
    assert origins.leaked.seen == []
