from __future__ import annotations

import asyncio
import json

import pytest

from maec_client import AsyncClient, ClientConfig, Conflict, JobFailed, NotFound
from tests.client.conftest import BASE, EXACT
from tests.client.test_client import MERGEKIT_YAML
from tests.client.test_download import FILES


def make(fake, clock) -> AsyncClient:
    async def sleep(s: float) -> None:
        clock.sleep(s)

    t = fake.transport()  # MockTransport serves both the async and the sync (download) side
    return AsyncClient(config=ClientConfig(url=BASE, api_key="k1"), transport=t,
                       sync_transport=t, retry=EXACT, sleep=sleep, clock=clock)


def test_async_round_trip(fake, clock, tmp_path):
    async def scenario():
        async with make(fake, clock) as c:
            fake.fail_next = [503]
            job = await c.submit(MERGEKIT_YAML, name="a")
            assert job.status == "queued" and clock.sleeps == [0.5]
            for _ in range(4):
                fake.add_job()
            ids = [j.id async for j in c.iter_jobs(page_size=2)]
            assert ids == ["j_0005", "j_0004", "j_0003", "j_0002", "j_0001"]
            assert len(await c.list_jobs(limit=3)) == 3
            assert (await c.cancel(job)).status == "cancelled"
            assert (await c.cancel(job.id)).status == "cancelled", "a retried cancel"
            with pytest.raises(Conflict):
                await c.cancel(fake.add_job(status="succeeded")["id"])
            with pytest.raises(NotFound):
                await c.get("j_9999")
            run = fake.add_job(status="running")
            fake.script[run["id"]] = [{}, {"status": "failed", "error": {
                "code": "worker_lost", "message": "gone", "details": {}}}]
            seen = []
            with pytest.raises(JobFailed) as info:
                await c.wait(run["id"], on_progress=lambda j: seen.append(j.status))
            assert info.value.code == "worker_lost" and seen == ["running", "failed"]
            done = fake.add_job()
            fake.finish(done["id"], FILES)
            await c.download(done["id"], tmp_path / "out", part_size=30_000)
        return job

    job = asyncio.run(scenario())
    body = json.loads(fake.requests[1].content)  # after the 503, the resend
    assert body["name"] == "a" and fake.jobs[job.id]["name"] == "a"
    assert {p.relative_to(tmp_path / "out").as_posix(): p.read_bytes()
            for p in (tmp_path / "out").rglob("*") if p.is_file()} == FILES


def test_async_delete_pin_and_unpin(fake, clock):
    async def scenario():
        async with make(fake, clock) as c:
            done = fake.add_job(status="succeeded")
            with pytest.raises(Conflict) as active:
                await c.delete(fake.add_job()["id"])
            assert active.value.code == "job_active"
            assert (await c.pin(done["id"])).pinned is True
            assert (await c.unpin(done["id"])).pinned is False
            await c.delete(done["id"])
            assert done["id"] not in fake.jobs
            with pytest.raises(NotFound):
                await c.delete(done["id"])
            await c.delete(done["id"], missing_ok=True)
            assert [r.method for r in fake.requests[-3:]] == ["DELETE"] * 3

    asyncio.run(scenario())
