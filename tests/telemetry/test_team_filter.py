"""The team filter of the overview dashboard: `tokenmeter_user_info{user, team}` for every
configured user (set at start, followed by reloads), the `$team` variable, and the join every
per-user query makes with it, run by a real Prometheus scraping a real proxy whose users are in
teams: a chosen team shows its users' figures only, All shows everyone's as before the filter.
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from aiohttp.test_utils import TestServer

from proxy.config.load import load_config
from proxy.server import reload as reload_mod
from proxy.server import state as st
from proxy.server.app import create_app
from proxy.server.reload import Poll
from proxy.telemetry.metrics import Metrics
from proxy.testing.mock_upstream import MockSettings, create_mock_app
from tests.helpers import ROOT, ServerFactory, config_data, scrape, sdk
from tests.servers import Prometheus, running_prometheus
from tests.telemetry.test_deploy import GRAFANA_INTERVALS, scrape_config_for
from tests.telemetry.test_histograms import _merged, _multiprocess

OVERVIEW = ROOT / "grafana" / "dashboards" / "tokenmeter-overview.json"
README = ROOT / "README.md"
# alice and dave are in team a, bob in b, carol in none.
TEAMS = {"alice": "a", "bob": "b", "carol": None, "dave": "a"}
INFO = 'tokenmeter_user_info{instance=~"$instance",team=~"$team"} == 1'
SWITCH = 'up{job="tokenmeter",instance=~"$instance",team=~"$team"}'
# The join each per-user rate or increase carries; group 1 is the term it filters.
_TERM = r'((?:rate|increase)\(\w+\{[^}]*user=~"\$user"[^}]*\}\[\$__\w+\]\))'
_FILTERED = re.compile(_TERM + re.escape(f" and on(user) ({INFO} or on(user) ") + r"(.+?)"
                       + re.escape(f" and on() {SWITCH})"))


def _key(user: str) -> str:
    return f"sk-team-{user}-0123456789"


def _config(upstream_url: str, teams: dict[str, str | None]) -> str:
    users = {u: {"keys": [_key(u)], **({"team": t} if t else {})} for u, t in teams.items()}
    data = config_data(upstream_url, users=users,
                       extra={"prices": {"mock-*": {"input": 1.0, "output": 2.0}}})
    return yaml.safe_dump(data, sort_keys=False)


def _info(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float]) -> dict[str, str]:
    """tokenmeter_user_info's series at 1, as user -> team."""
    out: dict[str, str] = {}
    for (name, labels), value in samples.items():
        if name == "tokenmeter_user_info" and value == 1:
            lab = dict(labels)
            assert lab["user"] not in out
            out[lab["user"]] = lab["team"]
    return out


@pytest.fixture
def manual_polls(monkeypatch: pytest.MonkeyPatch) -> None:
    """The background poller parked: the test reloads when it says so."""
    monkeypatch.setattr(reload_mod, "POLL_SECONDS", 3600.0)


@pytest.fixture
async def upstream_url(aiohttp_server: ServerFactory) -> str:
    upstream = await aiohttp_server(create_mock_app(
        MockSettings(tokens_per_second=2000, ttft_ms=1, output_tokens=8)))
    return str(upstream.make_url("/v1"))


async def test_user_info_gives_each_configured_users_team_and_follows_reloads(
    aiohttp_server: ServerFactory, upstream_url: str, tmp_path: Path, manual_polls: None,
) -> None:
    path = tmp_path / "tm.yaml"
    path.write_text(_config(upstream_url, TEAMS))
    proxy = await aiohttp_server(create_app(load_config(path), config_path=path))
    samples = await scrape(proxy)
    assert _info(samples) == {"alice": "a", "bob": "b", "carol": "", "dave": "a"}

    # bob dropped, alice moved to b, carol given a team, erin added without one.
    path.write_text(_config(upstream_url, {"alice": "b", "carol": "c", "dave": "a",
                                           "erin": None}))
    proxy.app[st.WATCHER].request_reload()
    assert await proxy.app[st.WATCHER].poll_once() is Poll.APPLIED
    samples = await scrape(proxy)
    assert _info(samples) == {"alice": "b", "carol": "c", "dave": "a", "erin": ""}
    # The old series are gone, not left at some value: a join on them would still match.
    assert {dict(lab)["user"] + "/" + dict(lab)["team"] for (n, lab) in samples
            if n == "tokenmeter_user_info"} == {"alice/b", "carol/c", "dave/a", "erin/"}


def test_user_info_of_workers_drops_a_user_to_zero(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Workers share their values through files that cannot forget a series: a dropped user,
    or a user's former team, reads 0, and the dashboards join on `== 1`."""
    with _multiprocess(tmp_path / "prom", monkeypatch) as d:
        metrics = Metrics()
        metrics.user_teams({"alice": "a", "bob": None})
        metrics.user_teams({"alice": "b"})
        metrics.publish()
        text = _merged(d).decode()
    lines = {ln for ln in text.splitlines() if ln.startswith("tokenmeter_user_info{")}
    assert lines == {'tokenmeter_user_info{team="a",user="alice"} 0.0',
                     'tokenmeter_user_info{team="",user="bob"} 0.0',
                     'tokenmeter_user_info{team="b",user="alice"} 1.0'}


def _overview() -> dict[str, Any]:
    dash: dict[str, Any] = json.loads(OVERVIEW.read_text(encoding="utf-8"))
    return dash


def _overview_exprs() -> list[tuple[str, str]]:
    return [(p["title"], t["expr"]) for row in _overview()["panels"]
            for p in [row, *row.get("panels", [])] for t in p.get("targets", [])]


def test_the_overview_dashboard_filters_every_user_query_by_team() -> None:
    variables = {v["name"]: v for v in _overview()["templating"]["list"]}
    team = variables["team"]
    assert team["query"]["query"] == team["definition"] == (
        'label_values(tokenmeter_user_info{instance=~"$instance"}, team)')
    assert team["multi"] is True and team["includeAll"] is True and team["allValue"] == ".*"
    filtered = 0
    for title, expr in _overview_exprs():
        terms = re.findall(_TERM, _unfiltered(expr))
        joins = _FILTERED.findall(expr)
        # Every per-user term is joined with the team's users, once, and the All branch
        # repeats that very term (so All keeps every user, those with no team known included).
        assert len(joins) == len(terms), f"{title}: {expr}"
        assert all(term == again for term, again in joins), title
        assert expr.count("$team") == 2 * len(terms), title
        filtered += bool(terms)
    # The request, token, cost and cache-saving panels: those with a user label.
    assert filtered >= 15


def _expand(expr: str, team: str = ".*", user: str = ".*") -> str:
    for macro, value in GRAFANA_INTERVALS.items():
        expr = expr.replace(macro, value)
    expr = expr.replace('=~"$team"', f'=~"{team}"').replace('=~"$user"', f'=~"{user}"')
    expr = re.sub(r'=~"\$\w+"', '=~".*"', expr)
    assert "$" not in expr, expr
    return expr


def _unfiltered(expr: str) -> str:
    """The query as it was before the team filter: every join taken out."""
    return _FILTERED.sub(lambda m: m.group(1), expr)


@pytest.fixture
async def teamed_proxy(
    aiohttp_server: ServerFactory, upstream_url: str, tmp_path: Path, manual_polls: None,
) -> TestServer:
    path = tmp_path / "tm.yaml"
    path.write_text(_config(upstream_url, TEAMS))
    return await aiohttp_server(create_app(load_config(path), config_path=path))


@pytest.fixture
async def prometheus(teamed_proxy: TestServer, tmp_path: Path) -> AsyncIterator[Prometheus]:
    scrape_config = scrape_config_for(f"127.0.0.1:{teamed_proxy.port}")
    (tmp_path / "prom").mkdir()
    async with running_prometheus(scrape_config, tmp_path / "prom") as prom:
        yield prom


async def _ask(proxy: TestServer, user: str) -> None:
    client = sdk(proxy, _key(user))
    try:
        await client.chat.completions.create(
            model="mock-gpt", messages=[{"role": "user", "content": f"hello from {user}"}])
    finally:
        await client.close()


async def _values(prom: Prometheus, expr: str, at: str) -> dict[str, float]:
    """The query's result at time `at`, as {its labels: value}."""
    body = await prom.api("/api/v1/query", query=expr, time=at)
    assert body["status"] == "success", f"{expr}: {body}"
    return {json.dumps(s["metric"], sort_keys=True): float(s["value"][1])
            for s in body["data"]["result"]}


async def test_a_team_shows_its_users_figures_and_all_shows_everyones(
    teamed_proxy: TestServer, prometheus: Prometheus, upstream_url: str, tmp_path: Path,
) -> None:
    await prometheus.wait_for('up{job="tokenmeter"} == 1')
    # Each user's first request creates their series; Prometheus sees them before the next
    # ones, so that rates over the window are not 0.
    for user in TEAMS:
        await _ask(teamed_proxy, user)
    await prometheus.wait_for("sum(tokenmeter_requests_total) >= 4")
    for user in TEAMS:
        await _ask(teamed_proxy, user)
    # dave leaves the configuration: his figures stay in All, and leave team a's.
    (tmp_path / "tm.yaml").write_text(_config(upstream_url, {
        u: t for u, t in TEAMS.items() if u != "dave"}))
    teamed_proxy.app[st.WATCHER].request_reload()
    assert await teamed_proxy.app[st.WATCHER].poll_once() is Poll.APPLIED
    await prometheus.wait_for("sum(tokenmeter_requests_total) >= 8")
    await prometheus.wait_for('absent(tokenmeter_user_info{user="dave"})')
    await prometheus.wait_for("sum(rate(tokenmeter_cost_usd_total[1m])) > 0")
    # Every query below at the time of one scrape that has all of this: later scrapes do not
    # change what it reads.
    (stamp,) = await prometheus.wait_for('timestamp(tokenmeter_user_info{user="alice"})')
    at = stamp["value"][1]

    checked = 0
    for title, expr in _overview_exprs():
        if "$team" not in expr:
            continue
        everyone = await _values(prometheus, _expand(expr), at)
        assert everyone == pytest.approx(
            await _values(prometheus, _expand(_unfiltered(expr)), at)), title
        # Team a is alice alone now (dave dropped); b is bob; carol is in none.
        for team, user in (("a", "alice"), ("b", "bob"), ("(a|b)", "(alice|bob)")):
            chosen = await _values(prometheus, _expand(expr, team=team), at)
            assert chosen == pytest.approx(
                await _values(prometheus, _expand(expr, user=user), at)), (title, team)
        checked += bool(everyone)
    assert checked >= 10  # the panels with data here (not the cache's)

    by_user = next(e for t, e in _overview_exprs() if t == "Estimated cost by user (time range)")

    async def users(team: str) -> set[str]:
        return {json.loads(k)["user"]
                for k in await _values(prometheus, _expand(by_user, team=team), at)}

    assert await users(".*") == {"alice", "bob", "carol", "dave"}
    assert await users("a") == {"alice"}
    assert await users("b") == {"bob"}
    assert await users("c") == set()
    # The README's example of summing a request metric by team.
    (example,) = re.findall(r"`(sum by \(team\) \(.+?)` \(the `max`", README.read_text())
    over_the_hour = example.replace("rate(", "increase(").replace("[5m]", "[1h]")
    by_team = await _values(prometheus, over_the_hour, at)
    cost = {json.loads(k)["user"]: v for k, v in (await _values(
        prometheus, _expand(by_user), at)).items()}
    assert {json.loads(k).get("team", ""): v for k, v in by_team.items()} == pytest.approx(
        {"a": cost["alice"], "b": cost["bob"], "": cost["carol"]})  # dave has no team now
    requests = next(e for t, e in _overview_exprs() if t == "Requests / s")
    (all_rate,) = (await _values(prometheus, _expand(requests), at)).values()
    (a_rate,) = (await _values(prometheus, _expand(requests, team="a"), at)).values()
    assert 0 < a_rate < all_rate
