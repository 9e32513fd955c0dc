"""The settlement spool under hostile conditions (issue 20, items 11 and 12): a malformed line
never stops a process from starting and is never skipped silently; a full disk with the store
down reports a settlement lost only when it is lost for good."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from proxy.budget.spool import Spool
from proxy.budget.store import Entry, Settlement
from tests.helpers import StackFactory, make_config, redis_int, sample, scrape

SLOT = "tokenmeter:{alice}"
KEY = f"{SLOT}:u:daily_tokens:20261203"


def _entries(amount: int) -> tuple[Entry, ...]:
    return (Entry(KEY, None, amount, 3600),)


@pytest.mark.timeout(60)
async def test_malformed_spool_lines_are_skipped_counted_and_named_not_fatal(
    make_stack: StackFactory, redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    state = Path(os.environ["TOKENMETER_STATE_DIR"])
    # What a previous run left owed: one settlement under its id, one sum of the outage.
    dead = Spool(state)
    dead.open()
    dead.owe(SLOT, "res-good", _entries(40), tokens=40, now=10**10,
             kind=Settlement.ADDITION)
    dead.add(SLOT, _entries(7), tokens=7, now=10**10)
    dead.close()  # a graceful stop: the file stays for the next start to adopt
    (path,) = state.glob("spool-*.jsonl")
    good_lines = path.read_text().count("\n")
    bad = [
        "5",  # valid JSON, not a record: on main, `"o" in 5` raised and every start failed
        json.dumps({"o": SLOT, "i": "res-x", "t": 3}),  # a record missing its entries
        json.dumps({"a": SLOT, "e": [[KEY, "lots", 1e10]], "t": 9}),  # a field of the wrong type
        '{"o":"tokenmeter:{alice}","i":"res-y","t":1030,"e":[["tokenm',  # garbled on disk
        json.dumps({"a": SLOT, "e": [[KEY, 11, 1e10]], "t": 11}),  # a good one after them
    ]
    with path.open("a") as f:
        f.write("\n".join(bad) + "\n")

    caplog.set_level(logging.INFO, logger="tokenmeter")
    config = make_config("http://127.0.0.1:9/v1", store=redis_url)
    stack = await make_stack(config)  # on main: the start raised (TypeError) and never served

    r = aioredis.Redis.from_url(redis_url)
    try:
        assert await redis_int(r, KEY) == 40 + 7 + 11  # every readable settlement replayed
    finally:
        await r.aclose()
    metrics = await scrape(stack.proxy)
    assert sample(metrics, "tokenmeter_settle_spool_bad_lines_total") == 4
    errors = [rec.getMessage() for rec in caplog.records if rec.levelno >= logging.ERROR]
    numbers = ", ".join(str(good_lines + i) for i in (1, 2, 3, 4))
    assert any(str(path) in m and f"line {numbers}" in m for m in errors), errors
    assert (path.parent / (path.name + ".bad")).exists()  # kept for an operator to look at
