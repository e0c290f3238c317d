"""The streaming reader's mapped windows: the same bytes as reads, unmapped once used,
and a file that shrinks under a window fails the merge instead of killing the process."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from maec_core import native
from maec_core.errors import CorruptCheckpoint
from maec_core.io.headers import read_header
from maec_core.io.units import MAP_MIN_BYTES, UnitReader

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(native.mapped_windows() is None,
                                reason="the compiled library is not built here")

# Elements per unit: 2 MB of bfloat16, large enough to be mapped.
UNIT = MAP_MIN_BYTES


def _checkpoint(path: Path, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tensors = {
        # One odd-sized, unaligned run after the small one: mapped at a page-misaligned
        # offset (the view starts inside the first page).
        "a.norm": torch.randn(3, generator=g).to(torch.bfloat16),
        "b.weight": torch.randn(1536, 2049, generator=g).to(torch.bfloat16),
        "c.weight": torch.randn(4 * UNIT + 5, generator=g).to(torch.bfloat16),
    }
    save_file(tensors, path, metadata={"format": "pt"})
    return tensors


def _steps(paths: list[Path]) -> list[list]:
    headers = [read_header(p).tensors for p in paths]
    return [[h[name] for h in headers] for name in sorted(headers[0])]


def _stream(steps: list[list], windows: native.MappedWindows | None) -> list[list[bytes]]:
    got: list[list[bytes]] = [[] for _ in steps]
    with UnitReader(steps, UNIT, windows=windows) as units:
        for u in units:
            got[u.step].append(b"".join(t.view(torch.uint8).numpy().tobytes()
                                        for t in u.tensors))
            u.release()
    return got


def test_windows_give_the_bytes_reads_give(tmp_path: Path) -> None:
    paths = [tmp_path / f"m{i}.safetensors" for i in range(3)]
    for i, p in enumerate(paths):
        _checkpoint(p, i)
    steps = _steps(paths)
    before = native.map_faults()
    assert _stream(steps, native.mapped_windows()) == _stream(steps, None)
    assert native.map_faults() == before


def _evicted(path: Path, offset: int = 0, length: int = 0) -> bool:
    """Drop ``path``'s pages (``length`` bytes at ``offset``; 0: to the end) from the page
    cache; False where the filesystem keeps them (tmpfs: its pages are the file)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return subprocess.run(["stat", "-f", "-c", "%T", str(path)], capture_output=True,
                          text=True).stdout.strip() != "tmpfs"


@pytest.fixture(params=["cachestat", "mincore"])
def cache_probe(request: pytest.FixtureRequest) -> Iterator[str]:
    """Each way the library asks what is cached: cachestat (Linux 6.5), and mincore, what
    it falls back to on older kernels; on a kernel without cachestat both are mincore."""
    loaded = native._library()
    assert loaded is not None
    loaded[0].maec_use_cachestat(int(request.param == "cachestat"))
    yield request.param
    loaded[0].maec_use_cachestat(1)


@pytest.mark.usefixtures("cache_probe")
def test_only_bytes_in_the_page_cache_are_mapped(tmp_path: Path) -> None:
    # Pages that must come from the disk are read, not faulted in through a window.
    path = tmp_path / "m.safetensors"
    data = bytes(range(256)) * (1 << 14)
    path.write_bytes(data)
    windows = native.mapped_windows()
    assert windows is not None
    fd = os.open(path, os.O_RDONLY)
    try:
        if not _evicted(path):
            pytest.skip("this filesystem keeps every page in memory")
        assert not windows.cached(fd, len(data))
        assert windows.view(fd, 4096, len(data) - 4096) is None
        assert path.read_bytes() == data  # now cached
        assert windows.cached(fd, len(data))
        view = windows.view(fd, 4096, len(data) - 4096)
        assert view is not None
        assert view.tobytes() == data[4096:]
        del view
    finally:
        os.close(fd)
    assert _mapped_ranges(path) == 0


@pytest.mark.usefixtures("cache_probe")
def test_a_window_over_evicted_pages_is_not_mapped(tmp_path: Path) -> None:
    # 2 MB evicted at 2 MB of an 8 MB file (whole folios, however large the kernel
    # makes them): a window touching any of it is read, one beside it is mapped.
    path = tmp_path / "m.safetensors"
    page, mb = os.sysconf("SC_PAGE_SIZE"), 1 << 20
    data = bytes(range(256)) * (8 * mb // 256)
    path.write_bytes(data)
    windows = native.mapped_windows()
    assert windows is not None
    if not _evicted(path, 2 * mb, 2 * mb):
        pytest.skip("this filesystem keeps every page in memory")
    fd = os.open(path, os.O_RDONLY)
    try:
        assert not windows.cached(fd, len(data))
        for lo, hi in [(0, 8 * mb), (2 * mb, 4 * mb), (mb, 3 * mb), (2 * mb - page, 2 * mb + page),
                       (4 * mb - page, 4 * mb + page), (3 * mb, 5 * mb)]:
            assert windows.view(fd, lo, hi - lo) is None, (lo, hi)
        for lo, hi in [(0, 2 * mb), (4 * mb, 8 * mb), (2 * mb - page, 2 * mb),
                       (4 * mb, 4 * mb + page)]:
            view = windows.view(fd, lo, hi - lo)
            assert view is not None, (lo, hi)
            assert view.tobytes() == data[lo:hi]
            del view
    finally:
        os.close(fd)
    assert _mapped_ranges(path) == 0


@pytest.mark.usefixtures("cache_probe")
def test_a_file_not_all_cached_when_opened_is_read(tmp_path: Path) -> None:
    # Even the units of it that are cached by the time they are reached: a merge of inputs
    # larger than memory reads them all.
    paths = [tmp_path / f"m{i}.safetensors" for i in range(2)]
    for i, p in enumerate(paths):
        _checkpoint(p, i)
    steps = _steps(paths)
    expected = _stream(steps, None)
    if not _evicted(paths[1]):
        pytest.skip("this filesystem keeps every page in memory")
    most = [0, 0]
    with UnitReader(steps, UNIT, windows=native.mapped_windows()) as units:
        for u in units:
            most = [max(m, _mapped_ranges(p)) for m, p in zip(most, paths, strict=True)]
            u.release()
    assert most[0] > 0 and most[1] == 0
    assert _stream(steps, native.mapped_windows()) == expected


def _mapped_ranges(path: Path) -> int:
    """How many ranges of ``path`` this process has mapped now."""
    text = Path("/proc/self/maps").read_text()
    return sum(1 for line in text.splitlines() if line.endswith(str(path)))


def test_windows_are_unmapped_once_used(tmp_path: Path) -> None:
    path = tmp_path / "m.safetensors"
    _checkpoint(path, 0)
    steps = _steps([path])
    most = 0
    depth = 2
    with UnitReader(steps, UNIT, depth=depth, windows=native.mapped_windows()) as units:
        for u in units:
            most = max(most, _mapped_ranges(path))
            u.release()
            del u
    # The units in flight at most (each held by its buffer set), never the whole file;
    # none once the reader is done with.
    assert 1 <= most <= depth + 1
    assert _mapped_ranges(path) == 0


def test_a_file_shrinking_under_a_mapped_window_fails_the_read(tmp_path: Path) -> None:
    path = tmp_path / "m.safetensors"
    _checkpoint(path, 0)
    header = read_header(path)
    steps = [[header.tensors["c.weight"]]]
    before = native.map_faults()
    with (pytest.raises(CorruptCheckpoint, match="truncated") as info,
          UnitReader(steps, UNIT, depth=3, windows=native.mapped_windows()) as units):
        first = next(units)
        # Once the next units are mapped (read ahead), the bytes go away under them.
        deadline = time.monotonic() + 60
        while _mapped_ranges(path) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert _mapped_ranges(path) >= 3
        with open(path, "r+b") as f:
            f.truncate(header.data_start)
        total = first.tensors[0].float().abs().sum()
        first.release()
        for u in units:
            total += u.tensors[0].float().abs().sum()  # reads zeros, does not crash
            u.release()
    assert info.value.details["file"] == path.name
    assert native.map_faults() > before  # the guard answered, the process lived on


def test_a_sigbus_outside_every_window_still_ends_the_process(tmp_path: Path) -> None:
    """The guard answers faults in its own windows only: any other mapping of a file
    that shrank still gets the signal's default action."""
    victim = tmp_path / "other.bin"
    victim.write_bytes(b"\1" * (1 << 16))
    script = textwrap.dedent(f"""
        import mmap, os, sys
        from maec_core import native
        assert native.mapped_windows() is not None  # the guard is installed
        fd = os.open({str(victim)!r}, os.O_RDWR)
        m = mmap.mmap(fd, 1 << 16)
        os.ftruncate(fd, 0)
        print(m[1 << 15], flush=True)
    """)
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == -7, (done.returncode, done.stderr)  # SIGBUS


def test_a_donor_shrinking_mid_merge_publishes_nothing(tmp_path: Path) -> None:
    """Through the engine, with tensors large enough to be mapped: the merge fails with
    corrupt_checkpoint and leaves no output."""
    from maec_core.context import RunContext
    from maec_core.parsing import parse_recipe
    from maec_core.run import run
    from tests.factories import make_llama

    shape = {"vocab_size": 4096, "hidden_size": 256, "intermediate_size": 1024}
    base = make_llama(tmp_path / "base", 1, dtype=torch.bfloat16, **shape)
    donor = make_llama(tmp_path / "donor", 2, dtype=torch.bfloat16, like=base, **shape)
    weights = donor / "model.safetensors"
    data_start = read_header(weights).data_start

    def progress(stage: str, done: int, total: int) -> None:
        if done == 1:
            with open(weights, "r+b") as f:
                f.truncate(data_start)

    recipe = {"merge_method": "task_arithmetic", "base_model": str(base), "dtype": "bfloat16",
              "models": [{"model": str(donor), "parameters": {"weight": 0.5}}]}
    out = tmp_path / "out" / "merged"
    with pytest.raises(CorruptCheckpoint, match="truncated"):
        run(parse_recipe(recipe), out, RunContext(progress=progress))
    assert not out.exists()
    assert list(out.parent.iterdir()) == []
