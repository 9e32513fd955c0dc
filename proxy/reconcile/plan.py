"""`tokenmeter reconcile`'s reading: do the books and the budget store tell the same story?
The SQL and the store reads, and the verdicts; what it prints is `render`'s.

For one day (default today, in the configured time zone), every calendar budget window that day
is in (its day, week and month; tokens, input, output and cost), per user, key and model group
with a window of their own, and per team: the ledger's total for the window against the store's
counter, and the reservations the store holds past their lease (orphans).

Which rows count towards a window: those whose `windows` column names it. Settle records there
the labels (`u:daily_tokens:20261203`, `t.platform:monthly_usd:M202612`) of the very counters it
charged, so a row is attributed exactly where the store counted it; no clock or time-zone
arithmetic can put a request on the other side of midnight. A user's window takes the user's
rows (the row's team says which slot its counters were in, so a user who changed teams is still
attributed right); a team's window takes every row naming it. Per-minute windows are not
compared (their counters live two minutes). A response-cache hit charged nothing (the default,
`cache.charge_hits: none`) names no window and is not counted; one charged in full names the
windows it was charged in, and counts what it saved (its `saved_*` columns; its own are 0).

What may legitimately differ, and how it is treated. A reading reads the ledger first, then
the store's counters and reservation records in one atomic snapshot per slot (one read-only
script). The counter less what the reservations in it hold is what the store settled.
- Books above what the store settled: never right. A row reaches the ledger after its settle
  (the shipper writes it a quarter second or more after it is spooled), so before the store was
  read: the budgets under-count. Drift, however much reservations hold (the tolerance is
  one-sided: in-flight requests explain a counter above the books by what they hold, never
  books above the counter); confirmed by two readings, so a row shipped while its settle still
  waits on a slow store is `pending` for one reading only.
- Requests in flight: their reservation (their worst case) is in the counter, their row is not
  in the ledger yet; subtracted exactly. Reservations past their lease (their proxy died) are
  listed as orphans; what they hold is subtracted too, since the next reservation in their slot
  gives it back. Orphans alone do not fail the run: they heal by themselves, and the metric and
  alert report them.
- Rows on their way: a settled request's row waits in its replica's ledger spool until the
  shipper writes it (a quarter of a second under load; longer while the database is down), so
  under traffic the store leads the books at every reading (`BEHIND`, "on its way"). Reconcile
  reaches no replica's spool; the next reading judges it instead: every row the store had
  settled at the earlier snapshot ended before it, so the rows that ended by then (plus
  `CUT_MARGIN_S` for clocks) must by now reach what the store had settled; short of it is drift
  (rows lost, or not shipped in all that time). Rows that ended later are not counted, so new
  traffic cannot hide a loss, and steady traffic is not drift. The command reads twice,
  `--recheck` seconds apart; the in-process `Auditor` judges each reading against the one
  before and feeds `tokenmeter_reconcile_drift_tokens`, whose alert waits 15 minutes before it
  fires. Books above the store in one reading only are `pending` (a row shipped before its
  settle finished, say), drift when both readings show it. Usage settled while the store was
  down waits in the budget spool: until it is replayed the books lead the store, which is
  drift, truthfully (the budgets under-count until then). The current day is judged like any
  other. `ledger_newest` (the newest row's end) shows how far the ledger is behind.
- The ledger's side is read from its windows rollup (`proxy.ledger.rollup.WINDOWS`) when the
  day's span is whole UTC hours (every zone but the few whose offset is not): exact, and a
  few thousand rollup rows instead of a month's rows. The rollup is kept by the sinks' own
  statements: a row deleted or changed by hand leaves it as it was, so only `--deep` (a
  reader opened without the rollups), which sums the rows themselves, sees that. The
  in-process `Auditor` reads the rollup.
- Windows the store no longer holds (past their retention: a day's counters for eight days
  after it, a week's fifteen, a month's forty) are listed as `expired` and not judged.
"""

from __future__ import annotations

import asyncio
import enum
import time
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import date, datetime, timedelta
from typing import Protocol
from zoneinfo import ZoneInfo

from proxy.budget import limits as lim
from proxy.budget.store import ScopeKind, Snapshot
from proxy.config.load import Config
from proxy.config.policy import Limits
from proxy.ledger.query import LedgerReader, as_int, rollups_ready
from proxy.ledger.rollup import HOUR_S, WINDOWS
from proxy.ledger.schema import TABLE
from proxy.storage.sql import Sql

DEFAULT_USER = "default"  # open mode's one user (proxy.auth.DEFAULT_USER)
_EXPIRY_MARGIN_S = 60  # a counter this close to its expiry may be gone by the time it is read
# A row's end is stamped by its proxy's clock just after the store settled it, the snapshot by
# the store's: rows ending this long after a snapshot still count as settled before it (clocks
# kept by NTP are well within it). A loss smaller than what one window's rows bring in this
# long can hide behind them in one pair of readings, not in the next quiet one.
CUT_MARGIN_S = 1.0


# --- the store's side: counters and reservations, one atomic snapshot per slot -------------------

class StoreView(Protocol):
    """What reconcile reads of a store (every `Store` is one)."""

    async def snapshot(self, slot: str, keys: Sequence[str]) -> Snapshot:
        """The counters `keys` (all in `slot`) and the slot's reservations, read atomically."""
        ...


# --- the result ---------------------------------------------------------------------------------

class Verdict(enum.StrEnum):
    AGREES = "agrees"  # the ledger's total is the store's counter
    IN_FLIGHT = "in flight"  # the ledger's total is the counter less what reservations hold
    # The store settled more than the ledger holds yet: rows on their way to it (one reading
    # cannot tell them from lost rows; the next reading does, see `confirmed_by`).
    BEHIND = "on its way"
    DRIFT = "drift"  # they differ beyond that
    PENDING = "pending"  # drift in a second reading only: rows may be on their way
    EXPIRED = "expired"  # the store no longer holds the window: not judged


@dataclass(frozen=True, slots=True)
class Check:
    """One window: the ledger's total, the store's counter, what reservations hold in it."""

    key: str  # the storage key
    user: str | None  # None: a team's window
    team: str | None
    label: str  # `<scope>:<window>:<stamp>`
    window: str  # its name: daily_tokens, monthly_usd, ...
    measure: str  # total, input, output, requests, cost (nano-dollars)
    ledger: int
    store: int
    in_flight: int
    verdict: Verdict
    # The difference nothing explains, signed like `difference`: ledger over what the store
    # settled (> 0), or short of what an earlier reading's store had settled (< 0).
    unexplained: int = 0

    @property
    def scope(self) -> str:
        return self.label.rsplit(":", 2)[0]

    @property
    def stamp(self) -> str:
        return self.label.rsplit(":", 1)[1]

    @property
    def difference(self) -> int:
        """Ledger minus store."""
        return self.ledger - self.store

    @property
    def settled(self) -> int:
        """What the store's counter holds for settled requests: the counter less what the
        reservations in it hold (their amounts are in the counter until they settle)."""
        return self.store - self.in_flight

    @property
    def gap(self) -> int:
        """Ledger minus what the store settled: never above 0 when the books are right (the
        ledger is read before the store, and a row is written after its settle); below 0 by
        the rows on their way."""
        return self.ledger - self.settled

    @property
    def judged(self) -> bool:
        return self.verdict is not Verdict.EXPIRED

    @property
    def quiet(self) -> bool:
        return self.ledger == 0 and self.store == 0 and self.in_flight == 0

    @property
    def is_cost(self) -> bool:
        return self.measure == lim.Measure.COST.value

@dataclass(frozen=True, slots=True)
class Orphan:
    """A reservation still held past its lease: its proxy died, or its release was lost."""

    slot: str
    res_id: str
    deadline: float  # epoch seconds
    overdue_s: float
    held: tuple[tuple[str, int], ...]  # (counter key within the slot, amount)

@dataclass(frozen=True, slots=True)
class Reconciliation:
    day: date
    timezone: str
    at: float  # the store's clock at the (first) snapshot
    # Not in the repr: asyncio.run formats its main task's result (`report.Report.rows`).
    checks: tuple[Check, ...] = field(repr=False)
    orphans: tuple[Orphan, ...] = field(repr=False)
    ledger_newest: float | None  # the newest row's end, epoch seconds; None: no rows at all
    # Rows that ended by this time (epoch seconds) include every row the store had settled
    # when it was read: its clock at the last snapshot, plus `CUT_MARGIN_S`.
    cut: float = 0.0

    @property
    def agrees(self) -> bool:
        return not any(c.verdict is Verdict.DRIFT for c in self.checks)

    @property
    def behind(self) -> bool:
        """Some window waits for rows on their way: a later reading is needed to judge it."""
        return any(c.verdict is Verdict.BEHIND for c in self.checks)

    def single(self) -> Reconciliation:
        """This reading judged alone: a store ahead of the ledger is drift (`--recheck 0`)."""
        checks = tuple(replace(c, verdict=Verdict.DRIFT, unexplained=c.gap)
                       if c.verdict is Verdict.BEHIND else c for c in self.checks)
        return replace(self, checks=checks)

    def drift_by_window(self) -> dict[str, int]:
        """Per window name (every calendar one, 0 included so a gauge clears): the unexplained
        difference (ledger minus store) summed over users, keys, model groups and teams. When
        some are over and some under, the larger side's sum: opposite drifts never cancel
        to 0. Cost windows are in nano-dollars."""
        over: dict[str, int] = defaultdict(int)
        under: dict[str, int] = defaultdict(int)
        for c in self.checks:
            if c.verdict is Verdict.DRIFT:
                u = c.unexplained
                (over if u > 0 else under)[c.window] += u
        out = {}
        for name in lim.WindowName:
            if name.calendar:
                plus, minus = over[name.value], under[name.value]
                out[name.value] = plus if plus >= -minus else minus
        return out

    def confirmed_by(self, earlier: Reconciliation,
                     reached: Mapping[str, int]) -> Reconciliation:
        """This (later) reading judged with `earlier`. `reached`: per window, this reading's
        ledger total over the rows that ended by `earlier.cut`.

        - Books over the store: drift only where `earlier` showed it too (else pending).
        - The store ahead of the books: every row the store had settled at `earlier` ended
          before it was read, so by now those rows are in the ledger unless they are lost.
          Still short of what `earlier`'s store had settled (and still behind now): drift, by
          what is missing. Rows that ended later are not counted, so they cannot hide it."""
        before = {c.key: c for c in earlier.checks}
        return replace(self, checks=tuple(_judged(c, before.get(c.key), reached.get(c.key, 0))
                                          for c in self.checks))

# --- the comparison -----------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class _Target:
    key: str
    user: str | None
    team: str | None
    label: str
    name: lim.WindowName
    expires_at: float


@dataclass(slots=True)
class _Tally:
    requests: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    cost_nanousd: int = 0

    def amount(self, measure: lim.Measure) -> int:
        if measure is lim.Measure.TOTAL:
            return self.input_tokens + self.output_tokens
        if measure is lim.Measure.INPUT:
            return self.input_tokens
        if measure is lim.Measure.OUTPUT:
            return self.output_tokens
        if measure is lim.Measure.COST:
            return self.cost_nanousd
        return self.requests


def _slot_of(key: str) -> str:
    """`prefix:{alice}:u:daily_tokens:20261203` -> `prefix:{alice}` (names never hold braces)."""
    return key[: key.index("}") + 1]


def _calendar(config: Config, at: float) -> dict[str, tuple[str, float]]:
    """Per calendar window name: the stamp of its period around `at` and when its counters
    expire. From a plan with every limit set, so it names every window there is."""
    every = Limits(**dict.fromkeys(Limits.model_fields, 1))
    limits = lim.effective_limits(None, every)
    return {w.name.value: (w.label.rsplit(":", 1)[1], at + w.ttl_s)
            for w in lim.plan(config, "_", limits, "", at).windows if w.name.calendar}


def _span(day: date, tz: ZoneInfo) -> tuple[float, float]:
    """From the start of the week or month `day` is in (whichever is earlier) to the end of the
    later one: the rows that can have charged a window of that day."""
    monday = day - timedelta(days=day.weekday())
    first = day.replace(day=1)
    start = min(monday, first)
    sunday_next = monday + timedelta(days=7)
    next_first = (first + timedelta(days=32)).replace(day=1)
    end = max(sunday_next, next_first)
    return (datetime(start.year, start.month, start.day, tzinfo=tz).timestamp(),
            datetime(end.year, end.month, end.day, tzinfo=tz).timestamp())


async def _ledger(reader: LedgerReader, config: Config, span: tuple[float, float],
                  calendar: Mapping[str, tuple[str, float]], ended_by: float | None = None
                  ) -> dict[str, tuple[_Target, _Tally]]:
    """The ledger's totals per counter key, for the windows of the day (of the rows that ended
    by `ended_by`, when given): the rows that started before the span's end and ended after its
    start (a window's labels are chosen at admission, between the two). From the rows
    themselves when the reader was opened without the rollups (`--deep`: the rollup does not
    see a row deleted or changed by hand, outside the sinks)."""
    q = reader.sql()
    if await rollups_ready(reader) and span[0] % HOUR_S == 0 and span[1] % HOUR_S == 0:
        text = _from_rollup(q, span, ended_by)
    else:  # a zone whose midnights are not whole UTC hours: the rows
        text = (  # (placeholders are numbered as they are made: in the text's order)
            # A response-cache hit used no tokens (its token columns are 0): one charged in
            # full (`cache.charge_hits: full`) was charged what it saved, which its `saved_*`
            # columns hold; one charged nothing names no window. Other rows saved nothing (0,
            # NULL). The windows rollup sums the same (`proxy.ledger.rollup.WINDOWS`).
            "SELECT user_name, team, windows, count(*), sum(input_tokens + saved_input_tokens), "
            "sum(output_tokens + saved_output_tokens), "
            "sum(coalesce(cost_nanousd, 0) + coalesce(saved_cost_nanousd, 0)) "
            f"FROM {TABLE} WHERE started_at < {q.ts(span[1])} "
            f"AND ended_at >= {q.ts(span[0])} "
            + (f"AND ended_at <= {q.ts(ended_by)} " if ended_by is not None else "")
            + "AND windows <> '' GROUP BY user_name, team, windows"
        )
    prefix = config.store.prefix
    out: dict[str, tuple[_Target, _Tally]] = {}
    for user, team, windows, n, inp, outp, cost in await reader.fetch(text, q.params):
        for written in str(windows).split():
            label = written
            if team is not None and written.startswith(f"{user}:"):
                # A team user's counter written as the key past the team's slot
                # (`alice:u:...`) rather than its label (`u:...`): no scope starts so.
                label = written[len(user) + 1:]
            scope, field, stamp = label.rsplit(":", 2)
            day_stamp = calendar.get(field)
            if day_stamp is None or day_stamp[0] != stamp:
                continue  # a per-minute window, or another period's
            if scope.startswith("t."):
                owner, team_of = None, scope[2:]
                key = f"{lim.slot_for(prefix, '', team_of)}:{label}"
            else:
                owner, team_of = user, team
                key = f"{lim.user_base(prefix, user, team)}:{label}"
            if key not in out:
                out[key] = (_Target(key, owner, team_of, label, lim.WindowName(field),
                                    day_stamp[1]), _Tally())
            tally = out[key][1]
            tally.requests += as_int(n)
            tally.input_tokens += as_int(inp)
            tally.output_tokens += as_int(outp)
            tally.cost_nanousd += as_int(cost)
    return out


def _from_rollup(q: Sql, span: tuple[float, float], ended_by: float | None) -> str:
    """`_ledger`'s statement over the windows rollup (`proxy.ledger.rollup.WINDOWS`: by the
    hour rows ended and the hour they started; exact for a span of whole hours). With
    `ended_by`, the rollup's hours that ended before its hour, and the rows of its hour up to
    it (those started at or after the first hour any of them started)."""
    w = WINDOWS
    sums = ", ".join(f"sum({m.name})" for m in w.measures)
    cols = ", ".join(["user_name", "team", "windows", *(m.name for m in w.measures)])
    within = f"started_at < {q.ts(span[1])} AND ended_at >= {q.ts(span[0])} AND windows <> ''"
    branches = f"SELECT {cols} FROM {w.table} WHERE {within}"
    if ended_by is not None:
        hour = ended_by - ended_by % HOUR_S
        branches += f" AND ended_at < {q.ts(hour)}"
        raw_cols = ", ".join(["user_name", "team", "windows",
                              *(f"{m.expr} AS {m.name}" for m in w.measures)])
        raw_within = (f"started_at < {q.ts(span[1])} AND ended_at >= {q.ts(span[0])} "
                      "AND windows <> ''")
        branches += (f" UNION ALL SELECT {raw_cols} FROM {TABLE} WHERE {raw_within} "
                     f"AND ended_at >= {q.ts(hour)} AND ended_at <= {q.ts(ended_by)} "
                     f"AND started_at >= (SELECT min(started_at) FROM {w.table} "
                     f"WHERE ended_at = {q.ts(hour)})")
    return f"SELECT user_name, team, windows, {sums} FROM ({branches}) u GROUP BY 1, 2, 3"


async def _newest(reader: LedgerReader) -> float | None:
    if await rollups_ready(reader):
        # The newest row ended in the rollup's last hour, and started no earlier than the
        # first hour any row ending then started: an index range, not the whole table.
        w = WINDOWS.table
        last = f"(SELECT max(ended_at) FROM {w})"
        text = (f"SELECT max(ended_at) FROM {TABLE} WHERE ended_at >= {last} AND started_at "
                f">= (SELECT min(started_at) FROM {w} WHERE ended_at = {last})")
    else:
        text = f"SELECT max(ended_at) FROM {TABLE}"
    ((newest,),) = await reader.fetch(text)
    if newest is None:
        return None
    return newest.timestamp() if isinstance(newest, datetime) else float(newest)


async def reconcile(config: Config, view: StoreView, reader: LedgerReader, day: date,
                    earlier: Reconciliation | None = None) -> Reconciliation:
    """One reading: the ledger first, then the store's snapshot (see the module's docstring).
    With `earlier` (a previous reading of the same day), judged against it (`confirmed_by`).
    `view`: the store. Raises StoreError or LedgerUnavailable when either cannot be
    read."""
    tz = ZoneInfo(config.timezone)
    at = datetime(day.year, day.month, day.day, 12, tzinfo=tz).timestamp()
    calendar = _calendar(config, at)
    span = _span(day, tz)
    targets: dict[str, _Target] = {}
    for user in list(config.users) or [DEFAULT_USER]:
        team = lim.team_of(config, user)
        for w in lim.windows_at(config, user, at):
            is_team = w.scope.kind is ScopeKind.TEAM
            targets.setdefault(w.key, _Target(
                w.key, None if is_team else user, w.scope.name if is_team else team, w.label,
                w.name, calendar[w.name.value][1]))
    # The ledger before the store: every row in it was settled before the store is read, so
    # the books can never rightly exceed what the store settled. (Read after, it could hold
    # rows of requests admitted after the snapshot.) Users and windows only the ledger knows
    # (a pass-through key, a user no longer configured, a key's limits since removed) are
    # read from the store too.
    ledger = await _ledger(reader, config, span, calendar)
    newest = await _newest(reader)
    for key, (target, _) in ledger.items():
        targets.setdefault(key, target)
    by_slot: dict[str, list[str]] = defaultdict(list)
    for key in targets:
        by_slot[_slot_of(key)].append(key)
    slots = sorted(by_slot)
    states = dict(zip(slots, await asyncio.gather(
        *(view.snapshot(slot, by_slot[slot]) for slot in slots)), strict=True))

    checks = []
    orphans = []
    for slot, state in states.items():
        held: dict[str, int] = defaultdict(int)
        for h in state.holds:
            for key, amt in h.amounts:
                held[key] += amt
            if h.deadline <= state.now:
                cut = len(slot) + 1
                orphans.append(Orphan(slot, h.res_id, h.deadline, state.now - h.deadline,
                                      tuple((k[cut:], a) for k, a in h.amounts)))
        for key in by_slot[slot]:
            t = targets[key]
            measure = t.name.measure
            found = ledger.get(key)
            total = found[1].amount(measure) if found is not None else 0
            stored, in_flight = state.counters[key], held[key]
            expired = state.now >= t.expires_at - _EXPIRY_MARGIN_S
            verdict, unexplained = _verdict(total, stored, in_flight, expired)
            checks.append(Check(key, t.user, t.team, t.label, t.name.value, measure.value,
                                total, stored, in_flight, verdict, unexplained))
    checks.sort(key=lambda c: (c.user is None, c.user or "", c.team or "", c.label))
    at_store = min((s.now for s in states.values()), default=time.time())
    last = max((s.now for s in states.values()), default=at_store)
    reading = Reconciliation(day, config.timezone, at_store, tuple(checks), tuple(orphans),
                             newest, last + CUT_MARGIN_S)
    if earlier is None or earlier.day != day:
        return reading
    reached: dict[str, int] = {}
    # Every window the earlier store was ahead in is judged by the rows that reached it since,
    # whatever that reading's verdict was: one judged drift (a persisting loss) is still short
    # of what its store had settled, and is judged so again, not against no rows at all.
    if any(c.judged and c.gap < 0 for c in earlier.checks):
        for key, (target, tally) in (await _ledger(reader, config, span, calendar,
                                                   ended_by=earlier.cut)).items():
            reached[key] = tally.amount(target.name.measure)
    return reading.confirmed_by(earlier, reached)


def _judged(c: Check, e: Check | None, reached: int) -> Check:
    """`c` judged with the same window's earlier check `e` (see `confirmed_by`)."""
    if c.verdict is Verdict.DRIFT and (e is None or e.gap <= 0):
        return replace(c, verdict=Verdict.PENDING)
    if c.verdict is Verdict.BEHIND and e is not None and e.gap < 0 and reached < e.settled:
        return replace(c, verdict=Verdict.DRIFT, unexplained=reached - e.settled)
    return c


def _verdict(ledger: int, store: int, in_flight: int, expired: bool) -> tuple[Verdict, int]:
    """One reading's verdict on a window, and the difference nothing explains. The tolerance
    is one-sided: reservations explain a store above the books by what they hold, and rows on
    their way a store further above (until the next reading); nothing explains books above
    what the store settled (the budgets under-count)."""
    gap = ledger - (store - in_flight)
    if expired:
        return Verdict.EXPIRED, 0
    if gap > 0:
        return Verdict.DRIFT, gap
    if gap < 0:
        return Verdict.BEHIND, 0
    return (Verdict.IN_FLIGHT if in_flight else Verdict.AGREES), 0
