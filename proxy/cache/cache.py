"""The response cache of one process: what a request's lookup decides (`consult`: a hit, a
miss that fills an entry, a bypass, or not consulted), and the filling of an entry from a
finished answer (`complete`). A store that fails or is slow is a miss, counted; a fill that
fails is an answer not stored, counted; neither ever fails a request."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import math
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from proxy.budget.principal import Principal
from proxy.cache.entry import OPERATIONS, Entry, EntryUnreadable, Form
from proxy.cache.flight import Flights
from proxy.cache.key import cache_key
from proxy.cache.policy import CacheRule, rule_for, samples, scope_id
from proxy.cache.replays import Hot, ReplayForm, Replays
from proxy.cache.store import CacheStore
from proxy.config.cache import CacheConfig
from proxy.protocol.codecs import codec_for
from proxy.protocol.usage import Usage
from proxy.record import NOT_CONSULTED as OUTCOME_NOT_CONSULTED
from proxy.record import BypassReason, CacheOutcome, CacheResult
from proxy.telemetry.families import CacheStage

log = logging.getLogger("tokenmeter.cache")

# A stream's bytes are kept for its entry up to this many times the entry's cap: a stream's
# events carry some 10-40 times the bytes of the text they deliver.
STREAM_FACTOR = 16
# A request body (or a stored entry) larger than this is hashed (decoded) in a thread: a
# canonical JSON of a 32 MB body is some 100 ms of CPU the loop must not spend.
ON_LOOP_BYTES = 256 * 1024
HIT_HEADER = "x-tokenmeter-cache"
REASON_HEADER = "x-tokenmeter-cache-reason"  # beside a bypass: its `BypassReason`


@dataclass(frozen=True, slots=True)
class CacheQuery:
    """What the cache reads of a request."""

    operation: str
    model: str  # the model sent upstream (the one asked for: a fallback's answer is not stored)
    upstream: str  # the upstream it is routed to: its name and URL
    body: dict[str, Any]
    principal: Principal
    cache_control: str  # the request's Cache-Control header ("" without one)
    body_bytes: int  # the body's size as sent
    # The most output tokens the request itself may be answered with, all choices together
    # (its body's cap under its key's, user's and team's; 0: unbounded): asked only when an
    # entry is found, since working it out needs the budget's plan.
    output_cap: Callable[[], int] = lambda: 0
    # The longest it waits for an identical request's answer on its way (its upstream's
    # first-byte timeout): at most `lock_timeout_s`.
    wait_s: float = math.inf


class FillBytes:
    """The bytes every fill in flight holds, together, bounded (`cache.fills_mb`, read at each
    claim: a reload may change it): a fill that would pass the bound keeps nothing more, and
    its answer is not stored (counted, `stage="bound"`)."""

    __slots__ = ("_bound", "_skipped", "held")

    def __init__(self, bound: Callable[[], int], skipped: Callable[[], None]) -> None:
        self._bound, self._skipped = bound, skipped
        self.held = 0

    def claim(self, size: int) -> bool:
        if self.held + size > self._bound():
            self._skipped()
            return False
        self.held += size
        return True

    def release(self, size: int) -> None:
        self.held -= size


class Fill:
    """The bytes of a miss's answer, kept for its entry: the JSON body, or the upstream's
    stream as it came (its usage chunk included). Past its bound, or the process's
    (`FillBytes`), it keeps nothing more and the answer is not stored. A leader's fill also
    tells its flight's waiters whether its client keeps up (`stalled`)."""

    __slots__ = ("_bytes", "_handed", "_held", "_parts", "_size", "bound", "key", "leader",
                 "operation", "over", "rule", "stream")

    def __init__(self, key: str, operation: str, rule: CacheRule, held: FillBytes, *,
                 stream: bool) -> None:
        self.key, self.operation, self.rule = key, operation, rule
        self.stream = stream
        self.leader = False  # it leads its key's flight (and lands it)
        self.bound = rule.max_entry_bytes * (STREAM_FACTOR if stream else 1)
        self._bytes = held
        self._parts: list[bytes] = []
        self._size = 0
        self._held = 0  # claimed of `_bytes`
        # When the relay was handed the last chunk it has not come back from (monotonic
        # seconds; None: it is reading the upstream): a client that does not read holds it.
        self._handed: float | None = None
        self.over = False

    def take(self, data: bytes) -> None:
        self._handed = time.monotonic()
        if self.over:
            return
        self._size += len(data)
        if self._size > self.bound or not self._bytes.claim(len(data)):
            self.over = True
            self._parts.clear()
            self.release()
            return
        self._held += len(data)
        self._parts.append(data)

    def relayed(self) -> None:
        """The chunk last taken is relayed: the relay reads the upstream again."""
        self._handed = None

    def stalled(self, now: float, stall_s: float) -> bool:
        """Whether waiting for this answer is pointless: it will not be stored, or its relay
        has held a chunk (a JSON answer: its whole body) `stall_s` without coming back."""
        handed = self._handed
        return self.over or (handed is not None and now - handed > stall_s)

    def release(self) -> None:
        """Gives back what it holds of the process's bound (its bytes stay readable)."""
        self._bytes.release(self._held)
        self._held = 0

    def data(self) -> bytes:
        return b"".join(self._parts)

    @property
    def size(self) -> int:
        return self._size

    @property
    def too_large(self) -> bool:
        """Its answer passed the entry's bound (not the process's: that one is a full cache's
        memory, counted by its own error stage)."""
        return self._size > self.bound


@dataclass(frozen=True, slots=True)
class Decision:
    result: CacheResult
    entry: Entry | None = None  # a hit's
    key: str = ""  # a hit's: where its entry is, the key of its replays
    age_s: float | None = None
    # A miss's (or a no-cache bypass's): the answer to store. A hit's, should its entry turn
    # out to hold no answer (`missed`); `served` drops it.
    fill: Fill | None = None
    reason: BypassReason | None = None  # a bypass's

    def served(self) -> Decision:
        return dataclasses.replace(self, fill=None)

    def missed(self) -> Decision:
        return Decision(CacheResult.MISS, fill=self.fill)

    @property
    def header(self) -> str | None:
        return None if self.result is CacheResult.NONE else self.result.value

    def headers(self) -> dict[str, str]:
        """What the answer says of the cache: the result and, beside a bypass, why."""
        value = self.header
        if value is None:
            return {}
        if self.reason is None:
            return {HIT_HEADER: value}
        return {HIT_HEADER: value, REASON_HEADER: self.reason.value}

    def outcome(self) -> CacheOutcome:
        """What settle is handed: on a hit, the stored answer's usage (what it saved)."""
        if self.result is CacheResult.NONE:
            return OUTCOME_NOT_CONSULTED
        if self.entry is None:
            reason = self.reason
            if reason is None and self.fill is not None and self.fill.too_large:
                reason = BypassReason.TOO_LARGE
            return CacheOutcome(self.result, reason=reason)
        return CacheOutcome(self.result, saved=self.entry.usage, age_s=self.age_s)


NOT_CONSULTED = Decision(CacheResult.NONE)


@dataclass(frozen=True, slots=True)
class Finished:
    """A miss's answer, as the handler saw it end: whole and successful or not."""

    usage: Usage  # reported by the upstream
    capped_ok: bool  # an end at the output cap is the client's own cap, not the proxy's


def _rule(config: CacheConfig, ask: CacheQuery) -> CacheRule | Decision:
    """The cache's rule for the request, or the decision that it is not looked up: not
    consulted (the cache does not apply to it), or passed by with the reason."""
    if not config.maybe_enabled:
        return NOT_CONSULTED
    rule = rule_for(config, ask.principal, ask.model)
    if not rule.enabled:
        return NOT_CONSULTED
    # The cache applies to this user and model: a request it passes by says why.
    if ask.principal.forward_client_key:
        # Pass-through: the proxy cannot tell a valid upstream key from another, and a hit
        # must need one.
        return Decision(CacheResult.BYPASS, reason=BypassReason.PASSTHROUGH)
    if ask.operation not in OPERATIONS:
        return Decision(CacheResult.BYPASS, reason=BypassReason.NOT_CACHEABLE)
    if not rule.cache_sampled and samples(ask.body):
        return Decision(CacheResult.BYPASS, reason=BypassReason.SAMPLED)
    return rule


def directives(cache_control: str) -> frozenset[str]:
    return frozenset(part.strip().lower().split("=", 1)[0]
                     for part in cache_control.split(",") if part.strip())


class ResponseCache:
    def __init__(self, store: CacheStore, on_error: Callable[[CacheStage], None],
                 clock: Callable[[], float], settings: Callable[[], CacheConfig]) -> None:
        """`settings`: the cache section in force (a reload may change its bounds)."""
        self.store = store
        self.flights = Flights()
        self.replays = Replays(lambda: int(settings().memory_mb * 1024 * 1024))
        self.hot = Hot(lambda: int(settings().memory_mb * 1024 * 1024))
        self.fill_bytes = FillBytes(lambda: int(settings().fills_mb * 1024 * 1024),
                                    lambda: on_error(CacheStage.BOUND))
        self._on_error = on_error
        self._clock = clock

    async def consult(self, config: CacheConfig, ask: CacheQuery) -> Decision:
        rule = _rule(config, ask)
        if isinstance(rule, Decision):
            return rule
        parts = (ask.operation, ask.model, ask.upstream, ask.body,
                 scope_id(rule.scope, ask.principal))
        key = (cache_key(*parts) if ask.body_bytes <= ON_LOOP_BYTES
               else await asyncio.to_thread(cache_key, *parts))
        stream = ask.body.get("stream") is True
        said = directives(ask.cache_control) if ask.cache_control else frozenset()
        if "no-store" in said:
            return Decision(CacheResult.BYPASS, reason=BypassReason.NO_STORE)
        fill = Fill(key, ask.operation, rule, self.fill_bytes, stream=stream)
        if "no-cache" in said:  # a fresh answer, stored; those asking meanwhile wait for it
            fill.leader = self.flights.lead(key, fill) is None
            return Decision(CacheResult.BYPASS, fill=fill, reason=BypassReason.NO_CACHE)
        # An answer on its way is waited for before the store is asked: it is the freshest.
        flight = self.flights.open(key)
        entry = None
        if flight is None:
            entry = self.hot.get(key)
            if entry is None or self._clock() - entry.created_at >= rule.ttl_s:
                entry = await self._lookup(key, config.lookup_timeout_ms / 1000)
                if entry is not None:
                    self.hot.put(key, entry)
            if entry is None:
                flight = self.flights.lead(key, fill)
                if flight is None:
                    fill.leader = True
                    return Decision(CacheResult.MISS, fill=fill)
        if flight is not None:
            entry = await self.flights.wait(flight, min(config.lock_timeout_s, ask.wait_s))
        age = None if entry is None else max(0.0, self._clock() - entry.created_at)
        # Not a hit: another API's entry; one older than the TTL (a reload shortened it, or
        # the store kept it longer); or an answer longer than this request may be answered
        # with (its key's output cap is lower than the one whose answer was stored).
        if (entry is None or age is None or entry.operation != ask.operation
                or age >= rule.ttl_s or 0 < ask.output_cap() < entry.usage.output_tokens):
            return Decision(CacheResult.MISS, fill=fill)
        return Decision(CacheResult.HIT, entry=entry, key=key, age_s=age, fill=fill)

    async def replay(self, hit: Decision, asked: dict[str, Any], *, stream: bool) -> bytes | None:
        """A hit's answer in the form asked for, or None if its entry is not an answer
        (counted; the request is then a miss). Each form of an entry is made once and kept
        (`Replays`): a stream entry is reassembled once, whatever its size and its hits."""
        entry = hit.entry
        assert entry is not None
        options = asked.get("stream_options")
        include_usage = isinstance(options, dict) and options.get("include_usage") is True
        if not stream and entry.form is Form.JSON:
            return entry.payload  # as stored: nothing to make
        form = ((ReplayForm.STREAM_USAGE if include_usage else ReplayForm.STREAM) if stream
                else ReplayForm.JSON)
        made = self.replays.get(hit.key, entry.created_at, form)
        if made is not None:
            return made
        base = entry
        if entry.form is Form.STREAM:  # the reassembled answer, if a hit has made it
            answer = self.replays.get(hit.key, entry.created_at, ReplayForm.JSON)
            if answer is not None:
                base = dataclasses.replace(entry, form=Form.JSON, payload=answer)
        make = functools.partial(render, base, stream=stream, include_usage=include_usage)
        # A stream entry is reassembled: some 4 times the work per byte of a JSON one's render.
        work = base.size * (4 if base.form is Form.STREAM else 1)
        forms = make() if work <= ON_LOOP_BYTES else await asyncio.to_thread(make)
        if forms is None:
            self._on_error(CacheStage.ENTRY)
            return None
        body, as_json = forms
        if as_json is not None:
            self.replays.put(hit.key, entry.created_at, ReplayForm.JSON, as_json)
        self.replays.put(hit.key, entry.created_at, form, body)
        return body

    async def _lookup(self, key: str, timeout_s: float) -> Entry | None:
        try:
            if self.store.in_process:  # a dict look-up: nothing to bound
                raw = await self.store.get(key)
            else:
                async with asyncio.timeout(timeout_s):
                    raw = await self.store.get(key)
        except Exception as exc:
            log.warning("cache lookup failed (a miss): %s", type(exc).__name__)
            self._on_error(CacheStage.LOOKUP)
            return None
        if raw is None:
            return None
        try:
            if len(raw) <= ON_LOOP_BYTES:
                return Entry.decode(raw)
            return await asyncio.to_thread(Entry.decode, raw)
        except EntryUnreadable:
            self._on_error(CacheStage.ENTRY)
            return None

    async def complete(self, fill: Fill, config: CacheConfig,
                       finished: Finished | None) -> None:
        """Store the miss's answer if it is whole and successful (`finished`), then end its
        flight: the waiters get the entry, or None and go upstream themselves."""
        entry = None
        try:
            made = None
            if finished is not None and not fill.over:
                make = functools.partial(_make_entry, fill, finished, tuple(config.redact),
                                         self._clock())
                # A small answer is made on the loop: a thread's hop would cost more.
                made = make() if fill.size <= ON_LOOP_BYTES else await asyncio.to_thread(make)
            # A stream's entry is its events: its bound is the fill's (the cap times
            # STREAM_FACTOR, as for the answer it carries), its head of some 200 bytes aside.
            # A redacted answer may have grown: else too large to keep.
            if made is not None and len(made[0].payload) <= fill.bound:
                entry = made[0]
                self.hot.put(fill.key, entry)  # the freshest answer: hits here read it
                await self._put(fill, made[1], config.lookup_timeout_ms / 1000)
        except Exception:
            log.exception("making a cache entry failed; the answer is not stored")
            self._on_error(CacheStage.FILL)
            entry = None
        finally:
            fill.release()
            if fill.leader:
                self.flights.land(fill.key, entry)

    async def _put(self, fill: Fill, raw: bytes, timeout_s: float) -> None:
        try:
            # A write waits a little longer than a lookup (its entry may be large), and is
            # never on a client's path.
            if self.store.in_process:
                await self.store.put(fill.key, raw, fill.rule.ttl_s)
            else:
                async with asyncio.timeout(max(timeout_s * 10, 0.5)):
                    await self.store.put(fill.key, raw, fill.rule.ttl_s)
        except Exception as exc:
            log.warning("cache store failed (the answer is not stored): %s", type(exc).__name__)
            self._on_error(CacheStage.STORE)

    async def close(self) -> None:
        await self.store.close()


def render(entry: Entry, *, stream: bool,
           include_usage: bool) -> tuple[bytes, bytes | None] | None:
    """A hit's answer as the client asked for it, and, when `entry` is a stream (reassembled
    here, on the first hit of a form rather than on every miss's path), the answer's JSON,
    which the entry's other forms are made from. None: the entry holds no answer."""
    if not stream and entry.form is Form.JSON:
        return entry.payload, None
    answer = entry.answer()
    if answer is None:
        return None
    codec = codec_for(entry.operation)
    as_json = codec.body(answer)
    if stream:
        body = codec.replay(answer, include_usage=include_usage)
        return body, as_json if entry.form is Form.STREAM else None
    return as_json, as_json


def _make_entry(fill: Fill, finished: Finished, redact: tuple[str, ...],
                now: float) -> tuple[Entry, bytes] | None:
    """The entry and its bytes as stored, or None when the answer is not to be stored. The
    answer is stored as it came, unparsed (a miss's path pays a scan for its finish reasons
    and the entry's head); redaction needs it parsed and stores its JSON."""
    raw, form = fill.data(), Form.STREAM if fill.stream else Form.JSON
    codec = codec_for(fill.operation)
    if redact:
        answer = codec.assemble_stream(raw) if fill.stream else codec.answer_of(raw)
        if answer is None or not codec.finished(answer, finished.capped_ok):
            return None
        raw, form = codec.body(codec.redacted(answer, redaction(redact))), Form.JSON
    elif not codec.ended(raw, finished.capped_ok):
        return None
    entry = Entry(fill.operation, form, raw, finished.usage, now)
    data = entry.encode()
    return dataclasses.replace(entry, size=len(data)), data


@functools.lru_cache(maxsize=8)
def redaction(redact: tuple[str, ...]) -> Callable[[str], str]:
    """The cache's `redact` patterns as one substitution, applied to every text of an answer
    its codec's walker finds (what the model wrote; ids, roles, finish reasons and usage are
    left as they are)."""
    pattern = re.compile("|".join(f"(?:{p})" for p in redact))
    return functools.partial(pattern.sub, "[REDACTED]")
