"""MAEC test helpers (hand-built checkpoints) and the exact selection rules.

The checkpoints here are written tensor by tensor with safetensors, so every test knows
θ0, θA, θL and θS exactly and can state the expected key rows, dropped tensor and
output in closed form.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from maec_core.errors import RecipeError
from maec_core.maec.params import ceil_count, key_count, maec_params, validate_maec_recipe
from maec_core.maec.select import global_top_k, select_tensors, top_k_indices
from maec_core.recipe import Recipe

H, INTER, V = 8, 12, 16
# Included by the default rule (2-D, ".layers." in the name), in sorted order.
UP0 = "model.layers.0.mlp.up_proj.weight"  # (INTER, H)
DOWN0 = "model.layers.0.mlp.down_proj.weight"  # (H, INTER)
Q0 = "model.layers.0.self_attn.q_proj.weight"  # (H, H)
Q1 = "model.layers.1.self_attn.q_proj.weight"  # (H, H)
INCLUDED = [DOWN0, UP0, Q0, Q1]
# Excluded: embeddings, lm_head, norms (1-D).
EMBED = "model.embed_tokens.weight"
HEAD = "lm_head.weight"
NORM0 = "model.layers.0.input_layernorm.weight"
SHAPES = {
    EMBED: (V, H), UP0: (INTER, H), DOWN0: (H, INTER), Q0: (H, H), Q1: (H, H),
    NORM0: (H,), "model.norm.weight": (H,), HEAD: (V, H),
}


@pytest.fixture(autouse=True)
def _private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Checksum cache and the default artifact store live under the test's tmp dir.
    monkeypatch.setenv("MAEC_CACHE_DIR", str(tmp_path / "cache"))


def write_ckpt(path: Path, tensors: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32
               ) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.to(dtype).contiguous() for k, v in tensors.items()},
              str(path / "model.safetensors"), metadata={"format": "pt"})
    cfg = {"model_type": "llama", "hidden_size": H, "intermediate_size": INTER,
           "vocab_size": V, "num_hidden_layers": 2, "tie_word_embeddings": False,
           "torch_dtype": str(dtype).removeprefix("torch.")}
    (path / "config.json").write_text(json.dumps(cfg))
    return path


def load(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(path / "model.safetensors"))


def base_weights(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(s, generator=g) for k, s in SHAPES.items()}


def noise_like(w: dict[str, torch.Tensor], seed: int, scale: float) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: scale * torch.randn(v.shape, generator=g) for k, v in w.items()}


def add(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: a[k] + b[k] for k in a}


def maec_recipe(base: Path, lang: Path, abilities: list[dict[str, object]],
                **params: object) -> Recipe:
    return Recipe.model_validate({
        "merge_method": "maec", "base_model": str(base), "language_base": str(lang),
        "abilities": abilities, "parameters": params,
    })


# --- the exact rules -------------------------------------------------------------------


def test_ceil_uses_the_written_decimal() -> None:
    # 0.07 * 100 == 7.000000000000001 in binary floating point; the rule means 7.
    assert 0.07 * 100 > 7
    assert ceil_count(0.07, 100) == 7
    assert ceil_count(0.05, 30) == 2  # 1.5 rounds up
    assert key_count(0.05, 10) == 1  # ceil(0.5) = 1
    assert key_count(0.001, 10) == 1  # max(1, ...) keeps at least one neuron
    assert key_count(1.0, 10) == 10


def test_top_k_ties_go_to_the_lower_index() -> None:
    s = torch.tensor([1.0, 3.0, 2.0, 3.0, 2.0, 2.0, 0.5])
    assert top_k_indices(s, 1).tolist() == [1]
    assert top_k_indices(s, 2).tolist() == [1, 3]
    # Third place is a three-way tie at 2.0 among indices 2, 4, 5: index 2 wins.
    assert top_k_indices(s, 3).tolist() == [1, 2, 3]
    assert top_k_indices(s, 4).tolist() == [1, 2, 3, 4]
    assert top_k_indices(s, 7).tolist() == list(range(7))


def test_top_k_all_equal_keeps_the_first_rows() -> None:
    assert top_k_indices(torch.zeros(100), 5).tolist() == [0, 1, 2, 3, 4]


def test_global_ties_go_to_lower_row_then_tensor_name() -> None:
    # Tensors given out of name order; all scores tie except one.
    names = ["b.weight", "a.weight"]
    scores = [torch.tensor([1.0, 1.0, 1.0]), torch.tensor([1.0, 1.0, 5.0])]
    # k=1: the strict maximum (a row 2). k=2: then row 0 of 'a' (row 0 ties; a < b).
    assert [p.tolist() for p in global_top_k(scores, names, 1)] == [[], [2]]
    assert [p.tolist() for p in global_top_k(scores, names, 2)] == [[], [0, 2]]
    # k=3: row 0 of 'b' next (still row 0), before row 1 of 'a'.
    assert [p.tolist() for p in global_top_k(scores, names, 3)] == [[0], [0, 2]]
    assert [p.tolist() for p in global_top_k(scores, names, 4)] == [[0], [0, 1, 2]]


def test_selection_ratio_keeps_lowest_abs_cos_ties_by_name() -> None:
    cos = {"d": 0.1, "c": -0.9, "b": 0.5, "a": -0.5}
    # ceil(0.75 * 4) = 3: drop the highest |c_t|, c.
    assert select_tensors(cos, mode="ratio", ratio=0.75, threshold=None) == {"a", "b", "d"}
    # ceil(0.5 * 4) = 2: d, then a tie at |0.5| between a and b: a by name.
    assert select_tensors(cos, mode="ratio", ratio=0.5, threshold=None) == {"a", "d"}
    assert select_tensors(cos, mode="threshold", ratio=1, threshold=0.5) == {"a", "b", "d"}


# --- parameter validation --------------------------------------------------------------


def _recipe(**kw: object) -> Recipe:
    data: dict[str, object] = {"merge_method": "maec", "base_model": "b", "language_base": "l",
                               "abilities": [{"model": "a"}]}
    data.update(kw)
    return Recipe.model_validate(data)


def test_defaults_are_the_documented_ones() -> None:
    p = validate_maec_recipe(_recipe())
    assert (p.importance, p.granularity, p.key_ratio, p.rank_scope) == (
        "delta", "row", 0.05, "tensor")
    assert (p.selection, p.selection_ratio, p.artifact_dtype) == ("ratio", 0.75, None)
    assert p.is_included(Q0, 2) and not p.is_included(NORM0, 1)
    assert not p.is_included(EMBED, 2) and not p.is_included(HEAD, 2)


@pytest.mark.parametrize("key,value", [("key_ratio", 0.0), ("key_ratio", 1.5),
                                       ("selection_ratio", 0.0), ("selection_ratio", -1)])
def test_ratio_outside_unit_interval_is_refused(key: str, value: float) -> None:
    with pytest.raises(RecipeError, match=key):
        validate_maec_recipe(_recipe(parameters={key: value}))


def test_unknown_parameter_and_missing_fields_are_refused() -> None:
    with pytest.raises(RecipeError, match="unknown MAEC parameter 'key_ration'"):
        maec_params(_recipe(parameters={"key_ration": 0.1}))
    with pytest.raises(RecipeError, match="language_base"):
        validate_maec_recipe(_recipe(language_base=None))
    with pytest.raises(RecipeError, match="base_model"):
        validate_maec_recipe(_recipe(base_model=None))
    with pytest.raises(RecipeError, match="at least one entry in abilities"):
        validate_maec_recipe(_recipe(abilities=[]))
    with pytest.raises(RecipeError, match="selection_threshold"):
        validate_maec_recipe(_recipe(parameters={"selection": "threshold"}))
    with pytest.raises(RecipeError, match="not a regex"):
        validate_maec_recipe(_recipe(parameters={"include": "([a"}))


@pytest.mark.parametrize("k", [1, 5, 17, 40, 99, 150, 199, 200, 250])
def test_streaming_global_select_matches_in_memory_rule(k: int) -> None:
    from maec_core.maec.radix import select_global

    g = torch.Generator().manual_seed(k)
    # Heavy ties (few distinct values, zeros among them) force the index digits too.
    sizes = {"b.w": 60, "a.w": 80, "c.w": 60}
    scores = {n: torch.randint(0, 4, (s,), generator=g).float() * 0.5 for n, s in
              sizes.items()}
    passes = [0]

    def stream():
        passes[0] += 1
        yield from scores.items()

    sel = select_global(stream, sizes, k)
    names = list(sizes)
    expected = global_top_k([scores[n] for n in names], names, k)
    for n, e in zip(names, expected, strict=True):
        assert sel.keep(n, scores[n]).tolist() == e.tolist(), n
        assert sel.counts[n] == e.numel()
    assert passes[0] <= 6


def test_streaming_global_select_real_valued_needs_two_passes() -> None:
    from maec_core.maec.radix import select_global

    g = torch.Generator().manual_seed(0)
    scores = {"x": torch.rand(1000, generator=g), "y": torch.rand(500, generator=g)}
    passes = [0]

    def stream():
        passes[0] += 1
        yield from scores.items()

    sel = select_global(stream, {"x": 1000, "y": 500}, 75)
    ref = global_top_k([scores["x"], scores["y"]], ["x", "y"], 75)
    assert sel.keep("x", scores["x"]).tolist() == ref[0].tolist()
    assert sel.keep("y", scores["y"]).tolist() == ref[1].tolist()
    assert passes[0] == 2
