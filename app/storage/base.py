"""The storage interface both backends implement, and its one error type."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Protocol

from maec_core.service import MaecError


class StorageError(MaecError):
    """The object store is unreachable or refused an operation."""

    code = "storage_unavailable"


class StorageDenied(StorageError):
    """The store refused this service access to a bucket or object (its credentials have
    no rights there): asking again gives the same answer, so a source it names is the
    request's error, not an outage."""


@dataclass(frozen=True)
class ObjectInfo:
    key: str
    size: int
    # Identifies the content version (S3 ETag / checksum; size+mtime locally).
    etag: str
    # The whole object's SHA-256 (hex) when the store keeps one: an S3 object uploaded
    # with a SHA-256 checksum in one part (``head`` only; listings do not carry it).
    sha256: str | None = None


# A file's expected SHA-256 (hex), or a function giving it once the file is complete.
Digest = str | Callable[[], str]
# Blocks until the first ``n`` bytes of a file being written are final.
WaitFn = Callable[[int], None]


def expected_digest(sha256: Digest) -> str:
    return sha256() if callable(sha256) else sha256


def write_stream(chunks: Iterable[bytes], dest: Path, sink: Callable[[bytes], None]) -> int:
    """``chunks`` into ``dest`` and ``sink``, in order; the bytes written."""
    written = 0
    with open(dest, "wb") as out:
        for chunk in chunks:
            sink(chunk)
            out.write(chunk)
            written += len(chunk)
    return written


def check_key(key: str) -> str:
    """Refuse keys that could escape a prefix (``..``, absolute, empty segments)."""
    parts = key.split("/")
    if not key or key.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise StorageError(f"invalid storage key {key!r}", key=key)
    return key


class Storage(Protocol):
    kind: str

    def ping(self) -> bool: ...

    def prepare(self) -> None:
        """Create the bucket/directory if missing (start-up; errors are the caller's)."""
        ...

    def put_file(self, key: str, path: Path) -> None: ...

    def put_bytes(self, key: str, data: bytes) -> None: ...

    def put_verified(self, key: str, f: BinaryIO, size: int, sha256: Digest, *,
                     wait_for: WaitFn | None = None) -> None:
        """Store the first ``size`` bytes of the open file ``f`` under ``key``, checked:
        they must hash to ``sha256`` (hex) and the store must confirm what it received;
        a mismatch is a ``StorageError`` and leaves no object at ``key``.

        For a file still being written: ``wait_for(n)`` returns once its first ``n``
        bytes are final (called before each read), and ``sha256`` may be a function
        giving the digest once the whole file is written."""
        ...

    def get_bytes(self, key: str) -> bytes: ...

    def get_range(self, key: str, start: int, end: int) -> bytes:
        """Bytes ``[start, end]`` (inclusive, as in HTTP Range)."""
        ...

    def iter_range(self, key: str, start: int, end: int, *, if_match: str | None = None
                   ) -> Iterator[bytes]:
        """Bytes ``[start, end]`` as chunks; with ``if_match``, only while the object's
        ``etag`` is still that one (a changed object is a ``StorageError``)."""
        ...

    def download_pinned(self, key: str, dest: Path, size: int, *, if_match: str | None,
                        sink: Callable[[bytes], None]) -> int:
        """The ``size`` bytes of ``key`` into ``dest`` (S3: ranged GETs in parallel),
        only while its ``etag`` is ``if_match`` (else ``StorageError``); ``sink`` gets
        the bytes in file order, each once. Returns the bytes written; the caller checks
        that and any digest."""
        ...

    def head(self, key: str) -> ObjectInfo | None: ...

    def list(self, prefix: str) -> list[ObjectInfo]: ...

    def download(self, key: str, dest: Path) -> None: ...

    def delete_prefix(self, prefix: str) -> None: ...

    def presign(self, key: str, seconds: int) -> str | None:
        """A short-lived GET URL, or None when the backend cannot make one."""
        ...

    def for_bucket(self, bucket: str) -> Storage:
        """The same store, another bucket (S3 sources); local storage refuses."""
        ...
