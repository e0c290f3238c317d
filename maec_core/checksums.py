"""sha256 of input files, with a stat-keyed cache so a file is hashed once per version.

Hashing a 16 GB checkpoint takes several seconds on one core; the cache (keyed on
real path, size, mtime and inode) makes repeat merges of the same inputs free, and the
engine runs the first hashing on a thread beside the merge (hashlib releases the GIL).
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from pathlib import Path

_LOCK = threading.Lock()
CHUNK = 8 * 1024 * 1024


def cache_dir() -> Path:
    base = os.environ.get("MAEC_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "maec"
    )
    return Path(base)


def _key(path: Path) -> str:
    st = path.stat()
    raw = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{st.st_ino}"
    return hashlib.sha256(raw.encode()).hexdigest()


class Stopped(Exception):
    """Hashing was abandoned (the merge it served failed)."""


def sha256_file(path: Path, *, use_cache: bool = True,
                stop: threading.Event | None = None) -> str:
    """The hex sha256 of ``path``'s bytes (raises ``Stopped`` once ``stop`` is set)."""
    entry = cache_dir() / "sha256" / _key(path) if use_cache else None
    if entry is not None:
        try:
            cached = entry.read_text().strip()
            if len(cached) == 64:
                return cached
        except OSError:
            pass
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            if stop is not None and stop.is_set():
                raise Stopped(str(path))
            h.update(chunk)
    digest = h.hexdigest()
    if entry is not None:
        try:
            entry.parent.mkdir(parents=True, exist_ok=True)
            tmp = entry.with_suffix(f".{os.getpid()}.{threading.get_ident()}")
            tmp.write_text(digest)
            os.replace(tmp, entry)
        except OSError:
            pass  # a read-only cache only costs speed
    return digest


def folder_digest(files: dict[str, str]) -> str:
    """One digest for a set of ``{file name: sha256}`` (order-independent)."""
    return hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()


class BackgroundHasher:
    """Hash a list of files on a thread; ``result()`` joins and returns name -> sha256."""

    def __init__(self, files: dict[str, list[Path]]) -> None:
        self._files = files
        self._out: dict[str, dict[str, str]] = {}
        self._error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="maec-hash", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for key, paths in self._files.items():
                self._out[key] = {p.name: sha256_file(p, stop=self._stop) for p in paths}
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
