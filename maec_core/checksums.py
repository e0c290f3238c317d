"""sha256 of input files, remembered per file version so a file is hashed once.

Hashing a 16 GB checkpoint takes several seconds on one core. Digests are remembered
in memory for the process and, when the caller names a cache folder, on disk (keyed on
real path, size, mtime and inode), which makes repeat merges of the same inputs free.
The engine runs the first hashing on a thread beside the merge (hashlib releases the
GIL). The library never picks a cache folder itself: the CLI and the worker do.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import threading
from pathlib import Path

_LOCK = threading.Lock()
# Digests remembered in this process, by file version; bounded so a long-lived worker
# hashing many inputs does not grow without limit.
_MEMO: dict[str, str] = {}
_MEMO_MAX = 4096


def _key(path: Path) -> str:
    st = path.stat()
    raw = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{st.st_ino}"
    return hashlib.sha256(raw.encode()).hexdigest()


class Stopped(Exception):
    """Hashing was abandoned (the merge it served failed)."""


class _StoppableReader:
    """A binary file whose reads raise ``Stopped`` once ``stop`` is set, so a hash of a
    large file running beside a merge ends soon after the merge fails."""

    def __init__(self, f: io.BufferedReader, path: Path, stop: threading.Event) -> None:
        self._f = f
        self._path = path
        self._stop = stop

    def readable(self) -> bool:
        return True

    def readinto(self, buf: bytearray) -> int:
        if self._stop.is_set():
            raise Stopped(str(self._path))
        return self._f.readinto(buf)


def _read_cached(entry: Path | None, memo_key: str) -> str | None:
    with _LOCK:
        hit = _MEMO.get(memo_key)
    if hit is not None:
        if entry is not None and not entry.is_file():
            _remember(entry, memo_key, hit)  # known here, not yet in this cache folder
        return hit
    if entry is None:
        return None
    try:
        cached = entry.read_text().strip()
    except OSError:
        return None
    if len(cached) != 64:
        return None
    with _LOCK:
        _MEMO[memo_key] = cached
    return cached


def _remember(entry: Path | None, memo_key: str, digest: str) -> None:
    with _LOCK:
        if len(_MEMO) >= _MEMO_MAX:
            _MEMO.clear()
        _MEMO[memo_key] = digest
    if entry is None:
        return
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        tmp = entry.with_suffix(f".{os.getpid()}.{threading.get_ident()}")
        tmp.write_text(digest)
        os.replace(tmp, entry)
    except OSError:
        pass  # a read-only cache only costs speed


def sha256_file(path: Path, *, cache: Path | None = None, use_cache: bool = True,
                stop: threading.Event | None = None) -> str:
    """The hex sha256 of ``path``'s bytes (raises ``Stopped`` once ``stop`` is set).

    ``cache`` is a folder where digests are kept between processes (None: memory only);
    ``use_cache=False`` always reads the file (for a file just written by the caller).
    """
    memo_key = _key(path)
    entry = cache / memo_key if cache is not None else None
    if use_cache:
        hit = _read_cached(entry, memo_key)
        if hit is not None:
            return hit
    with open(path, "rb") as f:
        source = f if stop is None else _StoppableReader(f, path, stop)
        digest = hashlib.file_digest(source, "sha256").hexdigest()
    if use_cache:
        _remember(entry, memo_key, digest)
    return digest


def folder_digest(files: dict[str, str]) -> str:
    """One digest for a set of ``{file name: sha256}`` (order-independent)."""
    return hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()


class BackgroundHasher:
    """Hash a list of files on a thread; ``result()`` joins and returns name -> sha256."""

    def __init__(self, files: dict[str, list[Path]], *, cache: Path | None = None) -> None:
        self._files = files
        self._cache = cache
        self._out: dict[str, dict[str, str]] = {}
        self._error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="maec-hash", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for key, paths in self._files.items():
                self._out[key] = {p.name: sha256_file(p, cache=self._cache, stop=self._stop)
                                  for p in paths}
        except BaseException as exc:  # re-raised in result()
            self._error = exc

    def stop(self) -> None:
        """Abandon the hashing (a failed merge needs no input digests); returns at once."""
        self._stop.set()

    def result(self) -> dict[str, dict[str, str]]:
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._out
