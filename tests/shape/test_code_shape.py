"""The request path's code stays readable: no function in `pipeline/`, `budget/` or `protocol/`
(the path of one request, its admission, and what is sent and read on the wire) is over 60 lines
or takes more than 5 parameters (issue 21). A function that needs more takes a value that groups
them."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import proxy

pytestmark = pytest.mark.unit

PACKAGES = ("pipeline", "budget", "protocol")
MAX_LINES = 60
MAX_PARAMETERS = 5  # `self` and `cls` not counted


def _functions() -> list[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    root = Path(proxy.__file__).parent
    found = []
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    found.append((f"{path.relative_to(root.parent)}:{node.lineno}", node))
    return found


def _parameters(node: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
    a = node.args
    names = [x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs)]
    names += [x.arg for x in (a.vararg, a.kwarg) if x is not None]
    return [n for n in names if n not in ("self", "cls")]


@pytest.mark.timeout(30)
def test_no_function_of_the_request_path_is_long_or_takes_many_parameters() -> None:
    functions = _functions()
    assert len(functions) > 100  # the walk found the packages
    too_big = [
        f"{where} {node.name}: {node.end_lineno - node.lineno + 1} lines, "  # type: ignore[operator]
        f"{len(_parameters(node))} parameters"
        for where, node in functions
        if node.end_lineno - node.lineno + 1 > MAX_LINES  # type: ignore[operator]
        or len(_parameters(node)) > MAX_PARAMETERS
    ]
    assert too_big == []
