"""Hot reload: keys added and removed take effect within a second; a bad file changes nothing."""

from __future__ import annotations

import asyncio
import logging
from datetime import datetime
from pathlib import Path
from zoneinfo import ZoneInfo

import openai
import pytest
from aiohttp.test_utils import TestServer

from proxy.config.load import load_config, parse_config
from proxy.pipeline.services import SERVICES
from proxy.server import reload as reload_mod
from proxy.server import state as st
from proxy.server.app import Placement, create_app
from proxy.server.reload import Poll
from tests.helpers import (
    ALICE_KEY,
    BOB_KEY,
    MESSAGES,
    FakeClock,
    ServerFactory,
    budget_yaml,
    sample,
    scrape,
    sdk,
    until,
)

CAROL_KEY = "sk-carol-0123456789"


async def _works(server: TestServer, key: str) -> bool:
    client = sdk(server, key)
    try:
        await client.chat.completions.create(model="mock-gpt", messages=MESSAGES)
        return True
    except openai.AuthenticationError:
        return False
    finally:
        await client.close()


async def _within_a_second(server: TestServer, key: str, expected: bool) -> None:
    """Until `key` works (or stops working). The poller looks every second (the feature); the
    deadline is generous, since a loaded machine may run the poll late, and that is not a bug."""

    async def settled() -> bool:
        return await _works(server, key) == expected

    await until(settled, deadline=10.0)


def _users(*keys: tuple[str, str]) -> str:
    return "".join(f'  {u}:\n    keys: ["{k}"]\n' for u, k in keys)


@pytest.fixture
def config_file(tmp_path: Path, upstream: TestServer) -> Path:
    path = tmp_path / "tm.yaml"
    path.write_text(budget_yaml(str(upstream.make_url("/v1")), "memory", _users(("alice", ALICE_KEY))))
    return path


async def test_keys_added_and_removed_within_a_second(
    aiohttp_server: ServerFactory, upstream: TestServer, config_file: Path
) -> None:
    proxy = await aiohttp_server(create_app(load_config(config_file), config_path=config_file))
    url = str(upstream.make_url("/v1"))
    assert await _works(proxy, ALICE_KEY) and not await _works(proxy, BOB_KEY)

    config_file.write_text(budget_yaml(url, "memory", _users(("alice", ALICE_KEY), ("bob", BOB_KEY))))
    await _within_a_second(proxy, BOB_KEY, True)

    config_file.write_text(budget_yaml(url, "memory", _users(("bob", BOB_KEY))))
    await _within_a_second(proxy, ALICE_KEY, False)
    assert await _works(proxy, BOB_KEY)
    m = await scrape(proxy)
    assert sample(m, "tokenmeter_config_reloads_total", result="ok") == 2


async def test_invalid_file_is_refused_and_old_config_serves(
    aiohttp_server: ServerFactory, config_file: Path
) -> None:
    proxy = await aiohttp_server(create_app(load_config(config_file), config_path=config_file))
    before = proxy.app[SERVICES].runtime.current
    config_file.write_text(config_file.read_text() + "\nusers: {bad user name!: {}}\n")
    watcher = proxy.app[st.WATCHER]
    watcher.request_reload()  # what SIGHUP does; the poller would also see the change

    async def refused() -> bool:
        return sample(await scrape(proxy), "tokenmeter_config_reloads_total",
                      result="error") >= 1

    await until(refused, deadline=10.0)
    assert proxy.app[SERVICES].runtime.current is before
    assert await _works(proxy, ALICE_KEY)
    watcher.request_reload()  # and it says so when asked directly
    assert await watcher.poll_once() is Poll.REFUSED


# Deterministic polls: the background poller is parked (an hour between looks) and the test
# calls `poll_once()` itself, exactly as the run loop does.
@pytest.fixture
def manual_polls(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(reload_mod, "POLL_SECONDS", 3600.0)


async def _reloads(proxy: TestServer, result: str) -> float:
    return sample(await scrape(proxy), "tokenmeter_config_reloads_total", result=result)


@pytest.mark.usefixtures("manual_polls")
async def test_half_written_file_is_never_applied(
    aiohttp_server: ServerFactory, upstream: TestServer, tmp_path: Path
) -> None:
    async with asyncio.timeout(30):
        url = str(upstream.make_url("/v1"))
        path = tmp_path / "tm.yaml"
        path.write_text(budget_yaml(url, "memory", _users(("alice", ALICE_KEY), ("bob", BOB_KEY))))
        proxy = await aiohttp_server(create_app(load_config(path), config_path=path))
        watcher = proxy.app[st.WATCHER]
        assert await watcher.poll_once() is Poll.UNCHANGED

        # A two-step write: truncate, then the users section cut after alice (valid YAML and a
        # valid config, without bob), then the rest. Each step is seen by one poll only.
        full = budget_yaml(
            url, "memory", _users(("alice", ALICE_KEY), ("bob", BOB_KEY), ("carol", CAROL_KEY))
        )
        partial = full[: full.index("  bob:")]
        assert parse_config(partial).users.keys() == {"alice"}
        path.write_text("")
        assert await watcher.poll_once() is Poll.SETTLING
        path.write_text(partial)
        assert await watcher.poll_once() is Poll.SETTLING
        assert await _works(proxy, BOB_KEY)  # the partial version was not applied
        path.write_text(full)
        assert await watcher.poll_once() is Poll.SETTLING  # new again: wait one more poll
        assert await watcher.poll_once() is Poll.APPLIED  # the same bytes twice: complete
        assert await watcher.poll_once() is Poll.UNCHANGED
        assert await _works(proxy, CAROL_KEY) and await _works(proxy, BOB_KEY)
        assert await _reloads(proxy, "ok") == 1  # only the complete version was loaded
        assert await _reloads(proxy, "error") == 0  # and the empty file was never tried


@pytest.mark.usefixtures("manual_polls")
async def test_sighup_loads_at_once_and_refused_file_is_not_retried(
    aiohttp_server: ServerFactory, upstream: TestServer, config_file: Path
) -> None:
    async with asyncio.timeout(30):
        proxy = await aiohttp_server(create_app(load_config(config_file), config_path=config_file))
        watcher = proxy.app[st.WATCHER]
        url = str(upstream.make_url("/v1"))
        config_file.write_text(
            budget_yaml(url, "memory", _users(("alice", ALICE_KEY), ("bob", BOB_KEY)))
        )
        watcher.request_reload()  # SIGHUP: no waiting for a second poll
        assert await watcher.poll_once() is Poll.APPLIED
        assert await _works(proxy, BOB_KEY)
        watcher.request_reload()  # even unchanged bytes (an env var it names may have changed)
        assert await watcher.poll_once() is Poll.APPLIED
        assert await _reloads(proxy, "ok") == 2

        config_file.write_text(config_file.read_text() + "\nusers: {}\n")  # `users` twice
        assert await watcher.poll_once() is Poll.SETTLING
        assert await watcher.poll_once() is Poll.REFUSED
        assert await watcher.poll_once() is Poll.UNCHANGED  # logged and counted once, not per poll
        assert await _reloads(proxy, "error") == 1
        assert await _works(proxy, BOB_KEY)


@pytest.mark.usefixtures("manual_polls")
async def test_store_prefix_change_waits_for_restart(
    aiohttp_server: ServerFactory, upstream: TestServer, tmp_path: Path, store_url: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    async with asyncio.timeout(30):
        url = str(upstream.make_url("/v1"))
        path = tmp_path / "tm.yaml"
        alice = f'  alice:\n    keys: ["{ALICE_KEY}"]\n    daily_tokens: 60\n'
        limits = "defaults:\n  max_output_tokens: 16\n"
        path.write_text(budget_yaml(url, store_url, alice, limits))
        clock = FakeClock(datetime(2026, 12, 2, 12, 0, tzinfo=ZoneInfo("UTC")))
        proxy = await aiohttp_server(
            create_app(load_config(path), config_path=path, clock=clock)
        )
        client = sdk(proxy, ALICE_KEY)
        for _ in range(10):  # exhaust alice's day
            try:
                await client.chat.completions.create(model="mock-gpt", messages=MESSAGES)
            except openai.RateLimitError as exc:
                assert exc.code == "daily_quota_exceeded"
                break
        else:
            pytest.fail("alice was never refused")

        # Same users plus bob, and another key prefix (which would be a fresh set of counters).
        bob = f'  bob:\n    keys: ["{BOB_KEY}"]\n'
        path.write_text(
            budget_yaml(url, store_url, alice + bob, limits).replace(
                "  lease_seconds: 30\n", "  lease_seconds: 30\n  prefix: other\n"
            )
        )
        caplog.set_level(logging.WARNING, logger="tokenmeter")
        watcher = proxy.app[st.WATCHER]
        watcher.request_reload()
        assert await watcher.poll_once() is Poll.APPLIED
        assert await _works(proxy, BOB_KEY)  # the rest of the new version is live
        assert proxy.app[SERVICES].runtime.current.config.store.prefix == "tokenmeter"
        with pytest.raises(openai.RateLimitError) as err:  # and alice's day is not reset
            await client.chat.completions.create(model="mock-gpt", messages=MESSAGES)
        assert err.value.code == "daily_quota_exceeded"
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert any("store.prefix" in w and "restart" in w for w in warnings), warnings
        assert not any(store_url in w for w in warnings if store_url != "memory")
        await client.close()


@pytest.mark.usefixtures("manual_polls")
async def test_sighup_on_a_missing_file_is_refused_and_said(
    aiohttp_server: ServerFactory, config_file: Path
) -> None:
    async with asyncio.timeout(30):
        proxy = await aiohttp_server(create_app(load_config(config_file), config_path=config_file))
        before = proxy.app[SERVICES].runtime.current
        watcher = proxy.app[st.WATCHER]
        config_file.unlink()  # mid-replace, or a wrong path after a deploy
        assert await watcher.poll_once() is Poll.MISSING
        assert await _reloads(proxy, "error") == 0  # a poll that finds no file waits quietly
        watcher.request_reload()
        assert await watcher.poll_once() is Poll.MISSING
        assert await _reloads(proxy, "error") == 1  # SIGHUP was asked for: it is counted
        assert proxy.app[SERVICES].runtime.current is before
        assert await _works(proxy, ALICE_KEY)


async def test_a_worker_refuses_a_reload_that_adds_limits_on_the_in_process_store(
    aiohttp_server: ServerFactory, upstream: TestServer, tmp_path: Path,
) -> None:
    """Under `serve --workers 2` each worker's in-process store is its own: a limit added by a
    reload would be kept twice over. The reload is refused; the running version serves on."""
    url = str(upstream.make_url("/v1"))
    path = tmp_path / "tm.yaml"
    path.write_text(budget_yaml(url, "memory", _users(("alice", ALICE_KEY))))
    app = create_app(load_config(path), config_path=path,
                     placement=Placement(workers=2, audit=False))
    proxy = await aiohttp_server(app)
    path.write_text(budget_yaml(url, "memory", _users(("alice", ALICE_KEY))
                                + "    daily_tokens: 10\n"))
    watcher = app[st.WATCHER]
    watcher.request_reload()
    assert await watcher.poll_once() is Poll.REFUSED
    assert sample(await scrape(proxy), "tokenmeter_config_reloads_total", result="error") == 1
    assert await _works(proxy, ALICE_KEY)  # no limit: the previous version serves
