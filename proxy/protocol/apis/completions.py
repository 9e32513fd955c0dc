"""OpenAI's legacy Completions (`/v1/completions`): an answer's `choices[].text`, a stream's
`text_completion` chunks with `choices[].text`, the usage in a chunk of its own when
`stream_options.include_usage` asked for it, `data: [DONE]` last. The one text kind: output."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from proxy.protocol.apis.chat import (
    FINISH_MARK,
    assemble_choices,
    choice_finish_reasons,
    choices_texts,
    chunk_head,
)
from proxy.protocol.codec import Codec, Text, TextKind, data_event, pieces

CAP_FIELDS = ("max_tokens",)


def choice_texts(choice: dict[str, Any]) -> Iterator[Text]:
    text = choice.get("text")
    if isinstance(text, str) and text:
        yield Text(TextKind.OUTPUT, (choice.get("index", 0),), choice, "text", text)


def _new(index: int) -> dict[str, Any]:
    return {"index": index, "text": "", "logprobs": None, "finish_reason": None}


def _take(choice: dict[str, Any], delta: dict[str, Any]) -> None:
    """Nothing but the text (joined at the end)."""


def _close(choice: dict[str, Any], texts: list[str]) -> dict[str, Any]:
    choice["text"] = "".join(texts)
    return choice


class CompletionsCodec(Codec):
    operation = "text_completion"
    streams = True
    cap_fields = CAP_FIELDS
    natural = frozenset({"stop"})
    capped = "length"
    finish_mark = FINISH_MARK

    def texts(self, obj: dict[str, Any]) -> Iterator[Text]:
        return choices_texts(obj, choice_texts)

    def finish_reasons(self, answer: dict[str, Any]) -> list[Any]:
        return choice_finish_reasons(answer)

    def assemble(self, events: list[dict[str, Any]]) -> dict[str, Any] | None:
        made = assemble_choices(events, "text", _take, _new, _close)
        if made is None:
            return None
        head, choices, usage = made
        answer = {**chunk_head(head), "object": "text_completion", "choices": choices}
        if usage is not None:
            answer["usage"] = usage
        return answer

    def replay(self, answer: dict[str, Any], *, include_usage: bool) -> bytes:
        head = {**chunk_head(answer), "object": "text_completion"}
        extra = {"usage": None} if include_usage else {}
        out: list[bytes] = []

        def chunk(index: int, text: str, finish: str | None = None) -> bytes:
            choice = {"index": index, "text": text, "logprobs": None, "finish_reason": finish}
            return data_event({**head, "choices": [choice], **extra})

        for choice in answer.get("choices") or ():
            index = choice.get("index", 0)
            out.extend(chunk(index, p) for p in pieces(choice.get("text") or ""))
            out.append(chunk(index, "", choice.get("finish_reason")))
        if include_usage and answer.get("usage") is not None:
            out.append(data_event({**head, "choices": [], "usage": answer["usage"]}))
        out.append(b"data: [DONE]\n\n")
        return b"".join(out)


CODEC = CompletionsCodec()
