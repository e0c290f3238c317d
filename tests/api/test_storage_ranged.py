"""The file a ranged download writes into: parts land in any order (and a retried part
lands twice), the sink sees the file's bytes in order, each once."""

from __future__ import annotations

import hashlib
import os
import random
from pathlib import Path

import pytest

from app.storage.ranged import InOrderFile


def _write(f: InOrderFile, data: bytes, start: int, end: int) -> None:
    f.seek(start)
    f.write(data[start:end])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_parts_in_any_order_reach_the_sink_in_order(tmp_path: Path, seed: int) -> None:
    data = os.urandom(3 * 1024 * 1024 + 777)
    part = 256 * 1024
    parts = [(s, min(s + part, len(data))) for s in range(0, len(data), part)]
    order = parts[:]
    random.Random(seed).shuffle(order)
    # A retried part: written again, in full, after the sink has taken it.
    order.insert(len(order) // 2, order[0])
    seen = hashlib.sha256()
    f = InOrderFile(tmp_path / "out", seen.update)
    written: set[tuple[int, int]] = set()
    for start, end in order:
        _write(f, data, start, end)
        written.add((start, end))
        # Everything up to the first gap is handed on, nothing past it.
        gap = min((s for s, e in parts if (s, e) not in written), default=len(data))
        assert f.handed == gap
    f.close()
    assert f.handed == len(data)
    assert seen.hexdigest() == hashlib.sha256(data).hexdigest()
    assert (tmp_path / "out").read_bytes() == data


def test_a_part_overlapping_what_was_handed_on(tmp_path: Path) -> None:
    data = bytes(range(256)) * 100
    got = bytearray()
    f = InOrderFile(tmp_path / "out", got.extend)
    _write(f, data, 0, 1000)
    _write(f, data, 500, 3000)  # overlaps: only bytes past 1000 are new
    _write(f, data, 5000, len(data))  # early
    assert bytes(got) == data[:3000]
    _write(f, data, 3000, 5000)  # fills the gap: the early part follows
    f.close()
    assert bytes(got) == data
