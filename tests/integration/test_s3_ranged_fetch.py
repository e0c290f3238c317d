"""Inputs fetched from S3 as parallel ranged GETs (boto3's managed transfer) against a
real S3 server (SeaweedFS): the bytes and their digest are checked as before, every GET
is pinned to the listed ETag, and a changed or corrupted object is refused, not cached.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

import pytest

from app.settings import Settings, hash_key
from app.sources import open_source, parse_source
from app.sources.base import SourceFile
from app.storage.base import StorageError
from app.storage.s3 import S3Storage
from maec_core.errors import SourceChanged
from tests.stack import S3_BUCKET, S3_INPUTS_BUCKET, S3_KEY_ID, S3_SECRET, S3Server
from worker.inputs import InputCache

pytestmark = pytest.mark.integration
PART = 1024 * 1024
# Several parts, the last one short.
SIZE = 5 * PART + 12345


def _settings(s3: S3Server) -> Settings:
    return Settings.model_validate(dict(
        api_keys={"a": hash_key("a")}, storage_backend="s3", s3_endpoint_url=s3.endpoint,
        s3_bucket=S3_BUCKET, s3_access_key=S3_KEY_ID, s3_secret_key=S3_SECRET,
        s3_transfer_concurrency=4, s3_download_part_bytes=PART))


def _gets(storage: S3Storage) -> list[dict[str, Any]]:
    """Every GetObject the client sends, as its parameters."""
    seen: list[dict[str, Any]] = []

    def record(params: dict[str, Any], **_: Any) -> None:
        seen.append(dict(params))

    storage.client.meta.events.register("provide-client-params.s3.GetObject", record)
    return seen


def _corpus(s3: S3Server, key: str, data: bytes) -> str:
    # One part with a SHA-256: the store keeps the whole object's digest.
    s3.client().put_object(Bucket=S3_INPUTS_BUCKET, Key=key, Body=data,
                           ChecksumAlgorithm="SHA256")
    return f"s3://{S3_INPUTS_BUCKET}/{key}"


def test_a_large_object_comes_in_pinned_ranged_parts(s3_server: S3Server,
                                                     tmp_path: Path) -> None:
    settings = _settings(s3_server)
    storage = S3Storage.from_settings(settings)
    data = os.urandom(SIZE)
    reader = open_source(parse_source(_corpus(s3_server, "ranged/big.txt", data), settings),
                         storage)
    file = reader.corpus_file()
    assert file.content_key == "sha256:" + hashlib.sha256(data).hexdigest()
    gets = _gets(storage)
    cache = InputCache(tmp_path / "cache", 10**9)
    assert cache.fill(tmp_path / "in", [file], reader.fetch) == (SIZE, 0)
    assert (tmp_path / "in" / "big.txt").read_bytes() == data
    ranges = sorted(g["Range"] for g in gets)
    assert len(ranges) == 6, ranges
    assert all(g["IfMatch"] == f'"{file.version}"' for g in gets)


def test_a_large_object_changed_after_listing_is_refused(s3_server: S3Server,
                                                         tmp_path: Path) -> None:
    settings = _settings(s3_server)
    storage = S3Storage.from_settings(settings)
    data = os.urandom(SIZE)
    reader = open_source(parse_source(_corpus(s3_server, "ranged/changing.txt", data),
                                      settings), storage)
    file = reader.corpus_file()
    # Same size, other bytes: only the ETag tells them apart.
    _corpus(s3_server, "ranged/changing.txt", data[::-1])
    cache = InputCache(tmp_path / "cache", 10**9)
    with pytest.raises(SourceChanged, match="was overwritten since"):
        cache.fill(tmp_path / "in", [file], reader.fetch)
    assert cache.lookup(file.content_key, file.size) is None


def test_bytes_that_miss_their_digest_are_refused(s3_server: S3Server,
                                                  tmp_path: Path) -> None:
    """The digest is still checked: a listing that promised other bytes (as a store
    sending wrong ones would) fails the fetch, with nothing cached."""
    settings = _settings(s3_server)
    storage = S3Storage.from_settings(settings)
    data = os.urandom(SIZE)
    reader = open_source(parse_source(_corpus(s3_server, "ranged/wrong.txt", data),
                                      settings), storage)
    file = reader.corpus_file()
    lying = SourceFile(file.name, file.size, "sha256:" + hashlib.sha256(b"x").hexdigest(),
                       file.location, file.version)
    cache = InputCache(tmp_path / "cache", 10**9)
    with pytest.raises(StorageError, match="do not match its sha256"):
        cache.fill(tmp_path / "in", [lying], reader.fetch)
    assert cache.lookup(lying.content_key, lying.size) is None


def test_the_read_rate_cap_reaches_every_ranged_fetch(s3_server: S3Server) -> None:
    """MAEC_S3_READ_BYTES_PER_S goes to the transfer that fetches inputs, of this bucket
    and of the source buckets alike; unset, nothing is capped."""
    assert S3Storage.from_settings(_settings(s3_server)).fetch_transfer.max_bandwidth is None
    capped = _settings(s3_server).model_copy(update={"s3_read_bytes_per_s": 8 * PART})
    storage = S3Storage.from_settings(capped)
    other = storage.for_bucket(S3_INPUTS_BUCKET)
    assert isinstance(other, S3Storage)
    for s in (storage, other):
        assert s.fetch_transfer.max_bandwidth == 8 * PART
