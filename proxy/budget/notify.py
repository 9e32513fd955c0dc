"""Tell someone when a user crosses a share of the daily quota: once per threshold per day,
across all replicas (the store marks each crossing), as a log line and an optional webhook."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import TYPE_CHECKING

import aiohttp

from proxy.budget.limits import Window
from proxy.budget.store import Store, StoreError
from proxy.telemetry.metrics import Metrics

if TYPE_CHECKING:
    from collections.abc import Callable

log = logging.getLogger("tokenmeter.alerts")


class Notifier:
    def __init__(self, metrics: Metrics, thresholds: Callable[[], list[float]],
                 webhook_url: Callable[[], str | None],
                 session: Callable[[], aiohttp.ClientSession | None]) -> None:
        self._metrics = metrics
        self._thresholds = thresholds
        self._webhook_url = webhook_url
        self._session = session
        self._tasks: set[asyncio.Task[None]] = set()

    async def check(self, store: Store, user: str, window: Window, used: int) -> None:
        assert window.limit
        for threshold in self._thresholds():
            if used < threshold * window.limit:
                break
            # The window key names the day, so the mark does too.
            mark = f"{window.key}:notified:{threshold:g}"
            try:
                first = await store.mark_once(mark, window.ttl_s)
            except StoreError as exc:
                log.error("could not record quota notice for %s: %s", user, exc)
                continue
            if first:
                self._notify(user, window, used, threshold)

    def _notify(self, user: str, window: Window, used: int, threshold: float) -> None:
        assert window.limit
        event = {
            "event": "budget_threshold",
            "user": user,
            "window": window.name,
            "threshold": threshold,
            "used": used,
            "limit": window.limit,
            "fraction": round(used / window.limit, 4),
        }
        self._metrics.threshold_crossed(user, threshold)
        log.warning(json.dumps(event, separators=(",", ":")))
        url, session = self._webhook_url(), self._session()
        if url and session is not None:
            task = asyncio.create_task(self._post(session, url, event))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _post(self, session: aiohttp.ClientSession, url: str,
                    event: dict[str, object]) -> None:
        try:
            async with session.post(url, json=event, timeout=aiohttp.ClientTimeout(total=10)) as r:
                if r.status >= 300:
                    log.error("quota webhook answered %s", r.status)
        except (aiohttp.ClientError, TimeoutError) as exc:
            log.error("quota webhook failed: %s", exc)
