"""The id a developer pastes into a ticket finds the request: the upstream's id (what the openai
and anthropic SDKs show as `request_id`) is kept in the ledger row and the capture beside
tokenmeter's, and `captures show`, `captures list --request-id` and `usage --request-id` accept
either, on SQLite and PostgreSQL (the ledger and the captures in the same database, the
default)."""

from __future__ import annotations

import asyncio
import json
import sqlite3
import subprocess
from typing import Any

import anthropic
import asyncpg
import openai
import pytest
from aiohttp.test_utils import TestServer

from proxy.capture.store import CaptureFilter, CaptureStore
from proxy.pipeline import services as st
from proxy.server.app import create_app
from tests.capture.captures import capture
from tests.helpers import ServerFactory, make_config, tokenmeter, until

ALICE = "sk-alice-either-id-0001"
# The captures table as tokenmeter made it before it kept the upstream's id (its columns).
_EARLIER = ("request_id {t} PRIMARY KEY, started_at {ts} NOT NULL, user_name {t}, key_name {t}, "
            "team {t}, requested_model {t} NOT NULL, model {t}, status integer NOT NULL, "
            "error_class {t} NOT NULL, stream {b} NOT NULL, size bigint NOT NULL, data {blob} "
            "NOT NULL")
REFUSE = {"x-mock-status": "400", "x-mock-error-code": "context_length_exceeded"}


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return tokenmeter(*args)


async def _proxy(aiohttp_server: ServerFactory, upstream: TestServer, url: str,
                 api: str) -> TestServer:
    config = make_config(str(upstream.make_url("/v1")), api=api,
                         users={"alice": {"keys": [ALICE]}},
                         extra={"capture": {"enabled": True, "sample": 1.0},
                                "ledger": {"url": url}})
    return await aiohttp_server(create_app(config))


async def _openai_refusal(proxy: TestServer) -> tuple[str, str]:
    """(tokenmeter's id, the id the SDK's exception shows) of an upstream's 400."""
    async with openai.AsyncOpenAI(base_url=str(proxy.make_url("/v1")), api_key=ALICE,
                                  max_retries=0) as client:
        with pytest.raises(openai.BadRequestError) as caught:
            await client.chat.completions.create(
                model="mock-gpt", messages=[{"role": "user", "content": "hi"}],
                max_tokens=5, extra_headers=REFUSE)
    assert caught.value.request_id is not None
    return caught.value.response.headers["x-tokenmeter-request-id"], caught.value.request_id


async def _anthropic_refusal(proxy: TestServer) -> tuple[str, str]:
    async with anthropic.AsyncAnthropic(base_url=str(proxy.make_url("")).rstrip("/"),
                                        api_key=ALICE, max_retries=0) as client:
        with pytest.raises(anthropic.BadRequestError) as caught:
            await client.messages.create(
                model="mock-gpt", messages=[{"role": "user", "content": "hi"}],
                max_tokens=5, extra_headers=REFUSE)
    assert caught.value.request_id is not None
    return caught.value.response.headers["x-tokenmeter-request-id"], caught.value.request_id


@pytest.mark.timeout(120)
@pytest.mark.parametrize("api", ["openai", "anthropic"])
async def test_either_id_finds_the_row_and_the_capture(
    aiohttp_server: ServerFactory, upstream: TestServer, store_url: str, api: str
) -> None:
    proxy = await _proxy(aiohttp_server, upstream, store_url, api)
    ours, theirs = await (_openai_refusal if api == "openai" else _anthropic_refusal)(proxy)
    assert ours != theirs
    ledger = proxy.app[st.SERVICES].ledger
    assert ledger is not None
    assert await ledger.flush(30), ledger.health()

    store = await CaptureStore.open(store_url)
    try:
        async def captured() -> bool:
            return await store.get(ours) is not None

        await until(captured, deadline=20)
        by_theirs = await store.get(theirs)
        assert by_theirs is not None
        assert (by_theirs.request_id, by_theirs.upstream_request_id) == (ours, theirs)
        [listed] = await store.list(CaptureFilter(request_id=theirs))
        assert (listed.request_id, listed.upstream_request_id) == (ours, theirs)
    finally:
        await store.close()

    def cli() -> tuple[dict[str, Any], list[dict[str, Any]], list[dict[str, Any]]]:
        shown = _cli("captures", "show", theirs, "--format", "json", "--url", store_url,
                     "--ledger", store_url)
        assert shown.returncode == 0, shown.stderr
        listed = _cli("captures", "list", "--request-id", theirs, "--format", "json",
                      "--url", store_url)
        assert listed.returncode == 0, listed.stderr
        rows = _cli("usage", "--ledger", store_url, "--request-id", theirs, "--format", "json")
        assert rows.returncode == 0, rows.stderr
        return json.loads(shown.stdout), json.loads(listed.stdout), json.loads(rows.stdout)

    shown, listed_json, rows = await asyncio.to_thread(cli)
    assert (shown["request_id"], shown["upstream_request_id"]) == (ours, theirs)
    assert shown["ledger"] is not None and shown["status"] == 400
    assert [r["request_id"] for r in listed_json] == [ours]
    [row] = rows
    assert (row["request_id"], row["upstream_request_id"]) == (ours, theirs)
    assert (row["status"], row["error_class"]) == (400, "context_length")

    # Tokenmeter's own id finds the same row; an id of neither finds nothing (exit 1).
    mine = await asyncio.to_thread(_cli, "usage", "--ledger", store_url, "--request-id", ours,
                                   "--format", "json")
    assert [r["upstream_request_id"] for r in json.loads(mine.stdout)] == [theirs]
    nothing = await asyncio.to_thread(_cli, "usage", "--ledger", store_url, "--request-id",
                                      "req_nobody")
    assert nothing.returncode == 1 and "no row of request 'req_nobody'" in nothing.stderr


async def test_a_table_of_an_earlier_version_gets_the_column_at_open(store_url: str) -> None:
    """An upgraded deployment's captures table (made before this column) is given it when the
    store opens: new captures keep the upstream's id, old ones read as having none."""
    if store_url.startswith("sqlite"):
        columns = _EARLIER.format(t="TEXT", ts="REAL", b="INTEGER", blob="BLOB")
        with sqlite3.connect(store_url.removeprefix("sqlite://")) as db:
            db.execute(f"CREATE TABLE tokenmeter_captures ({columns})")
    else:
        columns = _EARLIER.format(t="text", ts="timestamptz", b="boolean", blob="bytea")
        conn = await asyncpg.connect(store_url)
        try:
            await conn.execute("CREATE SCHEMA tokenmeter_capture; CREATE TABLE "
                               f"tokenmeter_capture.tokenmeter_captures ({columns})")
        finally:
            await conn.close()
    store = await CaptureStore.open(store_url)
    try:
        await store.write([capture("old", 1_764_000_000.0),
                           capture("new", 1_764_000_001.0, upstream_request_id="req_up1")])
        found = await store.get("req_up1")
        assert found is not None and found.request_id == "new"
        old = await store.get("old")
        assert old is not None and old.upstream_request_id is None
        listed = await store.list(CaptureFilter())
        assert [(r.request_id, r.upstream_request_id) for r in listed] == [
            ("new", "req_up1"), ("old", None)]
    finally:
        await store.close()
