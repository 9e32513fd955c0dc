"""Offline token counting with tiktoken.

tiktoken fetches its BPE files over the network on first use; a gateway must not depend on that.
We take the files from the `bpe-openai` wheel (it ships o200k_base and cl100k_base gzipped), check
them against the sha256 hashes tiktoken itself publishes in `tiktoken_ext/openai_public.py`, and
build the `tiktoken.Encoding` directly. We only read that package's data files: its compiled
module is never imported.

The proxy's counts are bounded (`count_texts`, `count_messages`): a prompt can be 32 MB, and
tiktoken's speed varies fifteen-fold with what the text is, so past a budget of characters the
count becomes an estimate from a random sample. `count_text` is exact, for tools and tests.
"""

from __future__ import annotations

import base64
import bisect
import functools
import gzip
import hashlib
import importlib.util
import itertools
import random
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tiktoken

ENDOFTEXT = "<|endoftext|>"
ENDOFPROMPT = "<|endofprompt|>"


@dataclass(frozen=True, slots=True)
class _EncodingSpec:
    sha256: str
    pat_str: str
    special_tokens: dict[str, int]


# Hashes and patterns as published by tiktoken (tiktoken_ext/openai_public.py).
_SPECS: dict[str, _EncodingSpec] = {
    "cl100k_base": _EncodingSpec(
        sha256="223921b76ee99bde995b7ff738513eef100fb51d18c93597a113bcffe865b2a7",
        pat_str=r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++[\r\n]*+|\s++$|\s*[\r\n]|\s+(?!\S)|\s""",  # noqa: E501
        special_tokens={
            ENDOFTEXT: 100257,
            "<|fim_prefix|>": 100258,
            "<|fim_middle|>": 100259,
            "<|fim_suffix|>": 100260,
            ENDOFPROMPT: 100276,
        },
    ),
    "o200k_base": _EncodingSpec(
        sha256="446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d",
        pat_str="|".join(
            [
                r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
                r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
                r"""\p{N}{1,3}""",
                r""" ?[^\s\p{L}\p{N}]+[\r\n/]*""",
                r"""\s*[\r\n]+""",
                r"""\s+(?!\S)""",
                r"""\s+""",
            ]
        ),
        special_tokens={ENDOFTEXT: 199999, ENDOFPROMPT: 200018},
    ),
}

# Model name prefixes that use cl100k_base; everything else (gpt-4o, o-series, gpt-4.1, gpt-5 and
# unknown open models) is counted with o200k_base, the encoding of every current OpenAI model.
_CL100K_PREFIXES = ("gpt-4-", "gpt-3.5", "gpt-35", "text-embedding-3", "text-embedding-ada")
_CL100K_EXACT = frozenset({"gpt-4", "gpt-4-32k"})


class EncodingUnavailable(RuntimeError):
    """The bundled BPE file is missing or does not match tiktoken's published hash."""


def encoding_name_for_model(model: str) -> str:
    name = model.rsplit("/", 1)[-1].lower()
    if name.startswith("gpt-4o"):
        return "o200k_base"
    if name in _CL100K_EXACT or name.startswith(_CL100K_PREFIXES):
        return "cl100k_base"
    return "o200k_base"


def _data_dir() -> Path:
    # find_spec on a top-level package locates it without executing its __init__ (which would load
    # a 70 MB native extension we do not need).
    spec = importlib.util.find_spec("bpe_openai")
    if spec is None or not spec.submodule_search_locations:
        raise EncodingUnavailable("package bpe-openai (carrier of the BPE files) is not installed")
    return Path(next(iter(spec.submodule_search_locations))) / "data"


def load_ranks(name: str, data: bytes | None = None) -> dict[bytes, int]:
    """Parse a `.tiktoken` file after checking it against tiktoken's published sha256."""
    spec = _SPECS.get(name)
    if spec is None:
        raise EncodingUnavailable(f"unknown encoding {name!r}")
    if data is None:
        path = _data_dir() / f"{name}.tiktoken.gz"
        try:
            data = gzip.decompress(path.read_bytes())
        except OSError as exc:
            raise EncodingUnavailable(f"cannot read {path}: {exc}") from exc
    digest = hashlib.sha256(data).hexdigest()
    if digest != spec.sha256:
        raise EncodingUnavailable(
            f"{name}: sha256 {digest} does not match tiktoken's published {spec.sha256}"
        )
    ranks: dict[bytes, int] = {}
    for line in data.splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


@functools.cache
def get_encoding(name: str) -> tiktoken.Encoding:
    spec = _SPECS.get(name)
    if spec is None:
        raise EncodingUnavailable(f"unknown encoding {name!r}")
    return tiktoken.Encoding(
        name=name,
        pat_str=spec.pat_str,
        mergeable_ranks=load_ranks(name),
        special_tokens=spec.special_tokens,
    )


def preload() -> None:
    for name in _SPECS:
        get_encoding(name)


def _encoded_len(enc: tiktoken.Encoding, text: str) -> int:
    try:
        # disallowed_special=() : user text containing "<|endoftext|>" is counted as plain text,
        # exactly as the upstream bills it, instead of raising.
        return len(enc.encode(text, disallowed_special=()))
    except ValueError:
        # tiktoken's regex gives up on some long runs (o200k: "Max stack size exceeded" on about
        # a megabyte of spaces): count the halves, off by at most a token or so per cut.
        if len(text) < 2:
            return len(text)
        half = len(text) // 2
        return _encoded_len(enc, text[:half]) + _encoded_len(enc, text[half:])


def count_text(model: str, text: str) -> int:
    """The exact count (unbounded: for tools and tests; the proxy counts with `count_texts`)."""
    if not text:
        return 0
    return _encoded_len(get_encoding(encoding_name_for_model(model)), text)


# What one count may tokenise. tiktoken's cost is linear in the text, but its rate ranges from
# about 0.1 us a character (prose) to 1.5 us (runs of one character such as spaces or `!`, CJK,
# emoji), measured with tiktoken 0.14 on a 2-core VM: 5 MB of `!` took 6 s. Off the loop (a
# prompt, the output of an answer without usage) a count tokenises at most PROMPT_BUDGET
# characters, about 0.2 s at the slowest rate; on the loop (a stream's output folded as it
# runs, once per 256 KiB of events) LOOP_BUDGET, about 0.1 s at the slowest rate (an upstream
# sending long runs of one character per event), and exact for the events of real streams (a
# few tokens each: text is a tenth to a quarter of their bytes, counted in 5-30 ms).
PROMPT_BUDGET = 128 * 1024
LOOP_BUDGET = 64 * 1024
# Past the budget, this many windows of budget/_WINDOWS characters (1 KiB for a prompt) are
# counted, one starting at random in each _WINDOWS-th of the text, and the whole is rated at
# their tokens per character. Each text also costs a tiktoken call (about 2.4 us, what 2
# characters cost at the slowest rate): many small texts count against the budget too.
_WINDOWS = 128
_CALL_CHARS = 2
_SNAP = 32  # how far a window's start moves to reach a space
_SPACE = re.compile(r"\s")
_SAMPLER = random.Random()  # random, not fixed, places: a client cannot aim its text at them


def _count(enc: tiktoken.Encoding, texts: list[str], budget: int) -> int:
    total = sum(map(len, texts))
    if total + _CALL_CHARS * len(texts) <= budget:
        return sum(_encoded_len(enc, t) for t in texts)
    return _sampled(enc, texts, total, budget)


def _sampled(enc: tiktoken.Encoding, texts: list[str], total: int, budget: int) -> int:
    """An estimate of the tokens of `texts`, tokenising at most about `budget` characters.

    Its error, measured over 20 estimates each (tokens per character of o200k, texts of 0.3 to
    2 MB): prose, code, JSON, CJK or a run of one character are within 2% (on average +0.3%,
    a window ending inside a word counts a token more); this project's sources with CJK text
    in one half within 1%; 20 KB stretches of `!` alternating with code within 8%, either way.
    The worst case is text whose kinds alternate in stretches no window happens to land in."""
    width = max(budget // _WINDOWS, 1)
    ends = list(itertools.accumulate(map(len, texts)))
    stride = total / _WINDOWS
    tokens = chars = 0
    for window in range(_WINDOWS):
        # Anywhere in its stretch, even if it then runs into the next: every character is as
        # likely to be counted as any other, so the rate is not skewed to some part of the text.
        pos = min(int((window + _SAMPLER.random()) * stride), total - 1)
        index = bisect.bisect_right(ends, pos)
        spent = 0
        while spent < width and index < len(texts):
            text = texts[index]
            start = pos - (ends[index] - len(text))  # 0 but for the window's first text
            if start:
                # Begin at a space, where tokens begin, or else at the next text, rather than
                # inside a word: a cut word counts a token more.
                space = _SPACE.search(text, start, start + _SNAP)
                if space is not None:
                    start = space.start()
                elif len(text) - start <= _SNAP:
                    start = len(text)
            piece = text[start : start + width - spent]
            if piece:
                tokens += _encoded_len(enc, piece)
                chars += len(piece)
                spent += len(piece) + _CALL_CHARS
            pos = ends[index]
            index += 1
    return round(tokens * total / chars) if chars else 0


def count_texts(model: str, texts: Iterable[str], budget: int = PROMPT_BUDGET) -> int:
    """The tokens of `texts`: exact up to `budget` characters, estimated from a sample past it
    (see `_sampled`)."""
    texts = [t for t in texts if t]
    if not texts:
        return 0
    # Not encode_batch: it builds a thread pool per call (~0.4 ms), 200x a short encode.
    return _count(get_encoding(encoding_name_for_model(model)), texts, budget)


# OpenAI's documented chat framing: every message costs 3 tokens, a name 1 more, and the reply is
# primed with 3. Close enough for an estimate; reported usage always wins when present.
_TOKENS_PER_MESSAGE = 3
_TOKENS_REPLY_PRIMER = 3


def _content_texts(content: Any) -> list[str]:
    if isinstance(content, str):
        return [content]
    out: list[str] = []
    if isinstance(content, list):
        for part in content:
            if isinstance(part, str):
                out.append(part)
            elif isinstance(part, dict):
                text = part.get("text") or part.get("input_text") or part.get("output_text")
                if isinstance(text, str):
                    out.append(text)
    return out


def count_messages(model: str, messages: Sequence[Any], extra: Iterable[str] = ()) -> int:
    """Estimate the prompt tokens of a chat `messages` list (or Responses `input` items), and
    of the `extra` texts of the prompt (instructions, a system prompt), in one bounded count."""
    texts: list[str] = []
    framing = _TOKENS_REPLY_PRIMER
    for message in messages:
        if not isinstance(message, dict):
            if isinstance(message, str):
                texts.append(message)
                framing += _TOKENS_PER_MESSAGE
            continue
        framing += _TOKENS_PER_MESSAGE
        for key in ("role", "name"):
            value = message.get(key)
            if isinstance(value, str):
                texts.append(value)
        if message.get("name"):
            framing += 1
        texts.extend(_content_texts(message.get("content")))
        calls = message.get("tool_calls")
        for call in calls if isinstance(calls, list) else ():  # the client's JSON: any type
            if isinstance(call, dict):
                fn = call.get("function") or {}
                if isinstance(fn, dict):
                    texts.extend(
                        v for v in (fn.get("name"), fn.get("arguments")) if isinstance(v, str)
                    )
    texts.extend(extra)
    return framing + count_texts(model, texts)
