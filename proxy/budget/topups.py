"""When a stream's reservation is topped up, and when the stream is ended, as values.

Under `admission: estimate` a stream reserves its prompt plus a learned estimate of its output
(`proxy.budget.estimate`) and keeps its own output cap upstream. As it runs it is checked,
at content-event counts this module chooses, against what it holds (`Allowance.check`):
- at three quarters of what is reserved, a top-up is started (`Act.START`, for `step` tokens)
  and the stream runs on while the store answers, so the round trip overlaps the stream
  instead of delaying a chunk;
- within `slack` of what is reserved while that top-up is still out, the stream waits for
  its answer (`Act.WAIT`: the one case that can delay a chunk, a store slower than the last
  quarter of a reservation takes to stream);
- once a top-up was refused (no room left in a window, or a store that fails closed), the
  stream runs to what it holds and is ended within `slack` of it, at the first check whose
  bytes end between two events (`Act.END`): an error event can follow only there.

`slack` covers what can stream between two checks that fall on consecutive events: two events
at the rate seen so far, or twice the most one check's interval brought while checked event by
event (`burst`: a chunk the tap could not cut finer). Between checks the relay pays one integer
comparison: the next check is placed, from the tokens per event seen so far, at half the
distance to the next threshold; from the first top-up on, and once refused, at every event.

Pure: the driver (`proxy.pipeline.topup`) counts the tokens, asks the store, applies its
answers (`granted`, `refusal`) and raises the end; the relay tells it where events end (the
tap's `client_at_boundary`), never by framing events itself.
"""

from __future__ import annotations

import enum
import sys
from dataclasses import dataclass, replace

from proxy.budget import estimate as est

NEVER = sys.maxsize  # `next_at` of a stream that needs no check: it holds its whole cap


class Act(enum.Enum):
    NOTHING = "nothing"  # run on to the next check
    START = "start"  # ask the store for `step` more output tokens; the stream runs on meanwhile
    WAIT = "wait"  # wait for the top-up that is out, apply its answer, and check again
    END = "end"  # end the stream here: it reached what it holds and could not get more


@dataclass(frozen=True, slots=True)
class Seen:
    """A stream at a check: its content events and output tokens so far, and whether the bytes
    forwarded to its client end between two events (the tap's `client_at_boundary`)."""

    events: int
    tokens: int
    at_boundary: bool = True


@dataclass(frozen=True, slots=True)
class Decision:
    act: Act
    allowance: Allowance  # after the check (WAIT: unchanged, to be checked again)
    step: int = 0  # START: the output tokens to ask for


@dataclass(frozen=True, slots=True)
class Allowance:
    """The output a stream holds and how it is checked: the top-up side of its reservation."""

    reserved: int  # output tokens the stream holds now
    cap: int  # the output cap sent upstream: no top-up passes it
    estimate: int  # what was first reserved: the top-ups' step follows it
    refused: bool = False  # a top-up was refused: none is asked for again
    burst: int = 0  # the most tokens one check's interval brought, checked event by event
    events: int = 0  # content events at the last check
    tokens: int = 0  # output tokens at the last check
    next_at: int = 1  # the content-event count at which the next check is due

    @staticmethod
    def of(output_cap: int, topup_cap: int | None) -> Allowance | None:
        """A reservation's allowance (its `output_cap` and `topup_cap`); None when it cannot
        be topped up: not admitted under `estimate`, or already holding its whole cap."""
        if topup_cap is None or output_cap >= topup_cap:
            return None
        return Allowance(output_cap, topup_cap, output_cap)

    def granted(self, tokens: int) -> Allowance:
        return replace(self, reserved=self.reserved + tokens)

    def refusal(self) -> Allowance:
        return replace(self, refused=True)

    def slack(self, seen: Seen, burst: int) -> int:
        """How far short of `reserved` a check must act: what two more events can bring."""
        return max(int(2 * _rate(seen)) + 2, 2 * burst)

    def check(self, seen: Seen, pending: bool) -> Decision:
        """The check due at `seen` (`seen.events >= next_at`); `pending`: a top-up is out and
        unanswered. The caller acts, then checks again while the check is still due (`WAIT`,
        and a top-up started within slack: wait for its answer now). A refused stream not yet
        at an event's end is checked again at the next."""
        burst = self.burst
        if self.next_at == self.events + 1:  # checked at every event: this interval's tokens
            burst = max(burst, seen.tokens - self.tokens)
        line = self.reserved - self.slack(seen, burst)
        near = seen.tokens >= line
        if pending and near:
            return Decision(Act.WAIT, self)
        act, step, next_at = Act.NOTHING, 0, self._next_at(seen, pending)
        if self.refused and near and seen.at_boundary:
            act = Act.END
        elif self._short(seen.tokens, pending, line):
            act, step = Act.START, est.step(self.estimate, self.cap - self.reserved)
            # Already within slack (a small reservation, a burst): due again at once, to wait
            # for this top-up's answer before another event goes out.
            next_at = seen.events if near else seen.events + 1
        after = replace(self, burst=burst, events=seen.events, tokens=seen.tokens,
                        next_at=next_at)
        return Decision(act, after, step)

    def _short(self, tokens: int, pending: bool, line: int) -> bool:
        """A top-up is due: none out, none refused, the cap not reached, and three quarters of
        what is held streamed, or less if the slack is more than a quarter (a small
        reservation): never is the line passed without a top-up asked for."""
        return (not pending and not self.refused and self.reserved < self.cap
                and tokens >= min(self.reserved * 3 // 4, line))

    def _next_at(self, seen: Seen, pending: bool) -> int:
        if pending or self.refused:
            return seen.events + 1
        if self.reserved >= self.cap:
            return NEVER  # the upstream stops at the cap itself
        ahead = (self.reserved * 3 // 4 - seen.tokens) / max(_rate(seen), 1e-3) / 2
        return seen.events + max(1, int(ahead))


def _rate(seen: Seen) -> float:
    """Tokens per content event so far (1 before any event)."""
    return seen.tokens / seen.events if seen.events else 1.0
