"""What every source kind shares: the parsed ``Source``, the ``SourceKind`` interface each
kind implements in its own module, and the pieces two kinds would otherwise each write
(the checkpoint-file predicate, sparse header copies, capped whole side files, header
views in a temporary folder, verified downloads).

A file's ``content_key`` names its bytes and says how they are checked while they
stream: ``sha256:<hex>`` (hub LFS files, S3 objects stored with a whole-object SHA-256)
and ``git-blob:<hex>`` (small hub files) are digests of the content, so the same bytes
from any repo, bucket or kind have one key; any other key (S3 objects without a SHA-256,
local files) is scoped to the store, the object and its version, and only the size is
checked.
"""

from __future__ import annotations

import hashlib
import struct
import tempfile
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, ClassVar, Literal

from app.settings import Settings
from app.storage.base import Storage, StorageError
from maec_core.service import (
    ADAPTER_CONFIG,
    INDEX_FILE,
    MAX_HEADER_BYTES,
    TOKENIZER_FILES,
    CorruptCheckpoint,
    MaecError,
    ModelFolder,
    SourceError,
    keep_tokenizer,
    open_model_folder,
)

Kind = Literal["s3", "local", "hf", "job"]
# Files a checkpoint folder may contribute (weights, configs, tokenizer; a LoRA adapter
# folder: its config beside adapter_model.safetensors); the rest of a prefix or repo is
# never fetched.
SMALL_FILES = ("config.json", INDEX_FILE, ADAPTER_CONFIG, "generation_config.json",
               *TOKENIZER_FILES)


def is_checkpoint_file(name: str) -> bool:
    """Whether ``name`` (relative to a prefix or repo) is fetched: top-level weights and
    ``SMALL_FILES``; sub-folders are not part of a checkpoint."""
    return "/" not in name and (name.endswith(".safetensors") or name in SMALL_FILES)


@dataclass(frozen=True)
class SourceFile:
    """One file a source contributes, as its store lists it."""

    name: str  # its name in the job's input folder
    size: int
    content_key: str  # names these bytes (see the module docstring)
    location: str  # where the store keeps it: object key, path in the repo, local path
    # The store's identity of this version, re-checked when fetching: the S3 ETag, a
    # local file's device, inode, size and mtime.
    version: str = ""


@dataclass(frozen=True)
class Source:
    """One parsed, allow-listed source; ``to_dict`` is what a job record stores.

    ``files`` is empty until ``SourceKind.pin`` records what the source held when it was
    checked; the worker then fetches exactly those files, each refused with
    ``source_changed`` if it is no longer the same.
    """

    kind: Kind
    uri: str
    bucket: str = ""
    prefix: str = ""
    path: str = ""
    root: str = ""  # the allow-listed root a local path was found under
    repo: str = ""
    revision: str = ""
    job: str = ""  # the job a job: source names
    files: tuple[SourceFile, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        doc = {k: v for k, v in self.__dict__.items() if v and k != "files"}
        if self.files:
            doc["files"] = [dict(f.__dict__) for f in self.files]
        return doc

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> Source:
        files = tuple(SourceFile(**f) for f in doc.get("files", ()))
        return cls(**{**doc, "files": files})


class SourceKind(ABC):
    """One kind of source: how its URIs parse, and how it is read.

    An instance serves one parsed ``Source``; the API uses ``headers``, ``corpus_file``
    (sizes only) and ``pin``, the worker ``files`` and ``fetch`` (through its
    content-keyed cache). A one-file source (an ability corpus, and any other input that
    is one file) is ``single``: its file is ``corpus_file``.
    """

    kind: ClassVar[Kind]
    scheme: ClassVar[str]  # "s3", "hf"; "" for local paths and job: references

    def __init__(self, source: Source, storage: Storage) -> None:
        self.source = source
        self.storage = storage

    @classmethod
    @abstractmethod
    def parse(cls, text: str, settings: Settings) -> Source:
        """Parse and allow-list ``text`` (its scheme is this kind's); no I/O but
        resolving local symlinks."""

    @abstractmethod
    def headers(self, tokenizer: bool = False, base: ModelFolder | None = None
                ) -> ModelFolder:
        """The checkpoint folder from its configs and headers only. For remote kinds its
        files are sparse stand-ins in a folder gone on return: plan with it, never read
        tensors from it. ``tokenizer``: its tokenizer files are read too (kept in the
        folder object), for a recipe that merges vocabularies. A LoRA adapter folder
        applies to ``base`` (the recipe's base, already opened); without one it is
        refused (the base its config names is never followed)."""

    @abstractmethod
    def checkpoint_files(self) -> list[SourceFile]:
        """The files of the checkpoint folder (``is_checkpoint_file``), with identities."""

    @abstractmethod
    def corpus_file(self) -> SourceFile:
        """The one file an ability corpus is (its size is checked at submission)."""

    def pin(self, *, single: bool = False) -> Source:
        """The source with the identity of every file it holds now (at submission), so
        the worker fetches those very files or fails with ``source_changed``."""
        files = [self.corpus_file()] if single else self.checkpoint_files()
        return replace(self.source, files=tuple(files))

    def files(self, *, single: bool = False) -> list[SourceFile]:
        """What the worker fetches: the files pinned at submission (a record written
        before pinning existed: as listed now)."""
        if self.source.files:
            return list(self.source.files)
        return [self.corpus_file()] if single else self.checkpoint_files()

    def check_unchanged(self, files: Iterable[SourceFile]) -> None:
        """``SourceChanged`` if any of ``files`` is no longer the version listed (pinned),
        even where the cache already holds those bytes: a job never runs on a source that
        changed after it was submitted. (Kinds whose files cannot change: nothing.)"""
        return None

    def ranged_for(self, files: Iterable[SourceFile]) -> bool:
        """Whether ``files`` can be fetched in part (:meth:`read_range`) with every
        weight file's sha256 known without fetching it whole (:meth:`digest`), as a part
        of a split merge or a resumed attempt needs (its manifest names the inputs'
        digests). Kinds that fetch whole files only: never."""
        return False

    def read_range(self, file: SourceFile, start: int, end: int) -> Iterator[bytes]:
        """Bytes ``[start, end)`` of ``file`` as pinned (a changed file is
        ``SourceChanged``), as chunks. Only where :meth:`ranged_for` says so."""
        raise NotImplementedError(f"{self.kind} sources are fetched whole")

    def digest(self, file: SourceFile) -> str:
        """The sha256 (hex) of the whole of ``file`` as pinned, without the worker's copy
        being whole: the digest its content key names."""
        algo, _, value = file.content_key.partition(":")
        if algo != "sha256":
            raise StorageError(f"{self.source.uri}: no sha256 of {file.name} is known "
                               "without reading it whole", source=self.source.uri)
        return value

    @abstractmethod
    def fetch(self, file: SourceFile, dest: Path) -> None:
        """Write the whole of ``file`` to ``dest``, checked while it streams (size, and
        the digest its ``content_key`` names); a wrong transfer is a ``StorageError``,
        a file that is no longer the version listed (pinned) a ``SourceChanged``."""

    def remote_view(self, build: Callable[[Path], Path], tokenizer: bool = False,
                    base: ModelFolder | None = None) -> ModelFolder:
        """``open_model_folder`` on the folder ``build(tmp)`` makes of sparse stand-ins
        (an adapter on ``base``), errors naming the source rather than the temporary
        folder; ``tokenizer``: the tokenizer files (written whole by ``build``) are kept
        in the returned folder."""
        uri = self.source.uri
        with tempfile.TemporaryDirectory(prefix="maec-headers-") as tmp:
            try:
                folder = open_model_folder(build(Path(tmp)), base=base)
                if tokenizer:
                    keep_tokenizer(folder)
                return folder
            except MaecError as exc:
                if isinstance(exc, StorageError):
                    raise SourceError(f"{uri}: cannot read it: {exc.message}",
                                      source=uri) from None
                raise _relabel(exc, Path(tmp), uri) from None


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


def write_whole(dest: Path, size: int, cap: int, read: Callable[[], bytes]) -> None:
    """``dest``: the whole of a small side file of ``size`` bytes (as listed), refused as
    corrupt above ``cap`` bytes before any of it is read."""
    if size > cap:
        raise CorruptCheckpoint(f"{dest.name} is {size} bytes, above the cap",
                                file=dest.name)
    dest.write_bytes(read())


@dataclass
class _Digest:
    hasher: Any  # a hashlib object
    want: str  # hex
    what: str  # how an error names it


def _digest_for(file: SourceFile) -> _Digest | None:
    """What ``file.content_key`` promises about the bytes, if it is a digest."""
    algo, _, value = file.content_key.partition(":")
    if algo == "sha256":
        return _Digest(hashlib.sha256(), value, "sha256")
    if algo == "git-blob":
        # Git names a blob by the sha1 of "blob <size>\0" + its bytes.
        sha1 = hashlib.sha1(b"blob %d\x00" % file.size, usedforsecurity=False)
        return _Digest(sha1, value, "git blob id")
    return None


def write_verified(chunks: Iterable[bytes], dest: Path, file: SourceFile, *, uri: str,
                   sender: str, where: str) -> None:
    """Write ``chunks`` (the body of a download of ``file``) to ``dest``, checking the
    size and the digest its content key names; ``sender`` and ``where`` word the error
    ("the hub" ... "at this commit")."""
    digest = _digest_for(file)
    got = 0
    with open(dest, "wb") as out:
        for chunk in chunks:
            got += len(chunk)
            if got > file.size:
                break  # no point reading (or storing) more of a wrong file
            if digest is not None:
                digest.hasher.update(chunk)
            out.write(chunk)
    _check_download(got, digest, file, uri=uri, sender=sender, where=where)


def download_verified(download: Callable[[Callable[[bytes], None]], int], file: SourceFile,
                      *, uri: str, sender: str, where: str) -> None:
    """Like :func:`write_verified`, for a download that writes the file itself (S3's
    parallel ranged GETs): ``download(sink)`` hands every byte to ``sink`` in file order
    and returns how many it wrote; the digest is computed as they arrive."""
    digest = _digest_for(file)
    got = download((lambda _: None) if digest is None else digest.hasher.update)
    _check_download(got, digest, file, uri=uri, sender=sender, where=where)


def _check_download(got: int, digest: _Digest | None, file: SourceFile, *, uri: str,
                    sender: str, where: str) -> None:
    if got != file.size:
        sent = f"more than {file.size}" if got > file.size else str(got)
        raise StorageError(f"{uri}: {sender} sent {sent} bytes of {file.name}, which is "
                           f"{file.size} bytes {where}", source=uri, file=file.name)
    if digest is not None and digest.hasher.hexdigest() != digest.want:
        raise StorageError(f"{uri}: the bytes {sender} sent for {file.name} do not match "
                           f"its {digest.what} {where}", source=uri, file=file.name)
