"""A stream's final event held until its row is spooled (proxy.pipeline.ending): where each API's
final event starts, and what the held writer forwards. The end-to-end proof (a real proxy
SIGKILLed with an upstream that keeps its response open after `[DONE]`) is
tests/ledger/test_hostile_books.py::test_a_stream_final_event_reaches_the_client_only_after_its_row."""

from __future__ import annotations

import pytest

from proxy.pipeline.ending import EndHeld, final_at
from proxy.protocol.translators import (
    ChatTranslator,
    MessagesTranslator,
    ResponsesTranslator,
)

pytestmark = pytest.mark.unit


class Sink:
    def __init__(self) -> None:
        self.out: list[bytes] = []

    async def write(self, data: bytes) -> None:
        self.out.append(data)


def test_the_final_event_starts_a_line_never_inside_an_answer() -> None:
    quoted = b'data: {"choices":[{"delta":{"content":"data: [DONE] event: message_stop"}}]}\n\n'
    chat = quoted + b"data: [DONE]\n\n"
    assert final_at(chat, ChatTranslator.final_events) == len(quoted)
    assert final_at(quoted, ChatTranslator.final_events) == -1
    stop = b'event: message_stop\ndata: {"type":"message_stop"}\n\n'
    messages = b'event: content_block_delta\r\ndata: {"text":"event: message_stop"}\r\n\r\n'
    assert final_at(messages + stop, MessagesTranslator.final_events) == len(messages)
    done = b'event: response.completed\ndata: {"type":"response.completed"}\n\n'
    delta = b'event: response.output_text.delta\ndata: {"delta":"hi"}\n\n'
    assert final_at(delta + done, ResponsesTranslator.final_events) == len(delta)
    assert final_at(done, ResponsesTranslator.final_events) == 0


async def test_held_from_the_final_event_on_and_released_in_order() -> None:
    sink = Sink()
    held = EndHeld(sink, ChatTranslator.final_events)
    await held.write(b"data: {}\n\n")
    assert not held.holding
    await held.write(b"data: {\"x\":1}\n\ndata: [DONE]\n\n")
    await held.write(b": more\n\n")
    assert held.holding and sink.out == [b"data: {}\n\n", b"data: {\"x\":1}\n\n"]
    await held.release()
    assert sink.out[2:] == [b"data: [DONE]\n\n: more\n\n"] and not held.holding
    await held.write(b"after")
    assert sink.out[-1] == b"after"
