"""Every metric family of `proxy.telemetry.metrics.Metrics`, declared once, grouped by the wing that
records into it: names, help texts, labels, buckets and how a gauge combines across workers.
The verbs that update them are in `proxy.telemetry.verbs`.

Names follow the OpenTelemetry GenAI semantic conventions in Prometheus form where one exists
(`gen_ai_server_*`); the rest live under `tokenmeter_`. Every label comes from a bounded set:
configured or upstream-listed model names (else the route pattern), configured users, upstream
names, operations, HTTP status codes and our own error classes.

Each gauge says how it combines across workers (`multiprocess_mode`, ignored by a single
process): `livesum` for a worker's own share of something (requests in flight, connections,
spool backlogs), `livemin` for "is it up" (0 as soon as one live worker lost the store or the
database), `livemax` for an age, `mostrecent` for a fact about shared state that any worker may
have read last (a budget's use in the shared store, the last reconcile) and `livemostrecent`
for configuration.
"""

from __future__ import annotations

import enum
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Gauge

from proxy.cost import NANOS_PER_USD
from proxy.telemetry.collectors import (
    BudgetPair,
    FastCounter,
    FastGauge,
    FastHistogram,
    GapHistogram,
    SharedGapHistogram,
)

# Upper bounds in seconds. Fine enough to tell 1 ms from 5 ms and 50 ms from 100 ms in TTFT.
TTFT_BUCKETS: tuple[float, ...] = (
    0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1,
    0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 20.0, 30.0, 60.0,
)
# Time per output token from 50 us (14,000 tok/s: 71 us) to 100 ms (10 tok/s) and beyond;
# 1.33 ms is 750 tok/s.
TPOT_BUCKETS: tuple[float, ...] = (
    0.00001, 0.000025, 0.00005, 0.000075, 0.0001, 0.00015, 0.0002, 0.0003, 0.0005, 0.00075,
    0.001, 0.00133, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1,
    0.25, 0.5, 1.0, 2.5,
)
DURATION_BUCKETS: tuple[float, ...] = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0,
    300.0, 600.0,
)
OVERHEAD_BUCKETS: tuple[float, ...] = (
    0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0,
)
TOKENS_PER_SECOND_BUCKETS: tuple[float, ...] = (
    5.0, 10.0, 25.0, 50.0, 75.0, 100.0, 150.0, 200.0, 300.0, 500.0, 750.0, 1000.0, 1500.0,
    2000.0, 3000.0, 5000.0, 7500.0, 10000.0, 14000.0, 20000.0, 50000.0,
)


class MeteringStage(enum.Enum):
    STREAM = "stream"  # reading a relayed stream on the side
    SETTLE = "settle"  # charging, recording and logging a finished request
    LEDGER = "ledger"  # making a finished request's ledger row


class LedgerStage(enum.Enum):
    SPOOL = "spool"  # appending a row to the local spool
    SHIP = "ship"  # writing a batch into the database
    CONNECT = "connect"  # opening the database (and migrating its schema)
    RETENTION = "retention"  # deleting rows past ledger.retention_days
    ROW = "row"  # the database refused one row (it is dropped; the others are stored)
    SHIPPER = "shipper"  # the shipper process died (it is started again) or could not start


class CaptureDrop(enum.Enum):
    QUEUE_FULL = "queue_full"  # capture.queue_max captures were already waiting
    STORE = "store"  # the capture store failed to take a batch (it is not retried)


class CaptureStage(enum.Enum):
    RECORD = "record"  # building a capture from a request's bytes
    STORE = "store"  # writing a batch into the capture store
    RETENTION = "retention"  # deleting captures past capture.retention_days


class ReconcileFailure(enum.Enum):
    """Why an in-process reconcile reading (proxy.reconcile.audit) was not made."""

    STORE = "store"  # the budget store could not be read
    LEDGER = "ledger"  # the ledger could not be opened or read (its reader is opened again)
    INTERNAL = "internal"  # a bug of ours (logged with its traceback)


class CacheStage(enum.Enum):
    """Where the response cache failed (the request was then a miss, or not stored)."""

    LOOKUP = "lookup"  # the store failed or took longer than cache.lookup_timeout_ms
    STORE = "store"  # the store failed to take an entry
    ENTRY = "entry"  # an entry could not be read back (another version, damaged)
    FILL = "fill"  # making an entry of a finished answer failed
    # An answer not kept for an entry: the fills in flight held cache.fills_mb already.
    BOUND = "bound"


class LatencyFamilies:
    """A request's latency histograms (streaming figures included)."""

    def __init__(self, r: CollectorRegistry) -> None:
        hist_labels = ("model", "upstream", "operation")
        self._ttft = FastHistogram(
            "gen_ai_server_time_to_first_token_seconds",
            "Request received to first content token forwarded to the client (streaming).",
            hist_labels, buckets=TTFT_BUCKETS, registry=r,
        )
        self._tpot = FastHistogram(
            "gen_ai_server_time_per_output_token_seconds",
            "Decode time per output token after the first one (streaming).",
            hist_labels, buckets=TPOT_BUCKETS, registry=r,
        )
        self._duration = FastHistogram(
            "gen_ai_server_request_duration_seconds",
            "End-to-end request duration as seen by the proxy.",
            hist_labels, buckets=DURATION_BUCKETS, registry=r,
        )
        self._upstream_ttft = FastHistogram(
            "tokenmeter_upstream_time_to_first_token_seconds",
            "Upstream call started to first content token received: the upstream's part of TTFT.",
            hist_labels, buckets=TTFT_BUCKETS, registry=r,
        )
        self._overhead = FastHistogram(
            "tokenmeter_proxy_overhead_seconds",
            "Proxy's own time from request received to upstream call started.",
            ("operation",), buckets=OVERHEAD_BUCKETS, registry=r,
        )
        self._tokens_per_second = FastHistogram(
            "tokenmeter_output_tokens_per_second",
            "Output tokens per second of one stream over its decode phase.",
            hist_labels, buckets=TOKENS_PER_SECOND_BUCKETS, registry=r,
        )


class RequestFamilies:
    """A request's tokens, result, cost and upstream calls; the streams' gaps."""

    def __init__(self, r: CollectorRegistry, shared: bool) -> None:
        gaps_doc = "Time between consecutive content chunks of a stream (inter-token latency)."
        self._gaps: GapHistogram | SharedGapHistogram
        if not shared:
            self._gaps = GapHistogram("tokenmeter_inter_chunk_latency_seconds", gaps_doc,
                                      TPOT_BUCKETS)
            r.register(self._gaps)
        else:
            self._gaps = SharedGapHistogram("tokenmeter_inter_chunk_latency_seconds", gaps_doc,
                                            TPOT_BUCKETS)
        self._tokens = FastCounter(
            "tokenmeter_tokens",
            "Tokens by type (input, output, cached_input, reasoning, cache_creation_input, "
            "cache_read_input) and source.",
            ("type", "model", "user", "source"), registry=r,
        )
        self._requests = FastCounter(
            "tokenmeter_requests",
            "Requests by HTTP status and error class.",
            ("model", "user", "status", "error_class"), registry=r,
        )
        self._active = FastGauge(
            "tokenmeter_active_requests", "Requests in flight.", ("upstream",), registry=r,
            multiprocess_mode="livesum",
        )
        self._retries = FastCounter(
            "tokenmeter_upstream_retries",
            "Upstream calls retried (before any byte reached the client), by the reason.",
            ("upstream", "reason"), registry=r,
        )
        self._fallbacks = FastCounter(
            "tokenmeter_fallbacks",
            "Requests handed from a route to its next fallback model, by the reason "
            "(an error class, or slow: recent TTFT p95 over the threshold).",
            ("route", "to_model", "reason"), registry=r,
        )
        self._auth_failures = FastCounter(
            "tokenmeter_auth_failures",
            "Requests refused for a missing or unknown API key (401). They have no ledger row "
            "and no access-log line each (a sampled line says how many).", registry=r,
        )
        self._metering_errors = FastCounter(
            "tokenmeter_metering_errors",
            "Failures while metering or settling a request (usage may be missing).",
            ("stage",), registry=r,
        )
        self._cost = FastCounter(
            "tokenmeter_cost_usd", "Estimated cost from the configured price table.",
            ("model", "user", "type"), registry=r,
        )


class TagFamilies:
    """What requests were for, by closed-list tag."""

    def __init__(self, r: CollectorRegistry) -> None:
        # Tags: only keys with a closed list of values are labels (bounded series); free ones
        # reach the books alone. A family of their own, so no other metric multiplies by them.
        self._tag_tokens = FastCounter(
            "tokenmeter_tag_tokens",
            "Tokens by tag (closed-list tag keys only) and type (input, output, cached_input, "
            "cache_creation_input).",
            ("tag", "value", "type"), registry=r,
        )
        self._tag_cost = FastCounter(
            "tokenmeter_tag_cost_usd",
            "Estimated cost by tag (closed-list tag keys only), from the price table.",
            ("tag", "value"), registry=r,
        )
        self._tags_dropped = FastCounter(
            "tokenmeter_tags_dropped", "Client tags dropped by the `tags:` rules, by reason.",
            ("reason",), registry=r,
        )


class BudgetFamilies:
    """Budgets: use and limits by window, reservations, refusals, top-ups."""

    def __init__(self, r: CollectorRegistry) -> None:
        budget = ("user", "window")
        self._budget_limit = FastGauge(
            "tokenmeter_budget_limit_tokens", "Configured limit of a budget window.", budget,
            registry=r, multiprocess_mode="mostrecent",
        )
        # The limit last set per (user, window), as the gauge holds it (`budget_state`).
        self._budget_limits: dict[tuple[str, str], int] = {}
        self._budget_used = FastGauge(
            "tokenmeter_budget_used_tokens",
            "Used (settled plus in-flight reservations) in the current window.", budget,
            registry=r, multiprocess_mode="mostrecent",
        )
        self._budget_remaining = FastGauge(
            "tokenmeter_budget_remaining_tokens", "Limit minus used in the current window.",
            budget, registry=r, multiprocess_mode="mostrecent",
        )
        # The users' cost windows, and the teams' windows (the counters a team's users share),
        # in their own families: tokens and USD are not summed in one family, and a team is not a
        # user. Limits of 0 or less are set too; the rules divide by `> 0` only.
        team = ("team", "window")
        self._budget_usd = BudgetPair(
            FastGauge("tokenmeter_budget_used_usd",
                   "Used (settled plus in-flight reservations) in the current cost window, USD.",
                   budget, registry=r, multiprocess_mode="mostrecent"),
            FastGauge("tokenmeter_budget_limit_usd", "Configured limit of a cost window, USD.",
                   budget, registry=r, multiprocess_mode="mostrecent"),
            NANOS_PER_USD)
        self._team_budget = BudgetPair(
            FastGauge("tokenmeter_team_budget_used_tokens",
                   "A team's use (settled plus in-flight reservations) in the current window.",
                   team, registry=r, multiprocess_mode="mostrecent"),
            FastGauge("tokenmeter_team_budget_limit_tokens",
                   "Configured limit of a team's budget window.", team, registry=r,
                   multiprocess_mode="mostrecent"))
        self._team_budget_usd = BudgetPair(
            FastGauge("tokenmeter_team_budget_used_usd",
                   "A team's use in the current cost window, USD.", team, registry=r,
                   multiprocess_mode="mostrecent"),
            FastGauge("tokenmeter_team_budget_limit_usd",
                   "Configured limit of a team's cost window, USD.", team, registry=r,
                   multiprocess_mode="mostrecent"),
            NANOS_PER_USD)
        self._budget_refusals = FastCounter(
            "tokenmeter_budget_refusals", "Requests refused by a budget limit.",
            ("user", "limit"), registry=r,
        )
        self._budget_reserved = FastCounter(
            "tokenmeter_budget_reserved_tokens",
            "Tokens reserved before requests went upstream (top-ups included), by admission "
            "policy.", ("user", "policy"), registry=r,
        )
        self._budget_overreserved = FastCounter(
            "tokenmeter_budget_overreserved_tokens",
            "Reserved minus actual tokens, released at settlement, by admission policy.",
            ("user", "policy"), registry=r,
        )
        self._budget_clamped = FastCounter(
            "tokenmeter_budget_clamped_requests",
            "Requests admitted with a lower output cap (admission: clamp), by the window that "
            "left the least room.", budget, registry=r,
        )
        self._budget_clamped_tokens = FastCounter(
            "tokenmeter_budget_clamped_tokens",
            "Output tokens cut from requests' caps by clamping (asked for minus granted).",
            budget, registry=r,
        )
        self._budget_topups = FastCounter(
            "tokenmeter_budget_topups",
            "Reservation top-ups of streams under admission: estimate, by outcome (granted, "
            "refused: no room left in a window, gone: the reservation had been reaped, "
            "unavailable: the store failed and the proxy fails closed).",
            ("user", "outcome"), registry=r,
        )
        self._budget_topup_tokens = FastCounter(
            "tokenmeter_budget_topup_tokens",
            "Output tokens added to streams' reservations by top-ups.", ("user",), registry=r,
        )
        self._budget_streams_ended = FastCounter(
            "tokenmeter_budget_streams_ended",
            "Streams ended mid-way because their quota could not be topped up, by window.",
            budget, registry=r,
        )
        self._threshold_crossings = FastCounter(
            "tokenmeter_budget_threshold_crossings",
            "Users crossing a notice threshold of their daily quota.", ("user", "threshold"),
            registry=r,
        )


class StoreFamilies:
    """The budget store's health and the settlements spooled while it is away."""

    def __init__(self, r: CollectorRegistry) -> None:
        self._store_errors = FastCounter(
            "tokenmeter_store_errors", "Budget store operations that failed.", ("op",),
            registry=r,
        )
        self._store_latency = FastHistogram(
            "tokenmeter_store_latency_seconds", "Budget store round trip.", ("op",),
            buckets=OVERHEAD_BUCKETS, registry=r,
        )
        self._store_up = FastGauge(
            "tokenmeter_store_up",
            "1 if the budget store answered its last operation or probe (probed every second).",
            registry=r, multiprocess_mode="livemin",
        )
        self._settle_backlog = FastGauge(
            "tokenmeter_settle_backlog",
            "Settlements in the local spool, waiting for the store to come back (each user's "
            "usage while the store was down counts as one).", registry=r,
            multiprocess_mode="livesum",
        )
        self._settle_backlog_tokens = FastGauge(
            "tokenmeter_settle_backlog_tokens",
            "Tokens in the local spool, owed to the store.", registry=r,
            multiprocess_mode="livesum",
        )
        self._settlements_spooled = FastCounter(
            "tokenmeter_settlements_spooled",
            "Settlements written to the local spool because the store could not take them.",
            registry=r,
        )
        self._settlements_lost = FastCounter(
            "tokenmeter_settlements_lost",
            "Settlements lost for good: the store did not take them and no spool holds them "
            "(none is open, or the process stopped while the spool could not be written).",
            registry=r,
        )
        self._settlement_tokens_lost = FastCounter(
            "tokenmeter_settlement_tokens_lost", "Tokens of the settlements lost.", registry=r,
        )
        self._settle_spool_bad_lines = FastCounter(
            "tokenmeter_settle_spool_bad_lines",
            "Lines of adopted settlement spool files that could not be read (skipped, logged "
            "with their file and line number; their usage is lost to the budgets).", registry=r,
        )


class LedgerFamilies:
    """The ledger's families (`proxy.telemetry.verbs.LedgerMetrics` says which process sets
    which, and how they combine across processes)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._ledger_rows = FastCounter(
            "tokenmeter_ledger_rows_written", "Ledger rows stored in the database.", ("sink",),
            registry=registry,
        )
        self._ledger_spool_rows = FastGauge(
            "tokenmeter_ledger_spool_rows", "Ledger rows in the local spool not yet stored.",
            registry=registry, multiprocess_mode="livesum",
        )
        self._ledger_spool_bytes = FastGauge(
            "tokenmeter_ledger_spool_bytes", "Disk taken by ledger rows not yet stored.",
            registry=registry, multiprocess_mode="livesum",
        )
        self._ledger_ship = FastHistogram(
            "tokenmeter_ledger_ship_seconds", "Time to store one batch of ledger rows.",
            buckets=DURATION_BUCKETS, registry=registry,
        )
        self._ledger_lag = FastGauge(
            "tokenmeter_ledger_lag_seconds",
            "Age of the oldest ledger row not yet stored (0: nothing waits).", registry=registry,
            multiprocess_mode="livemax",
        )
        self._ledger_errors = FastCounter(
            "tokenmeter_ledger_errors", "Ledger failures by stage.", ("stage",), registry=registry,
        )
        self._ledger_dropped = FastCounter(
            "tokenmeter_ledger_rows_dropped",
            "Ledger rows lost: the spool was full or could not be written.", registry=registry,
        )
        self._ledger_up = FastGauge(
            "tokenmeter_ledger_up", "1 when the last write to the ledger database succeeded.",
            registry=registry, multiprocess_mode="livemax",
        )


class CaptureFamilies:
    """Captures stored, dropped and failed."""

    def __init__(self, r: CollectorRegistry) -> None:
        self._captures = FastCounter(
            "tokenmeter_captures", "Requests captured whole (capture:), stored.", registry=r,
        )
        self._capture_bytes = FastCounter(
            "tokenmeter_capture_bytes", "Bytes of captures stored (compressed).", registry=r,
        )
        self._captures_dropped = FastCounter(
            "tokenmeter_captures_dropped",
            "Captures lost: the queue was full, or the capture store failed to take them.",
            ("reason",), registry=r,
        )
        self._capture_errors = FastCounter(
            "tokenmeter_capture_errors", "Capture failures by stage.", ("stage",), registry=r,
        )


class CacheFamilies:
    """The response cache: results, savings, a hit's latency, failures."""

    def __init__(self, r: CollectorRegistry) -> None:
        self._cache_errors = FastCounter(
            "tokenmeter_cache_errors",
            "Response cache failures by stage; each is a miss (or an answer not stored), "
            "never a failed request.", ("stage",), registry=r,
        )
        self._cache_requests = FastCounter(
            "tokenmeter_cache_requests",
            "Requests the response cache was consulted for, by result (hit: answered from an "
            "entry; miss: went upstream, the store's failures included; bypass: passed by, "
            "for the reason x-tokenmeter-cache-reason gives: sampled, the client's "
            "Cache-Control, an operation not cached).", ("model", "result"), registry=r,
        )
        self._cache_saved_tokens = FastCounter(
            "tokenmeter_cache_saved_tokens",
            "Tokens cache hits did not spend upstream: what the stored answers used, by type "
            "(as tokenmeter_tokens_total's).", ("type", "model", "user"), registry=r,
        )
        self._cache_saved_cost = FastCounter(
            "tokenmeter_cache_saved_cost_usd",
            "What cache hits would have cost: the stored answers' usage at the price of the "
            "day of the hit.", ("model", "user"), registry=r,
        )
        # A hit's latency is the proxy's alone: kept apart, so it does not flatter the
        # upstream's TTFT, duration and decode figures.
        self._cache_hit_ttft = FastHistogram(
            "tokenmeter_cache_hit_ttft_seconds",
            "Request received to first content token forwarded, for answers served from the "
            "response cache (streaming).", ("model", "operation"), buckets=TTFT_BUCKETS,
            registry=r,
        )
        self._cache_hit_duration = FastHistogram(
            "tokenmeter_cache_hit_duration_seconds",
            "End-to-end duration of requests answered from the response cache.",
            ("model", "operation"), buckets=TTFT_BUCKETS, registry=r,
        )


class ReconcileFamilies:
    """The in-process reconcile's readings."""

    def __init__(self, r: CollectorRegistry) -> None:
        self._reconcile_drift = FastGauge(
            "tokenmeter_reconcile_drift_tokens",
            "Ledger total minus the store's counter, beyond what requests in flight explain, "
            "at the last reconcile (by window).", ("window",), registry=r,
            multiprocess_mode="mostrecent",
        )
        self._reconcile_orphans = FastGauge(
            "tokenmeter_reconcile_orphans",
            "Reservations still held past their lease at the last reconcile.", registry=r,
            multiprocess_mode="mostrecent",
        )
        self._reconcile_failures = FastCounter(
            "tokenmeter_reconcile_failures",
            "In-process reconcile readings that could not be made, by reason: while they fail "
            "the drift gauge keeps its last value.", ("reason",), registry=r,
        )
        for failure in ReconcileFailure:  # every reason from 0, so an increase shows at once
            self._reconcile_failures.labels(failure.value)


class ProcessFamilies:
    """The serving process: client connections, configuration, users."""

    def __init__(self, r: CollectorRegistry, shared: bool) -> None:
        self._shared = shared
        # Gauges read from a callback at scrape time (a worker writes them every REFRESH_S).
        self._callbacks: list[tuple[Gauge, Callable[[], float]]] = []
        self._connections_closed = FastCounter(
            "tokenmeter_client_connections_closed",
            "Client connections the proxy refused (max_connections) or cut (header or body "
            "deadline).", ("reason",), registry=r,
        )
        self._connections_open = FastGauge(
            "tokenmeter_client_connections_open", "Client connections open now.", registry=r,
            multiprocess_mode="livesum",
        )
        self._config_reloads = FastCounter(
            "tokenmeter_config_reloads", "Configuration reloads by result.", ("result",),
            registry=r,
        )
        self._info = FastGauge(
            "tokenmeter_open_mode", "1 when no users are configured and every request is accepted.",
            registry=r, multiprocess_mode="livemostrecent",
        )
        # The request metrics carry `user` only (a team label would multiply every family by
        # it); a dashboard joins on this to filter them by team.
        self._user_info = FastGauge(
            "tokenmeter_user_info",
            'A configured user and their team (team="" for a user without one): 1 while the '
            "user is configured (0 for one a reload dropped, in a multi-worker process, which "
            "cannot remove a series).", ("user", "team"), registry=r,
            multiprocess_mode="livemostrecent",
        )
        self._user_teams: dict[str, str] = {}

    # Labels are passed in their declared order (prometheus_client sorts keyword labels on every
