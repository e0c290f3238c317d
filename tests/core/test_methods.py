"""Each merge method against a closed-form expectation on small hand-made tensors."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import pytest
import torch

from maec_core.errors import RecipeError
from maec_core.methods import TensorCall, TensorMethod, get_method
from maec_core.methods._sparsify import tensor_generator
from maec_core.methods.layer_swap import language_weight
from maec_core.methods.params import resolve_params
from maec_core.parsing import parse_recipe


def call(
    method: str,
    base: Sequence[Any] | torch.Tensor | None,
    models: Sequence[Sequence[Any] | torch.Tensor],
    model_params: list[dict[str, Any]] | None = None,
    name: str = "model.layers.0.mlp.up_proj.weight",
    layer: int | None = 0,
    num_layers: int = 4,
    **params: Any,
) -> torch.Tensor:
    spec = get_method(method, TensorMethod)
    tensors = [torch.as_tensor(m, dtype=torch.float32) for m in models]
    mp = model_params or [{} for _ in models]
    c = TensorCall(
        name=name,
        base=None if base is None else torch.as_tensor(base, dtype=torch.float32),
        models=tensors,
        model_params=[spec.model_params.model_validate(p) for p in mp],
        params=spec.params.model_validate(params),
        layer=layer,
        num_layers=num_layers,
    )
    return spec.merge(c)


def lam(value: float) -> dict[str, Any]:
    """``lambda`` as a keyword for :func:`call` (a Python keyword cannot be spelled)."""
    return {"lambda": value}


def close(got: torch.Tensor, want: list[float]) -> None:
    torch.testing.assert_close(got, torch.tensor(want), rtol=1e-6, atol=1e-6)


def test_linear_normalized_and_plain() -> None:
    a, b = [1.0, 2.0, -4.0], [3.0, 0.0, 4.0]
    close(call("linear", None, [a, b], [{"weight": 1}, {"weight": 3}]), [2.5, 0.5, 2.0])
    close(call("linear", None, [a, b], [{"weight": 1}, {"weight": 3}], normalize=False),
          [10.0, 2.0, 8.0])
    # A base takes part with weight 1.
    close(call("linear", [0.0, 0.0, 3.0], [a], [{"weight": 2}]), [2 / 3, 4 / 3, -5 / 3])


def test_task_arithmetic() -> None:
    base = [1.0, 1.0, 1.0]
    a, b = [2.0, 0.0, 1.0], [1.0, 3.0, -1.0]
    # θ0 + λ Σ w_i (θ_i − θ0): deltas (1,-1,0) and (0,2,-2).
    close(call("task_arithmetic", base, [a, b], [{"weight": 0.5}, {"weight": 1.0}],
               **lam(2.0)), [2.0, 4.0, -3.0])
    close(call("task_arithmetic", base, [a, b], [{"weight": 1}, {"weight": 1}],
               normalize=True), [1.5, 1.5, 0.0])


def test_ties_trim_elect_disjoint_mean() -> None:
    base = [0.0, 0.0, 0.0, 0.0]
    a = [3.0, -1.0, 0.5, 2.0]
    b = [-1.0, -2.0, 4.0, 0.25]
    # density 0.5 keeps the two largest magnitudes: a -> (3,0,0,2), b -> (0,-2,4,0).
    # Elected signs from the sums (3,-2,4,2): +,-,+,+; every surviving entry agrees.
    # Disjoint mean divides by the weight of the agreeing models only (1 each here).
    close(call("ties", base, [a, b], [{"density": 0.5}, {"density": 0.5}]),
          [3.0, -2.0, 4.0, 2.0])
    # Without trimming the signs disagree in entries 0 and 3.
    # sums: (2,-3,4.5,2.25) -> signs +,-,+,+ ; entry0: a only (3); entry1: mean(-1,-2)=-1.5;
    # entry2: b only (0.5 and 4 are both +: mean 2.25); entry3: mean(2, 0.25) = 1.125.
    close(call("ties", base, [a, b]), [3.0, -1.5, 2.25, 1.125])
    close(call("ties", base, [a, b], normalize=False), [3.0, -3.0, 4.5, 2.25])


def test_ties_weights_count_in_election() -> None:
    base = [1.0]
    # Weighted deltas: 0.2*(+2) = 0.4 and 1.0*(-1) = -1: the minus side wins.
    got = call("ties", base, [[3.0], [0.0]], [{"weight": 0.2}, {"weight": 1.0}])
    close(got, [0.0])


def test_ties_keeps_exactly_k_and_at_least_one() -> None:
    base = [0.0] * 4
    got = call("ties", base, [[1.0, 1.0, 1.0, 0.5]], [{"density": 0.25}])
    # k = 1: of the three tied magnitudes only the one mergekit's sort puts first stays.
    close(got, [1.0, 0.0, 0.0, 0.0])
    got = call("ties", base, [[0.1, 0.2, 0.9, 0.3]], [{"density": 0.01}])
    close(got, [0.0, 0.0, 0.9, 0.0])


def test_dare_density_one_is_task_arithmetic() -> None:
    base = [1.0, 2.0, 3.0]
    a, b = [2.0, 2.0, 0.0], [0.0, 4.0, 3.0]
    mp = [{"weight": 0.5}, {"weight": 0.5}]
    ta = call("task_arithmetic", base, [a, b], mp)
    torch.testing.assert_close(call("dare_linear", base, [a, b], mp), ta, rtol=0, atol=0)
    # dare_ties at density 1 is TIES without trimming (normalize defaults off, as mergekit).
    torch.testing.assert_close(
        call("dare_ties", base, [a, b], mp), call("ties", base, [a, b], mp, normalize=False)
    )


def test_dare_drops_rescales_and_is_seeded() -> None:
    n = 200_000
    base = torch.zeros(n)
    model = torch.full((n,), 2.0)
    out = call("dare_linear", base, [model], [{"density": 0.25}], random_seed=7)
    kept = out != 0
    # Survivors are rescaled by 1/density; about a quarter survive; the mean is preserved.
    assert torch.all(out[kept] == 8.0)
    assert abs(kept.float().mean().item() - 0.25) < 0.01
    assert abs(out.mean().item() - 2.0) < 0.05
    # Same seed and name: bit-identical; another name or seed: another mask.
    again = call("dare_linear", base, [model], [{"density": 0.25}], random_seed=7)
    assert torch.equal(out, again)
    other = call("dare_linear", base, [model], [{"density": 0.25}], random_seed=8)
    assert not torch.equal(out, other)
    renamed = call("dare_linear", base, [model], [{"density": 0.25}], random_seed=7,
                   name="model.layers.1.mlp.up_proj.weight")
    assert not torch.equal(out, renamed)
    no_rescale = call("dare_linear", base, [model], [{"density": 0.25}], random_seed=7,
                      rescale=False)
    assert torch.equal(no_rescale, out / 4)


def test_dare_mask_follows_generator_recipe() -> None:
    # The documented seeding: one CPU generator per tensor from (seed, crc32(name)),
    # masks drawn in model order.
    name = "model.layers.3.self_attn.q_proj.weight"
    gen = tensor_generator(5, name)
    m1 = torch.rand(64, generator=gen) < 0.5
    m2 = torch.rand(64, generator=gen) < 0.5
    out = call("dare_linear", torch.zeros(64), [torch.ones(64), torch.full((64,), 10.0)],
               [{"density": 0.5}, {"density": 0.5}], name=name, random_seed=5, rescale=False)
    torch.testing.assert_close(out, m1.float() + 10 * m2.float())


def test_dare_ties_elects_after_dropping() -> None:
    base = torch.zeros(4)
    a = torch.tensor([1.0, 1.0, 1.0, 1.0])
    b = torch.tensor([-3.0, -3.0, -3.0, -3.0])
    out = call("dare_ties", base, [a, b], normalize=True, random_seed=3)
    # Density 1: the minus side wins everywhere; the mean of agreeing models is b.
    close(out, [-3.0] * 4)


def test_slerp_closed_form() -> None:
    v0, v1 = [1.0, 0.0], [0.0, 2.0]
    # 90 degrees: coefficients sin((1-t)π/2)/1 and sin(tπ/2)/1.
    t = 0.3
    want = [math.sin(0.7 * math.pi / 2), 2 * math.sin(0.3 * math.pi / 2)]
    close(call("slerp", v0, [v1], t=t), want)
    close(call("slerp", v0, [v1], t=0.0), v0)
    close(call("slerp", v0, [v1], t=1.0), v1)


def test_slerp_falls_back_to_lerp_and_zero_is_orthogonal() -> None:
    # Parallel vectors: sin θ ≈ 0, linear interpolation.
    close(call("slerp", [1.0, 1.0], [[3.0, 3.0]], t=0.25), [1.5, 1.5])
    # A zero tensor counts as orthogonal to the other (mergekit's rule): θ = π/2, so
    # the result is sin(tπ/2)·v1, not t·v1.
    s = math.sin(0.5 * math.pi / 2)
    close(call("slerp", [0.0, 0.0], [[4.0, 2.0]], t=0.5), [4.0 * s, 2.0 * s])


@pytest.mark.parametrize(
    ("layer", "want"),
    [(0, 1.0), (1, 2 / 3), (2, 1 / 3), (3, 0.0), (4, 0.0), (5, 0.5), (6, 1.0), (7, 1.0)],
)
def test_layer_swap_weights(layer: int, want: float) -> None:
    # 8 layers: bottom 1 and top 2 swapped, 2-layer transition at the bottom seam and
    # (clipped by the other zone's reach) at the top seam.
    got = language_weight(layer, "x", 8, bottom_k=1, top_k=2, transition=2)
    if layer == 4:
        want = 1 / 3  # top seam: layers 5 and 4 get 2/3 and 1/3
    if layer == 5:
        want = 2 / 3
    assert got == pytest.approx(want)


def test_layer_swap_tensors_and_non_layer_choice() -> None:
    ability, language = [1.0, 1.0], [3.0, 5.0]
    mp = [{"role": "ability"}, {"role": "language"}]
    # Swapped block: an exact copy of the language expert.
    out = call("layer_swap", None, [ability, language], mp, layer=0, bottom_k=1, top_k=1)
    close(out, language)
    out = call("layer_swap", None, [ability, language], mp, layer=1, bottom_k=1, top_k=1,
               transition=1)
    close(out, [2.0, 3.0])  # halfway in a one-layer transition zone
    out = call("layer_swap", None, [ability, language], mp, layer=2, bottom_k=1, top_k=0)
    close(out, ability)
    # Non-layer tensors follow their end of the stack by default.
    emb: dict[str, Any] = dict(name="model.embed_tokens.weight", layer=None)
    head: dict[str, Any] = dict(name="lm_head.weight", layer=None)
    close(call("layer_swap", None, [ability, language], mp, bottom_k=1, top_k=0, **emb),
          language)
    close(call("layer_swap", None, [ability, language], mp, bottom_k=1, top_k=0, **head),
          ability)
    close(call("layer_swap", None, [language, ability], mp[::-1], bottom_k=0, top_k=1,
               **head), language)
    close(call("layer_swap", None, [ability, language], mp, bottom_k=1, top_k=1,
               non_layer="ability", **emb), ability)


def test_layer_swap_too_many_layers() -> None:
    with pytest.raises(RecipeError, match="exceeds"):
        language_weight(0, "x", 4, bottom_k=3, top_k=2, transition=0)


def test_filter_overrides_resolve_per_tensor() -> None:
    recipe = parse_recipe({
        "merge_method": "ties",
        "base_model": "base",
        "models": [{"model": "a", "parameters": {
            "density": [{"filter": "mlp", "value": 0.5}, {"value": 1.0}],
            "weight": [0.0, 1.0],
        }}],
    })
    params = recipe.models[0].parameters
    assert resolve_params(params, "model.layers.0.mlp.up_proj.weight", 3) == {
        "density": 0.5, "weight": 0.0}
    assert resolve_params(params, "model.layers.1.self_attn.q_proj.weight", 3) == {
        "density": 1.0, "weight": 0.5}
    # Outside the blocks a gradient takes its first value, as in mergekit 0.1.5.
    assert resolve_params(params, "lm_head.weight", 3)["weight"] == 0.0
    star = [{"filter": "q_proj", "value": 0.2}, {"filter": "*", "value": 0.7}]
    parsed = parse_recipe({"merge_method": "ties", "base_model": "b",
                           "models": [{"model": "a", "parameters": {"density": star}}]})
    assert resolve_params(parsed.models[0].parameters, "lm_head.weight", 3) == {"density": 0.7}


@pytest.mark.parametrize(
    ("data", "needle"),
    [
        ({"merge_method": "tise", "base_model": "b", "models": [{"model": "a"}]}, "tise"),
        ({"merge_method": "ties", "base_model": "b",
          "models": [{"model": "a", "parameters": {"density": 1.5}}]}, "density"),
        ({"merge_method": "ties", "base_model": "b", "models": [{"modle": "a"}]}, "modle"),
        ({"merge_method": "slerp", "base_model": "b",
          "models": [{"model": "a"}, {"model": "c"}]}, "exactly 1"),
        ({"merge_method": "layer_swap", "models": [
            {"model": "a", "parameters": {"role": "ability"}},
            {"model": "c", "parameters": {"role": "ability"}}]}, "role"),
    ],
)
def test_recipe_errors_name_the_problem(data: dict[str, Any], needle: str) -> None:
    with pytest.raises(RecipeError, match=needle):
        parse_recipe(data)


def test_a_misspelt_parameter_is_a_warning_naming_it() -> None:
    """mergekit ignores a name no method reads; here it is accepted too, and named."""
    from maec_core.parsing import recipe_warnings

    recipe = parse_recipe({"merge_method": "ties", "base_model": "b",
                           "models": [{"model": "a"}], "parameters": {"densty": 0.5}})
    assert recipe_warnings(recipe) == [
        "parameters.densty ignored: no merge method knows this name"]



def test_a_condition_key_other_than_filter_is_a_warning_and_matches_every_tensor() -> None:
    """mergekit's own gradient-slerp example keys its conditions ``pattern:``; mergekit
    drops the key, so the condition matches every tensor. Here too, and it is named."""
    from maec_core.parsing import recipe_warnings

    recipe = parse_recipe({"merge_method": "slerp", "base_model": "b",
                           "models": [{"model": "b"}, {"model": "a"}],
                           "parameters": {"t": [{"pattern": "mlp", "value": 0.3},
                                                {"value": 0.5}]}})
    assert recipe_warnings(recipe) == [
        "parameters.t[0].pattern ignored: conditions select tensors by 'filter'; so, as "
        "in mergekit, this condition matches every tensor"]
    first = recipe.parameters["t"][0]
    assert first.filter is None and first.value == 0.3

def test_ram_averages_shared_entries_and_keeps_unique_ones() -> None:
    # Entry 0: both change it (averaged); 1: only a (kept); 2: neither (base).
    base, a, b = [0.0, 0.0, 5.0], [2.0, 3.0, 5.0], [4.0, 0.0, 5.0]
    close(call("ram", base, [a, b]), [3.0, 3.0, 5.0])
    # RAM+: a has 1 shared and 1 unique entry, rho = 1 -> lambda = 1 + 0.1 * min(1, 0.2).
    close(call("ramplus_tl", base, [a, b]), [3.0, 3.0 * 1.02, 5.0])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 2, 3, 16, 17, 18, 33, 40, 257])
def test_task_arithmetic_16bit_sum_has_torchs_bytes(dtype: torch.dtype, rows: int) -> None:
    """The in-place sum task arithmetic streams with equals torch's sum over the stacked
    16-bit deltas (mergekit's) bit for bit: its float32 accumulation, its grouping of
    many rows, its +0.0 start (negative zeros sum to +0.0). Entries spread over 2^24 in
    magnitude, so a float32 sum in another order would round differently."""
    from maec_core.methods.task_arithmetic import _sum_stacked

    gen = torch.Generator().manual_seed(rows)
    n = 4099
    low = -12 if dtype == torch.float16 else -24
    scale = torch.randint(low, 1, (rows, n), generator=gen).float().exp2()
    signs = torch.randn(rows, n, generator=gen).sign()
    stacked = (signs * (1 + torch.rand(rows, n, generator=gen)) * scale).to(dtype)
    stacked[:, :5] = -0.0
    want = stacked.sum(dim=0)
    got = _sum_stacked([r.clone() for r in stacked.unbind(0)])
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
