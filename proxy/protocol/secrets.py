"""The forms a secret (an API key) takes in a JSON text: the one definition that both the
scrubbing of upstream error bodies (`upstream_errors.secret_forms`) and the capture's
redaction (`proxy.capture.redact`) use, so a form one knows the other does too."""

from __future__ import annotations

import json


def key_forms(key: str) -> tuple[str, ...]:
    """`key` as it is, JSON-escaped (`"`, `\\`, `/` as `\\/`, non-ASCII or every character as
    `\\uXXXX`), and JSON-escaped twice (a key inside a JSON string inside JSON, as tool
    arguments are); longest first, so a form holding another is replaced first."""
    once = json.dumps(key)[1:-1]
    forms = {key, once, json.dumps(key, ensure_ascii=False)[1:-1], once.replace("/", "\\/"),
             json.dumps(once)[1:-1], json.dumps(once.replace("/", "\\/"))[1:-1],
             "".join(f"\\u{ord(c):04x}" for c in key), "".join(f"\\u{ord(c):04X}" for c in key)}
    return tuple(sorted(forms, key=len, reverse=True))
