"""Input files held in memory, so several merges of the same inputs read them once.

A sweep merges the same language base (and, per extraction group, the same ability
vectors) once per candidate. :class:`ResidentFiles` holds the data section of such
files, byte for byte as on disk, in ordinary CPU memory; the engine's readers
(``maec_core.io.reader``, ``maec_core.io.units``, ``maec_core.maec.rowio``) take the bytes
of a tensor of a held file from there instead of reading the file. The bytes are the
file's own, so a merge gives the same result either way; only where they come from differs.

A held file is recognised by identity (device and inode), not by how its path is
spelled, and only while its size and modification time are those it had when read:
a file replaced since is read from disk again. Nothing here ever goes to a GPU: a CUDA
merge copies from these bytes into its pinned buffers, as it would from the file.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from maec_core.errors import Cancelled, CorruptCheckpoint
from maec_core.io.headers import TensorInfo, read_header

# Bytes per read while loading a file: large enough that syscalls are rare, small
# enough that a cancelled sweep stops soon after asking.
READ_BLOCK = 64 << 20

_Identity = tuple[int, int]  # (st_dev, st_ino)


@dataclass(frozen=True)
class HeldFile:
    """The bytes ``[offset, offset + len(data))`` of one file, as they were on disk."""

    path: Path
    offset: int
    data: torch.Tensor  # uint8, 1-D, CPU
    identity: tuple[int, int]  # (st_dev, st_ino) when read
    size: int
    mtime_ns: int


def _identity(st: os.stat_result) -> _Identity:
    return (st.st_dev, st.st_ino)


def _read_span(path: Path, offset: int, size: int, cancel: Callable[[], bool] | None
               ) -> torch.Tensor:
    """Bytes ``[offset, size)`` of ``path`` in one fresh uint8 tensor."""
    data = torch.empty(size - offset, dtype=torch.uint8)
    view = memoryview(data.numpy().data).cast("B")
    fd = os.open(path, os.O_RDONLY)
    try:
        done = 0
        while done < len(view):
            if cancel is not None and cancel():
                raise Cancelled(f"reading {path.name} into memory was cancelled")
            got = os.preadv(fd, [view[done: done + READ_BLOCK]], offset + done)
            if got <= 0:
                raise CorruptCheckpoint(
                    f"{path.name}: ends after {offset + done} of {size} bytes "
                    "(changed while being read)", file=path.name)
            done += got
    finally:
        os.close(fd)
    return data


class ResidentFiles:
    """Safetensors files whose tensor bytes are held in memory (see the module doc).

    Immutable once built; ``|`` makes a set holding both sides' files (sharing their
    bytes, not copying them). Lookups are thread-safe: the engine's reader threads and
    its compute threads ask concurrently.
    """

    def __init__(self, held: Iterable[HeldFile] = ()) -> None:
        self._held: dict[_Identity, HeldFile] = {}
        for h in held:
            self._held[h.identity] = h
        # Path as spelled by a caller -> its held file (None: not held); each distinct
        # path is looked up on disk once.
        self._by_path: dict[Path, HeldFile | None] = {}
        self._lock = threading.Lock()

    @classmethod
    def read(cls, paths: Iterable[Path], cancel: Callable[[], bool] | None = None
             ) -> ResidentFiles:
        """Read the data section of each safetensors file in ``paths`` (once each, however
        often it is named) into memory; ``cancel()`` True stops with ``Cancelled``."""
        held: dict[_Identity, HeldFile] = {}
        for path in paths:
            st = os.stat(path)
            if _identity(st) in held:
                continue
            header = read_header(path)
            data = _read_span(path, header.data_start, header.size, cancel)
            after = os.stat(path)
            if (after.st_size, after.st_mtime_ns) != (st.st_size, st.st_mtime_ns):
                raise CorruptCheckpoint(f"{path.name} changed while being read",
                                        file=path.name)
            held[_identity(st)] = HeldFile(path, header.data_start, data, _identity(st),
                                           st.st_size, st.st_mtime_ns)
        return cls(held.values())

    @property
    def files(self) -> list[HeldFile]:
        return list(self._held.values())

    @property
    def nbytes(self) -> int:
        return sum(h.data.numel() for h in self._held.values())

    def __or__(self, other: ResidentFiles) -> ResidentFiles:
        return ResidentFiles([*self._held.values(), *other._held.values()])

    def __bool__(self) -> bool:
        return bool(self._held)

    def _lookup(self, path: Path) -> HeldFile | None:
        with self._lock:
            if path in self._by_path:
                return self._by_path[path]
        try:
            st = os.stat(path)
        except OSError:
            found = None
        else:
            h = self._held.get(_identity(st))
            # Replaced or rewritten since it was read: not the bytes held.
            found = h if h is not None and (st.st_size, st.st_mtime_ns) == (
                h.size, h.mtime_ns) else None
        with self._lock:
            self._by_path[path] = found
        return found

    def span(self, info: TensorInfo, lo: int = 0, hi: int | None = None
             ) -> torch.Tensor | None:
        """Bytes ``[lo, hi)`` of ``info``'s stored tensor (``hi`` None: to its end) as a
        read-only uint8 view of the held bytes, or None when its file is not held."""
        h = self._lookup(info.file)
        if h is None:
            return None
        end = info.nbytes if hi is None else hi
        a = info.start - h.offset + lo
        b = info.start - h.offset + end
        if a < 0 or b > h.data.numel():
            return None  # outside the data section: the header's check should prevent it
        return h.data[a:b]


def held_bytes(paths: Iterable[Path]) -> int:
    """The bytes :meth:`ResidentFiles.read` would hold for ``paths`` (their data
    sections, each file once), from headers only."""
    seen: set[_Identity] = set()
    total = 0
    for path in paths:
        ident = _identity(os.stat(path))
        if ident in seen:
            continue
        seen.add(ident)
        header = read_header(path)
        total += header.size - header.data_start
    return total


def tensor_files(tensors: Mapping[str, TensorInfo] | Iterable[TensorInfo]) -> list[Path]:
    """Every file the bytes of ``tensors`` come from, low-rank deltas' included, in
    first-seen order."""
    infos = tensors.values() if isinstance(tensors, Mapping) else tensors
    files: dict[Path, None] = {}
    for info in infos:
        files[info.file] = None
        if info.delta is not None:
            files[info.delta.a.file] = None
            files[info.delta.b.file] = None
    return list(files)
