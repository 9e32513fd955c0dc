"""Offline token counting with tiktoken.

tiktoken fetches its BPE files over the network on first use; a gateway must not depend on that.
We take the files from the `bpe-openai` wheel (it ships o200k_base and cl100k_base gzipped), check
them against the sha256 hashes tiktoken itself publishes in `tiktoken_ext/openai_public.py`, and
build the `tiktoken.Encoding` directly. We only read that package's data files: its compiled
module is never imported.
"""

from __future__ import annotations

import base64
import functools
import gzip
import hashlib
import importlib.util
from collections.abc import Iterable
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


def count_text(model: str, text: str) -> int:
    if not text:
        return 0
    enc = get_encoding(encoding_name_for_model(model))
    # disallowed_special=() : user text containing "<|endoftext|>" is counted as plain text,
    # exactly as the upstream bills it, instead of raising.
    return len(enc.encode(text, disallowed_special=()))


def count_texts(model: str, texts: Iterable[str]) -> int:
    texts = [t for t in texts if t]
    if not texts:
        return 0
    enc = get_encoding(encoding_name_for_model(model))
    # Not encode_batch: it builds a thread pool per call (~0.4 ms), 200x a short encode.
    return sum(len(enc.encode(t, disallowed_special=())) for t in texts)


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


def count_messages(model: str, messages: Iterable[Any]) -> int:
    """Estimate the prompt tokens of a chat `messages` list (or Responses `input` items)."""
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
        for call in message.get("tool_calls") or ():
            if isinstance(call, dict):
                fn = call.get("function") or {}
                if isinstance(fn, dict):
                    texts.extend(
                        v for v in (fn.get("name"), fn.get("arguments")) if isinstance(v, str)
                    )
    return framing + count_texts(model, texts)
