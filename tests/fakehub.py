"""A fake Hugging Face Hub on 127.0.0.1, for testing hub sources without a network.

Two threaded ``http.server`` instances share one :class:`FakeHub`:

- the *hub* origin (``hub.endpoint``) answers what ``huggingface_hub`` (2.x) calls for
  ``HfApi.list_repo_tree`` / ``list_repo_files``, ``hf_hub_download``, ``hf_hub_url`` +
  plain GETs, and ``snapshot_download`` with a commit-hash revision:

  - ``GET /api/models/{owner}/{name}/tree/{revision}[/{path}]?recursive=&expand=``:
    one page (no ``Link`` header) of ``{"type": "file"|"directory", "oid", "size",
    "path"[, "lfs": {"oid", "size", "pointerSize"}]}``.
  - ``GET|HEAD /{owner}/{name}/resolve/{revision}/{path}``: a regular file is served here
    (``ETag`` = git blob id, ``X-Repo-Commit``, ``Content-Length``, ``Range`` -> 206 with
    ``Content-Range``). An LFS file (weights, pickles) answers ``302`` to the CDN origin with
    ``X-Linked-Etag`` (its sha256), ``X-Linked-Size`` and ``X-Repo-Commit``, as the real
    Hub does; the client then reads it from the CDN, without the ``Authorization`` header.

- the *CDN* origin (``hub.cdn``, another port, so another origin) serves LFS blobs at
  ``/lfs/{sha256}?repo=&file=`` with ``Range`` support.

Errors carry the real Hub's ``X-Error-Code`` so the client raises the same typed errors:
an unknown repo (or a private one without its token) is ``RepoNotFound`` (401 without a
token, 404 with one), an unknown revision ``RevisionNotFound`` (404), a missing file
``EntryNotFound`` (404). Only the fixed commit sha of each repo (and ``main``) resolve.

Two switches make a bad transfer: ``tampered[(repo, file)]`` serves other bytes (short,
or of the right length but wrong) in place of a file's content while the listing and the
resolve headers still describe the real file, as a corrupt mirror or CDN object would;
``drop_after = n`` announces a file download's full ``Content-Length`` and then closes the
connection after ``n`` body bytes. Range answers are cut from the served bytes as well.

Every request is recorded as a :class:`HubRequest` (origin, method, path, repo file,
``Range`` header, whether it carried ``Authorization``, body bytes sent) so tests can
assert exactly what a client fetched. :func:`use_fake_hub` points ``huggingface_hub`` at
the fake (the constants it reads at call time) with its caches in a temporary folder.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote, urlencode, urlsplit

import pytest

# Stored with git-lfs on the real Hub (its default .gitattributes): served through the CDN.
LFS_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".model", ".h5", ".msgpack",
                ".gguf")
_RANGE = re.compile(r"^bytes=(\d*)-(\d*)$")


def fake_sha(label: str) -> str:
    """A fixed 40-hex commit sha derived from ``label``."""
    return hashlib.sha1(label.encode()).hexdigest()


@dataclass
class HubRequest:
    origin: str  # "hub" or "cdn"
    method: str
    path: str  # URL path, percent-decoded, without the query
    repo: str | None  # "owner/name" for tree and resolve calls and CDN blobs
    file: str | None  # the repo file a resolve call or CDN blob is about
    range: str | None
    authorized: bool
    status: int
    sent: int  # body bytes written (set once written)


@dataclass
class FakeRepo:
    repo_id: str
    sha: str
    files: dict[str, bytes]
    token: str | None = None  # private: visible only with "Authorization: Bearer <token>"
    lfs: set[str] = field(default_factory=set)

    def git_oid(self, path: str) -> str:
        data = self.files[path]
        return hashlib.sha1(b"blob %d\x00" % len(data) + data).hexdigest()

    def sha256(self, path: str) -> str:
        return hashlib.sha256(self.files[path]).hexdigest()


class FakeHub:
    """Repos frozen at one commit each; start with ``with FakeHub() as hub``."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        self.host = host
        self.repos: dict[str, FakeRepo] = {}
        self.requests: list[HubRequest] = []
        self.ignore_range = False  # answer 200 with the whole file to a Range request
        # (repo, file) -> bytes served in place of the file's content (listing unchanged).
        self.tampered: dict[tuple[str, str], bytes] = {}
        # Close the connection after this many body bytes of a file (GET resolve or blob).
        self.drop_after: int | None = None
        self._lock = threading.Lock()
        self._servers: list[ThreadingHTTPServer] = []
        self._threads: list[threading.Thread] = []

    # -- repos ---------------------------------------------------------------------------
    def add_repo(self, repo_id: str, folder: Path, *, sha: str | None = None,
                 token: str | None = None) -> FakeRepo:
        """Serve every file under ``folder`` (read now: later edits do not show)."""
        files = {
            p.relative_to(folder).as_posix(): p.read_bytes()
            for p in sorted(folder.rglob("*")) if p.is_file()
        }
        repo = FakeRepo(repo_id, sha or fake_sha(repo_id), files, token,
                        {n for n in files if n.endswith(LFS_SUFFIXES)})
        with self._lock:
            self.repos[repo_id] = repo
        return repo

    def uri(self, repo_id: str) -> str:
        return f"hf://{repo_id}@{self.repos[repo_id].sha}"

    # -- request log ---------------------------------------------------------------------
    def log(self) -> list[HubRequest]:
        with self._lock:
            return list(self.requests)

    def clear(self) -> None:
        with self._lock:
            self.requests.clear()

    def downloads(self, repo: str | None = None) -> dict[str, int]:
        """How many times each repo file's content was served whole (a 200 to a GET on a
        resolve URL or a CDN blob, not a redirect or a range)."""
        counts: dict[str, int] = {}
        for r in self.log():
            if (r.file is not None and r.method == "GET" and r.status == 200
                    and (repo is None or r.repo == repo)):
                counts[r.file] = counts.get(r.file, 0) + 1
        return counts

    def content(self, repo: FakeRepo, name: str) -> bytes:
        """The bytes served for ``name``: the file's, unless tampered with."""
        with self._lock:
            return self.tampered.get((repo.repo_id, name), repo.files[name])

    def files_fetched(self, repo: str | None = None) -> set[str]:
        """Repo files whose bytes were requested (GET on a resolve URL or a CDN blob)."""
        return {r.file for r in self.log() if r.file is not None and r.method == "GET"
                and (repo is None or r.repo == repo)}

    # -- servers -------------------------------------------------------------------------
    @property
    def endpoint(self) -> str:
        host, port = self._servers[0].server_address[:2]
        return f"http://{host!s}:{port}"

    @property
    def cdn(self) -> str:
        host, port = self._servers[1].server_address[:2]
        return f"http://{host!s}:{port}"

    def start(self) -> FakeHub:
        for origin in ("hub", "cdn"):
            server = ThreadingHTTPServer((self.host, 0), _handler(self, origin))
            server.daemon_threads = True
            thread = threading.Thread(target=server.serve_forever, name=f"fakehub-{origin}",
                                      kwargs={"poll_interval": 0.05}, daemon=True)
            thread.start()
            self._servers.append(server)
            self._threads.append(thread)
        return self

    def stop(self) -> None:
        for server in self._servers:
            server.shutdown()
            server.server_close()
        for thread in self._threads:
            thread.join(timeout=5)

    def __enter__(self) -> FakeHub:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- request handling ----------------------------------------------------------------
    def _record(self, req: HubRequest) -> None:
        with self._lock:
            self.requests.append(req)


class _Answer:
    def __init__(self, status: int, headers: dict[str, str] | None = None,
                 body: bytes = b"", repo: str | None = None, file: str | None = None) -> None:
        self.status, self.headers, self.body = status, dict(headers or {}), body
        self.repo, self.file = repo, file


def _error(status: int, code: str, message: str, **headers: str) -> _Answer:
    body = json.dumps({"error": message}).encode()
    return _Answer(status, {"X-Error-Code": code, "X-Error-Message": message,
                            "Content-Type": "application/json", **headers}, body)


def _ranged(data: bytes, rng: str | None, ignore_range: bool,
            headers: dict[str, str]) -> tuple[int, dict[str, str], bytes]:
    """The status, headers and body for ``data`` under a ``Range`` header (one range)."""
    size = len(data)
    out = {**headers, "Accept-Ranges": "bytes"}
    m = _RANGE.match(rng or "")
    if rng is None or ignore_range or m is None or m.group(1) == m.group(2) == "":
        return 200, out, data  # absent, ignored, or a form we do not serve: whole file
    first, last = m.group(1), m.group(2)
    if first == "":
        start, end = max(size - int(last), 0), size - 1
        if int(last) == 0:
            start = size
    else:
        start, end = int(first), min(int(last), size - 1) if last else size - 1
    if start >= size or start > end:
        return 416, {**out, "Content-Range": f"bytes */{size}"}, b""
    out["Content-Range"] = f"bytes {start}-{end}/{size}"
    return 206, out, data[start:end + 1]


def _handler(hub: FakeHub, origin: str) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.0"  # one request per connection: nothing lingers

        def log_message(self, format: str, *args: Any) -> None:
            pass

        def do_HEAD(self) -> None:
            self._serve("HEAD")

        def do_GET(self) -> None:
            self._serve("GET")

        def _serve(self, method: str) -> None:
            url = urlsplit(self.path)
            path = unquote(url.path)
            auth = self.headers.get("Authorization")
            rng = self.headers.get("Range")
            try:
                if origin == "cdn":
                    answer = self._cdn(path, parse_qs(url.query), rng)
                else:
                    answer = self._hub(url.path, parse_qs(url.query), auth, rng)
            except Exception as exc:  # a bug in the fake: say so rather than hang
                answer = _error(500, "FakeHubError", f"{type(exc).__name__}: {exc}")
            body = b"" if method == "HEAD" else answer.body
            self.send_response(answer.status)
            headers = {"Content-Length": str(len(answer.body)), **answer.headers}
            for k, v in headers.items():
                self.send_header(k, v)
            self.end_headers()
            if (hub.drop_after is not None and answer.file is not None
                    and answer.status in (200, 206)):
                body = body[:hub.drop_after]  # then the connection closes (HTTP/1.0)
            # Recorded before the body goes out: a client that has read the whole body
            # and asks the hub's log at once must find its request there (recorded after,
            # the log raced the client on a busy machine). ``sent`` follows the write.
            req = HubRequest(origin, method, path, answer.repo, answer.file, rng,
                             auth is not None, answer.status, 0)
            hub._record(req)
            with contextlib.suppress(OSError):  # the client may stop reading early
                self.wfile.write(body)
                req.sent = len(body)

        # The CDN: LFS blobs by sha256 (the query names the repo file, as the real signed
        # URLs do, since two files may hold the same bytes); ranges; never any credentials.
        def _cdn(self, path: str, query: dict[str, list[str]], rng: str | None) -> _Answer:
            m = re.fullmatch(r"/lfs/([0-9a-f]{64})", path)
            repo = hub.repos.get(query.get("repo", [""])[0])
            name = query.get("file", [""])[0]
            if (m is None or repo is None or name not in repo.lfs
                    or repo.sha256(name) != m.group(1)):
                return _Answer(404, {"Content-Type": "text/plain"}, b"NoSuchKey")
            status, headers, body = _ranged(
                hub.content(repo, name), rng, hub.ignore_range,
                {"ETag": f'"{m.group(1)}"', "Content-Type": "application/octet-stream",
                 "Content-Disposition": f'inline; filename="{name.rsplit("/", 1)[-1]}";'})
            return _Answer(status, headers, body, repo.repo_id, name)

        def _hub(self, raw_path: str, query: dict[str, list[str]], auth: str | None,
                 rng: str | None) -> _Answer:
            parts = raw_path.split("/")
            # /api/models/{owner}/{name}/tree/{revision}[/{path}]
            if len(parts) >= 7 and parts[1:3] == ["api", "models"] and parts[5] == "tree":
                repo_id = f"{unquote(parts[3])}/{unquote(parts[4])}"
                sub = unquote("/".join(parts[7:])).strip("/")
                recursive = query.get("recursive", ["false"])[0].lower() in ("true", "1")
                return self._tree(repo_id, unquote(parts[6]), sub, recursive, auth)
            # /{owner}/{name}/resolve/{revision}/{path}
            if len(parts) >= 6 and parts[3] == "resolve":
                repo_id = f"{unquote(parts[1])}/{unquote(parts[2])}"
                return self._resolve(repo_id, unquote(parts[4]),
                                     unquote("/".join(parts[5:])), auth, rng)
            return _error(404, "NotFound", f"the fake hub does not serve {raw_path}")

        def _repo(self, repo_id: str, revision: str,
                  auth: str | None) -> FakeRepo | _Answer:
            repo = hub.repos.get(repo_id)
            if repo is None or (repo.token is not None and auth != f"Bearer {repo.token}"):
                # What the real Hub answers for a missing repo and for a private one
                # seen without its token alike (it does not say which).
                return _error(404 if auth else 401, "RepoNotFound", "Repository not found")
            if revision not in (repo.sha, "main"):
                return _error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
            return repo

        def _tree(self, repo_id: str, revision: str, sub: str, recursive: bool,
                  auth: str | None) -> _Answer:
            repo = self._repo(repo_id, revision, auth)
            if isinstance(repo, _Answer):
                return repo
            prefix = f"{sub}/" if sub else ""
            entries: list[dict[str, Any]] = []
            folders: set[str] = set()
            for name in sorted(repo.files):
                if not name.startswith(prefix):
                    continue
                rest = name[len(prefix):]
                if "/" in rest and not recursive:
                    folders.add(prefix + rest.split("/", 1)[0])
                    continue
                if recursive:
                    bits = rest.split("/")[:-1]
                    folders.update(prefix + "/".join(bits[:i + 1]) for i in range(len(bits)))
                entry: dict[str, Any] = {"type": "file", "oid": repo.git_oid(name),
                                         "size": len(repo.files[name]), "path": name}
                if name in repo.lfs:
                    entry["lfs"] = {"oid": repo.sha256(name), "size": len(repo.files[name]),
                                    "pointerSize": 134}
                entries.append(entry)
            if sub and not entries and not folders:
                return _error(404, "EntryNotFound", f"{sub} does not exist",
                              **{"X-Repo-Commit": repo.sha})
            entries += [{"type": "directory", "oid": fake_sha(f"{repo.sha}:{d}"), "size": 0,
                         "path": d} for d in sorted(folders)]
            return _Answer(200, {"Content-Type": "application/json"},
                           json.dumps(entries).encode(), repo.repo_id)

        def _resolve(self, repo_id: str, revision: str, name: str, auth: str | None,
                     rng: str | None) -> _Answer:
            repo = self._repo(repo_id, revision, auth)
            if isinstance(repo, _Answer):
                return repo
            if name not in repo.files:
                answer = _error(404, "EntryNotFound", f"{name} does not exist",
                                **{"X-Repo-Commit": repo.sha})
                answer.repo, answer.file = repo.repo_id, name
                return answer
            data = repo.files[name]
            common = {"X-Repo-Commit": repo.sha, "ETag": f'"{repo.git_oid(name)}"'}
            if name in repo.lfs:
                sha256 = repo.sha256(name)
                where = urlencode({"repo": repo.repo_id, "file": name})
                return _Answer(302, {**common, "Location": f"{hub.cdn}/lfs/{sha256}?{where}",
                                     "X-Linked-Etag": f'"{sha256}"',
                                     "X-Linked-Size": str(len(data))},
                               b"", repo.repo_id, name)
            status, headers, body = _ranged(hub.content(repo, name), rng, hub.ignore_range,
                                            {**common, "Content-Type": "text/plain"})
            return _Answer(status, headers, body, repo.repo_id, name)

    return Handler


def use_fake_hub(monkeypatch: pytest.MonkeyPatch, hub: FakeHub, home: Path,
                 token: str | None = None) -> None:
    """Point ``huggingface_hub`` at ``hub``, with its home and caches under ``home``.

    The client reads ``HF_ENDPOINT`` and friends once, at import, into
    ``huggingface_hub.constants``; the download and API code reads those constants at call
    time, so both the environment (for anything imported later) and the constants are set.
    """
    from huggingface_hub import constants

    home.mkdir(parents=True, exist_ok=True)
    env = {"HF_ENDPOINT": hub.endpoint, "HF_HOME": str(home), "HF_HUB_CACHE": str(home / "hub"),
           "HF_HUB_OFFLINE": "0", "HF_HUB_DISABLE_TELEMETRY": "1",
           "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    for k in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_OIDC_RESOURCE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(k, raising=False)
    if token is not None:
        monkeypatch.setenv("HF_TOKEN", token)
    values: dict[str, object] = {
        "ENDPOINT": hub.endpoint,
        "HUGGINGFACE_CO_URL_TEMPLATE": hub.endpoint + "/{repo_id}/resolve/{revision}/{filename}",
        "HF_HOME": str(home),
        "HF_HUB_CACHE": str(home / "hub"),
        "HF_ASSETS_CACHE": str(home / "assets"),
        "HF_TOKEN_PATH": str(home / "token"),
        "HF_STORED_TOKENS_PATH": str(home / "stored_tokens"),
        "HF_HUB_OFFLINE": False,
        "HF_HUB_DISABLE_TELEMETRY": True,
        "HF_HUB_DISABLE_PROGRESS_BARS": True,
    }
    for name, value in values.items():
        if hasattr(constants, name):
            monkeypatch.setattr(constants, name, value)


@contextlib.contextmanager
def fake_hub(monkeypatch: pytest.MonkeyPatch, home: Path) -> Iterator[FakeHub]:
    """A started :class:`FakeHub` that ``huggingface_hub`` talks to; stopped on exit."""
    with FakeHub() as hub:
        use_fake_hub(monkeypatch, hub, home)
        yield hub
