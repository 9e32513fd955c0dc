"""Anthropic's Messages (`/v1/messages`): an answer's `content` blocks (`text` with its
`citations`, `thinking`, `tool_use` and `server_tool_use` with their `input`), a stream's named
events (message_start, content_block_start/delta/stop, message_delta, message_stop).

A message's texts: a text block's `text` (output), a thinking block's `thinking` (reasoning), a
tool use's `name` and `input` (in a stream, its `input_json_delta` pieces). Citations are not
text the model wrote: they are kept, not walked."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

from proxy.protocol.codec import Codec, Text, TextKind, dumps, named_event, pieces
from proxy.protocol.usage import Usage, anthropic_usage

CAP_FIELDS = ("max_tokens",)

_TOOL_BLOCKS = frozenset({"tool_use", "server_tool_use"})
# A content_block_delta's text, by delta type: (its field, its kind).
_DELTAS = {"text_delta": ("text", TextKind.OUTPUT),
           "thinking_delta": ("thinking", TextKind.REASONING),
           "input_json_delta": ("partial_json", TextKind.TOOL_ARGS)}


def _block_texts(index: Any, block: dict[str, Any], *, start: bool) -> Iterator[Text]:
    """A content block's texts (`start`: as a content_block_start opens it, its input not yet
    streamed)."""
    for field, kind in (("text", TextKind.OUTPUT), ("thinking", TextKind.REASONING)):
        text = block.get(field)
        if isinstance(text, str) and text:
            yield Text(kind, (index,), block, field, text)
    if block.get("type") in _TOOL_BLOCKS:
        name = block.get("name")
        if isinstance(name, str) and name:
            yield Text(TextKind.TOOL_NAME, (index,), block, "name", name)
        if not start and "input" in block:
            yield Text(TextKind.TOOL_ARGS, (index,), block, "input",
                       dumps(block["input"]).decode())


class MessagesCodec(Codec):
    operation = "messages"
    streams = True
    cap_fields = CAP_FIELDS
    natural = frozenset({"end_turn", "stop_sequence", "tool_use"})
    capped = "max_tokens"
    finish_mark = re.compile(rb'"stop_reason"\s*:\s*"([A-Za-z_]+)"')

    def texts(self, obj: dict[str, Any]) -> Iterator[Text]:
        kind = obj.get("type")
        if kind == "content_block_delta":
            delta = obj.get("delta")
            found = _DELTAS.get(str(delta.get("type"))) if isinstance(delta, dict) else None
            if found is not None and isinstance(delta, dict):
                field, text_kind = found
                text = delta.get(field)
                if isinstance(text, str) and text:
                    yield Text(text_kind, (obj.get("index"),), delta, field, text)
        elif kind == "content_block_start":
            block = obj.get("content_block")
            if isinstance(block, dict):
                yield from _block_texts(obj.get("index"), block, start=True)
        elif isinstance(content := obj.get("content"), list):  # an answer (a `message`)
            for index, block in enumerate(content):
                if isinstance(block, dict):
                    yield from _block_texts(index, block, start=False)

    def finish_reasons(self, answer: dict[str, Any]) -> list[Any]:
        return [answer.get("stop_reason")] if "stop_reason" in answer else []

    def usage(self, answer: dict[str, Any]) -> Usage | None:
        return anthropic_usage(answer.get("usage"))

    def assemble(self, events: list[dict[str, Any]]) -> dict[str, Any] | None:
        message: dict[str, Any] | None = None
        blocks: dict[int, dict[str, Any]] = {}
        partial: dict[int, str] = {}
        stopped = False
        for event in events:
            kind = event.get("type")
            if kind == "error":
                return None
            if kind == "message_start":
                message = dict(event["message"])
            elif kind == "content_block_start":
                blocks[int(event["index"])] = dict(event["content_block"])
            elif kind == "content_block_delta":
                index = int(event["index"])
                _block_delta(blocks[index], index, event["delta"], partial)
            elif kind == "message_delta" and message is not None:
                message.update(event.get("delta") or {})
                message["usage"] = {**(message.get("usage") or {}), **(event.get("usage") or {})}
            elif kind == "message_stop":
                stopped = True
        if message is None or not stopped:
            return None
        for index, text in partial.items():
            blocks[index]["input"] = json.loads(text) if text else {}
        message["content"] = [blocks[i] for i in sorted(blocks)]
        return message

    def replay(self, answer: dict[str, Any], *, include_usage: bool) -> bytes:
        usage = dict(answer.get("usage") or {})
        start = {**answer, "content": [], "stop_reason": None, "stop_sequence": None,
                 "usage": {**usage, "output_tokens": 1}}
        out = [named_event("message_start", {"type": "message_start", "message": start})]
        for index, block in enumerate(answer.get("content") or ()):
            out.extend(_block(index, block))
        out.append(named_event("message_delta", {
            "type": "message_delta",
            "delta": {"stop_reason": answer.get("stop_reason"),
                      "stop_sequence": answer.get("stop_sequence")},
            "usage": usage,
        }))
        out.append(named_event("message_stop", {"type": "message_stop"}))
        return b"".join(out)

    def call_id(self, event: dict[str, Any], text: Text) -> str | None:
        block = event.get("content_block")
        if isinstance(block, dict) and isinstance(block.get("id"), str):
            return str(block["id"])
        return None


def _block_delta(block: dict[str, Any], index: int, delta: dict[str, Any],
                 partial: dict[int, str]) -> None:
    kind = delta.get("type")
    if kind == "text_delta":
        block["text"] = block.get("text", "") + delta["text"]
    elif kind == "input_json_delta":
        partial[index] = partial.get(index, "") + delta["partial_json"]
    elif kind == "thinking_delta":
        block["thinking"] = block.get("thinking", "") + delta["thinking"]
    elif kind == "signature_delta":
        block["signature"] = block.get("signature", "") + delta["signature"]
    elif kind == "citations_delta":
        # A new list: the one a content_block_start opened with is the caller's event's.
        block["citations"] = [*(block.get("citations") or ()), delta["citation"]]


def _block(index: int, block: dict[str, Any]) -> list[bytes]:
    kind = block.get("type")
    deltas: list[dict[str, Any]] = []
    opening = dict(block)
    if kind == "text":
        opening["text"] = ""
        deltas = [{"type": "text_delta", "text": p} for p in pieces(block.get("text", ""))]
        if "citations" in block:
            opening["citations"] = []
            deltas += [{"type": "citations_delta", "citation": c}
                       for c in block.get("citations") or ()]
    elif kind in _TOOL_BLOCKS:
        opening["input"] = {}
        deltas = [{"type": "input_json_delta",
                   "partial_json": dumps(block.get("input", {})).decode()}]
    elif kind == "thinking":
        opening["thinking"], opening["signature"] = "", ""
        deltas = [{"type": "thinking_delta", "thinking": p}
                  for p in pieces(block.get("thinking", ""))]
        deltas.append({"type": "signature_delta", "signature": block.get("signature", "")})
    out = [named_event("content_block_start", {"type": "content_block_start", "index": index,
                                               "content_block": opening})]
    out.extend(named_event("content_block_delta", {"type": "content_block_delta",
                                                   "index": index, "delta": d})
               for d in deltas)
    out.append(named_event("content_block_stop", {"type": "content_block_stop", "index": index}))
    return out


CODEC = MessagesCodec()
