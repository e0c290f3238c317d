"""maec_client and ``maec jobs`` against the real stack (uvicorn + Celery + Redis + storage).

Stacks come from tests/conftest.py (module scope, shared Redis and SeaweedFS); every job
is a tiny linear merge of two seeded Llamas, well under a second on CPU.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
from click.testing import CliRunner

from maec_client import (
    AuthError,
    ChecksumMismatch,
    Client,
    ClientConfig,
    Conflict,
    NetworkError,
    NotFound,
    ValidationFailed,
)
from maec_client.cli import main
from tests.stack import API_KEYS

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
MAEC = Path(sys.executable).parent / "maec"


@pytest.fixture(scope="module")
def env(make_module_stack, tiny_models, tmp_path_factory):
    stack = make_module_stack(local_roots=[tiny_models.root])
    stack.wait_ready()
    return {"stack": stack, "a": tiny_models.base, "b": tiny_models.donor,
            "root": tmp_path_factory.mktemp("client")}


def recipe_yaml(env, tmp_path, weight: float = 0.5) -> Path:
    path = tmp_path / "linear.yaml"
    path.write_text(f"""\
merge_method: linear
models:
  - model: {env['a']}
    parameters: {{weight: {weight}}}
  - model: {env['b']}
    parameters: {{weight: {1 - weight}}}
dtype: float32
""")
    return path


def make_client(env, key="alice", transport: httpx.BaseTransport | None = None) -> Client:
    return Client(config=ClientConfig(url=env["stack"].base_url, api_key=API_KEYS.get(key, key)),
                  transport=transport)


class Faulty(httpx.HTTPTransport):
    """Real HTTP, plus: cut or corrupt the next responses for one file, and log Ranges."""

    def __init__(self, path: str, cuts: list[int] | None = None,
                 corrupt_at: int | None = None) -> None:
        super().__init__()
        self.path, self.cuts, self.corrupt_at = path, list(cuts or []), corrupt_at
        self.ranges: list[str] = []

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        resp = super().handle_request(request)
        if not request.url.path.endswith("/files/" + self.path):
            return resp
        self.ranges.append(request.headers.get("range", ""))
        first = int(request.headers["range"].split("=")[1].split("-")[0])
        inner = resp.stream
        cut = self.cuts.pop(0) if self.cuts else None
        corrupt_at = self.corrupt_at

        class Stream(httpx.SyncByteStream):
            def __iter__(self):
                sent = 0
                for chunk in inner:
                    i = -1 if corrupt_at is None else corrupt_at - first - sent
                    if 0 <= i < len(chunk):
                        chunk = chunk[:i] + bytes([chunk[i] ^ 0x01]) + chunk[i + 1:]
                    if cut is not None and sent + len(chunk) >= cut:
                        yield chunk[:cut - sent]
                        raise httpx.ReadError("cut by test transport")
                    sent += len(chunk)
                    yield chunk

            def close(self):
                inner.close()

        return httpx.Response(resp.status_code, headers=resp.headers, stream=Stream(),
                              extensions=resp.extensions)


@pytest.fixture(scope="module")
def done_job(env, tmp_path_factory):
    with make_client(env) as c:
        job = c.submit(recipe_yaml(env, tmp_path_factory.mktemp("r")))
        return c.wait(job, timeout=120)


def test_submit_wait_download_verify(env, tmp_path):
    seen = []
    with make_client(env) as c:
        job = c.submit(recipe_yaml(env, tmp_path, 0.3), name="client-e2e")
        assert job.status in ("queued", "running") and job.name == "client-e2e"
        done = c.wait(job, timeout=120, on_progress=lambda j: seen.append(j.status))
        assert done.status == "succeeded" and seen[-1] == "succeeded"
        assert any(j.id == job.id for j in c.iter_jobs(page_size=1))
        dest = c.download(done, tmp_path / "out", part_size=16_384, workers=4)
    files = {f.path: f for f in done.result.files}
    assert {p.name for p in dest.iterdir()} == set(files)
    for path, f in files.items():
        data = (dest / path).read_bytes()
        assert len(data) == f.size and hashlib.sha256(data).hexdigest() == f.sha256
    # The shipped manifest.json is the one the API reported.
    assert json.loads((dest / "manifest.json").read_text()) == done.result.manifest
    assert not (tmp_path / "out.partial").exists()


def test_interrupted_download_resumes_with_range(env, done_job, tmp_path):
    size = next(f.size for f in done_job.result.files if f.path == "model.safetensors")
    cut = size // 3
    faulty = Faulty("model.safetensors", cuts=[cut, 0])
    with make_client(env, transport=faulty) as c, pytest.raises(NetworkError):
        c.download(done_job.id, tmp_path / "out", workers=1, retries=0)
    assert (tmp_path / "out.partial" / "model.safetensors.part").stat().st_size == cut
    assert not (tmp_path / "out").exists()

    resumed = Faulty("model.safetensors")
    with make_client(env, transport=resumed) as c:
        c.download(done_job.id, tmp_path / "out")
    assert resumed.ranges == [f"bytes={cut}-{size - 1}"]
    sha = next(f.sha256 for f in done_job.result.files if f.path == "model.safetensors")
    assert hashlib.sha256((tmp_path / "out" / "model.safetensors").read_bytes()
                          ).hexdigest() == sha


def test_corrupted_byte_is_detected(env, done_job, tmp_path):
    faulty = Faulty("model.safetensors", corrupt_at=5_000)
    with make_client(env, transport=faulty) as c, pytest.raises(ChecksumMismatch) as info:
        c.download(done_job.id, tmp_path / "out", part_size=8_192)
    assert info.value.path == "model.safetensors"
    assert not (tmp_path / "out").exists()
    with make_client(env) as c:  # the bad bytes were dropped: a clean rerun succeeds
        c.download(done_job.id, tmp_path / "out", redirect=True)
    assert (tmp_path / "out" / "model.safetensors").is_file()


def test_typed_errors_from_the_real_service(env, done_job, tmp_path):
    with make_client(env) as c:
        with pytest.raises(NotFound) as nf:
            c.get("j_does_not_exist")
        assert nf.value.code == "job_not_found"
        with pytest.raises(Conflict) as cf:
            c.cancel(done_job.id)
        assert cf.value.code == "job_finished"
        with pytest.raises(ValidationFailed) as vf:
            c.submit({"merge_method": "linear", "models": [{"model": "/etc/passwd"},
                                                           {"model": str(env["a"])}]})
        assert vf.value.code == "invalid_source" and vf.value.status == 422
    with make_client(env, key="bob") as bob, pytest.raises(NotFound):
        bob.get(done_job.id)  # another key's job does not exist for bob
    with make_client(env, key="wrong-key") as bad, pytest.raises(AuthError) as au:
        bad.list_page()
    assert au.value.code == "unauthorized"


def test_idempotent_submit_returns_the_same_job(env, tmp_path):
    with make_client(env) as c:
        path = recipe_yaml(env, tmp_path, 0.7)
        first = c.submit(path, idempotency_key="client-stack-once")
        again = c.submit(path, idempotency_key="client-stack-once")
    assert first.id == again.id


def cli(env, *args, key="alice", proc=False):
    """Run ``maec jobs ARGS``; ``proc`` uses the installed script, else CliRunner (faster)."""
    run_env = {"MAEC_URL": env["stack"].base_url, "MAEC_API_KEY": API_KEYS.get(key, key),
               "XDG_CONFIG_HOME": str(env["root"] / "no-config"), "MAEC_CONFIG": ""}
    if proc:
        return subprocess.run([str(MAEC), "jobs", *args], capture_output=True, text=True,
                              env={**os.environ, **run_env}, timeout=180)
    res = CliRunner().invoke(main, ["jobs", *args], env=run_env, catch_exceptions=False)
    return SimpleNamespace(returncode=res.exit_code, stdout=res.stdout, stderr=res.stderr)


def test_cli_json_round_trip(env, tmp_path):
    res = cli(env, "submit", str(recipe_yaml(env, tmp_path, 0.2)), "--json", "--wait",
              "--timeout", "120", proc=True)
    assert res.returncode == 0, res.stderr
    job = json.loads(res.stdout)
    assert job["status"] == "succeeded"
    res = cli(env, "status", job["id"], "--json")
    assert res.returncode == 0 and json.loads(res.stdout)["result"] == job["result"]
    res = cli(env, "list", "--json", "--status", "succeeded", "--all")
    assert job["id"] in {j["id"] for j in json.loads(res.stdout)["jobs"]}
    res = cli(env, "download", job["id"], str(tmp_path / "out"), "--json")
    assert res.returncode == 0, res.stderr
    listed = json.loads(res.stdout)["files"]
    for f in listed:
        data = (tmp_path / "out" / f["path"]).read_bytes()
        assert hashlib.sha256(data).hexdigest() == f["sha256"]
    res = cli(env, "download", job["id"], str(tmp_path / "out"), "--json")
    assert res.returncode == 2 and json.loads(res.stdout)["error"]["code"] == "download_error"
    res = cli(env, "cancel", job["id"], "--json")
    assert res.returncode == 8 and json.loads(res.stdout)["error"]["code"] == "job_finished"
    res = cli(env, "status", job["id"], "--json", key="bob")
    assert res.returncode == 4
    res = cli(env, "status", job["id"], key="nobody", proc=True)
    assert res.returncode == 3 and "[unauthorized]" in res.stderr


@pytest.fixture(scope="module")
def s3_env(make_module_stack, tiny_models, tmp_path_factory):
    stack = make_module_stack(storage="s3", local_roots=[tiny_models.root])
    stack.wait_ready()
    return {"stack": stack, "a": tiny_models.base, "b": tiny_models.donor,
            "root": tmp_path_factory.mktemp("client-s3")}


class Recorder(httpx.HTTPTransport):
    def __init__(self) -> None:
        super().__init__()
        self.requests: list[httpx.Request] = []

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        return super().handle_request(request)


@pytest.mark.slow
def test_s3_presigned_redirect_download(s3_env, tmp_path):
    rec = Recorder()
    with make_client(s3_env, transport=rec) as c:
        job = c.wait(c.submit(recipe_yaml(s3_env, tmp_path)), timeout=120)
        c.download(job, tmp_path / "out", redirect=True, part_size=16_384, workers=4)
    for f in job.result.files:
        data = (tmp_path / "out" / f.path).read_bytes()
        assert hashlib.sha256(data).hexdigest() == f.sha256
    api_port = str(httpx.URL(s3_env["stack"].base_url).port)
    store = [r for r in rec.requests if str(r.url.port) != api_port]
    # Every file came from the store, by range, and the API key never went there.
    assert len(store) >= len(job.result.files)
    assert all(r.headers.get("range") for r in store)
    assert not any("authorization" in r.headers for r in store)
