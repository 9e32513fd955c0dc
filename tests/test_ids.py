"""proxy.ids: unique, time-ordered, UUID-hex-shaped ids."""

from __future__ import annotations

import os
import re

import pytest

from proxy.ids import new_id

pytestmark = pytest.mark.unit


def test_ids_are_unique_ordered_and_shaped_like_a_uuid_hex() -> None:
    ids = [new_id() for _ in range(100_000)]
    assert len(set(ids)) == len(ids)
    assert all(re.fullmatch(r"[0-9a-f]{32}", i) for i in ids[:1000])
    assert ids == sorted(ids)  # time first: the ledger's index is appended to


def test_a_forked_child_draws_its_own_node() -> None:
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report an id and exit at once
        os.write(write, new_id().encode())
        os._exit(0)
    os.close(write)
    child = os.read(read, 64).decode()
    os.close(read)
    os.waitpid(pid, 0)
    assert child[-12:] != new_id()[-12:]
