"""Publishing a merge's files: shards uploaded while the merge goes on, manifest last.

The engine calls :meth:`ShardUploads.on_shard` as each output shard is complete; the
shard is opened there and then (the staging folder it lies in is renamed when the
merge ends, an open file is not affected) and uploaded on a thread, checked against the
digest the writer computed (``Storage.put_verified``). :func:`publish` then waits for
those, uploads the remaining small files the same way, and writes ``manifest.json`` last,
only once every other file is stored and verified. On any failure or cancellation the
caller stops the uploads (:meth:`ShardUploads.stop`) before removing the staging prefix,
so no upload can land after the clean-up.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any, BinaryIO

from app.storage.base import Storage
from maec_core.io.writer import WrittenFile

log = logging.getLogger("maec.worker")

# Shards uploaded at once: each upload also sends several parts in parallel (S3), and
# on a GPU worker the merge itself needs little CPU, so two keep the link busy.
UPLOAD_WORKERS = 2
# How often a wait for uploads checks for cancellation (seconds).
POLL_S = 0.2


class ShardUploads:
    """Uploads files under ``prefix`` on a small pool as they are handed in."""

    def __init__(self, storage: Storage, prefix: str) -> None:
        self.storage = storage
        self.prefix = prefix
        self._pool = ThreadPoolExecutor(UPLOAD_WORKERS, thread_name_prefix="maec-upload")
        self._futures: dict[str, Future[None]] = {}
        self._lock = threading.Lock()
        self._stopped = False

    def on_shard(self, path: Path, written: WrittenFile) -> None:
        """The engine's finished-shard callback (called on the writer's thread). An
        earlier upload's error is raised here, failing the merge now rather than at
        publish time."""
        with self._lock:
            failed = [f for f in self._futures.values() if f.done() and f.exception()]
        if failed:
            failed[0].result()
        self.submit(written.path, path, written.size, written.sha256)

    def submit(self, name: str, path: Path, size: int, sha256: str) -> None:
        f = open(path, "rb")  # noqa: SIM115 - closed by _upload
        with self._lock:
            if self._stopped:
                f.close()
                return
            self._futures[name] = self._pool.submit(self._upload, name, f, size, sha256)

    def _upload(self, name: str, f: BinaryIO, size: int, sha256: str) -> None:
        started = time.monotonic()
        with f:
            self.storage.put_verified(f"{self.prefix}/{name}", f, size, sha256)
        log.debug("uploaded %s (%d bytes) in %.2f s", name, size, time.monotonic() - started)

    @property
    def names(self) -> set[str]:
        with self._lock:
            return set(self._futures)

    def wait(self, cancelled: Callable[[], bool], done: Callable[[int], None]) -> bool:
        """Wait for every upload handed in; raise the first one's error. Returns False
        (uploads stopped) as soon as ``cancelled()`` says so; ``done(n)`` reports how
        many have finished."""
        with self._lock:
            pending = set(self._futures.values())
        total = len(pending)
        while pending:
            if cancelled():
                self.stop()
                return False
            finished, pending = wait(pending, timeout=POLL_S, return_when=FIRST_COMPLETED)
            for fut in finished:
                fut.result()
            done(total - len(pending))
        return True

    def stop(self) -> None:
        """No new uploads; queued ones dropped, running ones awaited (their errors are
        moot: the caller is about to remove the whole prefix)."""
        with self._lock:
            self._stopped = True
            futures = list(self._futures.values())
        for fut in futures:
            fut.cancel()
        self._pool.shutdown(wait=True, cancel_futures=True)

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def publish(uploads: ShardUploads, out: Path, files: list[dict[str, Any]],
            manifest: Path, *, cancelled: Callable[[], bool],
            progress: Callable[[int, int], None]) -> bool:
    """Every file of ``files`` stored and verified, then ``manifest`` last. Returns False
    (nothing more uploaded) when ``cancelled()`` turns true on the way."""
    total = len(files) + 1
    shards = uploads.names
    if not uploads.wait(cancelled, lambda n: progress(n, total)):
        return False
    rest = [f for f in files if f["path"] not in shards]
    for f in rest:
        uploads.submit(f["path"], out / f["path"], int(f["size"]), str(f["sha256"]))
    if not uploads.wait(cancelled, lambda n: progress(n, total)):
        return False
    if cancelled():
        return False
    # The commit marker: written only once every file above is stored and verified.
    uploads.storage.put_file(f"{uploads.prefix}/{manifest.name}", manifest)
    return True
