"""The worker's input cache: content-keyed, size-capped, least recently used out first."""

from __future__ import annotations

import os
import time
from pathlib import Path

from app.storage.local import LocalStorage
from worker.inputs import InputCache


def test_hits_misses_and_lru_eviction(tmp_path: Path) -> None:
    store = LocalStorage(tmp_path / "store")
    for name in ("a", "b", "c"):
        store.put_bytes(f"m/{name}.safetensors", name.encode() * 1000)
    cache = InputCache(tmp_path / "cache", max_bytes=2500)
    infos = {o.key: o for o in store.list("m/")}
    a, hit = cache.get(store, infos["m/a.safetensors"], "bucket")
    assert not hit and a.read_bytes() == b"a" * 1000
    again, hit = cache.get(store, infos["m/a.safetensors"], "bucket")
    assert hit and again == a
    b, _ = cache.get(store, infos["m/b.safetensors"], "bucket")
    # a was used after b was fetched: b is now the least recently used.
    past = time.time() - 100
    os.utime(b, (past, past))
    cache.get(store, infos["m/a.safetensors"], "bucket")
    c, _ = cache.get(store, infos["m/c.safetensors"], "bucket")
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
    first, _ = cache.get(store, info, "bucket")
    store.put_bytes("x/model.safetensors", b"2" * 10)  # same name, new content
    changed = store.list("x/")[0]
    second, hit = cache.get(store, changed, "bucket")
    assert not hit and second != first and second.read_bytes() == b"2" * 10
