"""S3-compatible storage through boto3: multipart uploads with SHA-256 checksums per part,
ranged GETs (inputs fetched as parallel ranged GETs: app/storage/ranged.py), presigned
URLs.

``put_verified`` (how the worker publishes a merge's files) runs its own multipart
upload rather than boto3's transfer manager: it reads each part once, hashes it for the
part's checksum (which the store checks on receipt) and for the whole file's SHA-256
(checked against the digest the writer computed), and sends up to ``UPLOAD_THREADS``
parts at once. A file whose bytes do not match is never completed: the upload is
aborted and nothing appears at the key.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import hashlib
from collections.abc import Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

import boto3
from boto3.exceptions import Boto3Error
from boto3.s3.transfer import TransferConfig
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError

from app.settings import Settings
from app.storage.base import (
    Digest,
    ObjectInfo,
    Storage,
    StorageDenied,
    StorageError,
    WaitFn,
    check_key,
    expected_digest,
    write_stream,
)
from app.storage.ranged import RateCap, Sink, ranged_download, transfer_config

if TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client

CHUNK = 1024 * 1024
# Parts of one file in flight at once (each holds a part in memory: 4 x 64 MB default).
UPLOAD_THREADS = 4


def _b64(digest: bytes) -> str:
    return base64.b64encode(digest).decode()


def composite_sha256(part_digests: list[bytes]) -> str:
    """S3's checksum of a multipart object: SHA-256 of the parts' SHA-256 digests,
    base64, then ``-<parts>``."""
    return f"{_b64(hashlib.sha256(b''.join(part_digests)).digest())}-{len(part_digests)}"


# What a store answers when the credentials may not read there (not an outage).
_DENIED = frozenset({"AccessDenied", "403", "AllAccessDisabled"})


def _fail(what: str, exc: Exception, **details: Any) -> StorageError:
    code = exc.response.get("Error", {}).get("Code") if isinstance(exc, ClientError) else None
    kind = StorageDenied if code in _DENIED else StorageError
    return kind(f"object store error while {what}: {exc}", **details)


def _full_sha256(head: Mapping[str, Any]) -> str | None:
    """The object's SHA-256 (hex) from a HEAD with checksums, when it covers the whole
    object: a multipart upload's is a checksum of its parts' checksums ("<b64>-<n>",
    ChecksumType COMPOSITE), which names the bytes only together with the part sizes."""
    value = head.get("ChecksumSHA256")
    if not isinstance(value, str) or "-" in value or \
            head.get("ChecksumType", "FULL_OBJECT") != "FULL_OBJECT":
        return None
    try:
        digest = base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        return None
    return digest.hex() if len(digest) == 32 else None


class S3Storage:
    kind = "s3"

    def __init__(self, client: S3Client, bucket: str, *, multipart_bytes: int,
                 presigner: S3Client | None = None, fetch_concurrency: int = 8,
                 fetch_part_bytes: int = 16 * 1024 * 1024,
                 stream_part_bytes: int = 16 * 1024 * 1024,
                 fetch_bytes_per_s: int | None = None, cap: RateCap | None = None) -> None:
        self.client = client
        # Signs URLs for the endpoint clients use (signatures cover the host).
        self.presigner = presigner or client
        self.bucket = bucket
        self.multipart_bytes = multipart_bytes
        self.transfer = TransferConfig(
            multipart_threshold=multipart_bytes, multipart_chunksize=multipart_bytes,
        )
        self.stream_part_bytes = stream_part_bytes
        self.fetch_concurrency = fetch_concurrency
        self.fetch_part_bytes = fetch_part_bytes
        self.fetch_bytes_per_s = fetch_bytes_per_s
        self.fetch_transfer = transfer_config(fetch_concurrency, fetch_part_bytes,
                                              fetch_bytes_per_s)
        # Shared with the same store's other buckets (for_bucket): one process's cap.
        self.cap = cap or (RateCap(fetch_bytes_per_s) if fetch_bytes_per_s else None)

    @classmethod
    def from_settings(cls, s: Settings) -> S3Storage:
        client = cls._client(s, s.s3_endpoint_url)
        presigner = (cls._client(s, s.s3_public_endpoint_url)
                     if s.s3_public_endpoint_url else None)
        return cls(client, s.s3_bucket, multipart_bytes=s.s3_multipart_bytes,
                   presigner=presigner, fetch_concurrency=s.s3_transfer_concurrency,
                   fetch_part_bytes=s.s3_download_part_bytes,
                   stream_part_bytes=s.s3_stream_part_bytes,
                   fetch_bytes_per_s=s.s3_read_bytes_per_s)

    @staticmethod
    def _client(s: Settings, endpoint: str | None) -> S3Client:
        return boto3.client(
            "s3",
            endpoint_url=endpoint,
            region_name=s.s3_region,
            aws_access_key_id=s.s3_access_key or None,
            aws_secret_access_key=s.s3_secret_key or None,
            config=Config(
                retries={"max_attempts": 5, "mode": "standard"},
                connect_timeout=5, read_timeout=60,
                s3={"addressing_style": "path"},
                max_pool_connections=32,
            ),
        )

    def for_bucket(self, bucket: str) -> Storage:
        return S3Storage(self.client, bucket, multipart_bytes=self.multipart_bytes,
                         presigner=self.presigner, fetch_concurrency=self.fetch_concurrency,
                         fetch_part_bytes=self.fetch_part_bytes,
                         stream_part_bytes=self.stream_part_bytes,
                         fetch_bytes_per_s=self.fetch_bytes_per_s, cap=self.cap)

    def prepare(self) -> None:
        try:
            self.client.head_bucket(Bucket=self.bucket)
        except ClientError:
            self.client.create_bucket(Bucket=self.bucket)

    def ping(self) -> bool:
        try:
            self.client.head_bucket(Bucket=self.bucket)
        except (ClientError, BotoCoreError):
            return False
        return True

    def put_file(self, key: str, path: Path) -> None:
        try:
            self.client.upload_file(
                str(path), self.bucket, check_key(key),
                ExtraArgs={"ChecksumAlgorithm": "SHA256"}, Config=self.transfer,
            )
        except (ClientError, BotoCoreError, Boto3Error, OSError) as exc:
            # Boto3Error: upload_file wraps failures in S3UploadFailedError, which is
            # neither a ClientError nor a BotoCoreError (seen with the store going down).
            raise _fail(f"uploading {key}", exc, key=key) from None

    def put_verified(self, key: str, f: BinaryIO, size: int, sha256: Digest, *,
                     wait_for: WaitFn | None = None) -> None:
        check_key(key)
        # A file still being written goes up in smaller parts: only its last part waits
        # for the writer to finish.
        part = self.multipart_bytes if wait_for is None else \
            min(self.multipart_bytes, self.stream_part_bytes)
        try:
            if size <= part:
                if wait_for is not None:
                    wait_for(size)
                f.seek(0)
                data = f.read(size)
                digest = expected_digest(sha256)
                if len(data) != size or hashlib.sha256(data).hexdigest() != digest:
                    raise StorageError(f"{key}: the file is not the one hashed", key=key)
                # The store checks the body against this checksum and refuses a mismatch.
                self.client.put_object(Bucket=self.bucket, Key=key, Body=data,
                                       ChecksumSHA256=_b64(bytes.fromhex(digest)))
            else:
                self._multipart(key, f, size, sha256, wait_for, part)
            head = self.client.head_object(Bucket=self.bucket, Key=key)
        except (ClientError, BotoCoreError, OSError) as exc:
            raise _fail(f"uploading {key}", exc, key=key) from None
        if int(head["ContentLength"]) != size:
            self.client.delete_object(Bucket=self.bucket, Key=key)
            raise StorageError(f"{key}: the store holds {head['ContentLength']} bytes, "
                               f"not {size}", key=key)

    def _multipart(self, key: str, f: BinaryIO, size: int, sha256: Digest,
                   wait_for: WaitFn | None, part: int) -> None:
        """Parts hashed as read (each once final, for a file still being written) and
        sent on a pool; completed only once the whole file hashed to ``sha256`` and the
        store confirmed the parts' composite checksum."""
        upload = self.client.create_multipart_upload(
            Bucket=self.bucket, Key=key, ChecksumAlgorithm="SHA256")["UploadId"]
        whole = hashlib.sha256()
        digests: list[bytes] = []
        sent: list[Future[dict[str, Any]]] = []
        try:
            with ThreadPoolExecutor(UPLOAD_THREADS, thread_name_prefix="s3-part") as pool:
                f.seek(0)
                for number, start in enumerate(range(0, size, part), 1):
                    n = min(part, size - start)
                    if wait_for is not None:
                        wait_for(start + n)
                    data = f.read(n)
                    if len(data) != n:
                        raise StorageError(f"{key}: the file ended at {start + len(data)} "
                                           f"of {size} bytes", key=key)
                    whole.update(data)
                    digests.append(hashlib.sha256(data).digest())
                    # Bounded: at most UPLOAD_THREADS parts held in memory.
                    if len(sent) >= UPLOAD_THREADS:
                        sent[len(sent) - UPLOAD_THREADS].result()
                    sent.append(pool.submit(self._part, key, upload, number, data,
                                            digests[-1]))
                parts = [fut.result() for fut in sent]
            if whole.hexdigest() != expected_digest(sha256):
                raise StorageError(f"{key}: the file is not the one hashed", key=key)
            done = self.client.complete_multipart_upload(
                Bucket=self.bucket, Key=key, UploadId=upload,
                MultipartUpload={"Parts": parts})  # type: ignore[typeddict-item]
        except BaseException:
            # Best effort: the original error is the one to report; a store that is down
            # expires the upload by its own lifecycle rules.
            with contextlib.suppress(ClientError, BotoCoreError):
                self.client.abort_multipart_upload(Bucket=self.bucket, Key=key,
                                                   UploadId=upload)
            raise
        stored = done.get("ChecksumSHA256")
        # Stores that report the composite checksum must report ours.
        if stored and stored != composite_sha256(digests):
            self.client.delete_object(Bucket=self.bucket, Key=key)
            raise StorageError(f"{key}: the store's checksum {stored} is not ours", key=key)

    def _part(self, key: str, upload: str, number: int, data: bytes, digest: bytes
              ) -> dict[str, Any]:
        resp = self.client.upload_part(
            Bucket=self.bucket, Key=key, UploadId=upload, PartNumber=number, Body=data,
            ChecksumSHA256=_b64(digest))
        return {"PartNumber": number, "ETag": resp["ETag"], "ChecksumSHA256": _b64(digest)}

    def put_bytes(self, key: str, data: bytes) -> None:
        try:
            self.client.put_object(
                Bucket=self.bucket, Key=check_key(key), Body=data, ChecksumAlgorithm="SHA256"
            )
        except (ClientError, BotoCoreError) as exc:
            raise _fail(f"uploading {key}", exc, key=key) from None

    def get_bytes(self, key: str) -> bytes:
        try:
            return self.client.get_object(Bucket=self.bucket, Key=key)["Body"].read()
        except (ClientError, BotoCoreError) as exc:
            raise _fail(f"reading {key}", exc, key=key) from None

    def get_range(self, key: str, start: int, end: int) -> bytes:
        try:
            resp = self.client.get_object(
                Bucket=self.bucket, Key=key, Range=f"bytes={start}-{end}"
            )
            return resp["Body"].read()
        except (ClientError, BotoCoreError) as exc:
            raise _fail(f"reading {key}", exc, key=key) from None

    def iter_range(self, key: str, start: int, end: int, *, if_match: str | None = None
                   ) -> Iterator[bytes]:
        try:
            if if_match is None:
                resp = self.client.get_object(
                    Bucket=self.bucket, Key=key, Range=f"bytes={start}-{end}")
            else:
                resp = self.client.get_object(
                    Bucket=self.bucket, Key=key, Range=f"bytes={start}-{end}",
                    IfMatch=f'"{if_match}"')
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in ("PreconditionFailed", "412"):
                raise StorageError(f"{key} changed since it was listed", key=key) from None
            raise _fail(f"reading {key}", exc, key=key) from None
        except BotoCoreError as exc:
            raise _fail(f"reading {key}", exc, key=key) from None
        try:  # a connection cut mid-body is a BotoCoreError too (ResponseStreamingError)
            for chunk in resp["Body"].iter_chunks(CHUNK):
                if self.cap is not None:
                    self.cap.take(len(chunk))
                yield chunk
        except BotoCoreError as exc:
            raise _fail(f"reading {key}", exc, key=key) from None

    def download_pinned(self, key: str, dest: Path, size: int, *, if_match: str | None,
                        sink: Sink) -> int:
        if size < self.fetch_transfer.multipart_threshold:
            # One GET: the transfer would make it one part anyway (and its one-GET path
            # sends no If-Match).
            chunks = self.iter_range(key, 0, size - 1, if_match=if_match) if size else ()
            return write_stream(chunks, dest, sink)
        return ranged_download(self.client, self.fetch_transfer, self.bucket, key, dest,
                               size, if_match=if_match, sink=sink)

    def head(self, key: str) -> ObjectInfo | None:
        try:
            # ChecksumMode: the stored SHA-256, when the object was uploaded with one.
            h = self.client.head_object(Bucket=self.bucket, Key=key, ChecksumMode="ENABLED")
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
                return None
            raise _fail(f"reading {key}", exc, key=key) from None
        except BotoCoreError as exc:
            raise _fail(f"reading {key}", exc, key=key) from None
        return ObjectInfo(key, int(h["ContentLength"]), str(h.get("ETag", "")).strip('"'),
                          sha256=_full_sha256(h))

    def list(self, prefix: str) -> list[ObjectInfo]:
        out: list[ObjectInfo] = []
        try:
            pages = self.client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=prefix
            )
            for page in pages:
                for obj in page.get("Contents", []):
                    out.append(ObjectInfo(
                        obj["Key"], int(obj["Size"]), str(obj.get("ETag", "")).strip('"')
                    ))
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") == "NoSuchBucket":
                return []
            raise _fail(f"listing {prefix}", exc, prefix=prefix) from None
        except BotoCoreError as exc:
            raise _fail(f"listing {prefix}", exc, prefix=prefix) from None
        return sorted(out, key=lambda o: o.key)

    def download(self, key: str, dest: Path) -> None:
        dest.parent.mkdir(parents=True, exist_ok=True)
        try:
            self.client.download_file(self.bucket, key, str(dest), Config=self.transfer)
        except (ClientError, BotoCoreError, Boto3Error) as exc:
            raise _fail(f"downloading {key}", exc, key=key) from None

    def delete_prefix(self, prefix: str) -> None:
        keys = [o.key for o in self.list(prefix)]
        try:
            for i in range(0, len(keys), 1000):
                self.client.delete_objects(
                    Bucket=self.bucket,
                    Delete={"Objects": [{"Key": k} for k in keys[i:i + 1000]], "Quiet": True},
                )
        except (ClientError, BotoCoreError) as exc:
            raise _fail(f"deleting {prefix}", exc, prefix=prefix) from None

    def presign(self, key: str, seconds: int) -> str | None:
        return self.presigner.generate_presigned_url(
            "get_object", Params={"Bucket": self.bucket, "Key": key}, ExpiresIn=seconds
        )
