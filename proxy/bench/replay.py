"""`tokenmeter bench --replay FILE.jsonl` (or `--replay-captures`, straight from the capture
store): recorded requests as the load, and what the run
says about them beyond speed: the cost per target from a price table, and (with --compare)
how the two targets' answers to the same requests compare.

The file is docs/capture.md's export line, read by the one parser of that line
(proxy/protocol/export_line.py), the one `mock-upstream --replay` reads too.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from proxy.bench.stats import RequestResult
from proxy.bench.workload import Prompt, message_text
from proxy.capture.cli import exported
from proxy.capture.store import CaptureFilter
from proxy.config.load import ConfigError, load_config
from proxy.config.policy import Price
from proxy.cost import NANOS_PER_USD, CostLines, price_for
from proxy.ledger.pg import mask_url
from proxy.protocol.export_line import Recording, ReplayFileError, parse_line, read_lines
from proxy.protocol.tokenizer import count_text
from proxy.protocol.usage import Usage

REQUEST_CHARS = 2_000  # of a request's text in the answers' listing
PAGE_SAMPLE = 20  # answer pairs on the HTML page


class ReplayError(ValueError):
    """A replay file or price table that cannot be used; the message names the file."""


def _prompt(rec: Recording, model: str) -> Prompt:
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
                  stream=body.get("stream") is True, line=rec.line)


def load_replay(path: str, route: str, tokenizer_model: str) -> list[Prompt]:
    """The requests of `route` in the export file, in the file's order."""
    try:
        found = read_lines(Path(path))
    except ReplayFileError as exc:
        raise ReplayError(f"--replay {path}: {exc}") from None
    return _prompts(found, route, tokenizer_model, f"--replay {path}")


def load_captures(url: str, filters: CaptureFilter, redact: Callable[[str], str],
                  route: str, tokenizer_model: str) -> list[Prompt]:
    """`--replay-captures`: the requests of `route` among the captures `filters` chooses,
    oldest first: the lines `tokenmeter captures export` would write, read as a file of them
    is (one conversion, proxy.protocol.export_line's)."""
    lines, _ = exported(url, filters, redact)
    try:
        found = [parse_line(json.dumps(line), n) for n, line in enumerate(lines, 1)]
    except ReplayFileError as exc:
        raise ReplayError(f"--replay-captures: capture {exc}") from None
    return _prompts(found, route, tokenizer_model, f"--replay-captures ({shown_url(url)})")


def shown_url(url: str) -> str:
    """A store's URL as printed: a PostgreSQL password masked."""
    return url if url.startswith("sqlite") else mask_url(url)


def _prompts(found: list[Recording], route: str, tokenizer_model: str,
             source: str) -> list[Prompt]:
    prompts = [_prompt(r, tokenizer_model) for r in found if r.path == route]
    if not prompts:
        raise ReplayError(f"{source}: no recorded request to {route}")
    return prompts


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
class ReplayReport:
    file: str
    requests: int  # recorded requests replayed (of the file's route)
    costs: tuple[TargetCost, ...]
    answers: AnswerComparison | None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "file": self.file, "requests": self.requests,
            "cost": [vars(c) | {"unpriced_models": list(c.unpriced_models)} for c in self.costs],
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

    def render(self) -> str:
        """The lines the terminal report gets after its tables."""
        lines = [f"\nreplay of {self.file}: {self.requests} recorded requests"]
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
