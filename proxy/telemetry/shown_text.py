"""Client-chosen text (model names, and whatever else reaches a ledger row) made safe to show:
on an operator's terminal, and in a CSV file a spreadsheet will open.

A model name is the client's to choose, so a report must never let it act: an ESC sequence
would clear or retitle the operator's terminal, a CR or LF would forge report lines, a bidi
override would reorder what is shown, and a cell starting with `=`, `+`, `-` or `@` runs as a
formula in a spreadsheet (OWASP, "CSV Injection"). JSON output needs neither: the encoder
escapes every control character, and nothing evaluates it.
"""

from __future__ import annotations

import unicodedata

# Unicode categories shown escaped: controls (C0, DEL, C1), format characters (bidi overrides,
# zero-width joiners), line and paragraph separators (terminals may break lines on them) and
# lone surrogates (undecodable bytes).
_HIDDEN_CATEGORIES = frozenset({"Cc", "Cf", "Zl", "Zp", "Cs"})
# OWASP's list: a cell starting with one of these is read as a formula (tab and CR too, which
# some spreadsheets skip before looking).
_FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")
_SHORT = {"\t": "\\t", "\n": "\\n", "\r": "\\r", "\\": "\\\\"}


def _escape(ch: str) -> str:
    # A backslash is doubled, so that `\x1b` on screen always means an escaped ESC.
    if (short := _SHORT.get(ch)) is not None:
        return short
    if unicodedata.category(ch) not in _HIDDEN_CATEGORIES:
        return ch
    code = ord(ch)
    if code <= 0xFF:
        return f"\\x{code:02x}"
    if code <= 0xFFFF:
        return f"\\u{code:04x}"
    return f"\\U{code:08x}"


def for_terminal(text: str) -> str:
    """`text` with every invisible or controlling character shown as a Python-style escape
    (`\\x1b`, `\\r`, `\\u202e`) and backslashes doubled: one line, printed as it reads."""
    if text.isprintable() and "\\" not in text:  # the common case: nothing to look at
        return text
    return "".join(_escape(ch) for ch in text)


def csv_cell(text: str) -> str:
    """A text cell of a CSV report: escaped as for the terminal (one physical line per record,
    safe to `cat`), then, when it would start a formula (leading spaces ignored, as some
    spreadsheets do), prefixed with `'`, which spreadsheets show as text and do not display."""
    shown = for_terminal(text)
    if shown.lstrip(" ").startswith(_FORMULA_STARTS):
        return "'" + shown
    return shown
