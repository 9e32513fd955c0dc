"""`tokenmeter bench --replay FILE.jsonl` (or `--replay-captures`, straight from the capture
store): recorded requests as the load, each in its own route's API, and what the run
says about them beyond speed: the lines skipped and why, each request's outcome beside the
recorded one, the cost per target from a price table, and (with --compare) how the two
targets' answers to the same requests compare.

The file is docs/capture.md's export line, read by the one parser of that line
(proxy/protocol/export_line.py), the one `mock-upstream --replay` reads too.
"""

from __future__ import annotations

import enum
import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from proxy.bench.client import BenchError, classify_status
from proxy.bench.stats import RequestResult
from proxy.bench.workload import Api, Prompt, message_text
from proxy.capture.cli import exported
from proxy.capture.store import CaptureFilter
from proxy.config.load import ConfigError, load_config
from proxy.config.policy import Price
from proxy.cost import NANOS_PER_USD, CostLines, price_for
from proxy.protocol.export_line import Recording, ReplayFileError, parse_line, read_counted
from proxy.protocol.tokenizer import count_text
from proxy.protocol.usage import Usage
from proxy.storage.urls import shown_url

REQUEST_CHARS = 2_000  # of a request's text in the answers' listing
PAGE_SAMPLE = 20  # answer pairs on the HTML page
OUTCOME_ROWS = 20  # requests whose outcome differs, listed in the terminal report


class ReplayError(ValueError):
    """A replay file or price table that cannot be used; the message names the file."""


# The route each API is sent to; a line of any other route is not replayed.
API_OF_ROUTE: Mapping[str, Api] = {"/v1/chat/completions": Api.OPENAI,
                                   "/v1/messages": Api.ANTHROPIC}


class SkipReason(enum.StrEnum):
    """Why a line of the export was not sent."""

    ROUTE = "route"  # a route bench does not send (embeddings, the Responses API...)
    API = "api"  # the other API than the --api given
    UNREADABLE = "unreadable"  # not a line that can be read (warned of when read)


@dataclass(frozen=True)
class Skip:
    reason: SkipReason
    what: str  # the route, or the API chosen
    count: int

    @property
    def text(self) -> str:
        if self.reason is SkipReason.ROUTE:
            return f"{self.count} {self.what} (not replayed by bench)"
        if self.reason is SkipReason.API:
            return f"{self.count} not --api {self.what}"
        return f"{self.count} {self.what}"


@dataclass(frozen=True)
class ReplayOutcome:
    """How one request ended: its HTTP status (None: no answer) and error class (None: ok)."""

    status: int | None
    error_class: str | None

    @property
    def text(self) -> str:
        return f"{'-' if self.status is None else self.status} {self.error_class or 'ok'}"

    def to_dict(self) -> dict[str, Any]:
        return {"status": self.status, "error_class": self.error_class}


def recorded_outcome(rec: Recording) -> ReplayOutcome:
    """The recorded answer's outcome, classified as bench classifies an answer it gets: an
    error status by its body (`client.classify_status`), a 200 stream by an error event in it."""
    if rec.status != 200:
        body = b"" if rec.body is None else json.dumps(rec.body).encode()
        return ReplayOutcome(rec.status, classify_status(rec.status, body)[0].value)
    for event in rec.events:
        for line in event.text.splitlines():
            if line.startswith("data:"):
                try:
                    obj = json.loads(line[5:])
                except ValueError:
                    continue
                if isinstance(obj, dict) and obj.get("error"):
                    return ReplayOutcome(200, BenchError.STREAM_ERROR.value)
    return ReplayOutcome(200, None)


@dataclass(frozen=True)
class Loaded:
    """The recorded requests to send, and what the source held besides."""

    prompts: list[Prompt]
    lines: int  # of the source, skipped ones included
    skipped: tuple[Skip, ...]
    recorded: Mapping[int, ReplayOutcome]  # by line


def _prompt(rec: Recording, model: str, api: Api) -> Prompt:
    body = dict(rec.request) if rec.request is not None else {}
    # The exported `messages`, `max_tokens` and `stream` are the request's own; a body
    # exported without them (or without a body at all) gets them from the line.
    body.setdefault("messages", list(rec.messages))
    if rec.max_tokens is not None and not any(
            k in body for k in ("max_tokens", "max_completion_tokens")):
        body["max_tokens"] = rec.max_tokens
    if rec.stream:
        body.setdefault("stream", True)
    tokens = count_text(model, message_text(list(rec.messages)))
    return Prompt(tuple(rec.messages), tokens, rec.max_tokens, body=body,
                  stream=body.get("stream") is True, line=rec.line, api=api)


def load_replay(path: str, api: Api | None, tokenizer_model: str) -> Loaded:
    """The requests in the export file of both APIs (`api` given: of that one), each in its
    own API, in the file's order."""
    try:
        found, unreadable = read_counted(Path(path))
    except ReplayFileError as exc:
        raise ReplayError(f"--replay {path}: {exc}") from None
    return _prompts(found, api, tokenizer_model, f"--replay {path}",
                    (Skip(SkipReason.UNREADABLE, "not readable", unreadable),))


def load_captures(url: str, filters: CaptureFilter, redact: Callable[[str], str],
                  api: Api | None, tokenizer_model: str) -> Loaded:
    """`--replay-captures`: the requests among the captures `filters` chooses (of `api`
    when given), oldest first: the lines `tokenmeter captures export` would write, read as a
    file of them is (one conversion, proxy.protocol.export_line's)."""
    lines, left_out = exported(url, filters, redact)
    try:
        found = [parse_line(json.dumps(line), n) for n, line in enumerate(lines, 1)]
    except ReplayFileError as exc:
        raise ReplayError(f"--replay-captures: capture {exc}") from None
    return _prompts(found, api, tokenizer_model, f"--replay-captures ({shown_url(url)})",
                    (Skip(SkipReason.UNREADABLE, "request not whole JSON", left_out),))


def _prompts(found: list[Recording], api: Api | None, tokenizer_model: str, source: str,
             unread: tuple[Skip, ...]) -> Loaded:
    prompts: list[Prompt] = []
    recorded: dict[int, ReplayOutcome] = {}
    routes: dict[str, int] = {}
    other_api = 0
    for r in found:
        line_api = API_OF_ROUTE.get(r.path)
        if line_api is None:
            routes[r.path] = routes.get(r.path, 0) + 1
        elif api is not None and line_api is not api:
            other_api += 1
        else:
            prompts.append(_prompt(r, tokenizer_model, line_api))
            recorded[r.line] = recorded_outcome(r)
    skipped = tuple(s for s in (
        *(Skip(SkipReason.ROUTE, path, n) for path, n in routes.items()),
        *((Skip(SkipReason.API, api.value, other_api),) if api is not None else ()),
        *unread) if s.count)
    lines = len(found) + sum(s.count for s in unread)
    if not prompts:
        why = "; ".join(s.text for s in skipped)
        raise ReplayError(f"{source}: no recorded request to replay"
                          + (f" (of {lines} lines skipped: {why})" if why else ""))
    return Loaded(prompts, lines, skipped, recorded)


def load_prices(prices_file: str | None, config_file: str | None) -> dict[str, Price]:
    """`--prices FILE.yaml` (a `prices:` mapping as in the config) or `--config`'s prices."""
    if config_file:
        try:
            return dict(load_config(config_file).prices)
        except (ConfigError, OSError) as exc:
            raise ReplayError(f"--config {config_file}: {exc}") from None
    if not prices_file:
        return {}
    try:
        data = yaml.safe_load(Path(prices_file).read_text(encoding="utf-8"))
        table = data.get("prices") if isinstance(data, dict) else None
        if not isinstance(table, dict):
            raise ValueError("expected a `prices:` mapping of model name to price")
        return {str(name): Price.model_validate(v) for name, v in table.items()}
    except (OSError, UnicodeDecodeError, yaml.YAMLError, ValidationError, ValueError) as exc:
        raise ReplayError(f"--prices {prices_file}: {exc}") from None


@dataclass(frozen=True)
class TargetCost:
    endpoint: str
    requests: int  # answered (ok) requests, the ones priced
    cost_usd: float | None  # None: no price table given
    cost_per_1k_requests_usd: float | None
    unpriced_models: tuple[str, ...]  # models the table has no price for (their cost: 0)


def _model_of(prompt: Prompt, model: str) -> str:
    recorded = (prompt.body or {}).get("model")
    return model or (recorded if isinstance(recorded, str) else "")


def target_costs(results: Sequence[RequestResult], prompts: Sequence[Prompt], model: str,
                 prices: Mapping[str, Price]) -> list[TargetCost]:
    """Per endpoint, in the run's order: the cost of its answered requests by the usage they
    reported (else the local counts), priced by the model sent (--model, else the recorded)."""
    by_line = {p.line: p for p in prompts}
    out = []
    for endpoint in dict.fromkeys(r.endpoint for r in results):
        ok = [r for r in results if r.endpoint == endpoint and r.ok]
        nanos, unpriced = 0, set()
        for r in ok:
            prompt = by_line[r.line]
            name = _model_of(prompt, model)
            price = price_for(prices, name)
            if price is None:
                unpriced.add(name)
                continue
            prompt_tokens = r.usage_prompt_tokens
            usage = Usage(input_tokens=prompt.tokens if prompt_tokens is None else prompt_tokens,
                          output_tokens=r.output_tokens)
            nanos += CostLines.of(price, usage).nanousd
        usd = nanos / NANOS_PER_USD if prices else None
        per_1k = usd / len(ok) * 1000 if usd is not None and ok else None
        out.append(TargetCost(endpoint, len(ok), usd, per_1k, tuple(sorted(unpriced))))
    return out


@dataclass(frozen=True)
class AnswerPair:
    line: int
    request: str
    a: str
    b: str

    @property
    def match(self) -> bool:
        return self.a == self.b


@dataclass(frozen=True)
class AnswerComparison:
    pairs: tuple[AnswerPair, ...]  # the requests both targets answered, in the file's order

    @property
    def exact_match_rate(self) -> float | None:
        return sum(p.match for p in self.pairs) / len(self.pairs) if self.pairs else None

    @property
    def length_ratio(self) -> float | None:
        """B's answers' characters over A's, all pairs together."""
        a = sum(len(p.a) for p in self.pairs)
        return sum(len(p.b) for p in self.pairs) / a if a else None


def _first_answers(results: Sequence[RequestResult], endpoint: str) -> dict[int, str]:
    out: dict[int, str] = {}
    for r in results:
        if r.endpoint == endpoint and r.ok and r.line and r.line not in out:
            out[r.line] = r.answer or ""
    return out


def compare_answers(results: Sequence[RequestResult], prompts: Sequence[Prompt],
                    endpoints: Sequence[str]) -> AnswerComparison | None:
    """A's and B's first answer to each request both answered; None with one endpoint."""
    if len(endpoints) != 2:
        return None
    a, b = (_first_answers(results, e) for e in endpoints)
    pairs = tuple(
        AnswerPair(p.line, message_text(list(p.messages))[:REQUEST_CHARS], a[p.line], b[p.line])
        for p in sorted(prompts, key=lambda p: p.line) if p.line in a and p.line in b)
    return AnswerComparison(pairs)


def _num(x: float | None, spec: str) -> str:
    return "-" if x is None or not math.isfinite(x) else format(x, spec)


@dataclass(frozen=True)
class RequestOutcome:
    """One replayed request: its recorded outcome beside each endpoint's (its first answer;
    None when the endpoint was never sent it, as with --requests below the lines)."""

    line: int
    api: str
    recorded: ReplayOutcome
    endpoints: tuple[ReplayOutcome | None, ...]  # in the run's order

    @property
    def same(self) -> tuple[bool, ...]:
        return tuple(o == self.recorded for o in self.endpoints)

    @property
    def differs(self) -> bool:
        return any(o is not None and o != self.recorded for o in self.endpoints)


def _first_outcomes(results: Sequence[RequestResult], endpoint: str) -> dict[int, ReplayOutcome]:
    out: dict[int, ReplayOutcome] = {}
    for r in results:
        if r.endpoint == endpoint and r.line and r.line not in out:
            cls = None if r.ok else r.error_class
            out[r.line] = ReplayOutcome(r.status, None if cls is None else str(cls))
    return out


def request_outcomes(results: Sequence[RequestResult], prompts: Sequence[Prompt],
                     recorded: Mapping[int, ReplayOutcome], endpoints: Sequence[str],
                     default_api: Api) -> tuple[RequestOutcome, ...]:
    """Per replayed request, in the file's order: the recorded outcome and each endpoint's."""
    got = [_first_outcomes(results, e) for e in endpoints]
    return tuple(
        RequestOutcome(p.line, (p.api or default_api).value, recorded[p.line],
                       tuple(g.get(p.line) for g in got))
        for p in sorted(prompts, key=lambda p: p.line) if p.line in recorded)


@dataclass(frozen=True)
class ReplayReport:
    file: str
    requests: int  # recorded requests replayed
    costs: tuple[TargetCost, ...]
    answers: AnswerComparison | None
    lines: int = 0  # of the source, the skipped included
    skipped: tuple[Skip, ...] = ()
    endpoints: tuple[str, ...] = ()
    outcomes: tuple[RequestOutcome, ...] = ()

    def same_outcome(self) -> list[tuple[str, int, int]]:
        """Per endpoint: the requests it answered as recorded, of those it was sent."""
        out = []
        for i, label in enumerate(self.endpoints):
            sent = [o for o in self.outcomes if o.endpoints[i] is not None]
            out.append((label, sum(o.endpoints[i] == o.recorded for o in sent), len(sent)))
        return out

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "file": self.file, "requests": self.requests, "lines": self.lines,
            "skipped": {"total": sum(s.count for s in self.skipped),
                        "by_reason": [{"reason": s.reason.value, "what": s.what,
                                       "count": s.count, "text": s.text}
                                      for s in self.skipped]},
            "cost": [vars(c) | {"unpriced_models": list(c.unpriced_models)} for c in self.costs],
            "outcomes": {
                "same_as_recorded": [{"endpoint": e, "same": n, "of": of}
                                     for e, n, of in self.same_outcome()],
                "differ": sum(o.differs for o in self.outcomes),
                "per_request": [
                    {"line": o.line, "api": o.api, "recorded": o.recorded.to_dict(),
                     "endpoints": [{"endpoint": e, **(x.to_dict() if x else
                                                      {"status": None, "error_class": None}),
                                    "sent": x is not None, "same": x == o.recorded}
                                   for e, x in zip(self.endpoints, o.endpoints, strict=True)]}
                    for o in self.outcomes],
            },
            "answers": None,
        }
        if self.answers is not None:
            out["answers"] = {
                "pairs": len(self.answers.pairs),
                "exact_match_rate": self.answers.exact_match_rate,
                "length_ratio": self.answers.length_ratio,
                "per_request": [{"line": p.line, "request": p.request, "a": p.a, "b": p.b,
                                 "match": p.match} for p in self.answers.pairs],
            }
        return out

    def _header(self) -> str:
        skipped = sum(s.count for s in self.skipped)
        head = (f"\nreplay of {self.file}: replayed {self.requests} of {self.lines} lines; "
                f"skipped {skipped}")
        return head + (": " + ", ".join(s.text for s in self.skipped) if skipped else "")

    def _outcome_lines(self) -> list[str]:
        if not self.outcomes or not self.endpoints:
            return []
        lines = ["  same outcome as recorded: " + ", ".join(
            f"{label} {n}/{of}" for label, n, of in self.same_outcome())]
        differ = [o for o in self.outcomes if o.differs]
        if not differ:
            return lines
        shown = differ[:OUTCOME_ROWS]
        more = f" (the first {len(shown)})" if len(differ) > len(shown) else ""
        lines.append(f"  outcome differs from the recording for {len(differ)} of "
                     f"{len(self.outcomes)} requests{more}:")
        width = max(16, *(len(e) + 2 for e in self.endpoints))
        lines.append("    " + f"{'line':>6}  {'api':<10} {'recorded':<{width}}" + "".join(
            f"{e:<{width}}" for e in self.endpoints).rstrip())
        for o in shown:
            cells = "".join(f"{'(not sent)' if x is None else x.text:<{width}}"
                            for x in o.endpoints)
            lines.append("    " + f"{o.line:>6}  {o.api:<10} {o.recorded.text:<{width}}"
                         + cells.rstrip())
        return lines

    def render(self) -> str:
        """The lines the terminal report gets after its tables."""
        lines = [self._header(), *self._outcome_lines()]
        for c in self.costs:
            cost = ("no price table (--prices or --config)" if c.cost_usd is None else
                    f"${c.cost_usd:.6f} for {c.requests} answered requests, "
                    f"${_num(c.cost_per_1k_requests_usd, '.4f')} per 1k requests")
            if c.unpriced_models:
                cost += f" (no price for: {', '.join(c.unpriced_models)})"
            lines.append(f"  cost {c.endpoint}: {cost}")
        if self.answers is not None:
            rate = self.answers.exact_match_rate
            lines.append(f"  answers: {len(self.answers.pairs)} pairs, exact match "
                         f"{_num(None if rate is None else rate * 100, '.1f')}%, "
                         f"length ratio (B/A, characters) "
                         f"{_num(self.answers.length_ratio, '.3f')}")
        return "\n".join(lines)

    def page_answers(self) -> list[dict[str, str]]:
        """A sample for the HTML page: the differing pairs first, then the others."""
        if self.answers is None:
            return []
        pairs = sorted(self.answers.pairs, key=lambda p: (p.match, p.line))[:PAGE_SAMPLE]
        return [{"request": p.request, "a": p.a, "b": p.b} for p in pairs]
