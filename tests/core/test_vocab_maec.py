"""MAEC with a language base whose tokenizer extends (and trims) the donor's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoTokenizer, LlamaForCausalLM

from maec_core.errors import IncompatibleCheckpoints, RecipeError
from maec_core.io.folder import open_model_folder
from maec_core.plan import plan_recipe
from maec_core.recipe import Recipe
from maec_core.run import run
from tests.core.test_maec_common import _private_cache  # noqa: F401 - autouse fixture
from tests.factories import make_extended, make_llama

EMBED, HEAD = "model.embed_tokens.weight", "lm_head.weight"


@pytest.fixture(scope="module")
def trio(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("maec-vocab")
    base = make_llama(root / "base", seed=0)
    return {
        "base": base,
        "donor": make_llama(root / "donor", seed=1, like=base, noise=0.05),
        # θL: two of θ0's words gone, three new words and an added token.
        "lang": make_extended(root / "lang", 2, like=base, words=["x0", "x1", "x2"],
                              added=["<lang>"], drop=2),
    }


def _recipe(trio: dict[str, Path], **extra: object) -> Recipe:
    data: dict[str, object] = {
        "merge_method": "maec", "base_model": str(trio["base"]),
        "language_base": str(trio["lang"]), "abilities": [{"model": str(trio["donor"])}],
        "parameters": {"include": ["embed_tokens", "lm_head", r"\.layers\."],
                       "key_ratio": 1.0, "selection_ratio": 1.0},
        "tokenizer_source": str(trio["lang"]),
    }
    data.update(extra)
    return Recipe.model_validate({k: v for k, v in data.items() if v is not None})


def _load(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(str(folder / "model.safetensors"))


@pytest.mark.parametrize("granularity", ["row", "element"])
def test_shared_tokens_merge_new_tokens_keep_lang_rows(trio: dict[str, Path], tmp_path: Path,
                                                       granularity: str) -> None:
    recipe = _recipe(trio)
    recipe = recipe.model_copy(update={"parameters": {**recipe.parameters,
                                                      "granularity": granularity}})
    res = run(recipe, tmp_path / "out")
    out = _load(tmp_path / "out")
    w0, wa, wl = (_load(trio[k]) for k in ("base", "donor", "lang"))
    v0 = AutoTokenizer.from_pretrained(trio["base"]).get_vocab()
    vl = AutoTokenizer.from_pretrained(trio["lang"]).get_vocab()
    for name in (EMBED, HEAD):
        assert out[name].shape == wl[name].shape
        for tok, j in vl.items():
            if tok in v0:
                i = v0[tok]
                want = wl[name][j] + (wa[name][i] - w0[name][i])
                torch.testing.assert_close(out[name][j], want, rtol=0, atol=1e-6,
                                           msg=f"{name}[{tok!r}]")
            else:
                assert torch.equal(out[name][j], wl[name][j]), f"{name}[{tok!r}]"
    assert not torch.equal(out[EMBED], wl[EMBED])  # not vacuous: shared rows moved
    report = json.loads((tmp_path / "out" / "maec_report.json").read_text())
    assert report["vocabulary"] == {"tokens_shared": 62, "tokens_added": 4,
                                    "tokens_dropped": 2, "language_base_rows": 66,
                                    "base_rows": 64}
    assert res.report is not None and res.report["vocabulary"]["tokens_added"] == 4
    assert AutoTokenizer.from_pretrained(tmp_path / "out").get_vocab() == vl
    model = LlamaForCausalLM.from_pretrained(tmp_path / "out")
    ids = AutoTokenizer.from_pretrained(tmp_path / "out")("w1 x0 <lang>",
                                                          return_tensors="pt").input_ids
    assert model.generate(ids, max_new_tokens=3, do_sample=False).shape[1] == ids.shape[1] + 3


def test_mismatch_without_tokenizer_source_names_the_fix(trio: dict[str, Path],
                                                         tmp_path: Path) -> None:
    recipe = _recipe(trio, tokenizer_source=None)
    folders = {str(p): open_model_folder(p) for p in trio.values()}
    with pytest.raises(IncompatibleCheckpoints, match="tokenizer_source"):
        plan_recipe(recipe, folders)
    with pytest.raises(IncompatibleCheckpoints, match="tokenizer_source"):
        run(recipe, tmp_path / "out")


def test_other_vocabulary_sources_are_refused(trio: dict[str, Path]) -> None:
    # The trio's θL dropped two of θ0's tokens: a union there is not θL's vocabulary.
    folders = {str(p): open_model_folder(p) for p in trio.values()}
    for source in ("base", "union", str(trio["base"])):
        with pytest.raises(RecipeError, match="language base"):
            plan_recipe(_recipe(trio, tokenizer_source=source), folders)



def test_union_is_accepted_when_it_is_the_language_bases_vocabulary(
        trio: dict[str, Path], tmp_path: Path) -> None:
    """A language base that appends its tokens to θ0's: mergekit's union of the inputs is
    then θL's vocabulary, so a recipe written with ``union`` gives what naming θL gives."""
    lang = make_extended(tmp_path / "appended", 3, like=trio["base"], words=["x0", "x1"],
                         added=["<lang>"])
    inputs = {**trio, "lang": lang}
    named = run(_recipe(inputs, tokenizer_source=str(lang)), tmp_path / "named")
    union = run(_recipe(inputs, tokenizer_source="union"), tmp_path / "union")
    assert named.report is not None and union.report is not None
    assert union.report["vocabulary"]["tokens_added"] == 3
    a, b = _load(tmp_path / "named"), _load(tmp_path / "union")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert (AutoTokenizer.from_pretrained(tmp_path / "union").get_vocab()
            == AutoTokenizer.from_pretrained(lang).get_vocab())

def test_plan_accepts_the_extended_language_base(trio: dict[str, Path]) -> None:
    folders = {str(p): open_model_folder(p) for p in trio.values()}
    plan = plan_recipe(_recipe(trio), folders)
    assert {t.name: t.shape for t in plan.tensors}[EMBED] == (66, 32)
