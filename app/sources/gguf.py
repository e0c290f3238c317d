"""GGUF sources: a ``.gguf`` file (local path, ``s3://`` object, ``job:<id>/<file>``), or a
local folder without a config.json holding one, is a checkpoint the worker dequantizes.

At submission only the header is read (``maec_core.gguf.header``, numpy only): the whole
of a local file's header, the first bytes of a remote one by ranged reads (a window that
doubles until the header parses, capped). An architecture or tensor type transformers
cannot dequantize is refused there with ``unsupported_gguf``; a truncated or malformed
file with ``invalid_gguf``. The source is pinned to its one file, which the worker
fetches through its input cache like any other.

A GGUF file on the hub is named by a file reference pinned to a commit
(``hf://owner/name@<sha>/<path>.gguf``, ``app.sources.hf``): its header is read by ranged
GETs at that commit, its file fetched and checked against the listing's digest.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

from app.sources.base import Source, SourceFile, SourceKind
from app.sources.hf import read_hub_range
from app.storage.base import Storage, StorageError
from maec_core.service import (
    GGUF_MAX_HEADER_BYTES as MAX_HEADER_BYTES,
)
from maec_core.service import (
    GgufHeader,
    InvalidGguf,
    SourceError,
    SourceNotFound,
    check_readable,
    find_gguf,
    is_gguf_name,
    read_header,
)

__all__ = ["GgufSource", "check_gguf_source", "gguf_candidate", "is_pinned_gguf"]

_FIRST_WINDOW = 1 << 20


@dataclass(frozen=True)
class GgufSource:
    """A GGUF source pinned to its file, and what its header says."""

    source: Source
    file: SourceFile
    header: GgufHeader


def is_pinned_gguf(source: Source) -> bool:
    """Whether a pinned source (a job record's) is one GGUF file."""
    return len(source.files) == 1 and is_gguf_name(source.files[0].name)


def gguf_candidate(source: Source) -> Source | None:
    """``source`` narrowed to its GGUF file when it names one (None: not GGUF). A local
    folder is GGUF when it has no config.json and holds a ``.gguf`` file (two are refused
    as ambiguous)."""
    name = (source.path or source.prefix or source.uri).rstrip("/")
    if is_gguf_name(name):
        if source.kind == "hf" and not source.path:
            raise SourceError(f"{source.uri}: a hub source names a repository; name a "
                              "GGUF file in it as hf://owner/name@<sha>/<file>.gguf",
                              source=source.uri)
        return source
    if source.kind != "local":
        return None
    folder = Path(source.path)
    if not folder.is_dir() or (folder / "config.json").exists():
        return None
    found = find_gguf(os.listdir(folder))
    return None if found is None else replace(source, path=str(folder / found))


def _read_prefix(source: Source, storage: Storage, file: SourceFile, n: int) -> bytes:
    if source.kind == "local":
        with open(file.location, "rb") as f:  # its identity was pinned: the worker rechecks
            return f.read(n)
    if source.kind == "hf":
        return read_hub_range(source, file, 0, n - 1)
    bucket = storage.for_bucket(source.bucket) if source.kind == "s3" else storage
    return bucket.get_range(file.location, 0, n - 1)


def _header(source: Source, storage: Storage, file: SourceFile) -> GgufHeader:
    """The file's header from as few leading bytes as parse."""
    window = min(_FIRST_WINDOW, file.size)
    with tempfile.TemporaryDirectory(prefix="maec-gguf-") as tmp:
        path = Path(tmp) / file.name
        while True:
            try:
                path.write_bytes(_read_prefix(source, storage, file, window))
            except (OSError, StorageError) as exc:
                raise SourceError(f"{source.uri}: cannot read it ({exc})",
                                  source=source.uri) from None
            try:
                return read_header(path, size=file.size)
            except InvalidGguf as exc:
                if window >= min(file.size, MAX_HEADER_BYTES) or "truncated" in exc.message:
                    exc.details.setdefault("source", source.uri)
                    raise
                window = min(window * 4, file.size, MAX_HEADER_BYTES)


def check_gguf_source(reader: SourceKind) -> GgufSource:
    """``reader``'s source (from :func:`gguf_candidate`) pinned to its file, its header
    checked: ``invalid_gguf`` or ``unsupported_gguf`` before anything is queued."""
    source = reader.source
    try:
        pinned = reader.pin(single=True)
    except SourceNotFound:
        raise SourceNotFound(f"{source.uri}: no such GGUF file", source=source.uri) from None
    file = pinned.files[0]
    header = _header(pinned, reader.storage, file)
    check_readable(header, source.uri)
    return GgufSource(pinned, file, header)
