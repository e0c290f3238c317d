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


# " dev " used to be refused here too; spaces are now outside the key-id alphabet
# (test_key_ids_outside_the_alphabet_stop_the_service).
@pytest.mark.parametrize("key_id", ["dev", "DEV"])
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


BAD_KEY_IDS = ["alice:ci", " dev ", "", "a" * 65, "tab\tid", "al/ice", "alice\n", "ålice",
               "a{b}", "x*"]


@pytest.mark.parametrize("key_id", BAD_KEY_IDS)
@pytest.mark.parametrize("field", ["api_keys", "key_weights", "priority_caps",
                                   "webhook_secrets"])
def test_key_ids_outside_the_alphabet_stop_the_service(field: str, key_id: str) -> None:
    """A key id names Redis keys, metrics and log lines: ``alice:ci`` beside ``alice``
    once shared idempotency slots. Every setting keyed by key id refuses one outside
    ``[A-Za-z0-9._-]{1,64}`` at start-up, naming the variable, never a value."""
    value: object = {"api_keys": hash_key("k2"), "key_weights": 2.0,
                     "priority_caps": "high", "webhook_secrets": "s" * 20}[field]
    kw: dict[str, object] = {"api_keys": dict(KEYS)}
    kw[field] = {**kw.get(field, {}), key_id: value}  # type: ignore[dict-item]
    with pytest.raises(ValidationError, match="not a valid key id") as err:
        Settings(**kw)  # type: ignore[arg-type]
    assert "s" * 20 not in str(err.value) and hash_key("k2") not in str(err.value)
    assert "a" * 20 not in str(err.value)  # an overlong id (a pasted key?) is cut short


def test_key_id_alphabet_error_names_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    get_settings.cache_clear()
    monkeypatch.setenv("MAEC_API_KEYS", json.dumps({"alice:ci": hash_key("k")}))
    try:
        with pytest.raises(SettingsInvalid, match=r"MAEC_API_KEYS: key id 'alice:ci' is "
                           r"not a valid key id: key ids are 1-64 characters of"):
            get_settings()
    finally:
        get_settings.cache_clear()


def test_key_ids_inside_the_alphabet_are_accepted() -> None:
    ids = ["a", "A.b_c-9", "x" * 64, "team-a", "ci.bot_2"]
    s = Settings(api_keys={i: hash_key(i) for i in ids}, key_weights=dict.fromkeys(ids, 2.0),
                 priority_caps=dict.fromkeys(ids, "high"))
    assert sorted(s.key_lookup.values()) == sorted(ids)


def test_metrics_token_is_a_hash_of_its_own() -> None:
    """The operator's metrics credential is stored hashed like API keys, and may not be
    a tenant's key (that tenant would read every tenant's counts)."""
    assert Settings(api_keys=KEYS).metrics_token_sha256 is None
    assert Settings(api_keys=KEYS, metrics_token_sha256="").metrics_token_sha256 is None
    ok = Settings(api_keys=KEYS, metrics_token_sha256=hash_key("op").upper())
    assert ok.metrics_token_sha256 == hash_key("op") and not ok.metrics_per_key
    with pytest.raises(ValidationError, match="never the token itself") as err:
        Settings(api_keys=KEYS, metrics_token_sha256="raw-operator-token")
    assert "raw-operator-token" not in str(err.value)
    with pytest.raises(ValidationError, match="hash of an API key"):
        Settings(api_keys=KEYS, metrics_token_sha256=next(iter(KEYS.values())))
