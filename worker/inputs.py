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

A part of a split merge, or a resumed attempt, needs only some byte ranges of a file
(``worker.partial``). Those go into a *partial* entry, under another name than the
whole file's (``<name>-part``), so it is never mistaken for it: a folder holding
``data`` (a sparse file of the full size) and ``ranges.json`` (the byte ranges present,
rewritten atomically after their bytes are written). A later request fills only the
ranges missing, under the entry's change lock (``DiskCache.changing``), while the jobs
using it keep it held. A whole-file request for a file with a partial entry completes
it: the missing ranges are fetched, the whole is checked (size, and the digest its
content key names), and the same file becomes the whole entry.

Local sources (``app.sources.local``) come through this cache too: the engine reads the
worker's copy, never a folder others can still change.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from functools import partial
from pathlib import Path

from app.disk_cache import DiskCache, Hold
from app.sources import Source, SourceFile, SourceKind, open_source
from app.storage.base import Storage, StorageError
from worker.byte_ranges import Ranges, merged, missing, read_sidecar, write_sidecar

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
             hold: Hold | None = None, ranged: SourceKind | None = None
             ) -> tuple[int, int]:
        """Link every file into ``dest`` (by its name) from the cache, ``fetch``-ing the
        misses first making room for them; returns (bytes fetched, bytes from the cache).
        With ``hold``, the entries stay held (see ``get``). With ``ranged`` (the source,
        when it reads byte ranges), a miss that has a partial entry is completed from it
        (only its missing ranges fetched; counted as fetched)."""
        # Looking the hits up marks them used, so making room evicts other entries, not them.
        missing_keys = {(f.content_key, f.size) for f in files
                        if self.lookup(f.content_key, f.size) is None}
        self.evict(keep_free=sum(size for _key, size in missing_keys))
        fetched = cached = 0
        with contextlib.ExitStack() as stack:
            if hold is None:
                hold = stack.enter_context(Hold())
            for f in files:
                part = self.partial_entry(f.content_key, f.size)
                if (ranged is not None and (f.content_key, f.size) in missing_keys
                        and part.exists()):
                    path, got = self.complete(f.content_key, f.size,
                                              partial(ranged.read_range, f),
                                              ranged.digest(f), hold)
                    link_file(path, dest / f.name)
                    fetched += got
                    cached += f.size - got
                    continue
                path, hit = self.get(f.content_key, f.size, partial(fetch, f), hold=hold)
                link_file(path, dest / f.name)
                if hit:
                    cached += f.size
                else:
                    fetched += f.size
        return fetched, cached


    def partial_entry(self, identity: str, size: int) -> Path:
        """Where the partial entry of the ``size`` bytes named by ``identity`` is (or
        would be): a folder of ``data`` and ``ranges.json``."""
        return self.entry(_name(identity, size) + PARTIAL)

    def get_ranges(self, identity: str, size: int, want: Ranges, read: ReadRange,
                   hold: Hold) -> tuple[Path, int]:
        """A file holding at least the byte ranges ``want`` of the content: the whole
        entry when cached, else the partial entry's ``data``, the ranges it lacks
        ``read`` (``read(start, end)`` gives bytes ``[start, end)``) first; (path, bytes
        fetched). The entry stays held in ``hold``."""
        whole = self._held_whole(identity, size, hold)
        if whole is not None:
            return whole, 0
        name = _name(identity, size) + PARTIAL
        folder, _ = self.get_or_fill(name, partial(_is_partial, size=size),
                                     partial(_new_partial, size=size), hold, what=identity)
        with self.changing(name):
            fetched = _fill_ranges(folder, size, want, read)
        return folder / DATA, fetched

    def complete(self, identity: str, size: int, read: ReadRange, digest: str | None,
                 hold: Hold) -> tuple[Path, int]:
        """The whole entry of the content, made from its partial entry (the ranges it
        lacks ``read``; then checked: its size and, when given, its sha256 ``digest``)
        or, with none, fetched whole by ``read``; (path, bytes fetched)."""
        fetched = [0]

        def fill(tmp: Path) -> None:
            part = self.partial_entry(identity, size)
            if _is_partial(part, size):
                with self.changing(part.name):
                    fetched[0] = _fill_ranges(part, size, [(0, size)], read)
                    _check_whole(part / DATA, identity, size, digest)
                    os.link(part / DATA, tmp)  # the same bytes, now the whole entry
            else:
                tmp.parent.mkdir(parents=True, exist_ok=True)
                with open(tmp, "wb") as out:
                    for chunk in read(0, size):
                        out.write(chunk)
                        fetched[0] += len(chunk)
                _check_whole(tmp, identity, size, digest)

        path, _ = self.get_or_fill(_name(identity, size), partial(_has_size, size=size),
                                   fill, hold, what=identity)
        # Its bytes are the whole entry's now; the folder goes unless a job still holds it.
        self.drop(_name(identity, size) + PARTIAL)
        return path, fetched[0]

    def _held_whole(self, identity: str, size: int, hold: Hold) -> Path | None:
        """The whole entry, held, when cached; else None (nothing is fetched)."""
        if self.lookup(identity, size) is None:
            return None

        def gone(_tmp: Path) -> None:  # evicted since the lookup
            raise _Gone

        try:
            return self.get(identity, size, gone, hold=hold)[0]
        except _Gone:
            return None


class _Gone(Exception):
    """A whole entry evicted between its lookup and its hold."""


# A partial entry's name: the whole entry's with this suffix (no dot: dot names are a
# fill's temporary files); its folder's files.
PARTIAL = "-part"
DATA = "data"
SIDECAR = "ranges.json"
# Bytes [start, end) of a file, as chunks.
ReadRange = Callable[[int, int], Iterable[bytes]]
# A partial entry's missing ranges are read in pieces of at most this many bytes, this
# many at once.
PIECE = 8 * 1024 * 1024
RANGE_THREADS = 8


def _is_partial(folder: Path, size: int) -> bool:
    return (folder / DATA).stat().st_size == size and (folder / SIDECAR).is_file()


def _new_partial(tmp: Path, size: int) -> None:
    tmp.mkdir()
    with open(tmp / DATA, "wb") as f:
        f.truncate(size)  # sparse: only the ranges written take disk space
    write_sidecar(tmp / SIDECAR, [])


def _fill_ranges(folder: Path, size: int, want: Ranges, read: ReadRange) -> int:
    """Write the ranges of ``want`` that ``folder``'s sidecar does not list into its
    data file, each recorded once its bytes are written; the bytes fetched. Called
    under the entry's change lock.

    The ranges go in pieces of at most ``PIECE`` bytes, ``RANGE_THREADS`` at once: a
    part's tensors are many ranges scattered over the file, and one GET at a time would
    spend its time waiting for each answer rather than reading."""
    have = read_sidecar(folder / SIDECAR)
    pieces = [(a, min(a + PIECE, end)) for start, end in missing(have, want)
              for a in range(start, end, PIECE)]
    for start, end in pieces:
        if not 0 <= start < end <= size:
            raise StorageError(f"bytes {start}-{end} are outside the {size}-byte file")
    if not pieces:
        return 0
    with open(folder / DATA, "r+b", buffering=0) as f, \
            ThreadPoolExecutor(max_workers=RANGE_THREADS,
                               thread_name_prefix="maec-range") as pool:
        futures = [pool.submit(_fill_piece, f.fileno(), start, end, read)
                   for start, end in pieces]
        try:
            for future in as_completed(futures):
                start, end = future.result()
                have = merged([*have, (start, end)])
                write_sidecar(folder / SIDECAR, have)
        except BaseException:
            for other in futures:
                other.cancel()
            raise
    return sum(end - start for start, end in pieces)


def _fill_piece(fd: int, start: int, end: int, read: ReadRange) -> tuple[int, int]:
    """Bytes ``[start, end)`` read and written at their offset."""
    pos = start
    for chunk in read(start, end):
        if pos + len(chunk) > end:
            raise StorageError(f"a read of bytes {start}-{end} gave more")
        view = memoryview(chunk)
        while view:
            n = os.pwrite(fd, view, pos)
            view, pos = view[n:], pos + n
    if pos != end:
        raise StorageError(f"a read of bytes {start}-{end} stopped at {pos}")
    return start, end


def _check_whole(path: Path, identity: str, size: int, digest: str | None) -> None:
    got = path.stat().st_size
    if got != size:
        raise StorageError(f"{identity}: {got} bytes where {size} were expected",
                           identity=identity)
    if digest is not None:
        with open(path, "rb") as f:
            value = hashlib.file_digest(f, "sha256").hexdigest()
        if value != digest:
            raise StorageError(f"{identity}: the bytes fetched in ranges do not match its "
                               "sha256", identity=identity)


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


def link_file(src: Path, dest: Path) -> None:
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
    got = cache.fill(dest, files, reader.fetch, hold=hold,
                     ranged=reader if reader.ranged_for(files) else None)
    return (dest / files[0].name if corpus else dest), *got

