"""The pipelined connection the Redis store runs its scripts over (proxy.budget.resp), on a real
redis-server: replies reach their own callers, a caller that gives up shifts nobody's reply,
a late reply drops the connection and the next call opens a new one, and a server that does not
hold a script yet is sent its body."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from proxy.budget import resp
from tests.helpers import redis_int

ECHO = resp.Script("return ARGV[1]")
# A script that writes: a pause of writes (CLIENT PAUSE ... WRITE) holds it, and its reply.
WRITE = resp.Script("redis.call('INCR', KEYS[1]); return ARGV[1]")


@pytest.fixture
async def admin(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    r = aioredis.from_url(redis_url)
    yield r
    await r.client_unpause()
    await r.aclose()


async def test_concurrent_calls_get_their_own_replies_over_one_connection(
    redis_url: str, admin: aioredis.Redis
) -> None:
    conn = resp.Connection(redis_url, 5.0)
    before = int((await admin.info("clients"))["connected_clients"])
    replies = await asyncio.gather(
        *(conn.evalsha(ECHO, [], [b"%d" % i]) for i in range(300)))
    assert replies == [b"%d" % i for i in range(300)]
    assert int((await admin.info("clients"))["connected_clients"]) == before + 1
    conn.close()


async def test_a_caller_that_gives_up_shifts_no_other_reply(
    redis_url: str, admin: aioredis.Redis
) -> None:
    conn = resp.Connection(redis_url, 5.0)
    await conn.evalsha(WRITE, [b"k"], [b"warm"])  # connected, script loaded
    await admin.client_pause(10_000, all=False)
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(conn.evalsha(WRITE, [b"k"], [b"abandoned"]), 0.2)
    second = asyncio.ensure_future(conn.evalsha(WRITE, [b"k"], [b"mine"]))
    await admin.client_unpause()
    assert await second == b"mine"
    assert await redis_int(admin, "k") == 3  # the abandoned call ran all the same
    conn.close()


async def test_a_late_reply_drops_the_connection_and_the_next_call_reconnects(
    redis_url: str, admin: aioredis.Redis
) -> None:
    conn = resp.Connection(redis_url, 0.3)
    await conn.evalsha(WRITE, [b"k"], [b"warm"])
    await admin.client_pause(10_000, all=False)
    with pytest.raises(resp.RespError, match="no reply within 300 ms"):
        await conn.evalsha(WRITE, [b"k"], [b"late"])
    await admin.client_unpause()
    assert await conn.evalsha(WRITE, [b"k"], [b"next"]) == b"next"
    conn.close()


async def test_a_script_the_server_does_not_hold_is_sent_whole(
    redis_url: str, admin: aioredis.Redis
) -> None:
    conn = resp.Connection(redis_url, 5.0)
    assert await conn.evalsha(ECHO, [], [b"one"]) == b"one"
    await admin.script_flush()
    assert await conn.evalsha(ECHO, [], [b"two"]) == b"two"
    assert (await admin.script_exists(ECHO.sha.decode())) == [True]
    conn.close()


async def test_the_urls_database_is_selected(redis_url: str, admin: aioredis.Redis) -> None:
    conn = resp.Connection(redis_url.rsplit("/", 1)[0] + "/3", 5.0)
    await conn.evalsha(WRITE, [b"in-db-3"], [b"x"])
    assert await admin.exists("in-db-3") == 0
    async with aioredis.from_url(redis_url.rsplit("/", 1)[0] + "/3") as db3:
        assert await redis_int(db3, "in-db-3") == 1
    conn.close()


async def test_an_error_reply_is_raised_and_the_connection_goes_on(redis_url: str) -> None:
    conn = resp.Connection(redis_url, 5.0)
    with pytest.raises(resp.RespError, match="boom"):
        await conn.evalsha(resp.Script("return redis.error_reply('boom')"), [], [])
    assert await conn.evalsha(ECHO, [], [b"after"]) == b"after"
    conn.close()
