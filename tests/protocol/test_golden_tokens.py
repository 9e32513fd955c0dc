"""The proxy's prompt estimate against prompt counts that OpenAI's API itself reported.

Source: the OpenAI Cookbook, "How to count tokens with tiktoken", section 6 ("Counting tokens for
chat completions API calls"), the cell that sends `example_messages` to each model with
max_tokens=1 and prints `response.usage.prompt_tokens`:
https://github.com/openai/openai-cookbook/blob/main/examples/How_to_count_tokens_with_tiktoken.ipynb
(also https://cookbook.openai.com/examples/how_to_count_tokens_with_tiktoken; read at commit
c81359cdc6744f001e40c08a192604c5113fdab3). The counts below are the lines "N prompt tokens
counted by the OpenAI API." of that cell's stored output, not this proxy's arithmetic.
"""

from __future__ import annotations

from typing import Any

import pytest

from proxy.protocol.tokenizer import count_messages

pytestmark = pytest.mark.unit

# The cookbook's example_messages, verbatim: a system message, then few-shot examples given as
# system messages with a `name`, then the user's message.
EXAMPLE_MESSAGES: list[dict[str, Any]] = [
    {
        "role": "system",
        "content": "You are a helpful, pattern-following assistant that translates corporate "
                   "jargon into plain English.",
    },
    {
        "role": "system",
        "name": "example_user",
        "content": "New synergies will help drive top-line growth.",
    },
    {
        "role": "system",
        "name": "example_assistant",
        "content": "Things working well together will increase revenue.",
    },
    {
        "role": "system",
        "name": "example_user",
        "content": "Let's circle back when we have more bandwidth to touch base on opportunities "
                   "for increased leverage.",
    },
    {
        "role": "system",
        "name": "example_assistant",
        "content": "Let's talk later when we're less busy about how to do better.",
    },
    {
        "role": "user",
        "content": "This late pivot means we don't have time to boil the ocean for the client "
                   "deliverable.",
    },
]

# model -> prompt_tokens the OpenAI API reported for EXAMPLE_MESSAGES.
API_REPORTED = {
    "gpt-3.5-turbo": 129,  # cl100k_base
    "gpt-4-0613": 129,  # cl100k_base
    "gpt-4": 129,  # cl100k_base
    "gpt-4o": 124,  # o200k_base
    "gpt-4o-mini": 124,  # o200k_base
}


@pytest.mark.parametrize(("model", "reported"), sorted(API_REPORTED.items()))
def test_prompt_estimate_equals_what_the_api_reported(model: str, reported: int) -> None:
    assert count_messages(model, EXAMPLE_MESSAGES) == reported


def test_the_name_field_is_what_the_counts_differ_by() -> None:
    """Guards the fixture itself: without the `name` fields (each costs its text plus one token)
    the estimate must drop, so the golden cases really exercise name handling."""
    unnamed = [{k: v for k, v in m.items() if k != "name"} for m in EXAMPLE_MESSAGES]
    for model, reported in API_REPORTED.items():
        assert count_messages(model, unnamed) < reported
