"""Who is calling, as every part of the proxy names them: a key's hash, its id, the name shown
for it. The one place these are computed: the configuration hashes the keys it reads with
`key_hash`, authentication hashes the key a client sends with it, and the budget's counters,
the cache's rules, the ledger's rows and the logs name a key by `key_id` or `key_label`.

A client's key itself is never kept: it is hashed as it is read, and only its hash (to look it
up) and the hash's first 12 hex digits (to show it) go further. The caller's whole identity as
admission sees it (user, key id and name, team, and the limits that hold them) is the budget's
`proxy.budget.principal.Principal`, made by `proxy.auth` with these.
"""

from __future__ import annotations

import hashlib

HASH_PREFIX = "sha256:"
KEY_ID_DIGITS = 12  # enough to tell a configuration's keys apart in a log line


def key_hash(raw: str) -> str:
    """`sha256:<hex>` of a raw key: how the configuration stores keys and how a client's key
    is looked up."""
    return HASH_PREFIX + hashlib.sha256(raw.encode()).hexdigest()


def key_id(hashed: str) -> str:
    """A key's id, from its `sha256:<hex>` hash: the first 12 hex digits, safe to log."""
    return hashed.removeprefix(HASH_PREFIX)[:KEY_ID_DIGITS]


def key_label(name: str | None, hashed_id: str | None) -> str | None:
    """What names a key in the books, the logs and its counters: its configured name, else its
    id (None: no key)."""
    return name or hashed_id
