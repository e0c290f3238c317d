"""The worker's local copies of ability artifacts: used only while storage holds the
artifact, capped in size with the least recently used going first, never one a job holds.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from app.artifacts import StorageArtifactStore
from app.disk_cache import Hold
from app.storage.base import ObjectInfo, StorageError
from app.storage.local import LocalStorage

A, B, C = "a" * 64, "b" * 64, "c" * 64
VECTOR = 1000  # bytes of each artifact's weights file


class Flaky(LocalStorage):
    """A store that may be unreachable (``down``)."""

    down = False

    def head(self, key: str) -> ObjectInfo | None:
        if self.down:
            raise StorageError("connection refused")
        return super().head(key)

    def list(self, prefix: str) -> list[ObjectInfo]:
        if self.down:
            raise StorageError("connection refused")
        return super().list(prefix)


def _stored(storage: LocalStorage, tmp_path: Path, *keys: str) -> None:
    for key in keys:
        folder = tmp_path / "made" / key
        folder.mkdir(parents=True)
        (folder / "ability.safetensors").write_bytes(key[:1].encode() * VECTOR)
        (folder / "ability.json").write_text(json.dumps({"key": key}))
        StorageArtifactStore(storage, tmp_path / "extractor", 10**9).put(key, folder)


def _aged(path: Path, seconds: float) -> None:
    past = time.time() - seconds
    os.utime(path, (past, past))


def test_a_copy_of_an_artifact_gone_from_storage_is_dropped(tmp_path: Path) -> None:
    storage = LocalStorage(tmp_path / "s")
    _stored(storage, tmp_path, A)
    used: list[str] = []
    store = StorageArtifactStore(storage, tmp_path / "w", 10**9, on_use=used.append)
    copy = store.get(A)
    assert copy is not None and (copy / "ability.safetensors").read_bytes() == b"a" * VECTOR
    assert store.get(A) == copy and used == [A, A]
    storage.delete_prefix(f"artifacts/{A}/")  # collected by another worker's sweep
    assert store.get(A) is None
    assert not copy.exists() and used == [A, A]  # never reported in use again
    assert list(store.copies.objects.iterdir()) == [] and list(store.copies.locks.iterdir()) == []
    # Extracted and stored again: fetched again.
    _stored(storage, tmp_path / "again", A)
    assert store.get(A) == copy and copy.is_dir()


def test_a_copy_in_use_is_not_dropped_but_not_returned_either(tmp_path: Path) -> None:
    storage = LocalStorage(tmp_path / "s")
    _stored(storage, tmp_path, A)
    with Hold() as hold:
        job = StorageArtifactStore(storage, tmp_path / "w", 10**9, hold=hold)
        copy = job.get(A)
        assert copy is not None
        storage.delete_prefix(f"artifacts/{A}/")
        other = StorageArtifactStore(storage, tmp_path / "w", 10**9)
        assert other.get(A) is None
        assert (copy / "ability.json").is_file()  # the running job still reads it
        assert len(hold) == 1
        assert job.get(A) is None and len(hold) == 1  # gone for this job too
        _stored(storage, tmp_path / "again", A)
        assert job.get(A) == copy and job.get(A) == copy and len(hold) == 1  # one lock
    storage.delete_prefix(f"artifacts/{A}/")
    assert other.get(A) is None and not copy.exists()


def test_storage_unreachable_uses_the_copy_and_fails_without_one(tmp_path: Path) -> None:
    storage = Flaky(tmp_path / "s")
    _stored(storage, tmp_path, A, B)
    store = StorageArtifactStore(storage, tmp_path / "w", 10**9)
    copy = store.get(A)
    storage.down = True
    assert store.get(A) == copy
    with pytest.raises(StorageError):
        store.get(B)  # nothing local to fall back on: as before, the store's error
    storage.down = False
    assert store.get(B) is not None


def test_a_small_cap_evicts_the_least_recently_used_copy_never_a_held_one(
        tmp_path: Path) -> None:
    storage = LocalStorage(tmp_path / "s")
    _stored(storage, tmp_path, A, B, C)
    cap = 2 * VECTOR + 200  # two copies (weights and metadata) fit, not three
    with Hold() as hold:
        running = StorageArtifactStore(storage, tmp_path / "w", cap, hold=hold)
        a = running.get(A)
        assert a is not None
        _aged(a, 100)  # the least recently used, yet held by a running job
        store = StorageArtifactStore(storage, tmp_path / "w", cap)
        b = store.get(B)
        assert b is not None
        _aged(b, 50)
        c = store.get(C)
        assert c is not None
        # Room for c: a is older but in use, so b went.
        assert a.is_dir() and not b.exists() and c.is_dir()
    # Released: a is now the one to go.
    assert store.get(B) == b and not a.exists() and c.is_dir()
    assert sorted(p.name for p in store.copies.objects.iterdir()) == [B, C]


_CHILD = r"""
import sys
from pathlib import Path
from app.artifacts import StorageArtifactStore
from app.disk_cache import Hold
from app.storage.local import LocalStorage

storage, local, key = sys.argv[1:]
with Hold() as hold:
    copy = StorageArtifactStore(LocalStorage(Path(storage)), Path(local), 0,
                                hold=hold).get(key)
    print(copy, flush=True)
    sys.stdin.readline()  # a job reading it until told to end
"""


def test_a_copy_held_by_another_process_survives_a_cap_of_zero(tmp_path: Path) -> None:
    storage = LocalStorage(tmp_path / "s")
    _stored(storage, tmp_path, A, B)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    child = subprocess.Popen([sys.executable, "-c", _CHILD, str(tmp_path / "s"),
                              str(tmp_path / "w"), A], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True, env=env)
    assert child.stdin is not None and child.stdout is not None
    try:
        a = Path(child.stdout.readline().strip())
        assert (a / "ability.json").is_file()
        store = StorageArtifactStore(storage, tmp_path / "w", 0)
        b = store.get(B)  # every copy nobody holds goes first: a is held elsewhere
        assert b is not None and a.is_dir()
        size = VECTOR + (b / "ability.json").stat().st_size
        assert store.copies.evict() == size
        assert a.is_dir() and not b.exists()
    finally:
        child.stdin.write("\n")
        child.stdin.flush()
        assert child.wait(30) == 0
    assert store.copies.evict() > 0 and not a.exists()


def test_delete_drops_this_workers_copy_and_earlier_layouts_are_cleared(
        tmp_path: Path) -> None:
    storage = LocalStorage(tmp_path / "s")
    _stored(storage, tmp_path, A, B)
    local = tmp_path / "w"
    # Copies as earlier versions kept them, directly in the folder: never read, removed
    # when the worker next makes room.
    for name in (C, f".{C}.1234abcd"):
        (local / name).mkdir(parents=True)
        (local / name / "ability.json").write_text("{}")
    store = StorageArtifactStore(storage, local, 10**9)
    assert store.get(C) is None and (local / C).is_dir()
    a = store.get(A)
    assert a is not None and not (local / C).exists() and not (local / f".{C}.1234abcd").exists()
    store.delete(A)
    assert not a.exists() and storage.list(f"artifacts/{A}/") == []
