"""What `tokenmeter reconcile` shows of a reading (`plan.Reconciliation`): the measures
in plain words, figures as people read them (cost in USD), the table and the JSON."""

from __future__ import annotations

import urllib.parse
from datetime import UTC, datetime

from proxy.budget import limits as lim
from proxy.ledger.report_render import usd
from proxy.reconcile.plan import Check, Orphan, Reconciliation, Verdict

_MEASURE_WORDS = {
    lim.Measure.TOTAL.value: "tokens",
    lim.Measure.INPUT.value: "input tokens",
    lim.Measure.OUTPUT.value: "output tokens",
    lim.Measure.REQUESTS.value: "requests",
    lim.Measure.COST.value: "cost (USD)",
}


def measure_words(c: Check) -> str:
    """The measure in plain words (the store counts cost in nano-dollars; people read USD)."""
    return _MEASURE_WORDS.get(c.measure, c.measure)


def amount(c: Check, value: int) -> str:
    """A figure of this window as shown: tokens and requests as counts, cost in USD (exact,
    nine decimals, from the nano-dollars the store and the ledger keep)."""
    return f"${usd(value)}" if c.is_cost else f"{value:,}"


def check_json(c: Check) -> dict[str, object]:
    out: dict[str, object] = {
        "user": c.user, "team": c.team, "scope": c.scope,
        "window": c.window, "stamp": c.stamp, "measure": c.measure,
        "unit": "usd" if c.is_cost else "requests"
        if c.measure == lim.Measure.REQUESTS.value else "tokens",
        "ledger": c.ledger, "store": c.store, "in_flight": c.in_flight,
        "difference": c.difference, "unexplained": c.unexplained,
        "verdict": c.verdict.value, "key": c.key}
    if c.is_cost:  # the integers stay nano-dollars (exact); these are the USD
        for name in ("ledger", "store", "in_flight", "difference", "unexplained"):
            out[f"{name}_usd"] = usd(getattr(c, name))
    return out


def orphan_json(o: Orphan) -> dict[str, object]:
    return {"slot": o.slot, "reservation": o.res_id,
            "lease_ended": datetime.fromtimestamp(o.deadline, UTC).isoformat(),
            "overdue_s": round(o.overdue_s, 3), "held": dict(o.held)}


def reconciliation_json(r: Reconciliation) -> dict[str, object]:
    shown = [c for c in r.checks if not c.quiet]
    return {
        "date": r.day.isoformat(), "timezone": r.timezone,
        "at": datetime.fromtimestamp(r.at, UTC).isoformat(),
        "agrees": r.agrees, "checked": len(r.checks),
        "ledger_newest": None if r.ledger_newest is None
        else datetime.fromtimestamp(r.ledger_newest, UTC).isoformat(),
        "windows": [check_json(c) for c in shown],
        "orphans": [orphan_json(o) for o in r.orphans],
        "drift_by_window": r.drift_by_window(),
    }


def redact(url: str) -> str:
    parts = urllib.parse.urlsplit(url)
    if parts.password is None:
        return url
    netloc = f"{parts.username or ''}:***@{parts.hostname or ''}"
    if parts.port is not None:
        netloc += f":{parts.port}"
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc))


def _ago(seconds: float) -> str:
    return f"{seconds:.1f} s" if seconds < 120 else f"{seconds / 60:.0f} min"


def render_table(r: Reconciliation, caption: str) -> str:
    lines = [caption]
    shown = [c for c in r.checks if not c.quiet]
    header = ("user", "team", "scope", "window", "period", "measure", "ledger", "store",
              "in flight", "verdict")
    rows = [header, *(
        ("-" if c.user is None else c.user, c.team or "-", c.scope, c.window, c.stamp,
         measure_words(c), amount(c, c.ledger), amount(c, c.store), amount(c, c.in_flight),
         c.verdict.value)
        for c in shown
    )]
    if shown:
        widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
        lines += ["  ".join(cell.rjust(w) if 6 <= i <= 8 else cell.ljust(w)
                            for i, (cell, w) in enumerate(zip(row, widths, strict=True))).rstrip()
                  for row in rows]
    else:
        lines.append("no usage in any window of the day, in the ledger or the store")
    if r.orphans:
        lines += ["", f"orphans (reservations held past their lease): {len(r.orphans)}"]
        for o in r.orphans:
            held = " ".join(f"{k}={a:,}" for k, a in o.held)
            lines.append(f"  {o.slot} {o.res_id}: lease ended {_ago(o.overdue_s)} ago; "
                         f"holds {held or 'nothing'}")
    if r.ledger_newest is not None:
        lines.append(f"\nthe ledger's newest row ended {_ago(max(0.0, r.at - r.ledger_newest))} "
                     "before the store was read")
    drift = [c for c in r.checks if c.verdict is Verdict.DRIFT]
    pending = [c for c in r.checks if c.verdict is Verdict.PENDING]
    behind = [c for c in r.checks if c.verdict is Verdict.BEHIND]
    judged = sum(1 for c in r.checks if c.judged)
    if drift:
        lines.append(f"DRIFT: {len(drift)} of {judged} windows disagree beyond the requests in "
                     "flight and the rows on their way")
    else:
        lines.append(f"agree: {judged} windows checked"
                     + (f"; {len(pending)} differ in the second reading only (pending)"
                        if pending else "")
                     + (f"; {len(behind)} wait for rows on their way to the ledger"
                        if behind else ""))
    return "\n".join(lines)


