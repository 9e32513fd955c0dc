"""The simulated upstream's Anthropic Messages API, checked with the real `anthropic` SDK."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

import anthropic
import httpx2
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient
from anthropic.types import MessageParam, ThinkingConfigEnabledParam

from proxy.testing import mock_tokens
from proxy.testing.mock_upstream import (
    MOCK_STATE,
    MockSettings,
    MockState,
    create_mock_app,
    generated_text,
)

Client = TestClient[web.Request, web.Application]
MakeClient = Callable[..., Awaitable[Client]]
MESSAGES: list[MessageParam] = [{"role": "user", "content": "Say something in mock language."}]
SYSTEM = "You are a mock, terse."
FAST = MockSettings(tokens_per_second=0, ttft_ms=0, output_tokens=12)


@pytest.fixture
async def mock(aiohttp_client: MakeClient) -> Client:
    return await aiohttp_client(create_mock_app(FAST))


@pytest.fixture
async def sdk(mock: Client) -> AsyncIterator[anthropic.AsyncAnthropic]:
    base = str(mock.make_url("/")).rstrip("/")
    client = anthropic.AsyncAnthropic(base_url=base, api_key="sk-ant-mock", max_retries=0)
    async with client:
        yield client


def state(client: Client) -> MockState:
    assert client.app is not None
    return client.app[MOCK_STATE]


def prompt_tokens() -> int:
    return mock_tokens.count_anthropic({"messages": MESSAGES, "system": SYSTEM})


async def test_non_streamed_message(sdk: anthropic.AsyncAnthropic, mock: Client) -> None:
    message = await sdk.messages.create(
        model="claude-mock", max_tokens=1024, system=SYSTEM, messages=MESSAGES
    )
    assert [block.type for block in message.content] == ["text"]
    assert message.content[0].type == "text" and message.content[0].text == generated_text(12)
    assert message.stop_reason == "end_turn" and message.model == "claude-mock"
    assert message.usage.input_tokens == prompt_tokens() == 2 + 4 + 1 + 6 + 7  # reply, message, role, content, system
    assert message.usage.output_tokens == 12
    assert message.usage.cache_creation_input_tokens == 0
    assert message.usage.cache_read_input_tokens == 0
    received = state(mock).requests[-1]
    assert received.path == "/v1/messages"
    # SDK 2.x sends api_key as a bearer token (older ones as x-api-key): the proxy takes both.
    assert received.headers["authorization"] == "Bearer sk-ant-mock"
    assert "anthropic-version" in received.headers


async def test_max_tokens_cuts_the_generation(sdk: anthropic.AsyncAnthropic) -> None:
    message = await sdk.messages.create(model="claude-mock", max_tokens=5, messages=MESSAGES)
    assert message.stop_reason == "max_tokens"
    assert message.usage.output_tokens == 5
    assert message.content[0].type == "text" and message.content[0].text == generated_text(5)


async def test_streamed_message_with_cache_usage(sdk: anthropic.AsyncAnthropic,
                                                  mock: Client) -> None:
    headers = {"x-mock-cache-read-tokens": "7", "x-mock-cache-creation-tokens": "3"}
    kinds: list[str] = []
    async with sdk.messages.stream(
        model="claude-mock", max_tokens=1024, system=SYSTEM, messages=MESSAGES,
        extra_headers=headers,
    ) as stream:
        text = ""
        async for event in stream:
            kinds.append(event.type)
            if event.type == "text":
                text += event.text
            if event.type == "message_start":
                assert event.message.usage.output_tokens == 1
                assert event.message.usage.cache_read_input_tokens == 7
        final = await stream.get_final_message()
    assert text == generated_text(12)
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert {"content_block_start", "content_block_delta", "content_block_stop",
            "message_delta"} <= set(kinds)
    assert final.content[0].type == "text" and final.content[0].text == text
    assert final.stop_reason == "end_turn"
    usage = final.usage
    assert (usage.input_tokens, usage.output_tokens) == (prompt_tokens() - 10, 12)
    assert (usage.cache_creation_input_tokens, usage.cache_read_input_tokens) == (3, 7)
    # What the soak checks compare with the proxy's books: the whole prompt, cache included.
    assert state(mock).reported == {"requests": 1, "prompt_tokens": prompt_tokens(),
                                    "completion_tokens": 12}


async def test_stream_wire_format_has_pings(sdk: anthropic.AsyncAnthropic) -> None:
    response = await sdk.messages.with_raw_response.create(
        model="claude-mock", max_tokens=3, messages=MESSAGES, stream=True
    )
    raw = await response.http_response.aread()
    events = [chunk.split(b"\n", 1)[0] for chunk in raw.rstrip(b"\n").split(b"\n\n")]
    assert events == [
        b"event: message_start", b"event: content_block_start", b"event: ping",
        *[b"event: content_block_delta"] * 3, b"event: content_block_stop",
        b"event: message_delta", b"event: message_stop",
    ]


async def test_count_tokens(sdk: anthropic.AsyncAnthropic, mock: Client) -> None:
    counted = await sdk.messages.count_tokens(model="claude-mock", system=SYSTEM, messages=MESSAGES)
    assert counted.input_tokens == prompt_tokens()
    assert state(mock).requests[-1].path == "/v1/messages/count_tokens"
    assert state(mock).reported["requests"] == 0  # counting generates nothing


async def test_injected_rate_limit_in_anthropic_shape(sdk: anthropic.AsyncAnthropic) -> None:
    with pytest.raises(anthropic.RateLimitError) as caught:
        await sdk.messages.create(
            model="claude-mock", max_tokens=8, messages=MESSAGES,
            extra_headers={"x-mock-status": "429"},
        )
    assert caught.value.status_code == 429
    assert caught.value.body == {
        "type": "error", "error": {"type": "rate_limit_error", "message": caught.value.body["error"]["message"]},  # type: ignore[index]
    }


@pytest.mark.parametrize(
    ("status", "error_type", "exception"),
    [
        (401, "authentication_error", anthropic.AuthenticationError),
        (529, "overloaded_error", anthropic.APIStatusError),
        (500, "api_error", anthropic.InternalServerError),
    ],
)
async def test_injected_errors(
    sdk: anthropic.AsyncAnthropic, status: int, error_type: str, exception: type[Exception]
) -> None:
    with pytest.raises(anthropic.APIStatusError) as caught:
        await sdk.messages.create(
            model="claude-mock", max_tokens=8, messages=MESSAGES,
            extra_headers={"x-mock-status": str(status)},
        )
    assert isinstance(caught.value, exception)
    assert caught.value.status_code == status
    assert isinstance(caught.value.body, dict)
    assert caught.value.body["type"] == "error"
    assert caught.value.body["error"]["type"] == error_type


async def test_missing_max_tokens_is_a_400(mock: Client) -> None:
    response = await mock.post("/v1/messages", json={"model": "claude-mock", "messages": MESSAGES})
    assert response.status == 400
    body = await response.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in body["error"]["message"]


async def test_reset_mid_stream(sdk: anthropic.AsyncAnthropic, mock: Client) -> None:
    text = ""
    # The SDK does not wrap a read error mid-stream: its HTTP client's error surfaces.
    with pytest.raises(httpx2.RemoteProtocolError):
        async with sdk.messages.stream(
            model="claude-mock", max_tokens=100, messages=MESSAGES,
            extra_headers={"x-mock-reset-after": "4"},
        ) as stream:
            async for chunk in stream.text_stream:
                text += chunk
    assert text == generated_text(4)
    await asyncio.wait_for(state(mock).requests[-1].closed.wait(), 5)
    assert state(mock).reported["requests"] == 0


async def test_extended_thinking_streamed(sdk: anthropic.AsyncAnthropic) -> None:
    """A thinking block (thinking_delta events, then its signature) before the answer; its
    tokens are output tokens, at most the budget."""
    kinds: list[str] = []
    async with sdk.messages.stream(
        model="claude-mock", max_tokens=100, messages=MESSAGES,
        thinking={"type": "enabled", "budget_tokens": 10},
    ) as stream:
        async for event in stream:
            if event.type == "content_block_delta":
                kinds.append(event.delta.type)
        final = await stream.get_final_message()
    assert kinds == ["thinking_delta"] * 10 + ["signature_delta"] + ["text_delta"] * 12
    thinking, text = final.content
    assert thinking.type == "thinking" and thinking.thinking == generated_text(10)
    assert thinking.signature
    assert text.type == "text" and text.text == generated_text(12)
    assert (final.stop_reason, final.usage.output_tokens) == ("end_turn", 22)


async def test_thinking_and_answer_share_max_tokens(sdk: anthropic.AsyncAnthropic) -> None:
    thinking: ThinkingConfigEnabledParam = {"type": "enabled", "budget_tokens": 50}
    # The mock's 16 thinking tokens, then 4 of its 12 answer tokens: 20 in all.
    message = await sdk.messages.create(model="claude-mock", max_tokens=20, messages=MESSAGES,
                                        thinking=thinking)
    assert [b.type for b in message.content] == ["thinking", "text"]
    assert message.content[1].type == "text" and message.content[1].text == generated_text(4)
    assert (message.stop_reason, message.usage.output_tokens) == ("max_tokens", 20)
    # All thinking: the answer never starts, the thinking block still closes.
    async with sdk.messages.stream(model="claude-mock", max_tokens=3, messages=MESSAGES,
                                   thinking=thinking,
                                   extra_headers={"x-mock-thinking-tokens": "5"}) as stream:
        final = await stream.get_final_message()
    assert [b.type for b in final.content] == ["thinking"]
    assert final.content[0].type == "thinking" and final.content[0].thinking == generated_text(3)
    assert (final.stop_reason, final.usage.output_tokens) == ("max_tokens", 3)


async def test_thinking_needs_a_budget(mock: Client) -> None:
    response = await mock.post("/v1/messages", json={
        "model": "claude-mock", "max_tokens": 10, "messages": MESSAGES,
        "thinking": {"type": "enabled"}})
    assert response.status == 400
    assert "budget_tokens" in (await response.json())["error"]["message"]
