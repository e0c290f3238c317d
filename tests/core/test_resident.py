"""Input files held in memory (``maec_core.io.resident``): every reader serves their
tensors from there, byte for byte as the file holds them, and a merge's output does not
change."""

from __future__ import annotations

import json
import os
import struct
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import maec_core.io.reader as reader_mod
from maec_core.context import RunContext
from maec_core.io.folder import open_model_folder
from maec_core.io.headers import read_header
from maec_core.io.reader import TensorReader
from maec_core.io.resident import ResidentFiles, held_bytes, tensor_files
from maec_core.io.units import UnitReader
from maec_core.maec.rowio import RowReader
from maec_core.parsing import parse_recipe
from maec_core.run import run
from maec_core.runtime import EngineOptions
from maec_core.sweep.memory import default_budget


@pytest.fixture
def reads(monkeypatch: pytest.MonkeyPatch) -> Iterator[Counter[str]]:
    """Bytes read with ``pread`` and files opened by the whole-tensor reader, by real
    path (the two ways the engine reads inputs)."""
    seen: Counter[str] = Counter()
    real_preadv, real_open = os.preadv, open

    def preadv(fd: int, buffers: Any, offset: int, *rest: Any) -> int:
        got = real_preadv(fd, buffers, offset, *rest)
        seen[os.readlink(f"/proc/self/fd/{fd}")] += got
        return got

    def opened(path: Any, *args: Any, **kw: Any) -> Any:
        seen[os.path.realpath(path)] += 1
        return real_open(path, *args, **kw)

    monkeypatch.setattr(os, "preadv", preadv)
    monkeypatch.setattr(reader_mod, "open", opened, raising=False)
    yield seen


def _file_bytes(path: Path, start: int, end: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(start)
        return f.read(end - start)


def test_held_bytes_are_the_files_and_follow_the_file_not_its_spelling(
        bf16_zoo: dict[str, Path], tmp_path: Path) -> None:
    folder = open_model_folder(bf16_zoo["a"])
    files = tensor_files(folder.tensors)
    held = ResidentFiles.read([*files, *files])  # named twice, held once
    assert held.nbytes == held_bytes(files) == sum(t.nbytes for t in folder.tensors.values())
    for info in folder.tensors.values():
        span = held.span(info)
        assert span is not None
        assert span.numpy().tobytes() == _file_bytes(info.file, info.start, info.end)
        part = held.span(info, 2, 6)
        assert part is not None and part.numpy().tobytes() == _file_bytes(
            info.file, info.start + 2, info.start + 6)
    # The same file by another path (a link to it) is the held file.
    (tmp_path / "link").symlink_to(bf16_zoo["a"])
    info = next(iter(open_model_folder(tmp_path / "link").tensors.values()))
    assert held.span(info) is not None
    # Another file is not held; nor is a held file once it has changed on disk.
    other = next(iter(open_model_folder(bf16_zoo["b"]).tensors.values()))
    assert held.span(other) is None
    copy = tmp_path / "copy"
    copy.mkdir()
    (copy / "model.safetensors").write_bytes(files[0].read_bytes())
    mine = ResidentFiles.read([copy / "model.safetensors"])
    first = read_header(copy / "model.safetensors").tensors
    assert mine.span(next(iter(first.values()))) is not None
    os.utime(copy / "model.safetensors", ns=(1, 1))
    again = ResidentFiles(mine.files)  # a fresh lookup sees the new modification time
    assert again.span(next(iter(first.values()))) is None


@pytest.mark.parametrize("method", ["task_arithmetic", "ties"])
def test_a_merge_from_held_inputs_reads_none_of_them_and_gives_the_same_bytes(
        bf16_zoo: dict[str, Path], tmp_path: Path, reads: Counter[str], method: str
) -> None:
    # task arithmetic streams slices (the element-wise reader); TIES takes whole tensors.
    recipe = parse_recipe({
        "merge_method": method, "base_model": str(bf16_zoo["base"]),
        "models": [{"model": str(bf16_zoo["a"]), "parameters": {"weight": 0.7,
                                                               "density": 0.5}},
                   {"model": str(bf16_zoo["b"]), "parameters": {"weight": 0.4,
                                                               "density": 0.5}}]})
    files = [f for k in ("base", "a", "b") for f in tensor_files(
        open_model_folder(bf16_zoo[k]).tensors)]
    run(recipe, tmp_path / "read", RunContext(device="cpu"))
    assert all(reads[os.path.realpath(f)] for f in files)
    held = ResidentFiles.read(files)
    reads.clear()
    run(recipe, tmp_path / "held", RunContext(device="cpu", options=EngineOptions(resident=held)))
    assert not any(reads[os.path.realpath(f)] for f in files)
    for name in ("model.safetensors", "manifest.json"):
        assert (tmp_path / "held" / name).read_bytes() == (
            tmp_path / "read" / name).read_bytes(), name


def _handmade(path: Path) -> Path:
    """A safetensors file whose F32 tensor starts 2 bytes past a 4-byte boundary (after
    an F16 tensor of 3 values): a view of the held bytes as float32 is impossible."""
    h = torch.tensor([1.5, -2.0, 3.25], dtype=torch.float16)
    f = torch.arange(10, dtype=torch.float32) / 3
    header = json.dumps({
        "h": {"dtype": "F16", "shape": [3], "data_offsets": [0, 6]},
        "f": {"dtype": "F32", "shape": [2, 5], "data_offsets": [6, 46]}}).encode()
    header += b" " * (-len(header) % 8)
    path.write_bytes(struct.pack("<Q", len(header)) + header
                     + h.numpy().tobytes() + f.numpy().tobytes())
    return path


@pytest.mark.parametrize("pin", [False, True])
def test_every_reader_serves_held_bytes_aligned_or_not(tmp_path: Path, pin: bool) -> None:
    if pin and not torch.cuda.is_available():
        pytest.skip("pinned buffers need CUDA")
    path = _handmade(tmp_path / "odd.safetensors")
    infos = read_header(path).tensors
    held = ResidentFiles.read([path])
    steps = [[infos["h"]], [infos["f"]]]
    for resident in (None, held):
        with UnitReader(steps, 4, pin=pin, resident=resident) as units:
            got: list[list[float]] = [[], []]
            for u in units:
                got[u.step] += u.tensors[0].float().tolist()
                if resident is not None and not pin and u.step == 0:
                    # Bytes that can be viewed as they are held are not even copied.
                    start = held.files[0].data.data_ptr()
                    assert start <= u.tensors[0].data_ptr() < start + held.files[0].data.numel()
                u.release()
        assert got[0] == [1.5, -2.0, 3.25]
        assert got[1] == (torch.arange(10, dtype=torch.float32) / 3).tolist()
        with TensorReader(pin=pin, resident=resident) as whole:
            t = whole.read(infos["f"])
            t.zero_()  # a caller's tensor is its own: the held bytes stay as they were
        with RowReader(resident) as rows:
            assert torch.equal(rows.read_rows(infos["f"], torch.tensor([0, 1])),
                               torch.arange(10, dtype=torch.float32).reshape(2, 5) / 3)
            assert rows.read(infos["h"]).tolist() == [1.5, -2.0, 3.25]
    assert held.span(infos["f"]) is not None
    assert bytes(held.span(infos["f"]).numpy()) == _file_bytes(path, infos["f"].start,
                                                                infos["f"].end)


def test_default_budget_is_half_the_available_memory_less_the_scoring_model() -> None:
    assert default_budget(100, available=1000) == 400
    assert default_budget(600, available=1000) == 0
    assert default_budget(0) > 0
