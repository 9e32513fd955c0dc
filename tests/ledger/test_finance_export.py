"""`tokenmeter usage` exports for finance, against golden files (tests/ledger/golden/): CSV and
JSON say their period, time zone, price version and rounding, mark the total line (or leave it
out: `--no-total`), round to cents half up (`--round cents`); a period that ends before it
starts and a tag key the configuration does not declare are errors, not empty reports. Rows in
a real SQLite ledger written by the proxy's own sink, the command run as a user runs it.

TOKENMETER_UPDATE_GOLDEN=1 rewrites the golden files from the output (then read the diff)."""

from __future__ import annotations

import os
from datetime import UTC, datetime
from pathlib import Path

import pytest
import yaml

from proxy.cli import main
from proxy.config.load import parse_config
from proxy.cost import price_version
from tests.books import ledger_row, write_sqlite
from tests.helpers import config_data

GOLDEN = Path(__file__).parent / "golden"
NOON = datetime(2026, 11, 2, 12, tzinfo=UTC).timestamp()
ROWS = [
    # 0.125 USD: half up makes it 0.13 (half even would make it 0.12).
    ledger_row("a", NOON, user_name="alice", team="platform", cost_nanousd=125_000_000),
    ledger_row("b", NOON + 60, user_name="bob", team="platform", cost_nanousd=2_994_999_999),
    ledger_row("c", NOON + 120, user_name="carol", team="search", cost_nanousd=1_004_999_999,
               tags='{"feature":"faq"}'),
]
NOVEMBER = ("--from", "2026-11-01", "--to", "2026-11-30")


@pytest.fixture
def config(tmp_path: Path) -> Path:
    ledger = tmp_path / "books.sqlite3"
    write_sqlite(ledger, ROWS)
    data = config_data("http://127.0.0.1:9", extra={
        "timezone": "Europe/Berlin",
        "ledger": {"url": f"sqlite:///{ledger}"},
        "prices": {"mock-gpt": {"input": 2.5, "output": 10.0}},
        "tags": {"feature": {"values": ["faq", "search"]}},
    })
    path = tmp_path / "tm.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def usage(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(["usage", *args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def golden(name: str, text: str) -> None:
    path = GOLDEN / name
    if os.environ.get("TOKENMETER_UPDATE_GOLDEN") == "1":
        path.write_text(text)
    assert text == path.read_text(), f"{name} differs from its golden file"


@pytest.mark.parametrize(("name", "options"), [
    ("usage_team_user_exact.csv", ("--by", "team,user", "--format", "csv")),
    ("usage_team_user_cents.csv", ("--by", "team,user", "--format", "csv", "--round", "cents")),
    ("usage_team_cents_no_total.csv", ("--by", "team", "--format", "csv", "--round", "cents",
                                       "--no-total")),
    ("usage_user_exact.json", ("--by", "user", "--format", "json")),
    ("usage_feature_cents.json", ("--by", "tag:feature", "--format", "json", "--round",
                                  "cents")),
    ("usage_user_cents_no_total.json", ("--by", "user", "--format", "json", "--round", "cents",
                                        "--no-total")),
])
def test_exports_match_their_golden_files(config: Path, capsys: pytest.CaptureFixture[str],
                                          name: str, options: tuple[str, ...]) -> None:
    code, out, err = usage(capsys, "--config", str(config), *NOVEMBER, *options)
    assert code == 0, err
    golden(name, out)


def test_the_price_version_is_the_one_the_proxy_records(config: Path,
                                                        capsys: pytest.CaptureFixture[str]
                                                        ) -> None:
    """The golden files' `price_version` is the fingerprint each ledger row carries: finance
    can tell the rows priced by another table."""
    prices = parse_config(config.read_text(), str(config)).prices
    assert f"\"price_version\": \"{price_version(prices)}\"" in (
        GOLDEN / "usage_user_exact.json").read_text()


def test_a_period_ending_before_it_starts_is_an_error(config: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = usage(capsys, "--config", str(config), "--from", "2026-11-30", "--to",
                           "2026-11-01", "--format", "csv")
    assert code == 2 and out == ""
    assert "--to 2026-11-01 is before --from 2026-11-30" in err


def test_an_undeclared_tag_key_is_an_error(config: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = usage(capsys, "--config", str(config), *NOVEMBER, "--by", "tag:featur",
                           "--format", "json")
    assert code == 2 and out == ""
    assert "no tag key 'featur'" in err and "declares feature" in err
