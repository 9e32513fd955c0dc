"""A stored answer replayed in the form the client asked for: its JSON, or a stream in the
API's own event shape (OpenAI's chunks and `data: [DONE]`, the usage chunk only when the
request asked for it with `stream_options.include_usage`; Anthropic's message_start,
content_block_start/delta/stop, message_delta, message_stop). Pure."""

from __future__ import annotations

import json
from typing import Any

# A text delta per this many characters: a stream of a long answer is several events, as the
# SDKs expect, without one event per token.
_PIECE = 512


_HEAD: tuple[str, ...] = ("id", "created", "model", "system_fingerprint", "service_tier")


def chunk_head(obj: dict[str, Any]) -> dict[str, Any]:
    """The fields every chunk of an OpenAI stream repeats (and its answer has once)."""
    return {k: obj[k] for k in _HEAD if k in obj}


def _dumps(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()


def as_json(answer: dict[str, Any]) -> bytes:
    return _dumps(answer)


def as_stream(operation: str, answer: dict[str, Any], include_usage: bool) -> bytes:
    if operation == "messages":
        return b"".join(_messages(answer))
    return b"".join(_choices(operation, answer, include_usage))


def _pieces(text: str) -> list[str]:
    return [text[i:i + _PIECE] for i in range(0, len(text), _PIECE)] or [""]


def _data(obj: dict[str, Any]) -> bytes:
    return b"data: " + _dumps(obj) + b"\n\n"


def _choices(operation: str, answer: dict[str, Any], include_usage: bool) -> list[bytes]:
    chat = operation == "chat"
    head = chunk_head(answer)
    head["object"] = "chat.completion.chunk" if chat else "text_completion"
    extra = {"usage": None} if include_usage else {}
    out = []

    def chunk(index: int, body: dict[str, Any], finish: str | None = None) -> bytes:
        choice = {"index": index, **body, "logprobs": None, "finish_reason": finish}
        return _data({**head, "choices": [choice], **extra})

    for choice in answer.get("choices") or ():
        index, finish = choice.get("index", 0), choice.get("finish_reason")
        if chat:
            out.extend(_chat_chunks(chunk, index, choice.get("message") or {}))
            out.append(chunk(index, {"delta": {}}, finish))
        else:
            out.extend(chunk(index, {"text": p}) for p in _pieces(choice.get("text") or ""))
            out.append(chunk(index, {"text": ""}, finish))
    if include_usage and answer.get("usage") is not None:
        out.append(_data({**head, "choices": [], "usage": answer["usage"]}))
    out.append(b"data: [DONE]\n\n")
    return out


def _chat_chunks(chunk: Any, index: int, message: dict[str, Any]) -> list[bytes]:
    text = message.get("content")
    out = [chunk(index, {"delta": {"role": message.get("role", "assistant"),
                                   "content": "" if isinstance(text, str) else None}})]
    if isinstance(text, str):
        out.extend(chunk(index, {"delta": {"content": p}}) for p in _pieces(message["content"]))
    if isinstance(message.get("refusal"), str):
        out.append(chunk(index, {"delta": {"refusal": message["refusal"]}}))
    for i, call in enumerate(message.get("tool_calls") or ()):
        out.append(chunk(index, {"delta": {"tool_calls": [{"index": i, **call}]}}))
    return out


def _event(name: str, obj: dict[str, Any]) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + _dumps(obj) + b"\n\n"


def _messages(answer: dict[str, Any]) -> list[bytes]:
    usage = dict(answer.get("usage") or {})
    start = {**answer, "content": [], "stop_reason": None, "stop_sequence": None,
             "usage": {**usage, "output_tokens": 1}}
    out = [_event("message_start", {"type": "message_start", "message": start})]
    for index, block in enumerate(answer.get("content") or ()):
        out.extend(_block(index, block))
    out.append(_event("message_delta", {
        "type": "message_delta",
        "delta": {"stop_reason": answer.get("stop_reason"),
                  "stop_sequence": answer.get("stop_sequence")},
        "usage": usage,
    }))
    out.append(_event("message_stop", {"type": "message_stop"}))
    return out


def _block(index: int, block: dict[str, Any]) -> list[bytes]:
    kind = block.get("type")
    deltas: list[dict[str, Any]] = []
    opening = dict(block)
    if kind == "text":
        opening["text"] = ""
        deltas = [{"type": "text_delta", "text": p} for p in _pieces(block.get("text", ""))]
    elif kind in ("tool_use", "server_tool_use"):
        opening["input"] = {}
        deltas = [{"type": "input_json_delta", "partial_json": _dumps(block.get("input", {}))
                   .decode()}]
    elif kind == "thinking":
        opening["thinking"], opening["signature"] = "", ""
        deltas = [{"type": "thinking_delta", "thinking": p}
                  for p in _pieces(block.get("thinking", ""))]
        deltas.append({"type": "signature_delta", "signature": block.get("signature", "")})
    out = [_event("content_block_start", {"type": "content_block_start", "index": index,
                                          "content_block": opening})]
    out.extend(_event("content_block_delta", {"type": "content_block_delta", "index": index,
                                              "delta": d}) for d in deltas)
    out.append(_event("content_block_stop", {"type": "content_block_stop", "index": index}))
    return out
