"""Rate limits live in Redis: two API instances over one Redis enforce one limit per key,
per key's submissions and per client address's failed authentications (which refuse
failed attempts only, never a valid key from the same address)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

import httpx
from fastapi.testclient import TestClient

from app.api.main import create_app
from app.settings import Settings
from tests.api.conftest import Api
from tests.stack import API_KEYS, free_port


@contextmanager
def instances(settings: Settings, *addresses: str) -> Iterator[list[TestClient]]:
    """One API app per address, all on ``settings`` (so on the same Redis DB)."""
    with ExitStack() as stack:
        yield [stack.enter_context(TestClient(create_app(settings), client=(a, 50000),
                                              raise_server_exceptions=False))
               for a in addresses]


def auth(key: str = "alice") -> dict[str, str]:
    return {"Authorization": f"Bearer {API_KEYS[key]}"}


def _is_429(resp: httpx.Response, max_wait: int) -> None:
    assert resp.status_code == 429, resp.text
    body = resp.json()
    assert set(body) == {"code", "message", "details"} and body["code"] == "rate_limited"
    assert 1 <= int(resp.headers["retry-after"]) <= max_wait
    assert body["details"]["retry_after"] == int(resp.headers["retry-after"])


def test_request_limit_is_shared_by_two_api_instances(api_factory: object) -> None:
    api: Api = api_factory()  # type: ignore[operator]
    # 6 a minute: a token every 10 s, so no refill between the quick requests below.
    settings = api.settings.model_copy(update={"rate_limit_per_minute": 6,
                                               "rate_limit_burst": 5})
    with instances(settings, "10.0.0.1", "10.0.0.2") as (a, b):
        codes = [c.get("/v1/jobs", headers=auth()).status_code for c in (a, b, a, b, a)]
        assert codes == [200] * 5
        for c in (a, b):  # the key's bucket is empty on both
            _is_429(c.get("/v1/jobs", headers=auth()), 10)
            _is_429(c.get("/v1/jobs/j_0", headers=auth()), 10)  # the hot route too
        assert b.get("/v1/jobs", headers=auth("bob")).status_code == 200  # per key
        assert a.get("/healthz").status_code == 200  # health is never limited
    assert any(k.startswith(b"maec:limit:req:") for k in api.r.scan_iter("maec:limit:*"))


def test_submission_limit_is_shared_by_two_api_instances(api_factory: object) -> None:
    api: Api = api_factory()  # type: ignore[operator]
    settings = api.settings.model_copy(update={"submissions_per_minute": 3})
    with instances(settings, "10.0.0.1", "10.0.0.2") as (a, b):
        for c in (a, b, a):
            r = c.post("/v1/jobs", json=api.named(), headers=auth())
            assert r.status_code == 202, r.text
        r = b.post("/v1/jobs", json=api.named(), headers=auth())
        _is_429(r, 20)
        assert r.json()["details"]["limit"] == 3
        assert a.post("/v1/jobs", json=api.named(), headers=auth("bob")).status_code == 202


def test_failed_authentication_is_limited_per_address(api_factory: object) -> None:
    api: Api = api_factory()  # type: ignore[operator]
    settings = api.settings.model_copy(update={"auth_failures_per_minute": 6,
                                               "auth_failure_burst": 3})
    guess = {"Authorization": "Bearer not-a-key"}
    with instances(settings, "10.0.0.7", "10.0.0.7", "10.0.0.8") as (a, b, other):
        codes = [c.get("/v1/jobs", headers=guess).status_code for c in (a, b, a)]
        assert codes == [401] * 3
        # Over the limit on both instances, for failed attempts only.
        for c in (b, a):
            _is_429(c.get("/v1/jobs", headers=guess), 10)
        _is_429(a.get("/v1/jobs"), 10)  # no key at all counts as a failure too
        # A valid key from the same address (one NAT, one proxy) is not locked out, on
        # either instance, on the listed and the hot route.
        for c in (a, b):
            assert c.get("/v1/jobs", headers=auth()).status_code == 200
            assert c.get(f"/v1/jobs/{'j_' + '0' * 24}", headers=auth()).status_code == 404
        # ... and its success does not refill the bucket for the guesses.
        _is_429(b.get("/v1/jobs", headers=guess), 10)
        # Another address is not affected.
        assert other.get("/v1/jobs", headers=auth()).status_code == 200
        assert other.get("/v1/jobs", headers=guess).status_code == 401


def test_limits_let_requests_through_when_redis_is_down(api_factory: object) -> None:
    api: Api = api_factory()  # type: ignore[operator]
    settings = api.settings.model_copy(
        update={"redis_url": f"redis://127.0.0.1:{free_port()}/0"})
    with instances(settings, "10.0.0.1") as (a,):
        # The store's own error (503 unavailable), not one from the limiter or a 500.
        r = a.get("/v1/jobs/j_0", headers=auth())
        assert (r.status_code, r.json()["code"]) == (503, "unavailable")
        r = a.get("/readyz", headers=auth())
        assert r.status_code == 503 and r.json()["redis"] is False
        assert a.get("/v1/jobs", headers={"Authorization": "Bearer x"}).status_code == 401


def test_concurrent_checks_share_one_script_call_and_stay_exact(api_factory: object) -> None:
    import asyncio

    import redis.asyncio as aioredis

    from app.api.errors import ApiError
    from app.api.limits import Limits

    api: Api = api_factory()  # type: ignore[operator]
    settings = api.settings.model_copy(update={"rate_limit_per_minute": 6,
                                               "rate_limit_burst": 5})

    def evalshas() -> int:
        return int(api.r.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0))

    async def main() -> tuple[list[bool], int]:
        limits = Limits(aioredis.Redis.from_url(settings.redis_url), settings)
        await limits.request("warm").check()  # loads the script
        before = evalshas()
        outcomes = await asyncio.gather(
            *(limits.request("alice").check() for _ in range(8)),
            return_exceptions=True)
        calls = evalshas() - before
        await limits.close()
        for o in outcomes:
            assert o is None or (isinstance(o, ApiError) and o.http_status == 429), o
        return [o is None for o in outcomes], calls

    admitted, calls = asyncio.run(main())
    assert admitted.count(True) == 5 and admitted[:5] == [True] * 5
    assert calls == 1


def test_forty_failed_logins_do_not_lock_a_valid_key_out(api_factory: object) -> None:
    """The defaults: a burst of failures from one address (a guesser behind the same NAT)
    gets 429s; everyone else's valid keys from that address keep working meanwhile."""
    api: Api = api_factory()  # type: ignore[operator]
    guess = {"Authorization": "Bearer wrong"}
    with instances(api.settings, "10.0.0.40") as (a,):
        codes = [a.get("/v1/jobs", headers=guess).status_code for _ in range(40)]
        assert codes.count(401) == api.settings.auth_failure_burst
        assert codes[-1] == 429
        for key in ("alice", "bob"):
            assert a.get("/v1/jobs", headers=auth(key)).status_code == 200
        _is_429(a.get("/v1/jobs", headers=guess), 60)
