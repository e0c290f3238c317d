"""The local-directory backend: atomic writes, ranges, listing, refusal of escaping keys."""

from __future__ import annotations

from pathlib import Path

import pytest

from app.storage.base import StorageError
from app.storage.local import LocalStorage


def test_roundtrip_ranges_listing_and_delete(tmp_path: Path) -> None:
    s = LocalStorage(tmp_path / "store")
    src = tmp_path / "f.bin"
    src.write_bytes(bytes(range(256)) * 10)
    s.put_file("jobs/j1/a1/f.bin", src)
    s.put_bytes("jobs/j1/a1/manifest.json", b"{}")
    assert s.get_bytes("jobs/j1/a1/manifest.json") == b"{}"
    assert s.get_range("jobs/j1/a1/f.bin", 10, 19) == bytes(range(10, 20))
    assert b"".join(s.iter_range("jobs/j1/a1/f.bin", 2550, 2559)) == bytes(range(246, 256))
    assert [o.key for o in s.list("jobs/j1/")] == ["jobs/j1/a1/f.bin", "jobs/j1/a1/manifest.json"]
    head = s.head("jobs/j1/a1/f.bin")
    assert head is not None and head.size == 2560
    assert s.head("jobs/none") is None
    s.delete_prefix("jobs/j1/")
    assert s.list("jobs/") == [] and s.presign("x", 60) is None
    assert s.ping()


@pytest.mark.parametrize("key", ["../x", "/abs", "a//b", "a/./b", "a/../../b", ""])
def test_escaping_keys_are_refused(tmp_path: Path, key: str) -> None:
    with pytest.raises(StorageError):
        LocalStorage(tmp_path).put_bytes(key, b"x")
