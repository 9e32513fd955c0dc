"""What a request is charged (`Outcome.charge`, `Settlement.usage`): nothing without an answer
the client could read or a prompt the upstream read, the answer's usage when one was read, and
the prompt alone when the client left while the upstream had the request."""

from __future__ import annotations

import json

import pytest

from proxy.budget.accounting import Budget
from proxy.budget.admission import Ask
from proxy.budget.limits import unlimited
from proxy.budget.notify import Notifier
from proxy.budget.principal import Principal
from proxy.budget.store import MemoryStore
from proxy.config.load import Config
from proxy.errors import ErrorClass
from proxy.pipeline.context import Candidacy, Charge, Outcome
from proxy.protocol.translators import ChatTranslator, parse_body
from proxy.protocol.usage import ZERO
from proxy.routing.upstream import Router
from proxy.telemetry.meter import RequestMeter
from proxy.telemetry.metrics import Metrics
from tests.helpers import ALICE_KEY, MESSAGES, budget_config

pytestmark = pytest.mark.unit

MODEL = "mock-gpt"
REPORTED = {"prompt_tokens": 11, "completion_tokens": 7, "total_tokens": 18}


def _config() -> Config:
    return budget_config("http://127.0.0.1:9/v1", "memory", f'  alice:\n    keys: ["{ALICE_KEY}"]\n')


async def _outcome() -> tuple[Outcome, Candidacy]:
    """An outcome with a candidate reserved by the real budget (an unenforced principal's
    reservation: nothing held in the store), not yet sent."""
    config = _config()
    budget = Budget(MemoryStore(), Metrics(),
                    Notifier(Metrics(), lambda: [], lambda: None, lambda: None))
    principal = Principal("alice", unlimited(config.defaults), enforce=False)
    request = parse_body(json.dumps({"model": MODEL, "messages": MESSAGES}).encode())
    translator = ChatTranslator(request)
    plan = budget.plan(principal, MODEL, config)
    ask = Ask(principal=principal, model=MODEL, plan=plan, prompt_tokens=0, asked_output=16,
              choices=1, stream=False, hidden_output=False)
    reservation = await budget.reserve(ask, config)
    route = Router(config).resolve(MODEL)
    assert route is not None
    outcome = Outcome("r1", "chat", RequestMeter())
    outcome.read(request)
    outcome.authenticated(principal)
    candidacy = Candidacy(route, MODEL, translator, reservation)
    outcome.candidate(candidacy, None)
    return outcome, candidacy


def _answer_body(usage: dict[str, int] | None) -> bytes:
    body: dict[str, object] = {"id": "c", "object": "chat.completion", "model": MODEL, "choices": [
        {"index": 0, "message": {"role": "assistant", "content": "four words of output"},
         "finish_reason": "stop"}]}
    if usage is not None:
        body["usage"] = usage
    return json.dumps(body).encode()


async def test_no_candidate_is_charged_nothing() -> None:
    outcome = Outcome("r0", "chat", RequestMeter())
    outcome.fail(ErrorClass.INVALID_API_KEY, 401)
    done = outcome.finish()
    assert done.charge is Charge.NOTHING and done.candidacy is None
    assert await done.usage() == ZERO
    assert (done.status, done.error_class, done.model) == (401, ErrorClass.INVALID_API_KEY, "")


async def test_an_answer_is_charged_its_reported_usage() -> None:
    outcome, candidacy = await _outcome()
    outcome.sent()
    outcome.answered(200, ErrorClass.NONE)
    candidacy.translator.on_body(_answer_body(REPORTED))
    done = outcome.finish()
    assert done.charge is Charge.ANSWER and done.status == 200
    usage = await done.usage()
    assert (usage.input_tokens, usage.output_tokens, usage.source) == (11, 7, "reported")


async def test_an_answer_without_usage_is_charged_an_estimate_of_it() -> None:
    outcome, candidacy = await _outcome()
    outcome.sent()
    outcome.answered(200, ErrorClass.NONE)
    candidacy.translator.on_body(_answer_body(None))
    usage = await outcome.finish().usage()
    assert usage.source == "estimated"
    assert usage.input_tokens == candidacy.translator.prompt_tokens() > 0
    assert usage.output_tokens > 0


async def test_an_answer_read_in_part_is_charged_though_the_client_left() -> None:
    """The client had part of the answer: its usage is charged, the status stays the
    upstream's and the class says the client left."""
    outcome, candidacy = await _outcome()
    outcome.sent()
    outcome.answered(200, ErrorClass.NONE)
    candidacy.translator.on_body(_answer_body(REPORTED))
    outcome.client_left()
    done = outcome.finish()
    assert done.charge is Charge.ANSWER
    assert (done.status, done.error_class) == (200, ErrorClass.CLIENT_DISCONNECT)
    assert (await done.usage()).output_tokens == 7


async def test_an_error_answer_is_charged_nothing_and_keeps_its_class() -> None:
    outcome, _ = await _outcome()
    outcome.sent()
    outcome.answered(400, ErrorClass.CONTEXT_LENGTH)
    done = outcome.finish()
    assert done.charge is Charge.NOTHING
    assert (done.status, done.error_class) == (400, ErrorClass.CONTEXT_LENGTH)
    assert await done.usage() == ZERO


async def test_a_client_gone_while_the_upstream_had_it_is_charged_its_prompt() -> None:
    for left in (Outcome.client_left, _cut_by_the_proxy):
        outcome, candidacy = await _outcome()
        outcome.sent()
        left(outcome)
        done = outcome.finish()
        assert done.charge is Charge.PROMPT and done.status == 499
        usage = await done.usage()
        assert (usage.output_tokens, usage.source) == (0, "estimated")
        assert usage.input_tokens == candidacy.translator.prompt_tokens() > 0


def _cut_by_the_proxy(outcome: Outcome) -> None:
    """The watchdog cut a client that stopped reading: the finer class stays."""
    outcome.fail(ErrorClass.CLIENT_TIMEOUT)
    outcome.client_left()
    assert outcome.error_class is ErrorClass.CLIENT_TIMEOUT


async def test_a_call_that_never_reached_the_model_is_charged_nothing() -> None:
    """Sent, but the call failed (no answer, the upstream is done with it): the client then
    leaving does not make the prompt chargeable."""
    outcome, _ = await _outcome()
    outcome.sent()
    outcome.call_failed()
    outcome.client_left()
    done = outcome.finish()
    assert done.charge is Charge.NOTHING and await done.usage() == ZERO


async def test_a_released_candidate_is_not_charged_and_counts_as_an_attempt() -> None:
    outcome, _ = await _outcome()
    outcome.sent()
    outcome.retried()
    outcome.released()
    done = outcome.finish()
    assert done.charge is Charge.NOTHING and done.candidacy is None
    assert done.attempts == 3
