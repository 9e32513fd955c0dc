"""The optional wings observe the request instead of being wired into its path: no function of
the request path (`proxy/pipeline/*.py`: admission, the attempts, the relay, settle and the
observers) is over 40 lines or of cyclomatic complexity over 12, `settle` itself is at most
10, `Outcome` and `Settlement` hold no wing's slot, and `pipeline/` compares no wing's object
with None (a wing that is absent is an observer that is not there)."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

import proxy
from proxy.pipeline.context import Outcome, Settlement

pytestmark = pytest.mark.unit

PIPELINE = Path(proxy.__file__).parent / "pipeline"
MAX_LINES = 40
MAX_COMPLEXITY = 12
MAX_SETTLE_COMPLEXITY = 10
# Names of what a wing would leave in the pipeline: its slot or its object.
WINGS = ("capture", "collect", "trace", "tracing", "span", "cache_fill", "fill")

Function = ast.FunctionDef | ast.AsyncFunctionDef


def _functions() -> list[tuple[str, Function]]:
    found = []
    for path in sorted(PIPELINE.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, Function):
                found.append((f"{path.name}:{node.lineno} {node.name}", node))
    return found


def complexity(function: Function) -> int:
    """McCabe's: 1, plus one per branch (if, loop, except, conditional expression,
    comprehension `if`, match case, assert) and per extra operand of `and`/`or`. A nested
    function counts in its own right, not in its parent's."""
    count = 1
    stack: list[ast.AST] = list(ast.iter_child_nodes(function))
    while stack:
        node = stack.pop()
        if isinstance(node, Function | ast.Lambda | ast.ClassDef):
            continue
        if isinstance(node, ast.If | ast.IfExp | ast.For | ast.AsyncFor | ast.While
                      | ast.ExceptHandler | ast.Assert | ast.match_case):
            count += 1
        elif isinstance(node, ast.BoolOp):
            count += len(node.values) - 1
        elif isinstance(node, ast.comprehension):
            count += 1 + len(node.ifs)
        stack.extend(ast.iter_child_nodes(node))
    return count


def _lines(function: Function) -> int:
    return function.end_lineno - function.lineno + 1  # type: ignore[operator]


@pytest.mark.timeout(30)
def test_the_complexity_count_sees_branches() -> None:
    tree = ast.parse("def f(a, b):\n    if a and b:\n        return [x for x in a if x]\n"
                     "    for y in b:\n        pass\n    return 1 if a else 2\n")
    function = tree.body[0]
    assert isinstance(function, ast.FunctionDef)
    assert complexity(function) == 1 + 1 + 1 + 1 + 1 + 1 + 1  # if, and, for-in, if, for, ifexp


@pytest.mark.timeout(30)
def test_no_function_of_the_request_path_is_long_or_tangled() -> None:
    functions = _functions()
    assert len(functions) > 80  # the walk found the pipeline
    too_big = [f"{where}: {_lines(node)} lines, complexity {complexity(node)}"
               for where, node in functions
               if _lines(node) > MAX_LINES or complexity(node) > MAX_COMPLEXITY]
    assert too_big == []


@pytest.mark.timeout(30)
def test_settle_is_a_charge_then_its_projections() -> None:
    settles = [node for where, node in _functions() if where.startswith("settle.py")
               and node.name == "settle"]
    assert len(settles) == 1
    assert complexity(settles[0]) <= MAX_SETTLE_COMPLEXITY


@pytest.mark.timeout(30)
def test_outcome_and_settlement_hold_no_wing() -> None:
    names = [f.name for f in dataclasses.fields(Settlement)]
    names += [n.lstrip("_") for n in Outcome.__slots__]
    assert "observers" in names  # the wings' one, generic, slot
    assert [n for n in names if any(w in n for w in WINGS)] == []


def _wing_named(node: ast.AST) -> str | None:
    text = ast.unparse(node).lower()
    return next((w for w in WINGS if w in text), None)


def _compared_with_none(node: ast.AST) -> ast.Compare | None:
    if not (isinstance(node, ast.Compare)
            and any(isinstance(op, ast.Is | ast.IsNot) for op in node.ops)
            and any(isinstance(c, ast.Constant) and c.value is None for c in node.comparators)):
        return None
    return node


def _own_nodes(function: Function) -> list[ast.AST]:
    """The function's nodes, a nested function's left to it."""
    nodes, stack = [], list(ast.iter_child_nodes(function))
    while stack:
        node = stack.pop()
        if not isinstance(node, Function):
            nodes.append(node)
            stack.extend(ast.iter_child_nodes(node))
    return nodes


def _factory(function: Function) -> bool:
    """A wing's factory of observers, whose answer for a request it does not want is None:
    the one place that asks whether its wing is there."""
    returns = function.returns
    return returns is not None and "Observer | None" in ast.unparse(returns)


@pytest.mark.timeout(30)
def test_the_pipeline_compares_no_wing_with_none() -> None:
    found, factories = [], 0
    for where, function in _functions():
        if _factory(function):
            factories += 1
            continue
        for node in _own_nodes(function):
            if (compare := _compared_with_none(node)) is not None and (
                    wing := _wing_named(compare.left)) is not None:
                found.append(f"{where}: {ast.unparse(compare)} ({wing})")
    assert factories >= 3  # capture's, tracing's and the cache fill's
    assert found == []
