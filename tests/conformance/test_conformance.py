"""mergekit's own recipes (a fast subset) give mergekit 0.1.5's answer here.

Slow: mergekit is imported and each recipe runs through both tools. Every recipe runs
in `make bench-conformance`.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.conformance.models import ModelFarm
from tests.conformance.suite import (
    KNOWN_DIFFERENCES,
    RECIPES,
    ROW_LAYOUT_DIFFERENCES,
    load_recipe,
    recipe_files,
    run_mergekit,
    run_one,
    run_ours,
)
from tests.conformance.suite import _tensors as tensors_of
from tests.factories import spy_slice_sizes

pytest.importorskip("mergekit.merge")

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def farm(tmp_path_factory: pytest.TempPathFactory) -> ModelFarm:
    return ModelFarm(tmp_path_factory.mktemp("conformance-models"))


@pytest.mark.parametrize("path", recipe_files(only_fast=True), ids=lambda p: p.stem)
def test_recipe_matches_mergekit(path: Path, farm: ModelFarm, tmp_path: Path,
                                 request: pytest.FixtureRequest) -> None:
    if path.stem in KNOWN_DIFFERENCES:
        # Strict: the day the two agree, the entry must go.
        request.applymarker(pytest.mark.xfail(reason=KNOWN_DIFFERENCES[path.stem],
                                              strict=True))
    outcome = run_one(path, farm, tmp_path)
    assert outcome.agree, (f"ours: {outcome.ours}, mergekit: {outcome.theirs}")
    assert outcome.passed, "\n".join(outcome.problems + outcome.other)
    if outcome.ours.accepted and not outcome.statistical:
        # Same compute dtype, same operations: mergekit's bytes, not just its values.
        assert outcome.max_abs_diff == 0, f"max abs diff {outcome.max_abs_diff:.3g}"


@pytest.mark.parametrize("stem", ROW_LAYOUT_DIFFERENCES)
def test_added_token_vocabularies_in_slices_keep_mergekit_rows(stem: str, farm: ModelFarm,
                                                               tmp_path: Path) -> None:
    """Slices over checkpoints whose vocabularies differ by added tokens: both accept;
    every tensor is mergekit's, but the vocabulary tensors, whose rows of the tokens
    both hold are mergekit's and whose other rows are zeros; ours loads in transformers,
    mergekit's (rows copied as they are, under the other model's config) does not."""
    from transformers import AutoModelForCausalLM

    recipe = load_recipe(RECIPES / f"{stem}.yaml", farm)
    ours, theirs = tmp_path / "ours", tmp_path / "mergekit"
    assert run_ours(recipe, ours).accepted and run_mergekit(recipe, theirs).accepted
    mine, ref = tensors_of(ours), tensors_of(theirs)
    assert sorted(mine) == sorted(ref)
    laid_out = 0
    for name in mine:
        got, want = mine[name], ref[name]
        if got.shape == want.shape:
            assert torch.equal(got, want), name
            continue
        laid_out += 1
        n = min(got.shape[0], want.shape[0])
        assert torch.equal(got[:n], want[:n]), name
        assert not got[n:].any(), name
    assert laid_out == 1  # the LM head: the embedding comes from the config's model
    AutoModelForCausalLM.from_pretrained(ours)
    with pytest.raises(RuntimeError, match="mismatched_sizes"):
        AutoModelForCausalLM.from_pretrained(theirs)


@pytest.mark.parametrize("method", ["task_arithmetic", "ties"])
def test_union_over_an_extended_language_base_matches_mergekit_by_token(
        method: str, tmp_path: Path) -> None:
    """Deltas over ``tokenizer_source: union`` where the language model extends the
    base's vocabulary (two plain words and an added token): every tensor is mergekit's,
    the vocabulary tensors row for row once rows are matched by token. mergekit orders
    new plain tokens as it meets them in ``get_vocab()``, a dict built from the Rust
    tokenizer's hash map, so its ids for ``x0`` and ``x1`` change from run to run (up to
    0.1 apart when compared by id); this engine takes them in id order."""
    from transformers import AutoTokenizer

    from tests.factories import make_extended, make_llama

    base = make_llama(tmp_path / "base", seed=1)
    donor = make_llama(tmp_path / "donor", seed=2)
    lang = make_extended(tmp_path / "lang", 3, like=base, words=["x0", "x1"],
                         added=["<lang>"])
    extra = {"density": 0.5} if method == "ties" else {}
    recipe = {"merge_method": method, "base_model": str(base), "dtype": "float32",
              "tokenizer_source": "union",
              "models": [{"model": str(donor), "parameters": {"weight": 0.5, **extra}},
                         {"model": str(lang), "parameters": {"weight": 0.5, **extra}}]}
    ours, theirs = tmp_path / "ours", tmp_path / "mergekit"
    assert run_ours(recipe, ours).accepted and run_mergekit(recipe, theirs).accepted
    mine, ref = tensors_of(ours), tensors_of(theirs)
    by_id = {str(f): AutoTokenizer.from_pretrained(f).get_vocab() for f in (ours, theirs)}
    assert set(by_id[str(ours)]) == set(by_id[str(theirs)])
    order = sorted(by_id[str(ours)], key=by_id[str(ours)].__getitem__)
    rows = torch.tensor([by_id[str(theirs)][t] for t in order])
    assert sorted(mine) == sorted(ref)
    for name, got in mine.items():
        vocab = name.endswith(("embed_tokens.weight", "lm_head.weight"))
        assert torch.equal(got, ref[name][rows] if vocab else ref[name]), name


# 16-bit recipes of every method the engine streams in slices.
STREAMED_16BIT = ("basic_task_arithmetic", "task_arithmetic_bf16", "task_arithmetic_fp16",
                  "basic_linear", "linear_fp16", "method_nearswap_bf16",
                  "method_nearswap_fp16", "method_ram_bf16", "method_ram_fp16",
                  "passthrough_scale_bf16", "passthrough_scale_fp16",
                  # Reductions (norms, a dot) in passes over slices, then element-wise.
                  "basic_slerp", "method_slerp_bf16", "method_slerp_fp16")
# Slices and units that cut every tensor at odd places (the tiny models' tensors hold
# 2,048 entries or fewer, less than one real slice).
ODD_CHUNK, ODD_UNIT = 77, 300


def _bits(folder: Path) -> dict[str, bytes]:
    out: dict[str, bytes] = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update({k: bytes(v.contiguous().view(torch.uint8).numpy())
                    for k, v in load_file(f).items()})
    return out


@pytest.mark.parametrize("stem", STREAMED_16BIT)
def test_streamed_16bit_recipes_give_mergekits_bytes(
    stem: str, farm: ModelFarm, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A 16-bit recipe streamed in slices cut at odd places writes mergekit's bytes
    (every bit, -0.0 included), and really was computed slice by slice."""
    path = RECIPES / f"{stem}.yaml"
    recipe = load_recipe(path, farm)
    assert recipe["dtype"] in ("bfloat16", "float16")
    sizes = spy_slice_sizes(monkeypatch, recipe["merge_method"], unit=ODD_UNIT,
                            chunk=ODD_CHUNK)
    outcome = run_one(path, farm, tmp_path)
    assert outcome.passed, "\n".join([str(outcome.ours), str(outcome.theirs),
                                      *outcome.problems, *outcome.other])
    assert sizes and max(sizes) <= ODD_CHUNK, f"computed whole tensors of {max(sizes)}"
    ours, theirs = _bits(tmp_path / f"{stem}-ours"), _bits(tmp_path / f"{stem}-mergekit")
    assert ours.keys() == theirs.keys()
    assert [k for k in ours if ours[k] != theirs[k]] == []


def test_fast_subset_exists() -> None:
    fast = recipe_files(only_fast=True)
    assert len(fast) >= 6 and all(p.parent == RECIPES for p in fast)


def test_recipes_cover_every_method_we_register(tmp_path: Path) -> None:
    """Every method both tools register is named by some recipe."""
    from mergekit.merge_methods.registry import registered_methods

    from maec_core.methods import all_methods

    farm = _NamesOnly()
    used = {str(load_recipe(p, farm).get("merge_method")) for p in recipe_files()}
    ours = {m.name for m in all_methods()} - {"maec"}
    theirs = {m.spec.name for m in registered_methods()}
    assert (ours & theirs) <= used


class _NamesOnly(ModelFarm):
    """Placeholders filled with their own names: enough to read a recipe's method."""

    def __init__(self) -> None:
        super().__init__(Path("."))

    def __getitem__(self, key: str) -> Path:
        return Path(key)
