from __future__ import annotations

import pytest

from maec_client import ConfigError, resolve_config
from maec_client.config import DEFAULT_URL


def test_defaults_without_any_source(tmp_path):
    cfg = resolve_config(env={"XDG_CONFIG_HOME": str(tmp_path)})
    assert (cfg.url, cfg.api_key, cfg.timeout, cfg.source_file) == (DEFAULT_URL, None, 30.0,
                                                                    None)


def test_precedence_flag_over_env_over_file(tmp_path):
    d = tmp_path / "maec"
    d.mkdir()
    (d / "client.toml").write_text('url = "http://127.0.0.1:1"\napi_key = "file-key"\n'
                                   "timeout = 5\n")
    env = {"XDG_CONFIG_HOME": str(tmp_path)}
    cfg = resolve_config(env=env)
    assert (cfg.url, cfg.api_key, cfg.timeout) == ("http://127.0.0.1:1", "file-key", 5.0)
    assert cfg.source_file == d / "client.toml"
    env |= {"MAEC_URL": "http://127.0.0.1:2/", "MAEC_API_KEY": "env-key"}
    cfg = resolve_config(env=env)
    assert (cfg.url, cfg.api_key, cfg.timeout) == ("http://127.0.0.1:2", "env-key", 5.0)
    cfg = resolve_config(url="http://127.0.0.1:3", api_key="flag-key", timeout=9, env=env)
    assert (cfg.url, cfg.api_key, cfg.timeout) == ("http://127.0.0.1:3", "flag-key", 9.0)


def test_yaml_file_and_explicit_config_path(tmp_path):
    d = tmp_path / "maec"
    d.mkdir()
    (d / "client.yaml").write_text("url: http://127.0.0.1:4\napi_key: y\n")
    assert resolve_config(env={"XDG_CONFIG_HOME": str(tmp_path)}).api_key == "y"
    other = tmp_path / "other.toml"
    other.write_text('api_key = "explicit"\n')
    env = {"XDG_CONFIG_HOME": str(tmp_path), "MAEC_CONFIG": str(other)}
    assert resolve_config(env=env).api_key == "explicit"
    assert resolve_config(config_file=d / "client.yaml", env=env).api_key == "y"


@pytest.mark.parametrize(("text", "match"), [
    ('urll = "http://x"\n', "unknown key"),
    ('url = "ftp://x"\n', "must start with http"),
    ("timeout = -1\n", "positive"),
    ('timeout = "soon"\n', "not a number"),
    ("url = [unclosed\n", "not valid"),
])
def test_bad_config_files_fail_loudly(tmp_path, text, match):
    path = tmp_path / "c.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=match):
        resolve_config(config_file=path, env={})


def test_explicit_missing_config_is_an_error(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        resolve_config(config_file=tmp_path / "nope.toml", env={})
