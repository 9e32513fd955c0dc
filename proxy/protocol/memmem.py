"""`find`: `bytes.find` done by the C library's `memmem` where the process has one.

Why. A fast upstream's stream reaches the relay coalesced: a read of 256 content events is
about 70 KB, and `readers.take_content_run` scans it once per mark that ends a run of plain
content (five marks). CPython's `bytes.find` takes 17-33 us for each such scan; glibc's
`memmem` (a search by two-byte hashes) 5-10 us (timeit, on the 68 KB body of the benchmarks'
256-token stream, `benchmarks/bench_scaling.stream_body`). py-spy of a serving process under
coalesced streams: the run's scans went from 19% of its samples to 5%.

Same answers: the offset of the first occurrence of `needle` in `haystack[start:stop]`, or -1,
exactly as `bytes.find`; `tests/protocol/test_memmem.py` holds the two equal. Where `memmem`
cannot be loaded (no such symbol, a C library ctypes cannot open), `find` is `bytes.find`.
Short haystacks go to `bytes.find` as well: below a few hundred bytes the foreign call costs
more than it saves.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable

# Below this many bytes to search, `bytes.find` is as fast as the call into C.
_MIN_C = 1024

Find = Callable[[bytes, bytes, int, int], int]


def _bytes_find(haystack: bytes, needle: bytes, start: int, stop: int) -> int:
    return haystack.find(needle, start, stop)


def _c_find() -> Find | None:
    try:
        memmem = ctypes.CDLL(None).memmem  # the C library this process already runs on
    except (OSError, AttributeError, TypeError):  # (Windows: no handle of the process itself)
        return None
    memmem.restype = ctypes.c_void_p
    memmem.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p, ctypes.c_size_t)
    as_pointer = ctypes.c_char_p
    as_address = ctypes.c_void_p

    def find(haystack: bytes, needle: bytes, start: int, stop: int) -> int:
        stop = min(stop, len(haystack))
        # (Negative bounds count from the end, an empty needle is found at `start`: left to
        # bytes.find, whose rules they are.)
        if start < 0 or stop - start < _MIN_C or not needle:
            return haystack.find(needle, start, stop)
        # A c_char_p of a bytes object points at its buffer (no copy); `haystack` outlives
        # the call, so the address stays valid.
        base = ctypes.cast(as_pointer(haystack), as_address).value
        if base is None:
            return haystack.find(needle, start, stop)
        at = memmem(base + start, stop - start, needle, len(needle))
        return -1 if at is None else at - base

    return find


find: Find = _c_find() or _bytes_find
