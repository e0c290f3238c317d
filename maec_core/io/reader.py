"""Read single tensors from validated safetensors files.

We read with ``readinto`` into a fresh buffer rather than memory-mapping whole files:
mapped pages that have been touched count towards the process's resident set until
unmapped, so an mmap reader's peak RSS grows with model size (that is most of mergekit's
footprint). A plain read holds exactly the tensors in hand. The one exception is the
streaming reader's large units, which may be windows mapped one unit at a time and
unmapped once used (``WindowSource``). ``TensorReader`` reads whole tensors
into fresh buffers (the whole-tensor path); ``UnitReader`` streams runs of elements into
a few buffers recycled for the whole merge (the element-wise path). For a CUDA merge
both read into pinned (page-locked) host memory, so host->device copies run
asynchronously (``non_blocking=True``) instead of through a staging copy.

Given :class:`~maec_core.io.resident.ResidentFiles`, every reader takes the bytes of a
held file's tensors from memory instead of the file (the same bytes; a sweep holds its
language base so it is read once for all candidates).
"""

from __future__ import annotations

import contextlib
import functools
import io
import os
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import torch

from maec_core.errors import CorruptCheckpoint
from maec_core.io.headers import TensorInfo
from maec_core.io.lowrank import with_delta

if TYPE_CHECKING:
    from maec_core.io.resident import ResidentFiles

TORCH_DTYPES: dict[str, torch.dtype] = {
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F64": torch.float64,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
SAFETENSORS_NAMES = {v: k for k, v in TORCH_DTYPES.items()}
# Runs shorter than this are read, not mapped: a mapping costs two system calls and a
# registered window, a read of a few kB costs one copy.
MAP_MIN_BYTES = 1 << 20


class WindowSource(Protocol):
    """Input bytes viewed in place instead of read (maec_core.native's mapped windows).

    ``view``: bytes ``[offset, offset + length)`` of ``fd`` as a read-only uint8 tensor
    over the file's own pages, or None (then they are read). ``faults``: a count that
    grows when a view was read past the end of a file that shrank under it (the view then
    reads zeros there). ``cached``: whether the first ``length`` bytes of ``fd`` are all in
    the page cache (only such files are viewed).
    """

    def view(self, fd: int, offset: int, length: int) -> torch.Tensor | None: ...

    def faults(self) -> int: ...

    def cached(self, fd: int, length: int) -> bool: ...


class TensorReader:
    """Reads tensors by ``TensorInfo``; keeps one open handle per file.

    Thread-safe: a seek and read pair runs under a per-file lock, so a prefetch thread
    and the main thread can share one reader. ``pin=True`` reads into pinned memory (for
    a CUDA merge; torch's host allocator caches those blocks, so this is no slower per
    tensor once warm). ``resident``: files whose tensors are copied from memory.
    """

    def __init__(self, *, pin: bool = False, resident: ResidentFiles | None = None) -> None:
        self._pin = pin
        self._resident = resident
        self._files: dict[Path, io.BufferedReader] = {}
        self._locks: dict[Path, threading.Lock] = {}
        self._guard = threading.Lock()

    def _handle(self, path: Path) -> tuple[io.BufferedReader, threading.Lock]:
        with self._guard:
            if path not in self._files:
                self._files[path] = open(path, "rb")  # noqa: SIM115 - closed in close()
                self._locks[path] = threading.Lock()
            return self._files[path], self._locks[path]

    def read(self, info: TensorInfo) -> torch.Tensor:
        """The tensor in its stored dtype, on CPU (plus its low-rank delta, if any)."""
        stored = self._read_stored(info)
        return stored if info.delta is None else with_delta(info, stored, self._read_stored)

    def _read_stored(self, info: TensorInfo) -> torch.Tensor:
        buf = torch.empty(info.nbytes, dtype=torch.uint8, pin_memory=self._pin)
        held = self._resident.span(info) if self._resident is not None else None
        if held is not None:
            # A copy, as a read gives: the caller may change its tensor in place.
            buf.copy_(held)
            return buf.view(TORCH_DTYPES[info.dtype]).reshape(info.shape)
        f, lock = self._handle(info.file)
        with lock:
            f.seek(info.start)
            got = f.readinto(buf.numpy().data)
        if got != info.nbytes:
            raise CorruptCheckpoint(
                f"{info.file.name}: tensor {info.name!r} truncated "
                f"({got} of {info.nbytes} bytes)",
                file=info.file.name,
                tensor=info.name,
            )
        return buf.view(TORCH_DTYPES[info.dtype]).reshape(info.shape)

    def close(self) -> None:
        with self._guard:
            for f in self._files.values():
                f.close()
            self._files.clear()

    def __enter__(self) -> TensorReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Prefetcher:
    """Reads the next step's tensors on a background thread while the current one computes.

    ``readinto`` releases the GIL, so I/O overlaps torch math. Depth 1 keeps memory at
    two steps' worth of inputs.
    """

    def __init__(self, reader: TensorReader, steps: list[list[TensorInfo]]) -> None:
        self._reader = reader
        self._steps = steps
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="maec-read")
        self._next: Future[list[torch.Tensor]] | None = None
        self._i = 0

    def _load(self, infos: list[TensorInfo]) -> list[torch.Tensor]:
        return [self._reader.read(i) for i in infos]

    def __iter__(self) -> Prefetcher:
        return self

    def __next__(self) -> list[torch.Tensor]:
        if self._i >= len(self._steps):
            self.close()
            raise StopIteration
        fut = self._next or self._pool.submit(self._load, self._steps[self._i])
        self._i += 1
        self._next = (
            self._pool.submit(self._load, self._steps[self._i])
            if self._i < len(self._steps)
            else None
        )
        return fut.result()

    def close(self) -> None:
        if self._next is not None:
            self._next.cancel()
        self._pool.shutdown(wait=True)


@dataclass
class Unit:
    """A run ``[lo, hi)`` of flat elements of step ``step``'s tensors, one view per input.

    The views live in a recycled buffer (or are the bytes of a resident file): read
    them, never write them, and call ``release()`` once done with them.
    """

    step: int
    lo: int
    hi: int
    numel: int
    tensors: list[torch.Tensor]
    release: Callable[[], None]

    @property
    def first(self) -> bool:
        return self.lo == 0

    @property
    def last(self) -> bool:
        return self.hi == self.numel


def _advise(fd: int, offset: int, length: int, advice: str) -> None:
    """``posix_fadvise`` where the system has it: a hint about how inputs are read (a
    larger readahead window, a range to fetch early), never needed for the result."""
    code = getattr(os, advice, None)
    if code is not None:
        with contextlib.suppress(OSError):
            os.posix_fadvise(fd, offset, length, code)


def _pread_into(fd: int, view: memoryview, offset: int, info: TensorInfo) -> None:
    done = 0
    while done < len(view):
        got = os.preadv(fd, [view[done:]], offset + done)
        if got <= 0:
            raise CorruptCheckpoint(
                f"{info.file.name}: tensor {info.name!r} truncated "
                f"({offset + done - info.start} of {info.nbytes} bytes)",
                file=info.file.name,
                tensor=info.name,
            )
        done += got


class UnitReader:
    """Streams every step's tensors in units of at most ``unit`` elements, on a thread.

    For element-wise merges: a unit of each input is read (``preadv`` releases the GIL)
    while the previous one is computed, the inputs' parts of a unit side by side, one
    thread per input: on inputs larger than memory, where reading is most of a merge, one
    thread reading them in turn measured 1.09x the time of three. Units land in
    ``depth + 1`` buffer sets allocated once and recycled, so memory stays at a few units
    however large the model is, and no fresh allocation (each a storm of page faults on
    first touch) happens per tensor. ``pin=True`` allocates them pinned, for asynchronous
    copies to a GPU.

    A tensor of a ``resident`` file is not read: its units are views of the held bytes
    (no copy at all), or, with ``pin``, copied from them into the pinned buffers.

    Given ``windows`` (and not ``pin``), a large unit of a file that is all in the page
    cache when the reader opens it is not read either: it is a view of those pages mapped
    in memory, which saves the copy (the largest cost of a merge of cached inputs). Any
    other file is read: on inputs larger than memory, mapping the units that happened to
    be cached as well as faulting the others in measured 1.2-1.3x the I/O floor at 7B,
    against 1.0-1.1x reading them all. A window is unmapped when its unit's views are
    gone, so the resident set stays at a few units as with reads. A file that shrinks is
    caught before mapping (then read, which fails as truncated) or, when it shrinks under
    a mapped window, by the guard's fault count, checked as each unit is handed out and
    when the reader closes: either way the merge fails with ``CorruptCheckpoint`` before
    anything computed from missing bytes is published.
    """

    def __init__(self, steps: list[list[TensorInfo]], unit: int, depth: int = 2, *,
                 pin: bool = False, resident: ResidentFiles | None = None,
                 windows: WindowSource | None = None) -> None:
        self._steps = steps
        self._unit = unit
        self._pin = pin
        self._resident = resident
        self._windows = None if pin else windows
        self._faults = windows.faults() if windows is not None else 0
        # How far into each file its tensors reach: what a shrunk file is measured against.
        self._extent: dict[Path, int] = {}
        for infos in steps:
            for i in infos:
                self._extent[i.file] = max(self._extent.get(i.file, 0), i.start + i.nbytes)
        slots = max((len(s) for s in steps), default=0)
        itemsize = max((i.nbytes // max(i.numel, 1) for s in steps for i in s), default=1)
        biggest = max((i.numel for s in steps for i in s), default=0)
        size = max(1, min(unit, biggest)) * itemsize
        self._free: queue.Queue[list[torch.Tensor]] = queue.Queue()
        for _ in range(depth + 1):
            self._free.put([torch.empty(size, dtype=torch.uint8, pin_memory=pin)
                            for _ in range(slots)])
        self._ready: queue.Queue[Unit | BaseException | None] = queue.Queue()
        self._fds: dict[Path, int] = {}
        self._fds_lock = threading.Lock()
        # The files whose units are mapped: those all in the page cache when opened.
        self._in_cache: set[Path] = set()
        # The reader thread reads one input's part of a unit, these the others'.
        self._side = (ThreadPoolExecutor(max_workers=slots - 1, thread_name_prefix="maec-read")
                      if slots > 1 else None)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="maec-read", daemon=True)
        self._thread.start()

    def _fd(self, path: Path) -> int:
        with self._fds_lock:
            fd = self._fds.get(path)
            if fd is None:
                fd = self._fds[path] = os.open(path, os.O_RDONLY)
                _advise(fd, 0, 0, "POSIX_FADV_SEQUENTIAL")
                if self._windows is not None and self._windows.cached(
                        fd, self._extent.get(path, 0)):
                    self._in_cache.add(path)
            return fd

    def _read_whole(self, info: TensorInfo) -> torch.Tensor:
        buf = torch.empty(info.nbytes, dtype=torch.uint8)
        held = self._resident.span(info) if self._resident is not None else None
        if held is not None:
            buf.copy_(held)
        elif info.nbytes:
            _pread_into(self._fd(info.file), buf.numpy().data.cast("B"), info.start, info)
        return buf.view(TORCH_DTYPES[info.dtype]).reshape(info.shape)

    def _fill(self, info: TensorInfo, raw: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        """Bytes ``[lo, hi)`` of ``info``'s stored tensor: read into ``raw``, or, for a
        resident file, the held bytes themselves when they can be viewed in the tensor's
        dtype (else copied into ``raw``)."""
        held = self._resident.span(info, lo, hi) if self._resident is not None else None
        if held is None:
            fd = self._fd(info.file)
            got = self._mapped(fd, info, lo, hi)
            if got is None:
                _pread_into(fd, raw.numpy().data.cast("B"), info.start + lo, info)
                got = raw
            # The next unit of this input is read after one of every other input: asked
            # for now, the disk fetches it while those are read and this one computed.
            ahead = min(hi - lo, info.nbytes - hi)
            if ahead > 0:
                _advise(fd, info.start + hi, ahead, "POSIX_FADV_WILLNEED")
            return got
        size = TORCH_DTYPES[info.dtype].itemsize
        if not self._pin and held.storage_offset() % size == 0:
            return held
        return raw.copy_(held)

    def _mapped(self, fd: int, info: TensorInfo, lo: int, hi: int) -> torch.Tensor | None:
        """Bytes ``[lo, hi)`` of ``info``'s stored tensor as a mapped window, or None:
        no window source, a file not all in the page cache when opened, a short run, a
        start not aligned to the dtype (the view would be misaligned), or a file already
        shorter than the run (a read then reports it)."""
        size = TORCH_DTYPES[info.dtype].itemsize
        if (self._windows is None or info.file not in self._in_cache
                or hi - lo < MAP_MIN_BYTES or (info.start + lo) % size
                or os.fstat(fd).st_size < info.start + hi):
            return None
        return self._windows.view(fd, info.start + lo, hi - lo)

    def _check(self) -> None:
        """Fail as truncated if a window was read past the end of one of our files."""
        if self._windows is None:
            return
        now = self._windows.faults()
        if now == self._faults:
            return
        self._faults = now  # another reader's file, unless one of ours is now short
        for path, fd in list(self._fds.items()):
            have = os.fstat(fd).st_size
            if have < self._extent.get(path, 0):
                raise CorruptCheckpoint(
                    f"{path.name}: truncated while being read ({have} of "
                    f"{self._extent[path]} bytes)", file=path.name)

    def _formed(self, info: TensorInfo) -> torch.Tensor:
        """``info``'s tensor with its low-rank delta added, as flat bytes."""
        whole = with_delta(info, self._read_whole(info), self._read_whole)
        return whole.reshape(-1).view(torch.uint8)

    def _take(self) -> list[torch.Tensor] | None:
        while not self._stop.is_set():
            try:
                return self._free.get(timeout=0.1)
            except queue.Empty:
                continue
        return None

    def _run(self) -> None:
        try:
            for si, infos in enumerate(self._steps):
                formed: dict[int, torch.Tensor] = {}
                numel = infos[0].numel if infos else 0
                bounds = [(lo, min(numel, lo + self._unit))
                          for lo in range(0, numel, self._unit)] or [(0, 0)]
                for lo, hi in bounds:
                    bufs = self._take()
                    if bufs is None:
                        return
                    views = self._views(infos, bufs, lo, hi, formed)
                    self._ready.put(Unit(si, lo, hi, numel, views,
                                         functools.partial(self._free.put, bufs)))
            self._ready.put(None)
        except BaseException as exc:  # handed to the consumer
            self._ready.put(exc)

    def _views(self, infos: list[TensorInfo], bufs: list[torch.Tensor], lo: int, hi: int,
               formed: dict[int, torch.Tensor]) -> list[torch.Tensor]:
        """Elements ``[lo, hi)`` of each input's tensor, in its dtype: read into ``bufs``
        (or viewed in place), the inputs side by side on the helper threads unless one of
        them is formed with a low-rank delta (then in turn)."""

        def one(k: int) -> torch.Tensor:
            info = infos[k]
            size = info.nbytes // max(info.numel, 1)
            raw = bufs[k][: (hi - lo) * size]
            if info.delta is not None:
                # Stored plus a low-rank delta: formed whole once per tensor (per input),
                # then handed out a unit at a time.
                if k not in formed:
                    formed[k] = self._formed(info)
                raw.copy_(formed[k][lo * size: hi * size])
            else:
                raw = self._fill(info, raw, lo * size, hi * size)
            return raw.view(TORCH_DTYPES[info.dtype])

        n = min(len(infos), len(bufs))
        if self._side is None or n < 2 or any(i.delta is not None for i in infos):
            return [one(k) for k in range(n)]
        others = [self._side.submit(one, k) for k in range(1, n)]
        try:
            first = one(0)
        finally:
            # Every read done (or failed) before the buffers can be handed on or reused.
            done = [f.exception() for f in others]
        for exc in done:
            if exc is not None:
                raise exc
        return [first, *(f.result() for f in others)]

    def __iter__(self) -> UnitReader:
        return self

    def __next__(self) -> Unit:
        item = self._ready.get()
        if isinstance(item, BaseException):
            raise item
        self._check()
        if item is None:
            raise StopIteration
        return item

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        if self._side is not None:
            self._side.shutdown(wait=True)
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __enter__(self) -> UnitReader:
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            if exc[0] is None:
                # Units handed out last may have been computed after the final __next__.
                self._check()
        finally:
            self.close()
