"""Route and store tests: the real app (TestClient) over a real Redis DB and local storage.

No worker runs here; jobs that must finish are run in-process with ``JobRunner``.
"""

from __future__ import annotations

import hashlib
import itertools
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis
from fastapi.testclient import TestClient

from app.api.main import create_app
from app.jobs.worker_store import WorkerJobStore
from app.settings import Settings, hash_key
from app.storage.local import LocalStorage
from tests.conftest import TinyModels
from tests.stack import API_KEYS, METRICS_TOKEN, RedisServer
from worker.runner import JobRunner

_DB = itertools.count(1)


@dataclass
class Api:
    client: TestClient
    settings: Settings
    r: redis.Redis
    models: TinyModels
    root: Path

    def auth(self, key: str = "alice") -> dict[str, str]:
        return {"Authorization": f"Bearer {API_KEYS[key]}"}

    def operator(self) -> dict[str, str]:
        """The operator's /metrics credential (API keys get 403 there)."""
        return {"Authorization": f"Bearer {METRICS_TOKEN}"}

    def named(self, method: str = "task_arithmetic", **kw: object) -> dict[str, object]:
        m = self.models
        body: dict[str, object] = {"method": method, "base": str(m.base),
                                   "ability_donor": [str(m.donor)], "language_base": str(m.lang)}
        body.update(kw)
        return body

    def submit(self, body: dict[str, object] | None = None, key: str = "alice"
               ) -> dict[str, object]:
        r = self.client.post("/v1/jobs", json=body or self.named(), headers=self.auth(key))
        assert r.status_code == 202, r.text
        return dict(r.json())

    def worker_store(self) -> WorkerJobStore:
        return WorkerJobStore(self.r)

    def storage(self) -> LocalStorage:
        return LocalStorage(self.settings.storage_dir)

    def run_published(self, job_id: str, key: str = "alice"
                      ) -> tuple[dict[str, str], dict[str, Any]]:
        """Run queued job ``job_id`` in-process to success; its files' URLs by path, and
        its manifest as the API serves it."""
        runner = JobRunner(self.settings, self.worker_store(), self.storage(), worker="test")
        assert runner.run(job_id) == "succeeded"
        job = self.client.get(f"/v1/jobs/{job_id}", headers=self.auth(key)).json()
        urls = {f["path"]: f["url"] for f in job["result"]["files"]}
        manifest = self.client.get(urls["manifest.json"], headers=self.auth(key)).json()
        return urls, manifest

    def assert_named_by_reference(self, manifest: dict[str, Any], refs: set[str]) -> None:
        """A published manifest names no path of the worker's, and every input (``refs``,
        local references here) by its reference with the sha256 of each of its files."""
        assert str(self.settings.work_dir) not in json.dumps(manifest)
        assert set(manifest["inputs"]) == refs
        for ref, doc in manifest["inputs"].items():
            path = Path(ref)
            files = [path] if path.is_file() else sorted(
                f for f in path.rglob("*") if f.is_file())
            assert doc["files"] == {
                (f.name if f == path else f.relative_to(path).as_posix()):
                    hashlib.sha256(f.read_bytes()).hexdigest() for f in files}, ref


def make_settings(root: Path, redis_url: str, models: TinyModels, **kw: object) -> Settings:
    values: dict[str, object] = dict(
        dev_mode=False,
        api_keys={k: hash_key(v) for k, v in API_KEYS.items()},
        metrics_token_sha256=hash_key(METRICS_TOKEN),
        redis_url=redis_url, storage_dir=root / "storage", work_dir=root / "work",
        local_roots=[models.root, root / "extra"], lease_seconds=5,
        max_active_jobs_per_key=50, progress_interval=0.0, device="cpu",
        # The app runs inside pytest here: leave the test process's collector alone
        # (test_gc_tuning turns it on and restores it).
        api_gc_threshold=0,
    )
    values.update(kw)
    return Settings.model_validate(values)


@pytest.fixture
def api_factory(redis_server: RedisServer, tiny_models: TinyModels, tmp_path: Path,
                monkeypatch: pytest.MonkeyPatch) -> Iterator[object]:
    monkeypatch.setenv("MAEC_CACHE_DIR", str(tmp_path / "checksums"))
    (tmp_path / "extra").mkdir()
    opened: list[TestClient] = []

    def make(**kw: object) -> Api:
        url = redis_server.db_url(next(_DB) % 16)
        r = redis.Redis.from_url(url)
        r.flushdb()
        settings = make_settings(tmp_path, str(kw.pop("redis_url", url)), tiny_models, **kw)
        client = TestClient(create_app(settings), raise_server_exceptions=False)
        client.__enter__()
        opened.append(client)
        return Api(client, settings, r, tiny_models, tmp_path)

    yield make
    for c in opened:
        c.__exit__(None, None, None)


@pytest.fixture
def api(api_factory: object) -> Api:
    return api_factory()  # type: ignore[operator, no-any-return]
