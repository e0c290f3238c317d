"""The worker's input cache: content-keyed, size-capped, least recently used out first.

(Hub sources through the same cache, against a fake Hub: ``test_hub_sources.py``.)
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import pytest

from app.sources.s3 import content_key
from app.storage.base import ObjectInfo, StorageError
from app.storage.local import LocalStorage
from worker.inputs import InputCache


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
    # The same bytes under another name (or from another source kind) are one entry.
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
