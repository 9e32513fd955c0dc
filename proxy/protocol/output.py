"""The estimate of a stream's output tokens: one estimator and one sampler for every API shape.

A reader (`proxy.protocol.readers`) hands the estimator each content event raw, as it came, and
a function that finds the output texts in a list of its shape's events. Nothing is parsed until
an estimate is asked for, so most answers are never parsed at all (their usage comes from the
upstream). Past `HOLD_BYTES` the held events are counted in one batch and dropped (`fold`), so
the memory of a stream stays bounded however long it runs.

Counting costs about as much per event as the rest of the hot path does. Where the count is
likely wasted (the upstream was asked to report the usage: only a broken stream needs the
estimate) or asked for again and again (`so_far`, the top-ups of a running stream), a random
sample of one event in `SAMPLE` is counted and rates the rest: one token or so per event, steady
over a stream. Random, not every nth: a stream with a period of its own would skew that. An
event longer than the stream's shortest by more than `WHOLE_PAST` bytes is never left to the
sample: it is counted whole. So the rate is that of events alike in size, and a stream of
uneven events (15 of one token, then one of 585) cannot hide its large ones from a sample that
missed them; a large event costs its count, which its size pays for anyway.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable

from proxy.protocol import tokenizer

# Raw content events held per stream before they are counted and dropped: about 1,000 chunks of
# OpenAI's, and no stream ever holds more than this.
HOLD_BYTES = 256 * 1024

SAMPLE = 16  # one event in this many rates the rest
# An event whose data is longer than the stream's shortest content event by more than this is
# counted whole, not sampled: some 16 tokens of text or more beyond the shortest.
WHOLE_PAST = 64

_SAMPLER = random.Random()  # picks the events that rate the rest

# The output texts in a list of one API shape's content events.
Texts = Callable[[list[bytes]], Iterable[str]]


class _Rate:
    """The tokens per event of a random sample of events, as the sample grows: the one
    sampler of a fold and of `so_far`."""

    __slots__ = ("events", "tokens")

    def __init__(self) -> None:
        self.events = 0
        self.tokens = 0

    def add(self, events: list[bytes], k: int, model: str, texts: Texts) -> None:
        """Count `k` of `events`, picked at random. On the loop, in the relay: a count bounded
        for the loop (see tokenizer.LOOP_BUDGET)."""
        sample = _SAMPLER.sample(events, k)
        self.events += k
        self.tokens += tokenizer.count_texts(model, texts(sample), tokenizer.LOOP_BUDGET)


def _uneven(events: list[bytes], shortest: int) -> tuple[list[bytes], list[bytes]]:
    """`events` split into those to sample and those to count whole (longer than `shortest`
    by more than `WHOLE_PAST`). Two scans at C speed when, as nearly always, none is long."""
    bound = shortest + WHOLE_PAST
    if max(map(len, events)) <= bound:
        return events, []
    return [e for e in events if len(e) <= bound], [e for e in events if len(e) > bound]


class OutputEstimate:
    """The content events of one stream, held for an estimate of its output tokens."""

    __slots__ = ("_fold_rate", "_folded", "_held", "_model", "_rate", "_rated", "_sampled",
                 "_seen_at", "_seen_list", "_seen_rated", "_seen_whole", "_shortest", "_texts",
                 "events")
    # `so_far`'s running count, set by its first call (whose held list is never the None the
    # count starts from): how far into the list it has looked, and its sample of the events
    # seen, kept across folds.
    _seen_at: int
    _seen_rated: int  # of the held events seen, those the sample rates
    _seen_whole: int  # and the tokens of those counted whole

    def __init__(self, model: str, texts: Texts, *, sampled: bool) -> None:
        """`texts`: the output texts of the shape's events. `sampled`: the upstream was asked
        to report the usage, so a fold counts a sample of the events (see the module's note)."""
        self._model = model
        self._texts = texts
        self._sampled = sampled
        self.events: list[bytes] = []  # the raw content events held
        self._held = 0  # their bytes
        self._folded = 0  # the tokens of the events dropped by a fold that counted them whole
        self._rated = 0  # the events dropped by a fold that counted a sample of them
        self._fold_rate = _Rate()  # those folds' samples
        self._seen_list: list[bytes] | None = None  # the held list `so_far` last looked at
        self._rate = _Rate()
        self._shortest = HOLD_BYTES  # the shortest content event's data, of those looked at

    def hold(self, data: bytes) -> None:
        """Keep one content event."""
        self.events.append(data)
        self._held += len(data)
        if self._held > HOLD_BYTES:
            self.fold()

    def hold_run(self, events: list[bytes], size: int) -> None:
        """Keep a run of content events, `size` bytes of data in all."""
        self.events += events
        self._held += size
        if self._held > HOLD_BYTES:
            self.fold()

    def fold(self) -> None:
        """Drop the held events, keeping what an estimate needs: their tokens, counted text by
        text as `tokens` does, or a sample's rate (see the module's note)."""
        events = self.events
        if self._sampled and events:
            rated, whole = self._uneven(events)
            if whole:
                self._folded += tokenizer.count_texts(self._model, self._texts(whole),
                                                      tokenizer.LOOP_BUDGET)
            if rated:
                self._fold_rate.add(rated, -(-len(rated) // SAMPLE), self._model, self._texts)
                self._rated += len(rated)
        elif not self._sampled:
            self._folded += tokenizer.count_texts(self._model, self._texts(events),
                                                  tokenizer.LOOP_BUDGET)
        self.events = []
        self._held = 0

    def _uneven(self, events: list[bytes]) -> tuple[list[bytes], list[bytes]]:
        """`_uneven` against the shortest event this stream has shown so far."""
        self._shortest = min(self._shortest, *map(len, events))
        return _uneven(events, self._shortest)

    def folded_tokens(self) -> int:
        """The tokens of the events dropped so far."""
        rated = 0
        if self._fold_rate.events:
            rated = round(self._rated * self._fold_rate.tokens / self._fold_rate.events)
        return self._folded + rated

    def tokens(self, answer: Iterable[str] | None = None) -> int:
        """The output tokens: those folded and the held events' (or, for an answer that was not
        streamed, its texts), counted whole. Bounded (see `tokenizer.PROMPT_BUDGET`), but up to
        a fifth of a second: off the loop."""
        texts = self._texts(self.events) if answer is None else answer
        return self.folded_tokens() + tokenizer.count_texts(self._model, texts)

    def so_far(self) -> int:
        """The output tokens streamed so far: the held events rated at the tokens per event of a
        random sample of one in `SAMPLE` (as a fold rates a stream whose usage will be
        reported), plus what was folded. A caller may ask every few events (the `estimate`
        policy's top-ups) and pays for the new ones only."""
        events = self.events
        if events is not self._seen_list:  # folded since: those are in `folded_tokens`
            self._seen_list, self._seen_at = events, 0
            self._seen_rated = self._seen_whole = 0
        if len(events) > self._seen_at:
            rated, whole = self._uneven(events[self._seen_at:])
            if whole:
                self._seen_whole += tokenizer.count_texts(self._model, self._texts(whole),
                                                          tokenizer.LOOP_BUDGET)
            k, part = divmod(len(rated), SAMPLE)
            if part and _SAMPLER.random() * SAMPLE < part:
                k += 1
            if rated and not self._rate.events:
                k = max(k, 1)
            if k:
                self._rate.add(rated, k, self._model, self._texts)
            self._seen_rated += len(rated)
            self._seen_at = len(events)
        held = self._seen_whole
        if self._rate.events:
            held += -(-self._seen_rated * self._rate.tokens // self._rate.events)  # rounded up
        return self.folded_tokens() + held
