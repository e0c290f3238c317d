"""Browser sessions of the /ui pages: an opaque id in a cookie, the key id in Redis.

The cookie holds only a random session id (HttpOnly, SameSite=Strict, path /ui); Redis
holds, under the id's sha256 (a copy of the store does not hand out live cookies), the
key id the session acts for and its form token, with a TTL renewed on every use. The API
key itself is checked once, at login, and is never stored.

Forms carry the session's token and are refused without it (with SameSite=Strict, a
second guard against cross-site posts). The login form, which has no session yet, uses
the same token pattern against a short-lived cookie of its own.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass

import redis.asyncio as aioredis
from fastapi import Request
from fastapi.responses import Response

from app.api.deps import Caller, Services
from app.jobs.keys import PREFIX

COOKIE = "maec_ui"
LOGIN_COOKIE = "maec_ui_login"
COOKIE_PATH = "/ui"
SESSION_SECONDS = 8 * 3600
LOGIN_FORM_SECONDS = 900


def session_key(session_id: str) -> str:
    return f"{PREFIX}ui:session:{hashlib.sha256(session_id.encode()).hexdigest()}"


@dataclass(frozen=True)
class UiSession:
    """A logged-in browser: the key id it acts for, its form token and the services."""

    owner: str
    csrf: str
    svc: Services

    @property
    def caller(self) -> Caller:
        return Caller(self.owner, self.svc)

    def token_ok(self, presented: str | None) -> bool:
        return presented is not None and hmac.compare_digest(presented.encode(),
                                                             self.csrf.encode())


def _redis(svc: Services) -> aioredis.Redis:
    return svc.store.client


def set_cookie(response: Response, request: Request, name: str, value: str,
               max_age: int) -> None:
    # Secure whenever the page came over TLS; a plain-HTTP local run still works.
    response.set_cookie(name, value, max_age=max_age, path=COOKIE_PATH, httponly=True,
                        samesite="strict", secure=request.url.scheme == "https")


def clear_cookie(response: Response, name: str) -> None:
    response.delete_cookie(name, path=COOKIE_PATH, httponly=True, samesite="strict")


async def create(svc: Services, owner: str) -> str:
    """A new session for ``owner``; returns the id to put in the cookie."""
    session_id = secrets.token_urlsafe(32)
    key = session_key(session_id)
    async with _redis(svc).pipeline(transaction=True) as pipe:
        pipe.hset(key, mapping={"owner": owner, "csrf": secrets.token_urlsafe(32)})
        pipe.expire(key, SESSION_SECONDS)
        await pipe.execute()
    return session_id


async def current(request: Request, svc: Services) -> UiSession | None:
    """The request's session, or None (no cookie, expired, or its key was removed)."""
    session_id = request.cookies.get(COOKIE)
    if not session_id or len(session_id) > 128:
        return None
    key = session_key(session_id)
    async with _redis(svc).pipeline(transaction=False) as pipe:
        pipe.hgetall(key)
        pipe.expire(key, SESSION_SECONDS)
        raw, _ = await pipe.execute()
    fields = {k.decode(): v.decode() for k, v in raw.items()}
    owner = fields.get("owner")
    if owner is None or "csrf" not in fields:
        return None
    # A key taken out of the configuration ends its sessions too (dev mode has no keys).
    if not svc.settings.dev_mode and owner not in svc.keys.values():
        return None
    return UiSession(owner, fields["csrf"], svc)


async def end(request: Request, svc: Services) -> None:
    session_id = request.cookies.get(COOKIE)
    if session_id:
        await _redis(svc).delete(session_key(session_id))
