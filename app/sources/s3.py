"""S3 sources: ``s3://bucket/prefix`` in the configured store (a checkpoint folder is the
objects right under the prefix; a corpus is the one object at the key).

At submission, compatibility is checked from ``config.json``, the shard index and each
safetensors header fetched with ranged GETs: the header is written into a *sparse* file
of the object's full size, so ``maec_core``'s own header validation (bounds, overlaps,
pickles) runs unchanged while no tensor byte is transferred or stored.

In the worker, each object is named in the cache by its content when the store keeps a
whole-object SHA-256 (an upload with ``ChecksumAlgorithm=SHA256`` in one part: S3 and
SeaweedFS return it on a HEAD with ``ChecksumMode=ENABLED``), so the same bytes in two
buckets, or on the hub, are one entry; and otherwise by bucket, key, ETag and size, since
an ETag alone is not a content digest (multipart, encrypted or copied objects) and must
not let one bucket's entry stand for another's object. The objects and their ETags (and
SHA-256s) are pinned when the job is submitted (``SourceKind.pin``): every fetch is a GET
of a pinned object that holds only while it still has that ETag (``If-Match``), checked
for size and (when the key is a SHA-256) digest while it streams; an object overwritten
or deleted since is ``source_changed``, and one added since is not fetched.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from functools import partial
from pathlib import Path
from typing import ClassVar

from app.settings import Settings
from app.sources.base import (
    SMALL_FILES,
    Kind,
    Source,
    SourceFile,
    SourceKind,
    download_verified,
    is_checkpoint_file,
    sparse_header_copy,
    write_whole,
)
from app.storage.base import ObjectInfo, Storage, StorageDenied, StorageError
from maec_core.service import (
    MAX_JSON_BYTES,
    PICKLE_SUFFIXES,
    ModelFolder,
    SourceChanged,
    SourceError,
    SourceNotFound,
)

_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9]$")


def content_key(bucket: str, info: ObjectInfo) -> str:
    """The cache's name for the bytes of ``info`` (an object of ``bucket``, from ``head``)."""
    if info.sha256:
        return f"sha256:{info.sha256}"
    return f"s3:{bucket}/{info.key}@{info.etag}:{info.size}"


class S3Source(SourceKind):
    kind: ClassVar[Kind] = "s3"
    scheme: ClassVar[str] = "s3"

    @classmethod
    def parse(cls, text: str, settings: Settings) -> Source:
        if settings.storage_backend != "s3":
            # Decided here, from the settings: no request can make it work, so it is the
            # request's error (422), never the store's (a 503 the client would retry).
            raise SourceError(f"{text}: s3:// sources need S3 storage; this service "
                              "keeps its storage in a local directory", source=text)
        bucket, _, prefix = text[5:].partition("/")
        prefix = prefix.strip("/")
        if not _BUCKET.match(bucket):
            raise SourceError(f"{text}: invalid bucket name", source=text)
        if not prefix or any(p in ("", ".", "..") for p in prefix.split("/")):
            raise SourceError(f"{text}: the prefix must be a plain path", source=text)
        return Source("s3", text, bucket=bucket, prefix=prefix)

    def _bucket(self) -> Storage:
        # Not in __init__: local storage refuses other buckets (a record written while the
        # service used S3 storage), and that refusal is the caller's error to word.
        return self.storage.for_bucket(self.source.bucket)

    def headers(self, tokenizer: bool = False, base: ModelFolder | None = None
                ) -> ModelFolder:
        # The view holds every JSON side file whole, tokenizer files included.
        return self.remote_view(self._view, tokenizer, base)

    def _view(self, into: Path) -> Path:
        source, bucket = self.source, self._bucket()
        objects = bucket.list(source.prefix + "/")
        if not objects:
            raise SourceNotFound(f"{source.uri}: no objects under this prefix",
                                 source=source.uri)
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
                write_whole(dest, obj.size, MAX_JSON_BYTES, partial(bucket.get_bytes, obj.key))
        return folder

    def _file(self, bucket: Storage, key: str, name: str) -> SourceFile:
        # A HEAD per object: listings carry no checksum.
        info = bucket.head(key)
        if info is None:
            raise SourceNotFound(f"{self.source.uri}: no such object"
                                 + ("" if key == self.source.prefix else f" {key}"),
                                 source=self.source.uri)
        return SourceFile(name, info.size, content_key(self.source.bucket, info), key,
                          info.etag)

    def checkpoint_files(self) -> list[SourceFile]:
        bucket, prefix = self._bucket(), self.source.prefix
        try:
            files = [self._file(bucket, obj.key, obj.key[len(prefix) + 1:])
                     for obj in bucket.list(prefix + "/")
                     if is_checkpoint_file(obj.key[len(prefix) + 1:])]
        except StorageDenied:
            raise self._denied() from None
        if not files:
            raise SourceNotFound(f"{self.source.uri}: no checkpoint files",
                                 source=self.source.uri)
        return files

    def corpus_file(self) -> SourceFile:
        key = self.source.prefix
        try:
            return self._file(self._bucket(), key, key.rsplit("/", 1)[-1])
        except StorageDenied:
            raise self._denied() from None

    def _denied(self) -> SourceError:
        # Asking again gives the same refusal: the request's error, not a 503 to retry.
        uri = self.source.uri
        return SourceError(f"{uri}: the store does not let this service read it",
                           source=uri)

    def fetch(self, file: SourceFile, dest: Path) -> None:
        bucket = self._bucket()
        download = partial(bucket.download_pinned, file.location, dest, file.size,
                           if_match=file.version or None)
        try:
            # Ranged GETs in parallel (boto3's managed transfer), each pinned to the
            # listed ETag; the digest is taken in file order as the parts land.
            download_verified(lambda sink: download(sink=sink), file, uri=self.source.uri,
                              sender="the store", where="as listed")
        except StorageError:
            # A refused If-Match and a store that is down read alike: ask which it was.
            self._check_unchanged(bucket, file)
            raise
        if not file.size:  # no GET carried the If-Match
            self._check_unchanged(bucket, file)

    def ranged_for(self, files: Iterable[SourceFile]) -> bool:
        # The manifest's input digests must be known without a whole copy: the store's
        # own sha256 of every weight file (an object uploaded with one, in one part).
        return all(f.content_key.startswith("sha256:") for f in files
                   if f.name.endswith(".safetensors"))

    def read_range(self, file: SourceFile, start: int, end: int) -> Iterator[bytes]:
        if end <= start:
            return iter(())
        bucket = self._bucket()
        return self._pinned_range(bucket, file, start, end)

    def _pinned_range(self, bucket: Storage, file: SourceFile, start: int, end: int
                      ) -> Iterator[bytes]:
        # Pinned to the listed ETag, as the whole download is: bytes of another version
        # are never put beside these.
        try:
            yield from bucket.iter_range(file.location, start, end - 1,
                                         if_match=file.version or None)
        except StorageError:
            self._check_unchanged(bucket, file)
            raise

    def check_unchanged(self, files: Iterable[SourceFile]) -> None:
        bucket = self._bucket()
        for file in files:
            self._check_unchanged(bucket, file)

    def _check_unchanged(self, bucket: Storage, file: SourceFile) -> None:
        """``SourceChanged`` when the object is no longer the version listed (pinned)."""
        info = bucket.head(file.location)
        if info is None or (file.version and info.etag != file.version):
            uri = self.source.uri
            why = "is gone" if info is None else "was overwritten"
            raise SourceChanged(f"{uri}: {file.name} {why} since the job was submitted",
                                source=uri, file=file.name)
