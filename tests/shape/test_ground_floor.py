"""The ground floor holds: each fact that several wings use is computed in one place below them.

A key's hash and id in `proxy/identity.py`, a store URL's dialect in `proxy/storage/`, the cache's
result as one enum on the request record (`proxy/record.py`); and on that floor the budget and
the books stay independent of each other (only `proxy.reconcile` reads both)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import get_type_hints

import grimp
import pytest

from proxy.record import BypassReason, CacheResult, RequestRecord

pytestmark = pytest.mark.unit

PROXY = Path(__file__).resolve().parents[2] / "proxy"


def _sources_but(*own: str) -> dict[str, str]:
    return {str(p.relative_to(PROXY)): p.read_text(encoding="utf-8")
            for p in sorted(PROXY.rglob("*.py"))
            if not any(str(p.relative_to(PROXY)).startswith(o) for o in own)}


def _hits(pattern: str, *own: str) -> list[str]:
    found = re.compile(pattern)
    return [f"{name}:{n}" for name, text in _sources_but(*own).items()
            for n, line in enumerate(text.splitlines(), 1) if found.search(line)]


def test_a_key_hash_and_a_key_id_are_read_only_by_identity() -> None:
    # The `sha256:` form of a key taken apart (its id) or recognised anywhere but identity.py
    # is a second definition of what a key id is.
    assert _hits(r"""(removeprefix|startswith)\(\s*["']sha256:""", "identity.py") == []


def test_a_store_urls_dialect_is_read_only_by_storage() -> None:
    assert _hits(r"""startswith\(\s*["'](postgres|sqlite)""", "storage/") == []


def test_the_records_cache_result_is_the_enum() -> None:
    hints = get_type_hints(RequestRecord)
    assert hints["cache"] is CacheResult
    assert hints["cache_reason"] == BypassReason | None


def test_budget_and_ledger_import_nothing_of_each_other() -> None:
    graph = grimp.build_graph("proxy", cache_dir=None)
    assert not graph.chain_exists("proxy.ledger", "proxy.budget", as_packages=True)
    assert not graph.chain_exists("proxy.budget", "proxy.ledger", as_packages=True)
