"""/docs loads only same-origin assets, which the API serves itself, and needs a key
outside dev mode (Bearer, or Basic with the key as password, which browsers can send)."""

from __future__ import annotations

import base64
import re

from tests.api.conftest import Api
from tests.stack import API_KEYS


def _basic(password: str, user: str = "me") -> dict[str, str]:
    token = base64.b64encode(f"{user}:{password}".encode()).decode()
    return {"Authorization": f"Basic {token}"}


def test_docs_reference_only_assets_the_api_serves(api: Api) -> None:
    r = api.client.get("/docs", headers=api.auth())
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    html = r.text
    refs = re.findall(r"""(?:src|href)\s*=\s*["']([^"']+)["']""", html)
    refs += re.findall(r"""url:\s*'([^']+)'""", html)
    assert len(refs) >= 4, html  # css, icon, script, the spec
    for ref in refs:
        assert ref.startswith("/") and not ref.startswith("//"), ref
    assert not re.search(r"https?://|//cdn|jsdelivr|unpkg", html), html
    for ref in refs:
        got = api.client.get(ref, headers=api.auth())
        assert got.status_code == 200, ref
        assert len(got.content) > 0
    js = api.client.get("/docs/assets/swagger-ui-bundle.js")  # the assets need no key
    assert js.status_code == 200 and "SwaggerUIBundle" in js.text
    assert js.headers["content-type"].startswith("text/javascript")
    assert api.client.get("/docs/assets/index.html").status_code == 404
    assert api.client.get("/docs/assets/..%2F__init__.py").status_code == 404
    assert api.client.get("/redoc").status_code == 404  # its page would load from a CDN


def test_docs_and_spec_need_a_key_outside_dev_mode(api: Api) -> None:
    for path in ("/docs", "/openapi.json"):
        for headers in ({}, {"Authorization": "Bearer wrong"}, _basic("wrong"),
                        {"Authorization": "Basic !!"},
                        {"Authorization": f"Basic {API_KEYS['alice']}"}):
            r = api.client.get(path, headers=headers)
            assert r.status_code == 401, (path, headers)
            assert r.json()["code"] == "unauthorized"
            assert r.headers["www-authenticate"].startswith("Basic realm=")
        assert api.client.get(path, headers=api.auth()).status_code == 200
        assert api.client.get(path, headers=_basic(API_KEYS["bob"])).status_code == 200
    spec = api.client.get("/openapi.json", headers=api.auth()).json()
    assert "/v1/jobs" in spec["paths"] and "/docs" not in spec["paths"]


def test_docs_key_follows_the_setting(api_factory: object) -> None:
    dev: Api = api_factory(dev_mode=True, api_keys={})  # type: ignore[operator]
    assert dev.client.get("/docs").status_code == 200
    assert dev.client.get("/openapi.json").status_code == 200
    open_docs: Api = api_factory(docs_require_key=False)  # type: ignore[operator]
    assert open_docs.client.get("/docs").status_code == 200
    assert open_docs.client.get("/openapi.json").status_code == 200
    assert open_docs.client.get("/v1/jobs").status_code == 401  # the API itself is not
