"""The I/O paths' cost cutting changes no byte: a shard's disk space is reserved as it
is created, yet the file still grows only as it is written (a follower uploading it
reads every byte below its size as final); input readahead hints change no result;
the 7B benchmark's depth can be cut for a harness check."""

from __future__ import annotations

import argparse
import hashlib
import os
from pathlib import Path

import torch

from bench.engine import family
from maec_core.io.headers import read_header
from maec_core.io.units import UnitReader
from maec_core.io.writer import OutputTensor, ShardedWriter, reserve


def test_a_reserved_shard_keeps_its_size_and_its_bytes(tmp_path: Path) -> None:
    specs = [OutputTensor("a", (4096,), "F32"), OutputTensor("b", (1000,), "BF16")]
    a = torch.arange(4096, dtype=torch.float32)
    b = torch.linspace(-1, 1, 1000).to(torch.bfloat16)
    sizes: list[int] = []
    writer = ShardedWriter(tmp_path, specs, 1 << 30, parallel_io=True,
                           on_shard_open=lambda p, _n, _s: sizes.append(p.stat().st_size))
    writer.write("a", a)
    path = tmp_path / "model.safetensors"
    # Only the header and the first tensor can be in the file so far, whatever is
    # reserved on disk for the rest.
    mid = path.stat().st_size
    writer.write("b", b)
    files = writer.close()
    raw = path.read_bytes()
    header_len = 8 + int.from_bytes(raw[:8], "little")
    assert sizes[0] <= header_len
    assert mid <= header_len + 4096 * 4 < len(raw)
    assert len(raw) == header_len + 4096 * 4 + 1000 * 2 == files[0].size
    assert files[0].sha256 == hashlib.sha256(raw).hexdigest()
    assert raw[header_len:header_len + 4096 * 4] == a.numpy().tobytes()
    assert raw[header_len + 4096 * 4:] == b.view(torch.int16).numpy().tobytes()


def test_reserve_sets_aside_blocks_without_growing_the_file(tmp_path: Path) -> None:
    path = tmp_path / "f.bin"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        reserved = reserve(fd, 8 << 20)
        assert os.fstat(fd).st_size == 0
        if reserved:  # a filesystem without fallocate(2) just says no
            assert os.fstat(fd).st_blocks * 512 >= 8 << 20
        assert reserve(fd, 0) is False
    finally:
        os.close(fd)


def test_units_read_with_readahead_hints_are_the_stored_bytes(tmp_path: Path) -> None:
    tensors = [("x", torch.randn(10_000)), ("y", torch.randn(77, 13))]
    writer = ShardedWriter(tmp_path, [OutputTensor(n, tuple(t.shape), "F32")
                                      for n, t in tensors], 1 << 30)
    for n, t in tensors:
        writer.write(n, t)
    writer.close()
    infos = read_header(tmp_path / "model.safetensors").tensors
    steps = [[infos[n]] for n, _ in tensors]
    got: dict[int, list[torch.Tensor]] = {0: [], 1: []}
    with UnitReader(steps, unit=1024) as units:
        for u in units:
            got[u.step].append(u.tensors[0].clone())
            u.release()
    for i, (_, t) in enumerate(tensors):
        assert torch.equal(torch.cat(got[i]), t.reshape(-1))


def test_the_7b_family_can_be_cut_to_a_few_layers() -> None:
    def args(layers: int | None) -> argparse.Namespace:
        return argparse.Namespace(small=False, shape="7b", layers=layers)

    full, tag = family(args(None))
    cut, cut_tag = family(args(2))
    assert (full.layers, tag) == (32, "llama-7b")
    assert (cut.layers, cut.hidden, cut.intermediate) == (2, 4096, 11008)
    assert cut_tag == "llama-7b-2l"
    assert cut.params() < full.params() / 8
