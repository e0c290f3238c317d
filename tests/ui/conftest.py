"""The /ui tests: page tests over the real app (TestClient, real Redis, local storage)
reuse the API tests' fixtures; the browser test runs the whole stack."""

from __future__ import annotations

from tests.api.conftest import api, api_factory  # re-exported fixtures

__all__ = ["api", "api_factory"]
