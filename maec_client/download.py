"""Parallel, resumable, verified download of a job's output folder.

Layout while downloading ``DIR``::

    DIR.partial/.maec-download.json      which job this partial folder belongs to
    DIR.partial/<path>.part              a file in flight
    DIR.partial/<path>.part.json         bytes done per range, for a file fetched in ranges
    DIR.partial/<path>                   a complete file (verified before the rename)

A file up to ``part_size`` is one stream appended to ``.part``: its length is its
progress, and a resume asks for ``Range: bytes=<len>-``. A larger file is split into
ranges written in place (pwrite at their offsets, so no concatenation pass doubles the
disk traffic), with the bytes done per range in ``.part.json``; each range resumes from
its own offset. Only when every file matches the manifest's sha256 does ``DIR.partial``
become ``DIR`` with one rename, so ``DIR`` existing means "complete and verified".
"""

from __future__ import annotations

import contextlib
import fcntl
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
from typing import Any, Protocol
from urllib.parse import quote

import httpx
from tqdm import tqdm

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
from maec_client.options import ByteCallback, DownloadOptions, MiB
from maec_client.retry import RetryPolicy


class Connection(Protocol):
    """What a download uses of its :class:`maec_client.client.Client` (the client calls
    this module, so the type is spelled here instead of imported back): the HTTP
    connection, the retry policy and the sleep its waits go through."""

    http: httpx.Client
    retry: RetryPolicy
    _sleep: Callable[[float], None]


MARKER = ".maec-download.json"


class _Ledger:
    """Bytes done per range of a file whose ranges are written in place.

    Saved atomically every SAVE_EVERY bytes and whenever a range attempt ends. After a
    crash it may lag the data (those bytes are fetched again); it never runs ahead of
    what was written in this process, and the final sha256 catches anything else.
    """

    SAVE_EVERY = 16 * MiB

    def __init__(self, path: Path, size: int, bounds: list[tuple[int, int]]) -> None:
        self.path = path
        self.size = size
        self.bounds = bounds
        self.done = {a: 0 for a, _ in bounds}
        self._lock = threading.Lock()
        self._unsaved = 0

    @classmethod
    def open(cls, path: Path, data: Path, size: int,
             bounds: list[tuple[int, int]]) -> _Ledger:
        ledger = cls(path, size, bounds)
        try:
            raw = json.loads(path.read_text())
        except (OSError, ValueError):
            raw = None
        if (data.exists() and isinstance(raw, dict) and raw.get("size") == size
                and raw.get("ranges") == [list(b) for b in bounds]
                and isinstance(raw.get("done"), dict)):
            for a, b in bounds:
                ledger.done[a] = max(0, min(int(raw["done"].get(str(a), 0)), b - a + 1))
        elif data.exists() and raw is None and not path.exists():
            # A single-stream run (larger part_size) left a contiguous prefix: credit it.
            have = data.stat().st_size
            for a, b in bounds:
                ledger.done[a] = max(0, min(have - a, b - a + 1))
        else:
            data.unlink(missing_ok=True)  # other boundaries or no trustworthy record
        ledger.save()
        return ledger

    def add(self, start: int, n: int) -> None:
        with self._lock:
            self.done[start] += n
            self._unsaved += n
            due = self._unsaved >= self.SAVE_EVERY
        if due:
            self.save()

    def save(self) -> None:
        with self._lock:
            doc = {"size": self.size, "ranges": [list(b) for b in self.bounds],
                   "done": {str(a): n for a, n in self.done.items()}}
            self._unsaved = 0
            tmp = self.path.with_name(f"{self.path.name}.{threading.get_ident()}.tmp")
            tmp.write_text(json.dumps(doc))
            os.replace(tmp, self.path)


@dataclass
class _Range:
    file: FileInfo
    part: Path
    start: int
    end: int  # inclusive, as in the Range header
    ledger: _Ledger | None = None  # None: a single stream appended to ``part``

    @property
    def length(self) -> int:
        return self.end - self.start + 1

    def have(self) -> int:
        if self.ledger is not None:
            return self.ledger.done[self.start]
        return self.part.stat().st_size if self.part.exists() else 0


class _Writer:
    """Writes a range's bytes: appended (single stream) or in place at the range offset."""

    def __init__(self, r: _Range, first: int) -> None:
        self.r = r
        self.pos = first
        flags = os.O_WRONLY | os.O_CREAT | (os.O_APPEND if r.ledger is None else 0)
        self.fd = os.open(r.part, flags, 0o644)

    def write(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            n = (os.write(self.fd, view) if self.r.ledger is None
                 else os.pwrite(self.fd, view, self.pos))
            view = view[n:]
            self.pos += n
        if self.r.ledger is not None:
            self.r.ledger.add(self.r.start, len(data))

    def close(self) -> None:
        os.close(self.fd)
        if self.r.ledger is not None:
            self.r.ledger.save()


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
    if rel.name == MARKER or rel.name.endswith((".part", ".part.json")) or ".tmp" in rel.name:
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


def download_job(client: Connection, job: Job, dest: Path,
                 options: DownloadOptions | None = None) -> Path:
    """Download every file of ``job`` into ``dest`` as ``options`` say; returns ``dest``.

    A transport error (or an answer the client's retry policy retries) retries that
    range from where it stopped, waiting as the policy says. If the call still fails,
    the bytes stay in ``dest.partial`` and the next call continues them.
    """
    opts = options or DownloadOptions()
    files = expected_files(job)
    dest = Path(dest)
    if dest.exists() and not opts.overwrite:
        raise DownloadError(f"{dest} already exists (use overwrite)")
    partial = dest.with_name(dest.name + ".partial")
    partial.mkdir(parents=True, exist_ok=True)
    # One downloader per folder: a second `maec jobs download` into the same DIR would
    # interleave writes into the same part files. The lock dies with the process.
    lock = os.open(partial, os.O_RDONLY)
    try:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise DownloadError(f"another download into {dest} is running") from None
        _claim_partial(partial, job.id, opts.overwrite)
        _download_into(client, job, files, (partial, dest), opts)
    finally:
        os.close(lock)
    return dest


def _download_into(client: Connection, job: Job, files: list[FileInfo],
                   folders: tuple[Path, Path], opts: DownloadOptions) -> None:
    """Fetch ``files`` into the partial folder, then publish it as the destination
    (``folders``: partial, destination)."""
    partial, dest = folders
    workers = opts.workers
    plans = [_Plan(f, partial / safe_relpath(f.path)) for f in files]
    stop = threading.Event()
    # Files completed by an earlier run are re-hashed (in parallel): kept if they match,
    # otherwise fetched again, so stale or damaged leftovers heal without a second run.
    _run_parallel(workers, [_reuse_task(p) for p in plans], stop)
    for p in plans:
        if not p.verified:
            _split(p, opts.part_size)
    total = sum(f.size for f in files)
    have = sum(_present(p) for p in plans)
    bar = _Progress(total, have, opts.progress, opts.on_bytes, stop)
    try:
        todo = [r for p in plans for r in p.ranges]
        _run_parallel(workers, [_fetch_task(client, job.id, r, bar, opts.redirect,
                                            opts.retries) for r in todo], stop)
        _run_parallel(workers, [_finish_task(p) for p in plans if not p.verified], stop)
    finally:
        bar.close()

    _prune(partial, {p.final for p in plans})
    (partial / MARKER).unlink()
    _publish(partial, dest, opts.overwrite)


def _claim_partial(partial: Path, job_id: str, overwrite: bool) -> None:
    marker = partial / MARKER
    try:
        owner = json.loads(marker.read_text()).get("job_id")
    except (OSError, ValueError, AttributeError):
        owner = None
    if owner != job_id and any(partial.iterdir()):
        if not overwrite:
            raise DownloadError(f"{partial} holds another download ({owner or 'unknown'}); "
                                "remove it or use overwrite")
        # Empty it rather than remove it: the folder itself carries our lock.
        for child in partial.iterdir():
            if child.is_dir() and not child.is_symlink():
                shutil.rmtree(child)
            else:
                child.unlink()
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
    """The ranges of a file still to fetch, resuming what an earlier run left."""
    f, final = plan.file, plan.final
    part = final.with_name(final.name + ".part")
    record = final.with_name(final.name + ".part.json")
    if f.size > part_size:
        bounds = [(a, min(a + part_size, f.size) - 1) for a in range(0, f.size, part_size)]
        ledger = _Ledger.open(record, part, f.size, bounds)
        plan.ranges = [_Range(f, part, a, b, ledger) for a, b in bounds]
    else:
        if record.exists():
            # Written in place with holes by a run with a smaller part_size: its length
            # is not a prefix, so it cannot be appended to.
            part.unlink(missing_ok=True)
            record.unlink()
        if f.size > 0:
            plan.ranges = [_Range(f, part, 0, f.size - 1)]


def _present(plan: _Plan) -> int:
    if plan.verified:
        return plan.file.size
    total = 0
    for r in plan.ranges:
        size = r.have()
        if size > r.length:
            r.part.unlink()  # longer than the file: cannot be ours, start it again
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
    # The service sends every file's URL; an empty one would mean "ask the API for it".
    return f.url or f"/v1/jobs/{quote(job_id, safe='')}/files/{quote(f.path)}"


def _fetch_task(client: Connection, job_id: str, r: _Range, bar: _Progress, redirect: bool,
                retries: int) -> Callable[[], None]:
    return lambda: _fetch_range(client, job_id, r, bar, redirect, retries)


def _fetch_range(client: Connection, job_id: str, r: _Range, bar: _Progress, redirect: bool,
                 retries: int) -> None:
    url = _file_url(job_id, r.file)
    params = {"redirect": "true"} if redirect else None
    failures = 0
    while True:
        have = r.have()
        if have >= r.length:
            return
        before = have
        try:
            _stream_into(client, url, params, r, have, bar)
        except _ShortRead as exc:
            error: Exception = exc
        except (httpx.TransportError, ApiError) as exc:
            if not client.retry.retryable(exc):
                raise
            error = exc
        else:
            continue  # re-check the length: a complete part returns above
        now = r.have()
        # Only consecutive attempts without progress count: a slow flaky link still finishes.
        failures = 0 if now > before else failures + 1
        if failures > retries:
            raise NetworkError(f"{r.file.path}: gave up after {failures} failed attempts "
                               f"({error}); run again to resume from {now} bytes") from error
        client._sleep(client.retry.delay(failures - 1, error))


class _ShortRead(Exception):
    """The server ended a response before the range was complete."""


class _Stopped(Exception):
    """Another range failed (or Ctrl-C): this one stops, its bytes stay for a resume."""


def _stream_into(client: Connection, url: str, params: dict[str, str] | None, r: _Range,
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
        out = _Writer(r, first)
        try:
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
        finally:
            out.close()
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
    """Verify a fetched file's size and sha256, then make it the complete file."""
    f, final = plan.file, plan.final
    if not plan.ranges:
        final.touch()  # a zero-byte file: nothing was fetched
        src = final
    else:
        src = plan.ranges[0].part  # every range of a file shares its part file
    size = src.stat().st_size
    actual = sha256_file(src)
    record = final.with_name(final.name + ".part.json")
    if size != f.size or actual != f.sha256:
        # Drop the bad bytes so the next run fetches this file again instead of trusting them.
        src.unlink()
        record.unlink(missing_ok=True)
        raise ChecksumMismatch(f.path, f.sha256, actual if size == f.size else f"size {size}")
    _fsync(src)
    if src != final:
        os.replace(src, final)
    record.unlink(missing_ok=True)


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
