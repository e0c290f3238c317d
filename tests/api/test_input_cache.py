"""The worker's input cache: content-keyed, size-capped, least recently used out first.

(Hub sources through the same cache, against a fake Hub: ``test_hub_sources.py``.)
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import subprocess
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


def _s3_settings() -> Settings:
    # s3:// sources are read only by a service whose storage is S3.
    return Settings(api_keys={"a": hash_key("a")}, storage_backend="s3",
                    s3_access_key="test-access", s3_secret_key="test-secret-value")


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
    settings = _s3_settings()
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
    settings = _s3_settings()
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


def test_local_sources_are_copied_through_the_cache_or_listed_and_fetched(
        tmp_path: Path) -> None:
    # Never read in place: the shared folder could change under the job (the pin tests
    # below); the worker reads its own copy.
    folder = tmp_path / "models" / "m"
    folder.mkdir(parents=True)
    for name, data in MODEL.items():
        (folder / name).write_bytes(data)
    settings = Settings(api_keys={"a": hash_key("a")}, local_roots=[tmp_path / "models"])
    source = parse_source(str(folder), settings)
    cache = InputCache(tmp_path / "cache", 10**6)
    store = LocalStorage(tmp_path / "store")
    assert fetch_source(source, store, cache, tmp_path / "in" / "0") == (
        tmp_path / "in" / "0", 3008, 0)
    assert fetch_source(source, store, cache, tmp_path / "in" / "2") == (
        tmp_path / "in" / "2", 0, 3008)
    reader = open_source(source, store)
    files = reader.checkpoint_files()
    assert [f.name for f in files] == ["config.json", "model.safetensors"]
    cache = InputCache(tmp_path / "cache2", 10**6)
    assert cache.fill(tmp_path / "in" / "1", files, reader.fetch) == (3008, 0)
    assert (tmp_path / "in" / "1" / "model.safetensors").read_bytes() == MODEL[
        "model.safetensors"]


# --- Sources pinned at submission, re-checked at fetch -------------------------------

def _local(tmp_path: Path) -> tuple[Settings, Path, Path]:
    """(settings, the allow-listed root, a folder outside it), each holding MODEL."""
    root, outside = tmp_path / "models", tmp_path / "outside"
    for folder in (root / "m", outside / "m"):
        folder.mkdir(parents=True)
        for name, data in MODEL.items():
            (folder / name).write_bytes(data)
    (outside / "m" / "model.safetensors").write_bytes(b"s" * 3000)  # someone's secret
    (root / "corpus.jsonl").write_bytes(b'{"text": "ours"}\n')
    (outside / "corpus.jsonl").write_bytes(b'{"text": "secret"}\n')
    settings = Settings(api_keys={"a": hash_key("a")}, local_roots=[root])
    return settings, root, outside


def _swap_folder(root: Path, outside: Path) -> None:
    (root / "m").rename(root / "m-old")
    (root / "m").symlink_to(outside / "m")


def _rewrite_shard(root: Path, outside: Path) -> None:
    (root / "m" / "model.safetensors").write_bytes(b"v" * 3000)


def _shard_to_link(root: Path, outside: Path) -> None:
    shard = root / "m" / "model.safetensors"
    shard.unlink()
    shard.symlink_to(outside / "m" / "model.safetensors")


def _replace_shard(root: Path, outside: Path) -> None:
    # Same bytes, another file: a rename over it is a swap whatever the content.
    new = root / "m" / ".new"
    new.write_bytes(MODEL["model.safetensors"])
    new.replace(root / "m" / "model.safetensors")


def _remove_shard(root: Path, outside: Path) -> None:
    (root / "m" / "model.safetensors").unlink()


SWAPS = [_swap_folder, _rewrite_shard, _shard_to_link, _replace_shard, _remove_shard]


@pytest.mark.parametrize("swap", SWAPS, ids=lambda f: f.__name__.strip("_"))
def test_a_local_folder_changed_after_its_pin_is_refused(tmp_path: Path,
                                                        swap: Callable[[Path, Path], None]
                                                        ) -> None:
    from app.sources import pin_source
    from maec_core.errors import SourceChanged

    settings, root, outside = _local(tmp_path)
    store = LocalStorage(tmp_path / "store")
    pinned = pin_source(parse_source(str(root / "m"), settings), store)
    assert sorted(f.name for f in pinned.files) == ["config.json", "model.safetensors"]
    # What a job record stores is what the worker gets back.
    from app.sources import Source

    assert Source.from_dict(pinned.to_dict()) == pinned
    swap(root, outside)
    cache = InputCache(tmp_path / "cache", 10**6)
    with pytest.raises(SourceChanged) as caught:
        fetch_source(pinned, store, cache, tmp_path / "in")
    assert caught.value.code == "source_changed"
    assert caught.value.details["source"] == str(root / "m")
    # Nothing from outside the root, nor anything changed, reached the cache.
    held = {p.read_bytes() for p in cache.objects.iterdir()}
    assert held <= {MODEL["config.json"]}


def test_a_link_above_the_folder_but_below_the_root_is_refused(tmp_path: Path) -> None:
    from app.sources import pin_source
    from maec_core.errors import SourceChanged

    settings, root, outside = _local(tmp_path)
    (root / "team").mkdir()
    (root / "m").rename(root / "team" / "m")
    store = LocalStorage(tmp_path / "store")
    pinned = pin_source(parse_source(str(root / "team" / "m"), settings), store)
    (root / "team").rename(root / "team-old")
    (root / "team").symlink_to(outside)
    with pytest.raises(SourceChanged, match="link"):
        fetch_source(pinned, store, InputCache(tmp_path / "cache", 10**6), tmp_path / "in")


def test_a_swapped_corpus_is_refused_and_an_unchanged_one_fetched(tmp_path: Path) -> None:
    from app.sources import check_corpus
    from maec_core.errors import SourceChanged

    settings, root, outside = _local(tmp_path)
    store = LocalStorage(tmp_path / "store")
    cache = InputCache(tmp_path / "cache", 10**6)
    pinned = check_corpus(parse_source(str(root / "corpus.jsonl"), settings), store, 1000)
    path, fetched, _ = fetch_source(pinned, store, cache, tmp_path / "in" / "0", corpus=True)
    assert path.read_bytes() == b'{"text": "ours"}\n' and fetched == 17
    (root / "corpus.jsonl").unlink()
    (root / "corpus.jsonl").symlink_to(outside / "corpus.jsonl")
    with pytest.raises(SourceChanged, match=r"corpus\.jsonl"):
        fetch_source(pinned, store, cache, tmp_path / "in" / "1", corpus=True)


def test_links_inside_a_local_folder_are_not_followed_at_submission(tmp_path: Path) -> None:
    from app.sources import pin_source
    from maec_core.errors import SourceError

    settings, root, _ = _local(tmp_path)
    shard = root / "m" / "model.safetensors"
    shard.rename(root / "m" / "v2.safetensors")
    shard.symlink_to("v2.safetensors")  # inside the folder, yet a link
    with pytest.raises(SourceError, match="without following links") as caught:
        pin_source(parse_source(str(root / "m"), settings), LocalStorage(tmp_path / "s"))
    assert caught.value.code == "invalid_source"


def test_a_file_rewritten_while_it_is_copied_is_refused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from app.sources import pin_source
    from maec_core.errors import SourceChanged

    settings, root, _ = _local(tmp_path)
    store = LocalStorage(tmp_path / "store")
    pinned = pin_source(parse_source(str(root / "m"), settings), store)
    reader = open_source(pinned, store)
    shard = next(f for f in pinned.files if f.name == "model.safetensors")

    def rewrite_midway(chunks: Iterator[bytes], dest: Path, file: object,
                       **kw: object) -> None:
        os.utime(root / "m" / "model.safetensors", ns=(1, 1))  # a write's mtime change
        dest.write_bytes(b"".join(chunks))

    monkeypatch.setattr("app.sources.local.write_verified", rewrite_midway)
    with pytest.raises(SourceChanged, match="rewritten"):
        reader.fetch(shard, tmp_path / "copy")


@pytest.mark.parametrize("change", ["overwritten", "gone"])
def test_s3_objects_are_pinned_at_submission(tmp_path: Path, change: str) -> None:
    from app.sources import pin_source
    from maec_core.errors import SourceChanged

    store = Buckets(tmp_path / "store", sha256=False)
    settings = _s3_settings()
    uri = _put_model(store, "team-a", "models/m", MODEL)
    pinned = pin_source(parse_source(uri, settings), store)
    assert {f.name for f in pinned.files} == {"config.json", "model.safetensors"}
    bucket = store.for_bucket("team-a")
    # Added after the pin: never fetched, even a file a checkpoint could contribute.
    bucket.put_bytes("models/m/tokenizer.json", b"{}")
    if change == "overwritten":
        bucket.put_bytes("models/m/model.safetensors", b"v" * 3000)
    else:
        (bucket.root / "models/m/model.safetensors").unlink()
    cache = InputCache(tmp_path / "cache", 10**6)
    with pytest.raises(SourceChanged, match=change):
        fetch_source(pinned, store, cache, tmp_path / "in" / "0")
    bucket.put_bytes("models/m/model.safetensors", MODEL["model.safetensors"])
    repinned = pin_source(parse_source(uri, settings), store)
    path, _, _ = fetch_source(repinned, store, cache, tmp_path / "in" / "1")
    assert sorted(p.name for p in path.iterdir()) == [
        "config.json", "model.safetensors", "tokenizer.json"]


# --- One cache directory, many processes ----------------------------------------------

_CHILD = r"""
import sys, time
from pathlib import Path
from typing import Any
from worker.inputs import InputCache

root, what, size, wait = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
cache = InputCache(Path(root), 10**9)

def download(tmp):
    tmp.write_bytes(b"x")  # a first chunk
    print("downloading", flush=True)
    time.sleep(wait)
    tmp.write_bytes(b"x" * size)

with cache.hold() as hold:
    entry, hit = cache.get(what, size, download, hold=hold)
    print("hit" if hit else "filled", flush=True)
    sys.stdin.readline()  # holds the entry until told to go
"""


def _child(cache_root: Path, what: str, size: int, wait: float = 0.0
           ) -> subprocess.Popen[str]:
    import sys

    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    return subprocess.Popen([sys.executable, "-c", _CHILD, str(cache_root), what,
                             str(size), str(wait)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env=env)


def _line(proc: subprocess.Popen[str]) -> str:
    assert proc.stdout is not None
    return proc.stdout.readline().strip()


def _release(proc: subprocess.Popen[str]) -> None:
    assert proc.stdin is not None
    proc.stdin.write("\n")
    proc.stdin.flush()
    assert proc.wait(30) == 0


def test_an_entry_held_by_another_process_is_never_evicted(tmp_path: Path) -> None:
    cache = InputCache(tmp_path / "cache", max_bytes=0)
    other = _child(cache.root, "held", 100)
    try:
        assert _line(other) == "downloading" and _line(other) == "filled"
        # Held by a running job elsewhere: still a hit here, at once.
        assert cache.get("held", 100, _fails_midway)[1]
        mine, _ = cache.get("mine", 50, lambda tmp: tmp.write_bytes(b"y" * 50))
        # Over the cap (0): everything not in use goes, the other process's entry stays.
        assert cache.evict() == 50
        assert cache.lookup("held", 100) is not None and not mine.exists()
    finally:
        _release(other)
    assert cache.evict() == 100
    assert list(cache.objects.iterdir()) == [] and list(cache.locks.iterdir()) == []


def test_two_processes_filling_one_entry_download_it_once(tmp_path: Path) -> None:
    cache = InputCache(tmp_path / "cache", max_bytes=10**6)
    first = _child(cache.root, "shared", 1000, wait=1.0)
    try:
        assert _line(first) == "downloading"
        second = _child(cache.root, "shared", 1000)
        try:
            # The second waits for the first's fill, then finds the entry.
            assert _line(second) == "hit"
            assert _line(first) == "filled"
            # An entry being filled or held is skipped by eviction, never half-removed.
            cache.max_bytes = 0
            assert cache.evict() == 0
        finally:
            _release(second)
    finally:
        _release(first)
    assert cache.evict() == 1000


def test_eviction_skips_an_entry_being_filled_by_another_process(tmp_path: Path) -> None:
    cache = InputCache(tmp_path / "cache", max_bytes=0)
    filler = _child(cache.root, "slow", 10, wait=2.0)
    try:
        assert _line(filler) == "downloading"
        assert cache.evict() == 0
        # Its temporary file is not stale (its entry's lock is held): kept.
        assert [p.name.startswith(".") for p in cache.objects.iterdir()] == [True]
        assert _line(filler) == "filled"
    finally:
        _release(filler)


def test_partial_files_and_lock_files_left_behind_are_swept(tmp_path: Path) -> None:
    cache = InputCache(tmp_path / "cache", max_bytes=10**6)
    entry = cache.entry_for("crashed", 10)
    (cache.objects / f".{entry.name}.deadbeef").write_bytes(b"half")  # a killed process
    with pytest.raises(StorageError):
        cache.get("failed", 10, _fails_midway)  # leaves its entry's lock file
    assert len(list(cache.locks.iterdir())) == 1
    cache.evict()
    assert list(cache.objects.iterdir()) == [] and list(cache.locks.iterdir()) == []


def test_a_held_entry_removed_by_hand_is_an_error_not_a_hang(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("app.disk_cache._MAX_SPIN_S", 0.2)
    cache = InputCache(tmp_path / "cache", max_bytes=10**6)
    with cache.hold() as hold:
        entry, _ = cache.get("x", 10, lambda tmp: tmp.write_bytes(b"x" * 10), hold=hold)
        entry.unlink()  # not the cache's doing: it never removes a held entry
        with pytest.raises(StorageError, match="held but missing"):
            cache.get("x", 10, lambda tmp: tmp.write_bytes(b"x" * 10))
    # Once nobody holds it, it is filled again.
    assert not cache.get("x", 10, lambda tmp: tmp.write_bytes(b"x" * 10))[1]


def _ranged(data: bytes, reads: list[tuple[int, int]]
            ) -> Callable[[int, int], Iterator[bytes]]:
    def read(start: int, end: int) -> Iterator[bytes]:
        reads.append((start, end))
        yield data[start:end]
    return read


def test_a_partial_entry_holds_its_ranges_only_and_a_whole_request_completes_it(
        tmp_path: Path) -> None:
    data = os.urandom(200_000)
    key, size = "sha256:" + hashlib.sha256(data).hexdigest(), len(data)
    reads: list[tuple[int, int]] = []
    cache = InputCache(tmp_path / "cache", 10**9)
    with cache.hold() as hold:
        part, got = cache.get_ranges(key, size, [(0, 100), (5000, 6000)], _ranged(data, reads),
                                     hold)
        assert got == 1100 and sorted(reads) == [(0, 100), (5000, 6000)]
        # Never taken for the whole file, though it has the whole file's size.
        assert part.stat().st_size == size and cache.lookup(key, size) is None
        # A later request fetches only what is missing.
        again, got = cache.get_ranges(key, size, [(50, 200), (5500, 7000)],
                                      _ranged(data, reads), hold)
        assert again == part and got == 100 + 1000
        assert sorted(reads[2:]) == [(100, 200), (6000, 7000)]
        assert part.read_bytes()[5000:7000] == data[5000:7000]
        # A whole request completes it: the ranges missing fetched, the whole checked.
        before = len(reads)
        whole, got = cache.complete(key, size, _ranged(data, reads),
                                    hashlib.sha256(data).hexdigest(), hold)
        assert got == size - 200 - 2000 and whole.read_bytes() == data
        assert cache.lookup(key, size) == whole and whole.samefile(part)
        assert not any(a < 200 or 5000 <= a < 7000 for a, _ in reads[before:])
        # From now on the whole entry serves a ranged request: nothing is fetched.
        served, got = cache.get_ranges(key, size, [(0, 10)], _ranged(data, reads), hold)
        assert served == whole and got == 0


def test_a_partial_entry_whose_bytes_do_not_match_is_never_made_whole(
        tmp_path: Path) -> None:
    data = os.urandom(50_000)
    key, size = "sha256:" + hashlib.sha256(data).hexdigest(), len(data)
    wrong = data[:1000] + b"\0" + data[1001:]
    cache = InputCache(tmp_path / "cache", 10**9)
    with cache.hold() as hold:
        cache.get_ranges(key, size, [(0, 4000)], _ranged(wrong, []), hold)
        with pytest.raises(StorageError, match="do not match"):
            cache.complete(key, size, _ranged(data, []), hashlib.sha256(data).hexdigest(),
                           hold)
    assert cache.lookup(key, size) is None
