"""Merges that compiled kernels take whole run without torch, and give the engine's files.

``maec_core.run`` hands an element-wise merge with a kernel for every tensor (task
arithmetic, the recipe most people publish) to ``maec_core.kernel_merge``; the rest go to
the engine. What a user checks: the same folder, byte for byte, whichever ran it; torch
not even imported by a ``maec merge`` it takes; and everything else still merged right.
"""

from __future__ import annotations

import json
import math
import random
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from maec_core import kernel_merge as km
from maec_core import native, streaming
from maec_core.context import RunContext
from maec_core.engine import run_method
from maec_core.errors import NonFiniteOutput
from maec_core.methods.scalars import held
from maec_core.parsing import parse_recipe
from maec_core.run import run
from maec_core.runtime import EngineOptions
from tests.core.conftest import leftovers
from tests.factories import make_llama

pytestmark = pytest.mark.skipif(not native.available(), reason="the kernels are not built")

ROOT = Path(__file__).resolve().parents[2]


def _recipe(models: dict[str, Path], dtype: str | None, weights: tuple[float, float] = (0.7, -0.35),
            **params: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "merge_method": "task_arithmetic",
        "base_model": str(models["base"]),
        "models": [{"model": str(models["a"]), "parameters": {"weight": weights[0]}},
                   {"model": str(models["b"]), "parameters": {"weight": weights[1]}}],
        "parameters": params,
    }
    if dtype is not None:
        doc["dtype"] = dtype
    return doc


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


@pytest.fixture(scope="module")
def f16_zoo(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("f16")
    base = make_llama(root / "base", seed=20, dtype=torch.float16)
    return {"base": base,
            "a": make_llama(root / "a", seed=21, like=base, dtype=torch.float16),
            "b": make_llama(root / "b", seed=22, like=base, dtype=torch.float16)}


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32", None])
@pytest.mark.parametrize("stored", ["zoo", "bf16_zoo", "f16_zoo"])
def test_the_kernel_merge_writes_the_engines_files(stored: str, dtype: str | None,
                                                   request: pytest.FixtureRequest,
                                                   tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    models = request.getfixturevalue(stored)
    recipe = parse_recipe(_recipe(models, dtype, **{"lambda": 0.9}))
    # Units far smaller than a tensor: every tensor streams in many, on both workers.
    monkeypatch.setattr(streaming, "UNIT_CPU", 1000)
    monkeypatch.setattr(streaming, "CHUNK_CPU", 300)
    ours = km.kernel_merge(recipe, tmp_path / "kernel", RunContext(device="cpu"))
    assert ours is not None
    engine = run_method(recipe, tmp_path / "engine", RunContext(device="cpu"))
    assert ours.tensors == engine.tensors
    assert _files(tmp_path / "kernel") == _files(tmp_path / "engine")


def test_maec_merge_of_a_published_recipe_does_not_import_torch(bf16_zoo: dict[str, Path],
                                                                 tmp_path: Path) -> None:
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(_recipe(bf16_zoo, "bfloat16")))
    # -X importtime lists every module imported, as it is (the CLI leaves by os._exit).
    done = subprocess.run([sys.executable, "-X", "importtime", "-c",
                           "from maec_client.cli import main; main()", "merge", "--device",
                           "cpu", str(recipe), str(tmp_path / "out")],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr
    imported = [line.rsplit("|", 1)[-1].strip() for line in done.stderr.splitlines()
                if line.startswith("import time:")]
    assert "maec_core.kernel_merge" in imported
    assert not [m for m in imported if m.split(".")[0] == "torch"]
    run_method(parse_recipe(recipe), tmp_path / "engine", RunContext(device="cpu"))
    assert _files(tmp_path / "out") == _files(tmp_path / "engine")


@pytest.mark.parametrize("case", ["normalize", "linear", "part", "cuda", "sink"])
def test_merges_it_does_not_take_go_to_the_engine(case: str, zoo: dict[str, Path],
                                                  tmp_path: Path) -> None:
    doc = _recipe(zoo, "bfloat16")
    ctx = RunContext(device="cpu")
    if case == "normalize":
        doc["parameters"] = {"normalize": True}
    elif case == "linear":
        doc["merge_method"] = "linear"
    elif case == "cuda":
        ctx = RunContext(device="cuda")
    elif case == "part":
        # One part of a split merge: its shards' bookkeeping is the engine's.
        ctx = RunContext(device="cpu", options=EngineOptions(part=(0, 1)))
    else:
        ctx = RunContext(device="cpu", options=EngineOptions(sink=lambda outputs: None))
    assert km.kernel_merge(parse_recipe(doc), tmp_path / "out", ctx) is None
    assert not (tmp_path / "out").exists()


def test_a_declined_merge_still_merges_through_run(zoo: dict[str, Path], tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    real = km.kernel_merge

    def spy(*args: Any, **kw: Any) -> Any:
        got = real(*args, **kw)
        calls.append("kernel" if got is not None else "engine")
        return got

    monkeypatch.setattr(km, "kernel_merge", spy)
    recipe = parse_recipe(_recipe(zoo, "bfloat16", normalize=True))
    result = run(recipe, tmp_path / "out", RunContext(device="cpu"))
    assert calls == ["engine"]
    engine = run_method(recipe, tmp_path / "engine", RunContext(device="cpu"))
    assert result.tensors == engine.tensors
    assert _files(tmp_path / "out") == _files(tmp_path / "engine")


def test_a_non_finite_result_fails_and_leaves_nothing(zoo: dict[str, Path],
                                                      tmp_path: Path) -> None:
    # Computed in float16: a delta of about 0.02 times 1e4, then 1e3, is beyond 65504.
    recipe = parse_recipe(_recipe(zoo, "float16", (1e4, 1e4), **{"lambda": 1e3}))
    with pytest.raises(NonFiniteOutput):
        km.kernel_merge(recipe, tmp_path / "out", RunContext(device="cpu"))
    assert leftovers(tmp_path / "out") == []


def test_progress_is_reported_and_a_cancel_leaves_nothing(zoo: dict[str, Path],
                                                          tmp_path: Path) -> None:
    seen: list[tuple[str, int, int]] = []
    recipe = parse_recipe(_recipe(zoo, "bfloat16"))
    done = km.kernel_merge(recipe, tmp_path / "out", RunContext(
        device="cpu", progress=lambda stage, i, n: seen.append((stage, i, n))))
    assert done is not None
    assert seen[-1] == ("merge", done.tensors, done.tensors)
    assert [i for _, i, _ in seen] == sorted(i for _, i, _ in seen)
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert "model.safetensors" in json.dumps(manifest)

    from maec_core.errors import Cancelled

    with pytest.raises(Cancelled):
        km.kernel_merge(recipe, tmp_path / "cancelled", RunContext(
            device="cpu", progress=lambda *a: None, cancel=lambda: True))
    assert leftovers(tmp_path / "cancelled") == []


def _near_ties(rng: random.Random) -> float:
    bits = struct.unpack("<I", struct.pack("<f", rng.uniform(-3, 3)))[0]
    tie = struct.unpack("<f", struct.pack("<I", (bits & ~0xFFFF) | 0x8000))[0]
    return tie + rng.choice([0.0, 1e-12, -1e-12])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_scalars_are_held_as_torch_holds_them(dtype: str) -> None:
    rng = random.Random(7)
    values = [0.5, 1 / 3, 0.1, -2.7, 1e-8, 1e-40, 3.4e38, 3.5e38, 1e39, 65504.0, 65520.0,
              65519.9, 6e-8, 2.9e-8, 3e-8, math.inf, -math.inf, math.nan, 0.0, -0.0]
    for _ in range(5000):
        values.append(rng.choice([-1, 1]) * rng.random() * 10 ** rng.uniform(-45, 40))
        values.append(_near_ties(rng))
    want = torch.tensor(values, dtype=getattr(torch, dtype)).tolist()
    got = held(values, dtype)
    assert [struct.pack("<d", v) if not math.isnan(v) else b"nan" for v in got] == [
        struct.pack("<d", v) if not math.isnan(v) else b"nan" for v in want]
