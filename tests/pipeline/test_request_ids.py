"""The request id a developer pastes into a ticket can be found: tokenmeter's own id is in the
message of every error the proxy writes (the one place an SDK user is sure to see it), and the
upstream's id, which the SDKs show as `request_id`, is kept beside it in the books."""

from __future__ import annotations

import asyncio
from pathlib import Path

import anthropic
import openai
import pytest
from aiohttp.test_utils import TestServer
from anthropic.types import MessageParam
from openai.types.chat import ChatCompletionMessageParam

from proxy.pipeline.relay import REQUEST_ID_HEADER
from tests.helpers import ALICE_KEY, UPSTREAM_KEY, Stack, StackFactory, make_config

MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hi"}]
ANTHROPIC_MESSAGES: list[MessageParam] = [{"role": "user", "content": "hi"}]
NODE_DIR = Path(__file__).parents[1] / "node"
USERS = {"alice": {"keys": [ALICE_KEY], "daily_tokens": 1000}}


@pytest.fixture
async def openai_stack(make_stack: StackFactory, upstream: TestServer) -> Stack:
    return await make_stack(make_config(str(upstream.make_url("/v1")), store="memory",
                                        users=USERS, api_key=UPSTREAM_KEY))


@pytest.fixture
async def anthropic_stack(make_stack: StackFactory, upstream: TestServer) -> Stack:
    return await make_stack(make_config(str(upstream.make_url("/v1")), store="memory",
                                        users=USERS, api_key=UPSTREAM_KEY, api="anthropic"))


def _anthropic(stack: Stack) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=stack.base_url.removesuffix("/v1"),
                                    api_key=ALICE_KEY, max_retries=0)


async def test_openai_quota_refusal_names_the_request(openai_stack: Stack) -> None:
    client = openai_stack.client(ALICE_KEY)
    with pytest.raises(openai.RateLimitError) as caught:
        await client.chat.completions.create(model="mock-gpt", messages=MESSAGES,
                                             max_tokens=5000)
    ours = caught.value.response.headers[REQUEST_ID_HEADER]
    assert f"(request id {ours})" in str(caught.value)
    assert ours in caught.value.message


async def test_openai_reset_mid_stream_names_the_request(openai_stack: Stack) -> None:
    client = openai_stack.client(ALICE_KEY)
    stream = await client.chat.completions.create(
        model="mock-gpt", messages=MESSAGES, stream=True, max_tokens=20,
        extra_headers={"x-mock-reset-after": "3"})
    ours = stream.response.headers[REQUEST_ID_HEADER]
    with pytest.raises(openai.APIError) as caught:
        async for _ in stream:
            pass
    assert caught.value.code == "upstream_reset"
    assert f"(request id {ours})" in str(caught.value)


async def test_anthropic_quota_refusal_names_the_request(anthropic_stack: Stack) -> None:
    async with _anthropic(anthropic_stack) as client:
        with pytest.raises(anthropic.RateLimitError) as caught:
            await client.messages.create(model="mock-gpt", max_tokens=5000,
                                         messages=ANTHROPIC_MESSAGES)
    ours = caught.value.response.headers[REQUEST_ID_HEADER]
    assert f"(request id {ours})" in str(caught.value)
    assert ours in caught.value.message


async def test_anthropic_reset_mid_stream_names_the_request(anthropic_stack: Stack) -> None:
    async with _anthropic(anthropic_stack) as client:
        with pytest.raises(anthropic.APIError) as caught:
            async with client.messages.stream(
                model="mock-gpt", max_tokens=20, messages=ANTHROPIC_MESSAGES,
                extra_headers={"x-mock-reset-after": "3"},
            ) as stream:
                ours = stream.response.headers[REQUEST_ID_HEADER]
                async for _ in stream:
                    pass
    assert f"(request id {ours})" in str(caught.value)


async def test_node_openai_sdk_error_names_the_request(openai_stack: Stack) -> None:
    """The openai Node SDK (tests/node, pinned) throws a RateLimitError on the quota's 429
    (stream.mjs asks for no max_tokens: its worst case does not fit): its message, which Node
    prints, carries the id."""
    proc = await asyncio.create_subprocess_exec(
        "node", str(NODE_DIR / "stream.mjs"), "openai", openai_stack.base_url, ALICE_KEY,
        "mock-gpt", cwd=NODE_DIR,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    async with asyncio.timeout(60):
        _, err = await proc.communicate()
    assert proc.returncode != 0
    await openai_stack.settled(1)
    [line] = [a for a in openai_stack.access_lines() if a.get("event") == "request"]
    assert (line["status"], line["error_class"]) == (429, "budget_exceeded")
    assert f"(request id {line['request_id']})" in err.decode()
