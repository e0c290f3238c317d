"""Retention over the real stack: expiry, pin, delete, quota, artifact collection, and a
download cut by a deletion (an error, never a file the client accepts).

One module stack with S3 storage whose jobs expire seconds after they end (pinned ones
stay) and whose unreferenced artifacts are collected two seconds after their last use;
the quota test starts its own stack (the quota is a start-up setting).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import redis

from app.jobs.keys import usage_key
from maec_client import Client
from maec_client.errors import ClientError, Conflict, NotFound
from tests.conftest import StackFactory, TinyModels
from tests.stack import API_KEYS, S3_BUCKET, Stack, wait_for

pytestmark = pytest.mark.integration
TTL_S = 4.0


@pytest.fixture(scope="module")
def rstack(make_module_stack: StackFactory, tiny_models: TinyModels) -> Stack:
    return make_module_stack(storage="s3", workers=1, local_roots=[tiny_models.root], env={
        "MAEC_JOB_TTL_DAYS": repr(TTL_S / 86400),
        "MAEC_ARTIFACT_GRACE_SECONDS": "2",
        "MAEC_RETENTION_SWEEP_SECONDS": "0.5",
    })


def _body(m: TinyModels, method: str = "task_arithmetic", **kw: Any) -> dict[str, Any]:
    return {"method": method, "base": str(m.base), "ability_donor": [str(m.donor)],
            "language_base": str(m.lang), **kw}


def _keys(stack: Stack, prefix: str) -> list[str]:
    assert stack.s3 is not None
    listed = stack.s3.client().list_objects_v2(Bucket=S3_BUCKET, Prefix=prefix)
    return [o["Key"] for o in listed.get("Contents", [])]


def _client(stack: Stack, key: str = "alice") -> Client:
    return Client(stack.base_url, API_KEYS[key], max_retries=0)


def _gone(stack: Stack, job_id: str) -> bool:
    with stack.client() as c:
        return c.get(f"/v1/jobs/{job_id}").status_code == 404


def test_unpinned_jobs_expire_with_their_files_pinned_ones_stay(
        rstack: Stack, tiny_models: TinyModels) -> None:
    loose = rstack.submit(_body(tiny_models))
    kept = rstack.submit(_body(tiny_models, pinned=True))
    assert kept["pinned"] is True and loose["pinned"] is False
    for job in (loose, kept):
        assert rstack.wait(job["id"])["status"] == "succeeded"
    wait_for(lambda: _gone(rstack, loose["id"]), 30, "expiry of the unpinned job")
    # The record goes first (with its prefix queued for deletion), the files right after.
    wait_for(lambda: _keys(rstack, f"jobs/{loose['id']}/") == [], 10, "expired files")
    # Well past the TTL, the pinned one is whole and downloadable.
    assert not _gone(rstack, kept["id"])
    assert any(k.endswith("manifest.json") for k in _keys(rstack, f"jobs/{kept['id']}/"))
    with rstack.client() as c:
        assert c.get(f"/v1/jobs/{kept['id']}/files/manifest.json").status_code == 200
    with _client(rstack) as client:
        assert client.unpin(kept["id"]).pinned is False
    wait_for(lambda: _gone(rstack, kept["id"]), 30, "expiry once unpinned")
    wait_for(lambda: _keys(rstack, f"jobs/{kept['id']}/") == [], 10, "expired files")


def test_delete_needs_a_finished_job_and_removes_its_files(
        rstack: Stack, tiny_models: TinyModels, corpus: Path) -> None:
    slow = rstack.submit(_body(
        tiny_models, "maec", pinned=True, ability_corpus=str(corpus),
        parameters={"importance": "gradient", "token_budget": 600000, "seq_len": 64,
                    "batch_size": 8}))
    with _client(rstack) as client, _client(rstack, "bob") as bob:
        with pytest.raises(Conflict) as active:
            client.delete(slow["id"])
        assert active.value.code == "job_active"
        client.cancel(slow["id"])
        assert rstack.wait(slow["id"], timeout=60)["status"] == "cancelled"
        client.delete(slow["id"])
        job = rstack.wait(rstack.submit(_body(tiny_models, pinned=True))["id"])
        assert job["status"] == "succeeded" and _keys(rstack, f"jobs/{job['id']}/")
        with pytest.raises(NotFound):
            bob.delete(job["id"])  # another key's job is as good as absent
        client.delete(job["id"])
        assert _keys(rstack, f"jobs/{job['id']}/") == []
        with pytest.raises(NotFound) as again:
            client.get(job["id"])
        assert again.value.code == "job_not_found"
        with pytest.raises(NotFound):
            client.delete(job["id"])
        client.delete(job["id"], missing_ok=True)


def test_unreferenced_artifacts_are_collected_after_the_grace(
        rstack: Stack, tiny_models: TinyModels) -> None:
    job = rstack.wait(rstack.submit(_body(
        tiny_models, "maec", pinned=True, parameters={"key_ratio": 0.25}))["id"])
    assert job["status"] == "succeeded", job["error"]
    keys = job["result"]["report"]["artifact_keys"]
    assert keys
    prefixes = [f"artifacts/{k}/" for k in keys]
    assert all(_keys(rstack, p) for p in prefixes)
    with pytest.raises(TimeoutError):  # referenced: kept well past the grace period
        wait_for(lambda: not any(_keys(rstack, p) for p in prefixes), 4, "collection")
    with _client(rstack) as client:
        client.delete(job["id"])
    wait_for(lambda: not any(_keys(rstack, p) for p in prefixes), 30, "collection")


def test_a_download_cut_by_a_delete_is_an_error_not_a_file(
        rstack: Stack, tiny_models: TinyModels, tmp_path: Path) -> None:
    job = rstack.wait(rstack.submit(_body(tiny_models, pinned=True))["id"])
    assert job["status"] == "succeeded"
    dest = tmp_path / "out"
    deleted: list[int] = []

    def delete_after_first_bytes(done: int, total: int) -> None:
        if not deleted and done:
            with rstack.client() as c:
                deleted.append(c.delete(f"/v1/jobs/{job['id']}").status_code)

    with _client(rstack) as client:
        current = client.get(job["id"])
        with pytest.raises(ClientError) as failed:
            client.download(current, dest, workers=1, part_size=1024,
                            on_bytes=delete_after_first_bytes)
        assert deleted == [204]
        assert failed.value.code in ("job_not_found", "network_error")
        assert not dest.exists()
        # Resuming finds nothing to resume from: the same clear error, still no folder.
        with pytest.raises(NotFound):
            client.download(current, dest, workers=1)
        assert not dest.exists()


def test_storage_quota_refuses_submissions_and_fails_jobs_past_it(
        make_stack: StackFactory, tiny_models: TinyModels) -> None:
    stack = make_stack(storage="local", local_roots=[tiny_models.root])
    r = redis.Redis.from_url(stack.redis_url)
    first = stack.wait(stack.submit(_body(tiny_models), key="bob")["id"], key="bob")
    assert first["status"] == "succeeded"
    used = int(r.get(usage_key("bob")) or 0)
    assert used == sum(f["size"] for f in first["result"]["files"])
    # Exactly one such output per key from now on (API and worker read the setting).
    quota = {"MAEC_STORAGE_QUOTA_BYTES_PER_KEY": str(used)}
    stack.restart_api(quota)
    stack.stop_worker(0)
    stack.start_worker(quota)
    with stack.client("bob") as c:
        refused = c.post("/v1/jobs", json=_body(tiny_models))
    assert refused.status_code == 413 and refused.json()["code"] == "quota_exceeded"
    half = stack.wait(stack.submit(_body(tiny_models, dtype="float16"))["id"])
    assert half["status"] == "succeeded", half["error"]
    over = stack.wait(stack.submit(_body(tiny_models))["id"])
    assert over["status"] == "failed" and over["error"]["code"] == "quota_exceeded"
    assert not (stack.root / "storage" / "jobs" / over["id"]).exists()
    with Client(stack.base_url, API_KEYS["bob"]) as bob:
        bob.delete(first["id"])
        again = bob.wait(bob.submit(_body(tiny_models)))
    assert again.status == "succeeded"
