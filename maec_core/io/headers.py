"""Read and validate safetensors headers without torch and without touching tensor data.

A safetensors file is ``u64 little-endian N`` + ``N`` bytes of JSON + a data buffer. The
header is untrusted input: we bound its size, parse it defensively and check that every
tensor's byte range lies inside the buffer, matches its shape and dtype, and does not
overlap another, before anyone reads a byte of data.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from maec_core.errors import CorruptCheckpoint

# The safetensors reference implementation caps headers at 100 MB; a real 8B model's
# header is well under 1 MB, so anything near the cap is hostile or broken.
MAX_HEADER_BYTES = 100_000_000

DTYPE_SIZES: dict[str, int] = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4,
    "I64": 8, "U64": 8, "F64": 8,
}
# Dtypes the engine merges. Everything else (int8/fp8 quantized weights) is refused.
FLOAT_DTYPES = frozenset({"F16", "BF16", "F32"})


@dataclass(frozen=True)
class LowRankDelta:
    """A low-rank addition ``scale * B @ A`` (transposed when ``transpose``) held in other
    tensors: how a LoRA adapter changes one base tensor (see ``maec_core.lora``)."""

    a: TensorInfo  # (r, in)
    b: TensorInfo  # (out, r)
    scale: float
    transpose: bool = False  # the base stores (in, out) (GPT-2's Conv1D, fan_in_fan_out)


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives: absolute byte range ``[start, end)`` in ``file``.

    With ``delta``, the tensor is the stored one plus that low-rank product: readers
    form it while reading (``maec_core.io.lowrank``), so an adapter on a base reads like
    a full checkpoint without one being written.
    """

    name: str
    file: Path
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int
    delta: LowRankDelta | None = None

    @property
    def nbytes(self) -> int:
        return self.end - self.start

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class SafetensorsHeader:
    file: Path
    size: int
    data_start: int
    tensors: dict[str, TensorInfo]
    metadata: dict[str, str]


def _bad(path: Path, why: str, **details: object) -> CorruptCheckpoint:
    return CorruptCheckpoint(f"{path.name}: {why}", file=path.name, **details)


def read_header(path: Path) -> SafetensorsHeader:
    """Parse and fully validate the header of one safetensors file."""
    size, data_start, raw = _read_raw_header(path)
    doc = _parse_json(path, raw)
    data_len = size - data_start
    metadata = _metadata(path, doc.pop("__metadata__", None) or {})
    tensors = {
        name: _tensor_info(path, name, entry, data_start, data_len)
        for name, entry in doc.items()
    }
    _check_coverage(path, tensors.values(), data_start, data_len)
    return SafetensorsHeader(path, size, data_start, tensors, metadata)


def _read_raw_header(path: Path) -> tuple[int, int, bytes]:
    """File size, where the data buffer starts, and the header's JSON bytes; the declared
    header length is bounded before anything is read."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise _bad(path, "file is shorter than the 8-byte header length")
            (n,) = struct.unpack("<Q", prefix)
            if n > MAX_HEADER_BYTES:
                raise _bad(path, f"header length {n} exceeds the {MAX_HEADER_BYTES} byte cap")
            if 8 + n > size:
                raise _bad(path, f"header length {n} runs past the end of the file ({size} bytes)")
            return size, 8 + n, f.read(n)
    except OSError as exc:
        raise _bad(path, f"cannot read: {exc.strerror}") from None


def _parse_json(path: Path, raw: bytes) -> dict[str, object]:
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError):
        # ValueError, not just JSONDecodeError: an integer literal longer than Python's
        # int_max_str_digits (e.g. a 5000-digit shape) raises a plain ValueError.
        raise _bad(path, "header is not valid JSON") from None
    if not isinstance(doc, dict):
        raise _bad(path, "header is not a JSON object")
    return doc


def _metadata(path: Path, raw: object) -> dict[str, str]:
    if not isinstance(raw, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in raw.items()
    ):
        raise _bad(path, "__metadata__ must map strings to strings")
    return dict(raw)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _tensor_info(path: Path, name: str, entry: object, data_start: int,
                 data_len: int) -> TensorInfo:
    """One tensor's entry, checked: known dtype, a valid shape, offsets inside the data
    buffer spanning exactly shape x dtype bytes."""
    if not isinstance(entry, dict):
        raise _bad(path, f"entry for {name!r} is not an object", tensor=name)
    dtype = entry.get("dtype")
    shape = entry.get("shape")
    offsets = entry.get("data_offsets")
    if dtype not in DTYPE_SIZES:
        raise _bad(path, f"tensor {name!r} has unknown dtype {dtype!r}", tensor=name)
    if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
        raise _bad(path, f"tensor {name!r} has an invalid shape", tensor=name)
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(
        _is_int(o) for o in offsets
    ):
        raise _bad(path, f"tensor {name!r} has invalid data_offsets", tensor=name)
    begin, end = offsets
    if not 0 <= begin <= end <= data_len:
        raise _bad(
            path,
            f"tensor {name!r} claims bytes [{begin}, {end}) outside the "
            f"{data_len}-byte data buffer",
            tensor=name,
        )
    expected = math.prod(shape) * DTYPE_SIZES[dtype]
    if end - begin != expected:
        raise _bad(
            path,
            f"tensor {name!r}: {end - begin} bytes for shape {shape} {dtype} "
            f"(expected {expected})",
            tensor=name,
        )
    return TensorInfo(name, path, dtype, tuple(shape), data_start + begin, data_start + end)


def _check_coverage(path: Path, tensors: Iterable[TensorInfo], data_start: int,
                    data_len: int) -> None:
    """Tensors may not overlap and must cover the data buffer exactly."""
    cursor = 0
    for info in sorted(tensors, key=lambda t: (t.start, t.end, t.name)):
        begin, end = info.start - data_start, info.end - data_start
        if begin < cursor:
            raise _bad(path, f"tensor {info.name!r} overlaps the previous tensor",
                       tensor=info.name)
        cursor = end
    if cursor != data_len:
        raise _bad(
            path,
            f"data buffer is {data_len} bytes but tensors cover {cursor} "
            "(truncated or padded file)",
        )
