"""The stored input tensors a group of output shards reads (``shard_reads``), taken from
the engine's own shard plan: a part run on inputs holding only those bytes (the rest
garbage) makes the unsplit merge's shards byte for byte, and a run that would read a
byte range it was not given refuses before reading any."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path
from typing import Any

import pytest

from maec_core.context import RunContext
from maec_core.errors import InputRangeMissing, NotSplittable
from maec_core.parsing import parse_recipe
from maec_core.recipe import Recipe
from maec_core.run import run
from maec_core.runtime import EngineOptions
from maec_core.shard_reads import InputSpan, shard_reads


def _recipe(zoo: dict[str, Path], models: dict[str, Path] | None = None) -> Recipe:
    m = models or zoo
    doc: dict[str, Any] = {
        "merge_method": "ties", "base_model": str(m["base"]), "out_shard_size": "20KB",
        "models": [{"model": str(m["a"]), "parameters": {"weight": 0.6, "density": 0.5}},
                   {"model": str(m["b"]), "parameters": {"weight": 0.4, "density": 0.5}}]}
    return parse_recipe(doc)


def _header_end(path: Path) -> int:
    with open(path, "rb") as f:
        return 8 + int(struct.unpack("<Q", f.read(8))[0])


def _holding_only(zoo: dict[str, Path], reads: dict[str, list[InputSpan]], root: Path
                  ) -> tuple[dict[str, Path], dict[Path, list[tuple[int, int]]]]:
    """Copies of the zoo's base, a and b whose weight files hold their header and the
    ``reads`` byte ranges, every other byte 0xFF (NaN if read); and what each holds."""
    held: dict[Path, list[tuple[int, int]]] = {}
    models: dict[str, Path] = {}
    for key in ("base", "a", "b"):
        src, dest = zoo[key], root / key
        shutil.copytree(src, dest)
        for f in dest.glob("*.safetensors"):
            data = (src / f.name).read_bytes()
            ranges = [(0, _header_end(f))] + [
                (s.start, s.end) for s in reads.get(str(src), []) if s.file.name == f.name]
            out = bytearray(b"\xff" * len(data))
            for a, b in ranges:
                out[a:b] = data[a:b]
            f.write_bytes(bytes(out))
            held[f] = ranges
        models[key] = dest
    return models, held


def _present(held: dict[Path, list[tuple[int, int]]]) -> Any:
    def present(path: Path, start: int, end: int) -> bool:
        ranges = held.get(Path(path))
        return ranges is None or any(a <= start and end <= b for a, b in ranges)
    return present


def test_a_part_given_only_its_reads_makes_the_whole_merges_shards(
        zoo: dict[str, Path], tmp_path: Path) -> None:
    whole = tmp_path / "whole"
    run(_recipe(zoo), whole)
    shards = sorted(p.name for p in whole.glob("model-*.safetensors"))
    n = len(shards)
    assert n >= 4
    lo, hi = 1, 3
    reads = shard_reads(_recipe(zoo), range(lo, hi))
    assert set(reads) == {str(zoo["base"]), str(zoo["a"]), str(zoo["b"])}
    index = json.loads((whole / "model.safetensors.index.json").read_text())["weight_map"]
    wanted = {t for t, shard in index.items() if shard in shards[lo:hi]}
    for spans in reads.values():
        assert {s.name for s in spans} == wanted
    # Together the parts read every tensor once per input; one part reads less.
    every = shard_reads(_recipe(zoo), range(n))
    total = sum(s.end - s.start for spans in every.values() for s in spans)
    part = sum(s.end - s.start for spans in reads.values() for s in spans)
    assert 0 < part < total

    models, held = _holding_only(zoo, reads, tmp_path / "held")
    out = tmp_path / "part"
    run(_recipe(zoo, models), out, RunContext(options=EngineOptions(
        part=(lo, hi), present=_present(held))))
    for name in shards[lo:hi]:
        assert (out / name).read_bytes() == (whole / name).read_bytes(), name
    # The run's manifest names no digest of a file it holds only in part.
    manifest = json.loads((out / "manifest.json").read_text())
    assert all(not doc["files"] for doc in manifest["inputs"].values())


def test_a_run_that_would_read_an_unfetched_range_refuses(zoo: dict[str, Path],
                                                          tmp_path: Path) -> None:
    reads = shard_reads(_recipe(zoo), [1])
    models, held = _holding_only(zoo, reads, tmp_path / "held")
    out = tmp_path / "out"
    # Shard 2's tensors were never fetched: asked for, the run refuses before any read.
    with pytest.raises(InputRangeMissing, match="was not fetched"):
        run(_recipe(zoo, models), out, RunContext(options=EngineOptions(
            part=(1, 3), present=_present(held))))
    assert not out.exists()


def test_reads_are_refused_where_they_are_not_named_by_shard(zoo: dict[str, Path]) -> None:
    with pytest.raises(NotSplittable, match="not one of the"):
        shard_reads(_recipe(zoo), [10_000])
    slices = parse_recipe({"merge_method": "linear", "slices": [{"sources": [
        {"model": str(zoo["a"]), "layer_range": [0, 1]}]}]})
    with pytest.raises(NotSplittable, match="not a plain"):
        shard_reads(slices, [0])
