"""The FastAPI application (``uvicorn app.api.main:create_app --factory``)."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI
from fastapi.concurrency import run_in_threadpool
from fastapi.openapi.utils import get_openapi

from app.api import docs, errors
from app.api.deps import Services
from app.api.gc_tuning import tune_gc
from app.api.limits import Limits
from app.api.routes import files, health, hub, jobs, queue
from app.api.ui import router as ui_router
from app.jobs.api_store import ApiJobStore
from app.queue import Enqueuer
from app.scheduler.view import QueueView
from app.settings import Settings, get_settings
from app.storage import make_storage

log = logging.getLogger("maec.api")
Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


class BodyLimit:
    """Refuse request bodies above ``limit`` bytes with 413 before any parsing.

    Pure ASGI (not BaseHTTPMiddleware, which costs throughput on every request).
    """

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        # More than 19 digits is more than any limit (and int() refuses thousands).
        if declared is not None and declared.isdigit() and (
            len(declared) > 19 or int(declared) > self.limit
        ):
            await self._refuse(send)
            return
        chunks: list[Message] = []
        total = 0
        while True:
            msg = await receive()
            chunks.append(msg)
            if msg["type"] != "http.request":
                break
            total += len(msg.get("body", b""))
            if total > self.limit:
                await self._refuse(send)
                return
            if not msg.get("more_body", False):
                break

        async def replay() -> Message:
            return chunks.pop(0) if chunks else await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, send: Send) -> None:
        resp = errors.problem(413, "request_too_large",
                              f"request body above {self.limit} bytes", {"limit": self.limit})
        await send({"type": "http.response.start", "status": 413,
                    "headers": resp.raw_headers})
        await send({"type": "http.response.body", "body": resp.body})


def _document_auth(app: FastAPI) -> None:
    """Declare the bearer key in OpenAPI (so /docs has "Authorize"); /healthz is open.

    Auth itself is enforced in ``app.api.deps.authenticate`` (``operator`` for /metrics),
    not by this description.
    """

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version,
                                 description=app.description, routes=app.routes)
            schema.setdefault("components", {})["securitySchemes"] = {
                "apiKey": {"type": "http", "scheme": "bearer",
                           "description": "Authorization: Bearer <API key>"},
                # /metrics is the operator's (app.api.deps.operator): API keys get 403.
                "metricsToken": {"type": "http", "scheme": "bearer",
                                 "description": "Authorization: Bearer <the token whose "
                                 "sha256 is MAEC_METRICS_TOKEN_SHA256>"}}
            for path, ops in schema.get("paths", {}).items():
                for op in ops.values():
                    op["security"] = [] if path == "/healthz" else \
                        [{"metricsToken": []}] if path == "/metrics" else [{"apiKey": []}]
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or get_settings()
    settings.warn_if_dev()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        storage = make_storage(settings)
        try:
            # A fresh deployment (compose) starts with an empty store.
            await run_in_threadpool(storage.prepare)
        except Exception as exc:  # readyz reports storage; the API still starts
            log.warning("could not prepare storage: %s", exc)
        store = ApiJobStore.from_url(settings.redis_url)
        enqueuer = Enqueuer(settings.redis_url)
        limits = Limits.from_settings(settings)
        app.state.services = Services(
            settings, store, storage, enqueuer, settings.key_lookup, limits,
            QueueView(store.client, settings),
        )
        tune_gc(settings.api_gc_threshold)
        try:
            yield
        finally:
            await limits.close()
            await store.close()
            enqueuer.close()

    app = FastAPI(
        title="maec-service",
        version="1",
        description="Model merging (MAEC and baselines) as jobs. See docs/api.md.",
        lifespan=lifespan,
        # Served by app.api.docs instead: same paths, assets from the package, optional key.
        docs_url=None, redoc_url=None, openapi_url=None,
    )
    _document_auth(app)
    errors.install(app)
    # Route matching is first-match over the list: the polled job route goes first.
    app.include_router(jobs.router)
    app.include_router(queue.router)
    app.include_router(files.router)
    # The Hub client's paths for a job's files (docs/client.md).
    app.include_router(hub.router)
    app.include_router(health.router)
    docs.install(app)
    app.include_router(ui_router)
    app.add_middleware(BodyLimit, limit=settings.max_body_bytes)
    return app
