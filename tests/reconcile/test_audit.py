"""The proxy reconciling its own books: agreement exports zero drift; usage the store counted
but the ledger never saw, shown by two readings in a row, exports the drift for the alert."""

from __future__ import annotations

import time

from aiohttp.test_utils import TestServer

from proxy.budget import limits as lim
from proxy.budget.store import USER, WindowAmount
from proxy.pipeline import services as st
from proxy.reconcile.audit import Auditor
from tests.helpers import ALICE_KEY, MESSAGES, Stack, StackFactory, make_config, sample, scrape


async def _alice_stack(make_stack: StackFactory, upstream: TestServer) -> Stack:
    config = make_config(str(upstream.make_url("/v1")), store="memory",
                         users={"alice": {"keys": [ALICE_KEY], "daily_tokens": 100_000}},
                         extra={"ledger": {"reconcile_every_s": 0}})
    return await make_stack(config)


async def test_books_that_agree_export_no_drift_and_a_phantom_charge_does(
    make_stack: StackFactory, upstream: TestServer
) -> None:
    stack = await _alice_stack(make_stack, upstream)
    client = stack.client(ALICE_KEY)
    for _ in range(3):
        await client.chat.completions.create(model="mock-gpt", messages=MESSAGES)
    await stack.settled(3)
    svc = stack.app[st.SERVICES]
    assert svc.ledger is not None and await svc.ledger.flush(30)
    config = svc.runtime.current.config
    auditor = Auditor(svc.budget.store, svc.metrics)
    try:
        first = await auditor.once(config)
        assert first is not None and first.agrees
        second = await auditor.once(config)
        assert second is not None and second.agrees
        metrics = await scrape(stack.proxy)
        assert sample(metrics, "tokenmeter_reconcile_drift_tokens", window="daily_tokens") == 0

        # 500 tokens the store counts that no ledger row explains (a lost row, say).
        daily = next(w for w in lim.windows_at(config, "alice", time.time())
                     if w.name is lim.WindowName.DAILY_TOKENS and w.scope == USER)
        plan = lim.plan(config, "alice", lim.limits_for(config, "alice"), "mock-gpt", time.time())
        await svc.budget.store.add_once(plan.slot, "phantom",
                                        [WindowAmount(daily.key, None, 500, daily.ttl_s)])
        await auditor.once(config)  # one reading is not enough: it could be the shipper's lag
        judged = await auditor.once(config)
        assert judged is not None and not judged.agrees
        metrics = await scrape(stack.proxy)
        assert sample(metrics, "tokenmeter_reconcile_drift_tokens", window="daily_tokens") == -500
        assert sample(metrics, "tokenmeter_reconcile_orphans") == 0
        assert any("disagree" in r.getMessage() for r in stack.caplog.records)
    finally:
        await auditor.close()
