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

One cache directory may serve many worker processes, on one machine or on several that
mount it, so its coordination is file locks (``flock``) on one lock file per entry in
``locks/``, never a lock of one process:

- a job holds a shared lock on every entry it uses until it ends (``InputCache.hold``);
- an entry is filled under its exclusive lock, so two processes wanting the same missing
  entry download it once (the second waits for the fill, then finds it); the exclusive
  lock is only ever tried, never waited for, so a fill never waits behind a running job;
- eviction (one evictor at a time: ``evict.lock``) takes each candidate's lock exclusive
  and non-blocking, and skips an entry in use or being filled.

A lock file is removed only by the evictor, while it holds it exclusively; whoever locks
one checks afterwards that the path still names the file it locked, and otherwise starts
again, so two processes never hold "the" lock of one entry on two different files.
Local sources (``app.sources.local``) come through this cache too: the engine reads the
worker's copy, never a folder others can still change.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import shutil
import time
import uuid
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path

from app.sources import Source, SourceFile, open_source
from app.storage.base import Storage, StorageError
from maec_core.errors import CheckpointError
from maec_core.io.folder import is_adapter_folder
from maec_core.recipe import Recipe

log = logging.getLogger("maec.worker.inputs")
# How long a process that found an entry missing, and another about to fill it, waits
# before looking again.
_RETRY_S = 0.02
_MAX_SPIN_S = 60.0

# Writes the content into the (temporary) path it is given (what it returns is not
# used); raises on any failure.
Download = Callable[[Path], object]


def _same_file(path: Path, fd: int) -> bool:
    """Whether ``path`` still names the file open as ``fd``."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    fst = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (fst.st_dev, fst.st_ino)


def _lock(path: Path, mode: int) -> int | None:
    """A descriptor of ``path`` locked with ``mode`` (``fcntl.LOCK_SH`` / ``LOCK_EX``,
    maybe ``| LOCK_NB``: then None when someone else holds it)."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, mode)
        except BlockingIOError:
            os.close(fd)
            return None
        except BaseException:
            os.close(fd)
            raise
        if _same_file(path, fd):
            return fd
        os.close(fd)  # removed by the evictor while we waited: lock the new one


def _lock_wait(path: Path, mode: int) -> int:
    fd = _lock(path, mode)
    assert fd is not None  # a blocking lock is always granted
    return fd


class Hold:
    """Shared locks on the cache entries a job uses: while held, no process evicts them.
    ``release`` (or leaving the ``with`` block) lets them go."""

    def __init__(self) -> None:
        self._fds: list[int] = []

    def add(self, fd: int) -> None:
        self._fds.append(fd)

    def __len__(self) -> int:
        return len(self._fds)

    def release(self) -> None:
        while self._fds:
            os.close(self._fds.pop())

    def __enter__(self) -> Hold:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class InputCache:
    def __init__(self, root: Path, max_bytes: int) -> None:
        self.root = Path(root)
        self.objects = self.root / "objects"
        self.locks = self.root / "locks"
        self.objects.mkdir(parents=True, exist_ok=True)
        self.locks.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes

    def entry_for(self, identity: str, size: int) -> Path:
        """Where the ``size`` bytes named by ``identity`` are (or would be) cached."""
        return self.objects / hashlib.sha256(f"{size}:{identity}".encode()).hexdigest()

    def _lock_of(self, entry: Path) -> Path:
        return self.locks / entry.name

    def hold(self) -> Hold:
        """An empty hold, for ``get`` / ``fill`` / ``fetch_source`` to add entries to."""
        return Hold()

    def lookup(self, identity: str, size: int) -> Path | None:
        """The entry when cached (and marks it used), else None."""
        entry = self.entry_for(identity, size)
        return entry if _fresh(entry, size) else None

    def get(self, identity: str, size: int, download: Download,
            hold: Hold | None = None) -> tuple[Path, bool]:
        """The cached copy of the content (``download``-ed on a miss); (path, was_hit).

        With ``hold``, the entry stays locked shared (never evicted) until it is released;
        without, only while this call runs.
        """
        entry = self.entry_for(identity, size)
        lock = self._lock_of(entry)
        spins = 0
        while True:
            # A shared lock waits only for a fill or an eviction of this entry in progress.
            fd = _lock_wait(lock, fcntl.LOCK_SH)
            hit = _fresh(entry, size)
            if not hit:
                os.close(fd)
                # Never wait for an exclusive lock: jobs hold entries shared for as long as
                # they run, and a wait behind them would stall this fill as long.
                excl = _lock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                if excl is None:
                    # Another process is about to fill it: a moment's wait. A long one
                    # means a held entry's file was removed by hand: nobody can fill it.
                    spins += 1
                    if spins * _RETRY_S > _MAX_SPIN_S:
                        raise StorageError(f"the input cache entry for {identity} is held "
                                           "but missing", identity=identity)
                    time.sleep(_RETRY_S)
                    continue
                fd = excl
                try:
                    hit = _fresh(entry, size)  # filled by another process meanwhile
                    if not hit:
                        self._fill(entry, identity, size, download)
                    # Not atomic (flock drops, then takes): the evictor may get in between.
                    fcntl.flock(fd, fcntl.LOCK_SH)
                except BaseException:
                    os.close(fd)
                    raise
                if not (_same_file(lock, fd) and entry.exists()):
                    os.close(fd)  # evicted in that gap: start over
                    continue
            if hold is not None:
                hold.add(fd)
            else:
                os.close(fd)
            return entry, hit

    def _fill(self, entry: Path, identity: str, size: int, download: Download) -> None:
        # Dot names are never entries (evict skips them); unique, so a stale one left by a
        # killed process never collides with a new fill.
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

    def evict(self, keep_free: int = 0) -> int:
        """Drop least recently used entries that no job holds and no fill is writing,
        until the cache fits with ``keep_free`` bytes to spare; returns bytes freed."""
        guard = _lock_wait(self.root / "evict.lock", fcntl.LOCK_EX)
        try:
            entries = []
            for p in self.objects.iterdir():
                if p.name.startswith("."):
                    continue
                with contextlib.suppress(FileNotFoundError):
                    st = p.stat()
                    entries.append((st.st_mtime, st.st_size, p))
            total = sum(e[1] for e in entries)
            freed = 0
            for _mtime, size, p in sorted(entries):
                if total - freed + keep_free <= self.max_bytes:
                    break
                if self._drop(p):
                    freed += size
            self._drop_stale_partials()
            self._drop_orphan_locks()
            return freed
        finally:
            os.close(guard)

    def _drop(self, entry: Path) -> bool:
        """Remove ``entry`` and its lock file unless someone holds the lock."""
        lock = self._lock_of(entry)
        fd = _lock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        if fd is None:
            return False  # in use by a job, or being filled
        try:
            entry.unlink(missing_ok=True)
            lock.unlink(missing_ok=True)  # while held: see the module docstring
        finally:
            os.close(fd)
        return True

    def _drop_stale_partials(self) -> None:
        """Temporary files whose entry nobody is filling: left by a killed process."""
        for p in self.objects.iterdir():
            if not p.name.startswith("."):
                continue
            entry = self.objects / p.name[1:].split(".", 1)[0]
            lock = self._lock_of(entry)
            fd = _lock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if fd is None:
                continue
            try:
                p.unlink(missing_ok=True)
                if not entry.exists():
                    lock.unlink(missing_ok=True)
            finally:
                os.close(fd)

    def _drop_orphan_locks(self) -> None:
        """Lock files of entries that do not exist and that nobody holds (a download that
        failed leaves its entry's lock file behind)."""
        for lock in self.locks.iterdir():
            if (self.objects / lock.name).exists():
                continue
            fd = _lock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if fd is None:
                continue  # being filled right now
            try:
                if not (self.objects / lock.name).exists():
                    lock.unlink(missing_ok=True)
            finally:
                os.close(fd)

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


def _fresh(entry: Path, size: int) -> bool:
    """Whether ``entry`` holds ``size`` bytes; if so it is marked used (LRU: mtime)."""
    try:
        if entry.stat().st_size != size:
            return False
        os.utime(entry)
    except FileNotFoundError:  # absent, or evicted in between
        return False
    return True


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


def check_adapter_bases(recipe: Recipe) -> None:
    """Refuse, before the merge opens anything, a LoRA adapter input that would apply to
    the base its own ``adapter_config.json`` names: ``recipe`` (its references rewritten
    to the fetched folders) must name a base that is not itself an adapter.

    Submission already refuses such recipes; this keeps a job record that got past it
    from leading the engine (which follows a config's base for local command-line use)
    to a path on the worker's machine.
    """
    base = recipe.base_model
    adapters = [s.ref for s in recipe.sources()
                if s.kind == "checkpoint" and is_adapter_folder(Path(s.ref))]
    if not adapters:
        return
    if base is None or is_adapter_folder(Path(base)):
        raise CheckpointError(
            "a LoRA adapter input applies only to the recipe's base model, which must be "
            "a full checkpoint; name its base in the recipe (base_model)",
            adapters=len(adapters))
