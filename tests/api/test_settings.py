"""Settings refuse insecure production defaults; dev mode is explicit and loud."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from app.settings import Settings, SettingsInvalid, get_settings, hash_key
from tests.stack import ROOT

KEYS = {"alice": hash_key("k")}


def test_no_api_keys_outside_dev_mode_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MAEC_API_KEYS", raising=False)
    monkeypatch.delenv("MAEC_DEV_MODE", raising=False)
    with pytest.raises(ValidationError, match="MAEC_API_KEYS is empty"):
        Settings()


def test_default_s3_credentials_are_refused() -> None:
    with pytest.raises(ValidationError, match="well-known default"):
        Settings(api_keys=KEYS, storage_backend="s3", s3_access_key="minioadmin",
                 s3_secret_key="minioadmin")
    Settings(api_keys=KEYS, storage_backend="s3", s3_access_key="a-real-id",
             s3_secret_key="a-real-secret")


def test_keys_must_be_sha256_and_roots_absolute() -> None:
    with pytest.raises(ValidationError, match="hex sha256"):
        Settings(api_keys={"alice": "plaintext-key"})
    with pytest.raises(ValidationError, match="absolute"):
        Settings(api_keys=KEYS, local_roots=["relative/dir"])


@pytest.mark.parametrize("key_id", ["dev", "DEV", " dev "])
def test_dev_modes_owner_is_reserved(key_id: str) -> None:
    """A configured key named like dev mode's owner would see every job made in dev mode
    against the same Redis: the key id is refused, in either mode."""
    for dev in (False, True):
        with pytest.raises(ValidationError, match="reserved for dev mode") as err:
            Settings(dev_mode=dev, api_keys={**KEYS, key_id: hash_key("k2")})
        assert hash_key("k2") not in str(err.value)
    Settings(api_keys={**KEYS, "developers": hash_key("k2")})  # only that id


def test_env_prefix_and_key_lookup(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MAEC_API_KEYS", json.dumps({"bob": hash_key("secret")}))
    monkeypatch.setenv("MAEC_MAX_ATTEMPTS", "5")
    s = Settings()
    assert s.max_attempts == 5
    assert s.key_lookup[hash_key("secret")] == "bob"


def test_the_two_worker_caches_are_capped_apart(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MAEC_CACHE_MAX_BYTES", raising=False)
    monkeypatch.setenv("MAEC_ARTIFACT_CACHE_MAX_BYTES", "123")
    s = Settings(api_keys=KEYS)
    assert s.artifact_cache_max_bytes == 123 and s.cache_max_bytes == 50 * 10**9
    monkeypatch.delenv("MAEC_ARTIFACT_CACHE_MAX_BYTES")
    assert Settings(api_keys=KEYS).artifact_cache_max_bytes == 10 * 10**9
    with pytest.raises(ValidationError, match="artifact_cache_max_bytes"):
        Settings(api_keys=KEYS, artifact_cache_max_bytes=-1)


def test_dev_mode_allows_no_keys_and_says_so(caplog: pytest.LogCaptureFixture) -> None:
    s = Settings(dev_mode=True, api_keys={})
    with caplog.at_level(logging.WARNING, logger="maec.settings"):
        s.warn_if_dev()
    assert "DEV MODE" in caplog.text and "authentication is OFF" in caplog.text


RAW_KEY = "raw-api-key-not-a-digest-7f3e"
S3_SECRET = "s3-secret-value-91c2d7"


def _start_api(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """Start the API as a deployment does (uvicorn factory) with ``env``; it must refuse."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MAEC_")}
    return subprocess.run(
        [str(Path(sys.executable).parent / "uvicorn"), "app.api.main:create_app",
         "--factory", "--host", "127.0.0.1", "--port", "0"],
        cwd=ROOT, env={**clean, **env}, capture_output=True, text=True, timeout=120,
    )


@pytest.mark.parametrize(("env", "secret", "names"), [
    ({"MAEC_API_KEYS": json.dumps({"alice": RAW_KEY})}, RAW_KEY, "MAEC_API_KEYS"),
    ({"MAEC_API_KEYS": json.dumps({"alice": hash_key("k")}), "MAEC_STORAGE_BACKEND": "s3",
      "MAEC_S3_ACCESS_KEY": "minioadmin", "MAEC_S3_SECRET_KEY": S3_SECRET},
     S3_SECRET, "MAEC_S3_ACCESS_KEY"),
], ids=["raw-api-key", "default-s3-access-key"])
def test_startup_error_names_the_variable_never_the_value(env: dict[str, str], secret: str,
                                                          names: str) -> None:
    out = _start_api(env)
    text = out.stdout + out.stderr
    assert out.returncode != 0, text
    assert "invalid_settings" in text and names in text, text
    assert secret not in text, text


def test_settings_errors_hide_values(monkeypatch: pytest.MonkeyPatch,
                                     caplog: pytest.LogCaptureFixture) -> None:
    for k in [k for k in os.environ if k.startswith("MAEC_")]:
        monkeypatch.delenv(k)
    monkeypatch.setenv("MAEC_API_KEYS", json.dumps({"alice": RAW_KEY}))
    get_settings.cache_clear()
    with caplog.at_level(logging.DEBUG), pytest.raises(SettingsInvalid) as info:
        get_settings()
    assert "MAEC_API_KEYS" in str(info.value) and "sha256" in str(info.value)
    assert RAW_KEY not in str(info.value) and RAW_KEY not in caplog.text
    # Not even the cause chain a traceback would print carries it.
    assert info.value.__suppress_context__ and info.value.__cause__ is None
    monkeypatch.setenv("MAEC_API_KEYS", "{not json " + RAW_KEY)
    with pytest.raises(SettingsInvalid, match="MAEC_API_KEYS is not valid JSON") as info:
        get_settings()
    assert RAW_KEY not in str(info.value)
    get_settings.cache_clear()
    monkeypatch.delenv("MAEC_API_KEYS")
    # Built directly (tests, tools), the pydantic error does not print the input either.
    with pytest.raises(ValidationError) as err:
        Settings(api_keys=KEYS, storage_backend="s3", s3_access_key="",
                 s3_secret_key=S3_SECRET)
    assert "MAEC_S3_ACCESS_KEY" in str(err.value) and S3_SECRET not in str(err.value)
