"""The commands a newcomer runs, as real processes."""

from __future__ import annotations

import json
import subprocess
import sys

from proxy.testing.mock_upstream import generated_text


def test_demo_quickstart_makes_a_metered_streaming_request() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "proxy.cli", "demo", "--once", "--port", "0"],
        capture_output=True, text=True, timeout=60, check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert generated_text(64) in proc.stdout
    assert 'tokenmeter_tokens_total{model="mock-gpt",source="reported",type="output"' in proc.stdout
    lines = [json.loads(x) for x in proc.stderr.splitlines() if x.startswith("{")]
    (access,) = [x for x in lines if x.get("event") == "request"]
    assert access["output_tokens"] == 64 and access["token_source"] == "reported"
    assert access["stream"] is True and access["ttft_ms"] > 0
    assert any("OPEN" in x.get("message", "") for x in lines)  # says loudly it is open
