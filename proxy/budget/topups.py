"""When a stream's reservation is topped up, and when the stream is ended, as values.

Under `admission: estimate` a stream reserves its prompt plus a learned estimate of its output
(`proxy.budget.estimate`) and keeps its own output cap upstream. As it runs it is checked,
at the bytes arrived this module chooses, against what it holds (`Allowance.check`):
- at three quarters of what is reserved, a top-up is started (`Act.START`, for `step` tokens)
  and the stream runs on while the store answers, so the round trip overlaps the stream
  instead of delaying a chunk;
- within `slack` of what is reserved while that top-up is still out, the stream waits for
  its answer (`Act.WAIT`: the one case that can delay a chunk, a store slower than the last
  quarter of a reservation takes to stream);
- once a top-up was refused (no room left in a window, or a store that fails closed), the
  stream runs to what it holds and is ended within `slack` of it, at the first check whose
  bytes end between two events (`Act.END`): an error event can follow only there.

`slack` covers what one more piece can bring: two events at the rate seen so far, or the most
one piece (one event) was seen to bring (`burst`).

Checks are placed by what arrived, not by event count: a piece of the stream (an event, or
the part of one a network chunk holds) carries no more output tokens than its bytes (every
token of the tokenizers in use is at least one byte of text, and the wire adds JSON and SSE
framing around it). So the next check is due once the bytes arrived since this one could
carry the stream to its next line (three quarters of what it holds, or within slack of it),
and the piece that reaches it is metered before it is forwarded: one that passes what the
stream holds is topped up (`START` then `WAIT`, for at least what it passed by) before it
goes out, or, refused, goes out as the last (`END`): one stream can pass what it holds by at
most what its largest event carried. Between checks the relay pays one integer comparison
per chunk. A piece of more than `MIN_STEP` tokens (`TopupDecision.bunched`) is what the
(upstream, model) is learned by (`proxy.budget.estimate`): a piece generated whole before
the proxy could act on it is what no top-up can follow.

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
    """A stream at a check: its content events, output tokens and bytes so far, the output
    tokens of the piece at hand (metered, not yet forwarded), and whether the bytes forwarded
    end between two events once that piece is (the tap's `client_at_boundary`)."""

    events: int
    tokens: int
    arrived: int  # bytes of the upstream's stream so far, the piece at hand included
    piece: int = 0
    at_boundary: bool = True


@dataclass(frozen=True, slots=True)
class TopupDecision:
    act: Act
    allowance: Allowance  # after the check (WAIT: unchanged, to be checked again)
    step: int = 0  # START: the output tokens to ask for
    # The piece at hand carried more than `MIN_STEP` output tokens: its (upstream, model) is
    # learned to stream in pieces no top-up can follow (`proxy.budget.estimate`).
    bunched: bool = False


@dataclass(frozen=True, slots=True)
class Allowance:
    """The output a stream holds and how it is checked: the top-up side of its reservation."""

    reserved: int  # output tokens the stream holds now
    cap: int  # the output cap sent upstream: no top-up passes it
    estimate: int  # what was first reserved: the top-ups' step follows it
    refused: bool = False  # a top-up was refused: none is asked for again
    burst: int = 0  # the most output tokens one piece was seen to bring
    events: int = 0  # content events at the last check
    tokens: int = 0  # output tokens at the last check
    next_at: int = 1  # the bytes arrived at which the next check is due

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
        """How far short of `reserved` a check must act: two more events at the rate seen, or
        the largest piece seen, whichever is more. One piece is enough: the piece that reaches
        a check is metered before it goes out, and goes out even when the stream ends there,
        so what must fit is one more, not two."""
        return max(int(2 * _rate(seen)) + 2, burst)

    def check(self, seen: Seen, pending: bool) -> TopupDecision:
        """The check due at `seen` (`seen.arrived >= next_at`); `pending`: a top-up is out
        and unanswered. The caller acts, then checks again while the check is still due
        (`WAIT`, and a top-up started within slack: wait for its answer now, before the piece
        at hand goes out). A refused stream not yet at an event's end is checked again at the
        next piece."""
        burst = max(self.burst, seen.piece)
        slack = self.slack(seen, burst)
        line = self.reserved - slack
        near = seen.tokens >= line
        bunched = seen.piece > est.MIN_STEP
        if pending and near:
            return TopupDecision(Act.WAIT, self, bunched=bunched)
        act, step = Act.NOTHING, 0
        if self.refused and near and seen.at_boundary:
            act = Act.END
        elif self._short(seen.tokens, pending, line):
            # At least what gets the stream back under its line: a piece that passed what
            # is held is covered by one answer, not a step at a time.
            act = Act.START
            step = min(self.cap - self.reserved,
                       max(est.step(self.estimate, self.cap - self.reserved),
                           seen.tokens + slack + 1 - self.reserved))
        if act is Act.START and near:
            # Already within slack (a small reservation, a large piece): due again at once,
            # to wait for this top-up's answer before the piece goes out.
            next_at = seen.arrived
        else:
            next_at = self._next_at(seen, pending or act is Act.START, slack)
        after = replace(self, burst=burst, events=seen.events, tokens=seen.tokens,
                        next_at=next_at)
        return TopupDecision(act, after, step, bunched)

    def _short(self, tokens: int, pending: bool, line: int) -> bool:
        """A top-up is due: none out, none refused, the cap not reached, and three quarters of
        what is held streamed, or less if the slack is more than a quarter (a small
        reservation): never is the line passed without a top-up asked for."""
        return (not pending and not self.refused and self.reserved < self.cap
                and tokens >= min(self.reserved * 3 // 4, line))

    def _next_at(self, seen: Seen, pending: bool, slack: int) -> int:
        """Where the bytes arrived could first carry the stream to its next line: within
        slack of what it holds while a top-up is out or after a refusal, else the line of the
        next top-up. One byte on (the next piece) once there."""
        if self.reserved >= self.cap and not self.refused:
            return NEVER  # the upstream stops at the cap itself
        line = self.reserved - slack
        if not (pending or self.refused):
            line = min(self.reserved * 3 // 4, line)
        return seen.arrived + max(1, line - seen.tokens)


def _rate(seen: Seen) -> float:
    """Tokens per content event so far (1 before any event)."""
    return seen.tokens / seen.events if seen.events else 1.0
