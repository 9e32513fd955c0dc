"""Store URLs, read in one place: which SQL dialect a ledger or capture URL names and its SQLite
file, whether a Redis URL names a cluster, a URL as it may be shown (no password), and the
state directory a store's files go in when no URL says otherwise."""

from __future__ import annotations

import enum
import os
import re
from pathlib import Path
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

# What the ledger and the capture store take: an SQLite file by absolute path (the third slash
# starts it) or a PostgreSQL server.
SQL_URL = re.compile(r"^(sqlite:///.+|postgres(ql)?://.+)$")
SQLITE_SCHEME = "sqlite://"
# What the budget's store and the cache take besides `memory`: a Redis server (TCP, TLS or a
# Unix socket) or any node of a Redis Cluster.
REDIS_URL = re.compile(r"^(rediss?(\+cluster)?|unix)://")
_CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}


class Dialect(enum.StrEnum):
    SQLITE = "sqlite"
    POSTGRESQL = "postgresql"


def dialect_of(url: str) -> Dialect | None:
    """The SQL dialect `url` names; None: not a URL of an SQL store."""
    if not SQL_URL.match(url):
        return None
    return Dialect.POSTGRESQL if url.startswith("postgres") else Dialect.SQLITE


def sqlite_path(url: str) -> Path:
    """The file of an `sqlite:///abs/path` URL: `/abs/path`."""
    return Path(url.removeprefix(SQLITE_SCHEME))


def sqlite_url(path: Path) -> str:
    """The URL of an SQLite file, its path made absolute (as the stores name themselves)."""
    return f"{SQLITE_SCHEME}{path.absolute()}"


def cluster_url(url: str) -> str | None:
    """The plain URL redis-py's cluster client takes, if `url` names a Redis Cluster."""
    scheme, sep, rest = url.partition("://")
    plain = _CLUSTER_SCHEMES.get(scheme)
    return f"{plain}{sep}{rest}" if plain is not None and sep else None


def mask_url(url: str) -> str:
    """The URL with any password replaced by ***: for logs, /readyz and the reports."""
    parts = urlsplit(url)
    netloc = parts.netloc
    if parts.password is not None:
        userinfo, _, hostinfo = netloc.rpartition("@")
        user = userinfo.split(":", 1)[0]
        netloc = f"{user}:***@{hostinfo}"
    query = parts.query
    if query:
        pairs = parse_qsl(query, keep_blank_values=True)
        query = urlencode([(k, "***" if k.lower() in ("password", "passfile") else v)
                           for k, v in pairs], safe="*")
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


def shown_url(url: str) -> str:
    """A store's URL as printed: an SQLite file as written, any other with its password
    masked."""
    return url if url.startswith("sqlite") else mask_url(url)


def state_dir() -> Path:
    """Where the proxy's own files go when the configuration names no place: the spools, the
    SQLite ledger. $TOKENMETER_STATE_DIR, else $XDG_STATE_HOME/tokenmeter, else
    ~/.local/state/tokenmeter."""
    env = os.environ.get("TOKENMETER_STATE_DIR")
    if env:
        return Path(env)
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "tokenmeter"
