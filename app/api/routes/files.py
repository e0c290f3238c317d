"""GET /v1/jobs/{id}/files: the published files; GET /v1/jobs/{id}/files/{path}: one of
them, with single-range support.

Only paths listed in the job's result (the manifest's files plus manifest.json) are
served, so a path can never name anything else in storage.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import RedirectResponse, Response, StreamingResponse

from app.api.bounds import MAX_PATH_CHARS, shown
from app.api.deps import Auth, Caller, Services
from app.api.errors import ApiError
from app.api.routes.jobs import check_id, not_found
from app.api.schemas import PROBLEMS
from app.jobs.record import JobRecord
from app.storage.base import StorageError
from maec_contract import FileList, with_file_urls

router = APIRouter(prefix="/v1/jobs", tags=["files"], responses=PROBLEMS)
# At most 19 digits a number (every file size fits in that): a longer one does not match,
# so it is ignored like any malformed range rather than handed to int(), which refuses
# thousands of digits.
_RANGE = re.compile(r"^bytes=(\d{0,19})-(\d{0,19})$")
MAX_RANGE_CHARS = 64


def parse_range(header: str | None, size: int) -> tuple[int, int] | None:
    """``(start, end)`` inclusive for one satisfiable range; None = whole file.

    Multi-range, malformed and over-long headers are ignored (the whole file is a valid
    answer); a well-formed but unsatisfiable range raises 416.
    """
    if not header or len(header) > MAX_RANGE_CHARS:
        return None
    m = _RANGE.match(header.strip())
    if m is None:
        return None
    first, last = m.group(1), m.group(2)
    if not first and not last:
        return None
    if not first:
        n = int(last)
        if n == 0:
            raise _unsatisfiable(size)
        return max(0, size - n), size - 1
    start = int(first)
    end = min(int(last), size - 1) if last else size - 1
    if start >= size or (last and int(last) < start):
        raise _unsatisfiable(size)
    return start, end


def exactly(chunks: Iterator[bytes], nbytes: int, key: str) -> Iterator[bytes]:
    """``chunks``, raising if they end before ``nbytes``: the response then ends in a
    broken connection, never in a complete-looking short body. An object deleted (the
    job deleted or expired) or cut short while it is being read ends so."""
    left = nbytes
    for chunk in chunks:
        left -= len(chunk)
        yield chunk
    if left > 0:
        raise StorageError(f"{key} ended {left} bytes early (deleted while being read?)",
                           key=key)


def _no_file(job_id: str, path: str, status: str) -> ApiError:
    path = shown(path, 200)
    return ApiError(404, "file_not_found", f"job {job_id} has no published file {path!r}",
                    job_id=job_id, path=path, status=status)


def _unsatisfiable(size: int) -> ApiError:
    return ApiError(416, "range_not_satisfiable", f"the file has {size} bytes",
                    headers={"Content-Range": f"bytes */{size}"}, size=size)


async def owned_job(auth: Caller, job_id: str) -> JobRecord:
    """The caller's job ``job_id``: 404 for an absent one and for another key's alike."""
    check_id(job_id)
    rec = await auth.svc.store.get(job_id, auth.owner)
    if rec is None:
        raise not_found(job_id)
    return rec


def published_files(rec: JobRecord) -> dict[str, dict[str, Any]]:
    """The files ``rec`` serves, by path: its result's, once it has succeeded; none
    before. The only paths ever turned into storage keys."""
    if rec.status != "succeeded" or not rec.result_prefix:
        return {}
    return {f["path"]: f for f in (rec.result or {}).get("files", [])}


def published_entry(rec: JobRecord, path: str) -> dict[str, Any]:
    """``path``'s entry in what ``rec`` published; 404 ``file_not_found`` otherwise."""
    entry = published_files(rec).get(path) if len(path) <= MAX_PATH_CHARS else None
    if entry is None:
        raise _no_file(rec.id, path, rec.status)
    return entry


def serve(svc: Services, rec: JobRecord, entry: dict[str, Any], request: Request, *,
          redirect: int | None = None, extra: Mapping[str, str] | None = None) -> Response:
    """One published file: with ``redirect`` (a status), a redirect to a presigned URL
    where storage makes one; otherwise its bytes, a single range honoured (HEAD: the
    same headers, no body). The sha256 is the ``ETag``; ``extra`` headers ride along."""
    key = f"{rec.result_prefix}/{entry['path']}"
    size = int(entry["size"])
    headers = {"Accept-Ranges": "bytes", "ETag": f'"{entry["sha256"]}"', **(extra or {})}
    if redirect is not None:
        url = svc.storage.presign(key, svc.settings.s3_presign_seconds)
        if url is not None:
            return RedirectResponse(url, status_code=redirect, headers=headers)
    rng = parse_range(request.headers.get("range"), size)
    if rng is None:
        start, end, status = 0, size - 1, 200
    else:
        (start, end), status = rng, 206
        headers["Content-Range"] = f"bytes {start}-{end}/{size}"
    headers["Content-Length"] = str(end - start + 1)
    if size == 0 or request.method == "HEAD":
        return Response(b"", status_code=status, headers=headers,
                        media_type="application/octet-stream")
    body = exactly(svc.storage.iter_range(key, start, end), end - start + 1, key)
    return StreamingResponse(body, status_code=status,
                             headers=headers, media_type="application/octet-stream")


@router.get("/{job_id}/files", response_model=FileList)
async def list_files(job_id: str, auth: Auth) -> FileList:
    """What the job published (path, size, sha256, download URL), from its manifest;
    empty until it has succeeded. Another key's job is a 404, as for the job itself."""
    rec = await owned_job(auth, job_id)
    served = with_file_urls(rec.result or {}, job_id) if rec.status == "succeeded" else {}
    files = served.get("files", [])
    return FileList(job_id=job_id, status=rec.status, files=files)


# "/files/" too: registered before the file route, whose empty path would otherwise
# answer it with a 404.
router.add_api_route("/{job_id}/files/", list_files, methods=["GET"],
                     response_model=FileList, include_in_schema=False)


@router.get("/{job_id}/files/{path:path}", response_class=StreamingResponse,
            responses={206: {"description": "partial content"},
                       307: {"description": "redirect to a presigned URL"}})
async def get_file(
    job_id: str, path: str, request: Request, auth: Auth,
    redirect: Annotated[bool, Query()] = False,
) -> Response:
    """One published file's bytes, with a sha256 `ETag` and single-range support;
    `?redirect=true` on S3 storage answers 307 to a short-lived presigned URL."""
    rec = await owned_job(auth, job_id)
    entry = published_entry(rec, path)
    return serve(auth.svc, rec, entry, request, redirect=307 if redirect else None)
