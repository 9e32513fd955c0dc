"""Every class of `proxy` has a name of its own: a reader who meets `Decision` or `Entry` knows
which one it is without looking at the import (two `Ask`s, two `Entry`s, two `Decision`s and two
`Charge`s each once named different things)."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

import proxy

pytestmark = pytest.mark.unit


@pytest.mark.timeout(30)
def test_no_two_classes_of_proxy_share_a_name() -> None:
    root = Path(proxy.__file__).parent
    where: dict[str, list[str]] = defaultdict(list)
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.ClassDef):
                where[node.name].append(f"{path.relative_to(root.parent)}:{node.lineno}")
    assert len(where) > 100  # the walk found the classes
    assert {name: places for name, places in where.items() if len(places) > 1} == {}
