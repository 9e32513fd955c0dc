"""`tokenmeter reconcile` with response-cache hits (issue 23), on a real redis-server and rows in
SQLite or a real PostgreSQL: a hit charged nothing (`cache.charge_hits: none`) names no window
and is not counted; one charged in full (`full`) is counted by what it saved (its own token
columns are 0). Either way the books and the store agree; a full hit whose saved columns the
books lost is drift."""

from __future__ import annotations

import time
import uuid

from proxy.budget import limits as lim
from proxy.cost import CostLines
from proxy.ledger.row import LedgerRow
from proxy.protocol.usage import ZERO, Usage
from proxy.reconcile.plan import Verdict
from proxy.reconcile.render import check_json
from tests.reconcile.test_reconcile import World, books, by_label, world  # noqa: F401  fixtures

SAVED = Usage(input_tokens=1000, output_tokens=2000, cached_input_tokens=500)


async def book_hit(w: World, user: str, plan: lim.Plan | None, saved: Usage,
                   saved_cost: int | None) -> None:
    """A hit's row as settle writes it: 0 tokens, what it saved, the windows it charged."""
    end = time.time()
    await w.books.write([LedgerRow(
        request_id=uuid.uuid4().hex, started_at=end - 0.01, ended_at=end, replica="r1",
        user_name=user, key_name=None, team=w.config.users[user].team, operation="chat",
        requested_model="gpt-4o", model=None, response_model=None, upstream=None,
        fallback_from=None, attempts=0, status=200, error_class="none", stream=True,
        input_tokens=0, output_tokens=0, cached_input_tokens=0, reasoning_tokens=0,
        token_source="reported", ttft_ms=0.5, upstream_ttft_ms=None, overhead_ms=None,
        duration_ms=1.0, output_tokens_per_s=None, cost_nanousd=0, price_version="p1",
        windows="" if plan is None else " ".join(x.label for x in plan.windows),
        cache="hit", saved_input_tokens=saved.input_tokens,
        saved_output_tokens=saved.output_tokens,
        saved_cached_input_tokens=saved.cached_input_tokens, saved_cost_nanousd=saved_cost)])


async def test_hits_charged_nothing_or_in_full_agree(world: World) -> None:  # noqa: F811
    price = world.config.prices["gpt-4o"]
    cost = CostLines.of(price, SAVED)
    await world.request("dave")  # a request that went upstream
    # A hit charged nothing: no window, no charge.
    await book_hit(world, "dave", None, SAVED, cost.nanousd)
    # A hit charged in full, with no reservation: an addition of what it saved.
    reservation = world.budget.unreserved(world.principal("dave"), "gpt-4o", world.config)
    await world.budget.settle(reservation, SAVED, cost)
    await book_hit(world, "dave", reservation.plan, SAVED, cost.nanousd)
    r = await world.reconcile()
    assert r.agrees, [check_json(c) for c in r.checks if c.verdict is not Verdict.AGREES]
    (tokens,) = by_label(r, "dave", "u:daily_tokens")
    assert tokens.ledger == tokens.store == 27 + SAVED.total_tokens
    (usd,) = by_label(r, "dave", "u:daily_usd")
    upstream = CostLines.of(price, Usage(input_tokens=20, output_tokens=7,
                                         cached_input_tokens=4)).nanousd
    assert usd.ledger == usd.store == upstream + cost.nanousd


async def test_a_full_hit_booked_without_what_it_saved_is_drift(world: World) -> None:  # noqa: F811
    price = world.config.prices["gpt-4o"]
    reservation = world.budget.unreserved(world.principal("dave"), "gpt-4o", world.config)
    await world.budget.settle(reservation, SAVED, CostLines.of(price, SAVED))
    await book_hit(world, "dave", reservation.plan, ZERO, 0)  # the saved columns lost
    first = await world.reconcile()
    r = await world.reconcile(earlier=first)
    (tokens,) = by_label(r, "dave", "u:daily_tokens")
    assert tokens.verdict is Verdict.DRIFT and tokens.store - tokens.ledger == 3000
