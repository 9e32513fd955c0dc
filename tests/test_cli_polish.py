"""The small things a newcomer meets first (issue 32, item 9): `tokenmeter --version`, the
human-readable log of `serve --log-format text`, and `mock-upstream --help` naming the
per-request headers the simulated upstream honours. Real processes, as tests/test_cli.py runs
them."""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import subprocess
import sys
from pathlib import Path

from proxy.testing.mock_settings import SCENARIO_HEADER, override_headers
from proxy.testing.mock_upstream import generated_text


def tokenmeter(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "proxy.cli", *args], capture_output=True,
                          text=True, timeout=60, check=False, env={**os.environ, **(env or {})})


def test_version_is_the_installed_packages() -> None:
    done = tokenmeter("--version")
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"tokenmeter {importlib.metadata.version('tokenmeter')}\n"


def test_log_format_text_writes_lines_for_people(tmp_path: Path) -> None:
    done = tokenmeter("demo", "--once", "--port", "0", "--log-format", "text",
                      env={"TOKENMETER_STATE_DIR": str(tmp_path)})
    assert done.returncode == 0, done.stderr
    assert generated_text(64) in done.stdout
    lines = done.stderr.splitlines()
    assert lines and not [line for line in lines if line.startswith("{")]
    stamp = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}"
    (access,) = [line for line in lines if "tokenmeter.access:" in line]
    assert re.fullmatch(
        stamp + r" INFO +tokenmeter\.access: request request_id=\w+ operation=chat user=default"
        r" model=mock-gpt .* status=200 error_class=none stream=true .* output_tokens=64 .*"
        r" token_source=reported .*", access), access
    assert "fallback_from=" not in access  # a field without a value is left out
    assert any(re.match(stamp + r" WARNING +tokenmeter: tokenmeter is OPEN", line)
               for line in lines)


def test_log_format_json_stays_the_default(tmp_path: Path) -> None:
    done = tokenmeter("demo", "--once", "--port", "0", env={"TOKENMETER_STATE_DIR": str(tmp_path)})
    assert done.returncode == 0, done.stderr
    objects = [json.loads(line) for line in done.stderr.splitlines()]  # every line is JSON
    assert [o for o in objects if o.get("event") == "request"]


def test_mock_upstream_help_lists_the_headers_it_honours() -> None:
    done = tokenmeter("mock-upstream", "--help")
    assert done.returncode == 0, done.stderr
    listed = re.findall(r"^\s+(x-mock-[a-z0-9-]+)\s+\S", done.stdout, re.MULTILINE)
    assert listed == [header for header, _ in override_headers()] + [SCENARIO_HEADER]
    assert re.search(r"^\s+x-mock-status\s+status$", done.stdout, re.MULTILINE)


def test_demo_screen_keeps_the_answer_the_log_line_and_the_metrics_apart(tmp_path: Path) -> None:
    """stdout and stderr as a terminal shows them, in one pipe: the streamed text whole on its
    own line, the request's access-log line under its heading, then the metrics."""
    done = subprocess.run(
        [sys.executable, "-m", "proxy.cli", "demo", "--once", "--port", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=60, check=False,
        env={**os.environ, "TOKENMETER_STATE_DIR": str(tmp_path)},
    )
    assert done.returncode == 0, done.stdout
    lines = [line for line in done.stdout.splitlines() if line]
    answer = lines.index("--- the streamed answer ---")
    log_line = lines.index("--- its access-log line (stderr) ---")
    metrics = next(i for i, line in enumerate(lines) if line.startswith("--- metrics: curl "))
    assert answer < log_line < metrics
    assert lines[answer + 1:log_line] == [generated_text(64)]
    (access,) = lines[log_line + 1:metrics]
    assert json.loads(access)["event"] == "request"
    assert any(line.startswith("  tokenmeter_requests_total{") for line in lines[metrics:])
