"""The codec of each API shape, by the request's operation (what the ledger books it as): the
one table the readers, the cache and capture find an API's wire format in. Adding an API shape
is a module in `proxy.protocol.apis` and a line here."""

from __future__ import annotations

from collections.abc import Mapping

from proxy.protocol.apis import chat, completions, count_tokens, embeddings, messages, responses
from proxy.protocol.codec import Codec, Shown, Text, TextKind

__all__ = ["CODECS", "Codec", "Shown", "Text", "TextKind", "codec_for"]

CODECS: Mapping[str, Codec] = {
    codec.operation: codec
    for codec in (chat.CODEC, completions.CODEC, responses.CODEC, embeddings.CODEC,
                  messages.CODEC, count_tokens.CODEC)
}


def codec_for(operation: str) -> Codec:
    """The codec of an operation; the base codec (no texts, no stream) for one unknown."""
    return CODECS.get(operation) or embeddings.CODEC
