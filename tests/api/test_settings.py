"""Settings refuse insecure production defaults; dev mode is explicit and loud."""

from __future__ import annotations

import json
import logging

import pytest
from pydantic import ValidationError

from app.settings import Settings, hash_key

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


def test_env_prefix_and_key_lookup(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MAEC_API_KEYS", json.dumps({"bob": hash_key("secret")}))
    monkeypatch.setenv("MAEC_MAX_ATTEMPTS", "5")
    s = Settings()
    assert s.max_attempts == 5
    assert s.key_lookup[hash_key("secret")] == "bob"


def test_dev_mode_allows_no_keys_and_says_so(caplog: pytest.LogCaptureFixture) -> None:
    s = Settings(dev_mode=True, api_keys={})
    with caplog.at_level(logging.WARNING, logger="maec.settings"):
        s.warn_if_dev()
    assert "DEV MODE" in caplog.text and "authentication is OFF" in caplog.text
