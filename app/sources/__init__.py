"""Checkpoint sources: parse and allow-list them, read their headers without weights, and
list and fetch their files for the worker's cache.

A source is ``s3://bucket/prefix`` (in the configured store, ``app.sources.s3``), an
absolute local path under one of the allow-listed roots (``app.sources.local``),
``hf://owner/name@<40-hex revision>`` when the hub is enabled (``app.sources.hf``), or
``job:<id>[/<path>]``, the outputs of one of the caller's own succeeded jobs
(``app.sources.job``). Anything else is refused before a job is queued, and so is any
source naming the service's own storage (``app.sources.guard``, applied here to every
parsed source). Each kind implements ``app.sources.base.SourceKind`` in its own module;
this module is the one place that picks the kind, from a URI's scheme or a parsed
``Source``'s kind.
"""

from __future__ import annotations

from collections.abc import Mapping

from app.settings import Settings
from app.sources.base import Source, SourceFile, SourceKind
from app.sources.gguf import GgufSource, check_gguf_source, gguf_candidate, is_pinned_gguf
from app.sources.guard import SourceForbidden, check_not_service_storage
from app.sources.hf import HubSource
from app.sources.job import JobSource, Published, published, referenced_job
from app.sources.local import LocalSource
from app.sources.s3 import S3Source
from app.storage.base import Storage
from maec_core.service import CorpusError, ModelFolder, SourceError

__all__ = [
    "GgufSource",
    "Published",
    "Source",
    "SourceFile",
    "SourceForbidden",
    "SourceKind",
    "check_corpus",
    "check_gguf",
    "check_not_service_storage",
    "gguf_candidate",
    "inspect_source",
    "is_pinned_gguf",
    "open_source",
    "parse_source",
    "pin_source",
    "published",
    "referenced_job",
]

_KINDS: tuple[type[SourceKind], ...] = (S3Source, HubSource, LocalSource, JobSource)
_BY_SCHEME = {k.scheme: k for k in _KINDS if k.scheme}
_BY_KIND = {k.kind: k for k in _KINDS}


def parse_source(text: str, settings: Settings,
                 outputs: Mapping[str, Published] | None = None) -> Source:
    """Parse and allow-list one source string (no I/O but resolving local symlinks).

    ``outputs``: the caller's succeeded jobs by id (:func:`published`), which ``job:``
    sources resolve against; a job not among them is ``source_not_found``. Any source
    naming the service's own storage is ``source_forbidden``."""
    if not isinstance(text, str) or not text or len(text) > 1024 or "\x00" in text:
        raise SourceError("a source must be a non-empty string", source=str(text)[:100])
    if text.startswith("job:"):
        # The one way into the service's storage: the caller's own jobs only.
        source = JobSource.resolve(JobSource.parse(text, settings), outputs or {})
    else:
        scheme, sep, _ = text.partition("://")
        kind = LocalSource if not sep else _BY_SCHEME.get(scheme)
        if kind is None:
            raise SourceError(f"{text}: only s3://, hf://, job: and local paths are "
                              "accepted", source=text)
        source = kind.parse(text, settings)
    return check_not_service_storage(source, settings)


def open_source(source: Source, storage: Storage) -> SourceKind:
    """The reader for a parsed ``source`` (``storage``: the store ``s3://`` URIs name)."""
    return _BY_KIND[source.kind](source, storage)


def inspect_source(source: Source, storage: Storage, tokenizer: bool = False,
                   base: ModelFolder | None = None) -> ModelFolder:
    """Open ``source`` as a checkpoint folder from its configs and headers only; a LoRA
    adapter folder as the checkpoint it makes of ``base`` (the recipe's base, inspected
    first), its shapes checked against the base's headers.

    For remote sources the returned folder's files are sparse stand-ins in a temporary
    directory that is gone on return: use it for planning, never for reading tensors.
    """
    return open_source(source, storage).headers(tokenizer, base)


def pin_source(source: Source, storage: Storage, *, single: bool = False) -> Source:
    """``source`` with the identity of each of its files now, as a job record keeps it:
    the worker fetches those files or fails with ``source_changed``."""
    return open_source(source, storage).pin(single=single)


def check_corpus(source: Source, storage: Storage, max_bytes: int | None = None) -> Source:
    """An ability corpus is one file; check that it exists and is within ``max_bytes``
    (its content is the worker's). Returns the source pinned to that file."""
    pinned = pin_source(source, storage, single=True)
    size = (pinned.files[0] if pinned.files
            else open_source(source, storage).corpus_file()).size
    if max_bytes is not None and size > max_bytes:
        raise CorpusError(
            f"{source.uri}: the corpus is {size} bytes, above this service's "
            f"{max_bytes} byte cap (MAEC_MAX_CORPUS_BYTES)",
            source=source.uri, size=size, limit=max_bytes,
        )
    return pinned


def check_gguf(source: Source, storage: Storage) -> GgufSource | None:
    """A GGUF ``source`` pinned to its one file with its header checked (None: ``source``
    is not GGUF; ``app.sources.gguf``)."""
    candidate = gguf_candidate(source)
    if candidate is None:
        return None
    return check_gguf_source(open_source(candidate, storage))
