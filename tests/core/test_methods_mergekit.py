"""Our methods agree with mergekit 0.1.5 on tiny checkpoints, within bf16 tolerance.

mergekit runs in-process through its Python API on CPU. DARE is compared only at
density 1.0: its random masks come from a different generator (and mergekit rescales
survivors to the dropped delta's L1 norm instead of 1/density), so at lower densities
the two are different draws of the same distribution, not comparable tensors.
Importing mergekit takes several seconds, hence ``slow``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from maec_core.parsing import parse_recipe
from maec_core.run import run

mergekit_config = pytest.importorskip("mergekit.config")
mergekit_merge = pytest.importorskip("mergekit.merge")

pytestmark = pytest.mark.slow


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def compare_with_mergekit(recipe: dict[str, Any], tmp_path: Path) -> None:
    run(parse_recipe(recipe), tmp_path / "ours")
    cfg = mergekit_config.MergeConfiguration.model_validate(recipe)
    options = mergekit_merge.MergeOptions(quiet=True, copy_tokenizer=False,
                                          write_model_card=False)
    mergekit_merge.run_merge(cfg, str(tmp_path / "theirs"), options)
    ours, theirs = _tensors(tmp_path / "ours"), _tensors(tmp_path / "theirs")
    assert sorted(ours) == sorted(theirs)
    for name, ref in theirs.items():
        got = ours[name]
        assert got.dtype == ref.dtype, name
        # bf16 tolerance: relative 2^-6 (torch's bf16 default), and an absolute floor of
        # one bf16 step at the tensor's own scale, for entries that cancel to near zero.
        atol = float(ref.float().abs().max()) * 2**-8

        def msg(m: str, n: str = name) -> str:
            return f"{n}: {m}"

        torch.testing.assert_close(got.float(), ref.float(), rtol=1.6e-2, atol=atol,
                                   msg=msg)


def two_donors(zoo: dict[str, Path], method: str, donor: dict[str, Any],
                **params: Any) -> dict[str, Any]:
    return {
        "merge_method": method,
        "base_model": str(zoo["base"]),
        "models": [
            {"model": str(zoo["a"]), "parameters": {"weight": 0.7, **donor}},
            {"model": str(zoo["b"]), "parameters": {"weight": 0.4, **donor}},
        ],
        "parameters": params,
        "dtype": "float32",
    }


def two_weighted(zoo: dict[str, Path], method: str, params: dict[str, Any], *,
                 with_base: bool) -> dict[str, Any]:
    """Two models, one weighted by a constant and one by a filter and a gradient (the
    weight varies by tensor and layer), with or without ``zoo``'s base."""
    recipe: dict[str, Any] = {
        "merge_method": method,
        "models": [{"model": str(zoo["a"]), "parameters": {"weight": 0.7}},
                   {"model": str(zoo["b"]),
                    "parameters": {"weight": [{"filter": "mlp", "value": 0.2},
                                              {"value": [0.5, 1.0]}]}}],
        "parameters": params,
        "dtype": "float32",
    }
    if with_base:
        recipe["base_model"] = str(zoo["base"])
    return recipe


def test_linear(zoo: dict[str, Path], tmp_path: Path) -> None:
    recipe = {
        "merge_method": "linear",
        "models": [{"model": str(zoo["a"]), "parameters": {"weight": 0.3}},
                   {"model": str(zoo["b"]), "parameters": {"weight": [0.2, 1.0]}}],
    }
    compare_with_mergekit(recipe, tmp_path)


def test_task_arithmetic(zoo: dict[str, Path], tmp_path: Path) -> None:
    compare_with_mergekit(two_donors(zoo, "task_arithmetic", {}, **{"lambda": 0.8}),
                          tmp_path)


def test_task_arithmetic_bf16(bf16_zoo: dict[str, Path], tmp_path: Path) -> None:
    recipe = two_donors(bf16_zoo, "task_arithmetic", {})
    recipe["dtype"] = "bfloat16"
    compare_with_mergekit(recipe, tmp_path)


def test_ties_with_filter_overrides(zoo: dict[str, Path], tmp_path: Path) -> None:
    density = [{"filter": "mlp", "value": 0.3}, {"filter": "self_attn", "value": 0.6},
               {"value": 0.9}]
    compare_with_mergekit(two_donors(zoo, "ties", {"density": density}), tmp_path)


@pytest.mark.parametrize("method", ["dare_linear", "dare_ties"])
def test_dare_at_full_density(zoo: dict[str, Path], tmp_path: Path, method: str) -> None:
    compare_with_mergekit(two_donors(zoo, method, {"density": 1.0}, random_seed=3),
                          tmp_path)


def test_slerp_with_gradient(zoo: dict[str, Path], tmp_path: Path) -> None:
    recipe = {
        "merge_method": "slerp",
        "base_model": str(zoo["base"]),
        "models": [{"model": str(zoo["base"])}, {"model": str(zoo["a"])}],
        "parameters": {"t": [{"filter": "mlp", "value": [0.0, 0.7]}, {"value": 0.4}]},
        "dtype": "float32",
    }
    compare_with_mergekit(recipe, tmp_path)
