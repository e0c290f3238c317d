"""The one retry policy, and that the sync client, async client and downloads follow it."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from maec_client import AsyncClient, Client, ClientConfig, NetworkError, NotFound, ServerError
from maec_client.errors import RateLimited, error_from_response
from maec_client.retry import RetryPolicy
from tests.client.conftest import BASE
from tests.client.test_download import FILES


def unavailable(retry_after: str | None = None) -> ServerError:
    exc = error_from_response(503, {"code": "unavailable", "message": "m", "details": {}},
                              retry_after)
    assert isinstance(exc, ServerError)
    return exc


def test_backoff_doubles_to_the_cap_and_jitter_only_shortens():
    exact = RetryPolicy(backoff=0.5, max_backoff=3.0, jitter=0.0)
    assert [exact.delay(a) for a in range(5)] == [0.5, 1.0, 2.0, 3.0, 3.0]
    low = RetryPolicy(backoff=0.5, jitter=0.5, rand=lambda: 0.999)
    high = RetryPolicy(backoff=0.5, jitter=0.5, rand=lambda: 0.0)
    for attempt in range(4):
        full = 0.5 * 2 ** attempt
        assert high.delay(attempt) == full
        assert full * 0.5 < low.delay(attempt) < full * 0.51
    # The default draws: two clients refused together come back apart.
    assert len({RetryPolicy().delay(2) for _ in range(20)}) > 1


def test_retry_after_wins_over_backoff_and_is_capped():
    policy = RetryPolicy(jitter=0.5, max_retry_after=60.0)
    assert policy.delay(0, unavailable("7")) == 7.0
    assert policy.delay(3, RateLimited("rate_limited", "m", retry_after=0.0)) == 0.0
    assert policy.delay(0, RateLimited("rate_limited", "m", retry_after=9999.0)) == 60.0
    assert policy.delay(0, unavailable("Wed, 21 Oct 2015 07:28:00 GMT")) <= 0.5


def test_what_is_retried():
    policy = RetryPolicy()
    assert policy.retryable(httpx.ConnectError("x"))
    assert policy.retryable(httpx.ReadError("x"))
    assert policy.retryable(unavailable())
    assert policy.retryable(RateLimited("too_many_jobs", "m"))
    assert not policy.retryable(NotFound("job_not_found", "m", status=404))
    assert not policy.retryable(ServerError("internal_error", "m", status=500))
    assert not policy.retryable(ValueError("x"))
    with pytest.raises(ValueError):
        RetryPolicy(jitter=1.5)


def test_call_retries_up_to_max_then_raises_the_last_error():
    sleeps: list[float] = []
    outcomes: list[object] = [httpx.ConnectError("a"), unavailable(), "ok"]

    def send() -> object:
        out = outcomes.pop(0)
        if isinstance(out, Exception):
            raise out
        return out

    policy = RetryPolicy(max_retries=2, jitter=0.0)
    assert policy.call(send, sleeps.append) == "ok" and sleeps == [0.5, 1.0]
    outcomes[:] = [unavailable(), unavailable("4"), unavailable()]
    with pytest.raises(ServerError):
        policy.call(send, sleeps.append)
    assert sleeps[2:] == [0.5, 4.0] and outcomes == []
    outcomes[:] = [unavailable(), "ok"]
    with pytest.raises(ServerError):
        policy.call(send, sleeps.append, enabled=False)
    with pytest.raises(NotFound):  # not retryable: raised at once
        policy.call(lambda: (_ for _ in ()).throw(NotFound("job_not_found", "m", status=404)),
                    sleeps.append)
    assert len(sleeps) == 4


def scripted(statuses: list[int], headers: dict[str, str]) -> httpx.MockTransport:
    def handle(request: httpx.Request) -> httpx.Response:
        status = statuses.pop(0) if statuses else 200
        if status == 0:
            raise httpx.ConnectError("refused")
        if status != 200:
            return httpx.Response(status, json={"code": "unavailable", "message": "m",
                                                "details": {}}, headers=headers)
        return httpx.Response(200, json={"status": "ok"})

    return httpx.MockTransport(handle)


def test_sync_and_async_clients_honour_retry_after_on_503():
    sleeps: list[float] = []
    policy = RetryPolicy(jitter=0.0)
    with Client(config=ClientConfig(url=BASE), transport=scripted([503, 0], {"Retry-After": "2"}),
                retry=policy, sleep=sleeps.append) as c:
        assert c.health() == {"status": "ok"}
    assert sleeps == [2.0, 1.0]  # the server's word, then backoff for the connect error

    async def scenario() -> None:
        async def sleep(s: float) -> None:
            sleeps.append(s)

        async with AsyncClient(config=ClientConfig(url=BASE), retry=policy, sleep=sleep,
                               transport=httpx.MockTransport(
                                   lambda r: httpx.Response(502, text="bad gateway"))) as c:
            with pytest.raises(ServerError) as info:
                await c.health()
            assert info.value.code == "http_502"

    sleeps.clear()
    asyncio.run(scenario())
    assert sleeps == [0.5, 1.0, 2.0]


def test_network_error_after_the_policy_gives_up():
    sleeps: list[float] = []
    policy = RetryPolicy(max_retries=1, jitter=0.0)
    with (Client(config=ClientConfig(url=BASE), transport=scripted([0, 0], {}),
                 retry=policy, sleep=sleeps.append) as c,
          pytest.raises(NetworkError)):
        c.health()
    assert sleeps == [0.5]


def test_download_ranges_wait_as_the_policy_says(client, fake, clock, tmp_path):
    job = fake.finish(fake.add_job()["id"], FILES)
    current = client.get(job["id"])
    fake.fail_next = [503, 429]  # the first file requests: retried per the policy
    client.download(current, tmp_path / "out", workers=1, part_size=10**9)
    # 503 without Retry-After: backoff; the fake's 429 says Retry-After: 0.
    assert clock.sleeps == [0.5, 0.0]
    assert {p.name for p in (tmp_path / "out").rglob("*") if p.is_file()} == {
        p.split("/")[-1] for p in FILES}
