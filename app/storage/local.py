"""Local-directory storage: the embedded default for one machine and the dev run.

Writes go to a temporary file and are renamed into place, so a reader sees a whole file
or none, as with S3.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO

from app.storage.base import (
    Digest,
    ObjectInfo,
    Storage,
    StorageError,
    WaitFn,
    check_key,
    expected_digest,
    write_stream,
)

CHUNK = 1024 * 1024


def _etag(st: os.stat_result) -> str:
    return f"{st.st_size}-{st.st_mtime_ns}"


class LocalStorage:
    kind = "local"

    def __init__(self, root: Path) -> None:
        self.root = Path(root).resolve()
        self.root.mkdir(parents=True, exist_ok=True)

    def _path(self, key: str) -> Path:
        return self.root / check_key(key)

    def prepare(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)

    def ping(self) -> bool:
        return self.root.is_dir() and os.access(self.root, os.W_OK)

    def _atomic(self, key: str) -> tuple[Path, Path]:
        dest = self._path(key)
        dest.parent.mkdir(parents=True, exist_ok=True)
        return dest, dest.parent / f".{dest.name}.{uuid.uuid4().hex[:8]}.part"

    def put_file(self, key: str, path: Path) -> None:
        dest, tmp = self._atomic(key)
        try:
            shutil.copyfile(path, tmp)
            os.replace(tmp, dest)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            raise StorageError(f"cannot store {key}: {exc.strerror}", key=key) from None

    def put_verified(self, key: str, f: BinaryIO, size: int, sha256: Digest, *,
                     wait_for: WaitFn | None = None) -> None:
        dest, tmp = self._atomic(key)
        digest = hashlib.sha256()
        try:
            f.seek(0)
            with open(tmp, "wb") as out:
                left = size
                while left > 0:
                    n = min(CHUNK * 8, left)
                    if wait_for is not None:
                        wait_for(size - left + n)
                    chunk = f.read(n)
                    if not chunk:
                        break
                    digest.update(chunk)
                    out.write(chunk)
                    left -= len(chunk)
            if left or digest.hexdigest() != expected_digest(sha256):
                raise StorageError(f"{key}: the bytes stored are not the ones hashed "
                                   f"({size - left} of {size} bytes read)", key=key)
            os.replace(tmp, dest)
        except OSError as exc:
            raise StorageError(f"cannot store {key}: {exc.strerror}", key=key) from None
        finally:
            tmp.unlink(missing_ok=True)

    def put_bytes(self, key: str, data: bytes) -> None:
        dest, tmp = self._atomic(key)
        tmp.write_bytes(data)
        os.replace(tmp, dest)

    def get_bytes(self, key: str) -> bytes:
        try:
            return self._path(key).read_bytes()
        except FileNotFoundError:
            raise StorageError(f"no object {key}", key=key) from None

    def get_range(self, key: str, start: int, end: int) -> bytes:
        with open(self._path(key), "rb") as f:
            f.seek(start)
            return f.read(end - start + 1)

    def iter_range(self, key: str, start: int, end: int, *, if_match: str | None = None
                   ) -> Iterator[bytes]:
        with open(self._path(key), "rb") as f:
            if if_match is not None and _etag(os.fstat(f.fileno())) != if_match:
                raise StorageError(f"{key} changed since it was listed", key=key)
            f.seek(start)
            left = end - start + 1
            while left > 0:
                chunk = f.read(min(CHUNK, left))
                if not chunk:
                    break
                left -= len(chunk)
                yield chunk

    def download_pinned(self, key: str, dest: Path, size: int, *, if_match: str | None,
                        sink: Callable[[bytes], None]) -> int:
        chunks = self.iter_range(key, 0, size - 1, if_match=if_match) if size else ()
        return write_stream(chunks, dest, sink)

    def head(self, key: str) -> ObjectInfo | None:
        try:
            st = self._path(key).stat()
        except FileNotFoundError:
            return None
        return ObjectInfo(key, st.st_size, _etag(st))

    def list(self, prefix: str) -> list[ObjectInfo]:
        base = self._path(prefix.rstrip("/")) if prefix.strip("/") else self.root
        if not base.is_dir():
            return []
        out = []
        for dirpath, _dirs, files in os.walk(base):
            for name in files:
                if name.startswith(".") and name.endswith(".part"):
                    continue
                p = Path(dirpath) / name
                st = p.stat()
                key = p.relative_to(self.root).as_posix()
                out.append(ObjectInfo(key, st.st_size, _etag(st)))
        return sorted(out, key=lambda o: o.key)

    def download(self, key: str, dest: Path) -> None:
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(self._path(key), dest)

    def delete_prefix(self, prefix: str) -> None:
        target = self._path(prefix.rstrip("/"))
        shutil.rmtree(target, ignore_errors=True)
        # As in S3, where a prefix exists only while objects do: folders left empty go too
        # (an attempt's removed uploads leave no empty jobs/<id>/ behind).
        for parent in target.parents:
            # Top-level folders (jobs/, artifacts/) stay: another upload may be creating
            # its folder inside one right now.
            if parent.parent == self.root or not parent.is_relative_to(self.root):
                break
            try:
                parent.rmdir()
            except OSError:  # not empty (or already gone): stop here
                break

    def presign(self, key: str, seconds: int) -> str | None:
        return None

    def for_bucket(self, bucket: str) -> Storage:
        raise StorageError(
            "s3:// sources need S3 storage (MAEC_STORAGE_BACKEND=s3); this service "
            "uses a local directory", bucket=bucket,
        )
