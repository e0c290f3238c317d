"""Dependencies: the shared service objects and the caller's key id."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request

from app.api.errors import ApiError
from app.api.limits import RateLimiter, owner_of
from app.jobs.api_store import ApiJobStore
from app.queue import Enqueuer
from app.settings import Settings
from app.storage.base import Storage


@dataclass
class Services:
    settings: Settings
    store: ApiJobStore
    storage: Storage
    enqueuer: Enqueuer
    # sha256 -> key id, built once: authenticating a request is one hash + one lookup.
    keys: dict[str, str]
    limiter: RateLimiter


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
    (each extra dependency node costs FastAPI measurable time per request)."""

    owner: str
    svc: Services


async def authenticate(request: Request) -> Caller:
    svc: Services = request.app.state.services
    return Caller(await require_key(request, svc), svc)


async def require_key(request: Request, svc: Svc) -> str:
    """The key id of the caller (``dev`` in dev mode); 401 otherwise."""
    if svc.settings.dev_mode:
        return "dev"
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise _unauthorized("missing API key (Authorization: Bearer <key>)")
    owner = owner_of(token.strip(), svc.keys)
    if owner is None:
        raise _unauthorized("unknown API key")
    svc.limiter.check(owner)
    return owner


Owner = Annotated[str, Depends(require_key)]
Auth = Annotated[Caller, Depends(authenticate)]
