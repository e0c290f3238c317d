"""A finished job's files at the routes a Hugging Face Hub client uses, so that
``huggingface_hub`` (``snapshot_download``, ``hf_hub_download``), ``transformers``
(``from_pretrained``) and vLLM fetch the merged model as repository ``jobs/<id>`` with
``HF_ENDPOINT`` pointing at the service:

- ``GET /api/models/jobs/{id}[/revision/{rev}]``: the model info, its ``siblings``
  (name, size, LFS sha256) and ``sha``, a commit id derived from the manifest's sha256;
- ``GET /api/models/jobs/{id}/tree/{rev}[/{path}]``: the file listing;
- ``GET|HEAD /jobs/{id}/resolve/{rev}/{path}``: a file, as the files route serves it
  (ETag = sha256, ranges; on S3 a redirect to a presigned URL, as the Hub redirects
  LFS files to its CDN), with ``X-Repo-Commit`` and the ``X-Linked-*`` headers.

Revisions: ``main`` and the commit id. Keys, ownership and paths are checked by the
files route's own functions (app/api/routes/files.py); only the error answers are
dressed for the Hub client, whose ``X-Error-Code`` header picks the exception it raises
(RepositoryNotFoundError, RevisionNotFoundError, EntryNotFoundError).
"""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from app.api.deps import Caller, authenticate
from app.api.errors import ApiError
from app.api.routes.files import owned_job, published_entry, published_files, serve
from app.jobs.record import JobRecord

router = APIRouter(tags=["hub"], include_in_schema=False)
REPO_PREFIX = "jobs"
MANIFEST = "manifest.json"
# The Hub's own branch name; the client asks for it unless told a revision.
MAIN = "main"
_BAD_KEY = "Invalid credentials in Authorization header"
# Our error code -> the Hub's X-Error-Code, which the Hub client turns into its
# exception classes. A missing key answers like the Hub for a private repository.
_HUB_CODES = {"job_not_found": "RepoNotFound", "model_not_ready": "RepoNotFound",
              "revision_not_found": "RevisionNotFound", "file_not_found": "EntryNotFound"}


def _header_text(text: str) -> str:
    # Header values are latin-1 on one line; a message quotes the caller's path.
    return "".join(c if " " <= c <= "~" else "?" for c in text)[:300]


def _for_hub(exc: ApiError, commit: str | None = None) -> ApiError:
    """``exc`` with the headers the Hub client reads: same status, code and body."""
    headers = dict(exc.headers)
    hub_code = _HUB_CODES.get(exc.code)
    if hub_code is not None:
        headers["X-Error-Code"] = hub_code
    headers.setdefault("X-Error-Message", _header_text(exc.message))
    if commit is not None:
        headers["X-Repo-Commit"] = commit
    exc.headers = headers
    return exc


@asynccontextmanager
async def _hub_errors(commit: str | None = None) -> AsyncIterator[None]:
    try:
        yield
    except ApiError as exc:
        raise _for_hub(exc, commit) from None


async def _hub_caller(request: Request) -> Caller:
    """``authenticate``'s checks and answers (401, 429), with the Hub's headers: for a
    key it does not know, the Hub's own words (the client shows a 401); with no key, a
    private repository reads as absent there (RepositoryNotFoundError)."""
    try:
        return await authenticate(request)
    except ApiError as exc:
        if exc.code == "unauthorized":
            scheme, _, token = request.headers.get("authorization", "").partition(" ")
            presented = scheme.lower() == "bearer" and bool(token.strip())
            exc.headers = {**exc.headers, **({"X-Error-Message": _BAD_KEY} if presented
                                             else {"X-Error-Code": "RepoNotFound"})}
        raise _for_hub(exc) from None


HubAuth = Annotated[Caller, Depends(_hub_caller)]


def commit_id(rec: JobRecord) -> str:
    """The job's commit id: the first 40 hex digits of its manifest's sha256, so it
    names exactly the published files (the manifest lists every one's sha256), is the
    same on every read, and has the shape the Hub client takes for a commit."""
    entry = published_files(rec).get(MANIFEST)
    if entry is None:  # every succeeded job publishes one; anything else is not ready
        raise _not_ready(rec)
    return str(entry["sha256"])[:40]


def _not_ready(rec: JobRecord) -> ApiError:
    return ApiError(404, "model_not_ready",
                    f"job {rec.id} has no published model (status {rec.status})",
                    job_id=rec.id, status=rec.status)


async def _finished(auth: Caller, job_id: str, revision: str) -> tuple[JobRecord, str]:
    """The caller's succeeded job and its commit id; 404s otherwise, as the files
    route answers (another key's job reads as absent)."""
    rec = await owned_job(auth, job_id)
    commit = commit_id(rec)
    if revision not in (MAIN, commit):
        raise ApiError(404, "revision_not_found",
                       f"job {job_id} has revisions {MAIN!r} and {commit!r} only",
                       job_id=job_id, revision=_header_text(revision)[:64])
    return rec, commit


def lfs_pointer(sha256: str, size: int) -> bytes:
    """The Git LFS pointer a Hub repository would hold for the file: its git blob id
    and length are what the Hub reports as ``blobId`` / ``pointerSize``."""
    return f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha256}\nsize {size}\n" \
        .encode()


def _blob_id(pointer: bytes) -> str:
    # Git's object id of a blob (sha1 over a header and the content), not a security use.
    return hashlib.sha1(b"blob %d\0" % len(pointer) + pointer, usedforsecurity=False) \
        .hexdigest()


def sibling(entry: dict[str, Any]) -> dict[str, Any]:
    """One file as the Hub describes an LFS file in model info."""
    sha, size = str(entry["sha256"]), int(entry["size"])
    pointer = lfs_pointer(sha, size)
    return {"rfilename": entry["path"], "size": size, "blobId": _blob_id(pointer),
            "lfs": {"sha256": sha, "size": size, "pointerSize": len(pointer)}}


def model_info(rec: JobRecord, commit: str) -> dict[str, Any]:
    """The Hub's model info for the job's published model."""
    siblings = [sibling(e) for e in published_files(rec).values()]
    repo = f"{REPO_PREFIX}/{rec.id}"
    return {"_id": rec.id, "id": repo, "modelId": repo, "author": REPO_PREFIX,
            "sha": commit, "private": True, "gated": False, "disabled": False,
            "downloads": 0, "likes": 0, "library_name": "transformers",
            "tags": ["transformers", "safetensors", "merge"],
            "createdAt": rec.created_at, "lastModified": rec.finished_at or rec.created_at,
            "siblings": siblings, "usedStorage": sum(s["size"] for s in siblings)}


@router.get(f"/api/models/{REPO_PREFIX}/{{job_id}}")
async def get_model_info(job_id: str, auth: HubAuth) -> JSONResponse:
    """Model info at ``main``."""
    return await get_model_info_at(job_id, MAIN, auth)


# ``:path``: the client sends a revision such as ``refs/pr/1`` with its slashes
# %-encoded, and the route matches the decoded path.
@router.get(f"/api/models/{REPO_PREFIX}/{{job_id}}/revision/{{revision:path}}")
async def get_model_info_at(job_id: str, revision: str, auth: HubAuth) -> JSONResponse:
    """Model info at ``revision`` (``main`` or the commit id)."""
    async with _hub_errors():
        rec, commit = await _finished(auth, job_id, revision)
    return JSONResponse(model_info(rec, commit), headers={"X-Repo-Commit": commit})


def tree(rec: JobRecord, under: str, recursive: bool) -> list[dict[str, Any]]:
    """The tree listing under folder ``under`` ("" = the top): files, and without
    ``recursive`` the folders directly in it."""
    prefix = f"{under.strip('/')}/" if under.strip("/") else ""
    out: list[dict[str, Any]] = []
    folders: set[str] = set()
    for path, entry in published_files(rec).items():
        if not path.startswith(prefix):
            continue
        rest = path[len(prefix):]
        if not recursive and "/" in rest:
            folders.add(prefix + rest.split("/", 1)[0])
            continue
        s = sibling(entry)
        out.append({"type": "file", "path": path, "size": s["size"], "oid": s["blobId"],
                    "lfs": {"oid": s["lfs"]["sha256"], "size": s["size"],
                            "pointerSize": s["lfs"]["pointerSize"]}})
    out += [{"type": "directory", "path": f, "size": 0,
             "oid": hashlib.sha1(f.encode(), usedforsecurity=False).hexdigest()}
            for f in sorted(folders)]
    return out


@router.get(f"/api/models/{REPO_PREFIX}/{{job_id}}/tree/{{revision}}")
async def get_tree(job_id: str, revision: str, auth: HubAuth,
                   recursive: bool = False) -> JSONResponse:
    """The files at the top (all of them with ``recursive``)."""
    return await get_tree_under(job_id, revision, "", auth, recursive)


@router.get(f"/api/models/{REPO_PREFIX}/{{job_id}}/tree/{{revision}}/{{path:path}}")
async def get_tree_under(job_id: str, revision: str, path: str, auth: HubAuth,
                         recursive: bool = False) -> JSONResponse:
    """The files under folder ``path``; a folder nothing is published under is a 404."""
    async with _hub_errors():
        rec, commit = await _finished(auth, job_id, revision)
    listing = tree(rec, path, recursive)
    if path.strip("/") and not listing:
        raise _for_hub(ApiError(404, "file_not_found",
                                f"job {job_id} has no published folder {path[:200]!r}",
                                job_id=job_id), commit)
    return JSONResponse(listing, headers={"X-Repo-Commit": commit})


@router.api_route(f"/{REPO_PREFIX}/{{job_id}}/resolve/{{revision}}/{{path:path}}",
                  methods=["GET", "HEAD"])
async def resolve(job_id: str, revision: str, path: str, request: Request,
                  auth: HubAuth) -> Response:
    """One file, served by the files route's code: on S3 a 302 to a presigned URL
    (the Hub client follows it without the key), elsewhere the bytes themselves."""
    async with _hub_errors():
        rec, commit = await _finished(auth, job_id, revision)
    async with _hub_errors(commit):
        entry = published_entry(rec, path)
    # X-Linked-*: what the Hub sends for LFS files, and what the client reads from a
    # redirect (whose own length is not the file's).
    extra = {"X-Repo-Commit": commit, "X-Linked-Etag": f'"{entry["sha256"]}"',
             "X-Linked-Size": str(entry["size"])}
    return serve(auth.svc, rec, entry, request, redirect=302, extra=extra)
