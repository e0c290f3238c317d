"""Where the client finds the service URL and API key.

Precedence, highest first: explicit arguments (CLI flags), environment (``MAEC_URL``,
``MAEC_API_KEY``, ``MAEC_TIMEOUT``), a config file, then defaults. The config file is
``--config``/``MAEC_CONFIG`` if given (it must exist), else the first of
``$XDG_CONFIG_HOME/maec/client.toml``, ``client.yaml``, ``client.yml`` (XDG default
``~/.config``) that exists. Keys in the file: ``url``, ``api_key``, ``timeout``.
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from maec_client.errors import ClientError

DEFAULT_URL = "http://127.0.0.1:8000"
DEFAULT_TIMEOUT = 30.0
_KEYS = ("url", "api_key", "timeout")


class ConfigError(ClientError):
    code = "invalid_config"


@dataclass(frozen=True)
class ClientConfig:
    url: str = DEFAULT_URL
    api_key: str | None = None
    timeout: float = DEFAULT_TIMEOUT
    # Which file contributed (None: none did); shown by the CLI for "why this URL?" questions.
    source_file: Path | None = None


def default_config_paths(env: Mapping[str, str]) -> list[Path]:
    base = Path(env.get("XDG_CONFIG_HOME") or Path.home() / ".config") / "maec"
    return [base / "client.toml", base / "client.yaml", base / "client.yml"]


def load_config_file(path: Path) -> dict[str, Any]:
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read config {path}: {exc.strerror}") from None
    try:
        if path.suffix == ".toml":
            data: Any = tomllib.loads(raw.decode())
        else:
            data = yaml.safe_load(raw) or {}
    except (tomllib.TOMLDecodeError, yaml.YAMLError, UnicodeDecodeError) as exc:
        raise ConfigError(f"config {path} is not valid: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config {path} must be a mapping")
    unknown = sorted(set(data) - set(_KEYS))
    if unknown:
        # Same rule as recipes: a misspelt key must not silently fall back to a default.
        raise ConfigError(f"config {path}: unknown key(s) {', '.join(unknown)}")
    return data


def resolve_config(url: str | None = None, api_key: str | None = None,
                   timeout: float | None = None, config_file: str | Path | None = None,
                   env: Mapping[str, str] | None = None) -> ClientConfig:
    env = os.environ if env is None else env
    file_data: dict[str, Any] = {}
    source: Path | None = None
    explicit = config_file or env.get("MAEC_CONFIG")
    if explicit:
        source = Path(explicit).expanduser()
        file_data = load_config_file(source)
    else:
        for candidate in default_config_paths(env):
            if candidate.is_file():
                source = candidate
                file_data = load_config_file(candidate)
                break

    def pick(arg: Any, env_name: str, key: str) -> Any:
        if arg is not None:
            return arg
        if env.get(env_name):
            return env[env_name]
        return file_data.get(key)

    final_url = pick(url, "MAEC_URL", "url") or DEFAULT_URL
    final_key = pick(api_key, "MAEC_API_KEY", "api_key")
    raw_timeout = pick(timeout, "MAEC_TIMEOUT", "timeout")
    try:
        final_timeout = DEFAULT_TIMEOUT if raw_timeout is None else float(raw_timeout)
    except (TypeError, ValueError):
        raise ConfigError(f"timeout {raw_timeout!r} is not a number") from None
    if final_timeout <= 0:
        raise ConfigError(f"timeout must be positive, got {final_timeout}")
    if not str(final_url).startswith(("http://", "https://")):
        raise ConfigError(f"url {final_url!r} must start with http:// or https://")
    return ClientConfig(url=str(final_url).rstrip("/"),
                        api_key=str(final_key) if final_key else None,
                        timeout=final_timeout, source_file=source)
