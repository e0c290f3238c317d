"""The engine on the test device (``MAEC_TEST_DEVICE``, CPU by default) against the CPU,
its options (compute dtype, GPU budget) and the finished-shard callback."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from maec_core.context import RunContext
from maec_core.errors import MaecError, RecipeError
from maec_core.io.writer import OutputTensor, WrittenFile
from maec_core.parsing import parse_recipe
from maec_core.run import run
from maec_core.runtime import EngineOptions


def tensors(folder: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def recipe(zoo: dict[str, Path], method: str, **extra: Any) -> dict[str, Any]:
    donor: dict[str, Any] = {"weight": 0.6}
    if method in ("ties", "dare_ties"):
        donor["density"] = 0.5
    params: dict[str, Any] = {"t": 0.3} if method == "slerp" else {}
    models = [{"model": str(zoo[k]), "parameters": donor} for k in ("a", "b")]
    if method == "slerp":
        models = [{"model": str(zoo["a"]), "parameters": {}}]
    return {"merge_method": method, "base_model": str(zoo["base"]), "models": models,
            "parameters": params, **extra}


def assert_same_or_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor],
                         exact: bool) -> None:
    assert got.keys() == want.keys()
    for name, w in want.items():
        if exact:
            assert torch.equal(got[name], w), name
        else:
            # Another device's kernels may fuse or reorder float32 operations, and a
            # magnitude cut (TIES) may break a tie between equal values the other way.
            close = torch.isclose(got[name].float(), w.float(), rtol=1e-5, atol=1e-6)
            assert float(close.float().mean()) >= 0.999, name


@pytest.mark.parametrize("method", ["task_arithmetic", "linear", "ties", "slerp"])
def test_test_device_matches_the_cpu(zoo: dict[str, Path], tmp_path: Path, test_device: str,
                                     method: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import maec_core.cuda_loops as cuda_loops

    # Units that split every tensor at odd places, so a GPU run crosses unit edges.
    monkeypatch.setattr(cuda_loops, "UNIT_CUDA", 1000)
    r = parse_recipe(recipe(zoo, method))
    run(r, tmp_path / "cpu", RunContext(device="cpu"))
    run(r, tmp_path / "dev", RunContext(device=test_device))
    assert_same_or_close(tensors(tmp_path / "dev"), tensors(tmp_path / "cpu"),
                         exact=test_device == "cpu")


def test_tensors_over_the_gpu_budget_compute_on_the_cpu(zoo: dict[str, Path], tmp_path: Path,
                                                        test_device: str) -> None:
    """With no GPU budget every whole tensor is computed on the CPU: the CPU's bytes."""
    r = parse_recipe(recipe(zoo, "ties"))
    run(r, tmp_path / "cpu", RunContext(device="cpu"))
    run(
        r,
        tmp_path / "dev",
        RunContext(device=test_device, options=EngineOptions(gpu_budget_bytes=0)),
    )
    assert_same_or_close(tensors(tmp_path / "dev"), tensors(tmp_path / "cpu"), exact=True)


def test_bfloat16_compute_is_close_to_float32(zoo: dict[str, Path], tmp_path: Path,
                                              test_device: str) -> None:
    r = parse_recipe(recipe(zoo, "task_arithmetic"))
    run(r, tmp_path / "f32", RunContext(device=test_device))
    run(
        r,
        tmp_path / "bf16",
        RunContext(device=test_device, options=EngineOptions(compute_dtype="bfloat16")),
    )
    f32, bf16 = tensors(tmp_path / "f32"), tensors(tmp_path / "bf16")
    differ = 0
    for name, want in f32.items():
        assert bf16[name].dtype == want.dtype
        # bf16 keeps 8 significant bits: within a couple of its ulps of the float32 result.
        torch.testing.assert_close(bf16[name], want, rtol=2 ** -6, atol=1e-3, msg=name)
        differ += int(not torch.equal(bf16[name], want))
    assert differ, "bf16 arithmetic changed nothing: the option was not applied"


def test_default_options_give_the_same_bytes(zoo: dict[str, Path], tmp_path: Path) -> None:
    r = parse_recipe(recipe(zoo, "ties"))
    run(r, tmp_path / "plain", RunContext(device="cpu"))
    run(
        r,
        tmp_path / "opts",
        RunContext(device="cpu", options=EngineOptions(compute_dtype="float32")),
    )
    for f in sorted((tmp_path / "plain").glob("*.safetensors")):
        assert f.read_bytes() == (tmp_path / "opts" / f.name).read_bytes()


def test_unknown_compute_dtype_is_a_recipe_error() -> None:
    with pytest.raises(RecipeError) as err:
        EngineOptions(compute_dtype="int8")
    assert err.value.code == "invalid_recipe"


@pytest.mark.parametrize("method", ["task_arithmetic", "ties"])
def test_each_shard_is_handed_over_complete_before_the_folder_exists(
        zoo: dict[str, Path], tmp_path: Path, method: str) -> None:
    out = tmp_path / "out"
    seen: list[tuple[str, bool, str]] = []

    def on_shard(path: Path, written: WrittenFile) -> None:
        data = path.read_bytes()
        assert len(data) == written.size
        seen.append((written.path, out.exists(), hashlib.sha256(data).hexdigest()))
        assert written.sha256 == seen[-1][2]

    result = run(
        parse_recipe(recipe(zoo, method, out_shard_size="16KB")),
        out,
        RunContext(device="cpu", options=EngineOptions(on_shard=on_shard)),
    )
    shards = [f for f in result.manifest["files"] if f["path"].endswith(".safetensors")]
    assert len(shards) >= 3
    assert [name for name, _, _ in seen] == [f["path"] for f in shards]
    assert not any(published for _, published, _ in seen)
    assert [sha for _, _, sha in seen] == [f["sha256"] for f in shards]


def test_a_lora_output_hands_over_no_shard_of_its_intermediate_merge(
        zoo: dict[str, Path], tmp_path: Path) -> None:
    seen: list[str] = []
    r = recipe(zoo, "task_arithmetic", out_shard_size="16KB",
               output={"format": "lora", "rank": 4})
    result = run(parse_recipe(r), tmp_path / "out", RunContext(
        device="cpu", options=EngineOptions(on_shard=lambda _p, w: seen.append(w.path))))
    assert seen == []
    assert any(f["path"].startswith("adapter") for f in result.manifest["files"])


def test_maec_on_the_test_device_matches_the_cpu(zoo: dict[str, Path], tmp_path: Path,
                                                 test_device: str) -> None:
    r = parse_recipe({
        "merge_method": "maec", "base_model": str(zoo["base"]),
        "language_base": str(zoo["b"]), "abilities": [{"model": str(zoo["a"]), "name": "a"}],
        "parameters": {"key_ratio": 0.1, "importance": "delta"}})
    run(r, tmp_path / "cpu", RunContext(device="cpu"))
    run(r, tmp_path / "dev", RunContext(device=test_device))
    assert_same_or_close(tensors(tmp_path / "dev"), tensors(tmp_path / "cpu"),
                         exact=test_device == "cpu")


class _Collect:
    """A tensor sink that keeps every tensor's bytes, in the order given."""

    def __init__(self, outputs: list[OutputTensor]) -> None:
        self.declared = [(t.name, t.shape, t.dtype) for t in outputs]
        self.seen: list[tuple[str, tuple[int, ...], str | None]] = []
        self.data: dict[str, bytearray] = {}
        self.closed = False

    def begin(self, name: str, shape: tuple[int, ...], dtype: str | None) -> None:
        self.seen.append((name, tuple(shape), dtype))
        self.data[name] = bytearray()

    def append(self, data: memoryview | bytes) -> None:
        self.data[self.seen[-1][0]] += bytes(data)

    def end(self) -> None:
        pass

    def close(self) -> list[WrittenFile]:
        self.closed = True
        return []

    def abort(self) -> None:
        pass


@pytest.mark.parametrize("method", ["task_arithmetic", "ties", "maec"])
def test_a_sink_gets_the_bytes_the_shards_hold_and_nothing_is_written(
        zoo: dict[str, Path], tmp_path: Path, test_device: str, method: str) -> None:
    if method == "maec":
        data: dict[str, Any] = {
            "merge_method": "maec", "base_model": str(zoo["base"]),
            "language_base": str(zoo["b"]), "abilities": [{"model": str(zoo["a"])}],
            "parameters": {"key_ratio": 0.1}}
    else:
        data = recipe(zoo, method, out_shard_size="16KB", dtype="bfloat16")
    r = parse_recipe(data)
    made: list[_Collect] = []

    def sink(outputs: list[OutputTensor]) -> _Collect:
        made.append(_Collect(outputs))
        return made[-1]

    result = run(r, tmp_path / "sunk",
                 RunContext(device=test_device, options=EngineOptions(sink=sink)))
    run(r, tmp_path / "folder", RunContext(device=test_device))
    assert not (tmp_path / "sunk").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["folder"]
    assert result.manifest == {}
    [got] = made
    assert got.closed and got.seen == got.declared
    want = tensors(tmp_path / "folder")
    assert set(got.data) == set(want)
    for name, t in want.items():
        assert bytes(got.data[name]) == t.contiguous().view(torch.uint8).numpy().tobytes(), name


def test_a_sink_is_refused_for_a_lora_output(zoo: dict[str, Path], tmp_path: Path) -> None:
    r = recipe(zoo, "task_arithmetic", output={"format": "lora", "rank": 4})
    with pytest.raises(MaecError, match="lora"):
        run(parse_recipe(r), tmp_path / "out",
            RunContext(device="cpu", options=EngineOptions(sink=_Collect)))
    assert not (tmp_path / "out").exists()


# Files of a merged folder that do not define the model: its weights, and the documents
# about the merge.
NOT_DEFINITION = {"recipe.yaml", "README.md", "manifest.json", "maec_report.json",
                  "model.safetensors.index.json"}


@pytest.mark.parametrize("kind", ["cast", "maec", "union-vocabulary", "slices"])
def test_a_sink_merge_writes_the_folder_definition_files_to_its_skeleton(
        zoo: dict[str, Path], tmp_path: Path, kind: str) -> None:
    """The skeleton holds the files of the folder that define the model (config with
    the output dtype and the merge's changes, generation config, tokenizer, a built
    vocabulary's tokenizer), byte for byte, and nothing else; it is complete when the
    sink is made."""
    from tests.factories import make_extended

    if kind == "cast":
        data = recipe(zoo, "task_arithmetic", dtype="bfloat16")
    elif kind == "maec":
        data = {"merge_method": "maec", "base_model": str(zoo["base"]),
                "language_base": str(zoo["b"]), "abilities": [{"model": str(zoo["a"])}],
                "parameters": {"key_ratio": 0.1}}
    elif kind == "union-vocabulary":
        ext = make_extended(tmp_path / "ext", 3, like=zoo["base"], words=["x0", "x1"],
                            added=["<lang>"])
        data = {"merge_method": "linear", "tokenizer_source": "union",
                "models": [{"model": str(zoo["base"]), "parameters": {"weight": 0.5}},
                           {"model": str(ext), "parameters": {"weight": 0.5}}]}
    else:
        data = {"merge_method": "passthrough",
                "slices": [{"sources": [{"model": str(zoo["a"]), "layer_range": [0, 1]}]}]}
    r = parse_recipe(data)
    skeleton = tmp_path / "skeleton"
    seen_at_sink: list[set[str]] = []

    def sink(outputs: list[OutputTensor]) -> _Collect:
        seen_at_sink.append({p.name for p in skeleton.iterdir()})
        return _Collect(outputs)

    run(r, tmp_path / "sunk",
        RunContext(device="cpu", options=EngineOptions(sink=sink, skeleton=skeleton)))
    run(r, tmp_path / "folder", RunContext(device="cpu"))
    assert not (tmp_path / "sunk").exists()
    folder = tmp_path / "folder"
    defining = {p.name for p in folder.iterdir()
                if p.suffix != ".safetensors" and p.name not in NOT_DEFINITION}
    assert {"config.json", "generation_config.json", "tokenizer.json"} <= defining
    assert seen_at_sink == [defining]
    for name in defining:
        assert (skeleton / name).read_bytes() == (folder / name).read_bytes(), name
    config = json.loads((skeleton / "config.json").read_text())
    if kind == "cast":
        assert config["dtype"] == "bfloat16"
    if kind == "slices":
        assert config["num_hidden_layers"] == 1
    if kind == "union-vocabulary":
        assert config["vocab_size"] > json.loads(
            (zoo["base"] / "config.json").read_text())["vocab_size"]


def test_a_skeleton_goes_with_a_sink(tmp_path: Path) -> None:
    with pytest.raises(MaecError, match="skeleton goes with a sink"):
        EngineOptions(skeleton=tmp_path / "skeleton")
