"""Stream tensors into sharded safetensors files without buffering a shard in memory.

The plan knows every output tensor's name, shape and dtype before the first one is
computed, so each shard's header (with final offsets) is written first and tensor bytes
are appended as they are produced, hashed on the way. Memory: one tensor at a time.
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

import torch

from maec_core.errors import MaecError
from maec_core.io.headers import DTYPE_SIZES
from maec_core.io.reader import SAFETENSORS_NAMES

INDEX_NAME = "model.safetensors.index.json"


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

    def __init__(self, folder: Path, tensors: list[OutputTensor], shard_size: int) -> None:
        self.folder = folder
        groups = shard_layout(tensors, shard_size)
        n = len(groups)
        names = (
            ["model.safetensors"]
            if n == 1
            else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        )
        self._shards = [_Shard(name, g) for name, g in zip(names, groups, strict=True)]
        self._order = [(si, t) for si, s in enumerate(self._shards) for t in s.tensors]
        self._pos = 0
        self._current: BinaryIO | None = None
        self._current_index = -1
        self.files: list[WrittenFile] = []

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for _, t in self._order)

    def _open(self, si: int) -> BinaryIO:
        if self._current_index != si:
            self._finish_current()
            shard = self._shards[si]
            shard.header = _header(shard.tensors)
            f = open(self.folder / shard.file_name, "wb")  # noqa: SIM115 - closed in _finish_current
            f.write(shard.header)
            shard.sha.update(shard.header)
            shard.size = len(shard.header)
            self._current, self._current_index = f, si
        assert self._current is not None
        return self._current

    def _finish_current(self) -> None:
        if self._current is None:
            return
        self._current.close()
        shard = self._shards[self._current_index]
        self.files.append(WrittenFile(shard.file_name, shard.size, shard.sha.hexdigest()))
        self._current = None

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Append the next tensor; it must match the declared name, shape and dtype."""
        if self._pos >= len(self._order):
            raise MaecError(f"writer got an unexpected extra tensor {name!r}")
        si, spec = self._order[self._pos]
        got_dtype = SAFETENSORS_NAMES.get(tensor.dtype)
        if spec.name != name or tuple(tensor.shape) != spec.shape or got_dtype != spec.dtype:
            raise MaecError(
                f"writer expected {spec.name} {list(spec.shape)} {spec.dtype}, got "
                f"{name} {list(tensor.shape)} {got_dtype}"
            )
        f = self._open(si)
        # Flat bytes: len() of a 2-D memoryview would count rows, not bytes.
        data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().data
        f.write(data)
        shard = self._shards[si]
        shard.sha.update(data)
        shard.size += len(data)
        self._pos += 1

    def close(self) -> list[WrittenFile]:
        """Finish the last shard, write the index when sharded; return files written."""
        if self._pos != len(self._order):
            raise MaecError(f"writer closed after {self._pos} of {len(self._order)} tensors")
        self._finish_current()
        if len(self._shards) > 1:
            index = {
                "metadata": {"total_size": self.total_bytes},
                "weight_map": {t.name: s.file_name for s in self._shards for t in s.tensors},
            }
            raw = (json.dumps(index, indent=2, sort_keys=True) + "\n").encode()
            (self.folder / INDEX_NAME).write_bytes(raw)
            self.files.append(WrittenFile(INDEX_NAME, len(raw), hashlib.sha256(raw).hexdigest()))
        return self.files

    def abort(self) -> None:
        if self._current is not None:
            self._current.close()
            self._current = None
