"""The relay's stream loop without a network (proxy.pipeline.relay.Stream): the real tap and
translator read the chunks, a recorder stands for the client's response, and a checker that
records its calls stands for the stream's top-ups. What reaches the client is the upstream's
bytes, as they came, in order; under top-ups, each check falls on an event, between two, at the
first whose bytes reach it, before that event is forwarded."""

from __future__ import annotations

import itertools
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import pytest
from hypothesis import given
from hypothesis import strategies as st

from proxy.errors import ErrorClass, ProxyError
from proxy.pipeline.context import Outcome
from proxy.pipeline.relay import Stream
from proxy.pipeline.topup import StoreFailed
from proxy.pipeline.watchdog import Watch
from proxy.protocol.tap import StreamTap
from proxy.protocol.translators import ChatTranslator, parse_body
from proxy.telemetry.meter import RequestMeter

pytestmark = pytest.mark.unit

EOLS = [b"\n", b"\r\n", b"\r"]


def _each(eol: bytes, tokens: int, done: bool = True) -> list[bytes]:
    """A streamed chat completion's events, `tokens` content events, lines ended by `eol`."""
    def event(delta: dict[str, str], finish: str | None = None) -> bytes:
        chunk = {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "gpt-4o",
                 "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
        return b"data: " + json.dumps(chunk).encode() + eol + eol

    out = [event({"content": f" t{i}"}) for i in range(tokens)]
    if done:
        out += [event({}, "stop"), b"data: [DONE]" + eol + eol]
    return out


def _events(eol: bytes, tokens: int, done: bool = True) -> bytes:
    return b"".join(_each(eol, tokens, done))


@dataclass
class Client:
    """The client's response: what was written, write by write."""

    writes: list[bytes] = field(default_factory=list)
    aborted: bool = False

    async def write(self, data: bytes) -> None:
        self.writes.append(data)

    def abort(self) -> None:
        self.aborted = True


@dataclass
class Checker:
    """Top-ups that want their next check `ahead` bytes after each (1: at every piece) and
    record each (events, whether the bytes forwarded end between two events once the piece is,
    bytes arrived); `end_at`: raise there, as a refused one."""

    ahead: int = 1
    end_at: int | None = None
    next_at: int = 1
    checks: list[tuple[int, bool]] = field(default_factory=list)
    arrived: list[int] = field(default_factory=list)

    def tokens(self) -> int:
        return 0

    async def check(self, events: int, arrived: int, before: int, at_boundary: bool) -> None:
        self.checks.append((events, at_boundary))
        self.arrived.append(arrived)
        self.next_at = arrived + self.ahead
        if events == self.end_at:
            raise StoreFailed("ended")


def _stream(client: Client) -> Stream:
    body = {"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}],
            "stream": True}
    translator = ChatTranslator(parse_body(json.dumps(body).encode()))
    outcome = Outcome("req-1", "chat", RequestMeter())
    return Stream(client, Watch(lambda: None, 30.0), StreamTap(translator, outcome.meter),
                  translator, outcome, client.abort)


async def _chunks(data: bytes, cuts: list[int]) -> AsyncIterator[bytes]:
    edges = [0, *sorted(set(cuts)), len(data)]
    for a, b in itertools.pairwise(edges):
        if b > a:
            yield data[a:b]


@pytest.mark.parametrize("eol", EOLS, ids=["lf", "crlf", "cr"])
async def test_a_bunched_chunk_is_forwarded_and_checked_event_by_event(eol: bytes) -> None:
    data = _events(eol, 10)
    client, checker = Client(), Checker()
    stream = _stream(client)
    await stream.pump_checked(_chunks(data, []), checker)
    await stream.finish()
    assert client.writes == _each(eol, 10)  # the upstream's bytes, one write per event
    assert checker.checks == [(n, True) for n in range(1, 11)]
    assert stream.outcome.error_class is ErrorClass.NONE


@pytest.mark.parametrize("eol", EOLS, ids=["lf", "crlf", "cr"])
async def test_a_chunk_that_cannot_reach_the_next_check_goes_whole(eol: bytes) -> None:
    data = _events(eol, 10)
    client, checker = Client(), Checker(ahead=10**6)
    stream = _stream(client)
    first = _events(eol, 5, done=False)
    await stream.pump_checked(_chunks(data, [len(first)]), checker)
    assert checker.checks == [(1, True)]  # the first event's, then none due
    # The first chunk, due at its first event, went event by event; the second whole.
    assert client.writes == [*_each(eol, 5, done=False), data[len(first):]]


@pytest.mark.parametrize("eol", EOLS, ids=["lf", "crlf", "cr"])
async def test_a_stream_ended_at_a_check_gets_the_error_event_after_that_event(
    eol: bytes,
) -> None:
    data = _events(eol, 10)
    client, checker = Client(), Checker(end_at=4)
    stream = _stream(client)
    with pytest.raises(StoreFailed) as ended:
        await stream.pump_checked(_chunks(data, []), checker)
    await stream.fail(ended.value)
    *forwarded, last = client.writes
    assert b"".join(forwarded) == _events(eol, 4, done=False)  # four events, whole
    assert last.startswith(b'data: {"error"') and b"service_unavailable" in last
    assert not client.aborted
    assert stream.outcome.error_class is ErrorClass.SERVICE_UNAVAILABLE


@dataclass
class Watching(Checker):
    """A checker that sees what the client had at each check."""

    client: Client = field(default_factory=Client)
    had: list[int] = field(default_factory=list)

    async def check(self, events: int, arrived: int, before: int, at_boundary: bool) -> None:
        self.had.append(sum(map(len, self.client.writes)))
        await super().check(events, arrived, before, at_boundary)


async def test_the_event_that_reaches_a_check_is_checked_before_it_is_forwarded() -> None:
    """Issue 31: the relay forwarded a piece before counting it, so the check came too late
    for a piece that carried the stream past what it held. Now the client has everything
    before the event at hand, and that event only once its check let it go."""
    data = _events(b"\n", 6)
    checker = Watching()
    stream = _stream(checker.client)
    await stream.pump_checked(_chunks(data, []), checker)
    ends = list(itertools.accumulate(map(len, _each(b"\n", 6, done=False))))
    assert checker.arrived == ends
    assert checker.had == [0, *ends[:-1]]


@pytest.mark.parametrize("eol", EOLS, ids=["lf", "crlf", "cr"])
async def test_a_stream_broken_mid_event_is_cut_not_given_an_event(eol: bytes) -> None:
    data = _events(eol, 3)
    client = Client()
    stream = _stream(client)
    await stream.pump(_chunks(data[:len(data) // 2 + 3], []))
    await stream.fail(ProxyError("broken", code="internal"))
    assert b"".join(client.writes) == data[:len(data) // 2 + 3]  # nothing after it
    assert client.aborted


@pytest.mark.parametrize("eol", EOLS, ids=["lf", "crlf", "cr"])
async def test_a_stream_without_its_final_event_is_told_it_is_incomplete(eol: bytes) -> None:
    data = _events(eol, 3, done=False)
    client = Client()
    stream = _stream(client)
    await stream.pump(_chunks(data, [5, 40]))
    await stream.finish()
    *forwarded, last = client.writes
    assert b"".join(forwarded) == data
    assert last.startswith(b'data: {"error"')
    assert stream.outcome.error_class is ErrorClass.UPSTREAM_INCOMPLETE


@given(st.sampled_from(EOLS), st.integers(1, 40), st.lists(st.integers(0, 5_000)),
       st.integers(1, 2_000))
async def test_any_cut_stream_reaches_the_client_whole_and_is_checked_on_events(
    eol: bytes, tokens: int, cuts: list[int], ahead: int,
) -> None:
    """However the network cuts the stream: the client gets its bytes unchanged, and every
    check falls between two events, at the first content event whose bytes reach it."""
    data = _events(eol, tokens)
    client, checker = Client(), Checker(ahead=ahead)
    stream = _stream(client)
    # A cut between an event's last CR and LF ends it a byte early (the CR ends it already;
    # the LF is taken as the rest of that CRLF): its check comes there, as it should, but a
    # byte off the ends counted here. The split CRLF has its own tests (test_tap).
    at = [c % len(data) for c in cuts]
    at = [c for c in at if data[c - 1:c + 1] != b"\r\n"]
    await stream.pump_checked(_chunks(data, at), checker)
    await stream.finish()
    assert b"".join(client.writes) == data
    ends = list(itertools.accumulate(map(len, _each(eol, tokens, done=False))))
    due, expected = 1, []
    for events, end in enumerate(ends, start=1):
        if end >= due:
            expected.append((events, end))
            due = end + ahead
    assert checker.checks == [(n, True) for n, _ in expected]
    assert checker.arrived == [end for _, end in expected]
