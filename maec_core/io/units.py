"""Stream the tensors of an element-wise merge in units of flat elements, on threads.

:class:`UnitReader` reads (or maps) a run of elements of every input of a step into a
few byte buffers recycled for the whole merge, so memory stays at a few units however
large the model. It holds bytes, not tensors, and imports torch only when a consumer asks
for tensors (``Unit.tensors``) or a unit needs torch to be formed (an adapter's low-rank
delta, pinned buffers): a merge computed by a compiled kernel
(``maec_core.kernel_merge``) never imports it.
"""

from __future__ import annotations

import contextlib
import functools
import os
import queue
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from maec_core.errors import CorruptCheckpoint
from maec_core.io.headers import DTYPE_SIZES, TensorInfo

if TYPE_CHECKING:
    import torch

    from maec_core.io.resident import ResidentFiles

# Runs shorter than this are read, not mapped: a mapping costs two system calls and a
# registered window, a read of a few kB costs one copy.
MAP_MIN_BYTES = 1 << 20


class WindowSource(Protocol):
    """Input bytes viewed in place instead of read (maec_core.native's mapped windows).

    ``view``: bytes ``[offset, offset + length)`` of ``fd`` as a uint8 array over the
    file's own pages (never written to), or None (then they are read). ``faults``: a count that
    grows when a view was read past the end of a file that shrank under it (the view then
    reads zeros there). ``cached``: whether the first ``length`` bytes of ``fd`` are all in
    the page cache (only such files are viewed).
    """

    def view(self, fd: int, offset: int, length: int) -> np.ndarray | None: ...

    def faults(self) -> int: ...

    def cached(self, fd: int, length: int) -> bool: ...


@dataclass
class Unit:
    """A run ``[lo, hi)`` of flat elements of step ``step``'s tensors, one view per input:
    ``data``, its bytes (uint8 arrays) in the stored dtypes ``dtypes`` (safetensors
    names); ``tensors``, the same bytes as flat torch tensors of those dtypes.

    The views live in a recycled buffer (or are the bytes of a resident file or of mapped
    pages): read them, never write them, and call ``release()`` once done with them.
    """

    step: int
    lo: int
    hi: int
    numel: int
    data: list[np.ndarray]
    dtypes: list[str]
    release: Callable[[], None]
    # The pinned buffers ``data`` was read into (each run the start of one), for a CUDA
    # merge's asynchronous copies; None otherwise.
    pinned: list[torch.Tensor] | None = field(default=None, repr=False)

    @functools.cached_property
    def tensors(self) -> list[torch.Tensor]:
        """The runs as torch tensors of their dtypes, sharing ``data``'s memory (torch is
        imported here, on first use)."""
        import torch

        from maec_core.io.reader import TORCH_DTYPES

        if self.pinned is not None:
            # Views of the pinned tensors themselves, which torch knows as pinned.
            return [buf[: d.size].view(TORCH_DTYPES[t])
                    for buf, d, t in zip(self.pinned, self.data, self.dtypes, strict=False)]
        return [torch.from_numpy(d).view(TORCH_DTYPES[t])
                for d, t in zip(self.data, self.dtypes, strict=True)]

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
        self._free: queue.Queue[_Buffers] = queue.Queue()
        for _ in range(depth + 1):
            self._free.put(_buffers(size, slots, pin))
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

    def _held(self, info: TensorInfo, lo: int = 0, hi: int | None = None
              ) -> np.ndarray | None:
        """Bytes ``[lo, hi)`` of ``info``'s stored tensor held in memory (a resident
        file's), or None."""
        held = self._resident.span(info, lo, hi) if self._resident is not None else None
        return None if held is None else held.numpy()

    def _read_whole(self, info: TensorInfo) -> np.ndarray:
        buf = np.empty(info.nbytes, dtype=np.uint8)
        held = self._held(info)
        if held is not None:
            np.copyto(buf, held)
        elif info.nbytes:
            _pread_into(self._fd(info.file), buf.data, info.start, info)
        return buf

    def _fill(self, info: TensorInfo, raw: np.ndarray, lo: int, hi: int) -> np.ndarray:
        """Bytes ``[lo, hi)`` of ``info``'s stored tensor: read into ``raw``, or, for a
        resident file, the held bytes themselves when they can be viewed in the tensor's
        dtype (else copied into ``raw``)."""
        held = self._held(info, lo, hi)
        if held is None:
            fd = self._fd(info.file)
            got = self._mapped(fd, info, lo, hi)
            if got is None:
                _pread_into(fd, raw.data, info.start + lo, info)
                got = raw
            # The next unit of this input is read after one of every other input: asked
            # for now, the disk fetches it while those are read and this one computed.
            ahead = min(hi - lo, info.nbytes - hi)
            if ahead > 0:
                _advise(fd, info.start + hi, ahead, "POSIX_FADV_WILLNEED")
            return got
        if not self._pin and held.ctypes.data % DTYPE_SIZES[info.dtype] == 0:
            return held
        np.copyto(raw, held)
        return raw

    def _mapped(self, fd: int, info: TensorInfo, lo: int, hi: int) -> np.ndarray | None:
        """Bytes ``[lo, hi)`` of ``info``'s stored tensor as a mapped window, or None:
        no window source, a file not all in the page cache when opened, a short run, a
        start not aligned to the dtype (the view would be misaligned), or a file already
        shorter than the run (a read then reports it)."""
        size = DTYPE_SIZES[info.dtype]
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

    def _formed(self, info: TensorInfo) -> np.ndarray:
        """``info``'s tensor with its low-rank delta added, as flat bytes (formed by
        torch: an adapter's merge imports it)."""
        import torch

        from maec_core.io.lowrank import with_delta
        from maec_core.io.reader import TORCH_DTYPES

        def whole(i: TensorInfo) -> torch.Tensor:
            return (torch.from_numpy(self._read_whole(i)).view(TORCH_DTYPES[i.dtype])
                    .reshape(i.shape))

        formed = with_delta(info, whole(info), whole)
        return formed.reshape(-1).view(torch.uint8).numpy()

    def _take(self) -> _Buffers | None:
        while not self._stop.is_set():
            try:
                return self._free.get(timeout=0.1)
            except queue.Empty:
                continue
        return None

    def _run(self) -> None:
        try:
            for si, infos in enumerate(self._steps):
                formed: dict[int, np.ndarray] = {}
                numel = infos[0].numel if infos else 0
                bounds = [(lo, min(numel, lo + self._unit))
                          for lo in range(0, numel, self._unit)] or [(0, 0)]
                for lo, hi in bounds:
                    bufs = self._take()
                    if bufs is None:
                        return
                    views = self._views(infos, bufs.data, lo, hi, formed)
                    self._ready.put(Unit(si, lo, hi, numel, views,
                                         [i.dtype for i in infos[: len(views)]],
                                         functools.partial(self._free.put, bufs),
                                         bufs.pinned))
            self._ready.put(None)
        except BaseException as exc:  # handed to the consumer
            self._ready.put(exc)

    def _views(self, infos: list[TensorInfo], bufs: list[np.ndarray], lo: int, hi: int,
               formed: dict[int, np.ndarray]) -> list[np.ndarray]:
        """The bytes of elements ``[lo, hi)`` of each input's tensor: read into ``bufs``
        (or viewed in place), the inputs side by side on the helper threads unless one of
        them is formed with a low-rank delta (then in turn)."""

        def one(k: int) -> np.ndarray:
            info = infos[k]
            size = info.nbytes // max(info.numel, 1)
            raw = bufs[k][: (hi - lo) * size]
            if info.delta is not None:
                # Stored plus a low-rank delta: formed whole once per tensor (per input),
                # then handed out a unit at a time.
                if k not in formed:
                    formed[k] = self._formed(info)
                np.copyto(raw, formed[k][lo * size: hi * size])
                return raw
            return self._fill(info, raw, lo * size, hi * size)

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


@dataclass(frozen=True)
class _Buffers:
    """One unit's buffers, one per input slot: ``data`` the bytes read into, views of
    ``pinned`` (page-locked torch buffers) when the reader pins."""

    data: list[np.ndarray]
    pinned: list[Any] | None


def _buffers(size: int, slots: int, pin: bool) -> _Buffers:
    if not pin:
        return _Buffers([np.empty(size, dtype=np.uint8) for _ in range(slots)], None)
    import torch

    pinned = [torch.empty(size, dtype=torch.uint8, pin_memory=True) for _ in range(slots)]
    return _Buffers([b.numpy() for b in pinned], pinned)
