"""Fetch a job's sources into local folders, through a size-capped LRU disk cache.

The cache only caches: entries are whole files named by their content key and size
(``app.sources.base.SourceFile.content_key``, given by each source kind's module, which
also lists and fetches the files), so the same bytes under two names, in two repos or
buckets, or from the hub and S3, are stored once and a repeated donor is not downloaded
again. A key is a digest of the content where the store has one (``sha256:``,
``git-blob:``), checked while the file streams, so an entry holds exactly the bytes it is
named by; otherwise it is scoped to the store's object and version.

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
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path

from app.sources import Source, SourceFile, open_source
from app.storage.base import Storage, StorageError

log = logging.getLogger("maec.worker.inputs")
_EVICT_LOCK = threading.Lock()

# Writes the content into the (temporary) path it is given (what it returns is not
# used); raises on any failure.
Download = Callable[[Path], object]


class InputCache:
    def __init__(self, root: Path, max_bytes: int) -> None:
        self.objects = Path(root) / "objects"
        self.objects.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes

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

    def fill(self, dest: Path, files: Sequence[SourceFile],
             fetch: Callable[[SourceFile, Path], None]) -> tuple[int, int]:
        """Link every file into ``dest`` (by its name) from the cache, ``fetch``-ing the
        misses first making room for them; returns (bytes fetched, bytes from the cache)."""
        # Looking the hits up marks them used, so making room evicts other entries, not them.
        missing = {(f.content_key, f.size) for f in files
                   if self.lookup(f.content_key, f.size) is None}
        self.evict(keep_free=sum(size for _key, size in missing))
        fetched = cached = 0
        for f in files:
            path, hit = self.get(f.content_key, f.size, partial(fetch, f))
            _link(path, dest / f.name)
            if hit:
                cached += f.size
            else:
                fetched += f.size
        return fetched, cached


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
    """Make ``source`` (a checkpoint folder, or with ``corpus`` one corpus file) available
    locally; returns (path, bytes fetched, bytes from the cache)."""
    reader = open_source(source, storage)
    here = reader.in_place()
    if here is not None:
        return here, 0, 0
    if corpus:
        file = reader.corpus_file()
        return dest / file.name, *cache.fill(dest, [file], reader.fetch)
    # One listing; SourceNotFound / StorageError as typed.
    return dest, *cache.fill(dest, reader.checkpoint_files(), reader.fetch)
