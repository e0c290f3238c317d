"""A GGUF file's header, read without its tensors (numpy only: the API uses it).

``gguf``'s reader maps the whole file and makes a view of every tensor; here the same
parser stops after the tensor infos, so a header prefix (the first bytes of a remote
file, fetched with a ranged read) is enough, and a truncated file is caught by
comparing where its tensors end with its size instead of by a failed read later.

What transformers can load is decided from the header: the architecture must be one its
GGUF loader maps (``ARCHITECTURES``; a test keeps the list equal to transformers') and
every tensor type one ``gguf``'s numpy dequantizers implement (the loader dequantizes
with them).
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, LlamaFileType, quants
from gguf.gguf_reader import ReaderField

from maec_core.errors import InvalidGguf, UnsupportedGguf
from maec_core.gguf.names import LOSSY_WARNING, find_gguf, is_gguf_name

__all__ = ["ARCHITECTURES", "GGUF_MAGIC", "LOSSY_WARNING", "GgufHeader", "check_readable",
           "find_gguf", "is_gguf_name", "read_header", "readable_types"]

GGUF_MAGIC = b"GGUF"
# The architectures transformers 5's GGUF loader maps to a model class
# (transformers.integrations.ggml's config mapping, less its "general" and "tokenizer"
# sections). Written out because the API process must not import transformers;
# tests/core/test_gguf.py fails when transformers' list and this one part.
ARCHITECTURES = frozenset({
    "llama", "mistral", "qwen2", "qwen2_moe", "gpt_oss", "lfm2", "qwen3", "qwen3_moe",
    "falcon", "phi3", "bloom", "t5", "stablelm", "gpt2", "starcoder2", "mamba",
    "nemotron", "gemma2", "gemma3", "gemma4", "umt5", "deci", "minimax_m2",
})
# A header above this is refused rather than read (a lying length cannot make the API
# read or allocate without bound); real headers with a 256k-token vocabulary are ~10 MB.
MAX_HEADER_BYTES = 64 << 20


def readable_types() -> frozenset[GGMLQuantizationType]:
    """The tensor types ``gguf``'s numpy code dequantizes (what transformers' loader can
    read): the float types and every quantization with a dequantizer."""
    out = {GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.F64,
           GGMLQuantizationType.BF16}
    base = quants.__Quant.dequantize_blocks if hasattr(quants, "__Quant") else None
    for qtype, cls in quants._type_traits.items():
        own = cls.__dict__.get("dequantize_blocks")
        if own is not None and own is not base:
            out.add(qtype)
    return frozenset(out)


@dataclass(frozen=True)
class GgufHeader:
    """What a GGUF file says about itself before its tensors."""

    architecture: str
    name: str
    tensor_types: dict[str, int]  # ggml type name -> number of tensors
    file_type: str  # general.file_type's name ("MOSTLY_Q4_1"), "" when absent
    parameters: int
    data_end: int  # where the last tensor's data ends: the file's least size
    header_bytes: int

    @property
    def quantization(self) -> str:
        """The file's quantization as people name it: its ``general.file_type`` (less
        ``MOSTLY_``), else its most common tensor type."""
        if self.file_type:
            return self.file_type.removeprefix("MOSTLY_")
        return max(self.tensor_types, key=lambda t: self.tensor_types[t])

    def to_dict(self) -> dict[str, Any]:
        return {"architecture": self.architecture, "quantization": self.quantization,
                "tensor_types": dict(self.tensor_types), "parameters": self.parameters}


class _HeaderReader(GGUFReader):
    """gguf's parser up to the tensor infos: no view of any tensor's data is made."""

    def _build_tensors(self, start_offs: int, fields: list[ReaderField]) -> None:
        self.infos: list[tuple[str, int, int, int]] = []  # name, type, elements, end
        for field in fields:
            _len, name, _ndims, dims, raw_type, offset = field.parts
            qtype = int(raw_type[0])
            elements = int(np.prod(dims.astype(np.uint64)))
            try:
                block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(qtype)]
            except (ValueError, KeyError):
                block, type_size = 1, 0  # an unknown type: refused by the caller
            end = int(start_offs) + int(offset[0]) + elements * type_size // block
            self.infos.append((bytes(name).decode("utf-8", "replace"), qtype, elements, end))


def _parse(path: Path) -> _HeaderReader:
    with open(path, "rb") as f:
        if f.read(4) != GGUF_MAGIC:
            raise InvalidGguf(f"{path.name} is not a GGUF file (no GGUF magic)", file=path.name)
    try:
        return _HeaderReader(path)
    except InvalidGguf:
        raise
    except (ValueError, IndexError, TypeError, OverflowError, UnicodeDecodeError) as exc:
        raise InvalidGguf(f"{path.name}: its GGUF header cannot be read ({exc})",
                          file=path.name) from None


def _string(reader: GGUFReader, key: str) -> str:
    field = reader.get_field(key)
    if field is None:
        return ""
    value = field.contents()
    return value if isinstance(value, str) else ""


def _file_type(reader: GGUFReader) -> str:
    field = reader.get_field("general.file_type")
    if field is None:
        return ""
    try:
        return LlamaFileType(int(field.contents())).name
    except (ValueError, TypeError):
        return ""


def read_header(path: Path, size: int | None = None) -> GgufHeader:
    """The header of the GGUF file at ``path``, which holds at least its header (the
    whole file, or a prefix of a remote one). ``size``: the whole file's size (default:
    ``path``'s), checked against where the tensors end.

    ``InvalidGguf`` for a file that is not GGUF, a header that cannot be parsed, or
    tensors that end past ``size`` (truncated)."""
    size = os.path.getsize(path) if size is None else size
    reader = _parse(path)
    types: Counter[str] = Counter()
    for _name, qtype, _n, _end in reader.infos:
        try:
            types[GGMLQuantizationType(qtype).name] += 1
        except ValueError:
            types[f"type_{qtype}"] += 1
    data_end = max((end for *_, end in reader.infos), default=reader.data_offset)
    if data_end > size:
        raise InvalidGguf(f"{path.name} is truncated: its tensors end at byte {data_end}, "
                          f"the file has {size}", file=path.name, size=size,
                          needed=data_end)
    return GgufHeader(
        architecture=_string(reader, "general.architecture"),
        name=_string(reader, "general.name"), tensor_types=dict(types),
        file_type=_file_type(reader), parameters=sum(n for _, _, n, _ in reader.infos),
        data_end=data_end, header_bytes=int(reader.data_offset))


def check_readable(header: GgufHeader, where: str) -> None:
    """``UnsupportedGguf`` unless transformers' GGUF loader can dequantize ``header``'s
    file: its architecture mapped, every tensor type readable."""
    if header.architecture not in ARCHITECTURES:
        raise UnsupportedGguf(
            f"{where}: GGUF architecture {header.architecture or '(none)'!r} cannot be "
            "dequantized (transformers' GGUF loader reads: "
            f"{', '.join(sorted(ARCHITECTURES))})", source=where,
            architecture=header.architecture)
    readable = {t.name for t in readable_types()}
    bad = sorted(t for t in header.tensor_types if t not in readable)
    if bad:
        raise UnsupportedGguf(
            f"{where}: GGUF tensor type(s) {', '.join(bad)} cannot be dequantized",
            source=where, types=bad)
