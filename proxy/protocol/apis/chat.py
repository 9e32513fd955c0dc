"""OpenAI's Chat Completions (`/v1/chat/completions`): an answer's `choices[].message`, a
stream's `chat.completion.chunk` events with `choices[].delta`, the usage in a chunk of its own
(with no choices) when `stream_options.include_usage` asked for it, `data: [DONE]` last.

A message's texts: `content`, the reasoning (`reasoning_content` from DeepSeek, vLLM and
llama.cpp, `reasoning` from others), `refusal`, and each tool call's function name and
arguments (`tool_calls`, and the deprecated single `function_call`)."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from proxy.protocol.codec import Codec, Text, TextKind, data_event, pieces

CAP_FIELDS = ("max_completion_tokens", "max_tokens")

# A message's (or delta's) fields that hold its texts, by kind.
_FIELDS = (("content", TextKind.OUTPUT), ("reasoning_content", TextKind.REASONING),
           ("reasoning", TextKind.REASONING), ("refusal", TextKind.REFUSAL))
_STRING_FIELDS = tuple(field for field, _ in _FIELDS)

_HEAD: tuple[str, ...] = ("id", "created", "model", "system_fingerprint", "service_tier")

# tuple.__new__ skips the NamedTuple constructor's extra call: once per event of a stream.
_new_text = tuple.__new__
_OUTPUT = TextKind.OUTPUT

FINISH_MARK = re.compile(rb'"finish_reason"\s*:\s*"([A-Za-z_]+)"')


def chunk_head(obj: dict[str, Any]) -> dict[str, Any]:
    """The fields every chunk of an OpenAI stream repeats (and its answer has once)."""
    return {k: obj[k] for k in _HEAD if k in obj}


def choice_texts(choice: dict[str, Any]) -> Iterator[Text]:
    """The texts of one choice of an answer (`message`) or of a chunk (`delta`)."""
    at = choice.get("index", 0)
    msg = choice.get("delta")
    if not isinstance(msg, dict):
        msg = choice.get("message")
        if not isinstance(msg, dict):
            return
    for field, kind in _FIELDS:
        text = msg.get(field)
        if isinstance(text, str) and text:
            yield Text(kind, (at, field), msg, field, text)
    calls = msg.get("tool_calls")
    for n, call in enumerate(calls if isinstance(calls, list) else ()):
        fn = call.get("function") if isinstance(call, dict) else None
        if isinstance(fn, dict):
            yield from _call_texts((at, "tool", call.get("index", n)), fn)
    fn = msg.get("function_call")
    if isinstance(fn, dict):
        yield from _call_texts((at, "function_call"), fn)


def _call_texts(at: tuple[Any, ...], fn: dict[str, Any]) -> Iterator[Text]:
    name, arguments = fn.get("name"), fn.get("arguments")
    if isinstance(name, str) and name:
        yield Text(TextKind.TOOL_NAME, at, fn, "name", name)
    if isinstance(arguments, str) and arguments:
        yield Text(TextKind.TOOL_ARGS, at, fn, "arguments", arguments)


def choices_texts(obj: dict[str, Any],
                  of_choice: Callable[[dict[str, Any]], Iterator[Text]]) -> Iterator[Text]:
    choices = obj.get("choices")
    for choice in choices if isinstance(choices, list) else ():
        if isinstance(choice, dict):
            yield from of_choice(choice)


def assemble_choices(events: list[dict[str, Any]], field: str,
                     take: Callable[[dict[str, Any], dict[str, Any]], None],
                     new: Callable[[int], dict[str, Any]],
                     close: Callable[[dict[str, Any], list[str]], dict[str, Any]],
                     ) -> tuple[dict[str, Any], list[dict[str, Any]], Any] | None:
    """The choices of a Chat or Completions stream, each from its deltas: (the first chunk,
    the choices in order, the last usage). `field`: the delta's text field (`content`,
    `text`), whose pieces are joined once at the end; `take` applies the rest of a delta."""
    head: dict[str, Any] | None = None
    choices: dict[int, dict[str, Any]] = {}
    texts: dict[int, list[str]] = {}
    usage = None
    for chunk in events:
        if "error" in chunk:
            return None
        if head is None:
            head = chunk
        if chunk.get("usage"):
            usage = chunk["usage"]
        for delta in chunk.get("choices") or ():
            index = delta.get("index", 0)
            body = delta.get("delta") or {} if field == "content" else delta
            piece = body.get(field)
            # The common event: one piece of text, nothing else (a dict look-up or two).
            if isinstance(piece, str) and index in choices and (
                    field == "text" or len(body) == 1):
                texts[index].append(piece)
            else:
                if index not in choices:
                    choices[index] = new(int(index))
                    texts[index] = []
                if isinstance(piece, str):
                    texts[index].append(piece)
                take(choices[index], body)
            if delta.get("finish_reason"):
                choices[index]["finish_reason"] = delta["finish_reason"]
    if head is None or not choices:
        return None
    return head, [close(choices[i], texts[i]) for i in sorted(choices)], usage


def _new(index: int) -> dict[str, Any]:
    return {"index": index, "message": {"role": "assistant", "content": None},
            "logprobs": None, "finish_reason": None, "_tools": {}}


def _take(choice: dict[str, Any], delta: dict[str, Any]) -> None:
    """Everything of a delta but its content (joined at the end)."""
    message = choice["message"]
    if delta.get("role"):
        message["role"] = delta["role"]
    for field in _STRING_FIELDS[1:]:
        piece = delta.get(field)
        if isinstance(piece, str):
            message[field] = (message.get(field) or "") + piece
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


def _close(choice: dict[str, Any], texts: list[str]) -> dict[str, Any]:
    tools = choice.pop("_tools")
    if texts:
        choice["message"]["content"] = "".join(texts)
    if tools:
        choice["message"]["tool_calls"] = [tools[i] for i in sorted(tools)]
    return choice


def choice_finish_reasons(answer: dict[str, Any]) -> list[Any]:
    """Each choice's finish reason (None where a choice has none), Chat's and Completions'."""
    choices = answer.get("choices")
    if not isinstance(choices, list):
        return []
    return [c.get("finish_reason") if isinstance(c, dict) else None for c in choices]


class ChatCodec(Codec):
    operation = "chat"
    streams = True
    cap_fields = CAP_FIELDS
    natural = frozenset({"stop", "tool_calls", "function_call"})
    capped = "length"
    finish_mark = FINISH_MARK

    def texts(self, obj: dict[str, Any]) -> Iterable[Text]:
        # Most events of most streams: one choice whose delta is a piece of content alone,
        # taken without the general walk (and without a generator: a third of a whole
        # stream's walk).
        choices = obj.get("choices")
        if type(choices) is list and len(choices) == 1:
            choice = choices[0]
            delta = choice.get("delta") if type(choice) is dict else None
            if type(delta) is dict and len(delta) == 1:
                piece = delta.get("content")
                if type(piece) is str:
                    if not piece:
                        return ()
                    return (_new_text(Text, (_OUTPUT, (choice.get("index", 0), "content"),
                                             delta, "content", piece)),)
        return choices_texts(obj, choice_texts)

    def finish_reasons(self, answer: dict[str, Any]) -> list[Any]:
        return choice_finish_reasons(answer)

    def assemble(self, events: list[dict[str, Any]]) -> dict[str, Any] | None:
        made = assemble_choices(events, "content", _take, _new, _close)
        if made is None:
            return None
        head, choices, usage = made
        answer = {**chunk_head(head), "object": "chat.completion", "choices": choices}
        if usage is not None:
            answer["usage"] = usage
        return answer

    def replay(self, answer: dict[str, Any], *, include_usage: bool) -> bytes:
        head = {**chunk_head(answer), "object": "chat.completion.chunk"}
        extra = {"usage": None} if include_usage else {}
        out: list[bytes] = []

        def chunk(index: int, delta: dict[str, Any], finish: str | None = None) -> bytes:
            choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}
            return data_event({**head, "choices": [choice], **extra})

        for choice in answer.get("choices") or ():
            index = choice.get("index", 0)
            message = choice.get("message") or {}
            text = message.get("content")
            out.append(chunk(index, {"role": message.get("role", "assistant"),
                                     "content": "" if isinstance(text, str) else None}))
            for field in ("reasoning_content", "reasoning"):
                if isinstance(message.get(field), str):
                    out.extend(chunk(index, {field: p}) for p in pieces(message[field]))
            if isinstance(text, str):
                out.extend(chunk(index, {"content": p}) for p in pieces(text))
            if isinstance(message.get("refusal"), str):
                out.append(chunk(index, {"refusal": message["refusal"]}))
            for i, call in enumerate(message.get("tool_calls") or ()):
                out.append(chunk(index, {"tool_calls": [{"index": i, **call}]}))
            out.append(chunk(index, {}, choice.get("finish_reason")))
        if include_usage and answer.get("usage") is not None:
            out.append(data_event({**head, "choices": [], "usage": answer["usage"]}))
        out.append(b"data: [DONE]\n\n")
        return b"".join(out)

    def call_id(self, event: dict[str, Any], text: Text) -> str | None:
        if text.at[1] != "tool":
            return None
        for choice in event.get("choices") or ():
            msg = choice.get("delta") or choice.get("message") if isinstance(choice, dict) else None
            if not isinstance(msg, dict) or choice.get("index", 0) != text.at[0]:
                continue
            for n, call in enumerate(msg.get("tool_calls") or ()):
                if (isinstance(call, dict) and call.get("index", n) == text.at[2]
                        and isinstance(call.get("id"), str)):
                    return str(call["id"])
        return None


CODEC = ChatCodec()
