"""`proxy.protocol.memmem.find`: the C library's memmem gives bytes.find's answers."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.protocol import memmem
from proxy.protocol.memmem import find

# A small alphabet makes near-misses and repeats common: the cases a search gets wrong.
_TEXT = st.binary(min_size=0, max_size=6000).map(lambda b: bytes(c % 4 + 34 for c in b))
_MARKS = (b'"finish_reason":"', b'"usage":{', b'"content":""', b"\n\ndata: ")


def test_this_platform_searches_with_memmem() -> None:
    # On Linux (glibc, as CI and the images run) the fast path is the one in use: a fallback
    # taken by mistake would pass every other test here and lose the speed silently.
    assert find is not memmem._bytes_find


@settings(max_examples=400, deadline=None)
@given(_TEXT, st.binary(min_size=0, max_size=5).map(lambda b: bytes(c % 4 + 34 for c in b)),
       st.integers(-7000, 7000), st.integers(-7000, 7000))
def test_find_is_bytes_find(haystack: bytes, needle: bytes, start: int, stop: int) -> None:
    assert find(haystack, needle, start, stop) == haystack.find(needle, start, stop)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from([b'{"delta":{"content":" the"}}', *_MARKS, b"x" * 300]),
                max_size=80),
       st.sampled_from(_MARKS), st.integers(0, 3000), st.integers(0, 30000))
def test_stream_marks_are_found_where_bytes_find_finds_them(
        parts: list[bytes], mark: bytes, start: int, stop: int) -> None:
    chunk = b"".join(parts)
    assert find(chunk, mark, start, stop) == chunk.find(mark, start, stop)
    assert find(chunk, mark, 0, len(chunk)) == chunk.find(mark)


def test_a_match_ending_at_stop_counts_and_one_past_it_does_not() -> None:
    chunk = b"a" * 5000 + b"MARK" + b"b" * 5000
    assert find(chunk, b"MARK", 0, 5004) == 5000
    assert find(chunk, b"MARK", 0, 5003) == -1
    assert find(chunk, b"MARK", 5001, len(chunk)) == -1
