"""Redaction of captured texts: the defaults remove keys, bearer tokens and e-mail addresses; a
text is redacted before it is cut (so a cut never leaves a secret's head), and what comes out
never matches any pattern."""

from __future__ import annotations

import json
import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from proxy.capture.redact import REDACTED, Redactor
from proxy.config.capture import DEFAULT_REDACT

pytestmark = pytest.mark.unit

_DEFAULT = Redactor.of(DEFAULT_REDACT)
_KEY = "sk-proj-" + "Ab3_" * 10


def test_defaults_remove_a_key_a_bearer_token_and_an_email() -> None:
    raw = (f'{{"api_key": "{_KEY}", "auth": "Bearer abc.DEF-123_xyz=", '
           f'"note": "write to jane.doe+x@example.co.uk please"}}').encode()
    body = _DEFAULT.body(raw, max_kb=256)
    assert _KEY not in body.text and "sk-" not in body.text
    assert "abc.DEF-123_xyz" not in body.text
    assert "jane.doe" not in body.text and "example.co.uk" not in body.text
    assert body.text.count(REDACTED) == 3
    assert "please" in body.text and body.size == len(raw) and not body.truncated


def test_an_anthropic_key_and_an_aws_key_id_are_removed() -> None:
    text = _DEFAULT.text("x sk-ant-api03-" + "q" * 40 + " y AKIAABCDEFGHIJKLMNOP z")
    assert text == f"x {REDACTED} y {REDACTED} z"


def test_invalid_utf8_is_decoded_with_replacement_and_size_is_the_raw_length() -> None:
    raw = b"ok \xff\xfe end"
    body = _DEFAULT.body(raw, max_kb=1)
    assert body.text == "ok \ufffd\ufffd end"
    assert body.size == len(raw)


def test_a_long_body_is_cut_at_max_kb_and_marked() -> None:
    raw = ("é" * 3000).encode()  # 6000 bytes; the cut at 1024 falls between two bytes of one é
    body = _DEFAULT.body(raw, max_kb=1)
    assert body.truncated and body.size == 6000
    assert len(body.text.encode()) <= 1024 and set(body.text) == {"é"}


def test_redaction_comes_before_the_cut() -> None:
    # The key straddles the 1 KiB cut: cut first, its head would survive (and match no pattern).
    raw = ("a" * 1010 + " " + _KEY + " " + "t" * 100).encode()
    body = _DEFAULT.body(raw, max_kb=1)
    assert body.truncated and body.size == len(raw)
    assert "sk-" not in body.text and "Ab3_" not in body.text
    assert body.text.startswith("a" * 1010 + " " + REDACTED + " t")


def test_a_pattern_matching_its_own_replacement_terminates() -> None:
    assert "x" in Redactor.of([r"REDACTED", r"secret"]).text("x secret")


_alphabet = st.sampled_from([*"sk-ant-proj-AKIA0123456789abcXYZ_.@~+/= \n\tBearer bearer é",
                             "@example.com", "sk-", "Bearer ", "AKIA", "[REDACTED]"])


@given(st.lists(_alphabet, max_size=120).map("".join), st.integers(1, 2))
def test_output_never_contains_a_match_of_any_default_pattern(text: str, max_kb: int) -> None:
    body = _DEFAULT.body(text.encode(), max_kb)
    for pattern in DEFAULT_REDACT:
        assert re.search(pattern, body.text) is None, (pattern, body.text)


@given(st.text(max_size=3000), st.integers(1, 2))
def test_output_never_matches_for_any_text(text: str, max_kb: int) -> None:
    body = _DEFAULT.body(text.encode("utf-8", errors="surrogatepass"), max_kb)
    assert all(p.search(body.text) is None for p in _DEFAULT.patterns)
    assert len(body.text.encode()) <= max_kb * 1024 or not body.truncated


_PLAIN_EMAIL = re.compile(r"[A-Za-z0-9._%+-]+@[A-Za-z0-9.-]+\.[A-Za-z]{2,}")


@given(st.lists(st.sampled_from([*"ab.-%+_@ 9", ".com", "x@y.io"]), max_size=60)
       .map(lambda parts: "".join(parts)[:64]))
def test_the_default_email_pattern_redacts_as_the_plain_one_does(text: str) -> None:
    # The same, for addresses of a real length (the default's bounds are the RFC's).
    (email,) = (p for p in _DEFAULT.patterns if "@" in p.pattern)
    assert email.sub(REDACTED, text) == _PLAIN_EMAIL.sub(REDACTED, text)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("raw", ["a" * 2**20, "a@" + "b" * 2**20, "x.@" * 2**18])
def test_a_long_run_without_a_match_takes_linear_time(raw: str) -> None:
    # Quadratic, the first would take minutes (~48 s at 256 KiB); linear, milliseconds.
    assert _DEFAULT.text(raw) == raw


def test_a_local_part_past_64_characters_loses_its_last_64_and_the_domain() -> None:
    assert _DEFAULT.text("a" * 70 + "@example.com") == "a" * 6 + REDACTED


_ODD_KEY = 'tm/key"é-0123456789'  # no pattern's shape; `/`, `"` and `é` change under JSON


def test_a_known_key_is_removed_in_every_form_json_gives_it() -> None:
    redactor = _DEFAULT.with_keys([_ODD_KEY, None, "short"])  # "short": too short to be a key
    once = json.dumps(_ODD_KEY)[1:-1]
    texts = [_ODD_KEY, once, json.dumps(_ODD_KEY, ensure_ascii=False)[1:-1],
             once.replace("/", "\\/"), json.dumps(once)[1:-1],
             "".join(f"\\u{ord(c):04x}" for c in _ODD_KEY)]
    for text in texts:
        assert redactor.text(f"a {text} b") == f"a {REDACTED} b", text
    assert redactor.text("short and sweet") == "short and sweet"
    assert _DEFAULT.text(_ODD_KEY) == _ODD_KEY  # a redactor without the key leaves it
    assert redactor.with_keys([_ODD_KEY]) is redactor  # nothing new: the same redactor
    assert "0123456789" not in repr(redactor)  # never shown, even by a repr


def test_spans_merge_what_every_literal_and_pattern_would_remove() -> None:
    redactor = _DEFAULT.with_keys([_ODD_KEY])
    text = f"x {_ODD_KEY}{_KEY} y jane@example.com"
    spans = redactor.spans(text)
    assert [text[a:b] for a, b in spans] == [_ODD_KEY + _KEY, "jane@example.com"]
    assert redactor.spans("nothing here") == []
