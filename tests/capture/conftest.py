from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.books import pg_admin


@pytest.fixture(params=["sqlite", "postgresql"])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A fresh database of either kind: an SQLite file, or a PostgreSQL database made (and
    dropped) for this test on the machine's server."""
    if request.param == "sqlite":
        yield f"sqlite://{tmp_path / 'captures.sqlite3'}"
        return
    name = f"tm_capture_{uuid.uuid4().hex[:12]}"
    asyncio.run(pg_admin(f'CREATE DATABASE "{name}"'))
    try:
        yield f"postgresql://postgres@127.0.0.1:5432/{name}"
    finally:
        asyncio.run(pg_admin(f'DROP DATABASE "{name}" WITH (FORCE)'))
