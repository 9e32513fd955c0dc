"""The ledger's, reconcile's and capture's alert rules (deploy/prometheus/rules/ledger.rules.yml).

- `promtool check rules` and the rules' unit tests (`promtool test rules`), which show every
  alert firing and staying quiet, and a healthy, an idle and a ledger-off replica quiet.
- Every metric, label and `stage` value the rules and their unit tests name is one that
  proxy/telemetry/metrics.py really exports (read from its registry, not from a list here).
- A real Prometheus loads the rules from deploy/prometheus/prometheus.yml and scrapes two
  exporters built on the real `Metrics`: one driven through an outage (every alert goes pending
  or fires), one freshly started (tokenmeter_ledger_up still 0: no alert at all).
"""

from __future__ import annotations

import asyncio
import re
import shutil
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from aiohttp import web
from aiohttp.test_utils import TestServer
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from proxy.telemetry.families import CaptureDrop, LedgerStage, ReconcileFailure
from proxy.telemetry.metrics import Metrics
from tests.helpers import ROOT, ServerFactory
from tests.servers import Prometheus, running_prometheus

PROM_DIR = ROOT / "deploy" / "prometheus"
PROM_CONFIG = PROM_DIR / "prometheus.yml"
RULES = PROM_DIR / "rules" / "ledger.rules.yml"
RULES_TEST = PROM_DIR / "rules" / "ledger.rules.test.yml"

ALERTS = frozenset({
    "TokenmeterLedgerDown", "TokenmeterLedgerSpoolGrowing", "TokenmeterLedgerLagging",
    "TokenmeterLedgerRowsDropped", "TokenmeterLedgerRetentionFailing",
    "TokenmeterReconcileDrift", "TokenmeterReconcileOrphans", "TokenmeterReconcileFailing",
    "TokenmeterCapturesDropped",
})
# Labels Prometheus adds to every scraped series; the rest must come from the exporter.
TARGET_LABELS = frozenset({"job", "instance"})
_METRIC = re.compile(r"(?<![:\w])(tokenmeter_\w+)(?![:\w])")
_STAGE = re.compile(r'stage\s*(=~|!~|!=|=)\s*"([^"]*)"')
_SERIES = re.compile(r"^(?P<name>\w+)\{(?P<labels>[^}]*)\}$")


def load_yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text(encoding="utf-8"))


def promtool(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("promtool")
    assert exe, "promtool is not installed (Debian package `prometheus`; .ci/run installs it)"
    return subprocess.run(
        [exe, *args], capture_output=True, text=True, timeout=60, cwd=cwd, check=False
    )


def rules() -> list[dict[str, Any]]:
    return [r for g in load_yaml(RULES)["groups"] for r in g["rules"]]


def alerts() -> dict[str, dict[str, Any]]:
    return {r["alert"]: r for r in rules() if "alert" in r}


# ------------------------------------------------------------------------------ promtool


def test_promtool_check_rules() -> None:
    r = promtool("check", "rules", str(RULES))
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"SUCCESS: {len(rules())} rules found" in r.stdout


def test_promtool_rule_unit_tests() -> None:
    r = promtool("test", "rules", RULES_TEST.name, cwd=RULES_TEST.parent)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS" in r.stdout + r.stderr


def test_every_alert_is_unit_tested_and_annotated() -> None:
    found = alerts()
    assert set(found) == ALERTS
    for name, rule in found.items():
        assert rule["labels"]["severity"] in {"warning", "critical"}, name
        assert rule["annotations"]["summary"] and rule["annotations"]["description"], name
    # Losing rows is the one thing here that cannot be undone.
    assert found["TokenmeterLedgerRowsDropped"]["labels"]["severity"] == "critical"
    # tokenmeter_ledger_up starts at 0 and stays there with the ledger off: never alone.
    down = found["TokenmeterLedgerDown"]["expr"]
    assert "tokenmeter_ledger_up == 0" in down and " and " in down

    tests = load_yaml(RULES_TEST)
    assert tests["rule_files"] == [RULES.name]
    fired: set[str] = set()
    quiet: set[str] = set()
    for case in tests["tests"]:
        for t in case.get("alert_rule_test", []):
            (fired if t.get("exp_alerts") else quiet).add(t["alertname"])
    assert fired == ALERTS, "every alert must be shown firing"
    assert quiet == ALERTS, "and every alert must be shown not firing"
    healthy = next(c for c in tests["tests"] if c["name"] == "healthy")
    assert {t["alertname"] for t in healthy["alert_rule_test"]} == ALERTS
    assert all(t["exp_alerts"] == [] for t in healthy["alert_rule_test"])


def test_prometheus_loads_the_ledger_rules() -> None:
    """The compose Prometheus reads both rule files (it mounts the whole rules directory)."""
    files = load_yaml(PROM_CONFIG)["rule_files"]
    assert "rules/ledger.rules.yml" in files and "rules/tokenmeter.rules.yml" in files
    assert all((PROM_DIR / f).is_file() for f in files)
    compose = load_yaml(ROOT / "deploy" / "docker-compose.yml")
    mounts = compose["services"]["prometheus"]["volumes"]
    assert "./prometheus/rules:/etc/prometheus/rules:ro" in mounts


# ------------------------------------------------- the names are the exporter's names


def exported() -> dict[str, frozenset[str]]:
    """Sample name -> label names, from a real `Metrics` with every ledger verb called once
    (labelled series exist only once a label value has been used)."""
    m = Metrics()
    m.ledger.ledger_stored("postgresql", 3, 0.01)
    m.ledger.ledger_pending(5, 512, 1.5)
    for stage in LedgerStage:
        m.ledger_failed(stage)
    m.ledger_dropped(1)
    m.reconciled({"daily_tokens": 0}, 0)
    for failure in ReconcileFailure:
        m.reconcile_failed(failure)
    m.captured(1, 100)
    for reason in CaptureDrop:
        m.capture_dropped(reason)
    text = generate_latest(m.registry).decode()
    out: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, set()).update(k for k in s.labels if k != "le")
    return {name: frozenset(labels) for name, labels in out.items()}


def test_rules_and_their_tests_use_exported_names_labels_and_stages() -> None:
    names = exported()
    stages = {s.value for s in LedgerStage}
    for rule in rules():
        used = set(_METRIC.findall(rule["expr"]))
        assert used, rule["alert"]
        unknown = used - set(names)
        assert not unknown, f"{rule['alert']}: not exported by proxy/telemetry/metrics.py: {unknown}"
        for op, value in _STAGE.findall(rule["expr"]):
            alternatives = value.split("|") if op in ("=~", "!~") else [value]
            assert set(alternatives) <= stages, f"{rule['alert']}: stage {value} not in LedgerStage"

    seen: set[str] = set()
    for case in load_yaml(RULES_TEST)["tests"]:
        for series in case["input_series"]:
            m = _SERIES.match(series["series"])
            assert m, series["series"]
            name = m["name"]
            labels = dict(re.findall(r'(\w+)="([^"]*)"', m["labels"]))
            seen.add(name)
            assert name in names, f"{name}: not exported by proxy/telemetry/metrics.py"
            extra = set(labels) - TARGET_LABELS - names[name]
            assert not extra, f"{series['series']}: labels {extra} are not exported"
            assert set(labels) >= TARGET_LABELS
            if "stage" in labels:
                assert labels["stage"] in stages
    # The unit tests feed every series the rules read.
    read = {n for r in rules() for n in _METRIC.findall(r["expr"])}
    assert read <= seen


# ----------------------------------------------------- a real Prometheus, the real exporter




@dataclass
class Outage:
    """An exporter whose replica lives through a database outage: every scrape sees the spool
    grown, another failed batch, another row dropped, another failed retention run."""

    metrics: Metrics
    scrapes: int = 0

    def advance(self) -> None:
        self.scrapes += 1
        n = self.scrapes
        self.metrics.ledger_failed(LedgerStage.CONNECT)
        self.metrics.ledger_failed(LedgerStage.SHIP)
        self.metrics.ledger.ledger_pending(rows=100 * n, spool_bytes=40_000 * n, oldest_age_s=1000 + n)
        self.metrics.ledger_dropped(1)
        self.metrics.ledger_failed(LedgerStage.RETENTION)
        self.metrics.reconciled({"daily_tokens": 120, "monthly_tokens": 0}, 3)
        self.metrics.reconcile_failed(ReconcileFailure.LEDGER)
        self.metrics.capture_dropped(CaptureDrop.QUEUE_FULL)


async def exporter(aiohttp_server: ServerFactory, metrics: Metrics, on_scrape: Any) -> TestServer:
    async def handler(_: web.Request) -> web.Response:
        on_scrape()
        return web.Response(body=generate_latest(metrics.registry),
                            content_type="text/plain", charset="utf-8")

    app = web.Application()
    app.router.add_get("/metrics", handler)
    server: TestServer = await aiohttp_server(app)
    return server


def prometheus_config(targets: list[str]) -> dict[str, Any]:
    """deploy/prometheus/prometheus.yml, fast, with its rule files (as absolute paths) and its
    tokenmeter job pointed at `targets`."""
    config: dict[str, Any] = load_yaml(PROM_CONFIG)
    config["global"].update(scrape_interval="1s", scrape_timeout="1s", evaluation_interval="1s")
    config["rule_files"] = [str(PROM_DIR / f) for f in config["rule_files"]]
    job = next(j for j in config["scrape_configs"] if j["job_name"] == "tokenmeter")
    job.pop("dns_sd_configs")
    job["static_configs"] = [{"targets": targets}]
    config["scrape_configs"] = [job]
    return config


@pytest.fixture
async def outage_and_idle(aiohttp_server: ServerFactory) -> tuple[TestServer, TestServer]:
    outage = Outage(Metrics())
    bad = await exporter(aiohttp_server, outage.metrics, outage.advance)
    # Freshly started (or the ledger off): nothing called, the gauges at their initial 0.
    idle = await exporter(aiohttp_server, Metrics(), lambda: None)
    return bad, idle


@pytest.fixture
async def prometheus(
    outage_and_idle: tuple[TestServer, TestServer], tmp_path: Path
) -> AsyncIterator[Prometheus]:
    async with running_prometheus(prometheus_config(
        [f"127.0.0.1:{s.port}" for s in outage_and_idle]
    ), tmp_path) as prom:
        yield prom


def active(alerts_data: dict[str, Any]) -> Iterator[tuple[str, str, str]]:
    for a in alerts_data["alerts"]:
        yield a["labels"]["alertname"], a["labels"].get("instance", ""), a["state"]


async def test_alerts_go_off_in_a_real_prometheus_on_the_real_exporter(
    outage_and_idle: tuple[TestServer, TestServer], prometheus: Prometheus
) -> None:
    bad, idle = (f"127.0.0.1:{s.port}" for s in outage_and_idle)
    # Each alert leaves "inactive" as soon as its expression holds (pending for its `for`,
    # or firing at once): that is the sync point with scrapes and evaluations.
    deadline = time.monotonic() + 30
    while True:
        # Only the ledger's: tokenmeter.rules.yml is loaded too, and a bare `Metrics` has
        # tokenmeter_store_up at 0 (the app sets it), which its TokenmeterStoreDown reads.
        states = [s for s in active(await prometheus.get("/api/v1/alerts")) if s[0] in ALERTS]
        on_bad = {name for name, instance, _ in states if instance == bad}
        if on_bad >= ALERTS:
            break
        assert time.monotonic() < deadline, (
            f"not active within 30 s: {sorted(ALERTS - on_bad)}\n{states}\n{prometheus.log_tail()}"
        )
        await asyncio.sleep(0.25)
    # The rules without a `for` fire at once; the others wait, as written.
    firing = {name for name, instance, state in states if instance == bad and state == "firing"}
    assert firing == {a for a, r in alerts().items() if r["for"] in ("0m", "0s")}
    # The idle replica was scraped and evaluated as often, and nothing went off for it.
    assert not [s for s in states if s[1] == idle], states
    up = await prometheus.get(f'/api/v1/query?query=tokenmeter_ledger_up{{instance="{idle}"}}')
    assert [r["value"][1] for r in up["result"]] == ["0"]

    groups = (await prometheus.get("/api/v1/rules"))["groups"]
    ledger_groups = {g["name"] for g in load_yaml(RULES)["groups"]}
    assert ledger_groups <= {g["name"] for g in groups}
    health = {r["name"]: r["health"] for g in groups for r in g["rules"]
              if g["name"] in ledger_groups}
    assert set(health) == ALERTS and set(health.values()) == {"ok"}, health
