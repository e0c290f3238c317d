"""Parallel, resumable, verified download of a job's output folder.

Layout while downloading ``DIR``::

    DIR.partial/.maec-download.json      which job this partial folder belongs to
    DIR.partial/<path>.part              a small file in flight (bytes 0..n so far)
    DIR.partial/<path>.part.<a>-<b>      one range of a large file (bytes a..a+n so far)
    DIR.partial/<path>                   a complete file (verified before the rename)

A part file's length *is* its progress, so resuming needs no state file: each range
continues with ``Range: bytes=<a+len>-<b>``. Range boundaries are in the name, so a run
with another ``part_size`` discards stale parts instead of splicing them wrongly. Only
when every file matches the manifest's sha256 does ``DIR.partial`` become ``DIR`` with
one rename, so ``DIR`` existing means "complete and verified".
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import sys
import threading
from collections.abc import Callable
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

import httpx
from tqdm import tqdm

from maec_client.client import RETRY_STATUS
from maec_client.errors import (
    ApiError,
    ChecksumMismatch,
    DownloadError,
    JobNotSucceeded,
    NetworkError,
    RangeNotSatisfiable,
    error_from_response,
)
from maec_client.models import FileInfo, Job

if TYPE_CHECKING:
    from maec_client.client import Client

MARKER = ".maec-download.json"
MiB = 1 << 20
ByteCallback = Callable[[int, int], None]


@dataclass
class _Range:
    file: FileInfo
    part: Path
    start: int
    end: int  # inclusive, as in the Range header

    @property
    def length(self) -> int:
        return self.end - self.start + 1


@dataclass
class _Plan:
    file: FileInfo
    final: Path
    ranges: list[_Range] = field(default_factory=list)
    verified: bool = False  # complete and hash-checked already (from an earlier run)


class _Progress:
    """Byte counter shared by the worker threads: a tqdm bar and/or a callback."""

    def __init__(self, total: int, initial: int, show: bool,
                 callback: ByteCallback | None, stop: threading.Event) -> None:
        self.total = total
        self.done = initial
        self._lock = threading.Lock()
        self.stop = stop
        self._callback = callback
        self._bar = tqdm(total=total, initial=initial, unit="B", unit_scale=True,
                         unit_divisor=1024, desc="download", file=sys.stderr,
                         dynamic_ncols=True, disable=not show)

    def add(self, n: int) -> None:
        with self._lock:
            self.done += n
            self._bar.update(n)
            if self._callback is not None:
                self._callback(self.done, self.total)

    def close(self) -> None:
        self._bar.close()


def safe_relpath(path: str) -> PurePosixPath:
    """A manifest path as a relative path that cannot escape the target folder."""
    rel = PurePosixPath(path)
    if (not path or "\\" in path or "\x00" in path or rel.is_absolute()
            or any(p in ("", ".", "..") for p in path.split("/"))):
        raise DownloadError(f"refusing unsafe file path {path!r} from the service")
    if rel.name == MARKER or rel.name.endswith(".part") or ".part." in rel.name:
        # Would collide with this module's own bookkeeping names.
        raise DownloadError(f"refusing reserved file name {path!r}")
    return rel


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        while chunk := fh.read(4 * MiB):
            h.update(chunk)
    return h.hexdigest()


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def expected_files(job: Job) -> list[FileInfo]:
    """The job's files, cross-checked against its manifest (the thing that ships)."""
    if job.status != "succeeded" or job.result is None:
        raise JobNotSucceeded(f"job {job.id} is {job.status}: nothing to download")
    files = job.result.files
    listed = {f.path: f for f in files}
    if len(listed) != len(files):
        raise DownloadError(f"job {job.id} lists a file twice")
    for entry in job.result.manifest.get("files", []):
        if not isinstance(entry, dict) or "path" not in entry:
            continue
        got = listed.get(str(entry["path"]))
        if got is None:
            raise DownloadError(f"manifest file {entry['path']} is not downloadable "
                                f"(missing from the job's files)")
        if "sha256" in entry and str(entry["sha256"]) != got.sha256:
            raise ChecksumMismatch(got.path, str(entry["sha256"]), got.sha256)
        if "size" in entry and int(entry["size"]) != got.size:
            raise ChecksumMismatch(got.path, f"size {entry['size']}", f"size {got.size}")
    for f in files:
        safe_relpath(f.path)
        if f.size < 0 or not re.fullmatch(r"[0-9a-f]{64}", f.sha256):
            raise DownloadError(f"file {f.path}: invalid size or sha256 in job result")
    return files


def download_job(client: Client, job: Job, dest: Path, *, workers: int = 8,
                 part_size: int = 64 * MiB, progress: bool = False,
                 on_bytes: ByteCallback | None = None, overwrite: bool = False,
                 redirect: bool = False, retries: int = 5) -> Path:
    """Download every file of ``job`` into ``dest``; returns ``dest``.

    Files larger than ``part_size`` are split into ranges; all ranges of all files share
    ``workers`` threads. A transport error retries that range from where it stopped
    (``retries`` times without progress). If the call still fails, the bytes stay in
    ``dest.partial`` and the next call continues them. ``redirect`` asks the service for
    307s to presigned store URLs (S3 storage only) instead of proxying the bytes.
    """
    if workers < 1 or part_size < 1:
        raise ValueError("workers and part_size must be positive")
    files = expected_files(job)
    dest = Path(dest)
    if dest.exists() and not overwrite:
        raise DownloadError(f"{dest} already exists (use overwrite)")
    partial = dest.with_name(dest.name + ".partial")
    _claim_partial(partial, job.id, overwrite)

    plans = [_Plan(f, partial / safe_relpath(f.path)) for f in files]
    stop = threading.Event()
    # Files completed by an earlier run are re-hashed (in parallel): kept if they match,
    # otherwise fetched again, so stale or damaged leftovers heal without a second run.
    _run_parallel(workers, [_reuse_task(p) for p in plans], stop)
    for p in plans:
        if not p.verified:
            _split(p, part_size)
    total = sum(f.size for f in files)
    have = sum(_present(p) for p in plans)
    bar = _Progress(total, have, progress, on_bytes, stop)
    try:
        todo = [r for p in plans for r in p.ranges]
        _run_parallel(workers, [_fetch_task(client, job.id, r, bar, redirect, retries)
                                for r in todo], stop)
        _run_parallel(workers, [_finish_task(p) for p in plans if not p.verified], stop)
    finally:
        bar.close()

    _prune(partial, {p.final for p in plans})
    (partial / MARKER).unlink()
    _publish(partial, dest, overwrite)
    return dest


def _claim_partial(partial: Path, job_id: str, overwrite: bool) -> None:
    marker = partial / MARKER
    if partial.exists():
        try:
            owner = json.loads(marker.read_text()).get("job_id")
        except (OSError, ValueError, AttributeError):
            owner = None
        if owner != job_id:
            if not overwrite:
                raise DownloadError(f"{partial} holds another download ({owner or 'unknown'}); "
                                    "remove it or use overwrite")
            shutil.rmtree(partial)
    partial.mkdir(parents=True, exist_ok=True)
    marker.write_text(json.dumps({"job_id": job_id}))


def _reuse_task(plan: _Plan) -> Callable[[], None]:
    return lambda: _reuse(plan)


def _reuse(plan: _Plan) -> None:
    f, final = plan.file, plan.final
    final.parent.mkdir(parents=True, exist_ok=True)
    if not final.is_file():
        return
    if final.stat().st_size == f.size and sha256_file(final) == f.sha256:
        plan.verified = True
    else:
        final.unlink()


def _split(plan: _Plan, part_size: int) -> None:
    """Ranges still to fetch for a file; part files of other boundaries are dropped."""
    f, final = plan.file, plan.final
    if f.size > part_size:
        bounds = [(a, min(a + part_size, f.size) - 1) for a in range(0, f.size, part_size)]
        plan.ranges = [_Range(f, final.with_name(f"{final.name}.part.{a}-{b}"), a, b)
                       for a, b in bounds]
    elif f.size > 0:
        plan.ranges = [_Range(f, final.with_name(final.name + ".part"), 0, f.size - 1)]
    wanted = {r.part.name for r in plan.ranges}
    for stale in final.parent.glob(f"{_glob_escape(final.name)}.part*"):
        if stale.name not in wanted:
            stale.unlink()


def _glob_escape(name: str) -> str:
    return re.sub(r"([*?\[])", r"[\1]", name)


def _present(plan: _Plan) -> int:
    if plan.verified:
        return plan.file.size
    total = 0
    for r in plan.ranges:
        size = r.part.stat().st_size if r.part.exists() else 0
        if size > r.length:
            r.part.unlink()  # longer than its range: cannot be ours, start it again
            size = 0
        total += size
    return total


def _run_parallel(workers: int, tasks: list[Callable[[], None]],
                  stop: threading.Event) -> None:
    """Run tasks on a pool; the first exception (or Ctrl-C) stops the rest and is raised.

    ``stop`` is polled by running fetches between chunks, so a failure in one range does
    not leave other threads streaming gigabytes that will be thrown away.
    """
    if not tasks:
        return

    def guarded(task: Callable[[], None]) -> None:
        if stop.is_set():
            return  # queued behind a failure: don't start it
        try:
            task()
        except BaseException:
            stop.set()  # at once, so a free worker does not pick up the next task
            raise

    pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="maec-dl")
    try:
        futures: list[Future[None]] = [pool.submit(guarded, t) for t in tasks]
        wait(futures, return_when=FIRST_EXCEPTION)
        # Let the others wind down (stop is set on any failure; they end within a chunk),
        # then report the cause: _Stopped in other tasks is only its consequence.
        wait(futures)
        errors = [e for e in (f.exception() for f in futures) if e is not None]
        causes = [e for e in errors if not isinstance(e, _Stopped)]
        if causes or errors:
            raise (causes or errors)[0]
    except BaseException:
        stop.set()
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _file_url(job_id: str, f: FileInfo) -> str:
    if f.url:
        return f.url
    return f"/v1/jobs/{quote(job_id, safe='')}/files/{quote(f.path)}"


def _fetch_task(client: Client, job_id: str, r: _Range, bar: _Progress, redirect: bool,
                retries: int) -> Callable[[], None]:
    return lambda: _fetch_range(client, job_id, r, bar, redirect, retries)


def _fetch_range(client: Client, job_id: str, r: _Range, bar: _Progress, redirect: bool,
                 retries: int) -> None:
    url = _file_url(job_id, r.file)
    params = {"redirect": "true"} if redirect else None
    failures = 0
    while True:
        have = r.part.stat().st_size if r.part.exists() else 0
        if have >= r.length:
            return
        before = have
        try:
            _stream_into(client, url, params, r, have, bar)
        except (httpx.TransportError, _ShortRead) as exc:
            error: Exception = exc
        except ApiError as exc:
            if exc.status not in RETRY_STATUS:
                raise
            error = exc
        else:
            continue  # re-check the length: a complete part returns above
        now = r.part.stat().st_size if r.part.exists() else 0
        # Only consecutive attempts without progress count: a slow flaky link still finishes.
        failures = 0 if now > before else failures + 1
        if failures > retries:
            raise NetworkError(f"{r.file.path}: gave up after {failures} failed attempts "
                               f"({error}); run again to resume from {now} bytes") from error
        client._sleep(client.retry_delay(failures - 1,
                                         error if isinstance(error, ApiError) else None))


class _ShortRead(Exception):
    """The server ended a response before the range was complete."""


class _Stopped(Exception):
    """Another range failed (or Ctrl-C): this one stops, its bytes stay for a resume."""


def _stream_into(client: Client, url: str, params: dict[str, str] | None, r: _Range,
                 have: int, bar: _Progress) -> None:
    first = r.start + have
    headers = {"Range": f"bytes={first}-{r.end}"}
    with client.http.stream("GET", url, params=params, headers=headers) as resp:
        if resp.status_code >= 400:
            resp.read()
            try:
                body: Any = resp.json()
            except ValueError:
                body = resp.text
            raise error_from_response(resp.status_code, body, resp.headers.get("retry-after"))
        etag = _sha256_etag(resp.headers.get("etag"))
        if etag is not None and etag != r.file.sha256:
            # The service is serving other bytes than the job lists: stop before fetching them.
            raise ChecksumMismatch(r.file.path, r.file.sha256, f"ETag {etag}")
        skip = 0
        if resp.status_code == 206:
            _check_content_range(resp.headers.get("content-range"), first, r)
        elif resp.status_code == 200:
            skip = first  # Range ignored (some proxies): discard the bytes we already have
        else:
            raise RangeNotSatisfiable("unexpected_status",
                                      f"{r.file.path}: HTTP {resp.status_code} for a range",
                                      {}, resp.status_code)
        remaining = r.length - have
        with r.part.open("ab") as out:
            # No chunk_size: httpx would buffer up to it, and bytes buffered when the
            # connection drops are lost to the resume; write what arrives as it arrives.
            for chunk in resp.iter_bytes():
                if skip:
                    cut = min(skip, len(chunk))
                    chunk = chunk[cut:]
                    skip -= cut
                if bar.stop.is_set():
                    raise _Stopped
                if not chunk:
                    continue
                chunk = chunk[:remaining]
                out.write(chunk)
                remaining -= len(chunk)
                bar.add(len(chunk))
                if remaining == 0:
                    break
    if remaining:
        raise _ShortRead(f"{r.file.path}: stream ended {remaining} bytes early")


def _sha256_etag(value: str | None) -> str | None:
    """The service's ETag is the sha256; a store's (after a redirect: S3's MD5) is not."""
    if not value:
        return None
    tag = value.strip().removeprefix("W/").strip('"')
    return tag if re.fullmatch(r"[0-9a-f]{64}", tag) else None


def _check_content_range(value: str | None, first: int, r: _Range) -> None:
    m = re.fullmatch(r"bytes (\d+)-(\d+)/(\d+|\*)", (value or "").strip())
    if not m or int(m.group(1)) != first:
        raise RangeNotSatisfiable("bad_content_range",
                                  f"{r.file.path}: asked bytes {first}-{r.end}, got {value!r}",
                                  {}, 206)
    if m.group(3) != "*" and int(m.group(3)) != r.file.size:
        raise ChecksumMismatch(r.file.path, f"size {r.file.size}", f"size {m.group(3)}")


def _finish_task(plan: _Plan) -> Callable[[], None]:
    return lambda: _finish(plan)


def _finish(plan: _Plan) -> None:
    """Assemble a file's parts, verify size and sha256, and make it the complete file."""
    f, final = plan.file, plan.final
    h = hashlib.sha256()
    if not plan.ranges:
        final.touch()  # a zero-byte file: nothing was fetched
        src = final
    elif len(plan.ranges) == 1:
        src = plan.ranges[0].part
        with src.open("rb") as fh:
            while chunk := fh.read(4 * MiB):
                h.update(chunk)
    else:
        src = final.with_name(final.name + ".part")
        with src.open("wb") as out:
            for r in plan.ranges:
                with r.part.open("rb") as fh:
                    while chunk := fh.read(4 * MiB):
                        h.update(chunk)
                        out.write(chunk)
        for r in plan.ranges:
            r.part.unlink()
    size = src.stat().st_size
    actual = h.hexdigest()
    if size != f.size or actual != f.sha256:
        # Drop the bad bytes so the next run fetches this file again instead of trusting them.
        src.unlink()
        raise ChecksumMismatch(f.path, f.sha256, actual if size == f.size else f"size {size}")
    _fsync(src)
    if src != final:
        os.replace(src, final)


def _prune(partial: Path, keep: set[Path]) -> None:
    """Remove anything in the partial folder that is not an expected file."""
    for path in sorted(partial.rglob("*"), key=lambda p: len(p.parts), reverse=True):
        if path.name == MARKER and path.parent == partial:
            continue
        if path.is_dir():
            with contextlib.suppress(OSError):
                path.rmdir()  # only empty leftovers go
        elif path not in keep:
            path.unlink()


def _publish(partial: Path, dest: Path, overwrite: bool) -> None:
    if dest.exists():
        if not overwrite:
            raise DownloadError(f"{dest} appeared while downloading; result left in {partial}")
        old = dest.with_name(f"{dest.name}.old-{os.getpid()}")
        os.rename(dest, old)
        os.rename(partial, dest)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(partial, dest)
    # Make the rename itself durable, not just the file contents.
    with contextlib.suppress(OSError):
        fd = os.open(dest.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
