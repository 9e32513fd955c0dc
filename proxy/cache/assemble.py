"""A finished answer made into an entry's JSON form: a non-streamed answer as it came, a
stream reassembled into the answer a non-streamed request would have had (text, tool calls,
finish reasons, usage). Pure and bounded by the bytes given (the fill caps them); run off the
loop by the cache. Returns None for anything that is not a whole, naturally finished answer."""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from typing import Any

from proxy.cache.replay import chunk_head
from proxy.protocol.sse import SSEDecoder

# Finish reasons of an answer that ended by itself. A `length` / `max_tokens` end is stored
# only when the client's own cap caused it (`Finish.capped_ok`), never the proxy's clamp.
_NATURAL = {
    "chat": frozenset({"stop", "tool_calls", "function_call"}),
    "text_completion": frozenset({"stop"}),
    "messages": frozenset({"end_turn", "stop_sequence", "tool_use"}),
}
_CAPPED = {"chat": "length", "text_completion": "length", "messages": "max_tokens"}

OPERATIONS = frozenset(_NATURAL)


def finished(operation: str, answer: dict[str, Any], capped_ok: bool) -> bool:
    """Whether every choice of the answer ended by itself (or by the client's own cap)."""
    natural = _NATURAL[operation]
    if capped_ok:
        natural = natural | {_CAPPED[operation]}
    if operation == "messages":
        return answer.get("stop_reason") in natural
    choices = answer.get("choices")
    if not isinstance(choices, list) or not choices:
        return False
    return all(isinstance(c, dict) and c.get("finish_reason") in natural for c in choices)


# A finish reason as the upstream wrote it (in an answer's body or a stream's events). Inside a
# JSON string its quotes would be escaped: text the model wrote never matches.
_ENDS = {
    "chat": re.compile(rb'"finish_reason"\s*:\s*"([A-Za-z_]+)"'),
    "text_completion": re.compile(rb'"finish_reason"\s*:\s*"([A-Za-z_]+)"'),
    "messages": re.compile(rb'"stop_reason"\s*:\s*"([A-Za-z_]+)"'),
}


def ended(operation: str, raw: bytes, capped_ok: bool) -> bool:
    """`finished` read off an answer's bytes (its JSON body or its stream) without parsing
    them: some finish reason was given and every one is natural (or the client's own cap).
    An answer of a shape the hit cannot reassemble is caught there (a miss, counted)."""
    natural = _NATURAL[operation]
    if capped_ok:
        natural = natural | {_CAPPED[operation]}
    reasons = _ENDS[operation].findall(raw)
    return bool(reasons) and all(r.decode() in natural for r in reasons)


def from_body(operation: str, body: bytes) -> dict[str, Any] | None:
    try:
        answer = json.loads(body)
    except ValueError:
        return None
    return answer if isinstance(answer, dict) else None


def from_stream(operation: str, raw: bytes) -> dict[str, Any] | None:
    datas = _datas(raw)
    if datas is None:
        return None
    try:
        if operation == "messages":
            return _messages(datas)
        return _choices(operation, datas)
    except (TypeError, KeyError, ValueError, AttributeError, IndexError):
        return None  # a shape this reassembly does not know: not stored


# One `data:` line of an event (SSE allows several per event: such a stream fails the one
# parse below and goes through the SSE decoder instead).
_DATA = re.compile(rb"^data: ?(.*)$", re.MULTILINE)


def _datas(raw: bytes) -> list[dict[str, Any]] | None:
    """The stream's JSON events, parsed in one `json.loads` of them all (a call per event
    costs several times more). Streams framed otherwise (`\r` line ends, an event's data on
    several lines) go through the SSE decoder."""
    if b"\r" in raw:
        return _decoded(raw)
    parts = [p for p in _DATA.findall(raw) if p != b"[DONE]"]
    try:
        events = json.loads(b"[" + b",".join(parts) + b"]")
    except ValueError:
        return _decoded(raw)
    return events if all(isinstance(e, dict) for e in events) else None


def _decoded(raw: bytes) -> list[dict[str, Any]] | None:
    decoder = SSEDecoder()
    events = []
    for event in (*decoder.feed(raw), *decoder.flush()):
        if event.data == b"[DONE]":
            continue
        try:
            obj = json.loads(event.data)
        except ValueError:
            return None
        if not isinstance(obj, dict):
            return None
        events.append(obj)
    return events


def _choices(operation: str, chunks: Iterable[dict[str, Any]]) -> dict[str, Any] | None:
    head: dict[str, Any] | None = None
    choices: dict[int, dict[str, Any]] = {}
    texts: dict[int, list[str]] = {}  # the content pieces of each choice, joined at the end
    usage = None
    field = "text" if operation == "text_completion" else "content"
    for chunk in chunks:
        if "error" in chunk:
            return None
        if head is None:
            head = chunk
        if chunk.get("usage"):
            usage = chunk["usage"]
        for delta in chunk.get("choices") or ():
            _take(delta, field, choices, texts)
    if head is None or not choices:
        return None
    answer = chunk_head(head)
    answer["object"] = "chat.completion" if operation == "chat" else "text_completion"
    answer["choices"] = [_closed(choices[i], texts[i]) for i in sorted(choices)]
    if usage is not None:
        answer["usage"] = usage
    return answer


def _take(delta: dict[str, Any], field: str, choices: dict[int, dict[str, Any]],
          texts: dict[int, list[str]]) -> None:
    """One choice's delta of a chunk, into its choice."""
    index = delta.get("index", 0)
    body = delta if field == "text" else delta.get("delta") or {}
    piece = body.get(field)
    # The common event: one piece of text, nothing else (a dict look-up or two).
    if isinstance(piece, str) and index in choices and (field == "text" or len(body) == 1):
        texts[index].append(piece)
    else:
        if index not in choices:
            choices[index] = _choice("text_completion" if field == "text" else "chat",
                                     int(index))
            texts[index] = []
        if isinstance(piece, str):
            texts[index].append(piece)
        if field == "content":
            _chat_delta(choices[index], body)
    if delta.get("finish_reason"):
        choices[index]["finish_reason"] = delta["finish_reason"]


def _choice(operation: str, index: int) -> dict[str, Any]:
    if operation == "chat":
        return {"index": index, "message": {"role": "assistant", "content": None},
                "logprobs": None, "finish_reason": None, "_tools": {}}
    return {"index": index, "text": "", "logprobs": None, "finish_reason": None}


def _chat_delta(choice: dict[str, Any], delta: dict[str, Any]) -> None:
    """Everything of a chat delta but its content (`_choices` keeps that)."""
    message = choice["message"]
    if delta.get("role"):
        message["role"] = delta["role"]
    if isinstance(delta.get("content"), str) and message["content"] is None:
        message["content"] = ""  # some text came, if only an empty one
    if isinstance(delta.get("refusal"), str):
        message["refusal"] = (message.get("refusal") or "") + delta["refusal"]
    for call in delta.get("tool_calls") or ():
        tools = choice["_tools"]
        slot = tools.setdefault(int(call.get("index", len(tools))),
                                {"id": None, "type": "function",
                                 "function": {"name": "", "arguments": ""}})
        if call.get("id"):
            slot["id"] = call["id"]
        if call.get("type"):
            slot["type"] = call["type"]
        function = call.get("function") or {}
        slot["function"]["name"] += function.get("name") or ""
        slot["function"]["arguments"] += function.get("arguments") or ""


def _closed(choice: dict[str, Any], texts: list[str]) -> dict[str, Any]:
    tools = choice.pop("_tools", None)
    if "message" in choice:
        if texts:
            choice["message"]["content"] = "".join(texts)
        if tools:
            choice["message"]["tool_calls"] = [tools[i] for i in sorted(tools)]
    else:
        choice["text"] = "".join(texts)
    return choice


def _messages(events: Iterable[dict[str, Any]]) -> dict[str, Any] | None:
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
            message["content"] = []
        elif kind == "content_block_start":
            blocks[int(event["index"])] = dict(event["content_block"])
        elif kind == "content_block_delta":
            _block_delta(blocks[int(event["index"])], int(event["index"]), event["delta"],
                         partial)
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
        block.setdefault("citations", []).append(delta["citation"])
