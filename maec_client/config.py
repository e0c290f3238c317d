"""Where the client finds the service URL and API key.

Precedence, highest first: explicit arguments (CLI flags), environment (``MAEC_URL``,
``MAEC_API_KEY``, ``MAEC_TIMEOUT``), a config file, then defaults. The config file is
``--config``/``MAEC_CONFIG`` if given (it must exist), else the first of
``$XDG_CONFIG_HOME/maec/client.toml``, ``client.yaml``, ``client.yml`` (XDG default
``~/.config``) that exists. Keys in the file: ``url``, ``api_key``, ``timeout``.

The layers are pydantic-settings sources (init arguments, environment, a TOML or YAML
file), merged and validated by :class:`ClientSettings`; this module only picks the file.
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Mapping
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError, field_validator
from pydantic_settings import (
    BaseSettings,
    EnvSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
    YamlConfigSettingsSource,
)

# ConfigError lives with the other exceptions (the CLI's exit-code table needs it without
# importing pydantic-settings); it is importable from here as before.
from maec_client.errors import ConfigError as ConfigError

DEFAULT_URL = "http://127.0.0.1:8000"
DEFAULT_TIMEOUT = 30.0


@dataclass(frozen=True)
class ClientConfig:
    url: str = DEFAULT_URL
    api_key: str | None = None
    timeout: float = DEFAULT_TIMEOUT
    # Which file contributed (None: none did); shown by the CLI for "why this URL?" questions.
    source_file: Path | None = None


# The file and environment of the resolve_config call in progress: pydantic-settings asks
# the settings class (not the call) for its sources, so the call hands them over here.
_CALL: ContextVar[tuple[Path | None, Mapping[str, str]]] = ContextVar("maec_client_config")


class _MappingEnv(EnvSettingsSource):
    """The environment source, reading a given mapping instead of os.environ."""

    def __init__(self, settings_cls: type[BaseSettings], env: Mapping[str, str]) -> None:
        self._env = env
        super().__init__(settings_cls)

    def _load_env_vars(self) -> Mapping[str, str | None]:
        # Lower-cased like the stock source does (case-insensitive), empty values dropped.
        return {k.lower(): v for k, v in self._env.items() if v}


class ClientSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="MAEC_", env_ignore_empty=True,
                                      extra="forbid")

    url: str = DEFAULT_URL
    api_key: str | None = None
    timeout: float = DEFAULT_TIMEOUT

    @field_validator("url")
    @classmethod
    def _http_url(cls, v: str) -> str:
        if not v.startswith(("http://", "https://")):
            raise ValueError(f"url {v!r} must start with http:// or https://")
        return v.rstrip("/")

    @field_validator("timeout")
    @classmethod
    def _positive(cls, v: float) -> float:
        if v <= 0:
            raise ValueError(f"timeout must be positive, got {v:g}")
        return v

    @classmethod
    def settings_customise_sources(
        cls, settings_cls: type[BaseSettings], init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource, dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        path, env = _CALL.get((None, os.environ))
        sources: list[PydanticBaseSettingsSource] = [init_settings,
                                                      _MappingEnv(settings_cls, env)]
        if path is not None:
            sources.append(TomlConfigSettingsSource(settings_cls, toml_file=path)
                           if path.suffix == ".toml"
                           else YamlConfigSettingsSource(settings_cls, yaml_file=path))
        return tuple(sources)


def default_config_paths(env: Mapping[str, str]) -> list[Path]:
    base = Path(env.get("XDG_CONFIG_HOME") or Path.home() / ".config") / "maec"
    return [base / "client.toml", base / "client.yaml", base / "client.yml"]


def config_file_for(config_file: str | Path | None, env: Mapping[str, str]) -> Path | None:
    """The file to read: the one named (which must exist), else the first default found."""
    explicit = config_file or env.get("MAEC_CONFIG")
    if explicit:
        path = Path(explicit).expanduser()
        if not path.is_file():
            raise ConfigError(f"cannot read config {path}: no such file")
        return path
    return next((p for p in default_config_paths(env) if p.is_file()), None)


def resolve_config(url: str | None = None, api_key: str | None = None,
                   timeout: float | None = None, config_file: str | Path | None = None,
                   env: Mapping[str, str] | None = None) -> ClientConfig:
    env = os.environ if env is None else env
    path = config_file_for(config_file, env)
    given = (("url", url), ("api_key", api_key), ("timeout", timeout))
    explicit: dict[str, Any] = {k: v for k, v in given if v is not None}
    token = _CALL.set((path, env))
    try:
        settings = ClientSettings(**explicit)
    except ValidationError as exc:
        raise ConfigError(_explain(exc, path)) from None
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError, yaml.YAMLError,
            TypeError, ValueError) as exc:
        # Raised by the file sources while reading or parsing (a list where a mapping
        # belongs is a TypeError or ValueError there).
        raise ConfigError(f"config {path} is not valid: {exc}") from None
    finally:
        _CALL.reset(token)
    return ClientConfig(url=settings.url, api_key=settings.api_key or None,
                        timeout=settings.timeout, source_file=path)


def _explain(exc: ValidationError, path: Path | None) -> str:
    problems: list[str] = []
    unknown = sorted(str(e["loc"][0]) for e in exc.errors() if e["type"] == "extra_forbidden")
    if unknown:
        # Same rule as recipes: a misspelt key must not silently fall back to a default.
        problems.append(f"config {path}: unknown key(s) {', '.join(unknown)}")
    for err in exc.errors():
        key = str(err["loc"][0]) if err["loc"] else "config"
        if err["type"] == "extra_forbidden":
            continue
        if err["type"] == "value_error":
            problems.append(str(err["msg"]).removeprefix("Value error, "))
        elif key == "timeout":
            problems.append(f"timeout {err.get('input')!r} is not a number")
        else:
            problems.append(f"{key} {err.get('input')!r}: {err['msg']}")
    return "; ".join(problems)
