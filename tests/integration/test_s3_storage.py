"""The S3 backend against a real S3 server (SeaweedFS), and header-only source reads."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from app.settings import Settings, hash_key
from app.sources import inspect_source, parse_source
from app.storage.s3 import S3Storage
from tests.conftest import TinyModels
from tests.stack import S3_BUCKET, S3_KEY_ID, S3_SECRET, S3Server

pytestmark = pytest.mark.integration


def _settings(s3: S3Server, **kw: object) -> Settings:
    values: dict[str, object] = dict(
        api_keys={"a": hash_key("a")}, storage_backend="s3", s3_endpoint_url=s3.endpoint,
        s3_bucket=S3_BUCKET, s3_access_key=S3_KEY_ID, s3_secret_key=S3_SECRET,
        s3_multipart_bytes=5 * 1024 * 1024)
    return Settings.model_validate({**values, **kw})


class CountingStorage(S3Storage):
    """Records every byte-range read, to prove what a header check transfers."""

    fetched = 0
    whole_reads: list[str] = []  # noqa: RUF012 - per-class record, reset by the test

    def get_range(self, key: str, start: int, end: int) -> bytes:
        data = super().get_range(key, start, end)
        CountingStorage.fetched += len(data)
        return data

    def get_bytes(self, key: str) -> bytes:
        CountingStorage.whole_reads.append(key)
        return super().get_bytes(key)

    def for_bucket(self, bucket: str) -> CountingStorage:
        return CountingStorage(self.client, bucket, multipart_bytes=self.multipart_bytes)


def test_multipart_upload_with_checksums_and_ranges(s3_server: S3Server, tmp_path: Path) -> None:
    store = S3Storage.from_settings(_settings(s3_server))
    big = tmp_path / "big.bin"
    big.write_bytes(os.urandom(12 * 1024 * 1024))  # three 5 MiB parts
    store.put_file("t/multipart/big.bin", big)
    head = store.client.head_object(Bucket=S3_BUCKET, Key="t/multipart/big.bin",
                                    ChecksumMode="ENABLED")
    assert head["ETag"].strip('"').endswith("-3"), "uploaded as a 3-part multipart upload"
    data = big.read_bytes()
    assert store.get_range("t/multipart/big.bin", 5 * 2**20 - 3, 5 * 2**20 + 2) == \
        data[5 * 2**20 - 3: 5 * 2**20 + 3]
    assert b"".join(store.iter_range("t/multipart/big.bin", 0, len(data) - 1)) == data
    dest = tmp_path / "back.bin"
    store.download("t/multipart/big.bin", dest)
    assert hashlib.sha256(dest.read_bytes()).digest() == hashlib.sha256(data).digest()
    info = store.head("t/multipart/big.bin")
    assert info is not None and info.size == len(data)
    assert store.head("t/multipart/none") is None
    store.put_bytes("t/multipart/small.json", b"{}")
    assert [o.key for o in store.list("t/multipart/")] == [
        "t/multipart/big.bin", "t/multipart/small.json"]
    url = store.presign("t/multipart/small.json", 60)
    assert url is not None and url.startswith(s3_server.endpoint)
    public = S3Storage.from_settings(_settings(
        s3_server, s3_public_endpoint_url="http://models.example.org:9000"))
    assert (public.presign("t/multipart/small.json", 60) or "").startswith(
        "http://models.example.org:9000/maec-test/t/multipart/small.json?")
    store.delete_prefix("t/multipart/")
    assert store.list("t/multipart/") == []
    assert store.ping()
    fresh = S3Storage.from_settings(_settings(s3_server, s3_bucket="made-by-prepare"))
    assert not fresh.ping()
    fresh.prepare()
    fresh.prepare()  # idempotent
    assert fresh.ping()


def test_s3_sources_are_checked_from_headers_only(s3_server: S3Server,
                                                  tiny_models: TinyModels,
                                                  tmp_path: Path) -> None:
    from tests.factories import make_llama

    # A checkpoint big enough that reading it whole would show: ~4 MB of weights.
    bigger = make_llama(tmp_path / "bigger", 7, hidden_size=256, intermediate_size=512,
                        num_attention_heads=4, num_key_value_heads=2, vocab_size=64)
    uri = s3_server.upload_folder(bigger, "headers/bigger")
    settings = _settings(s3_server)
    plain = S3Storage.from_settings(settings)
    counting = CountingStorage(plain.client, S3_BUCKET, multipart_bytes=5 * 2**20)
    CountingStorage.fetched, CountingStorage.whole_reads = 0, []
    folder = inspect_source(parse_source(uri, settings), counting)
    weights = sum(p.stat().st_size for p in bigger.glob("*.safetensors"))
    assert weights > 3_000_000
    assert 0 < CountingStorage.fetched < 20_000, "only the 8-byte length and the header"
    assert all(k.endswith(".json") for k in CountingStorage.whole_reads)
    assert len(folder.tensors) > 10
    assert folder.config["hidden_size"] == 256


def test_put_verified_multipart_checked_and_a_mismatch_leaves_nothing(
        s3_server: S3Server, tmp_path: Path) -> None:
    import io

    from app.storage.base import StorageError

    store = S3Storage.from_settings(_settings(s3_server))
    data = os.urandom(12 * 1024 * 1024)  # three 5 MiB parts
    sha = hashlib.sha256(data).hexdigest()
    store.put_verified("t/verified/big.bin", io.BytesIO(data), len(data), sha)
    head = store.client.head_object(Bucket=S3_BUCKET, Key="t/verified/big.bin")
    assert head["ETag"].strip('"').endswith("-3"), "uploaded as a 3-part multipart upload"
    assert store.get_bytes("t/verified/big.bin") == data
    store.put_verified("t/verified/small.bin", io.BytesIO(data[:1000]), 1000,
                       hashlib.sha256(data[:1000]).hexdigest())
    info = store.head("t/verified/small.bin")
    assert info is not None and info.sha256 == hashlib.sha256(data[:1000]).hexdigest()
    for size, body in ((len(data), data[:-1] + b"X"), (1000, data[:999] + b"X")):
        with pytest.raises(StorageError):
            store.put_verified("t/verified/bad.bin", io.BytesIO(body), size, sha)
        assert store.head("t/verified/bad.bin") is None
    uploads = store.client.list_multipart_uploads(Bucket=S3_BUCKET, Prefix="t/verified/")
    assert not uploads.get("Uploads"), "the refused multipart upload was aborted"
    store.delete_prefix("t/verified/")


def test_put_verified_follows_a_growing_file_part_by_part(s3_server: S3Server,
                                                          tmp_path: Path) -> None:
    store = S3Storage.from_settings(_settings(s3_server))
    data = os.urandom(12 * 1024 * 1024)
    path = tmp_path / "growing.bin"
    path.write_bytes(b"")
    asked: list[int] = []

    def wait_for(n: int) -> None:
        asked.append(n)
        with open(path, "ab") as out:  # the "writer" appends just what is asked for
            out.write(data[path.stat().st_size:n])

    with open(path, "rb") as f:
        store.put_verified("t/growing/big.bin", f, len(data),
                           lambda: hashlib.sha256(data).hexdigest(), wait_for=wait_for)
    assert asked == [5 * 2**20, 10 * 2**20, len(data)], "one wait per part, in order"
    assert store.get_bytes("t/growing/big.bin") == data
    store.delete_prefix("t/growing/")


def test_a_growing_file_goes_up_in_the_smaller_stream_parts(s3_server: S3Server,
                                                            tmp_path: Path) -> None:
    """While the merge still writes a shard, its parts are ``s3_stream_part_bytes``, so
    what waits for the writer's end is one small part; a finished file of the same size
    stays a single PUT under ``s3_multipart_bytes``."""
    store = S3Storage.from_settings(_settings(s3_server, s3_multipart_bytes=64 * 2**20,
                                              s3_stream_part_bytes=5 * 2**20))
    data = os.urandom(12 * 1024 * 1024)
    digest = hashlib.sha256(data).hexdigest()
    path = tmp_path / "growing.bin"
    path.write_bytes(b"")
    asked: list[int] = []

    def wait_for(n: int) -> None:
        asked.append(n)
        with open(path, "ab") as out:
            out.write(data[path.stat().st_size:n])

    with open(path, "rb") as f:
        store.put_verified("t/stream/growing.bin", f, len(data), lambda: digest,
                           wait_for=wait_for)
    assert asked == [5 * 2**20, 10 * 2**20, len(data)]
    with open(path, "rb") as f:
        store.put_verified("t/stream/whole.bin", f, len(data), digest)
    for key, parts in (("growing.bin", "-3"), ("whole.bin", None)):
        etag = store.client.head_object(Bucket=S3_BUCKET, Key=f"t/stream/{key}")["ETag"]
        assert (etag.strip('"').endswith(parts) if parts else "-" not in etag), (key, etag)
        assert store.get_bytes(f"t/stream/{key}") == data
    store.delete_prefix("t/stream/")
