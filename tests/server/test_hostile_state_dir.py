"""/readyz is not ready while the state directory cannot be written (issue 20, item 22): a proxy
that cannot write its ledger spool drops every row, and one that cannot write its settlement
spool loses what the store is owed during an outage; it must not take traffic quietly.

The tests run as root, which writes through any permission bits, so the directory is made
unwritable the way root cannot get around: something that is not a directory stands in its
path. (Under the image's uid 10001 a root-owned volume fails the same access(2) check.)"""

from __future__ import annotations

from pathlib import Path

import aiohttp
import pytest
from aiohttp.test_utils import TestServer

from proxy.server.app import create_app
from tests.helpers import ServerFactory, make_config

pytestmark = pytest.mark.timeout(60)


async def _readyz(server: TestServer) -> tuple[int, dict[str, object]]:
    async with aiohttp.ClientSession() as session, session.get(server.make_url("/readyz")) as r:
        return r.status, await r.json()


async def test_an_unwritable_state_dir_is_not_ready(
    aiohttp_server: ServerFactory, upstream: TestServer, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    monkeypatch.setenv("TOKENMETER_STATE_DIR", str(blocker / "state"))
    proxy = await aiohttp_server(create_app(make_config(str(upstream.make_url("/v1")))))
    status, body = await _readyz(proxy)
    assert status == 503, body
    assert body["status"] == "unavailable"
    assert isinstance(body["state_dir"], str) and body["state_dir"]


async def test_an_unwritable_ledger_spool_is_not_ready(
    aiohttp_server: ServerFactory, upstream: TestServer, tmp_path: Path,
) -> None:
    """The ledger's own spool_dir, apart from the state directory."""
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    spool = blocker / "spool"
    config = make_config(str(upstream.make_url("/v1")),
                         extra={"ledger": {"spool_dir": str(spool)}})
    proxy = await aiohttp_server(create_app(config))
    status, body = await _readyz(proxy)
    assert status == 503, body
    assert str(spool) in str(body["state_dir"])


async def test_a_writable_state_dir_is_ready(
    aiohttp_server: ServerFactory, upstream: TestServer, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Not there yet, but it can be created: ready (the spools create it).
    monkeypatch.setenv("TOKENMETER_STATE_DIR", str(tmp_path / "new" / "state"))
    proxy = await aiohttp_server(create_app(make_config(str(upstream.make_url("/v1")))))
    status, body = await _readyz(proxy)
    assert status == 200, body
    assert "state_dir" not in body
