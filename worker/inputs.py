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
A job's input folder is made of hard links to cache entries.

One cache directory may serve many worker processes; how they share it (file locks, a
job's hold, eviction of what nobody holds) is ``app.disk_cache``'s.

Local sources (``app.sources.local``) come through this cache too: the engine reads the
worker's copy, never a folder others can still change.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path

from app.disk_cache import DiskCache, Hold
from app.sources import Source, SourceFile, open_source
from app.storage.base import Storage, StorageError

log = logging.getLogger("maec.worker.inputs")
# Writes the content into the (temporary) path it is given (what it returns is not
# used); raises on any failure.
Download = Callable[[Path], object]


class InputCache(DiskCache):
    """Whole files, each an entry named by its content key and size."""

    def entry_for(self, identity: str, size: int) -> Path:
        """Where the ``size`` bytes named by ``identity`` are (or would be) cached."""
        return self.entry(_name(identity, size))

    def lookup(self, identity: str, size: int) -> Path | None:
        """The entry when cached (and marks it used), else None."""
        return self.find(_name(identity, size), partial(_has_size, size=size))

    def get(self, identity: str, size: int, download: Download,
            hold: Hold | None = None) -> tuple[Path, bool]:
        """The cached copy of the content (``download``-ed on a miss); (path, was_hit).

        With ``hold``, the entry stays locked shared (never evicted) until it is released;
        without, only while this call runs.
        """
        return self.get_or_fill(_name(identity, size), partial(_has_size, size=size),
                                partial(_download, download, identity, size), hold,
                                what=identity)

    def fill(self, dest: Path, files: Sequence[SourceFile],
             fetch: Callable[[SourceFile, Path], None],
             hold: Hold | None = None) -> tuple[int, int]:
        """Link every file into ``dest`` (by its name) from the cache, ``fetch``-ing the
        misses first making room for them; returns (bytes fetched, bytes from the cache).
        With ``hold``, the entries stay held (see ``get``)."""
        # Looking the hits up marks them used, so making room evicts other entries, not them.
        missing = {(f.content_key, f.size) for f in files
                   if self.lookup(f.content_key, f.size) is None}
        self.evict(keep_free=sum(size for _key, size in missing))
        fetched = cached = 0
        with contextlib.ExitStack() as stack:
            if hold is None:
                hold = stack.enter_context(Hold())
            for f in files:
                path, hit = self.get(f.content_key, f.size, partial(fetch, f), hold=hold)
                _link(path, dest / f.name)
                if hit:
                    cached += f.size
                else:
                    fetched += f.size
        return fetched, cached


def _name(identity: str, size: int) -> str:
    return hashlib.sha256(f"{size}:{identity}".encode()).hexdigest()


def _has_size(entry: Path, size: int) -> bool:
    return entry.stat().st_size == size


def _download(download: Download, identity: str, size: int, tmp: Path) -> None:
    download(tmp)
    got = tmp.stat().st_size
    if got != size:
        raise StorageError(f"a download of {identity} gave {got} bytes where {size} were "
                           "expected", identity=identity)


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
    hold: Hold | None = None,
) -> tuple[Path, int, int]:
    """Make ``source`` (a checkpoint folder, or with ``corpus`` one file: an ability
    corpus, or any other one-file input) available in ``dest``, as the files pinned at
    submission; returns (path, bytes fetched, bytes from the cache).

    A file no longer the one pinned is ``SourceChanged`` (nothing of it is cached);
    ``hold`` keeps the entries from eviction while the job runs.
    """
    reader = open_source(source, storage)
    # SourceNotFound / StorageError (an unpinned record's listing) as typed.
    files = reader.files(single=corpus)
    reader.check_unchanged(files)  # a cache hit does not excuse a changed source
    got = cache.fill(dest, files, reader.fetch, hold=hold)
    return (dest / files[0].name if corpus else dest), *got

