"""Hot reload: keys added and removed take effect within a second; a bad file changes nothing."""

from __future__ import annotations

import time
from pathlib import Path

import openai
import pytest
from aiohttp.test_utils import TestServer

from proxy import state as st
from proxy.app import create_app
from proxy.config import load_config
from tests.conftest import ServerFactory, sample
from tests.test_budget import ALICE_KEY, BOB_KEY, MESSAGES, _metrics, budget_yaml, sdk


async def _works(server: TestServer, key: str) -> bool:
    client = sdk(server, key)
    try:
        await client.chat.completions.create(model="mock-gpt", messages=MESSAGES)  # type: ignore[arg-type]
        return True
    except openai.AuthenticationError:
        return False
    finally:
        await client.close()


async def _within_a_second(server: TestServer, key: str, expected: bool) -> float:
    """How long until `key` works (or stops working); fails past one second."""
    start = time.monotonic()
    while await _works(server, key) != expected:
        assert time.monotonic() - start < 1.0, f"{key[:6]}... not {expected} within 1 s"
    return time.monotonic() - start


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
    m = await _metrics(proxy)
    assert sample(m, "tokenmeter_config_reloads_total", result="ok") == 2


async def test_invalid_file_is_refused_and_old_config_serves(
    aiohttp_server: ServerFactory, config_file: Path
) -> None:
    proxy = await aiohttp_server(create_app(load_config(config_file), config_path=config_file))
    before = proxy.app[st.RUNTIME_HOLDER].current
    config_file.write_text(config_file.read_text() + "\nusers: {bad user name!: {}}\n")
    watcher = proxy.app[st.WATCHER]
    watcher.request_reload()  # what SIGHUP does; the poller would also see the change
    start = time.monotonic()
    while sample(await _metrics(proxy), "tokenmeter_config_reloads_total", result="error") < 1:
        assert time.monotonic() - start < 1.0
    assert proxy.app[st.RUNTIME_HOLDER].current is before
    assert await _works(proxy, ALICE_KEY)
    assert not watcher.reload()  # and it says so when asked directly
