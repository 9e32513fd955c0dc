"""The YAML configuration: pydantic models, `${ENV}` interpolation, errors with file and line."""

from __future__ import annotations

import contextlib
import difflib
import enum
import fnmatch
import gc
import os
import re
import threading
import types
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal, Union, get_args, get_origin
from urllib.parse import urlsplit

import yaml
from pydantic import (
    AliasChoices,
    BaseModel,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from proxy.config.cache import CacheConfig
from proxy.config.capture import CaptureConfig
from proxy.config.ledger import LedgerConfig
from proxy.config.policy import ConfigModel, Policy, unknown_teams
from proxy.config.tags import MAX_TAGS, TagRule, check_defaults, valid_key
from proxy.config.tracing import TracingConfig


class ConfigError(Exception):
    """A configuration file that cannot be used; the message names file, line and field."""


# Unknown fields refused, frozen, and no boolean where a number is expected.
_Model = ConfigModel


class RetryConfig(_Model):
    """Retries of one upstream call, only ever before the client has been sent a byte."""

    # Tries in all, the first included: 1 turns retries off.
    max_attempts: int = Field(default=3, ge=1, le=10)
    # Backoff before retry n (1-based) is initial * 2^(n-1), capped at max, times a random factor
    # in [0.5, 1) ("equal jitter": spread out, never zero).
    initial_backoff_ms: float = Field(default=200.0, ge=0)
    max_backoff_ms: float = Field(default=5000.0, ge=0)
    # No retry starts (nor a Retry-After is waited out) past this many seconds after the first
    # try began; the last answer then goes to the client, or to the next fallback.
    deadline_s: float = Field(default=30.0, gt=0)
    on_status: list[int] = Field(default_factory=lambda: [429, 500, 502, 503, 504])

    @field_validator("on_status")
    @classmethod
    def _statuses(cls, v: list[int]) -> list[int]:
        bad = [s for s in v if not (s in {408, 409, 429} or 500 <= s <= 599)]
        if bad:
            raise ValueError(f"only 408, 409, 429 and 5xx can be retried, not {bad}")
        return v


class UpstreamApi(enum.StrEnum):
    """The API an upstream speaks: which routes it serves and how it takes its key."""

    OPENAI = "openai"  # key as `Authorization: Bearer`
    ANTHROPIC = "anthropic"  # Messages API (/v1/messages); key as `x-api-key`


class UpstreamConfig(_Model):
    base_url: str
    # Usually "${OPENAI_API_KEY}"; None sends no Authorization (local vLLM / Ollama).
    api_key: str | None = None
    api: UpstreamApi = UpstreamApi.OPENAI
    connect_timeout_s: float = Field(default=10.0, gt=0)
    # Request sent -> response headers received (the upstream's queueing plus prefill).
    first_byte_timeout_s: float = Field(default=120.0, gt=0)
    # Longest silence between two reads of a response; a stalled stream ends here. Streams have
    # no total cap: a long healthy stream must never be cut.
    idle_timeout_s: float = Field(
        default=60.0, gt=0, validation_alias=AliasChoices("idle_timeout_s", "read_timeout_s")
    )
    # Whole non-streaming request, headers and body.
    total_timeout_s: float = Field(default=600.0, gt=0)
    retry: RetryConfig = Field(default_factory=RetryConfig)
    # Ask for `stream_options.include_usage` on streamed chat/completions (stripped again if the
    # client did not ask). Turn off for a server that rejects the field; streams are then
    # counted with tiktoken and marked estimated.
    stream_usage: bool = True
    # Which output-cap fields the proxy writes: `all` of the API shape's (max_tokens and
    # max_completion_tokens on chat), since servers differ in the one they honour; `preferred`:
    # clamp the ones the client sent, else set only max_completion_tokens (OpenAI honours both
    # but refuses the two together); `auto`: `preferred` for api.openai.com, else `all`.
    cap_fields: Literal["auto", "all", "preferred"] = "auto"

    @field_validator("base_url")
    @classmethod
    def _url(cls, v: str) -> str:
        if not re.match(r"^https?://[^/\s]+", v):
            raise ValueError("must be an http:// or https:// URL, e.g. https://api.openai.com/v1")
        # Credentials in the URL would fail every request (aiohttp will not send them beside
        # the upstream's own Authorization) and sit in the config and in error messages. The
        # message never repeats the URL: it holds the password.
        if "@" in urlsplit(v).netloc:
            raise ValueError("must not carry credentials (user:password@host): give the "
                             "upstream's key as `api_key` (or its `${ENV}`)")
        return v.rstrip("/")

    @field_validator("api_key")
    @classmethod
    def _empty_is_none(cls, v: str | None) -> str | None:
        return v or None


class LatencyFallback(_Model):
    """Send a model's requests to its fallbacks while its recent upstream TTFT p95 is too high."""

    ttft_p95_ms: float = Field(gt=0)
    window_s: float = Field(default=60.0, gt=0)  # samples older than this are forgotten
    min_samples: int = Field(default=20, ge=1)  # fewer samples: no verdict, the model is tried


class ModelRoute(_Model):
    match: str = Field(min_length=1)  # glob on the requested model name: "gpt-4o*", "*"
    upstream: str
    # Models (each routed by its own entry) tried in order when this one fails after its
    # retries: unreachable, timed out before any byte, 429 or 5xx.
    fallbacks: list[str] = Field(default_factory=list)
    latency_fallback: LatencyFallback | None = None
    # Whether these models can bill output tokens they do not stream (reasoning tokens):
    # such a stream cannot be topped up on what it streams, so under `admission: estimate`
    # it reserves its cap as under `clamp`. None: told by the model's name and the request
    # (proxy.budget.estimate.hides_output).
    hidden_output: bool | None = None


class ServerConfig(_Model):
    host: str = "127.0.0.1"
    port: int = Field(default=8080, ge=0, le=65535)
    max_body_mb: float = Field(default=32.0, gt=0)
    # On SIGTERM: stop accepting, let running streams finish for up to this long, settle them.
    drain_seconds: float = Field(default=30.0, ge=0)
    # A request's header block must arrive whole within this long: from the connection's start
    # for its first request, from the first byte of the next one on a kept-alive connection.
    # Late: 408 and closed, so slow-drip clients (slowloris) cannot pile up open sockets.
    header_timeout_s: float = Field(default=10.0, gt=0)
    # The whole body within this long of its headers (a total, so a drip cannot stretch it).
    body_timeout_s: float = Field(default=60.0, gt=0)
    # A kept-alive connection idle this long between requests is closed.
    keepalive_timeout_s: float = Field(default=75.0, gt=0)
    # Client connections open at once (API and metrics ports together); one more gets a 503
    # at once. Lowered at start to what the open-file limit carries (each may need an upstream
    # socket too).
    max_connections: int = Field(default=4096, ge=1)
    # Of those, at most this many from one client address: one more from it gets a 429 at once.
    # Behind a reverse proxy or NAT every client shares its address: raise this to
    # max_connections there and limit per client in the reverse proxy. None: no such limit.
    max_connections_per_source: int | None = Field(default=256, ge=1)
    # A stream whose client reads nothing for this long while the proxy has bytes for it is
    # ended (error class client_timeout), like nginx's send_timeout; the upstream's own silence
    # is idle_timeout_s, which a slow client does not trip. None: wait as long as it takes.
    client_write_timeout_s: float | None = Field(default=300.0, gt=0)
    # Processes serving the one port (`serve --workers` overrides it): "auto" is one per CPU
    # this process may run on. With more than one, a supervisor binds the port and restarts a
    # worker that dies; budgets then need a Redis store (proxy/server/workers.py). Read at start.
    workers: int | Literal["auto"] = 1

    @field_validator("workers")
    @classmethod
    def _workers(cls, v: int | str) -> int | str:
        if isinstance(v, int) and v < 1:
            raise ValueError("must be at least 1, or 'auto' (one per CPU)")
        return v


class MetricsConfig(_Model):
    # Extra model names allowed as the `model` label; names in `models[].match` without glob
    # characters and names the upstreams list at /v1/models are allowed anyway.
    model_labels: list[str] = Field(default_factory=list)
    discover_models: bool = True
    # Serve /metrics on its own port (then not on the API port), e.g. one the firewall keeps
    # private; and/or require `Authorization: Bearer <token>` to read it.
    port: int | None = Field(default=None, ge=0, le=65535)
    host: str | None = None  # default: server.host
    token: str | None = None

    @field_validator("token")
    @classmethod
    def _empty_token(cls, v: str | None) -> str | None:
        return v or None


class CostHeaders(_Model):
    """`cost_headers:`: what a request cost, told in its answer (README "Cost in the answer").
    `json_answers`: headers on a JSON answer (`x-tokenmeter-cost-usd` and the tokens charged);
    `streams`: an SSE comment line ending a stream, which SSE parsers skip (the openai and
    anthropic SDKs, Python and Node, are tested to read the stream unchanged with it)."""

    json_answers: bool = True
    streams: bool = True


class Config(Policy):
    server: ServerConfig = Field(default_factory=ServerConfig)
    upstreams: dict[str, UpstreamConfig] = Field(min_length=1)
    models: list[ModelRoute] = Field(default_factory=list)
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)
    ledger: LedgerConfig = Field(default_factory=LedgerConfig)
    capture: CaptureConfig = Field(default_factory=CaptureConfig)
    cache: CacheConfig = Field(default_factory=CacheConfig)
    # The tag keys requests may carry, each a closed list or free text (proxy.config.tags).
    tags: dict[str, TagRule] = Field(default_factory=dict)
    cost_headers: CostHeaders = Field(default_factory=CostHeaders)

    @model_validator(mode="after")
    def _tag_rules(self) -> Config:
        for key in self.tags:
            if not valid_key(key):
                raise ValueError(f"tags: key {key!r} must be a lower-case word "
                                 "([a-z][a-z0-9_]*, at most 32 characters)")
        for user, cfg in self.users.items():
            levels = [(f"users.{user}", cfg.tags)]
            levels += [(f"users.{user}.keys[{i}]", k.tags) for i, k in enumerate(cfg.keys)
                       if not isinstance(k, str) and k.tags]
            for where, tags in levels:
                if len(tags) > MAX_TAGS:
                    raise ValueError(f"{where}.tags: at most {MAX_TAGS} tags")
                check_defaults(self.tags, where, tags)
        return self
    tracing: TracingConfig = Field(default_factory=TracingConfig)

    @model_validator(mode="after")
    def _cache_keys(self) -> Config:
        """A bare key name in `cache.keys` (older configs) must name one key: a name two
        users give their keys would set the cache of both."""
        for name in self.cache.keys:
            if "/" in name:
                continue
            owners = sorted(user for user, cfg in self.users.items()
                            if any(not isinstance(k, str) and k.name == name for k in cfg.keys))
            if len(owners) > 1:
                raise ValueError(f"cache.keys.{name}: keys of that name belong to "
                                 f"{', '.join(owners)}: write `{owners[0]}/{name}`")
        return self

    @model_validator(mode="after")
    def _routes(self) -> Config:
        if not self.models:
            if len(self.upstreams) != 1:
                raise ValueError("with several upstreams, `models` must say which model goes where")
            only = next(iter(self.upstreams))
            object.__setattr__(self, "models", [ModelRoute(match="*", upstream=only)])
        for i, route in enumerate(self.models):
            if route.upstream not in self.upstreams:
                known = ", ".join(sorted(self.upstreams))
                raise ValueError(
                    f"models[{i}].upstream: unknown upstream {route.upstream!r} (known: {known})"
                )
        for i, route in enumerate(self.models):
            for name in route.fallbacks:
                if not any(fnmatch.fnmatchcase(name, r.match) for r in self.models):
                    raise ValueError(f"models[{i}].fallbacks: {name!r} matches no models[] entry")
            if route.latency_fallback is not None and not route.fallbacks:
                raise ValueError(f"models[{i}].latency_fallback needs fallbacks to switch to")
        return self


_ENV = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


Path_ = tuple[str | int, ...]


def _interpolate(value: Any, path: Path_, errors: list[tuple[Path_, str]]) -> Any:
    if isinstance(value, str):
        def sub(m: re.Match[str]) -> str:
            name, default = m.group(1), m.group(2)
            env = os.environ.get(name)
            if env is not None:
                return env
            if default is not None:
                return default
            errors.append((path, f"environment variable {name} is not set"))
            return ""

        return _ENV.sub(sub, value)
    if isinstance(value, dict):
        return {k: _interpolate(v, (*path, k), errors) for k, v in value.items()}
    if isinstance(value, list):
        return [_interpolate(v, (*path, i), errors) for i, v in enumerate(value)]
    return value


def _line_of(root: yaml.Node | None, path: tuple[str | int, ...]) -> int | None:
    """Best line (1-based) for a field path: the deepest node of the path that exists."""
    node = root
    line = node.start_mark.line + 1 if node is not None else None
    for part in path:
        if isinstance(node, yaml.MappingNode):
            for key, val in node.value:
                if key.value == str(part):
                    node, line = val, key.start_mark.line + 1
                    break
            else:
                return line
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int) and part < len(
            node.value
        ):
            node = node.value[part]
            line = node.start_mark.line + 1
        else:
            return line
    return line


def _format(source: str, root: yaml.Node | None, path: tuple[str | int, ...], msg: str) -> str:
    field = ".".join(str(p) for p in path) or "(top level)"
    line = _line_of(root, path)
    where = f"{source}:{line}" if line is not None else source
    return f"{where}: {field}: {msg}"


class _DuplicateKey(Exception):
    def __init__(self, mapping: yaml.MappingNode, key: object, again: yaml.Node,
                 first: yaml.Node) -> None:
        super().__init__(key)
        self.mapping, self.key, self.again, self.first = mapping, key, again, first


# libyaml's parser (bundled with PyYAML's wheels) where present: the pure-Python one took 16 s
# of a 20 s load of 10,000 users; the result and the marks (lines) are the same. The constructor
# (and so the duplicate-key check below) is the Python one either way.
if TYPE_CHECKING:
    _SafeLoader = yaml.SafeLoader
else:
    _SafeLoader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


class _Loader(_SafeLoader):
    """SafeLoader that refuses a key given twice in one mapping, at any depth: PyYAML would
    keep the last silently, and a user written twice would lose its first definition."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, yaml.Node] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # `<<: *base` then `key:` is the documented way to override
            key = self.construct_object(key_node, deep=True)
            try:
                first = seen.get(key)
            except TypeError:
                continue  # unhashable: the base class reports it
            if first is not None:
                raise _DuplicateKey(node, key, key_node, first)
            seen[key] = key_node
        return super().construct_mapping(node, deep=deep)


def _path_to(root: yaml.Node, target: yaml.Node) -> Path_:
    """The field path of a node in the document (aliases may share nodes: the first path)."""
    stack: list[tuple[yaml.Node, Path_]] = [(root, ())]
    visited: set[int] = set()
    while stack:
        node, path = stack.pop()
        if node is target:
            return path
        if id(node) in visited:
            continue
        visited.add(id(node))
        if isinstance(node, yaml.MappingNode):
            stack.extend((v, (*path, str(k.value))) for k, v in node.value)
        elif isinstance(node, yaml.SequenceNode):
            stack.extend((v, (*path, i)) for i, v in enumerate(node.value))
    return ()


def _load_yaml(text: str, source: str) -> tuple[yaml.Node | None, Any]:
    """The node tree (for line numbers) and the data, from one parse."""
    loader = _Loader(text)
    try:
        root = loader.get_single_node()
        try:
            data = loader.construct_document(root) if root is not None else None
        except _DuplicateKey as dup:
            assert root is not None
            field = ".".join(str(p) for p in (*_path_to(root, dup.mapping), dup.key))
            raise ConfigError(
                f"{source}:{dup.again.start_mark.line + 1}: {field}: duplicate key, also "
                f"given at line {dup.first.start_mark.line + 1} (YAML would keep only the last)"
            ) from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{source}: invalid YAML: {exc}") from None
    finally:
        loader.dispose()
    return root, data


def _data_loc(data: Any, loc: Path_) -> Path_:
    """A pydantic error location as a path in the YAML: without the labels of union members
    (e.g. `keys.0.mapping.name` is `keys.0.name`), which name no key of the file."""
    out: list[str | int] = []
    for i, part in enumerate(loc):
        found = (isinstance(data, dict) and part in data) or (
            isinstance(data, list) and isinstance(part, int) and 0 <= part < len(data)
        )
        if found:
            data = data[part]
        elif isinstance(data, dict) and i == len(loc) - 1:
            pass  # a field that is missing: still its name
        else:
            continue
        out.append(part)
    return tuple(out)


class _CollectorPause:
    """The cyclic garbage collector off while a configuration is parsed (and, on reload, built).

    A parse builds about a million objects for 10,000 users (nodes, data, models), none of them
    cyclic garbage; the collections they trigger walk every one of them again, each full one
    holding the GIL (so the event loop, when a reload parses in a thread) for 200 ms or more,
    and together doubled the parse's time. Process-wide and counted, so parses that overlap
    never leave it off; the loop's own garbage waits the few seconds of one parse."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._running = 0  # parses running now (a reload's thread, a start)
        self._was_enabled = False

    @contextlib.contextmanager
    def __call__(self) -> Iterator[None]:
        with self._lock:
            if self._running == 0:
                self._was_enabled = gc.isenabled()
                gc.disable()
            self._running += 1
        try:
            yield
        finally:
            with self._lock:
                self._running -= 1
                if self._running == 0 and self._was_enabled:
                    gc.enable()


collector_paused = _CollectorPause()


def _release(tree: Any) -> None:
    """Free a node tree or parsed data piece by piece.

    Dropped whole, the 230,000 nodes of 10,000 users are freed in one C cascade of 250 ms that
    holds the GIL, and so the event loop, when a reload parses in a thread. One at a time,
    the thread can be switched out between any two."""
    stack = [tree]
    while stack:
        item = stack.pop()
        if isinstance(item, yaml.MappingNode):
            stack.extend(part for pair in item.value for part in pair)
            item.value = []
        elif isinstance(item, yaml.SequenceNode):
            stack.extend(item.value)
            item.value = []
        elif isinstance(item, dict):
            stack.extend(item.values())
            item.clear()
        elif isinstance(item, list):
            stack.extend(item)
            item.clear()


def parse_config(text: str, source: str = "<config>") -> Config:
    with collector_paused():
        root, data = _load_yaml(text, source)
        try:
            return _validate(root, data, source)
        finally:
            # The tree and the data as read are this function's own (what is validated is
            # the copy `_interpolate` makes): nothing outlives it.
            _release(root)
            _release(data)


def _validate(root: yaml.Node | None, data: Any, source: str) -> Config:
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: the configuration must be a YAML mapping")
    errors: list[tuple[tuple[str | int, ...], str]] = []
    data = _interpolate(data, (), errors)
    if errors:
        raise ConfigError("\n".join(_format(source, root, p, m) for p, m in errors))
    try:
        config = Config.model_validate(data)
    except ValidationError as exc:
        lines = []
        for err in exc.errors():
            raw = tuple(p for p in err["loc"] if isinstance(p, str | int))
            loc = _data_loc(data, raw)
            msg = err["msg"].removeprefix("Value error, ")
            if err["type"] == "extra_forbidden" and (near := _nearest_field(raw)) is not None:
                msg = f"{msg} (did you mean `{near}`?)"
            lines.append(_format(source, root, loc, msg))
        raise ConfigError("\n".join(lines)) from None
    finally:
        # Validation builds containers of its own (no field is `Any`): this copy is garbage.
        _release(data)
    if problems := unknown_teams(config):
        raise ConfigError("\n".join(_format(source, root, p, m) for p, m in problems))
    return config


def _members(annotation: Any) -> list[Any]:
    """The types an annotation may hold: union members, without `Annotated` wrappers."""
    if get_origin(annotation) is Annotated:
        return _members(get_args(annotation)[0])
    if get_origin(annotation) in (Union, types.UnionType):
        return [m for arg in get_args(annotation) for m in _members(arg)]
    return [annotation]


def _step(annotation: Any, part: str | int) -> Any:
    """The annotation one step down a pydantic error location; None where it names no field
    (a union member's label, such as a key entry's `mapping`: the caller stays put)."""
    for member in _members(annotation):
        origin = get_origin(member)
        if isinstance(member, type) and issubclass(member, BaseModel) and isinstance(part, str):
            if part in member.model_fields:
                return member.model_fields[part].annotation
        elif origin is dict and isinstance(part, str):
            return get_args(member)[1]
        elif origin is list and isinstance(part, int):
            return get_args(member)[0]
    return None


def _nearest_field(loc: Path_) -> str | None:
    """For an unknown field at `loc`: the closest field name the section has, if any is close."""
    annotation: Any = Config
    for part in loc[:-1]:
        annotation = _step(annotation, part) or annotation
    names = [name for member in _members(annotation)
             if isinstance(member, type) and issubclass(member, BaseModel)
             for name in member.model_fields]
    close = difflib.get_close_matches(str(loc[-1]), names, n=1, cutoff=0.6) if loc else []
    return close[0] if close else None


def load_config(path: str | Path) -> Config:
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{p}: cannot read: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{p}: not UTF-8: {exc.reason}") from None
    return parse_config(text, str(p))


def single_upstream_config(base_url: str, api_key: str | None) -> Config:
    """`tokenmeter serve --upstream URL`: one upstream, every model routed to it."""
    try:
        return Config(upstreams={"default": UpstreamConfig(base_url=base_url, api_key=api_key)})
    except ValidationError as exc:
        raise ConfigError(f"--upstream: {exc.errors()[0]['msg']}") from None
