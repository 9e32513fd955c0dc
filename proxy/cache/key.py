"""The key of a request's entry: a sha256 of what decides its answer.

That is the API shape (its operation), the model sent upstream and the upstream it is sent to
(its name and URL: a reload that routes the model elsewhere makes its entries misses), and the
body's fields but
those that change only how the answer is delivered or labelled (`stream`, `stream_options`)
or who asked (`user`, `metadata`), in canonical JSON (sorted keys, no spaces); and whose entry
it is (the scope's principal id). Never the client's key (its hash's prefix at most, for
`scope: key`) nor any header."""

from __future__ import annotations

import hashlib
import json
from typing import Any

# Fields that do not change the answer's content: a streamed and a non-streamed request of the
# same content share an entry (replayed in the form asked for).
_DELIVERY = frozenset({"stream", "stream_options", "user", "metadata"})


def canonical(body: dict[str, Any]) -> bytes:
    """The body's answer-deciding fields as canonical JSON (bounded by the body's own size,
    which admission already bounded)."""
    kept = {k: v for k, v in body.items() if k not in _DELIVERY}
    return json.dumps(kept, sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                      allow_nan=False).encode()


def cache_key(operation: str, model: str, upstream: str, body: dict[str, Any],
              scope_id: str) -> str:
    digest = hashlib.sha256()
    for part in (operation.encode(), model.encode(), upstream.encode(), scope_id.encode()):
        digest.update(len(part).to_bytes(4, "big"))
        digest.update(part)
    digest.update(canonical(body))
    return digest.hexdigest()
