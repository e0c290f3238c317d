"""Every bad input fails with its typed error and leaves nothing behind.

"Nothing" means neither the output folder nor a staging folder beside it.
"""

from __future__ import annotations

import json
import shutil
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from maec_core.context import RunContext
from maec_core.errors import (
    CheckpointError,
    CorruptCheckpoint,
    MaecError,
    NonFiniteOutput,
    OutputExists,
    PickleRefused,
    SourceNotFound,
    UnsupportedDtype,
)
from maec_core.io.headers import read_header
from maec_core.parsing import parse_recipe
from maec_core.run import run
from tests.core.conftest import leftovers


def ta(base: Path, *donors: Path, **extra: Any) -> dict[str, Any]:
    return {"merge_method": "task_arithmetic", "base_model": str(base),
            "models": [{"model": str(d), "parameters": {"weight": 0.5}} for d in donors],
            **extra}


def copy_of(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def rewrite_header(path: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    """Edit the JSON header of a safetensors file in place, keeping its data bytes."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    doc = json.loads(raw[8:8 + n])
    edit(doc)
    header = json.dumps(doc).encode()
    header += b" " * (-len(header) % 8)
    path.write_bytes(struct.pack("<Q", len(header)) + header + raw[8 + n:])


def expect_failure(recipe: dict[str, Any], out: Path, error: type[MaecError],
                   match: str | None = None) -> MaecError:
    with pytest.raises(error, match=match) as info:
        run(parse_recipe(recipe), out)
    assert leftovers(out) == []
    return info.value


def test_pickle_only_checkpoint_is_refused(zoo: dict[str, Path], tmp_path: Path) -> None:
    bad = tmp_path / "pickled"
    bad.mkdir()
    shutil.copy(zoo["a"] / "config.json", bad)
    # Never opened: content is irrelevant, and a real pickle would run code on load.
    (bad / "pytorch_model.bin").write_bytes(b"\x80\x04not really a pickle")
    err = expect_failure(ta(zoo["base"], bad), tmp_path / "out", PickleRefused, "pickle")
    assert err.code == "pickle_refused"


def test_index_naming_a_pickle_shard_is_refused(zoo: dict[str, Path], tmp_path: Path) -> None:
    bad = copy_of(zoo["a"], tmp_path / "a")
    (bad / "model.safetensors").unlink()
    (bad / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"model.embed_tokens.weight": "pytorch_model-00001.bin"}}))
    expect_failure(ta(zoo["base"], bad), tmp_path / "out", PickleRefused)


def test_truncated_file(zoo: dict[str, Path], tmp_path: Path) -> None:
    bad = copy_of(zoo["a"], tmp_path / "a")
    f = bad / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-100])
    # The last tensor's declared range now runs past the end of the data.
    err = expect_failure(ta(zoo["base"], bad), tmp_path / "out", CorruptCheckpoint,
                         "model.norm.weight.*outside")
    assert err.code == "corrupt_checkpoint"


def test_header_longer_than_file(zoo: dict[str, Path], tmp_path: Path) -> None:
    bad = copy_of(zoo["a"], tmp_path / "a")
    f = bad / "model.safetensors"
    raw = f.read_bytes()
    f.write_bytes(struct.pack("<Q", len(raw) * 2) + raw[8:])
    expect_failure(ta(zoo["base"], bad), tmp_path / "out", CorruptCheckpoint, "header")


def test_header_not_json(zoo: dict[str, Path], tmp_path: Path) -> None:
    bad = copy_of(zoo["a"], tmp_path / "a")
    f = bad / "model.safetensors"
    raw = bytearray(f.read_bytes())
    raw[8:12] = b"\xff\xfe{["
    f.write_bytes(bytes(raw))
    expect_failure(ta(zoo["base"], bad), tmp_path / "out", CorruptCheckpoint, "JSON")


@pytest.mark.parametrize(
    ("lie", "match"),
    [
        ("past_end", "outside"),
        ("overlap", "overlaps"),
        ("wrong_size", "expected"),
    ],
)
def test_lying_offsets(zoo: dict[str, Path], tmp_path: Path, lie: str, match: str) -> None:
    bad = copy_of(zoo["a"], tmp_path / "a")
    f = bad / "model.safetensors"
    names = sorted(read_header(f).tensors, key=lambda n: read_header(f).tensors[n].start)

    def edit(doc: dict[str, Any]) -> None:
        first, second = doc[names[0]], doc[names[1]]
        if lie == "past_end":
            last = doc[names[-1]]
            begin, end = last["data_offsets"]
            last["data_offsets"] = [begin + 10**9, end + 10**9]
        elif lie == "overlap":
            width = second["data_offsets"][1] - second["data_offsets"][0]
            start = first["data_offsets"][0]
            second["data_offsets"] = [start, start + width]
        else:
            first["shape"] = [first["shape"][0] + 1, *first["shape"][1:]]

    rewrite_header(f, edit)
    expect_failure(ta(zoo["base"], bad), tmp_path / "out", CorruptCheckpoint, match)


def test_file_shrinking_during_the_merge(zoo: dict[str, Path], tmp_path: Path) -> None:
    bad = copy_of(zoo["b"], tmp_path / "b")
    f = bad / "model.safetensors"
    keep = read_header(f).data_start
    out = tmp_path / "out"
    cut = []

    def progress(stage: str, done: int, total: int) -> None:
        if not cut:  # validated headers, then the bytes go away under the reader
            with open(f, "r+b") as h:
                h.truncate(keep)
            cut.append(done)

    with pytest.raises(CorruptCheckpoint, match="truncated"):
        run(parse_recipe(ta(zoo["base"], zoo["a"], bad)), out, RunContext(progress=progress))
    assert cut and leftovers(out) == []


def test_non_finite_output(zoo: dict[str, Path], tmp_path: Path) -> None:
    bad = copy_of(zoo["a"], tmp_path / "a")
    f = bad / "model.safetensors"
    weights = load_file(f)
    weights["model.layers.1.mlp.up_proj.weight"][3, 5] = float("nan")
    save_file(weights, f, metadata={"format": "pt"})
    err = expect_failure(ta(zoo["base"], bad), tmp_path / "out", NonFiniteOutput,
                         "model.layers.1.mlp.up_proj.weight")
    assert err.details["tensor"] == "model.layers.1.mlp.up_proj.weight"


def test_overflow_on_cast_is_non_finite(zoo: dict[str, Path], tmp_path: Path) -> None:
    # Finite in float32, beyond float16's range once cast: still refused.
    recipe = ta(zoo["base"], zoo["a"], dtype="float16")
    recipe["parameters"] = {"lambda": 1e9}
    expect_failure(recipe, tmp_path / "out", NonFiniteOutput)


def test_quantized_tensor_is_refused(zoo: dict[str, Path], tmp_path: Path) -> None:
    bad = copy_of(zoo["base"], tmp_path / "base")
    f = bad / "model.safetensors"
    weights = load_file(f)
    weights["model.layers.0.mlp.up_proj.weight"] = torch.zeros(64, 32, dtype=torch.int8)
    save_file(weights, f, metadata={"format": "pt"})
    expect_failure(ta(bad, zoo["a"]), tmp_path / "out", UnsupportedDtype, "I8")


def test_missing_folder_and_missing_weights(zoo: dict[str, Path], tmp_path: Path) -> None:
    expect_failure(ta(zoo["base"], tmp_path / "nowhere"), tmp_path / "out", SourceNotFound)
    empty = tmp_path / "empty"
    empty.mkdir()
    shutil.copy(zoo["a"] / "config.json", empty)
    expect_failure(ta(zoo["base"], empty), tmp_path / "out", CheckpointError, "no model")


def test_existing_output_is_not_touched(zoo: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(OutputExists):
        run(parse_recipe(ta(zoo["base"], zoo["a"])), out)
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    assert leftovers(out) == ["out"]
