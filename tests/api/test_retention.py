"""Retention in-process: delete, pin, expiry, storage quota and artifact references.

The real app and a real Redis; jobs run with ``JobRunner`` over local storage. The
sweeps are called directly (the worker's heartbeat calls the same methods).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, cast

from app.jobs.keys import ORPHANS_KEY, UNREFERENCED_KEY, idem_key, refs_key, usage_key
from app.settings import Settings
from app.storage.local import LocalStorage
from tests.api.conftest import Api
from worker.runner import JobRunner
from worker.sweeper import sweep_retention

ART = "a" * 64


def _run(api: Api, jid: str, settings: Settings | None = None) -> str:
    return JobRunner(settings or api.settings, api.worker_store(),
                     LocalStorage(api.settings.storage_dir), worker="test").run(jid)


def _finished(api: Api, key: str = "alice", **kw: Any) -> dict[str, Any]:
    job = api.submit(api.named(**kw), key=key)
    assert _run(api, str(job["id"])) == "succeeded"
    return _get(api, str(job["id"]), key).json()  # type: ignore[no-any-return]


def _get(api: Api, jid: str, key: str = "alice") -> Any:
    return api.client.get(f"/v1/jobs/{jid}", headers=api.auth(key))


def _delete(api: Api, jid: str, key: str = "alice") -> Any:
    return api.client.delete(f"/v1/jobs/{jid}", headers=api.auth(key))


def _outputs(api: Api, jid: str) -> Path:
    return Path(api.settings.storage_dir) / "jobs" / jid


def _usage(api: Api, owner: str = "alice") -> int:
    raw = cast(bytes | None, api.r.get(usage_key(owner)))
    return 0 if raw is None else int(raw)


def test_delete_removes_files_record_and_every_index_entry(api: Api) -> None:
    job = _finished(api, idempotency_key="k1")
    jid = job["id"]
    nbytes = sum(f["size"] for f in job["result"]["files"])
    assert _outputs(api, jid).is_dir() and _usage(api) == nbytes
    assert job["pinned"] is False
    # Another key sees the same 404 as for a job that never existed.
    for key, target in (("bob", jid), ("alice", "j_00000000000000000000")):
        r = _delete(api, target, key)
        assert (r.status_code, r.json()["code"]) == (404, "job_not_found")
    r = _delete(api, jid)
    assert r.status_code == 204 and r.content == b""
    assert not _outputs(api, jid).exists()
    assert _get(api, jid).status_code == 404
    again = _delete(api, jid)
    assert (again.status_code, again.json()["code"]) == (404, "job_not_found")
    listed = api.client.get("/v1/jobs", headers=api.auth()).json()["jobs"]
    assert jid not in [j["id"] for j in listed]
    assert api.r.zscore("maec:status:succeeded", jid) is None
    assert api.r.get(idem_key("alice", "k1")) is None and api.r.scard(ORPHANS_KEY) == 0
    assert _usage(api) == 0 and api.r.get(usage_key("alice")) is None
    # The idempotency key is free again: the same body makes a new job.
    fresh = api.submit(api.named(idempotency_key="k1"))
    assert fresh["id"] != jid


def test_a_queued_or_running_job_is_not_deleted_until_cancelled(api: Api) -> None:
    jid = str(api.submit()["id"])
    r = _delete(api, jid)
    assert r.status_code == 409 and r.json()["code"] == "job_active"
    assert r.json()["details"]["status"] == "queued"
    api.worker_store().claim(jid, worker="w", lease_s=30, max_attempts=3)
    r = _delete(api, jid)
    assert r.status_code == 409 and r.json()["details"]["status"] == "running"
    assert _get(api, jid).json()["status"] == "running"
    api.worker_store().transition(jid, allowed=("running",), to="cancelled", attempt=1)
    assert _delete(api, jid).status_code == 204


def test_a_deletion_the_store_refuses_is_finished_by_the_workers(api: Api) -> None:
    jid = _finished(api)["id"]
    outputs = _outputs(api, jid)
    # A stand-in for an unreachable store: the prefix cannot be removed.
    services = cast(Any, api.client.app).state.services
    services.storage = _Refusing(api.settings.storage_dir)
    assert _delete(api, jid).status_code == 204
    assert _get(api, jid).status_code == 404 and outputs.exists()
    assert api.r.smembers(ORPHANS_KEY) == {f"jobs/{jid}/".encode()}
    assert api.worker_store().clean_orphans(api.storage()) == [f"jobs/{jid}/"]
    assert not outputs.exists()


class _Refusing(LocalStorage):
    def delete_prefix(self, prefix: str) -> None:
        from app.storage.base import StorageError

        raise StorageError("store unreachable")


def test_pinned_jobs_outlive_expiry_and_unpinned_ones_go_with_their_files(api: Api) -> None:
    kept = _finished(api, pinned=True)
    gone = _finished(api)
    assert kept["pinned"] is True and gone["pinned"] is False
    store, storage = api.worker_store(), api.storage()
    # Nothing is old enough yet.
    assert store.expire_jobs(storage, older_than_s=3600) == []
    assert store.expire_jobs(storage, older_than_s=0) == [gone["id"]]
    assert _get(api, gone["id"]).status_code == 404 and not _outputs(api, gone["id"]).exists()
    assert _get(api, kept["id"]).json()["pinned"] is True
    assert _outputs(api, kept["id"]).is_dir()
    assert _usage(api) == sum(f["size"] for f in kept["result"]["files"])
    # Only the owner pins or unpins.
    assert api.client.post(f"/v1/jobs/{kept['id']}/unpin",
                           headers=api.auth("bob")).status_code == 404
    r = api.client.post(f"/v1/jobs/{kept['id']}/unpin", headers=api.auth())
    assert r.status_code == 200 and r.json()["pinned"] is False
    assert store.expire_jobs(storage, older_than_s=0) == [kept["id"]]
    assert _usage(api) == 0 and api.r.scard(ORPHANS_KEY) == 0


def test_expiry_removes_failed_and_cancelled_jobs_too(api: Api) -> None:
    cancelled = str(api.submit()["id"])
    api.client.post(f"/v1/jobs/{cancelled}/cancel", headers=api.auth())
    pinned = str(api.submit()["id"])
    assert api.client.post(f"/v1/jobs/{pinned}/pin", headers=api.auth()).json()["pinned"]
    api.client.post(f"/v1/jobs/{pinned}/cancel", headers=api.auth())
    running = str(api.submit()["id"])
    api.worker_store().claim(running, worker="w", lease_s=30, max_attempts=3)
    removed = api.worker_store().expire_jobs(api.storage(), older_than_s=0)
    assert removed == [cancelled]
    assert _get(api, pinned).status_code == 200 and _get(api, running).status_code == 200


def test_the_sweep_expires_only_with_a_ttl_and_once_per_period(api_factory: Any) -> None:
    api: Api = api_factory(job_ttl_days=1e-9, retention_sweep_seconds=3600)
    jid = _finished(api)["id"]
    swept = sweep_retention(api.worker_store(), api.storage(), api.settings)
    assert swept.jobs == [jid]
    other = _finished(api)["id"]
    # Another worker's beat within the period does nothing.
    assert sweep_retention(api.worker_store(), api.storage(), api.settings).jobs == []
    assert _get(api, other).status_code == 200
    off = api.settings.model_copy(update={"job_ttl_days": None})
    api.r.delete("maec:retention-lock")
    assert sweep_retention(api.worker_store(), api.storage(), off).jobs == []
    assert _get(api, other).status_code == 200


def test_a_submission_over_quota_is_refused_and_deleting_frees_it(api_factory: Any) -> None:
    api: Api = api_factory(storage_quota_bytes_per_key=1)
    unlimited = api.settings.model_copy(update={"storage_quota_bytes_per_key": None})
    jid = str(api.submit()["id"])
    assert _run(api, jid, unlimited) == "succeeded"
    r = api.client.post("/v1/jobs", json=api.named(), headers=api.auth())
    assert r.status_code == 413 and r.json()["code"] == "quota_exceeded"
    assert r.json()["details"] == {"used": _usage(api), "quota": 1}
    # Per key: bob has used nothing.
    assert api.client.post("/v1/jobs", json=api.named(), headers=api.auth("bob")
                           ).status_code == 202
    assert _delete(api, jid).status_code == 204
    assert api.client.post("/v1/jobs", json=api.named(), headers=api.auth()
                           ).status_code == 202


def test_a_job_whose_outputs_would_pass_the_quota_fails_and_publishes_nothing(
        api: Api) -> None:
    first = _finished(api)
    used = _usage(api)
    assert used == sum(f["size"] for f in first["result"]["files"])
    tight = api.settings.model_copy(update={"storage_quota_bytes_per_key": used + 10})
    jid = str(api.submit()["id"])
    assert _run(api, jid, tight) == "failed"
    job = _get(api, jid).json()
    assert job["error"]["code"] == "quota_exceeded"
    assert job["error"]["details"]["quota"] == used + 10
    assert not _outputs(api, jid).exists() and _usage(api) == used
    # Exactly at the quota fits.
    exact = api.settings.model_copy(update={"storage_quota_bytes_per_key": 2 * used})
    assert _run(api, str(api.submit()["id"]), exact) == "succeeded"
    assert _usage(api) == 2 * used


def test_reservations_are_replaced_by_a_new_attempt_and_released_on_failure(
        api: Api) -> None:
    store = api.worker_store()
    jid = str(api.submit()["id"])
    store.claim(jid, worker="w", lease_s=30, max_attempts=3)
    rec = store.get(jid)
    assert rec is not None
    assert store.reserve(rec, 1, 100, quota=150, artifacts=(ART,)) == ("ok", 100)
    # The same attempt (or a later one) reserving again replaces, not adds.
    assert store.reserve(rec, 1, 120, quota=150, artifacts=(ART,)) == ("ok", 120)
    assert store.reserve(rec, 1, 200, quota=150) == ("over", 0)
    assert store.reserve(rec, 2, 10, quota=None) == ("lost", 0)
    assert api.r.smembers(refs_key(ART)) == {jid.encode()}
    store.release(rec, 1)
    assert _usage(api) == 0 and api.r.scard(refs_key(ART)) == 0
    assert api.r.zscore(UNREFERENCED_KEY, ART) is not None
    after = store.get(jid)
    assert after is not None and (after.published_bytes, after.artifact_keys) == (0, [])


def test_artifacts_are_kept_while_referenced_and_collected_after_the_grace(api: Api) -> None:
    store = api.worker_store()
    deleted: list[str] = []
    jid = str(api.submit()["id"])
    store.claim(jid, worker="w", lease_s=30, max_attempts=3)
    store.touch_artifact(ART)  # stored by the job's extraction: a candidate until published
    rec = store.get(jid)
    assert rec is not None
    store.reserve(rec, 1, 0, quota=None, artifacts=(ART,))
    store.transition(jid, allowed=("running",), to="succeeded", attempt=1)
    assert api.r.zscore(UNREFERENCED_KEY, ART) is None
    assert store.collect_artifacts(deleted.append, grace_s=0) == [] and deleted == []
    store.touch_artifact(ART)  # reused by another job: still referenced, no candidate
    assert api.r.zscore(UNREFERENCED_KEY, ART) is None
    assert _delete(api, jid).status_code == 204
    assert store.collect_artifacts(deleted.append, grace_s=3600) == []
    assert store.collect_artifacts(deleted.append, grace_s=0) == [ART] and deleted == [ART]
    assert api.r.zcard(UNREFERENCED_KEY) == 0


def test_an_artifact_the_store_will_not_delete_stays_a_candidate(api: Api) -> None:
    from app.storage.base import StorageError

    store = api.worker_store()
    store.touch_artifact(ART)

    def refuse(key: str) -> None:
        raise StorageError("store unreachable")

    assert store.collect_artifacts(refuse, grace_s=0) == []
    assert api.r.zscore(UNREFERENCED_KEY, ART) is not None
    assert store.collect_artifacts(lambda key: None, grace_s=0) == [ART]


def test_artifact_store_deletes_and_reads_a_collected_artifact_as_absent(tmp_path: Path
                                                                        ) -> None:
    from app.artifacts import StorageArtifactStore

    storage = LocalStorage(tmp_path / "s")
    used: list[str] = []
    folder = tmp_path / "art"
    folder.mkdir()
    (folder / "ability.json").write_text("{}")
    (folder / "vectors.safetensors").write_bytes(b"x" * 10)
    writer = StorageArtifactStore(storage, tmp_path / "w1", 10**6, on_use=used.append)
    writer.put(ART, folder)
    reader = StorageArtifactStore(storage, tmp_path / "w2", 10**6, on_use=used.append)
    copy = reader.get(ART)
    assert copy is not None and used == [ART, ART]
    writer.delete(ART)
    assert storage.list("artifacts/") == []
    assert StorageArtifactStore(storage, tmp_path / "w3", 10**6).get(ART) is None
    # The worker that read it had a local copy: collected in storage, gone there too.
    assert reader.get(ART) is None and not copy.exists() and used == [ART, ART]


def test_a_record_from_before_pinning_reads_as_not_pinned(api: Api) -> None:
    from maec_contract import Job

    jid = str(api.submit()["id"])
    api.r.hdel(f"maec:job:{jid}", "pinned", "published_bytes", "artifact_keys")
    job = _get(api, jid).json()
    assert job["pinned"] is False and Job.model_validate(job).pinned is False
    assert api.client.post(f"/v1/jobs/{jid}/cancel", headers=api.auth()).status_code == 202
    assert _delete(api, jid).status_code == 204


class _CutShort(LocalStorage):
    """A store whose object is deleted while it is being read: the read in flight ends
    after half its bytes, and the job is deleted (``on_cut``) at that moment."""

    def __init__(self, root: Path, on_cut: Callable[[], None]) -> None:
        super().__init__(root)
        self.on_cut = on_cut

    def iter_range(self, key: str, start: int, end: int, *, if_match: str | None = None
                   ) -> Iterator[bytes]:
        data = b"".join(super().iter_range(key, start, end, if_match=if_match))
        yield data[: max(1, len(data) // 2)]
        self.on_cut()


def test_a_read_cut_short_breaks_the_connection_and_the_client_reports_it(
        api: Api, tmp_path: Path) -> None:
    """Over a real HTTP server (uvicorn), not the in-process test client: a body that ends
    early must not look complete to any client."""
    import threading

    import httpx
    import pytest
    import uvicorn

    from app.api.main import create_app
    from maec_client import Client, ClientError
    from tests.stack import API_KEYS, free_port

    job = _finished(api)
    entry = max(job["result"]["files"], key=lambda f: f["size"])
    app = create_app(api.settings)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=free_port(),
                                           log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        while not server.started:
            thread.join(0.05)
        base = f"http://127.0.0.1:{server.config.port}"
        store, disk = api.worker_store(), api.storage()

        def delete_job(jid: str) -> Callable[[], None]:
            def cut() -> None:
                rec = store.get(jid)
                if rec is not None:
                    assert store.remove(rec)[0] == "removed"
                    store.delete_outputs(disk, f"jobs/{jid}/")
            return cut

        app.state.services.storage = _CutShort(api.settings.storage_dir,
                                               delete_job(job["id"]))
        with httpx.Client(base_url=base, headers=api.auth()) as c:
            with pytest.raises(httpx.RemoteProtocolError):
                c.get(entry["url"])  # Content-Length promised, half sent, then a cut
            assert c.get(entry["url"]).status_code == 404
        # The client, mid-download when its job goes: an error, never a folder.
        other = _finished(api)
        app.state.services.storage = _CutShort(api.settings.storage_dir,
                                               delete_job(other["id"]))
        dest = tmp_path / "out"
        with Client(base, API_KEYS["alice"], max_retries=0) as client:
            seen = client.get(other["id"])
            with pytest.raises(ClientError) as failed:
                client.download(seen, dest, workers=1)
        assert failed.value.code == "job_not_found" and not dest.exists()
    finally:
        server.should_exit = True
        thread.join(10)


def test_a_stream_shorter_than_promised_raises_whatever_the_server() -> None:
    """The files route's own check, so a short read never ends a response cleanly even
    behind a server or proxy that would not compare the body with Content-Length."""
    import pytest

    from app.api.routes.files import exactly
    from app.storage.base import StorageError

    assert b"".join(exactly(iter([b"ab", b"cd"]), 4, "k")) == b"abcd"
    short = exactly(iter([b"ab"]), 4, "k")
    assert next(short) == b"ab"
    with pytest.raises(StorageError, match="2 bytes early"):
        next(short)
