"""A store whose per-owner indexes are under other names (written before owner ids were
length-prefixed) is indexed again from its records by ``python -m app.jobs.reindex``."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis

from app.jobs.api_store import ApiJobStore
from app.jobs.keys import (
    SCHED_PREFIX,
    active_key,
    idem_key,
    owner_key,
    sched_owners_key,
    sched_queue_key,
    usage_key,
)
from app.queue import QUEUE
from tests.api.conftest import Api


def _rename_to_the_old_layout(api: Api, owner: str, idem: str | None) -> None:
    """The indexes as the store used to name them: ``<family>:<owner>``."""
    moves = {owner_key(owner): f"maec:owner:{owner}", active_key(owner): f"maec:active:{owner}",
             sched_queue_key(QUEUE, owner): f"{SCHED_PREFIX}q:{QUEUE}:{owner}",
             usage_key(owner): f"maec:usage:{owner}"}
    if idem:
        moves[idem_key(owner, idem)] = f"maec:idem:{owner}:{idem}"
    for new, old in moves.items():
        if api.r.exists(new):
            api.r.rename(new, old)
    api.r.delete(sched_owners_key(QUEUE))


def test_reindex_rebuilds_lists_queues_replays_and_usage(api: Api) -> None:
    from app.jobs import reindex

    queued = api.submit(api.named(idempotency_key="nightly"))
    done = api.submit(key="bob")
    store = api.worker_store()
    taken = store.take([QUEUE], worker="w", pool=QUEUE, lease_s=30, max_attempts=3,
                       policy="fifo", weights={})
    assert taken.job_id == queued["id"]  # the oldest: alice's; put it back as queued
    api.r.hset(f"maec:job:{queued['id']}", mapping={"status": '"queued"', "attempts": "0"})
    api.r.zadd(sched_queue_key(QUEUE, "alice"), {str(queued["id"]): 1})
    api.r.hset(f"maec:job:{done['id']}", mapping={"status": '"succeeded"',
                                                  "published_bytes": "1234"})
    for owner, idem in (("alice", "nightly"), ("bob", None)):
        _rename_to_the_old_layout(api, owner, idem)
    assert api.client.get("/v1/jobs", headers=api.auth()).json()["jobs"] == []

    counts = reindex.rebuild(api.r)
    assert counts == {"jobs": 2, "active": 1, "queued": 1, "idempotency_keys": 1,
                      "owners": 2}
    assert [j["id"] for j in api.client.get("/v1/jobs", headers=api.auth()).json()[
        "jobs"]] == [queued["id"]]
    assert [j["id"] for j in api.client.get("/v1/jobs", headers=api.auth("bob")).json()[
        "jobs"]] == [done["id"]]
    replay = api.client.post("/v1/jobs", json=api.named(idempotency_key="nightly"),
                             headers=api.auth())
    assert replay.status_code == 200 and replay.json()["id"] == queued["id"]
    assert api.r.get(usage_key("bob")) == b"1234"
    assert api.r.smembers(active_key("alice")) == {str(queued["id"]).encode()}
    again = store.take([QUEUE], worker="w2", pool=QUEUE, lease_s=30, max_attempts=3,
                       policy="fair", weights={})
    assert again.job_id == queued["id"]  # the scheduler finds it under the new names
    assert reindex.rebuild(api.r)["jobs"] == 2  # running it again is harmless


def test_reindex_entry_point_reads_the_settings(api: Api,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    from app.jobs import reindex
    from app.settings import get_settings

    api.submit()
    api.r.delete(owner_key("alice"))
    monkeypatch.setenv("MAEC_REDIS_URL", api.settings.redis_url)
    monkeypatch.setenv("MAEC_DEV_MODE", "true")
    get_settings.cache_clear()
    try:
        assert reindex.main() == 0
    finally:
        get_settings.cache_clear()

    async def listed() -> int:
        store = ApiJobStore(aioredis.Redis.from_url(api.settings.redis_url))
        try:
            return len((await store.list("alice", status=None, limit=10, cursor=None)).jobs)
        finally:
            await store.close()

    assert asyncio.run(listed()) == 1
