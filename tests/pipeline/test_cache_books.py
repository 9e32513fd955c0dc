"""The books of a response-cache hit (issue 23), through the real settle of a served proxy: a
real redis-server for the budget, the SQLite ledger, the openai SDK for the request that made
the answer, and the settle of a hit as the cache hands it over (a `Settlement` whose
`CacheOutcome` is a hit; the cache core builds the same in its handler).

A hit books 0 upstream tokens, what it saved and that at the day's price; the budget is charged
nothing under `cache.charge_hits: none` and the saved usage under `full`; the metrics count it
apart (its latency in its own histograms); reconcile finds the books and the store agree.
"""

from __future__ import annotations

import json
import sqlite3
import time
from contextlib import closing
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo

import pytest
from aiohttp.test_utils import TestServer, make_mocked_request

from proxy.budget.admission import Ask
from proxy.budget.usage_report import read_usage
from proxy.cost import CostLines
from proxy.errors import ErrorClass
from proxy.ids import new_id
from proxy.ledger.query import locate, open_reader
from proxy.ledger.row import COLUMNS
from proxy.ledger.schema import TABLE
from proxy.pipeline import services as st
from proxy.pipeline.context import Candidacy, Charge, Settlement
from proxy.pipeline.settle import settle
from proxy.protocol.translators import ChatTranslator, parse_body
from proxy.protocol.usage import Usage
from proxy.reconcile.plan import Verdict, reconcile
from proxy.reconcile.render import check_json
from proxy.record import CacheOutcome, CacheResult
from proxy.server.app import create_app
from proxy.telemetry.meter import RequestMeter
from tests.helpers import ALICE_KEY, ServerFactory, make_config, sample, scrape, sdk, settled

PRICE = {"input": 2.5, "output": 10.0, "cached_input": 1.25}
# What the stored answer used when it was made: odd counts, so a cost off by a token shows.
SAVED = Usage(input_tokens=1234, output_tokens=567, cached_input_tokens=200, reasoning_tokens=0)


def noon_zone() -> str:
    """A fixed-offset zone where it is now between 12:00 and 13:00: the test's day cannot end
    between the requests and the reading of its counters."""
    offset = 12 - datetime.now(UTC).hour
    return "Etc/GMT" if offset == 0 else f"Etc/GMT{-offset:+d}"


async def _proxy(aiohttp_server: ServerFactory, upstream: TestServer, redis_url: str,
                 tmp_path: Path, charge: str) -> TestServer:
    config = make_config(
        str(upstream.make_url("/v1")), store=redis_url,
        users={"alice": {"keys": [ALICE_KEY], "daily_tokens": 10_000_000, "daily_usd": 100.0}},
        extra={"prices": {"mock-*": PRICE}, "timezone": noon_zone(),
               "ledger": {"url": f"sqlite://{tmp_path / 'ledger.sqlite3'}"},
               "cache": {"enabled": True, "charge_hits": charge}})
    return await aiohttp_server(create_app(config))


def _hit(proxy: TestServer) -> Settlement:
    """A streamed answer replayed from an entry: no candidacy, no upstream call."""
    runtime = proxy.app[st.SERVICES].runtime.current
    principal = runtime.users.authenticate(
        make_mocked_request("POST", "/v1/chat/completions",
                            headers={"Authorization": f"Bearer {ALICE_KEY}"}))
    meter = RequestMeter()
    meter.content(time.perf_counter())  # the replay's first content chunk went out
    meter.finish()
    return Settlement(
        request_id=new_id(), operation="chat", runtime=runtime, principal=principal,
        request_model="mock-gpt", stream=True, candidacy=None, status=200,
        error_class=ErrorClass.NONE, charge=Charge.NOTHING, meter=meter, fallback_from=None,
        attempts=0, cache=CacheOutcome(CacheResult.HIT, SAVED, age_s=12.5))


def _row(path: Path, request_id: str) -> dict[str, Any]:
    with closing(sqlite3.connect(path)) as db:
        found = db.execute(f"SELECT {', '.join(COLUMNS)} FROM {TABLE} WHERE request_id = ?",
                           (request_id,)).fetchone()
    assert found is not None, request_id
    return dict(zip(COLUMNS, found, strict=True))


@pytest.mark.parametrize("charge", ["none", "full"])
async def test_a_hit_is_booked_counted_and_charged_as_configured(
        aiohttp_server: ServerFactory, upstream: TestServer, redis_url: str, tmp_path: Path,
        charge: str) -> None:
    proxy = await _proxy(aiohttp_server, upstream, redis_url, tmp_path, charge)
    svc = proxy.app[st.SERVICES]
    config = svc.runtime.current.config
    today = datetime.now(ZoneInfo(config.timezone)).date()
    # The request that made the answer: a real one, upstream, charged.
    async with sdk(proxy, ALICE_KEY) as client:
        chunks = await client.chat.completions.create(
            model="mock-gpt", messages=[{"role": "user", "content": "hello"}], stream=True,
            stream_options={"include_usage": True})
        async for _ in chunks:
            pass
    await settled(proxy.app, 1)
    (before,) = await read_usage(config, svc.budget.store, today)
    assert before.tokens > 0

    done = _hit(proxy)
    await settle(done, svc)

    # The budget: nothing under `none`; the saved usage under `full`.
    (after,) = await read_usage(config, svc.budget.store, today)
    moved = after.tokens - before.tokens
    assert moved == (0 if charge == "none" else SAVED.total_tokens)

    # The row: a hit, 0 upstream tokens, what it saved at the day's price.
    ledger = svc.ledger
    assert ledger is not None
    assert await ledger.flush(30)
    row = _row(tmp_path / "ledger.sqlite3", done.request_id)
    price = svc.runtime.current.price_for("mock-gpt")
    assert price is not None
    assert row["cache"] == "hit"
    assert (row["input_tokens"], row["output_tokens"], row["cached_input_tokens"]) == (0, 0, 0)
    assert row["cost_nanousd"] == 0
    assert (row["saved_input_tokens"], row["saved_output_tokens"],
            row["saved_cached_input_tokens"]) == (1234, 567, 200)
    # (1034 x 2.5 + 200 x 1.25 + 567 x 10) / 1e6 USD, to the nano-dollar.
    assert row["saved_cost_nanousd"] == CostLines.of(price, SAVED).nanousd == 8_505_000
    assert (row["windows"] == "") is (charge == "none")
    # The request before it (sampled: no temperature, so 1): passed by, nothing saved.
    with closing(sqlite3.connect(tmp_path / "ledger.sqlite3")) as db:
        (others,) = db.execute(f"SELECT count(*) FROM {TABLE} WHERE cache = 'bypass' AND "
                               "saved_input_tokens = 0 AND saved_cost_nanousd IS NULL "
                               "AND input_tokens > 0").fetchone()
    assert others == 1

    # The metrics: the hit counted, what it saved; its latency apart from the upstream's.
    m = await scrape(proxy)
    assert sample(m, "tokenmeter_cache_requests_total", result="hit", model="mock-gpt") == 1
    assert sample(m, "tokenmeter_cache_requests_total", result="miss") == 0
    assert sample(m, "tokenmeter_cache_saved_tokens_total", type="input", user="alice") == 1234
    assert sample(m, "tokenmeter_cache_saved_tokens_total", type="output") == 567
    assert sample(m, "tokenmeter_cache_saved_cost_usd_total") == pytest.approx(0.008505)
    assert sample(m, "tokenmeter_cache_hit_ttft_seconds_count", model="mock-gpt") == 1
    assert sample(m, "tokenmeter_cache_hit_duration_seconds_count") == 1
    # Only the upstream's answer is in the upstream's and the proxy's latency histograms.
    assert sample(m, "gen_ai_server_time_to_first_token_seconds_count") == 1
    assert sample(m, "gen_ai_server_request_duration_seconds_count") == 1
    assert sample(m, "tokenmeter_upstream_time_to_first_token_seconds_count") == 1
    # The hit is a request like any other, and spent no tokens.
    assert sample(m, "tokenmeter_requests_total", user="alice", status="200") == 2
    assert sample(m, "tokenmeter_tokens_total", type="input") == row_tokens_of_the_miss(
        tmp_path / "ledger.sqlite3")

    # Reconcile: the books and the store agree either way (a hit charged nothing names no
    # window; one charged in full counts what it saved).
    async with await open_reader(locate(config.ledger)) as reader:
        r = await reconcile(config, svc.budget.store, reader, today)
    judged = [c for c in r.checks if c.user == "alice" and not c.quiet]
    assert judged
    assert all(c.verdict is Verdict.AGREES for c in judged), [check_json(c) for c in judged]
    (daily,) = [c for c in judged if c.window == "daily_tokens"]
    assert daily.ledger == after.tokens


@pytest.mark.parametrize("charge", ["none", "full"])
async def test_a_hit_after_admission_gives_back_or_settles_its_reservation(
        aiohttp_server: ServerFactory, upstream: TestServer, redis_url: str, tmp_path: Path,
        charge: str) -> None:
    """A cache that answers after admission reserved the request: under `none` the
    reservation is given back whole, under `full` it is settled to the saved usage."""
    proxy = await _proxy(aiohttp_server, upstream, redis_url, tmp_path, charge)
    svc = proxy.app[st.SERVICES]
    runtime = svc.runtime.current
    config = runtime.config
    today = datetime.now(ZoneInfo(config.timezone)).date()
    done = _hit(proxy)
    assert done.principal is not None
    plan = svc.budget.plan(done.principal, "mock-gpt", config)
    reservation = await svc.budget.reserve(
        Ask(principal=done.principal, model="mock-gpt", plan=plan, prompt_tokens=40,
            asked_output=500, choices=1, stream=True, hidden_output=False), config)
    route = runtime.router.resolve("mock-gpt")
    assert route is not None
    translator = ChatTranslator(parse_body(json.dumps(
        {"model": "mock-gpt", "messages": [{"role": "user", "content": "hello"}]}).encode()))
    (held,) = await read_usage(config, svc.budget.store, today)
    assert held.tokens == 540  # the worst case, held while the request runs

    await settle(replace(done, candidacy=Candidacy(route, "mock-gpt", translator, reservation)),
                 svc)

    (after,) = await read_usage(config, svc.budget.store, today)
    assert after.tokens == (0 if charge == "none" else SAVED.total_tokens)
    assert await svc.budget.store.leases(plan.slot) == {}  # nothing left held
    ledger = svc.ledger
    assert ledger is not None
    assert await ledger.flush(30)
    row = _row(tmp_path / "ledger.sqlite3", done.request_id)
    assert (row["cache"], row["input_tokens"], row["saved_output_tokens"]) == ("hit", 0, 567)
    assert (row["windows"] == "") is (charge == "none")


def row_tokens_of_the_miss(path: Path) -> int:
    with closing(sqlite3.connect(path)) as db:
        (tokens,) = db.execute(f"SELECT sum(input_tokens) FROM {TABLE}").fetchone()
    return int(tokens)
