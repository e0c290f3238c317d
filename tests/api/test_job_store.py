"""The job record's state machine: claims, leases, attempts, guarded writes, cancel."""

from __future__ import annotations

import time

from app.jobs.keys import active_key, job_key
from app.jobs.record import STATUSES
from app.jobs.worker_store import WorkerJobStore
from tests.api.conftest import Api


def _job(api: Api) -> str:
    return str(api.submit()["id"])


def test_claim_is_compare_and_set(api: Api) -> None:
    store, jid = api.worker_store(), _job(api)
    first = store.claim(jid, worker="w1", lease_s=30, max_attempts=3)
    assert (first.outcome, first.attempt) == ("claimed", 1)
    # A redelivered message while the lease is live does nothing.
    assert store.claim(jid, worker="w2", lease_s=30, max_attempts=3).outcome == "busy"
    rec = store.get(jid)
    assert rec is not None
    assert (rec.status, rec.attempts, rec.worker, rec.stage) == ("running", 1, "w1", "fetch")
    assert rec.started_at is not None
    counts = api.client.get("/metrics", headers=api.operator()).text
    assert 'maec_jobs{status="running"} 1.0' in counts
    assert 'maec_jobs{status="queued"} 0.0' in counts


def test_expired_lease_is_reclaimed_and_stale_writes_are_refused(api: Api) -> None:
    store, jid = api.worker_store(), _job(api)
    store.claim(jid, worker="w1", lease_s=0.05, max_attempts=3)
    time.sleep(0.1)
    second = store.claim(jid, worker="w2", lease_s=30, max_attempts=3)
    assert (second.outcome, second.attempt) == ("claimed", 2)
    # The first attempt's worker wakes up: every write of it is refused.
    assert store.update(jid, 1, {"stage": "combine"}) == -1
    ok, prev = store.transition(jid, allowed=("running",), to="succeeded", attempt=1)
    assert (ok, prev) == (False, "running")
    assert store.update(jid, 2, {"stage": "combine"}) == 0
    ok, _ = store.transition(jid, allowed=("running",), to="succeeded", attempt=2,
                             metrics={"finished_total:succeeded": 1})
    assert ok
    assert store.claim(jid, worker="w3", lease_s=30, max_attempts=3).outcome == "done"


def test_attempts_are_bounded(api: Api) -> None:
    store, jid = api.worker_store(), _job(api)
    assert api.r.scard(active_key("alice")) == 1
    for n in (1, 2):
        assert store.claim(jid, worker="w", lease_s=0.01, max_attempts=2).attempt == n
        time.sleep(0.03)
    last = store.claim(jid, worker="w", lease_s=0.01, max_attempts=2)
    assert last.outcome == "exhausted"
    rec = store.get(jid)
    assert rec is not None and rec.status == "failed" and rec.error is not None
    assert rec.error["code"] == "worker_lost" and rec.attempts == 2
    assert api.r.scard(active_key("alice")) == 0


def test_cancel_flag_reaches_the_worker(api: Api) -> None:
    store, jid = api.worker_store(), _job(api)
    store.claim(jid, worker="w", lease_s=30, max_attempts=3)
    assert store.update(jid, 1, {}) == 0 and not store.cancel_requested(jid)
    r = api.client.post(f"/v1/jobs/{jid}/cancel", headers=api.auth())
    assert r.status_code == 202 and r.json()["status"] == "running"
    assert r.json()["cancel_requested"] is True
    assert store.update(jid, 1, {"progress": {"fraction": 0.5, "done": 1, "total": 2}}) == 1
    assert store.cancel_requested(jid)


def test_cancelled_before_claim_is_never_run(api: Api) -> None:
    store, jid = api.worker_store(), _job(api)
    api.client.post(f"/v1/jobs/{jid}/cancel", headers=api.auth())
    assert store.claim(jid, worker="w", lease_s=30, max_attempts=3).outcome == "done"
    assert store.claim("j_missing", worker="w", lease_s=30, max_attempts=3).outcome == \
        "missing"


def test_reading_a_job_is_one_round_trip(api: Api) -> None:
    """A started job (what clients poll longest): one HGETALL. A queued one also reads
    its place in the scheduler's queue (checked below)."""
    jid = _job(api)
    WorkerJobStore(api.r).claim(jid, worker="w", lease_s=30, max_attempts=3)

    def counts() -> dict[str, int]:
        stats = api.r.info("commandstats")
        return {c: int(stats.get(f"cmdstat_{c}", {}).get("calls", 0))
                for c in ("hgetall", "evalsha", "hmget", "hset", "pexpire")}

    before = counts()
    calls = api.r.info("stats")["total_commands_processed"]
    assert api.client.get(f"/v1/jobs/{jid}", headers=api.auth()).status_code == 200
    total = api.r.info("stats")["total_commands_processed"] - calls
    used = {c: n - before[c] for c, n in counts().items()}
    # With a key, the request's rate-limit check is one more call, sent alongside the
    # read (app/api/limits.py): one EVALSHA and the commands its script runs in Redis.
    limiter = used["evalsha"] + used["hmget"] + used["hset"] + used["pexpire"]
    assert used["evalsha"] == 1
    # Our INFO calls are commands too; everything else is the one HGETALL.
    assert total - limiter <= 3
    assert used["hgetall"] == 1
    assert WorkerJobStore(api.r).get(jid) is not None
    assert api.r.type(job_key(jid)) == b"hash"


def test_concurrent_reads_share_a_round_trip_and_stay_correct(api: Api) -> None:
    import asyncio

    import redis.asyncio as aioredis

    from app.jobs.batching import HashReader

    ids = [_job(api) for _ in range(3)]

    async def main() -> tuple[list[dict[bytes, bytes]], int, Exception | None]:
        client = aioredis.Redis.from_url(api.settings.redis_url)
        reader = HashReader(client)
        def hgetalls() -> int:  # absent until the server's first HGETALL
            return int(api.r.info("commandstats").get("cmdstat_hgetall", {}).get("calls", 0))

        before = hgetalls()
        keys = [f"maec:job:{i}" for i in ids * 20] + ["maec:job:j_missing"]
        got = await asyncio.gather(*(reader.hgetall(k) for k in keys))
        calls = hgetalls() - before
        broken = HashReader(aioredis.Redis(port=1))
        try:
            await broken.hgetall("x")
            error = None
        except Exception as exc:
            error = exc
        await client.aclose()
        return got, calls, error

    got, calls, error = asyncio.run(main())
    for i, raw in enumerate(got[:-1]):
        assert raw[b"id"] == f'"{ids[i % 3]}"'.encode()
    assert got[-1] == {}
    assert calls == 4, "61 concurrent reads of 4 distinct jobs: 4 HGETALLs, one pipeline"
    assert error is not None


def test_reads_arriving_during_a_round_trip_share_the_next_one(api: Api) -> None:
    """One batch in flight at a time: everything that arrives meanwhile goes out in the
    following batch, across event-loop ticks; an error reaches only its own batch."""
    import asyncio

    import redis.asyncio as aioredis

    from app.jobs.batching import HashReader

    jid = _job(api)

    class Gated:
        """The real client, with each round trip held until the test releases it."""

        def __init__(self, real: aioredis.Redis) -> None:
            self.real, self.trips, self.fail_next = real, 0, False
            self.gate = asyncio.Event()

        async def hgetall(self, key: str) -> dict[bytes, bytes]:
            self.trips += 1
            await self.gate.wait()
            if self.fail_next:
                self.fail_next = False
                raise ConnectionError("injected")
            return await self.real.hgetall(key)  # type: ignore[no-any-return, misc]

    async def main() -> tuple[int, list[object]]:
        real = aioredis.Redis.from_url(api.settings.redis_url)
        client = Gated(real)
        reader = HashReader(client)  # type: ignore[arg-type]
        client.fail_next = True
        first = asyncio.ensure_future(reader.hgetall(f"maec:job:{jid}"))
        while client.trips == 0:
            await asyncio.sleep(0)
        later = []
        for _ in range(20):  # twenty separate ticks while the first trip is out
            later.append(asyncio.ensure_future(reader.hgetall(f"maec:job:{jid}")))
            await asyncio.sleep(0)
        client.gate.set()
        got = await asyncio.gather(first, *later, return_exceptions=True)
        await real.aclose()
        return client.trips, got

    trips, got = asyncio.run(main())
    assert trips == 2, "the 20 later reads went out together, in one round trip"
    assert isinstance(got[0], ConnectionError)
    for raw in got[1:]:
        assert isinstance(raw, dict) and raw[b"id"] == f'"{jid}"'.encode()


def test_an_attempt_killed_at_the_hard_time_limit_is_not_rerun(api: Api) -> None:
    store, jid = api.worker_store(), _job(api)
    store.claim(jid, worker="w1", lease_s=0.05, max_attempts=3, time_limit_s=0.1)
    time.sleep(0.15)  # the child was killed at the limit; its lease lapsed
    res = store.claim(jid, worker="w2", lease_s=30, max_attempts=3, time_limit_s=0.1)
    assert (res.outcome, res.attempt) == ("time_limit", 1)
    rec = store.get(jid)
    assert rec is not None and rec.status == "failed" and rec.error is not None
    assert rec.error["code"] == "time_limit"
    # A crash well inside the limit is retried instead.
    other = _job(api)
    store.claim(other, worker="w1", lease_s=0.05, max_attempts=3, time_limit_s=60)
    time.sleep(0.1)
    assert store.claim(other, worker="w2", lease_s=30, max_attempts=3,
                       time_limit_s=60).outcome == "claimed"


def test_scripts_name_no_key_and_take_exactly_their_arguments() -> None:
    import pytest

    from app.jobs import scripts
    from app.jobs.keys import PREFIX

    for script in scripts.ALL:
        assert PREFIX not in script.lua, f"{script.name} spells a key prefix"
    with pytest.raises(ValueError, match="takes keys"):
        scripts.UPDATE.pack({"job": "k"}, {})
    with pytest.raises(ValueError, match="takes keys"):
        scripts.UPDATE.pack({"job": "k", "other": "k2"}, {"attempt": 1})
    keys, args = scripts.CANCEL.pack({"job": "k"}, {"now_ms": 3, "id": "i", "now_iso": "t"})
    assert keys[0] == "k" and len(keys) == 1 + len(STATUSES)
    assert args[:3] == ["i", "t", 3]  # the declared order, whatever order they came in
    with pytest.raises(ValueError, match="bad or repeated"):
        scripts.Script("bad", ("job",), ("end",), "return 0")


def test_the_worker_never_touches_the_redis_client() -> None:
    """Every Redis access of the worker goes through the store's methods."""
    import ast
    from pathlib import Path

    for path in sorted((Path(__file__).parents[2] / "worker").glob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            else:
                names = []
            assert not [n for n in names if n.split(".")[0] == "redis"], path.name
            if isinstance(node, ast.Attribute):
                assert node.attr not in ("r", "_r", "client"), f"{path.name}:{node.lineno}"


def test_reading_a_queued_job_also_reads_its_place(api: Api) -> None:
    jid = _job(api)
    calls = api.r.info("stats")["total_commands_processed"]
    job = api.client.get(f"/v1/jobs/{jid}", headers=api.auth()).json()
    total = api.r.info("stats")["total_commands_processed"] - calls
    assert job["queue"]["position"] == 0 and job["queue"]["pool"] == job["pool"]
    # HGETALL, the limiter's script (and what it runs), the pool's owners, one count per
    # owner and band, the workers and recent durations: a handful, not a scan.
    assert total <= 14
