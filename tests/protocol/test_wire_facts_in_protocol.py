"""The facts of the APIs' wire formats live in proxy/protocol (its codecs): no module outside
it names a chunk's `choices`, a delta or a content block, and the wings (cache, capture,
ledger) cannot import the SSE parser or the readers (pyproject.toml's `forbidden` contract,
run here as CI runs it). The simulated upstream and bench's client stay apart on purpose: they
must not share the code they test and measure."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).parents[2]
PROXY = ROOT / "proxy"
# The spellings a wire format's reader looks for (as `grep '"delta"\\|"choices"\\|content_block'`).
_WIRE = re.compile(r'"delta"|"choices"|content_block')
_APART = ("protocol/", "testing/", "bench/client.py")


def test_no_module_outside_protocol_knows_the_wire_formats() -> None:
    found = [
        f"{path.relative_to(ROOT)}:{n}"
        for path in sorted(PROXY.rglob("*.py"))
        if not path.relative_to(PROXY).as_posix().startswith(_APART)
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if _WIRE.search(line)
    ]
    assert found == []
    # The check sees what it looks for: the codecs are full of it.
    assert _WIRE.search((PROXY / "protocol" / "apis" / "chat.py").read_text())


def test_the_wings_are_kept_from_the_sse_parser_and_the_readers() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    (contract,) = [c for c in config["tool"]["importlinter"]["contracts"]
                   if c["type"] == "forbidden"]
    assert set(contract["source_modules"]) >= {"proxy.cache", "proxy.capture", "proxy.ledger"}
    assert set(contract["forbidden_modules"]) >= {"proxy.protocol.sse", "proxy.protocol.readers"}
    lint = Path(sys.executable).parent / "lint-imports"
    result = subprocess.run([str(lint)], cwd=ROOT, capture_output=True, text=True, timeout=120,
                            check=False)
    assert result.returncode == 0, result.stdout
    assert f"{contract['name']} KEPT" in result.stdout
