from __future__ import annotations

from pathlib import Path

import pytest

from proxy.cli import main
from proxy.config.load import ConfigError, load_config, parse_config
from proxy.routing.upstream import Router
from tests.helpers import ROOT

GOOD = """
upstreams:
  openai:
    base_url: https://api.openai.com/v1/
    api_key: ${TM_TEST_KEY}
  local:
    base_url: http://127.0.0.1:8000/v1
    api_key: ${TM_UNSET_KEY:-}
models:
  - match: "gpt-4o*"
    upstream: openai
  - match: "llama-3"
    upstream: local
  - match: "*"
    upstream: local
"""


def test_good_config_routes_and_interpolates(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TM_TEST_KEY", "sk-from-env")
    cfg = parse_config(GOOD)
    assert cfg.upstreams["openai"].api_key == "sk-from-env"
    assert cfg.upstreams["openai"].base_url == "https://api.openai.com/v1"
    assert cfg.upstreams["local"].api_key is None
    router = Router(cfg)
    route = router.resolve("gpt-4o-mini")
    assert route is not None and route.upstream.name == "openai"
    assert router.model_label("gpt-4o-mini", route) == "gpt-4o*"  # a glob never leaks the name
    llama = router.resolve("llama-3")
    assert router.model_label("llama-3", llama) == "llama-3"  # exact names are bounded
    other = router.resolve("anything")
    assert other is not None and other.pattern == "*"


def test_missing_env_names_file_line_field(tmp_path: Path) -> None:
    path = tmp_path / "tm.yaml"
    path.write_text(GOOD)
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert str(err.value) == (
        f"{path}:5: upstreams.openai.api_key: environment variable TM_TEST_KEY is not set"
    )


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("upstreams:\n  a:\n    base_url: ftp://x\n", "<config>:3: upstreams.a.base_url:"),
        ("upstreams:\n  a:\n    base_url: http://x\n    bogus: 1\n",
         "<config>:4: upstreams.a.bogus: Extra inputs are not permitted"),
        ("upstreams:\n  a:\n    base_url: http://x\nmodels:\n  - match: '*'\n    upstream: b\n",
         "unknown upstream 'b'"),
        ("upstreams: {}\n", "upstreams:"),
        ("- just a list\n", "must be a YAML mapping"),
        ("upstreams: [\n", "invalid YAML"),
    ],
)
def test_bad_configs_are_explained(text: str, expected: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_config(text)
    assert expected in str(err.value)


def test_check_config_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good = tmp_path / "good.yaml"
    good.write_text("upstreams:\n  a:\n    base_url: http://127.0.0.1:1/v1\n")
    bad = tmp_path / "bad.yaml"
    bad.write_text("upstreams:\n  a:\n    base_url: nope\n")
    assert main(["check-config", str(good)]) == 0
    assert "OK" in capsys.readouterr().out
    assert main(["check-config", str(bad)]) == 1
    assert f"{bad}:3: upstreams.a.base_url" in capsys.readouterr().err


def test_example_config_is_valid(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", "sk-x")
    cfg = load_config(ROOT / "config" / "tokenmeter.example.yaml")
    assert set(cfg.upstreams) == {"openai", "local"}
