"""A finished job fetched by the real ``huggingface_hub`` client and by ``transformers``
from the service run by uvicorn (in a thread, over the test's Redis and storage), as
repository ``jobs/<id>``: snapshot_download, a download resumed with Range after the
connection broke, from_pretrained with HF_ENDPOINT in a fresh process, the S3 redirect,
and the errors the client raises for a wrong key and another key's job."""

from __future__ import annotations

import hashlib
import http.server
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn

from app.api.main import create_app
from app.storage import make_storage
from tests.api.conftest import Api
from tests.stack import (
    API_KEYS,
    S3_BUCKET,
    S3_KEY_ID,
    S3_SECRET,
    S3Server,
    free_port,
    wait_for,
)
from worker.runner import JobRunner

pytestmark = pytest.mark.integration
MODEL = "model.safetensors"


@pytest.fixture
def hub_client(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """``huggingface_hub`` online, quiet, and caching under the test's folder."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_PROGRESS_BARS", True)
    return tmp_path / "hf-cache"


@pytest.fixture
def serve() -> Iterator[Callable[[Api], str]]:
    """``serve(api)``: the app of ``api``'s settings under uvicorn; its URL."""
    servers: list[tuple[uvicorn.Server, threading.Thread]] = []

    def start(api: Api) -> str:
        port = free_port()
        server = uvicorn.Server(uvicorn.Config(create_app(api.settings), host="127.0.0.1",
                                               port=port, log_level="warning"))
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        servers.append((server, thread))
        wait_for(lambda: server.started, 20, "uvicorn")
        return f"http://127.0.0.1:{port}"

    yield start
    for server, thread in servers:
        server.should_exit = True
        thread.join(10)


def _finished(api: Api, runner: JobRunner | None = None) -> tuple[str, dict[str, Any]]:
    """A succeeded job of alice's and its published files by path."""
    jid = str(api.submit()["id"])
    runner = runner or JobRunner(api.settings, api.worker_store(), api.storage(), worker="t")
    assert runner.run(jid) == "succeeded"
    files = api.client.get(f"/v1/jobs/{jid}/files", headers=api.auth()).json()["files"]
    return jid, {f["path"]: f for f in files}


def _check_snapshot(folder: str | Path, files: dict[str, Any]) -> None:
    got = {p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
           for p in Path(folder).rglob("*") if p.is_file()}
    assert got == {p: f["sha256"] for p, f in files.items()}


def test_snapshot_download_and_the_clients_errors(api: Api, serve: Callable[[Api], str],
                                                  hub_client: Path) -> None:
    from huggingface_hub import hf_hub_download, snapshot_download
    from huggingface_hub.errors import (
        EntryNotFoundError,
        HfHubHTTPError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    url = serve(api)
    jid, files = _finished(api)
    repo, key = f"jobs/{jid}", API_KEYS["alice"]
    folder = snapshot_download(repo_id=repo, endpoint=url, token=key, cache_dir=hub_client)
    _check_snapshot(folder, files)
    commit = files["manifest.json"]["sha256"][:40]
    assert Path(folder).name == commit
    again = snapshot_download(repo_id=repo, revision=commit, endpoint=url, token=key,
                              cache_dir=hub_client / "2")
    _check_snapshot(again, files)
    other = hub_client / "other"
    with pytest.raises(RepositoryNotFoundError):
        snapshot_download(repo_id=repo, endpoint=url, token=API_KEYS["bob"], cache_dir=other)
    with pytest.raises(RepositoryNotFoundError):
        hf_hub_download(repo, MODEL, endpoint=url, token=API_KEYS["bob"], cache_dir=other)
    with pytest.raises(RepositoryNotFoundError):
        snapshot_download(repo_id="jobs/j-none", endpoint=url, token=key, cache_dir=other)
    with pytest.raises(HfHubHTTPError) as wrong:
        snapshot_download(repo_id=repo, endpoint=url, token="not-a-key", cache_dir=other)
    assert wrong.value.response is not None and wrong.value.response.status_code == 401
    with pytest.raises(RevisionNotFoundError):
        snapshot_download(repo_id=repo, revision="v2", endpoint=url, token=key, cache_dir=other)
    with pytest.raises(EntryNotFoundError):
        hf_hub_download(repo, "absent.bin", endpoint=url, token=key, cache_dir=other)


class _CuttingProxy(http.server.ThreadingHTTPServer):
    """Forwards to ``upstream``; the first whole-file GET of ``cut_path`` announces its
    full length and closes after ``cut_at`` bytes, as a dropped connection does.
    Records (method, path, Range, upstream status) of every request."""

    def __init__(self, upstream: str, cut_path: str, cut_at: int) -> None:
        self.upstream, self.cut_path, self.cut_at = upstream, cut_path, cut_at
        self.seen: list[tuple[str, str, str | None, int]] = []
        self.cut = False
        super().__init__(("127.0.0.1", free_port()), _ProxyHandler)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _ProxyHandler(http.server.BaseHTTPRequestHandler):
    server: _CuttingProxy

    def do_HEAD(self) -> None:
        self._forward()

    def do_GET(self) -> None:
        self._forward()

    def _forward(self) -> None:
        proxy = self.server
        headers = {k: v for k, v in self.headers.items() if k.lower() != "host"}
        with httpx.Client() as c, c.stream(self.command, proxy.upstream + self.path,
                                           headers=headers) as r:
            proxy.seen.append((self.command, self.path, self.headers.get("Range"),
                               r.status_code))
            cut = (self.command == "GET" and self.path.endswith(proxy.cut_path)
                   and r.status_code == 200 and not proxy.cut)
            self.send_response(r.status_code)
            for k, v in r.headers.items():
                if k.lower() not in ("connection", "transfer-encoding"):
                    self.send_header(k, v)
            self.end_headers()
            body = b"".join(r.iter_bytes()) if self.command == "GET" else b""
        if cut:
            proxy.cut = True
            body = body[:proxy.cut_at]
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


def test_a_broken_download_resumes_with_a_range(api: Api, serve: Callable[[Api], str],
                                                hub_client: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    from huggingface_hub import constants, hf_hub_download

    # The client counts what it has only by whole chunks (10 MB): chunks smaller than
    # the tiny model's third make its cut land after some of them, as a real model's does.
    monkeypatch.setattr(constants, "DOWNLOAD_CHUNK_SIZE", 4096)

    url = serve(api)
    jid, files = _finished(api)
    size = files[MODEL]["size"]
    cut_at = size // 3 // 4096 * 4096
    proxy = _CuttingProxy(url, f"/resolve/main/{MODEL}", cut_at)
    thread = threading.Thread(target=proxy.serve_forever, daemon=True)
    thread.start()
    try:
        path = hf_hub_download(f"jobs/{jid}", MODEL, endpoint=proxy.url,
                               token=API_KEYS["alice"], cache_dir=hub_client)
    finally:
        proxy.shutdown()
        thread.join(10)
    assert hashlib.sha256(Path(path).read_bytes()).hexdigest() == files[MODEL]["sha256"]
    gets = [(rng, status) for method, p, rng, status in proxy.seen
            if method == "GET" and p.endswith(MODEL)]
    # Cut once, then only the missing bytes asked for and served (206).
    assert proxy.cut and gets == [(None, 200), (f"bytes={cut_at}-", 206)]


def test_from_pretrained_by_job_id_with_hf_endpoint_and_token(
        api: Api, serve: Callable[[Api], str], hub_client: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """As HF_ENDPOINT and HF_TOKEN set before the import would (the client copies
    HF_ENDPOINT into its constants then; a fresh process with the environment set is
    tests/integration/test_readme_first_job.py's, against `make run`)."""
    import torch
    from huggingface_hub import constants
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    url = serve(api)
    jid, _ = _finished(api)
    monkeypatch.setattr(constants, "ENDPOINT", url)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE",
                        url + "/{repo_id}/resolve/{revision}/{filename}")
    monkeypatch.setenv("HF_TOKEN", API_KEYS["alice"])
    model = AutoModelForCausalLM.from_pretrained(f"jobs/{jid}", cache_dir=hub_client)
    rec = api.worker_store().get(jid)
    assert rec is not None and rec.result_prefix
    want = load_file(api.settings.storage_dir / rec.result_prefix / MODEL)
    state = model.state_dict()
    assert want and all(torch.equal(state[k], v) for k, v in want.items())
    assert (hub_client / f"models--jobs--{jid}").is_dir(), "fetched, not read from disk"


def test_s3_storage_redirects_to_a_presigned_url(api_factory: Callable[..., Api],
                                                 s3_server: S3Server,
                                                 serve: Callable[[Api], str],
                                                 hub_client: Path) -> None:
    from huggingface_hub import snapshot_download

    api = api_factory(storage_backend="s3", s3_endpoint_url=s3_server.endpoint,
                      s3_bucket=S3_BUCKET, s3_access_key=S3_KEY_ID, s3_secret_key=S3_SECRET)
    url = serve(api)
    runner = JobRunner(api.settings, api.worker_store(), make_storage(api.settings),
                       worker="t")
    jid, files = _finished(api, runner)
    key = {"Authorization": f"Bearer {API_KEYS['alice']}"}
    head = httpx.head(f"{url}/jobs/{jid}/resolve/main/{MODEL}", headers=key)
    assert head.status_code == 302
    assert head.headers["location"].startswith(s3_server.endpoint)
    assert head.headers["x-linked-size"] == str(files[MODEL]["size"])
    assert head.headers["x-linked-etag"] == f'"{files[MODEL]["sha256"]}"'
    # The presigned URL needs no key (the client drops it when leaving the service).
    blob = httpx.get(head.headers["location"])
    assert hashlib.sha256(blob.content).hexdigest() == files[MODEL]["sha256"]
    folder = snapshot_download(repo_id=f"jobs/{jid}", endpoint=url, token=API_KEYS["alice"],
                               cache_dir=hub_client)
    _check_snapshot(folder, files)
