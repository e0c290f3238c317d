"""Large objects fetched as boto3's managed transfer does: ranged GETs of one object in
parallel, each part written at its offset as it arrives.

The caller still sees the bytes in file order (``sink``), once each: the file the
transfer writes into (:class:`InOrderFile`) hands on the bytes written right after those
already handed on, and reads back from the file (the page cache, not the network) the
parts that arrived early, as soon as the gap before them is filled. So a digest is
computed while the parts download, in one pass, with no part held in memory.

Every GET carries ``If-Match`` with the ETag the object was pinned with: the transfer
manager takes the ETag (and the size) it is given instead of asking with a HEAD, and
puts it on each ranged GET, so parts of two versions can never be stitched together.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, cast

from boto3.exceptions import Boto3Error
from boto3.s3.transfer import TransferConfig, create_transfer_manager
from botocore.exceptions import BotoCoreError, ClientError
from s3transfer.exceptions import RetriesExceededError, S3DownloadFailedError, S3ValidationError
from s3transfer.subscribers import BaseSubscriber

from app.storage.base import StorageError

if TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client

Sink = Callable[[bytes], None]
# What a managed download raises when the store fails it (s3transfer's own errors are
# neither boto3's nor botocore's).
_TRANSFER_ERRORS = (ClientError, BotoCoreError, Boto3Error, RetriesExceededError,
                    S3DownloadFailedError, S3ValidationError)
# Bytes read back at a time when a gap closes.
READ_BACK = 1024 * 1024


class InOrderFile:
    """A seekable file the transfer writes parts into in any order; ``sink`` receives
    the file's bytes in order, each byte once (a retried part's bytes are not repeated)."""

    def __init__(self, path: Path, sink: Sink) -> None:
        # Unbuffered: bytes read back with pread must already be in the file.
        self._f = open(path, "w+b", buffering=0)  # noqa: SIM115 - closed by close()
        self._sink = sink
        self._pos = 0
        self.handed = 0  # bytes [0, handed) went to the sink
        self._early: dict[int, int] = {}  # start -> end of parts written past a gap
        self._lock = threading.Lock()

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        self._pos = self._f.seek(offset, whence)
        return self._pos

    def tell(self) -> int:
        return self._pos

    def write(self, data: bytes) -> int:
        with self._lock:
            start = self._pos
            view = memoryview(data)
            done = 0
            while done < len(view):  # a raw write may take fewer bytes than given
                done += self._f.write(view[done:]) or 0
            self._pos = end = start + done
            if start <= self.handed < end:
                self._sink(data[self.handed - start:])
                self.handed = end
                self._catch_up()
            elif start > self.handed:
                self._early[start] = max(end, self._early.get(start, end))
            return done

    def _catch_up(self) -> None:
        """Hand on every early part the gap before which just closed."""
        fd = self._f.fileno()
        while self._early:
            start = min(self._early)
            if start > self.handed:
                return
            end = self._early.pop(start)
            while self.handed < end:
                chunk = os.pread(fd, min(READ_BACK, end - self.handed), self.handed)
                if not chunk:
                    raise StorageError("a downloaded part vanished from the file")
                self._sink(chunk)
                self.handed += len(chunk)

    def size(self) -> int:
        return os.fstat(self._f.fileno()).st_size

    def close(self) -> None:
        self._f.close()


class _Pinned(BaseSubscriber):
    """Gives the transfer the object's size and ETag, so it skips its HEAD and sends
    ``If-Match`` with the pinned ETag on every GET."""

    def __init__(self, size: int, etag: str | None) -> None:
        self.size = size
        self.etag = etag

    def on_queued(self, future: Any, **kwargs: Any) -> None:
        future.meta.provide_transfer_size(self.size)
        if self.etag:
            future.meta.provide_object_etag(f'"{self.etag}"')


def _changed(exc: Exception) -> bool:
    if isinstance(exc, ClientError):
        return exc.response.get("Error", {}).get("Code") in ("PreconditionFailed", "412")
    return "did not match expected ETag" in str(exc)


def ranged_download(client: S3Client, config: TransferConfig, bucket: str, key: str,
                    dest: Path, size: int, *, if_match: str | None, sink: Sink) -> int:
    """Object ``key`` (``size`` bytes, pinned at ETag ``if_match``) into ``dest``; its
    bytes go to ``sink`` in order. Returns the size of the file written; the caller
    checks it and the digest."""
    out = InOrderFile(dest, sink)
    if size == 0:  # nothing to GET; the caller checks the pin with a HEAD
        out.close()
        return 0
    try:
        with create_transfer_manager(client, config) as manager:
            # A file-like object: the transfer needs seek, tell and write only.
            manager.download(bucket, key, cast("IO[bytes]", out),
                             subscribers=[_Pinned(size, if_match)]).result()
        if out.handed != out.size():
            raise StorageError(f"{key}: {out.size() - out.handed} downloaded bytes were "
                               "never handed on in order", key=key)
        return out.handed
    except _TRANSFER_ERRORS as exc:
        if _changed(exc):
            raise StorageError(f"{key} changed since it was listed", key=key) from None
        raise StorageError(f"object store error while reading {key}: {exc}",
                           key=key) from None
    finally:
        out.close()


def transfer_config(concurrency: int, part_bytes: int,
                    bytes_per_s: int | None = None) -> TransferConfig:
    """Parts of ``part_bytes``, ``concurrency`` GETs in flight; objects under two parts
    are one GET. ``bytes_per_s``: the parts of one object together read no faster
    (s3transfer's bandwidth limiter; None: no cap)."""
    return TransferConfig(multipart_threshold=2 * part_bytes, multipart_chunksize=part_bytes,
                          max_concurrency=concurrency, use_threads=True,
                          preferred_transfer_client="classic", max_bandwidth=bytes_per_s)


class RateCap:
    """A read rate shared by every ranged GET one process makes outside a managed
    transfer (``S3Storage.iter_range``: the byte ranges a part of a split merge reads,
    small objects): each chunk read books its share of the time, and the reader waits
    until its booking ends, so reads together go no faster than ``bytes_per_s``."""

    def __init__(self, bytes_per_s: int) -> None:
        self.bytes_per_s = bytes_per_s
        self._free_at = 0.0
        self._lock = threading.Lock()

    def take(self, n: int) -> None:
        """Book ``n`` bytes just read; returns once the rate allows them."""
        with self._lock:
            now = time.monotonic()
            self._free_at = max(now, self._free_at) + n / self.bytes_per_s
            wait = self._free_at - now
        if wait > 0:
            time.sleep(wait)
