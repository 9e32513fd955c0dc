"""`tokenmeter usage`: per-user consumption for a day, read from the budget's store counters."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from datetime import date, datetime
from zoneinfo import ZoneInfo

from proxy.budget.limits import daily_key, team_of
from proxy.budget.store import Store
from proxy.config.load import Config
from proxy.telemetry.shown_text import for_terminal

_FIELDS = ("daily_tokens", "daily_input_tokens", "daily_output_tokens")


@dataclass(frozen=True, slots=True)
class UserUsage:
    user: str
    day: str
    tokens: int
    input_tokens: int
    output_tokens: int
    daily_limit: int | None

    @property
    def remaining(self) -> int | None:
        return None if self.daily_limit is None else max(0, self.daily_limit - self.tokens)


def today(config: Config, now: float) -> date:
    return datetime.fromtimestamp(now, ZoneInfo(config.timezone)).date()


async def read_usage(config: Config, store: Store, day: date) -> list[UserUsage]:
    stamp = day.strftime("%Y%m%d")
    users = list(config.users) or ["default"]
    # A team's users keep their counters in the team's slot: the key depends on the team.
    keys = [daily_key(config.store.prefix, u, f, stamp, team_of(config, u))
            for u in users for f in _FIELDS]
    values = await store.read(keys)
    out = []
    for i, user in enumerate(users):
        total, inp, outp = values[i * 3 : i * 3 + 3]
        cfg = config.users.get(user)
        limit = cfg.daily_tokens if cfg and cfg.daily_tokens is not None else (
            config.defaults.daily_tokens
        )
        out.append(UserUsage(user, day.isoformat(), total, inp, outp, limit))
    return out


def render(rows: list[UserUsage], as_json: bool) -> str:
    if as_json:
        return json.dumps([{**asdict(r), "remaining": r.remaining} for r in rows], indent=2)
    header = ("user", "day", "tokens", "input", "output", "daily limit", "remaining")
    table = [header] + [
        # User names come from the configuration; escaped all the same, as every shown name.
        (for_terminal(r.user), r.day, f"{r.tokens:,}", f"{r.input_tokens:,}",
         f"{r.output_tokens:,}",
         "-" if r.daily_limit is None else f"{r.daily_limit:,}",
         "-" if r.remaining is None else f"{r.remaining:,}")
        for r in rows
    ]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    return "\n".join(
        "  ".join(cell.ljust(w) if i < 2 else cell.rjust(w)
                  for i, (cell, w) in enumerate(zip(row, widths, strict=True)))
        for row in table
    )
