"""Fetch a job's sources into local folders, through a size-capped LRU disk cache.

Cache entries are whole objects keyed by their content identity (size + ETag, which S3
derives from the bytes), so the same weights under two names are stored once and a
repeated donor is not downloaded again. A job's input folder is made of hard links to
cache entries: evicting an entry while a job uses it only drops the cache's name for it.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import threading
import uuid
from pathlib import Path

from app.sources import SMALL_FILES, Source
from app.storage.base import ObjectInfo, Storage
from maec_core.errors import SourceNotFound

log = logging.getLogger("maec.worker.inputs")
_EVICT_LOCK = threading.Lock()


class InputCache:
    def __init__(self, root: Path, max_bytes: int) -> None:
        self.objects = Path(root) / "objects"
        self.objects.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes

    @staticmethod
    def entry_name(bucket: str, obj: ObjectInfo) -> str:
        return hashlib.sha256(f"{obj.size}:{obj.etag or bucket + '/' + obj.key}".encode()
                              ).hexdigest()

    def get(self, storage: Storage, obj: ObjectInfo, bucket: str) -> tuple[Path, bool]:
        """The cached copy of ``obj`` (downloaded on a miss); (path, was_hit)."""
        entry = self.objects / self.entry_name(bucket, obj)
        if entry.is_file() and entry.stat().st_size == obj.size:
            os.utime(entry)  # LRU: mtime is the last use
            return entry, True
        tmp = entry.with_name(f".{entry.name}.{uuid.uuid4().hex[:8]}")
        try:
            storage.download(obj.key, tmp)
            os.replace(tmp, entry)
        finally:
            tmp.unlink(missing_ok=True)
        return entry, False

    def evict(self, keep_free: int = 0) -> int:
        """Drop least recently used entries until the cache fits; returns bytes freed."""
        with _EVICT_LOCK:
            entries = []
            for p in self.objects.iterdir():
                if p.name.startswith("."):
                    continue
                st = p.stat()
                entries.append((st.st_mtime, st.st_size, p))
            total = sum(e[1] for e in entries)
            freed = 0
            for _mtime, size, p in sorted(entries):
                if total - freed + keep_free <= self.max_bytes:
                    break
                p.unlink(missing_ok=True)
                freed += size
            return freed


def _link(src: Path, dest: Path) -> None:
    dest.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(src, dest)
    except OSError:
        shutil.copyfile(src, dest)  # another file system


def fetch_source(
    source: Source,
    storage: Storage,
    cache: InputCache,
    dest: Path,
    *,
    corpus: bool = False,
) -> tuple[Path, int, int]:
    """Make ``source`` available locally; returns (path, bytes fetched, bytes cached)."""
    if source.kind == "local":
        return Path(source.path), 0, 0
    if source.kind == "hf":
        from app.hub import hub_fetch

        return hub_fetch(source, dest), 0, 0
    bucket = storage.for_bucket(source.bucket)
    if corpus:
        info = bucket.head(source.prefix)
        if info is None:
            raise SourceNotFound(f"{source.uri}: no such object", source=source.uri)
        path, hit = cache.get(bucket, info, source.bucket)
        _link(path, dest / Path(source.prefix).name)
        return dest / Path(source.prefix).name, 0 if hit else info.size, info.size if hit else 0
    fetched = cached = 0
    wanted: list[tuple[str, ObjectInfo]] = []
    for obj in bucket.list(source.prefix + "/"):
        name = obj.key[len(source.prefix) + 1:]
        if "/" in name:
            continue
        if name.endswith(".safetensors") or name in SMALL_FILES:
            wanted.append((name, obj))
    if not wanted:
        raise SourceNotFound(f"{source.uri}: no checkpoint files", source=source.uri)
    cache.evict(keep_free=sum(o.size for _n, o in wanted))
    for name, obj in wanted:
        path, hit = cache.get(bucket, obj, source.bucket)
        _link(path, dest / name)
        if hit:
            cached += obj.size
        else:
            fetched += obj.size
    return dest, fetched, cached

