"""The benchmarks' page-cache priming: what it writes, that it leaves nothing behind, and
that it never takes memory the page cache holds (the inputs a benchmark keeps cached)."""

from __future__ import annotations

from pathlib import Path

import pytest

import bench.common as common

MiB = 1 << 20


def test_priming_writes_the_size_asked_and_removes_its_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(common, "free_memory", lambda: 4 << 30)
    target = tmp_path / "prime.bin"
    assert common.prime_pages(target, 20 * MiB) == 24 * MiB  # whole 8 MiB blocks
    assert not target.exists()
    assert list(tmp_path.iterdir()) == []


def test_priming_stays_within_free_memory_less_a_gib(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(common, "free_memory", lambda: (1 << 30) + 16 * MiB)
    assert common.prime_pages(tmp_path / "prime.bin", 1 << 30) == 16 * MiB
    monkeypatch.setattr(common, "free_memory", lambda: 1 << 30)
    assert common.prime_pages(tmp_path / "prime.bin", 1 << 30) == 0
    assert list(tmp_path.iterdir()) == []


def test_free_memory_reads_the_kernels_figure() -> None:
    meminfo = Path("/proc/meminfo")
    if not meminfo.exists():
        pytest.skip("no /proc/meminfo on this system")
    line = next(ln for ln in meminfo.read_text().splitlines() if ln.startswith("MemFree:"))
    kib = int(line.split()[1])
    # Free memory moves between the two reads; within a GiB of each other.
    assert abs(common.free_memory() - kib * 1024) < 1 << 30
