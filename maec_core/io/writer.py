"""Stream tensors into sharded safetensors files without buffering a shard in memory.

The plan knows every output tensor's name, shape and dtype before the first one is
computed, so each shard's header (with final offsets) is written first and tensor bytes
are appended as they are produced, hashed on the way. Memory: one tensor at a time.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import json
import math
import queue
import struct
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO, Protocol

from maec_core.errors import MaecError
from maec_core.io.headers import DTYPE_SIZES

if TYPE_CHECKING:
    import torch

INDEX_NAME = "model.safetensors.index.json"
# Below this, handing a write to the helper thread costs more than it overlaps.
PARALLEL_MIN_BYTES = 1 << 20
# fallocate(2)'s flag that reserves blocks without changing the file's size.
_FALLOC_FL_KEEP_SIZE = 1


@functools.cache
def _fallocate() -> Callable[[int, int, int, int], int] | None:
    """libc's ``fallocate`` (Linux), or None where there is none."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).fallocate
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    fn.restype = ctypes.c_int
    return fn


def reserve(fd: int, size: int) -> bool:
    """Reserve ``size`` bytes of disk for the file ``fd`` without changing its size.

    On ext4 a file grown by plain appends has its blocks allocated at writeback, a little
    at a time, and the appending process pays for it: writing a 1.7 GB shard measured 3-4x
    the CPU time of the same writes into reserved blocks. The size is kept, so a shard is
    still only ever appended to (a follower reads every byte below its size as final).
    False where the system or filesystem cannot (the writes then allocate as they go).
    """
    fn = _fallocate()
    return fn is not None and size > 0 and fn(fd, _FALLOC_FL_KEEP_SIZE, 0, size) == 0


@dataclass(frozen=True)
class OutputTensor:
    name: str
    shape: tuple[int, ...]
    dtype: str  # safetensors dtype name, e.g. "BF16"

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPE_SIZES[self.dtype]


@dataclass
class _Shard:
    file_name: str
    tensors: list[OutputTensor]
    header: bytes = b""
    sha: hashlib._Hash = field(default_factory=hashlib.sha256)
    size: int = 0


@dataclass(frozen=True)
class WrittenFile:
    path: str
    size: int
    sha256: str


# Called with each shard as soon as it is complete on disk (closed, hashed), from the
# writer's thread, while later tensors are still being merged: how the worker uploads
# shards during the merge. It must not block for long (hand the work to a thread).
ShardFn = Callable[[Path, WrittenFile], None]
# Called as a shard is created (its header written) with its path, name and final size,
# so a reader may follow it as it grows: a shard is only ever appended to, so every byte
# below the file's current size is final. Same thread and rules as ``ShardFn``.
ShardOpenFn = Callable[[Path, str, int], None]


class TensorSink(Protocol):
    """Where a merge's output tensors go, in the declared order: a folder's shards
    (:class:`ShardedWriter`) or anything else taking the same calls, such as a loaded
    model's weights (a sweep scores its candidates without writing them)."""

    def begin(self, name: str, shape: tuple[int, ...], dtype: str | None) -> None:
        """Start the next tensor (safetensors dtype name)."""
        ...

    def append(self, data: memoryview | bytes) -> None:
        """The next bytes of the current tensor."""
        ...

    def end(self) -> None:
        """The current tensor is complete."""
        ...

    def close(self) -> list[WrittenFile]:
        """Every tensor has been given; the files written (none for a sink that writes
        no file)."""
        ...

    def abort(self) -> None:
        """The merge failed: release what the sink holds."""
        ...


# Makes the sink for a merge, given the tensors it will receive in order.
SinkFn = Callable[[list[OutputTensor]], TensorSink]


def shard_layout(tensors: list[OutputTensor], shard_size: int) -> list[list[OutputTensor]]:
    """Greedy split in order; a tensor larger than ``shard_size`` gets a shard to itself."""
    shards: list[list[OutputTensor]] = [[]]
    used = 0
    for t in tensors:
        if shards[-1] and used + t.nbytes > shard_size:
            shards.append([])
            used = 0
        shards[-1].append(t)
        used += t.nbytes
    return shards


def shard_names(n: int) -> list[str]:
    """The file names of an output of ``n`` shards (HF's naming)."""
    if n == 1:
        return ["model.safetensors"]
    return [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]


def _index(groups: list[list[OutputTensor]]) -> bytes:
    names = shard_names(len(groups))
    index = {
        "metadata": {"total_size": sum(t.nbytes for g in groups for t in g)},
        "weight_map": {t.name: name for name, g in zip(names, groups, strict=True)
                       for t in g},
    }
    return (json.dumps(index, indent=2, sort_keys=True) + "\n").encode()


def shard_index(tensors: list[OutputTensor], shard_size: int) -> bytes | None:
    """The bytes of ``model.safetensors.index.json`` for ``tensors`` cut at
    ``shard_size`` (None for a one-shard output): what the final step of a split merge
    writes beside its parts' shards, the very bytes an unsplit merge writes."""
    groups = shard_layout(tensors, shard_size)
    return _index(groups) if len(groups) > 1 else None


def _planned_size(tensors: list[OutputTensor]) -> int:
    """A shard's file size: its header and its tensors' bytes."""
    return len(_header(tensors)) + sum(t.nbytes for t in tensors)


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """A CPU tensor's bytes as a flat memoryview (no copy when already contiguous)."""
    import torch  # here: a merge that writes bytes only never imports it

    # Flat: len() of a 2-D memoryview would count rows, not bytes.
    flat = tensor.detach().cpu().contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().data.cast("B")


def _header(tensors: list[OutputTensor]) -> bytes:
    doc: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for t in tensors:
        doc[t.name] = {"dtype": t.dtype, "shape": list(t.shape),
                       "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    raw = json.dumps(doc, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # data section starts 8-byte aligned, as the spec advises
    return struct.pack("<Q", len(raw)) + raw


class ShardedWriter:
    """Write ``tensors`` (in this exact order) into ``folder`` as HF-named shards."""

    def __init__(self, folder: Path, tensors: list[OutputTensor], shard_size: int, *,
                 parallel_io: bool = False, on_shard: ShardFn | None = None,
                 on_shard_open: ShardOpenFn | None = None,
                 done: Mapping[str, WrittenFile] | None = None,
                 part: tuple[int, int] | None = None) -> None:
        self.folder = folder
        self.on_shard = on_shard
        self.on_shard_open = on_shard_open
        # With parallel_io, each append writes the file on a helper thread while this one
        # hashes the same bytes (both release the GIL): hashing is the slowest step of
        # producing the output, and it no longer adds to the write.
        self._io = (ThreadPoolExecutor(max_workers=1, thread_name_prefix="maec-io")
                    if parallel_io else None)
        groups = shard_layout(tensors, shard_size)
        n = len(groups)
        names = shard_names(n)
        self._shards = [_Shard(name, g) for name, g in zip(names, groups, strict=True)]
        # Shards a resumed merge already has (published by an earlier run of the same
        # plan): not written here, listed as given. Only one of exactly the planned size
        # counts; any other is another plan's file, and is written again.
        self.done = {s.file_name: done[s.file_name] for s in self._shards
                     if done is not None and s.file_name in done
                     and done[s.file_name].size == _planned_size(s.tensors)}
        # One part of a merge split across workers: only shards ``[lo, hi)`` of the plan
        # are written here, and no index (the final step writes it: shard_index).
        self.part = part
        lo, hi = part if part is not None else (0, n)
        if not 0 <= lo < hi <= n:
            raise MaecError(f"writer: part {part} is not a range of the {n} planned shards")
        self._order = [(si, t) for si, s in enumerate(self._shards) for t in s.tensors
                       if s.file_name not in self.done and lo <= si < hi]
        self._pos = 0
        self._current: BinaryIO | None = None
        self._current_index = -1
        self._open_bytes: int | None = None
        self.files: list[WrittenFile] = []

    @property
    def partial(self) -> bool:
        """Whether some planned tensors are not to be given (done shards, or a part)."""
        return bool(self.done) or self.part is not None

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for s in self._shards for t in s.tensors)

    def expected(self) -> set[str]:
        """The names of the tensors to be given."""
        return {t.name for _, t in self._order}

    def _open(self, si: int) -> BinaryIO:
        if self._current_index != si:
            self._finish_current()
            shard = self._shards[si]
            shard.header = _header(shard.tensors)
            f = open(self.folder / shard.file_name, "wb")  # noqa: SIM115 - closed in _finish_current
            reserve(f.fileno(), _planned_size(shard.tensors))
            f.write(shard.header)
            shard.sha.update(shard.header)
            shard.size = len(shard.header)
            self._current, self._current_index = f, si
            if self.on_shard_open is not None:
                self.on_shard_open(self.folder / shard.file_name, shard.file_name,
                                   _planned_size(shard.tensors))
        assert self._current is not None
        return self._current

    def _finish_current(self) -> None:
        if self._current is None:
            return
        self._current.close()
        shard = self._shards[self._current_index]
        written = WrittenFile(shard.file_name, shard.size, shard.sha.hexdigest())
        self.files.append(written)
        self._current = None
        if self.on_shard is not None:
            self.on_shard(self.folder / shard.file_name, written)

    def begin(self, name: str, shape: tuple[int, ...], dtype: str | None) -> None:
        """Start the next tensor; it must match the declared name, shape and dtype."""
        if self._open_bytes is not None:
            raise MaecError(f"writer: tensor {name!r} begun before the previous one ended")
        if self._pos >= len(self._order):
            raise MaecError(f"writer got an unexpected extra tensor {name!r}")
        si, spec = self._order[self._pos]
        if spec.name != name or tuple(shape) != spec.shape or dtype != spec.dtype:
            raise MaecError(
                f"writer expected {spec.name} {list(spec.shape)} {spec.dtype}, got "
                f"{name} {list(shape)} {dtype}"
            )
        self._open(si)
        self._open_bytes = 0

    def append(self, data: memoryview | bytes) -> None:
        """Append bytes of the current tensor (hashed as they go)."""
        if self._open_bytes is None:
            raise MaecError("writer: append outside a tensor")
        si, spec = self._order[self._pos]
        n = memoryview(data).nbytes
        if self._open_bytes + n > spec.nbytes:
            raise MaecError(f"writer: more than {spec.nbytes} bytes for {spec.name!r}")
        assert self._current is not None
        shard = self._shards[si]
        if self._io is not None and n >= PARALLEL_MIN_BYTES:
            pending = self._io.submit(self._current.write, data)
            shard.sha.update(data)
            pending.result()
        else:
            self._current.write(data)
            shard.sha.update(data)
        shard.size += n
        self._open_bytes += n

    def end(self) -> None:
        if self._open_bytes is None:
            raise MaecError("writer: end outside a tensor")
        _, spec = self._order[self._pos]
        if self._open_bytes != spec.nbytes:
            raise MaecError(
                f"writer: {spec.name!r} got {self._open_bytes} of {spec.nbytes} bytes"
            )
        self._open_bytes = None
        self._pos += 1

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Append the next tensor; it must match the declared name, shape and dtype."""
        from maec_core.io.reader import SAFETENSORS_NAMES

        self.begin(name, tuple(tensor.shape), SAFETENSORS_NAMES.get(tensor.dtype))
        self.append(tensor_bytes(tensor))
        self.end()

    def close(self) -> list[WrittenFile]:
        """Finish the last shard, write the index when sharded; return files written."""
        if self._pos != len(self._order) or self._open_bytes is not None:
            raise MaecError(f"writer closed after {self._pos} of {len(self._order)} tensors")
        self._finish_current()
        self._shutdown_io()
        self.files.extend(self.done[s.file_name] for s in self._shards
                          if s.file_name in self.done)
        if len(self._shards) > 1 and self.part is None:
            raw = _index([s.tensors for s in self._shards])
            (self.folder / INDEX_NAME).write_bytes(raw)
            self.files.append(WrittenFile(INDEX_NAME, len(raw), hashlib.sha256(raw).hexdigest()))
        return self.files

    def _shutdown_io(self) -> None:
        if self._io is not None:
            self._io.shutdown(wait=True)
            self._io = None

    def abort(self) -> None:
        self._shutdown_io()
        if self._current is not None:
            self._current.close()
            self._current = None


@dataclass
class _Part:
    name: str
    shape: tuple[int, ...]
    dtype: str
    data: memoryview
    first: bool
    last: bool
    done: Callable[[], None] | None


class BackgroundWriter:
    """Runs a ``TensorSink`` (a ``ShardedWriter``) on its own thread, so hashing and
    writing overlap compute.

    ``sha256.update`` and ``file.write`` release the GIL, so on a CPU merge the output's
    hashing costs no wall time beside the math. Parts are queued (bounded, so memory stays
    at ``depth`` parts); ``done`` runs after a part is written, which is how callers
    recycle buffers. An error on the thread is raised on the next call from the caller.

    ``depth=0`` runs no thread: each part goes to the sink in the caller's ``put``. That
    is for a sink cheaper than a hand-off between threads (a copy into memory).
    """

    def __init__(self, writer: TensorSink, depth: int = 4) -> None:
        self.writer = writer
        self._queue: queue.Queue[_Part | None] = queue.Queue(maxsize=depth)
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        if depth > 0:
            self._thread = threading.Thread(target=self._run, name="maec-write",
                                            daemon=True)
            self._thread.start()

    def _write(self, part: _Part) -> None:
        if part.first:
            self.writer.begin(part.name, part.shape, part.dtype)
        self.writer.append(part.data)
        if part.last:
            self.writer.end()
        if part.done is not None:
            part.done()

    def _run(self) -> None:
        while True:
            part = self._queue.get()
            if part is None:
                return
            if self._error is None:
                try:
                    self._write(part)  # calls part.done once written
                    continue
                except BaseException as exc:  # re-raised in the caller's thread
                    self._error = exc
            # After a failure parts are drained unwritten, but their buffers still go
            # back (``done``): a producer waiting for a free buffer before its next
            # ``put`` (where the error is raised) would otherwise wait forever.
            if part.done is not None:
                part.done()

    def _check(self) -> None:
        if self._error is not None:
            raise self._error

    def put(self, name: str, shape: tuple[int, ...], dtype: str, data: memoryview, *,
            first: bool = True, last: bool = True,
            done: Callable[[], None] | None = None) -> None:
        """Queue the bytes ``data`` of tensor ``name`` (a whole tensor or one part)."""
        self._check()
        part = _Part(name, tuple(shape), dtype, data, first, last, done)
        if self._thread is None:
            self._write(part)
        else:
            self._queue.put(part)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Queue a whole tensor (kept alive by the queue until written)."""
        from maec_core.io.reader import SAFETENSORS_NAMES

        self.put(name, tuple(tensor.shape), SAFETENSORS_NAMES[tensor.dtype],
                 tensor_bytes(tensor))

    def _stop(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()

    def join(self) -> None:
        """Wait until everything queued is written; raise the thread's error if any."""
        self._stop()
        self._check()

    def close(self) -> list[WrittenFile]:
        self.join()
        return self.writer.close()

    def abort(self) -> None:
        if self._error is None:
            self._error = MaecError("writer aborted")
        self._stop()
        self.writer.abort()
