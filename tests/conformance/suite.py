"""Conformance with mergekit: the same recipe through both tools, tensor by tensor.

Each YAML file under ``recipes/`` is written in the style of mergekit's documented
examples, with ``${base}``, ``${a}``, ``${b}`` and ``${c}`` where model paths go. The
placeholders are filled with tiny Llama checkpoints built here (a base and three
fine-tunes of it, six layers each, so slices have layers to pick from); the recipe then
runs through our engine and through mergekit 0.1.5's Python API (in-process, CPU), and
every output tensor is compared: same names, same dtype, and the largest absolute
difference within a tolerance set by the dtype at the tensor's own scale.

Used by ``tests/conformance/test_conformance.py`` and ``bench/conformance.py``.
"""

from __future__ import annotations

import json
import string
from dataclasses import dataclass, field
from pathlib import Path

import torch
import yaml
from safetensors.torch import load_file

from tests.factories import make_llama, run_recipe

RECIPES = Path(__file__).parent / "recipes"
LAYERS = 6
# Allowed max |ours - theirs| as a fraction of the reference tensor's largest entry: a
# few units in the last place of the saved dtype (the tools round at different steps,
# and float32 sums in a different order differ in the last bits).
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2.0**-9, torch.bfloat16: 2.0**-6}
# Recipes whose outputs are known to differ, and why. Not hidden: the test expects them
# to fail (strictly) and the benchmark counts them as not passed.
KNOWN_DIFFERENCES: dict[str, str] = {}


def recipe_files() -> list[Path]:
    return sorted(RECIPES.glob("*.yaml"))


def build_models(root: Path) -> dict[str, Path]:
    """The base and three fine-tunes the recipes name (float32, untied, six layers)."""
    base = make_llama(root / "base", seed=0, num_hidden_layers=LAYERS)
    models = {"base": base}
    for seed, key in enumerate(("a", "b", "c"), start=1):
        models[key] = make_llama(root / key, seed=seed, like=base, noise=0.02,
                                 num_hidden_layers=LAYERS)
    return models


def load_recipe(path: Path, models: dict[str, Path]) -> dict[str, object]:
    text = string.Template(path.read_text()).substitute({k: str(v) for k, v in models.items()})
    data = yaml.safe_load(text)
    assert isinstance(data, dict)
    return data


@dataclass
class Outcome:
    recipe: str
    passed: bool
    max_abs_diff: float
    tensors: int
    problems: list[str] = field(default_factory=list)


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def run_mergekit(recipe: dict[str, object], out: Path) -> None:
    from mergekit.config import MergeConfiguration
    from mergekit.merge import MergeOptions, run_merge

    options = MergeOptions(quiet=True, copy_tokenizer=False, write_model_card=False)
    run_merge(MergeConfiguration.model_validate(recipe), str(out), options)


def compare(ours: Path, theirs: Path, name: str) -> Outcome:
    """Tensor names, dtypes and values, and the config's layer count."""
    mine, ref = _tensors(ours), _tensors(theirs)
    problems: list[str] = []
    if sorted(mine) != sorted(ref):
        problems.append(f"tensor names differ: only ours {sorted(set(mine) - set(ref))}, "
                        f"only mergekit {sorted(set(ref) - set(mine))}")
    layers = [json.loads((d / "config.json").read_text())["num_hidden_layers"]
              for d in (ours, theirs)]
    if layers[0] != layers[1]:
        problems.append(f"num_hidden_layers: ours {layers[0]}, mergekit {layers[1]}")
    worst = 0.0
    for key in sorted(set(mine) & set(ref)):
        got, want = mine[key], ref[key]
        if got.dtype != want.dtype or got.shape != want.shape:
            problems.append(f"{key}: ours {got.dtype} {list(got.shape)}, mergekit "
                            f"{want.dtype} {list(want.shape)}")
            continue
        diff = float((got.double() - want.double()).abs().max()) if got.numel() else 0.0
        worst = max(worst, diff)
        allowed = TOLERANCE[want.dtype] * float(want.double().abs().max()) + 1e-12
        if diff > allowed:
            problems.append(f"{key}: max abs diff {diff:.3g} > {allowed:.3g}")
    return Outcome(name, not problems, worst, len(ref), problems)


def run_one(path: Path, models: dict[str, Path], work: Path) -> Outcome:
    """Run one recipe file through both tools under ``work`` and compare."""
    recipe = load_recipe(path, models)
    ours, theirs = work / f"{path.stem}-ours", work / f"{path.stem}-mergekit"
    run_recipe(recipe, ours)
    run_mergekit(recipe, theirs)
    return compare(ours, theirs, path.stem)
