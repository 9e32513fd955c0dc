"""Issue 20, item 4: a reload of 10,000 users and 30,000 keys is built off the event loop.

A real proxy process serves a generated configuration of 10,000 users with three keys each
(30,000 keys: plain strings and mappings with limits of their own, users in teams). While a
storm of SIGHUPs and file rewrites hits it, another client's small requests must each be
answered within 2 s (a build on the loop stalls every request for the whole 7-9 s build, a
storm for tens of seconds; a loaded 2-core machine delays a request by up to about 0.8 s), the storm must cost a few builds rather than one per signal, and the file
written last must be the one in force afterwards. A bad file during a storm keeps the running
version serving.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest
from aiohttp.test_utils import TestServer
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers import timed_client, until
from tests.servers import free_port, wait_for_port

USERS = 10_000
# Far below the 7-9 s a build on the loop stalls a request, far above what a loaded machine
# adds (0.8 s seen with two test workers and two other processes busy on 2 cores).
STORM_BOUND_S = 2.0
STABLE_KEY = "sk-user00000-key0-abcdefghijkl"  # in every version


def _marker_key(version: str) -> str:
    return f"sk-marker-{version}-abcdefghijkl"


def _base_config(upstream_url: str) -> str:
    """10,000 users, 30,000 keys; `users:` last, so a version can append a user of its own."""
    out = [
        f"upstreams:\n  mock:\n    base_url: {upstream_url}\n",
        "metrics:\n  discover_models: false\n",
        "defaults:\n  max_output_tokens: 4096\n",
        "teams:\n  t0:\n    daily_tokens: 100000000\n",
        "".join(f"  t{t}: {{}}\n" for t in range(1, 50)),  # every user's team is listed
        "users:\n",
    ]
    for u in range(USERS):
        out.append(f"  user{u:05d}:\n    daily_tokens: 1000000\n    team: t{u % 50}\n"
                   f"    keys:\n      - sk-user{u:05d}-key0-abcdefghijkl\n")
        out.extend(f"      - key: sk-user{u:05d}-key{k}-abcdefghijkl\n        name: k{k}\n"
                   f"        daily_tokens: 500000\n" for k in (1, 2))
    return "".join(out)


def _version(base: str, version: str) -> str:
    """The base plus one user whose key only this version has."""
    return base + f"  marker-{version}:\n    keys: [{_marker_key(version)}]\n"


def _write(path: Path, text: str) -> None:
    """Whole or not at all (as `kubectl`'s ConfigMap swap or an editor's rename)."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


@dataclass
class Proxy:
    proc: subprocess.Popen[bytes]
    port: int
    config: Path
    log: Path
    sighups: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def sighup(self) -> None:
        self.proc.send_signal(signal.SIGHUP)
        self.sighups += 1

    async def ask(self, session: aiohttp.ClientSession, key: str) -> int:
        """A small chat request; its status."""
        async with session.post(
            f"{self.url}/v1/chat/completions",
            json={"model": "mock-gpt", "messages": [{"role": "user", "content": "hi"}],
                  "max_tokens": 4},
            headers={"Authorization": f"Bearer {key}", "x-mock-output-tokens": "2"},
        ) as resp:
            await resp.read()
            return resp.status

    async def reloads(self, session: aiohttp.ClientSession, result: str) -> float:
        async with session.get(f"{self.url}/metrics") as resp:
            text = await resp.text()
        for family in text_string_to_metric_families(text):
            for smp in family.samples:
                if smp.name == "tokenmeter_config_reloads_total" and smp.labels == {
                    "result": result
                }:
                    return smp.value
        return 0.0


@pytest.fixture
async def big_proxy(upstream: TestServer, tmp_path: Path) -> AsyncIterator[tuple[Proxy, str]]:
    """A proxy process serving version "v0" of the big configuration, and the base text."""
    base = _base_config(str(upstream.make_url("/v1")))
    config = tmp_path / "tm.yaml"
    await asyncio.to_thread(_write, config, _version(base, "v0"))
    port = free_port()
    log = tmp_path / "proxy.log"
    with log.open("wb") as err:  # a file, not a pipe: the access log must never block it
        proc = subprocess.Popen(
            [sys.executable, "-m", "proxy.cli", "serve", "--config", str(config),
             "--port", str(port)],
            stdout=subprocess.DEVNULL, stderr=err,
        )
    try:
        await asyncio.to_thread(wait_for_port, port, 150.0)
        proxy = Proxy(proc, port, config, log)
        # Answered: the loop runs, so its SIGHUP handler is in place (set as the port opens).
        async with aiohttp.ClientSession() as session:
            assert await proxy.ask(session, STABLE_KEY) == 200
        yield proxy, base
    finally:
        proc.terminate()
        try:
            await asyncio.to_thread(proc.wait, 60)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise


@contextmanager
def _fail_with_log(proxy: Proxy) -> Iterator[None]:
    try:
        yield
    except BaseException:
        lines = proxy.log.read_text(errors="replace").splitlines()
        print("\n".join(x for x in lines if '"event":"request"' not in x)[-4000:])
        raise


async def _storm(proxy: Proxy, session: aiohttp.ClientSession, texts: list[str],
                 signals_per_write: int = 5) -> None:
    """Each text written in turn, each followed by SIGHUPs; paced by the client's own
    requests (one between writes), so the storm overlaps the builds it causes."""
    for text in texts:
        await asyncio.to_thread(_write, proxy.config, text)
        for _ in range(signals_per_write):
            proxy.sighup()
        assert await proxy.ask(session, STABLE_KEY) == 200


@pytest.mark.timeout(400)
async def test_a_sighup_storm_of_a_big_config_keeps_requests_fast_and_the_last_file_wins(
    big_proxy: tuple[Proxy, str],
) -> None:
    proxy, base = big_proxy
    versions = [f"v{i}" for i in range(1, 11)]
    texts = await asyncio.to_thread(lambda: [_version(base, v) for v in versions])
    async with aiohttp.ClientSession() as session:
        with _fail_with_log(proxy):
            assert await proxy.ask(session, STABLE_KEY) == 200
            assert await proxy.ask(session, _marker_key("v0")) == 200
            async with timed_client(lambda: proxy.ask(session, STABLE_KEY)) as latencies:
                await _storm(proxy, session, texts)

                async def last_in_force() -> bool:
                    return await proxy.ask(session, _marker_key(versions[-1])) == 200

                await until(last_in_force, deadline=240.0, every=0.2)
            latencies.check(bound_s=STORM_BOUND_S)
            # The version written last is the one in force, whole: the one before it is gone.
            assert await proxy.ask(session, _marker_key(versions[-2])) == 401
            assert await proxy.ask(session, _marker_key("v0")) == 401
            # Coalesced: 50 SIGHUPs and 10 rewrites cost a few builds, not one per signal (the
            # first, one after it with the last file, and one at most if a build ended within
            # the storm).
            ok = await proxy.reloads(session, "ok")
            assert 1 <= ok <= 3, (ok, proxy.sighups)
            assert await proxy.reloads(session, "error") == 0


@pytest.mark.timeout(400)
async def test_a_bad_file_during_a_sighup_storm_keeps_the_running_version(
    big_proxy: tuple[Proxy, str],
) -> None:
    proxy, base = big_proxy
    # Valid YAML, every user there, but one field wrong: refused whole (its marker never works).
    bad = _version(base, "bad") + "    daily_tokens: lots\n"
    async with aiohttp.ClientSession() as session:
        with _fail_with_log(proxy):
            async with timed_client(lambda: proxy.ask(session, STABLE_KEY)) as latencies:
                await _storm(proxy, session, [bad] * 5)

                async def refused() -> bool:
                    return await proxy.reloads(session, "error") >= 1

                await until(refused, deadline=240.0, every=0.2)
                # Every build of the storm read the bad file: none was applied.
                assert await proxy.reloads(session, "ok") == 0
                assert await proxy.ask(session, _marker_key("bad")) == 401
                assert await proxy.ask(session, _marker_key("v0")) == 200
                # And the watcher still reloads once the file is fixed.
                await asyncio.to_thread(_write, proxy.config, _version(base, "fixed"))
                proxy.sighup()

                async def fixed() -> bool:
                    return await proxy.ask(session, _marker_key("fixed")) == 200

                await until(fixed, deadline=240.0, every=0.2)
            latencies.check(bound_s=STORM_BOUND_S)
            assert await proxy.ask(session, _marker_key("v0")) == 401
