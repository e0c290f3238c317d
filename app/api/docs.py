"""/docs and /openapi.json, self-contained: Swagger UI's files are served from the
installed ``swagger-ui-bundle-v2`` package, so the page loads nothing from a CDN (the
service may run where none is reachable, and a CDN script would run with the page's
origin).

With ``docs_require_key`` (on by default outside dev mode) both need an API key: as
``Authorization: Bearer <key>``, or as HTTP Basic credentials with the key as password
(any user name), which is what a browser can send: a 401 here asks for them. Failed
attempts count against the client address like any other (app/api/limits.py). The UI's
own assets are the public Swagger UI distribution and need no key.
"""

from __future__ import annotations

import base64
import binascii
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse
from swagger_ui_bundle import swagger_ui_path

from app.api.deps import Services, client_address
from app.api.errors import ApiError
from app.api.limits import owner_of

ASSETS = "/docs/assets"
# The files the page uses, by the name it asks for them.
_FILES = {
    "swagger-ui-bundle.js": "text/javascript; charset=utf-8",
    "swagger-ui.css": "text/css; charset=utf-8",
    "favicon-32x32.png": "image/png",
}
_REALM = 'Basic realm="maec-service docs", charset="UTF-8"'


def _presented_key(header: str) -> str | None:
    scheme, _, value = header.partition(" ")
    value = value.strip()
    if scheme.lower() == "bearer" and value:
        return value
    if scheme.lower() == "basic" and value:
        try:
            decoded = base64.b64decode(value, validate=True).decode()
        except (binascii.Error, UnicodeDecodeError):
            return None
        _, sep, password = decoded.partition(":")
        return password if sep and password else None
    return None


async def _require_docs_key(request: Request) -> None:
    svc: Services = request.app.state.services
    if svc.settings.dev_mode or not svc.settings.docs_need_key:
        return
    key = _presented_key(request.headers.get("authorization", ""))
    owner = owner_of(key, svc.keys) if key else None
    address = client_address(request)
    if owner is None:
        await svc.limits.failed_auth(address)
        raise ApiError(401, "unauthorized", "the API docs need an API key (Authorization: "
                       "Bearer <key>, or the key as the password of HTTP Basic)",
                       headers={"WWW-Authenticate": _REALM})
    await svc.limits.request(owner).check()


def install(app: FastAPI) -> None:
    """Add the three routes; create the app with ``docs_url``, ``redoc_url`` and
    ``openapi_url`` set to None so FastAPI's CDN-backed defaults are not there."""
    folder = Path(str(swagger_ui_path))

    @app.get("/openapi.json", include_in_schema=False)
    async def openapi(request: Request) -> JSONResponse:
        await _require_docs_key(request)
        return JSONResponse(app.openapi())

    @app.get("/docs", include_in_schema=False)
    async def docs(request: Request) -> HTMLResponse:
        await _require_docs_key(request)
        return get_swagger_ui_html(
            openapi_url="/openapi.json", title=f"{app.title} - API docs",
            swagger_js_url=f"{ASSETS}/swagger-ui-bundle.js",
            swagger_css_url=f"{ASSETS}/swagger-ui.css",
            swagger_favicon_url=f"{ASSETS}/favicon-32x32.png",
            oauth2_redirect_url=None,
            # No spec validation badge: it would send the spec to an outside validator.
            swagger_ui_parameters={"validatorUrl": None},
        )

    @app.get(ASSETS + "/{name}", include_in_schema=False)
    async def asset(name: str) -> Any:
        media = _FILES.get(name)
        if media is None:
            raise ApiError(404, "not_found", "no such docs asset")
        return FileResponse(folder / name, media_type=media,
                            headers={"Cache-Control": "public, max-age=86400"})
