"""A size-capped, least-recently-used disk cache that many processes share through file
locks: the machinery under the worker's input cache (``worker.inputs.InputCache``, whole
files) and its local copies of ability artifacts (``app.artifacts``, whole folders).

An entry is a file or a folder ``objects/<name>``; what makes one complete, and how it is
filled, is the caller's (``get_or_fill``). A fill writes a temporary name beside its entry
and is renamed into place only once it is complete, so a failed, short or corrupt
transfer never leaves an entry. Least recently used means the entry's mtime, which every
hit refreshes.

One cache directory may serve many worker processes, on one machine or on several that
mount it, so its coordination is file locks (``flock``) on one lock file per entry in
``locks/``, never a lock of one process:

- a job holds a shared lock on every entry it uses until it ends (``Hold``);
- an entry is filled under its exclusive lock, so two processes wanting the same missing
  entry fill it once (the second waits for the fill, then finds it); the exclusive lock
  is only ever tried, never waited for, so a fill never waits behind a running job;
- eviction (one evictor at a time: ``evict.lock``) and ``drop`` take an entry's lock
  exclusive and non-blocking, and skip an entry in use or being filled.

A lock file is removed only while it is held exclusively (by eviction or ``drop``);
whoever locks one checks afterwards that the path still names the file it locked, and
otherwise starts again, so two processes never hold "the" lock of one entry on two
different files.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

from app.storage.base import StorageError

# How long a process that found an entry missing, and another about to fill it, waits
# before looking again.
_RETRY_S = 0.02
_MAX_SPIN_S = 60.0

# Whether an existing entry is complete (may raise FileNotFoundError: then it is not).
Fresh = Callable[[Path], bool]
# Writes the entry (a file or a folder) at the temporary path it is given (what it
# returns is not used); raises on any failure.
Fill = Callable[[Path], object]


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


def _remove(path: Path) -> None:
    """Remove a file or a folder; a folder is first renamed to a temporary (dot) name, so
    a process killed halfway never leaves a partial folder under an entry's name."""
    if path.is_dir() and not path.is_symlink():
        if not path.name.startswith("."):
            aside = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}")
            os.rename(path, aside)
            path = aside
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def disk_bytes(path: Path) -> int:
    """The bytes of a file, or of every file in a folder."""
    if not path.is_dir():
        return path.stat().st_size
    total = 0
    for parent, _dirs, files in os.walk(path):
        for name in files:
            with contextlib.suppress(FileNotFoundError):
                total += os.lstat(os.path.join(parent, name)).st_size
    return total


class Hold:
    """Shared locks on the cache entries a job uses: while held, no process evicts them.
    ``release`` (or leaving the ``with`` block) lets them go. One hold may take entries of
    several caches."""

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


class DiskCache:
    def __init__(self, root: Path, max_bytes: int) -> None:
        self.root = Path(root)
        self.objects = self.root / "objects"
        self.locks = self.root / "locks"
        self.objects.mkdir(parents=True, exist_ok=True)
        self.locks.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes

    def entry(self, name: str) -> Path:
        if not name or name.startswith(".") or "/" in name:
            # Dot names are temporary files (see _fill); anything else must stay inside.
            raise ValueError(f"not a cache entry name: {name!r}")
        return self.objects / name

    def _lock_of(self, entry: Path) -> Path:
        return self.locks / entry.name

    def hold(self) -> Hold:
        """An empty hold, for ``get_or_fill`` to add entries to."""
        return Hold()

    def find(self, name: str, fresh: Fresh) -> Path | None:
        """The entry when complete (and marks it used), else None; takes no lock."""
        entry = self.entry(name)
        return entry if _hit(entry, fresh) else None

    def get_or_fill(self, name: str, fresh: Fresh, fill: Fill, hold: Hold | None = None,
                    *, what: str | None = None) -> tuple[Path, bool]:
        """The complete entry ``name`` (``fill``-ed on a miss); (path, was_hit).

        With ``hold``, the entry stays locked shared (never evicted) until it is released;
        without, only while this call runs. ``what`` names the content in errors.
        """
        entry = self.entry(name)
        lock = self._lock_of(entry)
        spins = 0
        while True:
            # A shared lock waits only for a fill or an eviction of this entry in progress.
            fd = _lock_wait(lock, fcntl.LOCK_SH)
            hit = _hit(entry, fresh)
            if not hit:
                os.close(fd)
                # Never wait for an exclusive lock: jobs hold entries shared for as long as
                # they run, and a wait behind them would stall this fill as long.
                excl = _lock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                if excl is None:
                    # Another process is about to fill it: a moment's wait. A long one
                    # means a held entry was removed by hand: nobody can fill it.
                    spins += 1
                    if spins * _RETRY_S > _MAX_SPIN_S:
                        raise StorageError(f"the cache entry for {what or name} is held "
                                           "but missing", identity=what or name)
                    time.sleep(_RETRY_S)
                    continue
                fd = excl
                try:
                    hit = _hit(entry, fresh)  # filled by another process meanwhile
                    if not hit:
                        _fill(entry, fill)
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

    @contextlib.contextmanager
    def changing(self, name: str) -> Iterator[None]:
        """An exclusive lock for changing entry ``name`` in place (a partial entry that
        gains byte ranges: ``worker.inputs.InputCache``), waited for: such a change is
        short, and two processes wanting the same bytes fetch them once. Separate from
        the entry's own lock, which the jobs using the entry hold shared meanwhile."""
        fd = _lock_wait(self.locks / f"{self.entry(name).name}.change", fcntl.LOCK_EX)
        try:
            yield
        finally:
            os.close(fd)

    def drop(self, name: str) -> bool:
        """Remove entry ``name`` now, unless it is in use or being filled (then False)."""
        entry = self.entry(name)
        if not entry.exists():
            return True
        return self._drop(entry)

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
                    entries.append((p.stat().st_mtime, disk_bytes(p), p))
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
            with contextlib.suppress(FileNotFoundError):
                _remove(entry)
            lock.unlink(missing_ok=True)  # while held: see the module docstring
        finally:
            os.close(fd)
        return True

    def _drop_stale_partials(self) -> None:
        """Temporary files and folders whose entry nobody is filling: left by a killed
        process (a fill, or a removal halfway)."""
        for p in self.objects.iterdir():
            if not p.name.startswith("."):
                continue
            entry = self.objects / p.name[1:].split(".", 1)[0]
            lock = self._lock_of(entry)
            fd = _lock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if fd is None:
                continue
            try:
                with contextlib.suppress(FileNotFoundError):
                    _remove(p)
                if not entry.exists():
                    lock.unlink(missing_ok=True)
            finally:
                os.close(fd)

    def _drop_orphan_locks(self) -> None:
        """Lock files of entries that do not exist and that nobody holds (a fill that
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


def _hit(entry: Path, fresh: Fresh) -> bool:
    """Whether ``entry`` is there and complete; if so it is marked used (LRU: mtime)."""
    try:
        if not fresh(entry):
            return False
        os.utime(entry)
    except FileNotFoundError:  # absent, or evicted in between
        return False
    return True


def _fill(entry: Path, fill: Fill) -> None:
    # Dot names are never entries (evict skips them); unique, so a stale one left by a
    # killed process never collides with a new fill.
    tmp = entry.with_name(f".{entry.name}.{uuid.uuid4().hex[:8]}")
    try:
        fill(tmp)
        if os.path.lexists(entry) and (entry.is_dir() or tmp.is_dir()):
            # An incomplete entry (damaged by hand) that a rename cannot replace.
            _remove(entry)
        os.replace(tmp, entry)
    finally:
        with contextlib.suppress(FileNotFoundError):
            _remove(tmp)
