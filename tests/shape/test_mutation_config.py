"""setup.cfg's [mutmut] section against the tree. mutmut copies the source paths, tests/,
setup.cfg, pyproject.toml and what `also_copy` names into mutants/ and runs the selected tests
there: a module to mutate that moved, a selection that collects nothing, or a unit test reading a
folder mutmut does not copy breaks every run ("failed to collect stats"). These tests read the
section the way mutmut 3.8 does and fail first."""

from __future__ import annotations

import ast
import tomllib
from collections.abc import Iterator
from configparser import ConfigParser
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"
# What mutmut 3.8 copies into mutants/ whatever the configuration says (besides source_paths).
ALWAYS_COPIED = frozenset({"tests", "setup.cfg", "pyproject.toml"})


def _option(name: str) -> list[str]:
    """A list option of the section, split as mutmut splits it: by lines when there are several."""
    parser = ConfigParser()
    parser.read(ROOT / "setup.cfg")
    value = parser.get("mutmut", name, fallback="")
    if "\n" in value:
        return [line for line in value.split("\n") if line]
    return [value] if value else []


def _ignored() -> list[Path]:
    prefix = "--ignore="
    return [ROOT / arg[len(prefix):] for arg in _option("pytest_add_cli_args")
            if arg.startswith(prefix)]


def _parse(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), str(path))


def _is_unit(tree: ast.Module) -> bool:
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets):
            return "pytest.mark.unit" in ast.unparse(node.value)
    return False


def _unit_modules() -> Iterator[tuple[Path, ast.Module]]:
    """The unit test modules mutmut runs: marked `unit`, under no ignored path."""
    ignored = _ignored()
    for path in sorted(TESTS.rglob("test_*.py")):
        if "node_modules" in path.parts or any(path.is_relative_to(i) for i in ignored):
            continue
        tree = _parse(path)
        if _is_unit(tree):
            yield path, tree


def _imported_modules(tree: ast.Module) -> set[str]:
    """Every module a tree imports, `from a.b import c` counting as both a.b and a.b.c."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module is not None:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def _path_parts_read(tree: ast.Module) -> set[str]:
    """The first component of every string joined onto a path with `/` (`ROOT / "docs"`)."""
    parts: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
            for side in (node.left, node.right):
                if isinstance(side, ast.Constant) and isinstance(side.value, str):
                    parts.add(side.value.split("/")[0])
    return parts


def test_setup_cfg_is_the_configuration_mutmut_reads() -> None:
    """mutmut reads pyproject.toml's [tool.mutmut] instead when there is one."""
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "mutmut" not in pyproject.get("tool", {})
    assert _option("source_paths") == ["proxy"]


def test_every_module_to_mutate_is_a_file_of_the_source_paths() -> None:
    sources = [ROOT / p for p in _option("source_paths")]
    only = _option("only_mutate")
    assert only
    for name in only:
        path = ROOT / name
        assert name.endswith(".py") and path.is_file(), name
        assert any(path.is_relative_to(s) for s in sources), name


def test_every_module_to_mutate_is_imported_by_a_unit_test() -> None:
    """A module no unit test imports has every mutant survive."""
    imported = set().union(*(_imported_modules(tree) for _, tree in _unit_modules()))
    for name in _option("only_mutate"):
        module = name.removesuffix(".py").replace("/", ".")
        assert module in imported, f"no unit test imports {module}"


def test_the_selection_is_the_unit_layer_and_its_paths_exist() -> None:
    selection = _option("pytest_add_cli_args_test_selection")
    assert selection[-2:] == ["-m", "unit"]
    paths = selection[:-2]
    assert paths and all((ROOT / p).is_dir() for p in paths), paths
    assert all(p.exists() for p in _ignored())
    # Every unit module is selected, and there are some.
    units = [path for path, _ in _unit_modules()]
    assert units
    assert all(any(u.is_relative_to(ROOT / p) for p in paths) for u in units)


def test_every_folder_of_tests_is_a_package() -> None:
    """Test modules of the same name in two folders (tests/budget/test_store.py and
    tests/cache/test_store.py) import as two modules only inside packages."""
    for path in TESTS.rglob("test_*.py"):
        if "node_modules" not in path.parts:
            assert (path.parent / "__init__.py").is_file(), path.parent


def test_what_the_unit_tests_read_beside_the_package_is_copied() -> None:
    """Every folder or file at the top of the repository that a unit test, a conftest or a
    helper module they import reads (`ROOT / "benchmarks"`) is one mutmut copies."""
    top = {p.name for p in ROOT.iterdir() if not p.name.startswith(".")}
    copied = ALWAYS_COPIED | set(_option("source_paths")) | set(_option("also_copy"))
    trees = [tree for _, tree in _unit_modules()]
    trees += [_parse(p) for p in TESTS.rglob("conftest.py") if "node_modules" not in p.parts]
    seen: set[Path] = set()
    for tree in trees:  # the helpers appended below are walked too, for what they import
        for module in _imported_modules(tree):
            helper = ROOT / (module.replace(".", "/") + ".py")
            if module.startswith("tests.") and helper.is_file() and helper not in seen:
                seen.add(helper)
                trees.append(_parse(helper))
    read = set().union(*(_path_parts_read(tree) for tree in trees)) & top
    assert read - copied == set(), f"add to also_copy in setup.cfg: {sorted(read - copied)}"
    assert all((ROOT / p).exists() for p in _option("also_copy"))
