"""A second extract/combine method, defined here, gets sweeps and artifact reuse through
the method hooks alone: no shared module names it.

The method extracts the donor's delta from the base once (an artifact, stored by its
content key) and combines ``base + scale * delta``; a sweep over ``scale`` is one reuse
group, so the delta is extracted once and every other candidate is combined from it.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from maec_core.artifact_store import META_NAME, ArtifactStore, LocalArtifactStore
from maec_core.context import RunContext
from maec_core.methods import MergeMethod, all_methods
from maec_core.methods import base as base_mod
from maec_core.methods import registry as registry_mod
from maec_core.methods.base import Finite, Made, Params, ReuseKey
from maec_core.parsing import parse_recipe
from maec_core.recipe import Recipe
from maec_core.run import run
from maec_core.runtime import MergeResult, torch_threads
from maec_core.sweep.runner import SweepOptions, run_sweep
from tests.factories import make_llama

NAME = "delta_scale_for_test"
WEIGHTS = "model.safetensors"


class ScaleParams(Params):
    scale: Finite = 1.0


class DeltaScale(MergeMethod):
    """Extract ``donor - base`` (an artifact), combine ``base + scale * delta``."""

    paper = "none (a test's method)"
    params = ScaleParams
    min_models = 1
    max_models = 1

    def __init__(self) -> None:
        self.extracted = 0
        self.reused = 0

    def run(self, recipe: Recipe, out: Path, ctx: RunContext) -> MergeResult:
        store = ctx.artifact_store
        assert store is not None and recipe.base_model is not None
        key = self._key(recipe)
        if store.get(key) is None:
            self.extracted += 1
            staging = Path(out).parent / f".{key[:12]}.delta"
            staging.mkdir()
            base = load_file(Path(recipe.base_model) / WEIGHTS)
            donor = load_file(Path(recipe.models[0].model) / WEIGHTS)
            save_file({k: (donor[k] - v).contiguous() for k, v in base.items()},
                      staging / WEIGHTS)
            for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
                if (Path(recipe.base_model) / name).is_file():
                    shutil.copy(Path(recipe.base_model) / name, staging / name)
            (staging / META_NAME).write_text(json.dumps({"key": key}))
            store.put(key, staging)
            shutil.rmtree(staging)
        held = store.get(key)
        assert held is not None
        result = self._combine(recipe, held, out, ctx)
        return MergeResult(result.out_dir, result.manifest, result.tensors, result.seconds,
                           report={"delta": key})

    def reuse_key(self, recipe: Recipe) -> ReuseKey | None:
        return ()  # the delta does not depend on any parameter: one per sweep

    def made(self, result: MergeResult, store: ArtifactStore) -> Made | None:
        held = store.get((result.report or {})["delta"])
        return None if held is None else Made(files=[held / WEIGHTS], state=held)

    def run_reusing(self, recipe: Recipe, made: Made, out: Path, ctx: RunContext
                    ) -> dict[str, Any]:
        self.reused += 1
        return self._combine(recipe, made.state, out, ctx).manifest

    @staticmethod
    def _key(recipe: Recipe) -> str:
        return hashlib.sha256(f"{recipe.base_model}\0{recipe.models[0].model}"
                              .encode()).hexdigest()

    @staticmethod
    def _combine(recipe: Recipe, delta: Path, out: Path, ctx: RunContext) -> MergeResult:
        # The combination is a plain linear merge of the base and the stored delta.
        scale = float(recipe.parameters.get("scale", 1.0))
        linear = parse_recipe({
            "merge_method": "linear", "dtype": "float32", "parameters": {"normalize": False},
            "models": [{"model": recipe.base_model, "parameters": {"weight": 1.0}},
                       {"model": str(delta), "parameters": {"weight": scale}}]})
        return run(linear, out, ctx)


@pytest.fixture
def method(monkeypatch: pytest.MonkeyPatch) -> Iterator[DeltaScale]:
    all_methods()  # every built-in found first: the copy holds them
    registry = dict(base_mod._REGISTRY)
    monkeypatch.setattr(base_mod, "_REGISTRY", registry)
    monkeypatch.setattr(registry_mod, "_REGISTRY", registry)
    type(NAME.title(), (DeltaScale,), {"name": NAME})  # defining it registers it
    defined = registry[NAME]
    assert isinstance(defined, DeltaScale)
    yield defined


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("delta")
    with torch_threads(1):
        base = make_llama(root / "base", 0)
        donor = make_llama(root / "donor", 1, like=base, noise=0.05)
    (root / "texts.jsonl").write_text(
        "".join(json.dumps({"text": f"w{i} w{i + 3} w{i + 7} w{i + 1}"}) + "\n"
                for i in range(4)))
    return {"root": root, "base": base, "donor": donor}


def _recipe(pair: dict[str, Path], **extra: Any) -> dict[str, Any]:
    return {"merge_method": NAME, "base_model": str(pair["base"]),
            "models": [{"model": str(pair["donor"])}], **extra}


def _expected(pair: dict[str, Path], scale: float) -> dict[str, torch.Tensor]:
    base, donor = load_file(pair["base"] / WEIGHTS), load_file(pair["donor"] / WEIGHTS)
    return {k: v + scale * (donor[k] - v) for k, v in base.items()}


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for shard in sorted(folder.glob("*.safetensors")):
        out.update(load_file(shard))
    return out


def test_run_extracts_once_and_combines(method: DeltaScale, pair: dict[str, Path],
                                        tmp_path: Path) -> None:
    store = LocalArtifactStore(tmp_path / "store")
    ctx = RunContext(device="cpu", artifact_store=store)
    assert method.extracts()  # derived from its reuse hooks: it runs from what it made
    with torch_threads(1):
        run(parse_recipe(_recipe(pair, parameters={"scale": 0.5})), tmp_path / "a", ctx)
        run(parse_recipe(_recipe(pair, parameters={"scale": 1.0})), tmp_path / "b", ctx)
    assert method.extracted == 1  # the second run found the delta in the store
    got, want = _weights(tmp_path / "b"), _expected(pair, 1.0)
    assert set(got) == set(want)
    for name, tensor in want.items():
        torch.testing.assert_close(got[name], tensor, rtol=0, atol=1e-6)


def test_sweep_makes_the_artifact_once_and_reuses_it(method: DeltaScale,
                                                     pair: dict[str, Path],
                                                     tmp_path: Path) -> None:
    scales = [0.0, 0.5, 1.0]
    recipe = parse_recipe(_recipe(
        pair,
        evaluate=[{"name": "t", "language": "en", "kind": "perplexity",
                   "path": str(pair["root"] / "texts.jsonl")}],
        sweep={"grid": {"scale": scales}, "publish": "best",
               "objective": {"set": "t", "metric": "perplexity"}}))
    with torch_threads(1):
        res = run_sweep(recipe, tmp_path / "out", RunContext(device="cpu"),
                        SweepOptions(resident_budget=0))
    assert res.extractions == 1 and res.board.extractions == 1
    # Scored in memory: the candidates after the first, then the winner's published
    # folder, are all combined from the one extracted delta.
    assert (method.extracted, method.reused) == (1, len(scales))
    assert [(r.id, r.values) for r in res.board.rows] == [
        (f"c{i:02d}", {"scale": s}) for i, s in enumerate(scales)]
    winner = res.board.winner
    assert winner is not None
    # The published winner is base + scale * delta for its own scale, bit for bit of
    # what the combination computes.
    scale = scales[int(winner[1:])]
    got = _weights(tmp_path / "out")
    for name, tensor in _expected(pair, scale).items():
        torch.testing.assert_close(got[name], tensor, rtol=0, atol=1e-6)
