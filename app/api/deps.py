"""Dependencies: the shared service objects and the caller's key id."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request

from app.api.errors import ApiError
from app.api.limits import Admission, Limits, owner_of, token_matches
from app.jobs.api_store import ApiJobStore
from app.queue import Enqueuer
from app.scheduler.view import QueueView
from app.settings import DEV_OWNER, Settings
from app.storage.base import Storage


@dataclass
class Services:
    settings: Settings
    store: ApiJobStore
    storage: Storage
    enqueuer: Enqueuer
    # sha256 -> key id, built once: authenticating a request is one hash + one lookup.
    keys: dict[str, str]
    limits: Limits
    # The scheduler's read side: a queued job's place, GET /v1/queue, the gauges.
    queue: QueueView


async def get_services(request: Request) -> Services:
    svc: Services = request.app.state.services
    return svc


# Async dependencies: FastAPI runs sync ones in a thread pool, which costs throughput.
Svc = Annotated[Services, Depends(get_services)]


def _unauthorized(message: str) -> ApiError:
    return ApiError(401, "unauthorized", message, headers={"WWW-Authenticate": "Bearer"})


@dataclass(frozen=True)
class Caller:
    """An authenticated request's key id and the service objects, from one dependency
    (each extra dependency node costs FastAPI measurable time per request), and the
    pending rate-limit verdict on the request (None in dev mode: no limits)."""

    owner: str
    svc: Services
    admission: Admission | None = None

    async def admitted(self) -> None:
        """Raise 429 if the request is over a rate limit."""
        if self.admission is not None:
            await self.admission.check()


def client_address(request: Request) -> str:
    # The peer uvicorn reports: behind a proxy, the address its --proxy-headers trust.
    return request.client.host if request.client else "unknown"


async def identify(request: Request) -> Caller:
    """The caller's key checked (401, after counting the failure against the client
    address: 429 once that is over its limit), and its rate-limit check started but not
    awaited, so a route can overlap it with its own Redis work; ``admitted()`` must be
    awaited before answering. Dev mode: key ``dev``, no limits."""
    svc: Services = request.app.state.services
    if svc.settings.dev_mode:
        return Caller(DEV_OWNER, svc)
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        await svc.limits.failed_auth(client_address(request))
        raise _unauthorized("missing API key (Authorization: Bearer <key>)")
    owner = owner_of(token.strip(), svc.keys)
    if owner is None:
        await svc.limits.failed_auth(client_address(request))
        raise _unauthorized("unknown API key")
    return Caller(owner, svc, svc.limits.request(owner))


async def operator(request: Request) -> Services:
    """The operator's credential (``MAEC_METRICS_TOKEN_SHA256``), for what only the
    operator reads. An API key is a valid credential of someone else: 403
    ``operator_only`` (not 401, which would tell its holder the key is wrong, nor 404: the
    route is public knowledge, in /openapi.json). Anything else counts as a failed
    authentication, as on every other route. Dev mode: open, as everything is."""
    svc: Services = request.app.state.services
    if svc.settings.dev_mode:
        return svc
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        await svc.limits.failed_auth(client_address(request))
        raise _unauthorized("missing operator token (Authorization: Bearer <token>)")
    wanted = svc.settings.metrics_token_sha256
    if wanted is not None and token_matches(token, wanted):
        return svc
    if owner_of(token, svc.keys) is not None:
        raise ApiError(403, "operator_only",
                       "this endpoint is for the operator's metrics token "
                       "(MAEC_METRICS_TOKEN_SHA256), not for API keys")
    await svc.limits.failed_auth(client_address(request))
    raise _unauthorized("unknown operator token")


Operator = Annotated[Services, Depends(operator)]


async def authenticate(request: Request) -> Caller:
    caller = await identify(request)
    await caller.admitted()
    return caller


Auth = Annotated[Caller, Depends(authenticate)]
