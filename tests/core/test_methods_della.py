"""DELLA and DELLA-linear: MagPrune's law, closed forms, the task-vector family's shared
parameters, and agreement with mergekit 0.1.5 (exact where no sampling happens, in the
statistics that define MagPrune where it does)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from maec_core.errors import RecipeError
from maec_core.methods._sparsify import magprune_, tensor_generator
from maec_core.parsing import parse_recipe
from tests.core.test_methods import call, close, lam


def rank_spread(delta: torch.Tensor) -> torch.Tensor:
    """Each entry's magnitude rank in its row (dimension 1), scaled to 0..1."""
    rows = delta.unsqueeze(0) if delta.dim() < 2 else delta
    ranks = rows.abs().argsort(dim=1).argsort(dim=1).float()
    return (ranks / (rows.shape[1] - 1)).reshape(delta.shape)


def kept_by_rank(kept: torch.Tensor, spread: torch.Tensor, bins: int = 10) -> torch.Tensor:
    """The kept fraction among the entries of each rank bin (0: smallest magnitudes)."""
    which = (spread * bins).long().clamp(max=bins - 1)
    return torch.stack([kept[which == b].float().mean() for b in range(bins)])


def test_magprune_keeps_by_rank_and_rescales() -> None:
    gen = torch.Generator().manual_seed(0)
    delta = torch.randn(400, 500, generator=gen)
    pruned = magprune_(delta.clone(), 0.4, 0.2, tensor_generator(1, "w"), rescale=False)
    kept = pruned != 0
    # Keep probability rises linearly with the rank, from 0.2 to 0.6: bin b's mean is
    # 0.2 + 0.4 (b + 0.5) / 10 (20 000 entries a bin, standard error ~0.0035).
    want = 0.2 + 0.4 * (torch.arange(10) + 0.5) / 10
    torch.testing.assert_close(kept_by_rank(kept, rank_spread(delta)), want, atol=0.015,
                               rtol=0)
    assert torch.equal(pruned[kept], delta[kept])  # survivors untouched without rescale
    again = magprune_(delta.clone(), 0.4, 0.2, tensor_generator(1, "w"), rescale=True)
    assert torch.equal(again != 0, kept)  # same generator, same mask
    torch.testing.assert_close(again.abs().sum(), delta.abs().sum())
    # One-dimensional tensors are one row; density 1 keeps everything.
    flat = torch.arange(1.0, 11.0)
    assert torch.equal(magprune_(flat.clone(), 1.0, 0.2, tensor_generator(1, "w"),
                                 rescale=True), flat)


def test_magprune_follows_the_generator_recipe() -> None:
    # Ranks 0..3 of |delta| in the one row give probabilities 0.3, 0.4, 0.5, 0.6 (density
    # 0.45, epsilon 0.15); one uniform draw per entry from the tensor's generator.
    delta = torch.tensor([[4.0, -1.0, 3.0, 2.0]])
    draws = torch.rand(delta.shape, generator=tensor_generator(9, "t"))
    probs = torch.tensor([[0.6, 0.3, 0.5, 0.4]])
    got = magprune_(delta.clone(), 0.45, 0.15, tensor_generator(9, "t"), rescale=False)
    torch.testing.assert_close(got, delta * (draws < probs))
    # A row of one entry has no rank spread: it is kept with probability density.
    single = torch.tensor([[2.0], [3.0]])
    draws = torch.rand(single.shape, generator=tensor_generator(9, "t"))
    got = magprune_(single.clone(), 0.45, 0.15, tensor_generator(9, "t"), rescale=False)
    torch.testing.assert_close(got, single * (draws < 0.45))


def test_della_at_full_density_is_ties_and_task_arithmetic() -> None:
    base = [1.0, 2.0, 3.0, 0.0]
    a, b = [2.0, 0.0, 3.5, 1.0], [0.0, 4.0, 1.0, -2.0]
    mp = [{"weight": 0.5}, {"weight": 2.0}]
    torch.testing.assert_close(call("della", base, [a, b], mp, **lam(0.7)),
                               call("ties", base, [a, b], mp, **lam(0.7)))
    torch.testing.assert_close(call("della_linear", base, [a, b], mp, normalize=True),
                               call("task_arithmetic", base, [a, b], mp, normalize=True))


def test_della_elects_signs_among_the_survivors() -> None:
    # Task vectors +1 and -10 everywhere: della_linear without rescale shows which entries
    # each model kept (0, 1, -10 or -9), and della draws the same masks (same seed, same
    # tensor, same model order) before electing signs.
    # Lists, not tensors: a merge may overwrite the tensors it is given.
    n = 2000
    base, a, b = [0.0] * n, [1.0] * n, [-10.0] * n
    mp = [{"density": 0.5, "epsilon": 0.2}] * 2
    linear = call("della_linear", base, [a, b], mp, rescale=False, random_seed=4)
    kept_a = (linear == 1) | (linear == -9)
    kept_b = linear <= -9
    assert set(linear.unique().tolist()) == {0.0, 1.0, -10.0, -9.0}
    # Where both survive, -9 elects minus: b alone (divided by its weight, 1).
    want = torch.where(kept_b, -10.0, torch.where(kept_a, 1.0, 0.0))
    torch.testing.assert_close(call("della", base, [a, b], mp, rescale=False,
                                    random_seed=4), want)
    # rescale (the default) brings each pruned task vector back to its L1 norm n.
    scaled = call("della_linear", base, [a], mp[:1], random_seed=4)
    torch.testing.assert_close(scaled.abs().sum(), torch.tensor(float(n)))
    assert not torch.equal(scaled, call("della_linear", base, [a], mp[:1], random_seed=5))


def _della(density: Any, epsilon: Any = 0.15, method: str = "della") -> dict[str, Any]:
    return {"merge_method": method, "base_model": "b",
            "models": [{"model": "a", "parameters": {"density": density,
                                                      "epsilon": epsilon}}]}


def test_della_refuses_probabilities_outside_the_unit_interval() -> None:
    parse_recipe(_della(0.5, 0.3))
    parse_recipe(_della(1.0, 0.5))  # nothing is pruned at density 1
    with pytest.raises(RecipeError, match=r"density ± epsilon .*density 0\.1, epsilon"):
        parse_recipe(_della(0.1))
    with pytest.raises(RecipeError, match=r"density 0\.9, epsilon 0\.15"):
        parse_recipe(_della(0.9, method="della_linear"))
    # A filter on one may meet any value of the other: mlp tensors would get 0.2 ± 0.3.
    with pytest.raises(RecipeError, match=r"density 0\.2, epsilon 0\.3"):
        parse_recipe(_della([{"filter": "mlp", "value": 0.2}, {"value": 0.5}],
                            [{"filter": "attn", "value": 0.1}, {"value": 0.3}]))
    # Between gradient ends the merge checks each tensor's values itself.
    with pytest.raises(RecipeError, match="density ± epsilon"):
        call("della", [0.0, 0.0], [[1.0, 2.0]], [{"density": 0.9, "epsilon": 0.12}],
             name="model.layers.0.mlp.up_proj.weight")


def test_a_gradient_leaving_the_band_fails_the_merge(tmp_path: Path) -> None:
    # Three blocks: density 0.5, 0.75, 1.0 by depth. The recipe's values pass (1.0 prunes
    # nothing), block 1's 0.75 ± 0.3 does not; nothing is published.
    from tests.factories import make_llama, run_recipe

    base = make_llama(tmp_path / "base", seed=0, num_hidden_layers=3, tokenizer=False)
    a = make_llama(tmp_path / "a", seed=1, like=base, num_hidden_layers=3, tokenizer=False)
    recipe = {"merge_method": "della", "base_model": str(base), "models": [
        {"model": str(a), "parameters": {"density": [0.5, 1.0], "epsilon": 0.3}}]}
    parse_recipe(recipe)
    with pytest.raises(RecipeError, match=r"layers\.1\..*density 0\.75, epsilon 0\.3"):
        run_recipe(recipe, tmp_path / "out")
    assert not (tmp_path / "out").exists()


FAMILY = ["task_arithmetic", "ties", "dare_linear", "dare_ties", "breadcrumbs",
          "breadcrumbs_ties", "della", "della_linear"]


@pytest.mark.parametrize("method", FAMILY)
def test_the_task_vector_family_takes_mergekits_shared_parameters(method: str) -> None:
    recipe = parse_recipe({
        "merge_method": method, "base_model": "b",
        "models": [{"model": "a", "parameters": {"weight": 0.5}}],
        "parameters": {"int8_mask": True, "normalize": True, "lambda": 0.5,
                       "rescale": True},
    })
    assert recipe.parameters["rescale"] is True


def test_ties_rescale_restores_the_l1_norm() -> None:
    base = [0.0, 0.0, 0.0, 0.0]
    a = [4.0, -1.0, 0.5, 2.5]  # L1 norm 8; density 0.5 keeps 4 and 2.5 (6.5)
    close(call("ties", base, [a], [{"density": 0.5}]), [4.0, 0.0, 0.0, 2.5])
    close(call("ties", base, [a], [{"density": 0.5}], rescale=True),
          [4.0 * 8 / 6.5, 0.0, 0.0, 2.5 * 8 / 6.5])
    # Task arithmetic sparsifies nothing: rescale changes nothing.
    torch.testing.assert_close(call("task_arithmetic", base, [a], rescale=True),
                               call("task_arithmetic", base, [a]))


mergekit = pytest.importorskip("mergekit.merge")


@pytest.mark.slow
@pytest.mark.parametrize("method", ["della", "della_linear"])
@pytest.mark.parametrize("params", [{}, {"normalize": True, "lambda": 0.7},
                                    {"normalize": False, "rescale": False}])
def test_agrees_with_mergekit_at_full_density(
    zoo: dict[str, Path], tmp_path: Path, method: str, params: dict[str, Any],
) -> None:
    from tests.core.test_methods_mergekit import compare_with_mergekit, two_donors

    compare_with_mergekit(two_donors(zoo, method, {"density": 1.0, "epsilon": 0.1},
                                     **params), tmp_path)


@pytest.mark.slow
def test_magprune_statistics_agree_with_mergekit(zoo: dict[str, Path],
                                                 tmp_path: Path) -> None:
    """One task vector, no rescale: an entry is kept where the merge differs from the
    base. Both runs are seeded, so the comparison is deterministic; its tolerance is
    four standard errors of a rank bin's kept fraction (~2 300 entries a bin)."""
    from safetensors.torch import load_file

    from tests.core.test_methods_mergekit import _tensors, mergekit_config
    from tests.factories import run_recipe

    recipe: dict[str, Any] = {
        "merge_method": "della_linear", "base_model": str(zoo["base"]),
        "models": [{"model": str(zoo["a"]),
                    "parameters": {"weight": 1.0, "density": 0.45, "epsilon": 0.3}}],
        "parameters": {"rescale": False}, "dtype": "float32",
    }
    run_recipe(recipe, tmp_path / "ours")
    torch.manual_seed(0)
    mergekit.run_merge(mergekit_config.MergeConfiguration.model_validate(recipe),
                       str(tmp_path / "theirs"),
                       mergekit.MergeOptions(quiet=True, copy_tokenizer=False,
                                             write_model_card=False))
    base = load_file(zoo["base"] / "model.safetensors")
    a = load_file(zoo["a"] / "model.safetensors")
    ours, theirs = _tensors(tmp_path / "ours"), _tensors(tmp_path / "theirs")
    spread = torch.cat([rank_spread(a[k] - base[k]).reshape(-1) for k in sorted(base)])
    stats = []
    for merged in (ours, theirs):
        kept = torch.cat([(merged[k] != base[k]).reshape(-1) for k in sorted(base)])
        # Survivors are the task vector's own entries (no rescale).
        for k in sorted(base):
            keep = merged[k] != base[k]
            torch.testing.assert_close(merged[k][keep], a[k][keep])
        stats.append(kept_by_rank(kept, spread))
    want = 0.15 + 0.6 * (torch.arange(10) + 0.5) / 10
    torch.testing.assert_close(stats[0], want, atol=0.045, rtol=0)
    torch.testing.assert_close(stats[1], want, atol=0.045, rtol=0)
    torch.testing.assert_close(stats[0], stats[1], atol=0.06, rtol=0)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["ties", "task_arithmetic"])
def test_family_rescale_agrees_with_mergekit(zoo: dict[str, Path], tmp_path: Path,
                                             method: str) -> None:
    from tests.core.test_methods_mergekit import compare_with_mergekit, two_donors

    donor = {"density": 0.4} if method == "ties" else {}
    compare_with_mergekit(two_donors(zoo, method, donor, rescale=True, int8_mask=True),
                          tmp_path)
