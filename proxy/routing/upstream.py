"""Which upstream serves a model, and which headers cross the proxy in each direction."""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit

from multidict import CIMultiDict

from proxy.config.load import Config, LatencyFallback, RetryConfig, UpstreamApi, UpstreamConfig
from proxy.config.tags import HEADER as TAGS_HEADER
from proxy.errors import UpstreamRedirect
from proxy.protocol.upstream_errors import secret_forms

# RFC 9110 7.6.1 hop-by-hop fields, plus what the proxy itself must own: the client's credentials
# (never forwarded), framing (recomputed), Host, and Accept-Encoding (we ask for identity so the
# SSE bytes we meter are the bytes we forward).
_HOP_BY_HOP = frozenset(
    {
        "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te",
        "trailer", "trailers", "transfer-encoding", "upgrade", "proxy-connection",
    }
)
# The proxy's own tags header is the proxy's (a free tag may name a customer): not forwarded.
_REQUEST_DROP = _HOP_BY_HOP | {"host", "authorization", "api-key", "x-api-key",
                               "content-length", "accept-encoding", TAGS_HEADER}
_RESPONSE_DROP = _HOP_BY_HOP | {"content-length"}
# The proxy's own response headers (its cost, tokens, cache verdict, request id, clamp...) are
# the proxy's to write: one an upstream sends would read as the proxy's word to the client.
_OWN_PREFIX = "x-tokenmeter-"


@dataclass(frozen=True, slots=True)
class Upstream:
    """A configured upstream as the request path reads it: its `UpstreamConfig`'s settings
    (defaults live there only) as plain attributes, read on every call, and what they imply."""

    name: str
    base_url: str
    api_key: str | None
    connect_timeout_s: float
    first_byte_timeout_s: float
    idle_timeout_s: float
    total_timeout_s: float
    stream_usage: bool
    retry: RetryConfig
    write_all_caps: bool  # see UpstreamConfig.cap_fields
    api: UpstreamApi

    @classmethod
    def of(cls, name: str, u: UpstreamConfig) -> Upstream:
        return cls(
            name=name, base_url=u.base_url, api_key=u.api_key,
            connect_timeout_s=u.connect_timeout_s, first_byte_timeout_s=u.first_byte_timeout_s,
            idle_timeout_s=u.idle_timeout_s, total_timeout_s=u.total_timeout_s,
            stream_usage=u.stream_usage, retry=u.retry, write_all_caps=_writes_all_caps(u),
            api=u.api,
        )


def _writes_all_caps(u: UpstreamConfig) -> bool:
    if u.cap_fields == "auto":
        host = urlsplit(u.base_url).hostname or ""
        return host != "api.openai.com"
    return u.cap_fields == "all"


@dataclass(frozen=True, slots=True)
class Route:
    upstream: Upstream
    pattern: str
    fallbacks: tuple[str, ...] = ()
    latency: LatencyFallback | None = None
    hidden_output: bool | None = None  # see ModelRoute.hidden_output


class Router:
    def __init__(self, config: Config) -> None:
        self.upstreams = {name: Upstream.of(name, u) for name, u in config.upstreams.items()}
        # The upstream keys as an error body may echo them: scrubbed before it is relayed.
        self.key_forms = secret_forms(u.api_key for u in self.upstreams.values() if u.api_key)
        self._routes = [
            (
                re.compile(fnmatch.translate(r.match)),
                Route(self.upstreams[r.upstream], r.match, tuple(r.fallbacks), r.latency_fallback,
                      r.hidden_output),
            )
            for r in config.models
        ]
        exact = {r.match for r in config.models if not any(c in r.match for c in "*?[")}
        self._labels: set[str] = exact | set(config.metrics.model_labels)
        self.discovered: set[str] = set()

    def resolve(self, model: str) -> Route | None:
        for regex, route in self._routes:
            if regex.match(model):
                return route
        return None

    def add_model_labels(self, names: Iterable[str], limit: int = 1000) -> None:
        """Names the upstreams list at /v1/models: a bounded set not chosen by clients."""
        for name in names:
            if len(self._labels) >= limit:
                break
            self._labels.add(name)
            self.discovered.add(name)

    def model_label(self, model: str, route: Route | None) -> str:
        if model in self._labels:
            return model
        return route.pattern if route is not None else "unrouted"


def upstream_request_headers(
    client: Mapping[str, str], upstream: Upstream, *, client_key: str | None = None
) -> CIMultiDict[str]:
    """`client_key`: pass-through mode, where the client's own key is the upstream key."""
    drop = _REQUEST_DROP | _connection_tokens(client)
    out: CIMultiDict[str] = CIMultiDict(
        (k, v) for k, v in client.items() if k.lower() not in drop
    )
    out["Accept-Encoding"] = "identity"
    key = client_key or upstream.api_key
    if key and upstream.api is UpstreamApi.ANTHROPIC:
        out["x-api-key"] = key
    elif key:
        out["Authorization"] = f"Bearer {key}"
    return out


def redirect_refused(upstream: Upstream, status: int) -> UpstreamRedirect | None:
    """The error for an upstream answer that is a redirect (any 3xx), else None. Every call to
    an upstream is made with `allow_redirects=False` (aiohttp follows them by default): a
    followed redirect would send the operator's key and the client's prompt to an origin the
    configuration does not name, and hand the client that origin's answer. The message names
    the upstream and the status only; the `Location` is the upstream's text."""
    if not 300 <= status < 400:
        return None
    return UpstreamRedirect(
        f"Upstream `{upstream.name}` answered {status}, a redirect; the proxy does not follow "
        "redirects to upstreams (check its base_url)."
    )


def client_response_headers(upstream: Mapping[str, str]) -> CIMultiDict[str]:
    drop = _RESPONSE_DROP | _connection_tokens(upstream)
    return CIMultiDict((k, v) for k, v in upstream.items()
                       if (name := k.lower()) not in drop and not name.startswith(_OWN_PREFIX))


def _connection_tokens(headers: Mapping[str, str]) -> frozenset[str]:
    """Fields named in `Connection` are hop-by-hop too, in every `Connection` line: a second
    line must not smuggle a field past the proxy."""
    getall = getattr(headers, "getall", None)
    values: list[str] = getall("Connection", []) if getall is not None else (
        [headers["Connection"]] if "Connection" in headers else []
    )
    return frozenset(
        t.strip().lower() for value in values for t in value.split(",") if t.strip()
    )
