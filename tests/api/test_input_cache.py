"""The worker's input cache: content-keyed, size-capped, least recently used out first.

(Hub sources through the same cache, against a fake Hub: ``test_hub_sources.py``.)
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import time
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path

import pytest

from app.settings import Settings, hash_key
from app.sources import open_source, parse_source
from app.sources.s3 import content_key
from app.storage.base import ObjectInfo, StorageError
from app.storage.local import LocalStorage
from worker.inputs import InputCache, fetch_source


def _get(cache: InputCache, store: LocalStorage, info: ObjectInfo) -> tuple[Path, bool]:
    """What ``fetch_source`` does for one S3 object."""
    return cache.get(content_key("bucket", info), info.size,
                     partial(store.download, info.key))


def test_hits_misses_and_lru_eviction(tmp_path: Path) -> None:
    store = LocalStorage(tmp_path / "store")
    for name in ("a", "b", "c"):
        store.put_bytes(f"m/{name}.safetensors", name.encode() * 1000)
    cache = InputCache(tmp_path / "cache", max_bytes=2500)
    infos = {o.key: o for o in store.list("m/")}
    a, hit = _get(cache, store, infos["m/a.safetensors"])
    assert not hit and a.read_bytes() == b"a" * 1000
    again, hit = _get(cache, store, infos["m/a.safetensors"])
    assert hit and again == a
    b, _ = _get(cache, store, infos["m/b.safetensors"])
    # a was used after b was fetched: b is now the least recently used.
    past = time.time() - 100
    os.utime(b, (past, past))
    _get(cache, store, infos["m/a.safetensors"])
    c, _ = _get(cache, store, infos["m/c.safetensors"])
    freed = cache.evict()
    assert freed == 1000
    assert a.exists() and c.exists() and not b.exists()
    # Room is made before a fetch: keep_free counts the bytes about to arrive.
    assert cache.evict(keep_free=1000) == 1000
    assert len(list(cache.objects.iterdir())) == 1


def test_entries_are_keyed_by_content_identity(tmp_path: Path) -> None:
    store = LocalStorage(tmp_path / "store")
    store.put_bytes("x/model.safetensors", b"1" * 10)
    cache = InputCache(tmp_path / "cache", max_bytes=10**6)
    info = store.list("x/")[0]
    first, _ = _get(cache, store, info)
    store.put_bytes("x/model.safetensors", b"2" * 10)  # same name, new content
    changed = store.list("x/")[0]
    second, hit = _get(cache, store, changed)
    assert not hit and second != first and second.read_bytes() == b"2" * 10
    # The same key is one entry, whatever downloads it.
    third, hit = cache.get(content_key("bucket", changed), 10,
                           lambda tmp: tmp.write_bytes(b"2" * 10))
    assert hit and third == second


def _short(tmp: Path) -> None:
    tmp.write_bytes(b"x" * 5)


def _fails_midway(tmp: Path) -> None:
    tmp.write_bytes(b"x" * 5)
    raise StorageError("connection reset")


@pytest.mark.parametrize("download", [_short, _fails_midway], ids=lambda f: f.__name__)
def test_a_failed_or_short_download_leaves_no_entry(
        tmp_path: Path, download: Callable[[Path], None]) -> None:
    cache = InputCache(tmp_path / "cache", max_bytes=10**6)
    with pytest.raises(StorageError):
        cache.get("etag-1", 10, download)
    assert list(cache.objects.iterdir()) == []  # no entry, no temporary file
    assert cache.lookup("etag-1", 10) is None
    entry, hit = cache.get("etag-1", 10, lambda tmp: tmp.write_bytes(b"y" * 10))
    assert not hit and entry.read_bytes() == b"y" * 10
    assert cache.lookup("etag-1", 10) == entry


class Buckets(LocalStorage):
    """A store of buckets (one directory each) that keeps each object's SHA-256, as an
    S3 store does for objects uploaded with one; ``serve`` replaces what a GET sends."""

    def __init__(self, root: Path, *, sha256: bool = True) -> None:
        super().__init__(root)
        self.sha256 = sha256
        self.serve: dict[str, bytes] = {}

    def for_bucket(self, bucket: str) -> Buckets:
        other = Buckets(self.root / bucket, sha256=self.sha256)
        other.serve = self.serve
        return other

    def head(self, key: str) -> ObjectInfo | None:
        info = super().head(key)
        if info is None or not self.sha256:
            return info
        digest = hashlib.sha256(self._path(key).read_bytes()).hexdigest()
        return dataclasses.replace(info, sha256=digest)

    def iter_range(self, key: str, start: int, end: int, *, if_match: str | None = None
                   ) -> Iterator[bytes]:
        if key in self.serve:  # a store (or a path to it) sending other bytes
            return iter([self.serve[key][start:end + 1]])
        return super().iter_range(key, start, end, if_match=if_match)


def _put_model(store: Buckets, bucket: str, prefix: str, files: dict[str, bytes]) -> str:
    for name, data in files.items():
        store.for_bucket(bucket).put_bytes(f"{prefix}/{name}", data)
    return f"s3://{bucket}/{prefix}"


MODEL = {"model.safetensors": b"w" * 3000, "config.json": b'{"a": 1}', "notes.txt": b"x"}


@pytest.mark.parametrize("sha256", [True, False], ids=["sha256", "no-sha256"])
def test_s3_entries_are_shared_across_buckets_only_by_sha256(tmp_path: Path,
                                                               sha256: bool) -> None:
    store = Buckets(tmp_path / "store", sha256=sha256)
    cache = InputCache(tmp_path / "cache", 10**6)
    settings = Settings(api_keys={"a": hash_key("a")})
    total = len(MODEL["model.safetensors"]) + len(MODEL["config.json"])
    counts = []
    for i, bucket in enumerate(("team-a", "team-b")):
        uri = _put_model(store, bucket, "models/m", MODEL)
        path, fetched, cached = fetch_source(parse_source(uri, settings), store, cache,
                                             tmp_path / "in" / str(i))
        assert {p.name: p.read_bytes() for p in path.iterdir()} == {
            n: d for n, d in MODEL.items() if n != "notes.txt"}
        counts.append((fetched, cached))
    assert counts == ([(total, 0), (0, total)] if sha256 else [(total, 0), (total, 0)])
    assert len(list(cache.objects.iterdir())) == (2 if sha256 else 4)


def test_s3_bytes_not_matching_their_sha256_are_refused_while_streaming(
        tmp_path: Path) -> None:
    store = Buckets(tmp_path / "store")
    cache = InputCache(tmp_path / "cache", 10**6)
    settings = Settings(api_keys={"a": hash_key("a")})
    uri = _put_model(store, "team-a", "models/m", MODEL)
    weights = MODEL["model.safetensors"]
    store.serve["models/m/model.safetensors"] = weights[:1500] + b"v" + weights[1501:]
    with pytest.raises(StorageError, match="do not match its sha256") as caught:
        fetch_source(parse_source(uri, settings), store, cache, tmp_path / "in" / "0")
    assert caught.value.details == {"source": uri, "file": "model.safetensors"}
    store.serve["models/m/model.safetensors"] = weights[:-1]
    with pytest.raises(StorageError, match=r"sent 2999 bytes of model\.safetensors"):
        fetch_source(parse_source(uri, settings), store, cache, tmp_path / "in" / "1")
    # Nothing of the refused file is cached, nor left half-written beside the entries.
    held = {p.read_bytes() for p in cache.objects.iterdir()}
    assert held <= {MODEL["config.json"]}
    store.serve.clear()
    path, fetched, _ = fetch_source(parse_source(uri, settings), store, cache,
                                    tmp_path / "in" / "2")
    assert (path / "model.safetensors").read_bytes() == weights and fetched >= len(weights)


def test_local_sources_are_read_in_place_or_listed_and_fetched(tmp_path: Path) -> None:
    folder = tmp_path / "models" / "m"
    folder.mkdir(parents=True)
    for name, data in MODEL.items():
        (folder / name).write_bytes(data)
    settings = Settings(api_keys={"a": hash_key("a")}, local_roots=[tmp_path / "models"])
    source = parse_source(str(folder), settings)
    cache = InputCache(tmp_path / "cache", 10**6)
    store = LocalStorage(tmp_path / "store")
    assert fetch_source(source, store, cache, tmp_path / "in" / "0") == (folder, 0, 0)
    reader = open_source(source, store)
    files = reader.checkpoint_files()
    assert [f.name for f in files] == ["config.json", "model.safetensors"]
    assert cache.fill(tmp_path / "in" / "1", files, reader.fetch) == (3008, 0)
    assert (tmp_path / "in" / "1" / "model.safetensors").read_bytes() == MODEL[
        "model.safetensors"]
