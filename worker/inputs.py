"""Fetch a job's sources into local folders, through a size-capped LRU disk cache.

Cache entries are whole files keyed by their content identity and size, so the same
weights under two names (or in two repos) are stored once and a repeated donor is not
downloaded again:

- S3 objects: their ETag, which S3 derives from the bytes (bucket + key when a store
  gives none);
- hub files (``hf://owner/name@<sha>``, listed and downloaded by ``app.hub``): the LFS
  sha256, else the git blob id. A pinned commit never changes, and ``app.hub`` checks
  every download against that digest, so an entry holds exactly the bytes it is named by.

Every download goes to a temporary name beside its entry, is checked for size, and only
then renamed into place, so a failed, short or corrupt transfer never leaves an entry.
A job's input folder is made of hard links to cache entries: evicting an entry while a
job uses it only drops the cache's name for it.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from app.sources import Source, is_checkpoint_file
from app.storage.base import ObjectInfo, Storage, StorageError
from maec_core.errors import SourceNotFound

log = logging.getLogger("maec.worker.inputs")
_EVICT_LOCK = threading.Lock()

# Writes the content into the (temporary) path it is given; raises on any failure.
Download = Callable[[Path], None]


class InputCache:
    def __init__(self, root: Path, max_bytes: int) -> None:
        self.objects = Path(root) / "objects"
        self.objects.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes

    @staticmethod
    def s3_identity(bucket: str, obj: ObjectInfo) -> str:
        return obj.etag or f"{bucket}/{obj.key}"

    def entry_for(self, identity: str, size: int) -> Path:
        """Where the ``size`` bytes named by ``identity`` are (or would be) cached."""
        return self.objects / hashlib.sha256(f"{size}:{identity}".encode()).hexdigest()

    def lookup(self, identity: str, size: int) -> Path | None:
        """The entry when cached (and marks it used), else None."""
        entry = self.entry_for(identity, size)
        try:
            if entry.stat().st_size != size:
                return None
            os.utime(entry)  # LRU: mtime is the last use
        except FileNotFoundError:  # absent, or evicted in between
            return None
        return entry

    def get(self, identity: str, size: int, download: Download) -> tuple[Path, bool]:
        """The cached copy of the content (``download``-ed on a miss); (path, was_hit)."""
        entry = self.lookup(identity, size)
        if entry is not None:
            return entry, True
        entry = self.entry_for(identity, size)
        # Dot names are never entries (evict skips them); unique so concurrent fetches of
        # one entry do not write into each other's file.
        tmp = entry.with_name(f".{entry.name}.{uuid.uuid4().hex[:8]}")
        try:
            download(tmp)
            got = tmp.stat().st_size
            if got != size:
                raise StorageError(f"a download of {identity} gave {got} bytes where {size} "
                                   "were expected", identity=identity)
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


@dataclass(frozen=True)
class _Wanted:
    name: str  # the file's name in the job folder
    identity: str
    size: int
    download: Download


def _link(src: Path, dest: Path) -> None:
    dest.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(src, dest)
    except OSError:
        shutil.copyfile(src, dest)  # another file system


def _fill(cache: InputCache, dest: Path, wanted: list[_Wanted]) -> tuple[int, int]:
    """Link every wanted file into ``dest`` from the cache, downloading the misses first
    making room for them; returns (bytes fetched, bytes cached)."""
    # Looking the hits up marks them used, so making room evicts other entries, not them.
    missing = {(w.identity, w.size) for w in wanted if cache.lookup(w.identity, w.size) is None}
    cache.evict(keep_free=sum(size for _i, size in missing))
    fetched = cached = 0
    for w in wanted:
        path, hit = cache.get(w.identity, w.size, w.download)
        _link(path, dest / w.name)
        if hit:
            cached += w.size
        else:
            fetched += w.size
    return fetched, cached


def _s3_file(bucket: Storage, bucket_name: str, name: str, obj: ObjectInfo) -> _Wanted:
    return _Wanted(name, InputCache.s3_identity(bucket_name, obj), obj.size,
                   partial(bucket.download, obj.key))


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
        from app.hub import hub_download, hub_files

        files = hub_files(source)  # one listing; SourceNotFound / StorageError as typed
        return dest, *_fill(cache, dest, [
            _Wanted(f.name, f.content_id, f.size, partial(hub_download, source, f))
            for f in files])
    bucket = storage.for_bucket(source.bucket)
    if corpus:
        info = bucket.head(source.prefix)
        if info is None:
            raise SourceNotFound(f"{source.uri}: no such object", source=source.uri)
        name = Path(source.prefix).name
        return dest / name, *_fill(cache, dest, [_s3_file(bucket, source.bucket, name, info)])
    wanted: list[_Wanted] = []
    for obj in bucket.list(source.prefix + "/"):
        name = obj.key[len(source.prefix) + 1:]
        if is_checkpoint_file(name):
            wanted.append(_s3_file(bucket, source.bucket, name, obj))
    if not wanted:
        raise SourceNotFound(f"{source.uri}: no checkpoint files", source=source.uri)
    return dest, *_fill(cache, dest, wanted)
