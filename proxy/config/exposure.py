"""Secrets a configuration file holds in clear while every user of the machine can read it.

A client key written raw in `users.<name>.keys` (not `sha256:<hex>`, not `${ENV}`: the default
of a `${ENV:-default}` is in the file), an upstream `api_key` or a `metrics.token` written in
the file is readable by anyone who can read the file.
`check-config` and `serve` warn about it; they do not refuse, since the file may sit on a
machine where that is intended. Only field names are reported, never a value.
"""

from __future__ import annotations

import re
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from proxy.identity import HASH_PREFIX

# `${VAR}` is read from the environment; `${VAR:-default}`'s default is written in the file.
_REFERENCE = re.compile(r"\$\{\w+(?::-([^}]*))?\}")


def _literal(value: object) -> bool:
    """A secret written in the file itself: what is left once `${VAR}`s are taken out (and
    `${VAR:-default}`s replaced by their defaults) is not empty."""
    return isinstance(value, str) and bool(_REFERENCE.sub(lambda m: m[1] or "", value))


def _raw_client_keys(data: dict[str, Any]) -> Iterator[str]:
    users = data.get("users")
    if not isinstance(users, dict):
        return
    for user, entry in users.items():
        keys = entry.get("keys") if isinstance(entry, dict) else None
        for i, key in enumerate(keys if isinstance(keys, list) else []):
            value = key.get("key") if isinstance(key, dict) else key
            if _literal(value) and not str(value).lower().startswith(HASH_PREFIX):
                yield f"users.{user}.keys[{i}]"


def _raw_other_secrets(data: dict[str, Any]) -> Iterator[str]:
    upstreams = data.get("upstreams")
    for name, upstream in (upstreams.items() if isinstance(upstreams, dict) else ()):
        if isinstance(upstream, dict) and _literal(upstream.get("api_key")):
            yield f"upstreams.{name}.api_key"
    metrics = data.get("metrics")
    if isinstance(metrics, dict) and _literal(metrics.get("token")):
        yield "metrics.token"


def exposure_warning(path: Path) -> str | None:
    """A warning when `path` is readable by others (`o+r`) and holds secrets in clear, else
    None (also when it cannot be read: loading it reports that)."""
    try:
        mode = path.stat().st_mode
        if not mode & stat.S_IROTH:
            return None
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return None
    if not isinstance(data, dict):
        return None
    client = list(_raw_client_keys(data))
    other = list(_raw_other_secrets(data))
    if not client and not other:
        return None
    fields = ", ".join([*client, *other])
    advice = []
    if client:
        advice.append("give client keys as 'sha256:<hex>' (printf %s KEY | sha256sum)")
    if other:
        advice.append("give secrets as ${ENV} variables")
    return (f"{path} is readable by every user of this machine (mode "
            f"{stat.S_IMODE(mode):04o}) and holds secrets in clear ({fields}): "
            f"`chmod o-r` it, and {' and '.join(advice)}")
