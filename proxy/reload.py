"""Hot reload of the configuration file: on change (polled) and on SIGHUP.

A new version is parsed and validated whole; only then is the app's `Runtime` swapped, so a
request in flight finishes under the version it started with and the next one sees the new
one. An invalid file is refused, logged and counted, and the previous version keeps serving.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
from collections.abc import Callable
from pathlib import Path

from proxy.config import Config, ConfigError, load_config
from proxy.metrics import Metrics

log = logging.getLogger("tokenmeter.reload")

POLL_SECONDS = 0.25  # a changed key takes effect well within a second


class ConfigWatcher:
    def __init__(self, path: Path, apply: Callable[[Config], None], metrics: Metrics) -> None:
        self.path = path
        self._apply = apply
        self._metrics = metrics
        self._digest = self._read_digest()
        self._changed = asyncio.Event()

    def _read_digest(self) -> bytes | None:
        try:
            return hashlib.sha256(self.path.read_bytes()).digest()
        except OSError:
            return None

    def request_reload(self) -> None:
        """SIGHUP: reload even if the content looks unchanged (e.g. an env var changed)."""
        self._digest = None
        self._changed.set()

    def reload(self) -> bool:
        try:
            config = load_config(self.path)
        except ConfigError as exc:
            self._metrics.config_reloads.labels("error").inc()
            log.error("configuration reload refused, the previous version keeps serving: %s", exc)
            return False
        self._apply(config)
        self._metrics.config_reloads.labels("ok").inc()
        log.info("configuration reloaded from %s", self.path)
        return True

    async def run(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), POLL_SECONDS)
            self._changed.clear()
            digest = self._read_digest()
            if digest is None or digest == self._digest:
                continue
            self._digest = digest
            self.reload()
