"""The verbs of `proxy.telemetry.metrics.Metrics`, one class per wing that records: each says what
happened in the domain's words and names its labels, so no caller depends on label order.
Labels are passed in their declared order (prometheus_client sorts keyword labels on every
call). The families they update are declared in `proxy.telemetry.families`."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from prometheus_client import CollectorRegistry

from proxy.config.policy import AdmissionPolicy
from proxy.config.tags import TagDrop
from proxy.cost import NANOS_PER_USD, CostLines
from proxy.record import CacheResult, RequestRecord
from proxy.telemetry.collectors import InFlight
from proxy.telemetry.families import (
    BudgetFamilies,
    CacheFamilies,
    CacheStage,
    CaptureDrop,
    CaptureFamilies,
    CaptureStage,
    LatencyFamilies,
    LedgerFamilies,
    LedgerStage,
    MeteringStage,
    ProcessFamilies,
    ReconcileFailure,
    ReconcileFamilies,
    RequestFamilies,
    StoreFamilies,
    TagFamilies,
)


class CacheVerbs(CacheFamilies):
    """What the response cache did for a request, and its failures."""

    def cache_failed(self, stage: CacheStage) -> None:
        self._cache_errors.labels(stage.value).inc()

    def _observe_cache(self, rec: RequestRecord) -> None:
        self._cache_requests.labels(rec.model_label, rec.cache.value).inc()
        u = rec.saved_usage
        for kind, value in (
            ("input", u.input_tokens),
            ("output", u.output_tokens),
            ("cached_input", u.cached_input_tokens),
            ("reasoning", u.reasoning_tokens),
            ("cache_creation_input", u.cache_creation_input_tokens),
        ):
            if value:
                self._cache_saved_tokens.labels(kind, rec.model_label, rec.user).inc(value)
        if rec.saved_cost is not None and rec.saved_cost.nanousd:
            self._cache_saved_cost.labels(rec.model_label, rec.user).inc(
                rec.saved_cost.nanousd / NANOS_PER_USD)

    def _observe_hit(self, rec: RequestRecord) -> None:
        labels = (rec.model_label, rec.operation)
        f = rec.figures
        self._cache_hit_duration.labels(*labels).observe(f.duration)
        if f.ttft is not None:
            self._cache_hit_ttft.labels(*labels).observe(f.ttft)


class TagVerbs(TagFamilies):
    """Tokens and cost by closed-list tag; tags the rules dropped."""

    def tags_dropped(self, reasons: Sequence[TagDrop]) -> None:
        for reason in reasons:
            self._tags_dropped.labels(reason.value).inc()

    def _observe_tags(self, rec: RequestRecord) -> None:
        u = rec.usage
        usd = None if rec.cost is None else rec.cost.nanousd / NANOS_PER_USD
        for tag in rec.tags.closed:
            for kind, value in (("input", u.input_tokens), ("output", u.output_tokens),
                                ("cached_input", u.cached_input_tokens),
                                ("cache_creation_input", u.cache_creation_input_tokens)):
                if value:
                    self._tag_tokens.labels(tag.key, tag.value, kind).inc(value)
            if usd:
                self._tag_cost.labels(tag.key, tag.value).inc(usd)


class RequestVerbs(LatencyFamilies, RequestFamilies, CacheVerbs, TagVerbs):
    """A finished request (its record), and what happened while it was relayed."""

    def record_request(self, rec: RequestRecord, gaps: list[int]) -> None:
        """One finished request: latency, tokens, the request itself, its cost, its gaps; what
        the response cache did for it. A hit's latency goes to the cache's own histograms."""
        if rec.cache is not CacheResult.NONE:
            self._observe_cache(rec)
        if rec.hit:
            self._observe_hit(rec)
        else:
            self._observe_latency(rec)
            self._observe_gaps(rec, gaps)
        self._observe(rec)
        if rec.cost is not None:
            self._observe_cost(rec, rec.cost)
        if rec.tags.items:
            self._observe_tags(rec)

    def relaying(self, upstream: str) -> InFlight:
        """A request in flight to `upstream` while its answer is relayed."""
        return InFlight(self._active.labels(upstream))

    def retried(self, upstream: str, reason: str) -> None:
        self._retries.labels(upstream, reason).inc()

    def fell_back(self, route: str, to_model: str, reason: str) -> None:
        self._fallbacks.labels(route, to_model, reason).inc()

    def auth_failed(self) -> None:
        self._auth_failures.inc()

    def metering_failed(self, stage: MeteringStage) -> None:
        self._metering_errors.labels(stage.value).inc()

    def metering_failure_counter(self, stage: MeteringStage) -> Callable[[], None]:
        """`metering_failed(stage)` bound once, for a stream's per-chunk path."""
        return self._metering_errors.labels(stage.value).inc

    def _observe_latency(self, rec: RequestRecord) -> None:
        hl = (rec.model_label, rec.upstream_label, rec.operation)
        f = rec.figures
        self._duration.labels(*hl).observe(f.duration)
        if f.ttft is not None:
            self._ttft.labels(*hl).observe(f.ttft)
        if f.upstream_ttft is not None:
            self._upstream_ttft.labels(*hl).observe(f.upstream_ttft)
        if f.time_per_output_token is not None:
            self._tpot.labels(*hl).observe(f.time_per_output_token)
        if f.output_tokens_per_second is not None:
            self._tokens_per_second.labels(*hl).observe(f.output_tokens_per_second)
        if f.overhead is not None:
            self._overhead.labels(rec.operation).observe(f.overhead)

    def _observe(self, rec: RequestRecord) -> None:
        u = rec.usage
        for kind, value in (
            ("input", u.input_tokens),
            ("output", u.output_tokens),
            ("cached_input", u.cached_input_tokens),
            ("reasoning", u.reasoning_tokens),
            ("cache_creation_input", u.cache_creation_input_tokens),
            ("cache_read_input", u.cache_read_input_tokens),
        ):
            if value:
                self._tokens.labels(kind, rec.model_label, rec.user, u.source).inc(value)
        self._requests.labels(rec.model_label, rec.user, str(rec.status), rec.error_class).inc()

    def _observe_cost(self, rec: RequestRecord, cost: CostLines) -> None:
        """By the price the tokens paid (`CostLines`: input, cached_input, cache_write_5m,
        cache_write_1h, output): the nano-dollars the ledger sums, in USD."""
        labels = (rec.model_label, rec.user)
        for kind, usd in cost.usd():
            self._cost.labels(*labels, kind).inc(usd)

    def _observe_gaps(self, rec: RequestRecord, counts: list[int]) -> None:
        f = rec.figures
        total = (f.mean_inter_chunk or 0.0) * max(f.content_chunks - 1, 0)
        self._gaps.merge((rec.model_label, rec.upstream_label, rec.operation), counts, total)


class BudgetVerbs(BudgetFamilies):
    """Budgets: reservations, refusals, clamps, top-ups, the windows' state."""

    def budget_reserved(self, user: str, policy: AdmissionPolicy, tokens: int) -> None:
        self._budget_reserved.labels(user, policy.value).inc(tokens)

    def budget_overreserved(self, user: str, policy: AdmissionPolicy, tokens: int) -> None:
        self._budget_overreserved.labels(user, policy.value).inc(tokens)

    def budget_clamped(self, user: str, window: str, tokens_cut: int) -> None:
        self._budget_clamped.labels(user, window).inc()
        self._budget_clamped_tokens.labels(user, window).inc(tokens_cut)

    def budget_topped_up(self, user: str, outcome: str, tokens: int) -> None:
        self._budget_topups.labels(user, outcome).inc()
        if tokens:
            self._budget_topup_tokens.labels(user).inc(tokens)

    def budget_stream_ended(self, user: str, window: str) -> None:
        self._budget_streams_ended.labels(user, window).inc()

    def budget_refused(self, user: str, limit: str) -> None:
        self._budget_refusals.labels(user, limit).inc()

    def budget_state(self, user: str, window: str, used: int, limit: int | None) -> None:
        self._budget_used.labels(user, window).set(used)
        if limit is not None:
            # A limit changes with the configuration only: set when it does, not twice a
            # request (every worker sets the new one at its next request: `mostrecent` keeps
            # the latest).
            if self._budget_limits.get((user, window)) != limit:
                self._budget_limits[(user, window)] = limit
                self._budget_limit.labels(user, window).set(limit)
            self._budget_remaining.labels(user, window).set(max(0, limit - used))

    def budget_cost_state(self, user: str, window: str, used_nanousd: int,
                          limit_nanousd: int | None) -> None:
        self._budget_usd.set(user, window, used_nanousd, limit_nanousd)

    def team_budget_state(self, team: str, window: str, used: int, limit: int | None) -> None:
        self._team_budget.set(team, window, used, limit)

    def team_budget_cost_state(self, team: str, window: str, used_nanousd: int,
                               limit_nanousd: int | None) -> None:
        self._team_budget_usd.set(team, window, used_nanousd, limit_nanousd)

    def threshold_crossed(self, user: str, threshold: float) -> None:
        self._threshold_crossings.labels(user, f"{threshold:g}").inc()


class StoreVerbs(StoreFamilies):
    """The budget store and the settlement spool."""

    def store_answered(self, op: str, seconds: float | None) -> None:
        if seconds is not None:
            self._store_latency.labels(op).observe(seconds)
        self._store_up.set(1)

    def store_failed(self, op: str) -> None:
        self._store_errors.labels(op).inc()
        self._store_up.set(0)

    def settlement_spooled(self) -> None:
        self._settlements_spooled.inc()

    def settlement_lost(self, tokens: int) -> None:
        self._settlements_lost.inc()
        self._settlement_tokens_lost.inc(tokens)

    def settle_spool_bad_lines(self, lines: int) -> None:
        self._settle_spool_bad_lines.inc(lines)

    def settle_backlog(self, settlements: int, tokens: int) -> None:
        self._settle_backlog.set(settlements)
        self._settle_backlog_tokens.set(tokens)


class LedgerMetrics(LedgerFamilies):
    """The ledger's collectors: the serving process counts rows it could not spool; the shipper
    process (proxy.ledger.shipper_process), which registers these alone, everything else. Its
    gauges are set by the shipper only, so across processes they combine as that one's value
    (`livesum`/`livemax` over the others' zeros; `up` is `livemax` for that reason)."""

    def ledger_stored(self, sink: str, rows: int, seconds: float) -> None:
        """A batch of `rows` reached the database (`sink`: sqlite or postgresql)."""
        self._ledger_rows.labels(sink).inc(rows)
        self._ledger_ship.observe(seconds)
        self._ledger_up.set(1)

    def ledger_pending(self, rows: int, spool_bytes: int, oldest_age_s: float) -> None:
        self._ledger_spool_rows.set(rows)
        self._ledger_spool_bytes.set(spool_bytes)
        self._ledger_lag.set(oldest_age_s)

    def ledger_connected(self) -> None:
        """The database answered (a connect or an idle ping): up before any batch is stored."""
        self._ledger_up.set(1)

    def ledger_failed(self, stage: LedgerStage) -> None:
        self._ledger_errors.labels(stage.value).inc()
        if stage in (LedgerStage.CONNECT, LedgerStage.SHIP):
            self._ledger_up.set(0)

    def ledger_dropped(self, rows: int) -> None:
        self._ledger_dropped.inc(rows)


def process_ledger_metrics() -> LedgerMetrics:
    """The ledger's collectors alone, for the shipper process, in the multiprocess directory
    its parent gave it. Written through (prometheus_client's own multiprocess value, not a
    worker's buffered one): a few updates per batch, and a scrape right after a batch sees it."""
    return LedgerMetrics(CollectorRegistry(auto_describe=True))


class BooksVerbs:
    """The serving process's part of the ledger's figures (the shipper process counts the rest)."""

    ledger: LedgerMetrics

    def ledger_failed(self, stage: LedgerStage) -> None:
        self.ledger.ledger_failed(stage)

    def ledger_dropped(self, rows: int) -> None:
        self.ledger.ledger_dropped(rows)


class CaptureVerbs(CaptureFamilies):
    """Captures stored, dropped and failed."""

    def captured(self, count: int, stored_bytes: int) -> None:
        self._captures.inc(count)
        self._capture_bytes.inc(stored_bytes)

    def capture_dropped(self, reason: CaptureDrop, count: int = 1) -> None:
        self._captures_dropped.labels(reason.value).inc(count)

    def capture_failed(self, stage: CaptureStage) -> None:
        self._capture_errors.labels(stage.value).inc()


class ReconcileVerbs(ReconcileFamilies):
    """The in-process reconcile's readings and failures."""

    def reconciled(self, drift_by_window: dict[str, int], orphans: int) -> None:
        for window, drift in drift_by_window.items():
            self._reconcile_drift.labels(window).set(drift)
        self._reconcile_orphans.set(orphans)

    def reconcile_failed(self, reason: ReconcileFailure) -> None:
        self._reconcile_failures.labels(reason.value).inc()


class ProcessVerbs(ProcessFamilies):
    """Client connections, configuration reloads, the configured users."""

    def connection_closed(self, reason: str) -> None:
        self._connections_closed.labels(reason).inc()

    def connections_open(self, count: Callable[[], float]) -> None:
        if not self._shared:
            self._connections_open.set_function(count)
        else:  # a callback is not shared between processes: its value is written (refresh)
            self._callbacks.append((self._connections_open, count))
            self._connections_open.set(count())

    def config_reloaded(self, ok: bool) -> None:
        self._config_reloads.labels("ok" if ok else "error").inc()

    def open_mode(self, is_open: bool) -> None:
        self._info.set(1 if is_open else 0)

    def user_teams(self, teams: Mapping[str, str | None]) -> None:
        """The configured users, each with their team (None: none), as tokenmeter_user_info;
        called at start and on every reload. A user the new version drops, or whose team
        changed, loses the old series: removed, or set to 0 where the multiprocess files
        cannot forget it (every worker sets its own at its own reload)."""
        wanted = {user: team or "" for user, team in teams.items()}
        for user, team in self._user_teams.items():
            if wanted.get(user) != team:
                if not self._shared:
                    self._user_info.remove(user, team)
                else:
                    self._user_info.labels(user=user, team=team).set(0)
        for user, team in wanted.items():
            if self._user_teams.get(user) != team:
                # By name, not through the memo: a removed child must not come back from it.
                self._user_info.labels(user=user, team=team).set(1)
        self._user_teams = wanted
