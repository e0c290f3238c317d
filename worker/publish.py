"""Publishing a merge's files: shards uploaded while the merge goes on, manifest last.

The engine calls :meth:`ShardUploads.on_shard_open` as each output shard is created: the
shard is opened there and then (the staging folder it lies in is renamed when the merge
ends; an open file is not affected) and uploaded on a thread as it grows, part by part
once each part's bytes are written, so even a one-shard output is mostly uploaded by the
time the merge ends. :meth:`ShardUploads.on_shard` (the shard complete) gives the digest
the writer computed, which the upload is checked against (``Storage.put_verified``).
:func:`publish` then uploads the remaining small files the same way, beside the shards'
last parts, waits for all of them, and writes ``manifest.json`` last, only once every
other file is stored and verified. On any failure or cancellation the caller stops the
uploads (:meth:`ShardUploads.stop`) before removing the staging prefix, so no upload can
land after the clean-up.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
from collections.abc import Callable, Collection, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import BinaryIO

from app.storage.base import Digest, Storage, StorageError, WaitFn, expected_digest
from maec_core.service import FileEntry
from maec_core.service.running import WrittenFile

log = logging.getLogger("maec.worker")

# Shards uploaded at once: each upload also sends several parts in parallel (S3), and
# on a GPU worker the merge itself needs little CPU, so two keep the link busy.
UPLOAD_WORKERS = 2
# How often a wait for uploads checks for cancellation (seconds).
POLL_S = 0.2
# How often an upload following a growing shard looks at its size (seconds).
GROW_POLL_S = 0.05


class _Growing:
    """A shard the writer is still appending to, followed by its upload."""

    def __init__(self, name: str, size: int) -> None:
        self.name = name
        self.size = size
        self.written: WrittenFile | None = None
        self._ended = threading.Event()

    def finish(self, written: WrittenFile) -> None:
        self.written = written
        self._ended.set()

    def stop(self) -> None:
        """The merge stopped: the shard will never be finished."""
        self._ended.set()

    def wait_for(self, fd: int, n: int) -> None:
        """Until the first ``n`` bytes are written (an append-only file: bytes below its
        size are final)."""
        while os.fstat(fd).st_size < n:
            if self._ended.is_set():
                # The size read above may predate the writer's last append: the shard can
                # be finished between that read and this check. Only a size read after
                # the end was seen is the shard's last word.
                have = os.fstat(fd).st_size
                if have >= n:
                    return
                raise StorageError(f"{self.name}: ended at {have} of {n} bytes (the merge "
                                   "stopped)", file=self.name)
            self._ended.wait(GROW_POLL_S)

    def sha256(self) -> str:
        """The writer's digest, once the shard is finished."""
        self._ended.wait()
        if self.written is None or self.written.size != self.size:
            raise StorageError(f"{self.name}: not finished as planned", file=self.name)
        return self.written.sha256


class ShardUploads:
    """Uploads files under ``prefix`` on a small pool as they are handed in."""

    def __init__(self, storage: Storage, prefix: str, *,
                 on_stored: Callable[[str, int, str], None] | None = None) -> None:
        self.storage = storage
        self.prefix = prefix
        # Called with (name, size, sha256) once a shard is stored and verified (from the
        # upload's thread; an error it raises fails the upload): how a resumable job
        # records its shards as they land (worker.resume).
        self.on_stored = on_stored
        self._pool = ThreadPoolExecutor(UPLOAD_WORKERS, thread_name_prefix="maec-upload")
        self._futures: dict[str, Future[None]] = {}
        self._growing: dict[str, _Growing] = {}
        self._lock = threading.Lock()
        self._stopped = False

    def _raise_failed(self) -> None:
        """An earlier upload's error, raised in the engine's callback: the merge fails
        now rather than at publish time."""
        with self._lock:
            failed = [f for f in self._futures.values() if f.done() and f.exception()]
        if failed:
            failed[0].result()

    def on_shard_open(self, path: Path, name: str, size: int) -> None:
        """The engine's shard-created callback: upload it as it grows."""
        self._raise_failed()
        growing = _Growing(name, size)
        with self._lock:
            self._growing[name] = growing
        self.submit(name, path, size, growing.sha256, grow=growing, shard=True)

    def on_shard(self, path: Path, written: WrittenFile) -> None:
        """The engine's finished-shard callback (called on the writer's thread)."""
        self._raise_failed()
        with self._lock:
            growing = self._growing.get(written.path)
        if growing is not None:
            growing.finish(written)
        else:
            self.submit(written.path, path, written.size, written.sha256, shard=True)

    def submit(self, name: str, path: Path, size: int, sha256: Digest, *,
               grow: _Growing | None = None, shard: bool = False) -> None:
        f = open(path, "rb")  # noqa: SIM115 - closed by _upload
        wait_for = None if grow is None else functools.partial(grow.wait_for, f.fileno())
        with self._lock:
            if self._stopped:
                f.close()
                return
            self._futures[name] = self._pool.submit(self._upload, name, f, size, sha256,
                                                    wait_for, shard)

    def _upload(self, name: str, f: BinaryIO, size: int, sha256: Digest,
                wait_for: WaitFn | None, shard: bool) -> None:
        started = time.monotonic()
        with f:
            self.storage.put_verified(f"{self.prefix}/{name}", f, size, sha256,
                                      wait_for=wait_for)
        if shard and self.on_stored is not None:
            self.on_stored(name, size, expected_digest(sha256))
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
            growing = list(self._growing.values())
        for g in growing:
            g.stop()  # an upload following an unfinished shard gives up
        for fut in futures:
            fut.cancel()
        self._pool.shutdown(wait=True, cancel_futures=True)

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def publish(uploads: ShardUploads, out: Path, files: Sequence[FileEntry],
            manifest: Path, *, cancelled: Callable[[], bool],
            progress: Callable[[int, int], None],
            stored: Collection[str] = ()) -> bool:
    """Every file of ``files`` stored and verified, then ``manifest`` last. Returns False
    (nothing more uploaded) when ``cancelled()`` turns true on the way. ``stored``:
    files already stored and verified under the prefix (a resumed merge's shards)."""
    total = len(files) + 1
    shards = uploads.names | set(stored)
    # The other files (config, tokenizer, card, recipe) are complete once the merge has
    # returned: sent now, beside the last shard's last parts, not after them.
    for f in files:
        if f.path not in shards:
            uploads.submit(f.path, out / f.path, f.size, f.sha256)
    already = sum(1 for f in files if f.path in stored)
    if not uploads.wait(cancelled, lambda n: progress(already + n, total)):
        return False
    if cancelled():
        return False
    # The commit marker: written only once every file above is stored and verified.
    uploads.storage.put_file(f"{uploads.prefix}/{manifest.name}", manifest)
    return True
