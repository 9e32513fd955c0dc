"""The layers of docs/architecture.md hold.

`lint-imports` (.ci/run) checks pyproject.toml's layers contract: nothing imports from a layer
above its own or from an independent sibling. These tests keep that contract honest: every
package of proxy is in one of its layers (a new package cannot slip past it), the document
draws the same order, no two packages import each other, however indirectly, and no module
imports itself through others (a file circle)."""

from __future__ import annotations

import tomllib
from itertools import combinations
from pathlib import Path

import grimp
import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]


def _layers() -> list[str]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    (contract,) = [c for c in config["tool"]["importlinter"]["contracts"]
                   if c["type"] == "layers"]
    layers: list[str] = contract["layers"]
    return layers


def test_every_package_and_module_of_proxy_is_in_a_layer() -> None:
    named = {name.strip() for layer in _layers() for name in layer.split("|")}
    top = ROOT / "proxy"
    packages = {p.name for p in top.iterdir() if (p / "__init__.py").is_file()}
    modules = {p.stem for p in top.glob("*.py") if p.stem != "__init__"}
    assert named == packages | modules


def test_the_architecture_document_draws_the_contract() -> None:
    doc = (ROOT / "docs" / "architecture.md").read_text()
    drawn = "\n".join(f"    {layer}" for layer in _layers())
    assert drawn in doc, f"docs/architecture.md should list the layers as:\n{drawn}"


def test_no_two_packages_import_each_other() -> None:
    graph = grimp.build_graph("proxy", cache_dir=None)
    children = sorted(graph.find_children("proxy"))
    both_ways = [
        (a, b) for a, b in combinations(children, 2)
        if graph.chain_exists(a, b, as_packages=True) and graph.chain_exists(b, a, as_packages=True)
    ]
    assert both_ways == []


def test_no_module_imports_itself_through_others() -> None:
    graph = grimp.build_graph("proxy", cache_dir=None)
    circles = sorted(
        (module, imported) for module in graph.modules
        for imported in graph.find_modules_directly_imported_by(module)
        if graph.chain_exists(imported, module)
    )
    assert circles == []
