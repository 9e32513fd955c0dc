"""Anthropic's `/v1/messages/count_tokens`: a JSON answer (`input_tokens`), no text, no stream,
no usage to bill (it generates nothing)."""

from __future__ import annotations

from typing import Any

from proxy.protocol.codec import Codec
from proxy.protocol.usage import Usage


class CountTokensCodec(Codec):
    operation = "count_tokens"

    def usage(self, answer: dict[str, Any]) -> Usage | None:
        return Usage()


CODEC = CountTokensCodec()
