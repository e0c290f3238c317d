"""Checkpoint sources: parse and allow-list them, and read their headers without weights.

A source is ``s3://bucket/prefix`` (in the configured store), an absolute local path
under one of the allow-listed roots, or ``hf://owner/name@<40-hex revision>`` when the hub
is enabled. Anything else is refused before a job is queued.

For S3, compatibility is checked from ``config.json``, the shard index and each
safetensors header fetched with ranged GETs: the header is written into a *sparse* file
of the object's full size, so ``maec_core``'s own header validation (bounds, overlaps,
pickles) runs unchanged while no tensor byte is transferred or stored.
"""

from __future__ import annotations

import re
import struct
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Literal

from app.settings import Settings
from app.storage.base import Storage, StorageError
from maec_core.errors import (
    CorpusError,
    CorruptCheckpoint,
    MaecError,
    SourceError,
    SourceNotFound,
)
from maec_core.io.folder import (
    INDEX_FILE,
    MAX_JSON_BYTES,
    PICKLE_SUFFIXES,
    TOKENIZER_FILES,
    ModelFolder,
    open_model_folder,
)
from maec_core.io.headers import MAX_HEADER_BYTES

Kind = Literal["s3", "local", "hf"]
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9]$")
_HF = re.compile(r"^hf://(?P<repo>[A-Za-z0-9][\w.\-]*/[\w.\-]+)(?:@(?P<rev>[^@]*))?$")
_REV = re.compile(r"^[0-9a-f]{40}$")
# Files a checkpoint folder may contribute (weights, configs, tokenizer); the rest of a
# prefix or repo is never fetched.
SMALL_FILES = ("config.json", INDEX_FILE, "generation_config.json", *TOKENIZER_FILES)


def is_checkpoint_file(name: str) -> bool:
    """Whether ``name`` (relative to a prefix or repo) is fetched: top-level weights and
    ``SMALL_FILES``; sub-folders are not part of a checkpoint."""
    return "/" not in name and (name.endswith(".safetensors") or name in SMALL_FILES)


@dataclass(frozen=True)
class Source:
    kind: Kind
    uri: str
    bucket: str = ""
    prefix: str = ""
    path: str = ""
    repo: str = ""
    revision: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if v}

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> Source:
        return cls(**doc)


def parse_source(text: str, settings: Settings) -> Source:
    """Parse and allow-list one source string (no I/O but resolving local symlinks)."""
    if not isinstance(text, str) or not text or len(text) > 1024 or "\x00" in text:
        raise SourceError("a source must be a non-empty string", source=str(text)[:100])
    if text.startswith("s3://"):
        bucket, _, prefix = text[5:].partition("/")
        prefix = prefix.strip("/")
        if not _BUCKET.match(bucket):
            raise SourceError(f"{text}: invalid bucket name", source=text)
        if not prefix or any(p in ("", ".", "..") for p in prefix.split("/")):
            raise SourceError(f"{text}: the prefix must be a plain path", source=text)
        return Source("s3", text, bucket=bucket, prefix=prefix)
    if text.startswith("hf://"):
        if not settings.hub_enabled:
            raise SourceError(
                f"{text}: hub sources are disabled on this service (MAEC_HUB_ENABLED)",
                source=text,
            )
        m = _HF.match(text)
        if m is None:
            raise SourceError(f"{text}: expected hf://owner/name@<revision>", source=text)
        rev = m.group("rev") or ""
        if not _REV.match(rev):
            raise SourceError(
                f"{text}: hub sources need a pinned 40-hex commit revision "
                "(hf://owner/name@<sha>); branches and tags can move",
                source=text,
            )
        return Source("hf", text, repo=m.group("repo"), revision=rev)
    if "://" in text:
        raise SourceError(f"{text}: only s3://, hf:// and local paths are accepted",
                          source=text)
    raw = Path(text)
    if not raw.is_absolute() or ".." in raw.parts:
        raise SourceError(f"{text}: local sources must be absolute paths without '..'",
                          source=text)
    resolved = raw.resolve()
    for root in settings.local_roots:
        if resolved == root or root in resolved.parents:
            return Source("local", text, path=str(resolved))
    raise SourceError(
        f"{text} is not under an allowed local root",
        source=text, allowed_roots=[str(r) for r in settings.local_roots],
    )


def sparse_header_copy(read_range: Callable[[int, int], bytes], size: int, dest: Path
                       ) -> None:
    """Write a ``size``-byte safetensors file's header into a sparse file of that size;
    ``read_range(first, last)`` reads those bytes (inclusive) of the remote file."""
    if size < 8:
        raise CorruptCheckpoint(f"{dest.name}: shorter than the 8-byte header length",
                                file=dest.name)
    (n,) = struct.unpack("<Q", read_range(0, 7))
    if n > MAX_HEADER_BYTES or 8 + n > size:
        raise CorruptCheckpoint(f"{dest.name}: header length {n} is impossible", file=dest.name)
    header = read_range(8, 8 + n - 1) if n else b""
    with open(dest, "wb") as f:
        f.write(struct.pack("<Q", n) + header)
        f.truncate(size)


def _s3_view(source: Source, storage: Storage, into: Path) -> Path:
    bucket = storage.for_bucket(source.bucket)
    objects = bucket.list(source.prefix + "/")
    if not objects:
        raise SourceNotFound(f"{source.uri}: no objects under this prefix", source=source.uri)
    folder = into / source.prefix.rsplit("/", 1)[-1]
    folder.mkdir(parents=True)
    for obj in objects:
        name = obj.key[len(source.prefix) + 1:]
        if "/" in name:
            continue  # sub-folders are not part of a checkpoint
        dest = folder / name
        if name.endswith(".safetensors"):
            sparse_header_copy(partial(bucket.get_range, obj.key), obj.size, dest)
        elif name.endswith(PICKLE_SUFFIXES):
            dest.touch()  # present, never read: lets open_model_folder refuse it by name
        elif name in SMALL_FILES and name.endswith(".json"):
            if obj.size > MAX_JSON_BYTES:
                raise CorruptCheckpoint(f"{name} is {obj.size} bytes, above the cap", file=name)
            dest.write_bytes(bucket.get_bytes(obj.key))
    return folder


def _relabel(exc: MaecError, tmp: Path, uri: str) -> MaecError:
    """Say ``uri`` instead of the temporary folder in an error raised on a header view."""
    exc.message = exc.message.replace(str(tmp), uri)
    exc.details = {
        k: (v.replace(str(tmp), uri) if isinstance(v, str) else v)
        for k, v in exc.details.items()
    }
    exc.details.setdefault("source", uri)
    exc.args = (exc.message,)
    return exc


def inspect_source(source: Source, storage: Storage) -> ModelFolder:
    """Open ``source`` as a checkpoint folder from its configs and headers only.

    For remote sources the returned folder's files are sparse stand-ins in a temporary
    directory that is gone on return: use it for planning, never for reading tensors.
    """
    if source.kind == "local":
        path = Path(source.path)
        if not path.is_dir():
            raise SourceNotFound(f"{source.uri}: no such checkpoint folder", source=source.uri)
        return open_model_folder(path)
    with tempfile.TemporaryDirectory(prefix="maec-headers-") as tmp:
        try:
            if source.kind == "s3":
                folder = _s3_view(source, storage, Path(tmp))
            else:
                from app.hub import hub_view

                folder = hub_view(source, Path(tmp))
            return open_model_folder(folder)
        except MaecError as exc:
            if isinstance(exc, StorageError):
                raise SourceError(f"{source.uri}: cannot read it: {exc.message}",
                                  source=source.uri) from None
            raise _relabel(exc, Path(tmp), source.uri) from None


def check_corpus(source: Source, storage: Storage, max_bytes: int | None = None) -> None:
    """An ability corpus is one file; check that it exists and is within ``max_bytes``
    (its content is the worker's)."""
    size: int
    if source.kind == "local":
        if not Path(source.path).is_file():
            raise SourceNotFound(f"{source.uri}: no such corpus file", source=source.uri)
        size = Path(source.path).stat().st_size
    elif source.kind == "s3":
        info = storage.for_bucket(source.bucket).head(source.prefix)
        if info is None:
            raise SourceNotFound(f"{source.uri}: no such object", source=source.uri)
        size = info.size
    else:
        raise SourceError(f"{source.uri}: a corpus must be an s3:// object or a local file",
                          source=source.uri)
    if max_bytes is not None and size > max_bytes:
        raise CorpusError(
            f"{source.uri}: the corpus is {size} bytes, above this service's "
            f"{max_bytes} byte cap (MAEC_MAX_CORPUS_BYTES)",
            source=source.uri, size=size, limit=max_bytes,
        )
