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
            raw = f.read(n)
    except OSError as exc:
        raise _bad(path, f"cannot read: {exc.strerror}") from None
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError):
        # ValueError, not just JSONDecodeError: an integer literal longer than Python's
        # int_max_str_digits (e.g. a 5000-digit shape) raises a plain ValueError.
        raise _bad(path, "header is not valid JSON") from None
    if not isinstance(doc, dict):
        raise _bad(path, "header is not a JSON object")

    data_start = 8 + n
    data_len = size - data_start
    metadata_raw = doc.pop("__metadata__", None) or {}
    if not isinstance(metadata_raw, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata_raw.items()
    ):
        raise _bad(path, "__metadata__ must map strings to strings")

    tensors: dict[str, TensorInfo] = {}
    spans: list[tuple[int, int, str]] = []
    for name, entry in doc.items():
        if not isinstance(entry, dict):
            raise _bad(path, f"entry for {name!r} is not an object", tensor=name)
        dtype = entry.get("dtype")
        shape = entry.get("shape")
        offsets = entry.get("data_offsets")
        if dtype not in DTYPE_SIZES:
            raise _bad(path, f"tensor {name!r} has unknown dtype {dtype!r}", tensor=name)
        if not isinstance(shape, list) or not all(
            isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
        ):
            raise _bad(path, f"tensor {name!r} has an invalid shape", tensor=name)
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
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
        spans.append((begin, end, name))
        tensors[name] = TensorInfo(
            name, path, dtype, tuple(shape), data_start + begin, data_start + end
        )

    spans.sort()
    cursor = 0
    for begin, end, name in spans:
        if begin < cursor:
            raise _bad(path, f"tensor {name!r} overlaps the previous tensor", tensor=name)
        cursor = end
    if cursor != data_len:
        raise _bad(
            path,
            f"data buffer is {data_len} bytes but tensors cover {cursor} "
            "(truncated or padded file)",
        )
    return SafetensorsHeader(path, size, data_start, tensors, dict(metadata_raw))
