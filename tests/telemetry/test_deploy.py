"""Deployment artefacts under deploy/ and grafana/.

- Prometheus: `promtool check config` / `check rules`, and the rules' unit tests
  (`promtool test rules`), which show every alert firing and staying quiet.
- A real Prometheus scraping a real proxy in front of the simulated upstream: every PromQL
  expression of the Grafana dashboards runs through its HTTP API, and the rule file loads there.
- Static invariants of the Dockerfile, docker-compose.yml, the compose and Kubernetes proxy
  configs, the Kubernetes manifests and the Grafana provisioning; constraints.txt pins every
  dependency; the compose gateway's nginx template renders to a config `nginx -t` accepts.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import json
import re
import shlex
import shutil
import subprocess
import time
import tomllib
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
import yaml
from aiohttp.test_utils import TestServer
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from yarl import URL

from proxy.config.load import parse_config
from proxy.errors import ErrorClass
from proxy.identity import key_hash
from proxy.server.app import create_app
from proxy.testing.mock_upstream import MockSettings, create_mock_app
from tests.helpers import ROOT
from tests.servers import Prometheus, free_port, running_prometheus, wait_for_port

DEPLOY = ROOT / "deploy"
DOCKERFILE = DEPLOY / "Dockerfile"
COMPOSE = DEPLOY / "docker-compose.yml"
COMPOSE_PROXY_CONFIG = DEPLOY / "compose" / "tokenmeter.yaml"
NGINX_TEMPLATE = DEPLOY / "compose" / "nginx.conf.template"
CONSTRAINTS = ROOT / "constraints.txt"
PROM_CONFIG = DEPLOY / "prometheus" / "prometheus.yml"
RULES = DEPLOY / "prometheus" / "rules" / "tokenmeter.rules.yml"
RULES_TEST = DEPLOY / "prometheus" / "rules" / "tokenmeter.rules.test.yml"
K8S = DEPLOY / "kubernetes"
SECRET_EXAMPLE = K8S / "examples" / "secret.yaml"
GRAFANA = ROOT / "grafana"
DASHBOARD_FILES = ("tokenmeter-overview.json", "tokenmeter-budgets.json", "tokenmeter-latency.json")

ENTRYPOINT = [
    "tokenmeter", "serve", "--config", "/etc/tokenmeter/tokenmeter.yaml",
    "--host", "0.0.0.0", "--port", "8080",
]
# The demo keys deploy/docker-compose.yml and deploy/compose/tokenmeter.yaml document.
ALICE_DEMO_KEY = "sk-alice-demo-key-change-me"
BOB_DEMO_KEY = "sk-bob-demo-key-change-me"

# Metric families the proxy exports (base names: a histogram's _bucket/_count/_sum map here).
EXISTING_METRICS = frozenset({
    "up",
    "gen_ai_server_time_to_first_token_seconds",
    "gen_ai_server_time_per_output_token_seconds",
    "gen_ai_server_request_duration_seconds",
    "tokenmeter_upstream_time_to_first_token_seconds",
    "tokenmeter_proxy_overhead_seconds",
    "tokenmeter_output_tokens_per_second",
    "tokenmeter_inter_chunk_latency_seconds",
    "tokenmeter_tokens_total",
    "tokenmeter_requests_total",
    "tokenmeter_active_requests",
    "tokenmeter_metering_errors_total",
    "tokenmeter_open_mode",
})
# Budget, store, reload and cost metrics: their queries need only be valid PromQL here (the
# proxy runs in open mode with no store, so most of them have no series).
ADDED_METRICS = frozenset({
    "tokenmeter_budget_limit_tokens",
    "tokenmeter_budget_used_tokens",
    "tokenmeter_budget_remaining_tokens",
    "tokenmeter_budget_used_usd",
    "tokenmeter_budget_limit_usd",
    "tokenmeter_team_budget_used_tokens",
    "tokenmeter_team_budget_limit_tokens",
    "tokenmeter_team_budget_used_usd",
    "tokenmeter_team_budget_limit_usd",
    "tokenmeter_budget_refusals_total",
    "tokenmeter_budget_reserved_tokens_total",
    "tokenmeter_budget_overreserved_tokens_total",
    "tokenmeter_store_errors_total",
    "tokenmeter_store_latency_seconds",
    "tokenmeter_store_up",
    "tokenmeter_config_reloads_total",
    "tokenmeter_cost_usd_total",
    "tokenmeter_upstream_retries_total",
    "tokenmeter_fallbacks_total",
    "tokenmeter_settlements_lost_total",
    "tokenmeter_settle_backlog_tokens",
    "tokenmeter_settle_backlog",
    "tokenmeter_settlement_tokens_lost_total",
    "tokenmeter_auth_failures_total",
    "tokenmeter_settle_spool_bad_lines_total",
    # The response cache's (the Cache row; tests/telemetry/test_cache_dashboard.py gives them
    # data).
    "tokenmeter_cache_requests_total",
    "tokenmeter_cache_saved_tokens_total",
    "tokenmeter_cache_saved_cost_usd_total",
    "tokenmeter_cache_hit_ttft_seconds",
    "tokenmeter_tag_tokens_total",
    "tokenmeter_tag_cost_usd_total",
    # One series per configured user (none in open mode; tests/telemetry/test_team_filter.py
    # gives it data).
    "tokenmeter_user_info",
})
# Exported, but with no series until something goes wrong.
MAY_BE_EMPTY = frozenset({"tokenmeter_metering_errors_total"})
# Panels that must show data after a few streaming requests, whatever else changes.
CORE_PANELS = frozenset({
    ("tokenmeter-overview", "Requests / s"),
    ("tokenmeter-overview", "TTFT p95"),
    ("tokenmeter-overview", "Time to first token p50 / p95 / p99"),
    ("tokenmeter-overview", "Input / output tokens per minute by model"),
    ("tokenmeter-overview", "Output tokens / s per stream p50 / p95"),
    ("tokenmeter-overview", "Errors / s by class"),
    # The requests' closed-list tag (a free one never becomes a label).
    ("tokenmeter-overview", "Estimated cost by tag (time range)"),
    ("tokenmeter-overview", "Tokens by tag (time range)"),
    ("tokenmeter-budgets", "Top users by tokens (time range)"),
    ("tokenmeter-latency", "TTFT distribution: $model"),
    ("tokenmeter-latency", "Inter-token latency distribution: $model"),
    ("tokenmeter-latency", "Request duration p50 / p95 / p99 by model"),
    ("tokenmeter-latency", "Proxy overhead p50 / p95 / p99"),
    ("tokenmeter-latency", "Upstream TTFT p50 / p95 by upstream"),
})
GRAFANA_INTERVALS = {"$__rate_interval": "1m", "$__interval": "15s", "$__range": "1h"}
# A metric name: not part of a recording rule's name (colons), `up` only as a selector.
_METRIC = re.compile(r"(?<![:\w])((?:gen_ai|tokenmeter)_\w+|up(?=\s*\{))(?![:\w])")
_HIST_SUFFIX = re.compile(r"_(bucket|count|sum)$")
_LABEL_VALUES = re.compile(r"^label_values\((?P<selector>.+),\s*(?P<label>\w+)\)$")

ServerFactory = Callable[..., Coroutine[Any, Any, TestServer]]


def load_yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text(encoding="utf-8"))


def load_yaml_docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text(encoding="utf-8")) if d]


def promtool(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("promtool")
    assert exe, "promtool is not installed (Debian package `prometheus`; .ci/run installs it)"
    return subprocess.run(
        [exe, *args], capture_output=True, text=True, timeout=60, cwd=cwd, check=False
    )


def metrics_in(expr: str) -> set[str]:
    """Metric (family) names an expression reads, histogram suffixes removed."""
    return {_HIST_SUFFIX.sub("", m.group(1)) for m in _METRIC.finditer(expr)}


# ------------------------------------------------------------------------ dashboards helpers


@dataclass(frozen=True)
class Query:
    dashboard: str
    panel: str
    expr: str  # variables substituted
    heatmap: bool


def dashboards() -> dict[str, dict[str, Any]]:
    return {
        name: json.loads((GRAFANA / "dashboards" / name).read_text(encoding="utf-8"))
        for name in DASHBOARD_FILES
    }


def all_panels(dash: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for panel in dash["panels"]:
        yield panel
        yield from panel.get("panels", [])  # collapsed rows keep theirs inside


def variable_query(var: dict[str, Any]) -> str:
    q = var.get("query")
    return str(q["query"] if isinstance(q, dict) else q)


def substitute(expr: str, variables: list[str]) -> str:
    for macro, value in GRAFANA_INTERVALS.items():
        expr = expr.replace(macro, value)
    for name in variables:
        # Multi-value variables with "All" = ".*" are only correct inside a regex matcher.
        bare = re.sub(rf'=~"\$(?:{name}|\{{{name}\}})"', "", expr)
        assert f"${name}" not in bare and f"${{{name}" not in bare, (
            f"${name} used outside a =~\"...\" matcher: {expr}"
        )
        expr = re.sub(rf"\$(?:{name}\b|\{{{name}\}})", ".*", expr)
    assert "$" not in expr, f"unknown variable in {expr}"
    return expr


def dashboard_queries() -> list[Query]:
    out = []
    for dash in dashboards().values():
        variables = [v["name"] for v in dash["templating"]["list"]]
        for panel in all_panels(dash):
            for target in panel.get("targets", []):
                out.append(Query(
                    dashboard=dash["uid"], panel=panel["title"],
                    expr=substitute(target["expr"], variables),
                    heatmap=target.get("format") == "heatmap",
                ))
        for var in dash["templating"]["list"]:
            m = _LABEL_VALUES.match(variable_query(var))
            assert m, f"{dash['uid']}: variable {var['name']} is not label_values(...)"
            out.append(Query(
                dashboard=dash["uid"], panel=f"variable {var['name']}",
                expr=substitute(m["selector"], variables), heatmap=False,
            ))
    return out


# ------------------------------------------------------------------------------ promtool


def test_promtool_check_config() -> None:
    r = promtool("check", "config", str(PROM_CONFIG))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS" in r.stdout + r.stderr


def test_promtool_check_rules() -> None:
    r = promtool("check", "rules", str(RULES))
    assert r.returncode == 0, r.stdout + r.stderr


def test_promtool_rule_unit_tests() -> None:
    r = promtool("test", "rules", RULES_TEST.name, cwd=RULES_TEST.parent)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS" in r.stdout + r.stderr


def _class_sets(expr: str) -> list[frozenset[str]]:
    return [frozenset(m.split("|")) for m in re.findall(r'error_class=~\\?"([a-z0-9_|]+)\\?"', expr)]


def test_every_error_class_is_the_platforms_or_the_clients_once() -> None:
    """The page counts the proxy's and the upstream's failures only, the client warning the
    client's own 4xx (issue 32: quota 429s and client 400s paged). Every ErrorClass is placed
    on one side deliberately, and the overview's error ratio counts what the page counts."""
    records = {r["record"]: r["expr"] for g in load_yaml(RULES)["groups"] for r in g["rules"]
               if "record" in r}
    (platform,) = _class_sets(records["tokenmeter:request_failures:ratio_rate5m"])
    (client,) = _class_sets(records["tokenmeter:request_client_errors:ratio_rate5m"])
    # Neither: no failure (none), clients gone or too slow to read (client_disconnect,
    # client_timeout), quota refusals (their per-user alert), per-address connection refusals
    # (429; the listener's 503 counts as a 5xx), /metrics without its token (not an API request).
    neither = {"none", "client_disconnect", "client_timeout", "budget_exceeded",
               "too_many_connections", "invalid_token"}
    assert not platform & client and not (platform | client) & neither
    assert platform | client | neither == {c.value for c in ErrorClass}
    assert "budget_exceeded" not in platform | client
    assert {"bad_request", "invalid_request"} <= client
    overview = json.loads((GRAFANA / "dashboards" / "tokenmeter-overview.json").read_text())
    (panel,) = [p for p in overview["panels"] if p.get("title") == "Error ratio (proxy / upstream)"]
    # Twice: the team filter's All branch repeats the term it filters.
    assert _class_sets(panel["targets"][0]["expr"]) == [platform, platform]


def test_every_alert_is_unit_tested_and_annotated() -> None:
    rules = load_yaml(RULES)
    alerts = {r["alert"]: r for g in rules["groups"] for r in g["rules"] if "alert" in r}
    expected = {
        "TokenmeterUserBudgetWarning", "TokenmeterUserBudgetExhausted",
        "TokenmeterHighTimeToFirstToken", "TokenmeterHighErrorRatio", "TokenmeterStoreErrors",
        "TokenmeterStoreDown", "TokenmeterDown", "TokenmeterAbsent",
        "TokenmeterClientErrorsHigh",
    }
    assert expected <= set(alerts)
    for name, rule in alerts.items():
        assert rule["labels"]["severity"] in {"warning", "critical"}, name
        assert rule["annotations"]["summary"] and rule["annotations"]["description"], name
    assert alerts["TokenmeterUserBudgetWarning"]["labels"]["severity"] == "warning"
    # A user at their own quota, or clients' 4xx, are not a page for the platform (issue 32).
    assert alerts["TokenmeterUserBudgetExhausted"]["labels"]["severity"] == "warning"
    assert alerts["TokenmeterClientErrorsHigh"]["labels"]["severity"] == "warning"
    assert 'up{job="tokenmeter"} == 0' in alerts["TokenmeterDown"]["expr"]
    assert 'absent(up{job="tokenmeter"})' in alerts["TokenmeterAbsent"]["expr"]

    tests = load_yaml(RULES_TEST)["tests"]
    fired: set[str] = set()
    quiet: set[str] = set()
    for case in tests:
        for t in case.get("alert_rule_test", []):
            (fired if t.get("exp_alerts") else quiet).add(t["alertname"])
    assert fired == set(alerts), "every alert must be shown firing"
    assert quiet == set(alerts), "and every alert must be shown not firing"
    healthy = next(c for c in tests if c["name"] == "healthy")
    assert {t["alertname"] for t in healthy["alert_rule_test"]} == set(alerts)
    assert all(t["exp_alerts"] == [] for t in healthy["alert_rule_test"])

    # Every metric the rules read is one the proxy exports (or a recording rule).
    recorded = {r["record"] for g in rules["groups"] for r in g["rules"] if "record" in r}
    for g in rules["groups"]:
        for r in g["rules"]:
            unknown = metrics_in(r["expr"]) - EXISTING_METRICS - ADDED_METRICS - recorded
            assert not unknown, f"{r.get('alert') or r.get('record')}: {unknown}"


# ---------------------------------------------------- a real Prometheus, a real proxy




@pytest.fixture
async def metered_proxy(aiohttp_server: ServerFactory) -> TestServer:
    # Paced so that every stream spans several reads even on a loaded box: at 2,000 tok/s its
    # 16 tokens could arrive in one read, leaving no decode phase and the tokens/s histogram
    # without a sample (the dashboards' queries on it then have no data).
    upstream = await aiohttp_server(create_mock_app(
        MockSettings(tokens_per_second=400, ttft_ms=5, output_tokens=16)
    ))
    config = parse_config(f"""
upstreams:
  mock:
    base_url: {upstream.make_url("/v1")}
models:
  - match: "mock-*"
    upstream: mock
metrics:
  model_labels: [mock-gpt]
  discover_models: false
prices:
  "mock-*": {{input: 1.0, output: 2.0}}
tags:
  feature: {{values: [faq, search]}}
  customer: {{free: true}}
""", "test-deploy.yaml")
    return await aiohttp_server(create_app(config))


def scrape_config_for(target: str) -> dict[str, Any]:
    """deploy/prometheus/prometheus.yml with its tokenmeter job pointed at `target`."""
    config: dict[str, Any] = load_yaml(PROM_CONFIG)
    config["global"].update(scrape_interval="1s", scrape_timeout="1s", evaluation_interval="1s")
    # Every rule file prometheus.yml loads (tokenmeter's and the ledger's), as absolute paths.
    config["rule_files"] = [str(PROM_CONFIG.parent / f) for f in config["rule_files"]]
    job = next(j for j in config["scrape_configs"] if j["job_name"] == "tokenmeter")
    job.pop("dns_sd_configs")
    job["static_configs"] = [{"targets": [target]}]
    config["scrape_configs"] = [job]
    return config


@pytest.fixture
async def prometheus(
    metered_proxy: TestServer, tmp_path: Path
) -> AsyncIterator[Prometheus]:
    target = f"127.0.0.1:{metered_proxy.port}"
    async with running_prometheus(scrape_config_for(target), tmp_path) as prom:
        yield prom


async def _stream(client: openai.AsyncOpenAI, text: str) -> str:
    stream = await client.chat.completions.create(
        model="mock-gpt", messages=[{"role": "user", "content": text}], stream=True,
        stream_options={"include_usage": True},
        extra_headers={"x-tokenmeter-tags": f"feature=faq,customer=c-{text}"},
    )
    parts = [c.choices[0].delta.content or "" async for c in stream if c.choices]
    return "".join(parts)


async def _fail(client: openai.AsyncOpenAI) -> None:
    """A request the simulated upstream answers with 500 (error_class upstream_5xx)."""
    with pytest.raises(openai.InternalServerError):
        await client.chat.completions.create(
            model="mock-gpt", messages=[{"role": "user", "content": "fail"}],
            extra_headers={"x-mock-status": "500"},
        )


async def test_dashboards_and_rules_against_real_prometheus(  # noqa: PLR0915  one scenario per real Prometheus
    metered_proxy: TestServer, prometheus: Prometheus,
) -> None:
    await prometheus.wait_for('up{job="tokenmeter"} == 1')
    client = openai.AsyncOpenAI(
        base_url=str(metered_proxy.make_url("/v1")), api_key="x", max_retries=0
    )
    try:
        # First requests create the series; Prometheus must see them once before the next
        # requests, or every rate() would be 0 (a counter's first sample is not an increase).
        assert await _stream(client, "hello")
        await _fail(client)
        await prometheus.wait_for('sum(tokenmeter_requests_total{job="tokenmeter"}) >= 2')
        for i in range(4):
            assert await _stream(client, f"question {i}")
        await _fail(client)
    finally:
        await client.close()
    await prometheus.wait_for('sum(tokenmeter_requests_total{job="tokenmeter"}) >= 7')
    await prometheus.wait_for(
        'sum(rate(tokenmeter_requests_total{error_class!="none"}[1m])) > 0'
    )
    await prometheus.wait_for(
        "sum(rate(gen_ai_server_time_to_first_token_seconds_count[1m])) > 0"
    )
    # Every histogram a panel takes a rate of needs two scrapes around an increase: one
    # scrape can land between the TTFT's observation and this one's (seen in CI on a busy box).
    await prometheus.wait_for("sum(rate(tokenmeter_output_tokens_per_second_count[1m])) > 0")

    scraped = {
        s["metric"]["__name__"]
        for s in await prometheus.query('count by (__name__) ({job="tokenmeter"})')
    }
    present = {_HIST_SUFFIX.sub("", n) if not n.endswith("_total") else n for n in scraped}
    present.add("up")
    # The names this file expects are the ones the proxy exports. tokenmeter_active_requests is
    # declared by proxy/metrics.py but has no series until the proxy sets it.
    unseen = EXISTING_METRICS - MAY_BE_EMPTY - {"tokenmeter_active_requests"} - present
    assert not unseen, f"the proxy no longer exports {unseen}"

    queries = dashboard_queries()
    assert len(queries) > 60
    empty: list[str] = []
    for q in queries:
        used = metrics_in(q.expr)
        assert used, f"{q.dashboard} / {q.panel}: no metric in {q.expr}"
        unknown = used - EXISTING_METRICS - ADDED_METRICS
        assert not unknown, f"{q.dashboard} / {q.panel}: unknown metrics {unknown}"
        result = await prometheus.query(q.expr)  # asserts status == success
        must_have_data = (q.dashboard, q.panel) in CORE_PANELS or (
            used <= EXISTING_METRICS and used <= present and not used & MAY_BE_EMPTY
        )
        if must_have_data and not result:
            empty.append(f"{q.dashboard} / {q.panel}: {q.expr}")
        if q.heatmap:
            assert all("le" in s["metric"] for s in result), q.expr
    assert not empty, "queries without data:\n" + "\n".join(empty)

    # The closed-list tag is a label; the free one, a different value per request, is not.
    tagged = await prometheus.query("tokenmeter_tag_cost_usd_total")
    assert {(s["metric"]["tag"], s["metric"]["value"]) for s in tagged} == {("feature", "faq")}
    assert not await prometheus.query('{__name__=~"tokenmeter_.+", tag="customer"}')

    # The Model variable lists the model the requests used.
    model_var = next(
        q for q in queries if q.dashboard == "tokenmeter-overview" and q.panel == "variable model"
    )
    models = {s["metric"].get("model") for s in await prometheus.query(model_var.expr)}
    assert "mock-gpt" in models

    # The rule file loads and evaluates in this Prometheus.
    expected_groups = {g["name"] for f in load_yaml(PROM_CONFIG)["rule_files"]
                       for g in load_yaml(PROM_CONFIG.parent / f)["groups"]}
    assert len(expected_groups) > len(load_yaml(RULES)["groups"])  # the ledger's are in
    deadline = time.monotonic() + 20
    while True:
        body = await prometheus.api("/api/v1/rules")
        assert body["status"] == "success"
        groups = body["data"]["groups"]
        health = {r["name"]: r["health"] for g in groups for r in g["rules"]}
        if "unknown" not in health.values() or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.25)
    assert {g["name"] for g in groups} == expected_groups
    assert set(health.values()) == {"ok"}, health
    await prometheus.wait_for("model:gen_ai_server_time_to_first_token_seconds:p95_rate5m")
    ratio = await prometheus.wait_for("tokenmeter:request_failures:ratio_rate5m > 0")
    assert float(ratio[0]["value"][1]) < 1  # 2 of 7 requests failed


# ------------------------------------------------------------------ static invariants


def dockerfile_instructions() -> list[tuple[str, str]]:
    text = DOCKERFILE.read_text(encoding="utf-8").replace("\\\n", " ")
    out = []
    for raw in text.splitlines():
        line = raw.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def dockerfile_stages() -> list[list[tuple[str, str]]]:
    """The instructions of each stage, FROM first."""
    stages: list[list[tuple[str, str]]] = []
    for k, v in dockerfile_instructions():
        if k == "FROM":
            stages.append([])
        if stages:
            stages[-1].append((k, v))
    return stages


def run_lines(stage: list[tuple[str, str]]) -> str:
    return "\n".join(v for k, v in stage if k == "RUN")


def test_dockerfile() -> None:
    instr = dockerfile_instructions()
    args = {v.split("=", 1)[0]: v.split("=", 1)[1] for k, v in instr if k == "ARG" and "=" in v}
    stages = [v.replace("${PYTHON_IMAGE}", args.get("PYTHON_IMAGE", "")) for k, v in instr
              if k == "FROM"]
    assert len(stages) >= 2, "multi-stage"
    assert all(s.startswith("python:3.11-slim") for s in stages), stages
    # Reproducible: every stage's base is pinned by digest (through the build ARG).
    for s in stages:
        assert re.fullmatch(r"python:3\.11-slim@sha256:[0-9a-f]{64}( AS \w+)?", s), s
    runtime = max(i for i, (k, _) in enumerate(instr) if k == "FROM")
    final = instr[runtime:]
    user = [v for k, v in final if k == "USER"]
    assert user and user[-1].split(":")[0] not in {"", "0", "root"}
    assert any(k == "COPY" and "--from=" in v for k, v in final), "runtime copies the venv"
    assert ("EXPOSE", "8080") in final
    # The state directory is its user's alone, as the proxy makes one (issue 31, item 13).
    (state,) = [m[1] for k, v in final if k == "ENV"
                for m in re.finditer(r"TOKENMETER_STATE_DIR=(\S+)", v)]
    assert any(k == "RUN" and f"chmod 0700 {state}" in v for k, v in final), state
    health = next(v for k, v in final if k == "HEALTHCHECK")
    assert "/healthz" in health and "python" in health and "curl" not in health
    entry = next(v for k, v in reversed(final) if k == "ENTRYPOINT")
    assert json.loads(entry) == ENTRYPOINT
    # The context is the repository root: every COPY source exists there and is let through by
    # deploy/Dockerfile.dockerignore (an allow-list).
    ignore = (DEPLOY / "Dockerfile.dockerignore").read_text(encoding="utf-8").splitlines()
    allowed = {p[1:].rstrip("/") for p in ignore if p.startswith("!")}
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    readme = project["readme"]  # setuptools needs it to build the wheel
    copied: set[str] = set()
    for k, v in instr:
        if k == "COPY" and "--from=" not in v:
            *sources, _dest = shlex.split(v)
            for src in sources:
                copied.add(src.rstrip("/"))
                assert src.rstrip("/") in allowed, f"COPY {src}: excluded by the dockerignore"
                # The readme is the top-level README's business; everything else is here now.
                if src != readme:
                    assert (ROOT / src).exists(), f"COPY {src}: not in the repository root"
    assert {"pyproject.toml", readme, "proxy", CONSTRAINTS.name} <= copied


def test_dockerfile_build_is_pinned_and_runtime_has_no_installer() -> None:
    *build_stages, final = dockerfile_stages()
    build = "\n".join(run_lines(s) for s in build_stages)
    # Every pip command of the build installs under the constraints; the wheel builds without
    # isolation, on the pinned setuptools installed just before.
    pip_cmds = [c.strip() for c in re.split(r"&&|;", build) if re.search(r"\bpip\b", c)]
    installs = [c for c in pip_cmds if re.search(r"\bpip (?:--python \S+ )?(install|wheel)\b", c)]
    assert installs, build
    for cmd in installs:
        assert f"-c {CONSTRAINTS.name}" in cmd, f"unconstrained: {cmd}"
    assert any("setuptools" in c and " install " in c for c in installs)
    assert any(" wheel " in c and "--no-build-isolation" in c for c in installs)
    # The venv is made without pip and is checked to have none.
    assert re.search(r"venv --without-pip /opt/venv", build)
    assert "! /opt/venv/bin/python -c 'import pip'" in build
    # bpe-openai: only data/ survives (with a stub package), and the encodings are loaded (with
    # their sha256 check) from the trimmed venv before the runtime stage is built.
    assert re.search(r'find "\$site/bpe_openai" -mindepth 1 -maxdepth 1 ! -name data '
                     r"-exec rm -rf \{\} \+", build), build
    assert '"$site/bpe_openai/__init__.py"' in build
    assert "from proxy.protocol.tokenizer import preload; preload()" in build
    assert build.index("preload()") > build.index("bpe_openai/__init__.py")

    # The runtime stage installs nothing and removes the base image's installers.
    runtime = run_lines(final)
    assert not re.search(r"pip (install|wheel)|-m ensurepip|get-pip", runtime), runtime
    assert re.search(r"pip uninstall -y (?:-q )?pip setuptools wheel", runtime), runtime
    assert "rm -rf /usr/local/lib/python3.*/ensurepip" in runtime  # no way to get pip back
    assert "! python -c 'import pip'" in runtime
    copies = [v for k, v in final if k == "COPY"]
    assert copies == ["--from=build /opt/venv /opt/venv"], copies


def read_constraints() -> dict[str, str]:
    """name -> pinned version. A pin may carry an environment marker (`; python_full_version
    < "3.11.3"`): it is a pin all the same, for the Pythons it applies to."""
    pins: dict[str, str] = {}
    for raw in CONSTRAINTS.read_text(encoding="utf-8").splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        pin, _, marker = line.partition(";")
        name, sep, version = pin.strip().partition("==")
        assert sep and version and not re.search(r"[<>=!~;,\s]", version), f"not a pin: {raw}"
        if marker:
            Requirement(line)  # the marker parses
        key = canonicalize_name(name)
        assert key not in pins, f"pinned twice: {name}"
        pins[key] = version
    return pins


def test_constraints_pin_every_dependency() -> None:
    pins = read_constraints()
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    direct = [
        *pyproject["build-system"]["requires"],
        *pyproject["project"]["dependencies"],
        *pyproject["project"]["optional-dependencies"]["test"],
    ]
    for spec in direct:
        req = Requirement(spec)
        name = canonicalize_name(req.name)
        assert name in pins, f"{req.name} (pyproject.toml) has no pin in constraints.txt"
        assert req.specifier.contains(pins[name], prereleases=True), (
            f"{req.name}=={pins[name]} does not satisfy pyproject.toml's {req.specifier}"
        )
        for extra in req.extras:  # redis[hiredis] -> hiredis
            for sub in importlib.metadata.requires(req.name) or []:
                sub_req = Requirement(sub)
                if sub_req.marker and sub_req.marker.evaluate({"extra": extra}):
                    assert canonicalize_name(sub_req.name) in pins, sub

    # And everything those pull in, as installed here (the closure pip resolved).
    missing: set[str] = set()
    seen: set[tuple[str, str]] = set()

    def walk(dist: str, extras: frozenset[str]) -> None:
        for raw in importlib.metadata.requires(dist) or []:
            req = Requirement(raw)
            envs = [{"extra": e} for e in extras] or [{"extra": ""}]
            if req.marker and not any(req.marker.evaluate(env) for env in envs):
                continue
            name = canonicalize_name(req.name)
            key = (name, ",".join(sorted(req.extras)))
            if key in seen:
                continue
            seen.add(key)
            if name not in pins:
                missing.add(req.name)
            walk(req.name, frozenset(req.extras))

    walk("tokenmeter", frozenset({"test"}))
    assert len(seen) > 20, "the dependency walk found too little to mean anything"
    assert not missing, f"installed but not pinned in constraints.txt: {sorted(missing)}"

    # CI installs with the constraints (the Dockerfile is checked above).
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert re.search(r"pip install -q -c constraints\.txt --no-build-isolation -e '\.\[test\]'",
                     ci), ci


# Pythons pyproject.toml admits that markers tell apart: 3.11.0-3.11.2 (Debian 12's python3 is
# 3.11.2) need what 3.11.3+ does not.
PYTHONS = ("3.11.0", "3.11.2", "3.11.3", "3.11.7", "3.12.0", "3.13.0")


def _unpinned(pins: dict[str, str], python: str) -> set[str]:
    """What tokenmeter[test] pulls in on Python `python` (markers evaluated for it, through the
    installed distributions' metadata) that constraints.txt does not pin."""
    env = {"python_full_version": python, "python_version": python.rsplit(".", 1)[0]}
    seen: set[str] = set()
    missing: set[str] = set()

    def walk(dist: str, extras: frozenset[str]) -> None:
        try:
            requires = importlib.metadata.requires(dist) or []
        except importlib.metadata.PackageNotFoundError:
            return  # not installed here (its marker excludes this Python): its pin is enough
        for raw in requires:
            req = Requirement(raw)
            envs = [{**env, "extra": e} for e in extras] or [{**env, "extra": ""}]
            if req.marker and not any(req.marker.evaluate(e) for e in envs):
                continue
            name = canonicalize_name(req.name)
            if name in seen:
                continue
            seen.add(name)
            if name not in pins:
                missing.add(req.name)
            walk(req.name, frozenset(req.extras))

    walk("tokenmeter", frozenset({"test"}))
    return missing


def test_constraints_pin_what_every_supported_python_pulls_in() -> None:
    """The walk above evaluates markers for the Python running the tests; a dependency that only
    an older 3.11 needs (redis-py's async-timeout below 3.11.3) must be pinned as well."""
    pins = read_constraints()
    missing = {v: _unpinned(pins, v) for v in PYTHONS}
    missing = {v: names for v, names in missing.items() if names}
    assert not missing, f"pulled in but not pinned in constraints.txt: {missing}"
    # And the pin applies where it is needed, nowhere else.
    line = next(raw for raw in CONSTRAINTS.read_text(encoding="utf-8").splitlines()
                if raw.startswith("async-timeout=="))
    marker = Requirement(line).marker
    assert marker is not None
    assert [v for v in PYTHONS if marker.evaluate({"python_full_version": v})] == [
        "3.11.0", "3.11.2"]


def test_the_documented_venv_gets_the_pinned_pip_and_setuptools() -> None:
    """A fresh venv carries the pip and setuptools of its Python (3.11: pip 23, setuptools 65):
    the quickstart and CI replace them with the pinned ones before installing anything, and
    build the project with that setuptools."""
    pins = read_constraints()
    assert {"pip", "setuptools"} <= set(pins)
    upgrade = re.compile(r"\.venv/bin/python -m pip install (?:-q )?-c constraints\.txt "
                         r"--upgrade pip setuptools")
    project = re.compile(r"\.venv/bin/(?:python -m )?pip install (?:-q )?-c constraints\.txt "
                         r"--no-build-isolation -e '\.\[test\]'")
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    quickstart = readme[readme.index("## Quickstart"):readme.index("## Tests")]
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    for name, text in (("README quickstart", quickstart), (".ci/run", ci)):
        first, second = upgrade.search(text), project.search(text)
        assert first and second and first.start() < second.start(), name
        assert "venv .venv" in text[:first.start()], name


def test_compose() -> None:
    compose = load_yaml(COMPOSE)
    services = compose["services"]
    assert {"tokenmeter", "mock-upstream", "redis", "prometheus", "grafana"} <= set(services)

    tm = services["tokenmeter"]
    assert (DEPLOY / tm["build"]["context"]).resolve() == ROOT
    assert (ROOT / tm["build"]["dockerfile"]).resolve() == DOCKERFILE
    # No fixed host port, so `--scale tokenmeter=2` works; something else publishes the API.
    assert "ports" not in tm
    assert any("8080:8080" in str(p) for s in services.values() for p in s.get("ports", []))
    assert "OPENAI_API_KEY" in tm["environment"]
    mounts = {v.split(":")[1]: v.split(":")[0] for v in tm["volumes"]}
    assert (DEPLOY / mounts["/etc/tokenmeter/tokenmeter.yaml"]).resolve() == COMPOSE_PROXY_CONFIG
    assert int(tm["stop_grace_period"].rstrip("s")) > 30
    # Declared here as well as in the Dockerfile: podman's default OCI image format drops the
    # Dockerfile's HEALTHCHECK. The same probe, so the two cannot disagree.
    dockerfile_health = next(v for k, v in dockerfile_stages()[-1] if k == "HEALTHCHECK")
    probe = json.loads(dockerfile_health[dockerfile_health.index("CMD ") + 4:])
    assert tm["healthcheck"]["test"] == ["CMD", *probe]
    assert "/healthz" in " ".join(tm["healthcheck"]["test"])

    mock = services["mock-upstream"]
    assert mock["image"] == tm["image"]
    assert mock["entrypoint"] == [
        "tokenmeter", "mock-upstream", "--host", "0.0.0.0", "--port", "9000"
    ]
    assert services["redis"]["image"].startswith("redis:7")

    prom = services["prometheus"]
    prom_mounts = {v.split(":")[1]: (DEPLOY / v.split(":")[0]).resolve() for v in prom["volumes"]
                   if v.startswith(".")}
    assert prom_mounts["/etc/prometheus/prometheus.yml"] == PROM_CONFIG
    assert prom_mounts["/etc/prometheus/rules"] == RULES.parent
    job = next(j for j in load_yaml(PROM_CONFIG)["scrape_configs"]
               if j["job_name"] == "tokenmeter")
    dns = job["dns_sd_configs"][0]
    # The replicas' metrics.port (9464), not the API port the gateway publishes.
    assert dns["names"] == ["tokenmeter"] and dns["type"] == "A" and dns["port"] == 9464

    graf = services["grafana"]
    graf_mounts = {v.split(":")[1]: (DEPLOY / v.split(":")[0]).resolve() for v in graf["volumes"]
                   if v.startswith(".")}
    assert graf_mounts["/etc/grafana/provisioning"] == GRAFANA / "provisioning"
    provider = load_yaml(GRAFANA / "provisioning" / "dashboards" / "tokenmeter.yml")
    path = provider["providers"][0]["options"]["path"]
    assert graf_mounts[path] == GRAFANA / "dashboards"
    assert graf["environment"]["GF_AUTH_ANONYMOUS_ENABLED"] == "true"

    # Every file the compose stack mounts exists.
    for svc in services.values():
        for v in svc.get("volumes", []):
            if v.startswith("."):
                assert (DEPLOY / v.split(":")[0]).exists(), v


def render_nginx_template(env: dict[str, str]) -> str:
    """What the nginx image's 20-envsubst-on-templates.sh writes: ${VAR} and $VAR replaced for
    defined variables whose names start with NGINX_ENVSUBST_FILTER, everything else kept."""
    prefix = env.get("NGINX_ENVSUBST_FILTER", "")

    def sub(m: re.Match[str]) -> str:
        return env.get(m.group(2), m.group(0)) if m.group(2).startswith(prefix) else m.group(0)

    return re.sub(r"\$(\{)?(\w+)(?(1)\})", sub, NGINX_TEMPLATE.read_text(encoding="utf-8"))


def test_compose_gateway_resolver_is_not_docker_only() -> None:
    gateway = load_yaml(COMPOSE)["services"]["gateway"]
    env = {k: str(v) for k, v in gateway["environment"].items()}
    mounts = {v.split(":")[1]: (DEPLOY / v.split(":")[0]).resolve() for v in gateway["volumes"]}
    template_dir = "/etc/nginx/templates"
    (target,) = [m for m in mounts if m.startswith(template_dir + "/")]
    assert mounts[target] == NGINX_TEMPLATE
    # The entrypoint renders templates/<name>.template to NGINX_ENVSUBST_OUTPUT_DIR/<name>:
    # that must be the main config, since the template has the http {} block.
    assert target.endswith(".template")
    rendered_at = env["NGINX_ENVSUBST_OUTPUT_DIR"] + target[len(template_dir):-len(".template")]
    assert rendered_at == "/etc/nginx/nginx.conf"
    assert env["NGINX_ENTRYPOINT_LOCAL_RESOLVERS"]  # exports NGINX_LOCAL_RESOLVERS
    assert env["NGINX_ENVSUBST_FILTER"] == "NGINX_"  # nginx's own $host etc. stay untouched

    text = NGINX_TEMPLATE.read_text(encoding="utf-8")
    directives = "\n".join(line.split("#", 1)[0] for line in text.splitlines())
    # Docker's embedded DNS address does not exist under podman.
    assert "127.0.0.11" not in directives and "127.0.0.11" not in COMPOSE.read_text("utf-8")
    assert re.search(r"^\s*resolver \$\{NGINX_LOCAL_RESOLVERS\} ", directives, re.M), directives
    rendered = render_nginx_template({**env, "NGINX_LOCAL_RESOLVERS": "10.89.0.1 [fd00::1]"})
    assert "resolver 10.89.0.1 [fd00::1] valid=10s" in rendered
    rendered_directives = "\n".join(line.split("#", 1)[0] for line in rendered.splitlines())
    assert "${" not in rendered_directives and "NGINX_" not in rendered_directives
    for var in ("$tokenmeter", "$host", "$proxy_add_x_forwarded_for"):
        assert var in rendered, f"{var} must survive rendering"


def test_compose_gateway_nginx_config_is_valid(tmp_path: Path) -> None:
    nginx = shutil.which("nginx")
    if nginx is None:
        pytest.skip("nginx is not installed (Debian package nginx-light)")
    env = {k: str(v) for k, v in load_yaml(COMPOSE)["services"]["gateway"]["environment"].items()}
    conf = tmp_path / "nginx.conf"
    conf.write_text(render_nginx_template({**env, "NGINX_LOCAL_RESOLVERS": "127.0.0.1"}))
    r = subprocess.run(
        [nginx, "-t", "-e", "stderr", "-p", str(tmp_path), "-c", str(conf),
         "-g", f"pid {tmp_path / 'nginx.pid'};"],
        capture_output=True, text=True, timeout=60, check=False,
    )
    assert r.returncode == 0, r.stderr
    assert "syntax is ok" in r.stderr


def test_compose_proxy_config(monkeypatch: pytest.MonkeyPatch) -> None:
    env = load_yaml(COMPOSE)["services"]["tokenmeter"]["environment"]
    for name, value in env.items():
        # "${ALICE_API_KEY:-sk-...}" -> the default, as compose would fill it in.
        m = re.fullmatch(r"\$\{\w+:-(.*)\}", str(value))
        monkeypatch.setenv(name, m.group(1) if m else str(value))
    config = parse_config(COMPOSE_PROXY_CONFIG.read_text(encoding="utf-8"), "compose")
    assert config.store.url == "redis://redis:6379/0"
    assert config.store.on_error == "fail_open"
    assert config.server.port == 8080 and config.server.drain_seconds == 30
    assert config.upstreams["mock"].base_url == "http://mock-upstream:9000/v1"
    assert config.upstreams["openai"].base_url == "https://api.openai.com/v1"
    assert {r.upstream for r in config.models} == {"mock"}  # the default needs no key
    assert set(config.users) == {"alice", "bob"}
    assert key_hash(ALICE_DEMO_KEY) in config.users["alice"].keys
    assert key_hash(BOB_DEMO_KEY) in config.users["bob"].keys
    raw = load_yaml(COMPOSE_PROXY_CONFIG)
    assert any(k.startswith("sha256:") for k in raw["users"]["bob"]["keys"])
    assert any(k.startswith("${") for k in raw["users"]["alice"]["keys"])
    assert {"input", "cached_input", "output"} <= set(raw["prices"]["mock-gpt"])

    # The books go to the compose stack's PostgreSQL, with ledger-db's password.
    assert config.ledger.enabled and config.ledger.dialect == "postgresql"
    assert config.ledger.url == (
        "postgresql://tokenmeter:tokenmeter-ledger-demo-change-me@ledger-db:5432/tokenmeter"
    )

    monkeypatch.setenv("TOKENMETER_UPSTREAM", "openai")
    switched = parse_config(COMPOSE_PROXY_CONFIG.read_text(encoding="utf-8"), "compose")
    assert switched.models[-1].upstream == "openai"


def k8s_objects() -> dict[str, dict[str, Any]]:
    """The default kustomization's objects, the operator component's, and the example Secret."""
    kustomization = load_yaml(K8S / "kustomization.yaml")
    objects: dict[str, dict[str, Any]] = {}
    for resource in kustomization["resources"]:
        for doc in load_yaml_docs(K8S / resource):
            assert "namespace" not in doc["metadata"], f"{resource}: namespace-agnostic"
            objects[doc["kind"]] = doc
    component = K8S / "components" / "prometheus-operator"
    for resource in load_yaml(component / "kustomization.yaml")["resources"]:
        for doc in load_yaml_docs(component / resource):
            assert "namespace" not in doc["metadata"]
            objects[doc["kind"]] = doc
    (secret,) = load_yaml_docs(SECRET_EXAMPLE)
    assert secret["kind"] == "Secret" and "namespace" not in secret["metadata"]
    objects["Secret"] = secret
    return objects


def test_kubernetes_default_set_leaves_the_real_secret_alone() -> None:
    kustomization = load_yaml(K8S / "kustomization.yaml")
    # `kubectl apply -k` after `kubectl create secret` must not replace the real Secret with
    # placeholders: no Secret manifest, generator or placeholder in what the default set applies.
    assert not kustomization.get("secretGenerator")
    applied = [doc for r in kustomization["resources"] for doc in load_yaml_docs(K8S / r)]
    assert applied and "Secret" not in {d["kind"] for d in applied}
    for resource in kustomization["resources"]:
        assert "REPLACE-ME" not in (K8S / resource).read_text(encoding="utf-8"), resource
    assert "examples" not in " ".join(kustomization["resources"])
    # The Deployment still expects that Secret, by the name the example and the docs use.
    (secret,) = load_yaml_docs(SECRET_EXAMPLE)
    deployment = next(d for d in applied if d["kind"] == "Deployment")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    refs = [e["secretRef"]["name"] for e in container["envFrom"] if "secretRef" in e]
    assert refs == [secret["metadata"]["name"]] == ["tokenmeter-secrets"]
    readme = (DEPLOY / "README.md").read_text(encoding="utf-8")
    assert "kubectl -n tokenmeter create secret generic tokenmeter-secrets" in readme
    assert readme.index("create secret generic") < readme.index("kubectl apply -n tokenmeter -k")


def test_kubernetes_manifests(  # noqa: PLR0915  a checklist of asserts over the manifests
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    listed = set(load_yaml(K8S / "kustomization.yaml")["resources"])
    on_disk = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert listed == on_disk, "every manifest is in kustomization.yaml"
    objs = k8s_objects()
    assert {"Deployment", "Service", "ConfigMap", "Secret", "HorizontalPodAutoscaler",
            "PodMonitor"} <= set(objs)

    dep = objs["Deployment"]
    pod = dep["spec"]["template"]
    spec = pod["spec"]
    (container,) = spec["containers"]
    assert dep["spec"]["replicas"] == 2
    assert dep["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"http": 8080, "metrics": 9464}
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert spec["securityContext"]["runAsUser"] != 0
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert container["resources"]["requests"]["cpu"], "the HPA needs a CPU request"
    assert "limits" in container["resources"]

    # Scrape annotations (the plain-Prometheus way).
    ann = pod["metadata"]["annotations"]
    assert ann["prometheus.io/scrape"] == "true"
    assert int(ann["prometheus.io/port"]) == ports["metrics"]
    assert ann["prometheus.io/path"] == "/metrics"

    # Graceful shutdown: preStop sleep, then SIGTERM and drain_seconds, all within the grace.
    cm = objs["ConfigMap"]
    secret = objs["Secret"]
    assert {"REDIS_URL", "LEDGER_URL", "OPENAI_API_KEY"} <= set(secret["stringData"])
    for name, value in secret["stringData"].items():
        monkeypatch.setenv(name, value)
    config = parse_config(cm["data"]["tokenmeter.yaml"], "configmap.yaml")
    assert "${REDIS_URL}" in cm["data"]["tokenmeter.yaml"]
    assert config.store.url == secret["stringData"]["REDIS_URL"]
    # Replicas share one ledger, in PostgreSQL; its spool fits the pod's state volume, or the
    # kubelet would evict the pod before the ledger could drop rows.
    assert "${LEDGER_URL}" in cm["data"]["tokenmeter.yaml"]
    assert config.ledger.url == secret["stringData"]["LEDGER_URL"]
    assert config.ledger.dialect == "postgresql"
    state = next(v for v in spec["volumes"] if v["name"] == "state")
    size = re.fullmatch(r"(\d+)(Mi|Gi)", state["emptyDir"]["sizeLimit"])
    assert size, state
    state_mib = int(size[1]) * (1024 if size[2] == "Gi" else 1)
    assert config.ledger.spool_max_mb * 1.25 <= state_mib, "room for the settlement spool too"
    pre_stop = container["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep"
    grace = spec["terminationGracePeriodSeconds"]
    assert grace > config.server.drain_seconds + float(pre_stop[1])

    # Wiring: config volume, secret env, service, HPA, PodMonitor.
    volumes = {v["name"]: v for v in spec["volumes"]}
    mount = next(m for m in container["volumeMounts"] if m["mountPath"] == "/etc/tokenmeter")
    assert "subPath" not in mount, "a subPath mount never sees ConfigMap updates"
    assert volumes[mount["name"]]["configMap"]["name"] == cm["metadata"]["name"]
    assert "tokenmeter.yaml" in cm["data"]
    assert {"secretRef": {"name": secret["metadata"]["name"]}} in container["envFrom"]
    svc = objs["Service"]
    assert svc["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    (svc_port,) = svc["spec"]["ports"]
    assert svc_port["targetPort"] in ports
    hpa = objs["HorizontalPodAutoscaler"]
    assert hpa["spec"]["scaleTargetRef"]["name"] == dep["metadata"]["name"]
    assert hpa["spec"]["minReplicas"] >= 2
    assert hpa["spec"]["metrics"][0]["resource"]["name"] == "cpu"
    pm = objs["PodMonitor"]
    assert pm["apiVersion"] == "monitoring.coreos.com/v1"
    assert pm["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    assert pm["spec"]["podMetricsEndpoints"][0]["port"] == "metrics"
    assert pm["spec"]["podMetricsEndpoints"][0]["path"] == "/metrics"
    # The job label the alert rules expect.
    assert pod["metadata"]["labels"][pm["spec"]["jobLabel"]] == "tokenmeter"


def test_kustomize_build(tmp_path: Path) -> None:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed (the YAML invariants are checked without it)")
    base = subprocess.run([kubectl, "kustomize", str(K8S)], capture_output=True, text=True,
                          timeout=60, check=False)
    assert base.returncode == 0, base.stderr
    kinds = {d["kind"] for d in yaml.safe_load_all(base.stdout) if d}
    assert "PodMonitor" not in kinds and {"Deployment", "Service"} <= kinds
    assert "Secret" not in kinds, "apply -k would overwrite the real Secret"
    # The operator component, used from an overlay (kustomize wants relative paths).
    overlay = tmp_path / "overlay"
    overlay.mkdir()
    rel = Path(*([".."] * len(overlay.parts[1:]))) / K8S.relative_to("/")
    (overlay / "kustomization.yaml").write_text(yaml.safe_dump({
        "resources": [str(rel)], "components": [str(rel / "components/prometheus-operator")],
    }))
    op = subprocess.run([kubectl, "kustomize", str(overlay)], capture_output=True, text=True,
                        timeout=60, check=False)
    assert op.returncode == 0, op.stderr
    docs = {d["kind"]: d for d in yaml.safe_load_all(op.stdout) if d}
    assert "PodMonitor" in docs
    annotations = docs["Deployment"]["spec"]["template"]["metadata"].get("annotations") or {}
    assert not any(k.startswith("prometheus.io/") for k in annotations)


def test_grafana_provisioning_and_dashboards() -> None:
    ds = load_yaml(GRAFANA / "provisioning" / "datasources" / "prometheus.yml")
    uids = {d["uid"] for d in ds["datasources"]}
    assert "prometheus" in uids
    prom_ds = next(d for d in ds["datasources"] if d["uid"] == "prometheus")
    assert prom_ds["type"] == "prometheus" and prom_ds["url"] == "http://prometheus:9090"
    assert prom_ds["jsonData"]["timeInterval"] == load_yaml(PROM_CONFIG)["global"][
        "scrape_interval"
    ]
    provider = load_yaml(GRAFANA / "provisioning" / "dashboards" / "tokenmeter.yml")
    assert provider["providers"][0]["type"] == "file"

    seen_uids = set()
    for name, dash in dashboards().items():
        assert dash["uid"] not in seen_uids
        seen_uids.add(dash["uid"])
        assert name == dash["uid"] + ".json"
        assert dash["schemaVersion"] == 39
        variables = {v["name"]: v for v in dash["templating"]["list"]}
        wanted = {"instance", "model"} | ({"user"} if "latency" not in name else set())
        assert wanted <= set(variables), name
        for var in variables.values():
            assert var["type"] == "query" and var["includeAll"] is True
            assert var["datasource"]["uid"] in uids
            assert variable_query(var).startswith("label_values(")
        assert variable_query(variables["instance"]) == (
            'label_values(up{job="tokenmeter"}, instance)'
        )
        ids = set()
        for panel in all_panels(dash):
            assert panel["id"] not in ids, f"{name}: duplicate panel id"
            ids.add(panel["id"])
            assert {"x", "y", "w", "h"} <= set(panel["gridPos"])
            if panel["type"] == "row":
                continue
            assert panel["datasource"]["uid"] in uids, f"{name} / {panel['title']}"
            assert panel["targets"], f"{name} / {panel['title']}"
            for t in panel["targets"]:
                assert t["datasource"]["uid"] in uids
            if panel["type"] == "heatmap":
                assert all(t.get("format") == "heatmap" and "_bucket" in t["expr"]
                           for t in panel["targets"])
                assert panel["options"]["calculate"] is False
            if panel.get("repeat"):
                assert variables[panel["repeat"]]["multi"] is True

    latency = dashboards()["tokenmeter-latency.json"]
    heatmaps = [p for p in all_panels(latency) if p["type"] == "heatmap"]
    exprs = " ".join(t["expr"] for p in heatmaps for t in p["targets"])
    assert "gen_ai_server_time_to_first_token_seconds_bucket" in exprs
    assert "tokenmeter_inter_chunk_latency_seconds_bucket" in exprs


def test_the_budgets_dashboard_filters_teams_and_shows_cost_windows() -> None:
    """Issue 32: a team filter, and the teams' and cost windows beside the users' tokens."""
    dash = dashboards()["tokenmeter-budgets.json"]
    (team,) = [v for v in dash["templating"]["list"] if v["name"] == "team"]
    assert variable_query(team) == (
        'label_values(tokenmeter_team_budget_used_tokens{instance=~"$instance"}, team)')
    assert team["multi"] is True and team["allValue"] == ".*"
    exprs = [t["expr"] for p in all_panels(dash) for t in p.get("targets", [])]
    team_queries = [e for e in exprs if "tokenmeter_team_budget_" in e]
    assert len(team_queries) >= 3
    for e in team_queries:
        assert e.count('team=~"$team"') == e.count("tokenmeter_team_budget_"), e
    assert any("tokenmeter_budget_used_usd" in e for e in exprs)


def test_dashboard_queries_parse_offline() -> None:
    """Cheap checks of every query, before the live test runs them through Prometheus."""
    queries = dashboard_queries()
    panels = {(q.dashboard, q.panel) for q in queries}
    assert panels >= CORE_PANELS
    overview = " ".join(q.expr for q in queries if q.dashboard == "tokenmeter-overview")
    for needle in ("tokenmeter_requests_total", "gen_ai_server_time_to_first_token_seconds",
                   "tokenmeter_output_tokens_per_second_bucket", "tokenmeter_tokens_total",
                   "tokenmeter_cost_usd_total"):
        assert needle in overview
    budgets = " ".join(q.expr for q in queries if q.dashboard == "tokenmeter-budgets")
    for needle in ("tokenmeter_budget_used_tokens", "tokenmeter_budget_limit_tokens",
                   "tokenmeter_budget_remaining_tokens", "tokenmeter_budget_refusals_total",
                   "topk("):
        assert needle in budgets


def test_readme_mentions_the_commands() -> None:
    text = (DEPLOY / "README.md").read_text(encoding="utf-8")
    for needle in ("docker compose -f deploy/docker-compose.yml up", "--scale tokenmeter=2",
                   "kubectl apply", "promtool test rules"):
        assert needle in text, needle


def test_readme_alert_tables_and_metrics_port_match_the_rules_and_manifests(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """deploy/README.md's alert tables list every alert of every rules file (and no other), and
    every metrics port it writes is the one the compose config, prometheus.yml and the
    Kubernetes manifests use (issue 31, item 24: it said Prometheus discovers replicas on 8080,
    and left TokenmeterCapturesDropped out)."""
    text = (DEPLOY / "README.md").read_text(encoding="utf-8")
    rule_files = sorted(p for p in RULES.parent.glob("*.rules.yml"))
    assert len(rule_files) >= 2
    alerts = {r["alert"] for p in rule_files for g in load_yaml(p)["groups"] for r in g["rules"]
              if "alert" in r}
    rows = set(re.findall(r"^\| `(Tokenmeter\w+)` \| (?:warning|critical) \|", text, re.M))
    assert rows == alerts, (f"missing from the README: {sorted(alerts - rows)}; "
                            f"not a rule: {sorted(rows - alerts)}")

    compose = _compose_config(monkeypatch).metrics.port
    (container,) = k8s_objects()["Deployment"]["spec"]["template"]["spec"]["containers"]
    k8s = {p["name"]: p["containerPort"] for p in container["ports"]}["metrics"]
    job = next(j for j in load_yaml(PROM_CONFIG)["scrape_configs"]
               if j["job_name"] == "tokenmeter")
    assert compose == k8s == job["dns_sd_configs"][0]["port"]
    flat = " ".join(text.split())  # a sentence may wrap anywhere
    written = [
        *re.findall(r"dns_sd_configs` \(type A, name `tokenmeter`, port (\d+)", flat),
        *re.findall(r"`metrics\.port: (\d+)`", flat),
        *re.findall(r"prometheus\.io/port: \"(\d+)\"", flat),
        *re.findall(r"`/metrics` on :(\d+)", flat),
    ]
    assert len(written) >= 4, written
    assert set(written) == {str(compose)}, written


def test_the_settlement_spool_has_a_writable_volume_everywhere() -> None:
    """The image runs as a user without a home on a read-only root: without a state directory
    set and mounted, the spool could not be written and an outage's usage would be lost."""
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    runtime = dockerfile[dockerfile.index("AS runtime"):]
    assert "TOKENMETER_STATE_DIR=/var/lib/tokenmeter" in runtime
    assert re.search(r"chown 10001:10001 /var/lib/tokenmeter", runtime)
    compose = load_yaml(DEPLOY / "docker-compose.yml")
    assert "tokenmeter-state:/var/lib/tokenmeter" in compose["services"]["tokenmeter"]["volumes"]
    assert "tokenmeter-state" in compose["volumes"]
    (deployment,) = [d for d in load_yaml_docs(DEPLOY / "kubernetes" / "deployment.yaml")
                     if d.get("kind") == "Deployment"]
    pod = deployment["spec"]["template"]["spec"]
    mounts = {m["mountPath"]: m["name"] for m in pod["containers"][0]["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert "emptyDir" in volumes[mounts["/var/lib/tokenmeter"]]


# ------------------------------------------------------------------ the ledger's database


def _compose_default(value: str) -> str:
    """"${VAR:-default}" -> default, as compose fills it in with VAR unset."""
    m = re.fullmatch(r"\$\{\w+:-(.*)\}", value)
    return m.group(1) if m else value


def test_compose_ledger_database_and_grafana_datasource() -> None:
    services = load_yaml(COMPOSE)["services"]
    db = services["ledger-db"]
    env = {k: str(v) for k, v in db["environment"].items()}
    assert db["image"].startswith("postgres:15")  # the version the tests run against
    assert "ports" not in db
    assert "pg_isready" in db["healthcheck"]["test"]
    # The proxy writes as the database's owner, with the same password.
    tm = services["tokenmeter"]
    assert _compose_default(tm["environment"]["LEDGER_DB_PASSWORD"]) == _compose_default(
        env["POSTGRES_PASSWORD"])
    assert tm["depends_on"]["ledger-db"]["condition"] == "service_healthy"
    raw = load_yaml(COMPOSE_PROXY_CONFIG)
    assert raw["ledger"]["url"] == (
        f"postgresql://{env['POSTGRES_USER']}:${{LEDGER_DB_PASSWORD}}@ledger-db:5432/"
        f"{env['POSTGRES_DB']}"
    )
    # The read-only role: the init script runs the SQL file at the path compose mounts it.
    mounts = {v.split(":")[1]: (DEPLOY / v.split(":")[0]).resolve() for v in db["volumes"]
              if v.startswith(".")}
    init = next(m for m in mounts if m.startswith("/docker-entrypoint-initdb.d/"))
    assert init.endswith(".sh") and mounts[init] == DEPLOY / "compose" / "ledger-init.sh"
    script = mounts[init].read_text(encoding="utf-8")
    sql_path = re.search(r"-f (\S+)", script)
    assert sql_path and mounts[sql_path[1]] == DEPLOY / "compose" / "ledger-reader.sql"
    for var in ("POSTGRES_USER", "POSTGRES_DB", "LEDGER_READER_USER", "LEDGER_READER_PASSWORD"):
        assert f'"${var}"' in script and var in env, var
    assert mounts[init].stat().st_mode & 0o111, "the image runs an executable init script"
    assert "ledger-data:/var/lib/postgresql/data" in db["volumes"]
    assert "ledger-data" in load_yaml(COMPOSE)["volumes"]

    # Grafana's ledger datasource is filled from Grafana's environment: every variable set,
    # pointing at ledger-db as the read-only role.
    graf = services["grafana"]
    genv = {k: str(v) for k, v in graf["environment"].items()}
    ds_text = (GRAFANA / "provisioning" / "datasources" / "ledger.yml").read_text("utf-8")
    wanted = set(re.findall(r"\$\{(\w+)\}", ds_text))
    assert wanted and wanted <= set(genv), wanted - set(genv)
    assert genv["TOKENMETER_LEDGER_DB_HOST"] == "ledger-db:5432"
    assert genv["TOKENMETER_LEDGER_DB_NAME"] == env["POSTGRES_DB"]
    assert genv["TOKENMETER_LEDGER_DB_USER"] == env["LEDGER_READER_USER"]
    assert genv["TOKENMETER_LEDGER_DB_USER"] != env["POSTGRES_USER"]
    assert _compose_default(genv["TOKENMETER_LEDGER_DB_PASSWORD"]) == _compose_default(
        env["LEDGER_READER_PASSWORD"])
    assert "ledger-db" in graf["depends_on"]


def test_readme_upgrade_runs_the_init_script_compose_mounts() -> None:
    """The upgrade of an existing ledger-data volume (issue 31, item 23): the README's command
    runs the very script compose mounts as the database's init script (its variables are the
    container's environment); ledger-reader.sql is safe to run again
    (tests/ledger/test_hostile_ledger_reader.py runs it twice)."""
    db = load_yaml(COMPOSE)["services"]["ledger-db"]
    init = next(v.split(":")[1] for v in db["volumes"]
                if v.split(":")[1].startswith("/docker-entrypoint-initdb.d/"))
    text = (DEPLOY / "README.md").read_text(encoding="utf-8")
    assert "#### Upgrading the ledger database" in text
    assert f"docker compose -f deploy/docker-compose.yml exec ledger-db {init}" in text


def test_kubernetes_grafana_ledger_datasource_example() -> None:
    """The example for a Kubernetes Grafana is the provisioned datasource with values filled
    in: same name, uid, type and settings, so the dashboard finds it."""
    (secret,) = load_yaml_docs(K8S / "examples" / "grafana-ledger-datasource.yaml")
    assert secret["kind"] == "Secret" and "namespace" not in secret["metadata"]
    assert secret["metadata"]["labels"]["grafana_datasource"] == "1"
    (text,) = secret["stringData"].values()
    (example,) = yaml.safe_load(text)["datasources"]
    (provisioned,) = load_yaml(GRAFANA / "provisioning" / "datasources" / "ledger.yml")[
        "datasources"]

    def flat(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
        out: dict[str, Any] = {}
        for k, v in d.items():
            out.update(flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {prefix + k: v})
        return out

    mine, theirs = flat(provisioned), flat(example)
    assert set(mine) == set(theirs)
    # Everything but what the provisioned file takes from Grafana's environment is the same.
    env_driven = {k for k, v in mine.items() if isinstance(v, str) and "${" in v}
    assert env_driven == {"url", "user", "jsonData.database", "jsonData.sslmode",
                          "secureJsonData.password"}
    assert {k: v for k, v in mine.items() if k not in env_driven} == {
        k: v for k, v in theirs.items() if k not in env_driven}
    assert example["uid"] == "tokenmeter-ledger"
    assert example["user"] != "tokenmeter", "Grafana reads as a read-only role"
    assert "REPLACE-ME" in example["secureJsonData"]["password"]
    # Not applied by `kubectl apply -k`: it holds a password and belongs to Grafana.
    kustomization = load_yaml(K8S / "kustomization.yaml")
    assert not any("grafana" in r for r in kustomization["resources"])


# ------------------------------------------------------------------ /metrics stays private


def _compose_config(monkeypatch: pytest.MonkeyPatch) -> Any:
    for name, value in load_yaml(COMPOSE)["services"]["tokenmeter"]["environment"].items():
        monkeypatch.setenv(name, _compose_default(str(value)))
    return parse_config(COMPOSE_PROXY_CONFIG.read_text(encoding="utf-8"), "compose")


def _routes(config: Any) -> set[str]:
    app = create_app(config)
    return {r.canonical for r in app.router.resources()}


def test_compose_metrics_are_on_their_own_port_the_gateway_never_forwards(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """/metrics names every user: in compose it is on metrics.port, which Prometheus scrapes
    on the compose network and the gateway (the only published API port) never reaches."""
    config = _compose_config(monkeypatch)
    port = config.metrics.port
    assert port is not None and port != config.server.port
    assert "/metrics" not in _routes(config) and "/v1/models" in _routes(config)
    services = load_yaml(COMPOSE)["services"]
    assert str(port) in [str(p) for p in services["tokenmeter"]["expose"]]
    assert not any(str(port) in str(p) for s in services.values() for p in s.get("ports", []))
    job = next(j for j in load_yaml(PROM_CONFIG)["scrape_configs"]
               if j["job_name"] == "tokenmeter")
    assert job["dns_sd_configs"][0]["port"] == port
    # The gateway forwards to the API port only, and refuses /metrics itself.
    text = NGINX_TEMPLATE.read_text(encoding="utf-8")
    directives = "\n".join(line.split("#", 1)[0] for line in text.splitlines())
    assert set(re.findall(r"http://tokenmeter:(\d+)", directives)) == {str(config.server.port)}
    assert re.search(r"location \^~ /metrics \{\s*return 404;\s*\}", directives), directives


def test_kubernetes_service_does_not_expose_metrics(monkeypatch: pytest.MonkeyPatch) -> None:
    objs = k8s_objects()
    for name, value in objs["Secret"]["stringData"].items():
        monkeypatch.setenv(name, value)
    config = parse_config(objs["ConfigMap"]["data"]["tokenmeter.yaml"], "configmap.yaml")
    (container,) = objs["Deployment"]["spec"]["template"]["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert config.metrics.port == ports["metrics"] != config.server.port == ports["http"]
    assert "/metrics" not in _routes(config)
    # The Service (and whatever routes to it) carries the API port only.
    targets = {p["targetPort"] for p in objs["Service"]["spec"]["ports"]}
    assert targets == {"http"}
    assert {p["port"] for p in objs["Service"]["spec"]["ports"]} == {ports["http"]}


def test_kubernetes_networkpolicy_example() -> None:
    """Port 8080 from the ingress controller's namespace, the metrics port from Prometheus
    only, and nothing else, on exactly the tokenmeter pods."""
    (policy,) = load_yaml_docs(K8S / "examples" / "networkpolicy.yaml")
    assert policy["kind"] == "NetworkPolicy" and policy["apiVersion"] == "networking.k8s.io/v1"
    assert "namespace" not in policy["metadata"]
    pod = next(d for d in load_yaml_docs(K8S / "deployment.yaml")
               if d["kind"] == "Deployment")["spec"]["template"]
    spec = policy["spec"]
    assert spec["podSelector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    assert "Ingress" in spec["policyTypes"]
    (container,) = pod["spec"]["containers"]
    names = {p["name"] for p in container["ports"]}
    by_port: dict[str, list[dict[str, Any]]] = {}
    for rule in spec["ingress"]:
        assert rule.get("from"), "no rule may admit every source"
        for p in rule["ports"]:
            assert p["port"] in names
            by_port.setdefault(p["port"], []).extend(rule["from"])
    assert set(by_port) == {"http", "metrics"}
    # Metrics: one peer, Prometheus' pods in the monitoring namespace (both selectors in one
    # element, which ANDs them).
    (peer,) = by_port["metrics"]
    assert peer["podSelector"]["matchLabels"] and peer["namespaceSelector"]["matchLabels"]
    assert "ipBlock" not in peer
    assert by_port["metrics"] != by_port["http"]
    kustomization = load_yaml(K8S / "kustomization.yaml")
    assert "examples" not in " ".join(kustomization["resources"])


@pytest.mark.timeout(60)
async def test_compose_gateway_answers_metrics_404_with_a_real_nginx(
    tmp_path: Path, aiohttp_server: ServerFactory
) -> None:
    """The rendered gateway config in a real nginx, in front of a real proxy that still
    serves /metrics on its API port (a config without metrics.port): the gateway refuses it
    however the path is spelt, and forwards the API."""
    nginx = shutil.which("nginx")
    if nginx is None:
        pytest.skip("nginx is not installed (Debian package nginx-light)")
    upstream = await aiohttp_server(create_mock_app(MockSettings(tokens_per_second=0)))
    proxy = await aiohttp_server(create_app(parse_config(f"""
upstreams:
  mock:
    base_url: {upstream.make_url("/v1")}
metrics:
  discover_models: false
""", "test-deploy.yaml")))
    port = free_port()
    env = {k: str(v) for k, v in load_yaml(COMPOSE)["services"]["gateway"]["environment"].items()}
    rendered = render_nginx_template({**env, "NGINX_LOCAL_RESOLVERS": "127.0.0.1"})
    assert "listen 8080;" in rendered and "http://tokenmeter:8080" in rendered
    conf = tmp_path / "nginx.conf"
    conf.write_text(rendered.replace("listen 8080;", f"listen 127.0.0.1:{port};")
                    .replace("http://tokenmeter:8080", f"http://127.0.0.1:{proxy.port}")
                    .replace("worker_processes auto;", "worker_processes 1;"))
    (tmp_path / "logs").mkdir()
    proc = await asyncio.create_subprocess_exec(
        nginx, "-e", "stderr", "-p", str(tmp_path), "-c", str(conf),
        "-g", f"daemon off; pid {tmp_path / 'nginx.pid'}; user root;",
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
    )
    try:
        await asyncio.to_thread(wait_for_port, port)
        async with aiohttp.ClientSession() as session:
            async with session.get(proxy.make_url("/metrics")) as direct:
                assert direct.status == 200  # the proxy itself serves it, the gateway not
            base = f"http://127.0.0.1:{port}"
            for path in ("/metrics", "//metrics", "/%6Detrics", "/metrics/", "/./metrics",
                         "/v1/../metrics", "/metrics?x=1"):
                # encoded=True: sent as spelt, not normalised by the client first
                async with session.get(URL(base + path, encoded=True)) as r:
                    assert r.status == 404, path
                    assert "tokenmeter_" not in await r.text(), path
            async with session.get(base + "/healthz") as r:
                assert r.status == 200
    finally:
        proc.terminate()
        await proc.wait()



# ------------------------------------------------------------------ what an operator types


def _kubectl_secret_keys(text: str) -> set[str]:
    """The keys of every `kubectl ... create secret generic` command in `text` (a shell block,
    or comment lines with `#` and line continuations)."""
    lines = [line.lstrip("# ").rstrip() for line in text.splitlines()]
    joined = "\n".join(lines).replace("\\\n", " ")
    keys: set[str] = set()
    found = False
    for line in joined.splitlines():
        if "create secret generic" in line:
            found = True
            words = shlex.split(line)
            keys |= {w.split("=", 2)[1] for w in words if w.startswith("--from-literal=")}
    assert found, "no kubectl create secret command"
    return keys


def test_every_documented_kubectl_create_secret_gives_every_key() -> None:
    """Pods built from the documented command must start: it gives every ${VAR} the ConfigMap
    reads without a default, as the example Secret does (LEDGER_URL was missing: exit 2)."""
    (secret,) = load_yaml_docs(SECRET_EXAMPLE)
    wanted = set(secret["stringData"])
    cm = next(d for d in load_yaml_docs(K8S / "configmap.yaml") if d["kind"] == "ConfigMap")
    needed = set(re.findall(r"\$\{(\w+)\}", cm["data"]["tokenmeter.yaml"]))
    assert needed <= wanted, needed - wanted
    assert _kubectl_secret_keys(SECRET_EXAMPLE.read_text(encoding="utf-8")) == wanted
    readme = (DEPLOY / "README.md").read_text(encoding="utf-8")
    assert _kubectl_secret_keys(readme) == wanted


# What the nginx image's 15-local-resolvers.envsh (1.27) exports from /etc/resolv.conf.
IMAGE_LOCAL_RESOLVERS = r"""
NGINX_LOCAL_RESOLVERS=$(awk 'BEGIN{ORS=" "} $1=="nameserver" {if ($2 ~ ":") {print "["$2"]"} else {print $2}}' "$RESOLV_CONF")
NGINX_LOCAL_RESOLVERS="${NGINX_LOCAL_RESOLVERS% }"
export NGINX_LOCAL_RESOLVERS
"""


@pytest.mark.parametrize(("resolv", "first"), [
    # podman before 4.5: aardvark-dns, then the host's nameserver
    ("search dns.podman\nnameserver 10.89.0.1\nnameserver 192.168.1.1\n", "10.89.0.1"),
    ("nameserver fd00::1\nnameserver 10.89.0.1\n", "[fd00::1]"),
    ("nameserver 127.0.0.11\noptions ndots:0\n", "127.0.0.11"),  # Docker's embedded DNS
])
def test_compose_gateway_resolves_through_the_first_nameserver_only(
    tmp_path: Path, resolv: str, first: str
) -> None:
    """The gateway's entrypoint, as the image runs it: its 15-local-resolvers.envsh, then ours
    (sourced by a real sh, in the order the entrypoint sorts them), then the template rendered
    with what they exported, checked by a real `nginx -t`."""
    gateway = load_yaml(COMPOSE)["services"]["gateway"]
    mounts = {v.split(":")[1]: (DEPLOY / v.split(":")[0]).resolve() for v in gateway["volumes"]}
    scripts = sorted(m for m in mounts if m.startswith("/docker-entrypoint.d/"))
    assert [Path(s).name for s in scripts] == ["16-first-local-resolver.envsh"]
    ours = mounts[scripts[0]]
    # The entrypoint sources *.envsh in name order and skips those not executable.
    assert "15-local-resolvers.envsh" < ours.name < "20-envsubst-on-templates.sh"
    assert ours.stat().st_mode & 0o111
    (tmp_path / "resolv.conf").write_text(resolv)
    done = subprocess.run(
        ["sh", "-c", f'set -eu; {IMAGE_LOCAL_RESOLVERS}. "$OURS"; printf %s "$NGINX_LOCAL_RESOLVERS"'],
        env={"PATH": "/usr/bin:/bin", "RESOLV_CONF": str(tmp_path / "resolv.conf"),
             "OURS": str(ours)},
        capture_output=True, text=True, timeout=30, check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == first
    env = {k: str(v) for k, v in gateway["environment"].items()}
    rendered = render_nginx_template({**env, "NGINX_LOCAL_RESOLVERS": done.stdout})
    assert f"resolver {first} valid=10s" in rendered
    nginx = shutil.which("nginx")
    if nginx is None:
        pytest.skip("nginx is not installed (Debian package nginx-light)")
    conf = tmp_path / "nginx.conf"
    conf.write_text(rendered)
    r = subprocess.run(
        [nginx, "-t", "-e", "stderr", "-p", str(tmp_path), "-c", str(conf),
         "-g", f"pid {tmp_path / 'nginx.pid'};"],
        capture_output=True, text=True, timeout=60, check=False,
    )
    assert r.returncode == 0, r.stderr
