"""The library refuses every hostile checkpoint with its stable code and leaves nothing.

For each case in tests/hostile.py: the first step expected to refuse it does so with the
case's code and a message naming the defence; a full merge with it (as the first model
and as the second) fails with the same code; the output folder does not exist and no
staging folder is left beside it; a pickle payload never ran.
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest

from maec_core.context import RunContext
from maec_core.errors import CorruptCheckpoint, MaecError
from maec_core.io.folder import open_model_folder
from maec_core.io.headers import read_header
from maec_core.parsing import parse_recipe
from maec_core.plan import build_plan
from maec_core.run import run
from tests.factories import make_llama
from tests.hostile import HOSTILE, Hostile, marker_path, payload_bytes, torch_zip_bytes
from tests.reliability import results

pytestmark = pytest.mark.faults


@pytest.fixture(scope="module")
def good(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_llama(tmp_path_factory.mktemp("good") / "llama", seed=0)


@pytest.fixture(autouse=True)
def _private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The engine's sha256 cache must not write into the user's ~/.cache during tests.
    monkeypatch.setenv("MAEC_CACHE_DIR", str(tmp_path / "cache"))


def _recipe(first: Path, second: Path) -> dict[str, object]:
    return {
        "merge_method": "linear",
        "models": [
            {"model": str(first), "parameters": {"weight": 0.5}},
            {"model": str(second), "parameters": {"weight": 0.5}},
        ],
    }


def _expect(case: Hostile, exc: BaseException) -> None:
    assert isinstance(exc, MaecError), f"{case.name}: untyped {type(exc).__name__}: {exc}"
    assert exc.code == case.code, f"{case.name}: got {exc.code}: {exc.message}"
    assert case.hint in exc.message, f"{case.name}: unexpected defence: {exc.message}"
    json.dumps(exc.to_dict())  # the API and the job record serialise it as is


def test_payload_is_live(tmp_path: Path) -> None:
    """The marker mechanism works: unpickling the payload does create the file. Without
    this, 'the marker does not exist' would prove nothing."""
    marker = tmp_path / "ran"
    pickle.loads(payload_bytes(marker))
    assert marker.exists()
    import io
    import zipfile

    marker2 = tmp_path / "ran2"
    with zipfile.ZipFile(io.BytesIO(torch_zip_bytes(marker2))) as z:
        pickle.loads(z.read("archive/data.pkl"))
    assert marker2.exists()


def test_good_checkpoint_passes_every_stage(good: Path, tmp_path: Path) -> None:
    """The harness is not refusing everything: an unbroken copy opens, plans and merges."""
    folder = open_model_folder(good)
    build_plan({"a": folder, "b": open_model_folder(good)}, "a")
    result = run(parse_recipe(_recipe(good, good)), tmp_path / "out" / "merged")
    assert (result.out_dir / "manifest.json").is_file()


@pytest.mark.parametrize("case", HOSTILE, ids=lambda c: c.name)
def test_hostile_checkpoint_is_refused(case: Hostile, good: Path, tmp_path: Path) -> None:
    bad = case.build(good, tmp_path / "bad")
    marker = marker_path(bad)

    # 1. The step that should catch it does, with the code and the intended defence.
    if case.stage == "open":
        with pytest.raises(MaecError) as info:
            open_model_folder(bad)
        _expect(case, info.value)
    else:
        hostile = open_model_folder(bad)
        peer = open_model_folder(good)
        if case.stage == "plan":
            for ref in ("bad", "good"):
                with pytest.raises(MaecError) as info:
                    build_plan({"bad": hostile, "good": peer}, ref)
                _expect(case, info.value)
        else:
            build_plan({"bad": hostile, "good": peer}, "bad")

    # 2. A whole merge, with the hostile model in either position, fails the same way
    #    and publishes nothing: no output folder, no staging folder beside it.
    for i, (first, second) in enumerate(((bad, good), (good, bad))):
        out = tmp_path / f"out{i}" / "merged"
        with pytest.raises(MaecError) as info:
            run(parse_recipe(_recipe(first, second)), out)
        _expect(case, info.value)
        assert not out.exists()
        leftovers = list(out.parent.iterdir()) if out.parent.exists() else []
        assert leftovers == [], f"left behind: {leftovers}"

    # 3. No payload ran at any point.
    assert not marker.exists(), f"{case.name}: the pickle payload ran"
    results.add("hostile_inputs")
    if case.name.endswith("_adapter"):
        results.add("adapters_refused")  # LoRA adapter folders (pickled, DoRA)


def test_every_listed_attack_has_a_case() -> None:
    """The attacks the service promises to refuse, each with at least one generator."""
    names = {c.name for c in HOSTILE}
    required = {
        "pickle_only", "truncated", "overlapping_offsets", "out_of_file_offsets",
        "absurd_header_size", "config_json_bomb_size", "config_json_bomb_nesting",
        "mismatched_shapes", "nan_weights", "inf_weights", "symlink_shard_out",
        "dotdot_shard_name", "tokenizer_json_is_pickle", "tokenizer_config_not_json",
    }
    assert required <= names, required - names
    assert all(c.marker for c in HOSTILE if "pickle" in c.name or "zip" in c.name)


def test_file_truncated_during_merge_publishes_nothing(good: Path, tmp_path: Path) -> None:
    """A donor that shrinks after validation (a concurrent writer, a failing disk) fails
    the merge with corrupt_checkpoint mid-stream; the staging folder is removed."""
    victim = tmp_path / "victim"
    make_llama(victim, seed=3)
    weights = victim / "model.safetensors"
    data_start = read_header(weights).data_start
    calls: list[int] = []

    def progress(stage: str, done: int, total: int) -> None:
        calls.append(done)
        if done == 1:
            with open(weights, "r+b") as f:
                f.truncate(data_start)

    out = tmp_path / "out" / "merged"
    with pytest.raises(CorruptCheckpoint) as info:
        run(parse_recipe(_recipe(good, victim)), out, RunContext(progress=progress))
    assert "truncated" in info.value.message
    assert 1 <= len(calls) < 21, calls  # it failed mid-stream, not before or after
    assert not out.exists()
    assert list(out.parent.iterdir()) == []
