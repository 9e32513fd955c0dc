"""Usage owed to the store survives an outage of any length, a graceful stop and a restart, and
is applied exactly once; the in-process store stays bounded however many requests it serves."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import aiohttp
import redis.asyncio as aioredis
from aiohttp.test_utils import TestServer

from proxy.budget.accounting import Budget
from proxy.budget.admission import Ask
from proxy.budget.limits import daily_key
from proxy.budget.notify import Notifier
from proxy.budget.spool import Debit, SettleSpool
from proxy.budget.store import MemoryStore, SettleKind, WindowAmount
from proxy.budget.usage_report import today
from proxy.config.load import parse_config
from proxy.protocol.translators import ChatTranslator, parse_body
from proxy.protocol.usage import Usage
from proxy.telemetry.metrics import Metrics
from tests.helpers import ALICE_KEY, BOB_KEY, MESSAGES, budget_yaml
from tests.servers import RedisServer, ServedProxy

SLOT = "tokenmeter:{alice}"


def _entries(amount: int, key: str = f"{SLOT}:u:daily_tokens:20261203") -> tuple[WindowAmount, ...]:
    return (WindowAmount(key, None, amount, 3600), WindowAmount(f"{SLOT}:u:requests:20261203", None, 1, 3600))


def _charge(tokens: int, res_id: str = "", kind: SettleKind = SettleKind.ADDITION) -> Debit:
    """A settlement of `tokens` in the day's window and one request."""
    return Debit(slot=SLOT, res_id=res_id, entries=_entries(tokens), tokens=tokens, kind=kind)


def test_an_outage_longer_than_any_count_bound_is_summed_exactly(tmp_path: Path) -> None:
    spool = SettleSpool(tmp_path)
    spool.open()
    for i in range(150_000):  # the old in-memory queue dropped everything past 100,000
        spool.add(_charge(1 + i % 7), now=1000.0)
    expected = sum(1 + i % 7 for i in range(150_000))
    assert spool.pending() == (1, expected)
    # Summed per counter and compacted: the file holds the state, not the history.
    assert spool.path.stat().st_size < 20_000 * 200
    (batch,) = spool.take()
    amounts = {e.key: e.amount for e in batch.entries(now=1000.0)}
    assert amounts[f"{SLOT}:u:daily_tokens:20261203"] == expected
    assert amounts[f"{SLOT}:u:requests:20261203"] == 150_000
    spool.done(batch)
    assert spool.pending() == (0, 0)
    spool.close()
    assert list(tmp_path.glob("spool-*")) == []  # nothing owed, nothing left behind


def test_a_dead_processes_spool_is_adopted_with_the_same_ids(tmp_path: Path) -> None:
    dead = SettleSpool(tmp_path)
    dead.open()
    dead.owe(_charge(40, "res-1", SettleKind.RESERVED), now=1000.0)
    dead.add(_charge(5), now=1000.0)
    dead.add(_charge(6), now=1000.0)
    # Killed: no close(), its lock goes with its file descriptors.
    assert dead._lock is not None and dead._fd >= 0
    dead._lock.close()
    os.close(dead._fd)

    def adopt() -> dict[str, int]:
        heir = SettleSpool(tmp_path)
        heir.open()
        owed = {o.res_id: sum(e.amount for e in o.entries(1000.0) if "daily" in e.key)
                for o in heir.take()}
        heir._lock.close()  # type: ignore[union-attr]  # dies too, before replaying anything
        os.close(heir._fd)
        return owed

    first = adopt()
    assert first["res-1"] == 40 and sorted(first.values()) == [11, 40]
    # Adopted again (a crash before replay): the same ids, which the store applies once.
    assert adopt() == first


def test_a_live_processes_spool_is_not_adopted(tmp_path: Path) -> None:
    live = SettleSpool(tmp_path)
    live.open()
    live.add(_charge(5), now=1000.0)
    other = SettleSpool(tmp_path)
    other.open()
    assert other.pending() == (0, 0)
    assert live.pending() == (1, 5)
    other.close()
    live.close()


async def test_the_in_process_store_stays_bounded_over_30000_requests() -> None:
    """Marks and counters expire in time order: after 30,000 requests (marks live 600 s, a
    request every 0.05 s) the structures hold what is alive, and no more."""
    now = [1_796_000_000.0]
    store = MemoryStore(lambda: now[0])
    budget = Budget(store, Metrics(), Notifier(Metrics(), lambda: [], lambda: None, lambda: None),
                    clock=lambda: now[0])
    text = budget_yaml("http://127.0.0.1:9/v1", "memory", f"""
  alice:
    keys: ["{ALICE_KEY}"]
    tokens_per_minute: 100000000
    requests_per_minute: 100000000
  bob:
    keys: ["{BOB_KEY}"]
    daily_tokens: 100000000
""")
    config = parse_config(text)
    from proxy.auth import UserIndex

    users = UserIndex(config)
    principals = [users._by_hash[k] for k in list(users._by_hash)]
    translator = ChatTranslator(parse_body(
        b'{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":5}'
    ))
    peak = 0
    for i in range(30_000):
        principal = principals[i % len(principals)]
        plan = budget.plan(principal, translator.model, config)
        output = translator.max_output(plan.output_cap)
        ask = Ask(principal=principal, model=translator.model, plan=plan, prompt_tokens=3,
                  asked_output=output, choices=1, stream=False, hidden_output=False)
        reservation = await budget.reserve(ask, config)
        await budget.settle(reservation, Usage(3, 5), None)
        now[0] += 0.05
        if i >= 20_000:
            snapshot = await store.snapshot(plan.slot, [])
            assert not snapshot.holds and not snapshot.reaped  # every reservation settled
            peak = max(peak, snapshot.size)
    alive_marks = int(600 / 0.05) + 10
    # Per user: 3 daily counters and, for alice, 2 minute windows of which at most 3 minutes
    # are alive at once (each lives to the end of its minute plus 60 s).
    assert peak <= alive_marks + 2 * 3 + 2 + 2 * 3


async def _redis_daily(r: aioredis.Redis, text: str) -> int:
    key = daily_key("tokenmeter", "alice", "daily_tokens",
                    today(parse_config(text), time.time()).strftime("%Y%m%d"))
    return int(await r.get(key) or 0)


async def test_usage_owed_during_an_outage_survives_sigterm_and_restart(
    upstream: TestServer, tmp_path: Path
) -> None:
    redis_server = RedisServer(persistent=True)
    redis_server.start()
    users = f'  alice:\n    keys: ["{ALICE_KEY}"]\n    daily_tokens: 10000000\n'
    text = budget_yaml(str(upstream.make_url("/v1")), redis_server.url, users, timeout_ms=300)
    cfg = tmp_path / "tm.yaml"
    cfg.write_text(text)
    state = tmp_path / "state"
    env = {"TOKENMETER_STATE_DIR": str(state)}
    first = ServedProxy(cfg, tmp_path / "first.log", env=env)
    second = ServedProxy(cfg, tmp_path / "second.log", env=env, port=first.port)
    url = f"{first.url}/v1/chat/completions"
    auth = {"Authorization": f"Bearer {ALICE_KEY}"}
    r = aioredis.Redis.from_url(redis_server.url)
    try:
        await first.started()
        total: int = 0  # declared: the closure below would see the Any of resp.json()
        async with aiohttp.ClientSession() as s:
            async with s.post(url, json={"model": "mock-gpt", "messages": MESSAGES},
                              headers=auth) as resp:
                total += (await resp.json())["usage"]["total_tokens"]
            assert await _redis_daily(r, text) == total
            redis_server.stop()  # the outage
            for _ in range(300):
                async with s.post(url, json={"model": "mock-gpt", "messages": MESSAGES},
                                  headers=auth) as resp:
                    assert resp.status == 200
                    total += (await resp.json())["usage"]["total_tokens"]
        code = await first.stopped(signal.SIGTERM)  # a rolling restart during the outage
        err = first.log_text()
        assert code == 0, err
        assert "owed to the budget store" in err  # and it says where they wait
        assert list(state.glob("spool-*.jsonl"))  # on main: nothing kept, 7,500 tokens lost

        redis_server.start()
        await r.aclose()
        r = aioredis.Redis.from_url(redis_server.url)  # the old connection died with the server
        await second.started()

        async def replayed() -> bool:
            return await _redis_daily(r, text) >= total

        async with asyncio.timeout(30):
            while not await replayed():  # noqa: ASYNC110 (the counter lives in Redis)
                await asyncio.sleep(0.05)
        assert await _redis_daily(r, text) == total  # exactly once
        assert await second.stopped(signal.SIGTERM) == 0
        assert list(state.glob("spool-*")) == []  # nothing owed any more
    finally:
        first.kill()
        second.kill()
        await r.aclose()
        redis_server.stop()
