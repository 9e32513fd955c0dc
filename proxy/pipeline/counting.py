"""Token counts that may take long, kept off the event loop.

A translator counts a request's tokens with tiktoken when it must: the prompt, for a reservation
that counts it or a charge the upstream did not report; the output of an answer that came
without usage. Each count is bounded (`proxy.protocol.tokenizer.PROMPT_BUDGET`) but a large one
still takes up to a fifth of a second of CPU, which on the loop would stall every other request
of the replica. tiktoken releases the GIL, so in a thread it costs the loop nothing but the hop.
The prompt is counted once and kept on the translator: admission and settle share the count.
"""

from __future__ import annotations

import asyncio

from proxy.protocol.translators import Translator
from proxy.protocol.usage import Usage

# A body up to this size is counted on the loop: its prompt has at most this many characters,
# at most ~6 ms at tiktoken's slowest rate (~0.5 ms for prose), less than a thread's hop
# (0.1-0.3 ms) costs in latency for the common small prompt.
INLINE_PROMPT_BYTES = 4096


async def prompt_tokens(translator: Translator) -> int:
    """The prompt's estimated tokens (counted once, then kept on the translator)."""
    if translator.prompt_counted or len(translator.request.raw) <= INLINE_PROMPT_BYTES:
        return translator.prompt_tokens()
    return await asyncio.to_thread(translator.prompt_tokens)


async def answer_usage(translator: Translator) -> Usage:
    """The usage of an answer read, whole or in part: as reported, else counted in a thread
    (the prompt, if not counted yet, and the output received)."""
    if not translator.counts_usage():
        return translator.usage()
    return await asyncio.to_thread(translator.usage)


async def prompt_usage(translator: Translator) -> Usage:
    """The prompt alone: the charge of a request abandoned while the upstream had it."""
    await prompt_tokens(translator)
    return translator.prompt_usage()
