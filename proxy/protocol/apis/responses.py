"""OpenAI's Responses (`/v1/responses`): an answer's `output` items (a `message` with
`output_text` and `refusal` parts, a `reasoning` item with its `summary` and `content` parts, a
`function_call` or `custom_tool_call` with its name and arguments or input), a stream's named
events (`response.created`, items and parts added and done, their text deltas, and a terminal
`response.completed`, `.incomplete` or `.failed` carrying the whole response)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from proxy.protocol.codec import Codec, Text, TextKind, named_event, pieces

CAP_FIELDS = ("max_output_tokens",)

# The delta events, by type: the kind of text, and the part of its item it is a piece of
# (`content`, `summary`, or None for a tool call's arguments).
DELTAS: dict[str, tuple[TextKind, str | None]] = {
    "response.output_text.delta": (TextKind.OUTPUT, "content"),
    "response.refusal.delta": (TextKind.REFUSAL, "content"),
    "response.reasoning_text.delta": (TextKind.REASONING, "content"),
    "response.reasoning_summary_text.delta": (TextKind.REASONING, "summary"),
    "response.function_call_arguments.delta": (TextKind.TOOL_ARGS, None),
    "response.custom_tool_call_input.delta": (TextKind.TOOL_ARGS, None),
    "response.output_audio_transcript.delta": (TextKind.OUTPUT, "audio"),
}
TERMINAL = frozenset({"response.completed", "response.incomplete", "response.failed"})
_TOOL_ITEMS = {"function_call": "arguments", "custom_tool_call": "input"}
_PART_INDEX = {"content": "content_index", "summary": "summary_index"}
# A part's text field, and its kind (a reasoning item's parts are reasoning, whatever their type).
_PART_FIELDS = (("text", TextKind.OUTPUT), ("refusal", TextKind.REFUSAL))


def _item_texts(index: Any, item: dict[str, Any], *, added: bool) -> Iterator[Text]:
    """An output item's texts (`added`: as `response.output_item.added` opens it: its name
    only, its texts streamed after)."""
    kind = item.get("type")
    if kind in _TOOL_ITEMS:
        name = item.get("name")
        if isinstance(name, str) and name:
            yield Text(TextKind.TOOL_NAME, (index,), item, "name", name)
        field = _TOOL_ITEMS[kind]
        args = item.get(field)
        if not added and isinstance(args, str) and args:
            yield Text(TextKind.TOOL_ARGS, (index,), item, field, args)
        return
    if added:
        return
    for part_name in ("summary", "content"):
        parts = item.get(part_name)
        for n, part in enumerate(parts if isinstance(parts, list) else ()):
            if not isinstance(part, dict):
                continue
            for field, part_kind in _PART_FIELDS:
                text = part.get(field)
                if isinstance(text, str) and text:
                    text_kind = TextKind.REASONING if kind == "reasoning" else part_kind
                    yield Text(text_kind, (index, part_name, n), part, field, text)


def _event_texts(obj: dict[str, Any], kind: str) -> Iterator[Text]:
    found = DELTAS.get(kind)
    if found is not None:
        text = obj.get("delta")
        if isinstance(text, str) and text:
            text_kind, part = found
            at: tuple[Any, ...] = (obj.get("output_index"),)
            if part is not None:
                at = (*at, part, obj.get(_PART_INDEX.get(part, ""), 0))
            yield Text(text_kind, at, obj, "delta", text)
    elif kind == "response.output_item.added":
        item = obj.get("item")
        if isinstance(item, dict):
            yield from _item_texts(obj.get("output_index"), item, added=True)


class ResponsesCodec(Codec):
    operation = "responses"
    streams = True
    cap_fields = CAP_FIELDS

    def texts(self, obj: dict[str, Any]) -> Iterator[Text]:
        kind = obj.get("type")
        if isinstance(kind, str) and kind.startswith("response."):
            yield from _event_texts(obj, kind)
            return
        output = obj.get("output")
        for index, item in enumerate(output if isinstance(output, list) else ()):
            if isinstance(item, dict):
                yield from _item_texts(index, item, added=False)

    def finish_reasons(self, answer: dict[str, Any]) -> list[Any]:
        status = answer.get("status")
        if status == "incomplete":
            details = answer.get("incomplete_details")
            return [details.get("reason") if isinstance(details, dict) else None]
        return [status] if status is not None else []

    natural = frozenset({"completed"})
    capped = "max_output_tokens"

    def assemble(self, events: list[dict[str, Any]]) -> dict[str, Any] | None:
        """The terminal event's response; its output from the items done if it has none (a
        server that sends the whole response only piece by piece)."""
        done: dict[int, dict[str, Any]] = {}
        for event in events:
            kind = event.get("type")
            if kind == "error":
                return None
            if kind == "response.output_item.done" and isinstance(event.get("item"), dict):
                done[int(event.get("output_index", len(done)))] = event["item"]
            elif kind in TERMINAL and isinstance(event.get("response"), dict):
                answer = dict(event["response"])
                if not answer.get("output") and done:
                    answer["output"] = [done[i] for i in sorted(done)]
                return answer
        return None

    def replay(self, answer: dict[str, Any], *, include_usage: bool) -> bytes:
        events = _Replay()
        opened = {**answer, "status": "in_progress", "output": [], "usage": None}
        events.add("response.created", {"response": opened})
        for index, item in enumerate(answer.get("output") or ()):
            _replay_item(events, index, item)
        status = answer.get("status")
        events.add(f"response.{status if status in ('incomplete', 'failed') else 'completed'}",
                   {"response": answer})
        return b"".join(events.out)


class _Replay:
    """The events of a replay, numbered (`sequence_number`) as the API numbers them."""

    def __init__(self) -> None:
        self.out: list[bytes] = []

    def add(self, kind: str, body: dict[str, Any]) -> None:
        self.out.append(named_event(kind, {"type": kind, "sequence_number": len(self.out),
                                           **body}))


def _replay_item(events: _Replay, index: int, item: dict[str, Any]) -> None:
    kind = item.get("type")
    item_id = item.get("id")
    ids = {"item_id": item_id, "output_index": index}
    if kind in _TOOL_ITEMS:
        field = _TOOL_ITEMS[kind]
        events.add("response.output_item.added",
                   {"output_index": index, "item": {**item, field: ""}})
        text = item.get(field) or ""
        delta = ("response.function_call_arguments" if kind == "function_call"
                 else "response.custom_tool_call_input")
        events.add(f"{delta}.delta", {**ids, "delta": text})
        events.add(f"{delta}.done", {**ids, field: text})
    else:
        opened = {k: ([] if k in ("content", "summary") else v) for k, v in item.items()}
        events.add("response.output_item.added", {"output_index": index, "item": opened})
        for n, part in enumerate(item.get("summary") or ()):
            _replay_part(events, {**ids, "summary_index": n}, part,
                         "response.reasoning_summary")
        for n, part in enumerate(item.get("content") or ()):
            prefix = "response.reasoning" if kind == "reasoning" else "response"
            _replay_part(events, {**ids, "content_index": n}, part, prefix)
    events.add("response.output_item.done", {"output_index": index, "item": item})


def _replay_part(events: _Replay, at: dict[str, Any], part: dict[str, Any],
                 prefix: str) -> None:
    field = "refusal" if part.get("type") == "refusal" else "text"
    text = part.get(field) or ""
    # The delta's event: `response.refusal.delta`, `response.output_text.delta`,
    # `response.reasoning_text.delta`, `response.reasoning_summary_text.delta`.
    name = f"{prefix}.refusal" if field == "refusal" else (
        f"{prefix}_text" if prefix != "response" else "response.output_text")
    added = "response.reasoning_summary_part" if "summary_index" in at else (
        "response.content_part")
    events.add(f"{added}.added", {**at, "part": {**part, field: ""}})
    for piece in pieces(text):
        events.add(f"{name}.delta", {**at, "delta": piece})
    events.add(f"{name}.done", {**at, field: text})
    events.add(f"{added}.done", {**at, "part": part})


CODEC = ResponsesCodec()
