"""OpenAI's Embeddings (`/v1/embeddings`): a JSON answer with a `usage`, no text, no stream."""

from __future__ import annotations

from proxy.protocol.codec import Codec


class EmbeddingsCodec(Codec):
    operation = "embeddings"


CODEC = EmbeddingsCodec()
