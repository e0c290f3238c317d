"""Read chosen rows of a stored tensor without reading the rest.

MAEC needs θ0 and θL (selection), and θA / θS (when scores come from elsewhere) only on
the key rows: about ``key_ratio`` of each tensor. A row of a C-ordered tensor is one
contiguous byte range, so consecutive key rows are read with one ``pread`` each and
the other 95 % of the bytes are never touched. Rows of a resident file
(:class:`~maec_core.io.resident.ResidentFiles`) are copied from memory instead.
"""

from __future__ import annotations

import math
import os
import threading
from typing import TYPE_CHECKING

import torch

from maec_core.errors import CorruptCheckpoint
from maec_core.io.headers import DTYPE_SIZES, TensorInfo
from maec_core.io.lowrank import with_delta
from maec_core.io.reader import TORCH_DTYPES

if TYPE_CHECKING:
    from maec_core.io.resident import ResidentFiles


class RowReader:
    """``pread``-based reads (no shared file position, so threads need no lock); the
    tensors of ``resident`` files are copied from memory."""

    def __init__(self, resident: ResidentFiles | None = None) -> None:
        self._fds: dict[str, int] = {}
        self._guard = threading.Lock()
        self._resident = resident

    def _fd(self, info: TensorInfo) -> int:
        key = str(info.file)
        with self._guard:
            if key not in self._fds:
                self._fds[key] = os.open(info.file, os.O_RDONLY)
            return self._fds[key]

    def _pread_into(self, fd: int, view: memoryview, offset: int, info: TensorInfo) -> None:
        done = 0
        while done < len(view):
            got = os.preadv(fd, [view[done:]], offset + done)
            if got <= 0:
                raise CorruptCheckpoint(
                    f"{info.file.name}: tensor {info.name!r} truncated", file=info.file.name,
                    tensor=info.name,
                )
            done += got

    def _fill(self, info: TensorInfo, raw: torch.Tensor, lo: int) -> None:
        """Bytes ``[lo, lo + len(raw))`` of ``info``'s stored tensor into the uint8 ``raw``."""
        if not raw.numel():
            return
        held = (self._resident.span(info, lo, lo + raw.numel())
                if self._resident is not None else None)
        if held is not None:
            raw.copy_(held)
        else:
            self._pread_into(self._fd(info), memoryview(raw.numpy().data).cast("B"),
                             info.start + lo, info)

    def read(self, info: TensorInfo) -> torch.Tensor:
        """The whole tensor, in its stored dtype, on CPU (plus its low-rank delta)."""
        stored = self._read_stored(info)
        return stored if info.delta is None else with_delta(info, stored, self._read_stored)

    def _read_stored(self, info: TensorInfo) -> torch.Tensor:
        buf = torch.empty(info.nbytes, dtype=torch.uint8)
        self._fill(info, buf, 0)
        return buf.view(TORCH_DTYPES[info.dtype]).reshape(info.shape)

    def read_row_range(self, info: TensorInfo, r0: int, r1: int, buf: torch.Tensor
                       ) -> torch.Tensor:
        """Rows ``[r0, r1)`` as ``(r1 - r0, width)``, read into the uint8 buffer ``buf``."""
        width = math.prod(info.shape[1:]) if len(info.shape) > 1 else 1
        row_bytes = width * DTYPE_SIZES[info.dtype]
        raw = buf[: (r1 - r0) * row_bytes]
        self._fill(info, raw, r0 * row_bytes)
        rows = raw.view(TORCH_DTYPES[info.dtype]).reshape(r1 - r0, width)
        # A low-rank delta only on the rows read: B's rows [r0, r1) times A.
        return with_delta(info, rows, self._read_stored, slice(r0, r1))

    def read_rows(self, info: TensorInfo, rows: torch.Tensor) -> torch.Tensor:
        """Rows ``rows`` (ascending int64) of the tensor viewed as ``(shape[0], -1)``."""
        width = math.prod(info.shape[1:]) if len(info.shape) > 1 else 1
        row_bytes = width * DTYPE_SIZES[info.dtype]
        idx = rows.tolist()
        buf = torch.empty(len(idx) * row_bytes, dtype=torch.uint8)
        # Key rows are mostly apart, so this is a read per row, thousands per tensor:
        # from a file, each is a pread into one view of the buffer (slicing a view costs
        # far less than slicing the tensor and viewing the slice).
        held = self._resident is not None and self._resident.span(info, 0, 0) is not None
        direct = None if held else (self._fd(info), memoryview(buf.numpy().data).cast("B"))
        i = 0
        while i < len(idx):
            # Coalesce a run of consecutive rows into one read.
            j = i + 1
            while j < len(idx) and idx[j] == idx[j - 1] + 1:
                j += 1
            if direct is not None:
                fd, view = direct
                self._pread_into(fd, view[i * row_bytes: j * row_bytes],
                                 info.start + idx[i] * row_bytes, info)
            else:
                self._fill(info, buf[i * row_bytes: j * row_bytes], idx[i] * row_bytes)
            i = j
        got = buf.view(TORCH_DTYPES[info.dtype]).reshape(len(idx), width)
        return with_delta(info, got, self._read_stored, rows)

    def close(self) -> None:
        with self._guard:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()

    def __enter__(self) -> RowReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
