"""S3 sources through the worker's cache against a real S3 server (SeaweedFS): what the
store returns decides the cache key, and a key never lets one bucket's bytes stand in
for another's object.

SeaweedFS (as S3) keeps a SHA-256 when an object is uploaded with one and returns it on
a HEAD with ``ChecksumMode=ENABLED``: the whole object's for a one-part upload, a
checksum of the parts' checksums ("<b64>-<n>", COMPOSITE) for a multipart one. Listings
carry no checksum, and the ETag of a one-part upload is the MD5 of its bytes, equal
across buckets.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest
from boto3.s3.transfer import TransferConfig

from app.settings import Settings, hash_key
from app.sources import open_source, parse_source
from app.storage.s3 import S3Storage
from maec_core.errors import SourceChanged
from tests.conftest import TinyModels
from tests.stack import S3_BUCKET, S3_INPUTS_BUCKET, S3_KEY_ID, S3_SECRET, S3Server
from worker.inputs import InputCache, fetch_source

pytestmark = pytest.mark.integration
OTHER = "other-team"


def _settings(s3: S3Server) -> Settings:
    return Settings.model_validate(dict(
        api_keys={"a": hash_key("a")}, storage_backend="s3", s3_endpoint_url=s3.endpoint,
        s3_bucket=S3_BUCKET, s3_access_key=S3_KEY_ID, s3_secret_key=S3_SECRET,
        s3_multipart_bytes=5 * 1024 * 1024))


def _upload(s3: S3Server, folder: Path, bucket: str, prefix: str, *, sha256: bool) -> str:
    c = s3.client()
    extra = {"ChecksumAlgorithm": "SHA256"} if sha256 else {}
    for p in sorted(folder.iterdir()):
        if p.is_file():
            c.upload_file(str(p), bucket, f"{prefix}/{p.name}", ExtraArgs=extra)
    return f"s3://{bucket}/{prefix}"


def _in_two_buckets(s3: S3Server, folder: Path, other: str, prefixes: tuple[str, str], *,
                    sha256: bool) -> tuple[Settings, S3Storage, str, str]:
    """The service's settings and store, and the URIs of ``folder`` uploaded to the
    inputs bucket (at ``prefixes[0]``) and to ``other`` (at ``prefixes[1]``)."""
    settings = _settings(s3)
    return (settings, S3Storage.from_settings(settings),
            _upload(s3, folder, S3_INPUTS_BUCKET, prefixes[0], sha256=sha256),
            _upload(s3, folder, other, prefixes[1], sha256=sha256))


@pytest.fixture(scope="module")
def other_bucket(s3_server: S3Server) -> str:
    c = s3_server.client()
    if OTHER not in {b["Name"] for b in c.list_buckets()["Buckets"]}:
        c.create_bucket(Bucket=OTHER)
    return OTHER


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}


def test_sha256_objects_are_one_entry_across_buckets(
        s3_server: S3Server, other_bucket: str, tiny_models: TinyModels,
        tmp_path: Path) -> None:
    want = _files(tiny_models.base)
    settings, storage, a, b = _in_two_buckets(s3_server, tiny_models.base, other_bucket,
                                              ("keyed/base", "mirror/base"), sha256=True)
    listed = open_source(parse_source(a, settings), storage).checkpoint_files()
    assert {f.name: f.content_key for f in listed} == {
        n: "sha256:" + hashlib.sha256(d).hexdigest() for n, d in want.items()}
    cache = InputCache(tmp_path / "cache", 10**9)
    total = sum(len(d) for d in want.values())
    first, fetched, cached = fetch_source(parse_source(a, settings), storage, cache,
                                          tmp_path / "in" / "0")
    assert (fetched, cached) == (total, 0) and _files(first) == want
    second, fetched, cached = fetch_source(parse_source(b, settings), storage, cache,
                                           tmp_path / "in" / "1")
    assert (fetched, cached) == (0, total) and _files(second) == want
    assert (second / "model.safetensors").samefile(first / "model.safetensors")
    assert len(list(cache.objects.iterdir())) == len(want)


def test_objects_without_sha256_are_keyed_by_bucket_key_etag_and_size(
        s3_server: S3Server, other_bucket: str, tiny_models: TinyModels,
        tmp_path: Path) -> None:
    want = _files(tiny_models.donor)
    settings, storage, a, b = _in_two_buckets(s3_server, tiny_models.donor, other_bucket,
                                              ("plain/donor", "plain/donor"), sha256=False)
    in_a = open_source(parse_source(a, settings), storage).checkpoint_files()
    in_b = open_source(parse_source(b, settings), storage).checkpoint_files()
    # The same ETags in both buckets: keyed by them alone, b's objects would be a's entries.
    assert [f.version for f in in_a] == [f.version for f in in_b]
    for f in in_a:
        assert f.content_key == \
            f"s3:{S3_INPUTS_BUCKET}/plain/donor/{f.name}@{f.version}:{f.size}"
    cache = InputCache(tmp_path / "cache", 10**9)
    total = sum(len(d) for d in want.values())
    for i, uri in enumerate((a, b)):
        path, fetched, cached = fetch_source(parse_source(uri, settings), storage, cache,
                                             tmp_path / "in" / str(i))
        assert (fetched, cached) == (total, 0) and _files(path) == want
    assert len(list(cache.objects.iterdir())) == 2 * len(want)


def test_an_object_changed_after_listing_is_refused_and_not_cached(
        s3_server: S3Server, tiny_models: TinyModels, tmp_path: Path) -> None:
    settings = _settings(s3_server)
    storage = S3Storage.from_settings(settings)
    uri = _upload(s3_server, tiny_models.lang, S3_INPUTS_BUCKET, "changing/lang",
                  sha256=False)
    reader = open_source(parse_source(uri, settings), storage)
    files = reader.checkpoint_files()
    config = next(f for f in files if f.name == "config.json")
    data = (tiny_models.lang / "config.json").read_bytes()
    # Same size, other bytes: only the ETag tells the listed object from this one.
    s3_server.client().put_object(Bucket=S3_INPUTS_BUCKET, Key=config.location,
                                  Body=data.replace(b'"', b"'", 1))
    cache = InputCache(tmp_path / "cache", 10**9)
    # The listing is what a job pins at submission: a changed object is source_changed.
    with pytest.raises(SourceChanged, match=r"config\.json was overwritten since"):
        cache.fill(tmp_path / "in", files, reader.fetch)
    assert cache.lookup(config.content_key, config.size) is None
    assert not [p for p in cache.objects.iterdir() if p.name.startswith(".")]


def test_corpus_objects_one_part_and_multipart(s3_server: S3Server, tmp_path: Path) -> None:
    settings = _settings(s3_server)
    storage = S3Storage.from_settings(settings)
    c = s3_server.client()
    small, big = tmp_path / "small.txt", tmp_path / "big.txt"
    small.write_bytes(b"w1 w2 w3\n" * 1000)
    big.write_bytes(os.urandom(6 * 2**20))
    five = TransferConfig(multipart_threshold=5 * 2**20, multipart_chunksize=5 * 2**20)
    for p in (small, big):
        c.upload_file(str(p), S3_INPUTS_BUCKET, f"corpora/{p.name}",
                      ExtraArgs={"ChecksumAlgorithm": "SHA256"}, Config=five)
    cache = InputCache(tmp_path / "cache", 10**9)
    for i, p in enumerate((small, big)):
        source = parse_source(f"s3://{S3_INPUTS_BUCKET}/corpora/{p.name}", settings)
        key = open_source(source, storage).corpus_file().content_key
        if p is small:
            assert key == "sha256:" + hashlib.sha256(p.read_bytes()).hexdigest()
        else:  # a composite checksum names no bytes by itself: bucket, key, ETag, size
            assert key.startswith(f"s3:{S3_INPUTS_BUCKET}/corpora/big.txt@")
            assert key.endswith(f"-2:{6 * 2**20}")  # a two-part upload's ETag, and the size
        path, fetched, cached = fetch_source(source, storage, cache, tmp_path / "in" / str(i),
                                             corpus=True)
        assert path.name == p.name and path.read_bytes() == p.read_bytes()
        assert (fetched, cached) == (p.stat().st_size, 0)
