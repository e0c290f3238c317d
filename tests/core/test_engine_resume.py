"""A merge resumed from shards an earlier run already made: the done shards' tensors are
neither read nor computed, and the folder, with those shards put back, is the
uninterrupted run's byte for byte. Likewise the parts of a merge split by shard groups."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path
from typing import Any

import pytest

from maec_core.context import RunContext
from maec_core.errors import MaecError
from maec_core.io.writer import INDEX_NAME, OutputTensor, WrittenFile, shard_index
from maec_core.parsing import parse_recipe
from maec_core.run import run
from maec_core.runtime import EngineOptions


def _recipe(zoo: dict[str, Path], method: str) -> dict[str, Any]:
    extra = {"density": 0.5} if method == "ties" else {}
    return {"merge_method": method, "base_model": str(zoo["base"]), "out_shard_size": "20KB",
            "models": [{"model": str(zoo["a"]), "parameters": {"weight": 0.6, **extra}},
                       {"model": str(zoo["b"]), "parameters": {"weight": 0.4, **extra}}]}


def _files(out: Path) -> dict[str, WrittenFile]:
    manifest = json.loads((out / "manifest.json").read_text())
    return {f["path"]: WrittenFile(f["path"], f["size"], f["sha256"])
            for f in manifest["files"]}


# task_arithmetic streams slices, ties goes whole tensor by tensor: both loops skip.
@pytest.mark.parametrize("method", ["task_arithmetic", "ties"])
def test_resumed_merge_makes_only_the_missing_shards(zoo: dict[str, Path], tmp_path: Path,
                                                     method: str) -> None:
    recipe = parse_recipe(_recipe(zoo, method))
    whole = tmp_path / "whole"
    run(recipe, whole)
    shards = sorted(p.name for p in whole.glob("model-*.safetensors"))
    assert len(shards) >= 4
    files = _files(whole)
    # Every other shard is done; one more is given with a wrong size (another plan's
    # file): it must be made again, not trusted.
    done = {n: files[n] for n in shards[::2]}
    wrong = shards[1]
    done[wrong] = WrittenFile(wrong, files[wrong].size + 8, files[wrong].sha256)
    made: list[str] = []
    reports: list[tuple[str, int, int]] = []
    ctx = RunContext(progress=lambda s, d, t: reports.append((s, d, t)), options=EngineOptions(
        done_shards=done, on_shard=lambda _p, w: made.append(w.path)))
    resumed = tmp_path / "resumed"
    run(recipe, resumed, ctx)
    assert sorted(made) == sorted(set(shards) - set(shards[::2]))
    assert not any((resumed / n).exists() for n in shards[::2])
    for n in shards[::2]:
        shutil.copy(whole / n, resumed / n)
    assert sorted(p.name for p in resumed.iterdir()) == sorted(p.name for p in whole.iterdir())
    for p in whole.iterdir():
        assert (resumed / p.name).read_bytes() == p.read_bytes(), p.name
    # Progress counts the done shards' tensors as done: it never goes back, and it ends
    # at the whole count.
    merged = [(d, t) for s, d, t in reports if s == "merge"]
    assert merged[-1][0] == merged[-1][1]
    assert [d for d, _ in merged] == sorted(d for d, _ in merged)


def _planned(folder: Path) -> list[OutputTensor]:
    """The output tensors in plan order, read back from the shards' headers."""
    out: list[OutputTensor] = []
    for shard in sorted(folder.glob("model-*.safetensors")):
        with open(shard, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
        header.pop("__metadata__", None)
        for name, d in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
            out.append(OutputTensor(name, tuple(d["shape"]), d["dtype"]))
    return out


def test_parts_of_a_split_merge_make_the_whole_merges_shards(zoo: dict[str, Path],
                                                             tmp_path: Path) -> None:
    """Each part makes only its contiguous group of shards (and no index); together they
    are the unsplit merge's shards byte for byte, and shard_index gives its index."""
    recipe = parse_recipe(_recipe(zoo, "ties"))
    whole = tmp_path / "whole"
    run(recipe, whole)
    shards = sorted(p.name for p in whole.glob("model-*.safetensors"))
    n = len(shards)
    made: list[str] = []
    for i, part in enumerate([(0, 2), (2, n - 1), (n - 1, n)]):
        out = tmp_path / f"part{i}"
        run(recipe, out, RunContext(options=EngineOptions(
            part=part, on_shard=lambda _p, w: made.append(w.path))))
        assert sorted(p.name for p in out.glob("model-*")) == shards[part[0]:part[1]]
        assert not (out / INDEX_NAME).exists()
        for name in shards[part[0]:part[1]]:
            assert (out / name).read_bytes() == (whole / name).read_bytes(), name
    assert made == shards
    index = shard_index(_planned(whole), recipe.shard_size_bytes())
    assert index == (whole / INDEX_NAME).read_bytes()
    with pytest.raises(MaecError, match="not a range"):
        run(recipe, tmp_path / "bad", RunContext(options=EngineOptions(part=(2, n + 1))))
