"""Vocabulary merges: tokenizer_source base / union / a model, per-token overrides,
padding, tied embeddings, and refusals; agreement with mergekit 0.1.5 by token string."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoTokenizer, LlamaForCausalLM

from maec_core.errors import IncompatibleCheckpoints, RecipeError, TokenizerError
from maec_core.io.folder import open_model_folder
from maec_core.parsing import parse_recipe
from maec_core.plan import plan_recipe
from tests.factories import make_extended, make_llama, run_recipe

EMBED, HEAD = "model.embed_tokens.weight", "lm_head.weight"


@pytest.fixture(scope="module")
def vz(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A base, a language base extending its vocabulary (3 words and an added token), and
    a fine-tune that lost two words and gained one."""
    root = tmp_path_factory.mktemp("vocab")
    base = make_llama(root / "base", seed=0)
    return {
        "base": base,
        "ext": make_extended(root / "ext", 3, like=base, words=["x0", "x1", "x2"],
                             added=["<lang>"]),
        "drop": make_extended(root / "drop", 4, like=base, words=["y0"], drop=2),
        "tuned": make_llama(root / "tuned", seed=5, like=base),
    }


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def _by_token(folder: Path) -> tuple[dict[str, int], dict[str, torch.Tensor]]:
    return AutoTokenizer.from_pretrained(folder).get_vocab(), _tensors(folder)


def compare_with_mergekit(recipe: dict[str, Any], tmp_path: Path) -> None:
    """Our merge and mergekit's have the same vocabulary and, token by token, the same
    embedding and LM-head rows (ids may differ: compared by token string)."""
    mk_config = pytest.importorskip("mergekit.config")
    mk_merge = pytest.importorskip("mergekit.merge")
    run_recipe(recipe, tmp_path / "ours")
    cfg = mk_config.MergeConfiguration.model_validate(recipe)
    mk_merge.run_merge(cfg, str(tmp_path / "theirs"),
                       mk_merge.MergeOptions(quiet=True, write_model_card=False))
    our_vocab, ours = _by_token(tmp_path / "ours")
    their_vocab, theirs = _by_token(tmp_path / "theirs")
    assert set(our_vocab) == set(their_vocab)
    assert sorted(ours) == sorted(theirs)
    ours_cfg = json.loads((tmp_path / "ours" / "config.json").read_text())
    theirs_cfg = json.loads((tmp_path / "theirs" / "config.json").read_text())
    assert ours_cfg["vocab_size"] == theirs_cfg["vocab_size"]
    for name, ref in theirs.items():
        got = ours[name]
        assert got.shape == ref.shape, name
        if name not in (EMBED, HEAD):
            torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6, msg=name)
            continue
        for tok, j in their_vocab.items():
            torch.testing.assert_close(got[our_vocab[tok]], ref[j], rtol=1e-5, atol=1e-6,
                                       msg=f"{name}[{tok!r}]")
        n = len(their_vocab)
        torch.testing.assert_close(got[n:], ref[n:], rtol=1e-5, atol=1e-6, msg=f"{name} pad")


def _models(vz: dict[str, Path], *names: str, weight: float = 0.5) -> list[dict[str, Any]]:
    return [{"model": str(vz[n]), "parameters": {"weight": weight}} for n in names]


@pytest.mark.slow
def test_union_linear_matches_mergekit(vz: dict[str, Path], tmp_path: Path) -> None:
    compare_with_mergekit({"merge_method": "linear",
                           "models": _models(vz, "base", "ext", "drop"),
                           "tokenizer_source": "union", "dtype": "float32"}, tmp_path)


@pytest.mark.slow
def test_union_task_arithmetic_matches_mergekit(vz: dict[str, Path], tmp_path: Path) -> None:
    compare_with_mergekit({"merge_method": "task_arithmetic", "base_model": str(vz["base"]),
                           "models": _models(vz, "ext", "drop", "tuned", weight=0.7),
                           "tokenizer_source": "union", "dtype": "float32"}, tmp_path)


@pytest.mark.slow
def test_base_task_arithmetic_matches_mergekit(vz: dict[str, Path], tmp_path: Path) -> None:
    compare_with_mergekit({"merge_method": "task_arithmetic", "base_model": str(vz["base"]),
                           "models": _models(vz, "ext", "drop", weight=0.6),
                           "tokenizer_source": "base", "dtype": "float32"}, tmp_path)


def test_base_without_base_model_is_the_first_model(vz: dict[str, Path],
                                                    tmp_path: Path) -> None:
    """No base_model: the first model's vocabulary (mergekit picks one from a set, so
    this case is not compared with it). Tokens one model lacks take the mean of the
    models that have them; tokens only one has take its row."""
    out = tmp_path / "out"
    run_recipe({"merge_method": "linear", "models": _models(vz, "ext", "drop", "base"),
                "tokenizer_source": "base", "dtype": "float32"}, out)
    vocab, merged = _by_token(out)
    ext_vocab, ext = _by_token(vz["ext"])
    _, base = _by_token(vz["base"])
    assert vocab == ext_vocab
    for name in (EMBED, HEAD):
        # x0: ext alone has it, so every model's aligned row is ext's.
        torch.testing.assert_close(merged[name][vocab["x0"]], ext[name][ext_vocab["x0"]])
        # w60: drop lacks it; its aligned row is the mean of ext's and base's.
        i = vocab["w60"]
        mean = (ext[name][i] + base[name][i]) / 2
        want = (ext[name][i] + mean + base[name][i]) / 3
        torch.testing.assert_close(merged[name][i], want)


@pytest.mark.slow
def test_token_overrides_and_padding_match_mergekit(vz: dict[str, Path],
                                                    tmp_path: Path) -> None:
    base, ext = str(vz["base"]), str(vz["ext"])
    compare_with_mergekit({
        "merge_method": "task_arithmetic",
        "base_model": base,
        "models": _models(vz, "ext", "drop"),
        "tokenizer": {
            "source": "union",
            "pad_to_multiple_of": 16,
            "tokens": {
                "x0": {"source": {"kind": "zero"}},
                "w5": {"source": ext, "force": True},
                "x1": {"source": {"kind": "model_token", "model": base, "token": "w7"}},
                "<new>": {"source": {"kind": "model_token", "model": ext, "token_id": 9}},
            },
        },
        "dtype": "float32",
    }, tmp_path)


def test_model_source_keeps_that_vocabulary(vz: dict[str, Path], tmp_path: Path) -> None:
    """tokenizer_source naming the language base: its tokens, its added token, its rows
    for the tokens only it has, the merge for shared ones."""
    out = tmp_path / "out"
    run_recipe({"merge_method": "linear", "models": _models(vz, "base", "ext"),
                "tokenizer_source": str(vz["ext"]), "dtype": "float32"}, out)
    vocab, merged = _by_token(out)
    ext_vocab, ext = _by_token(vz["ext"])
    _, base = _by_token(vz["base"])
    assert vocab == ext_vocab
    for name in (EMBED, HEAD):
        for tok in ("x0", "x2", "<lang>"):
            assert torch.equal(merged[name][vocab[tok]], ext[name][ext_vocab[tok]])
        i = vocab["w4"]
        torch.testing.assert_close(merged[name][i], (base[name][i] + ext[name][i]) / 2)
    assert json.loads((out / "config.json").read_text())["vocab_size"] == len(vocab)


def test_tied_embeddings_stay_tied(tmp_path: Path) -> None:
    base = make_llama(tmp_path / "base", seed=0, tie_word_embeddings=True)
    ext = make_extended(tmp_path / "ext", 3, like=base, words=["x0", "x1"])
    assert HEAD not in _tensors(ext)
    out = tmp_path / "out"
    run_recipe({"merge_method": "linear", "models": _models({"a": base, "b": ext}, "a", "b"),
                "tokenizer_source": "union"}, out)
    merged = _tensors(out)
    assert HEAD not in merged and merged[EMBED].shape[0] == 66
    config = json.loads((out / "config.json").read_text())
    assert config["tie_word_embeddings"] is True and config["vocab_size"] == 66


def test_merged_model_loads_and_generates(vz: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "out"
    run_recipe({"merge_method": "task_arithmetic", "base_model": str(vz["base"]),
                "models": _models(vz, "ext", "drop"), "tokenizer_source": "union"}, out)
    tok = AutoTokenizer.from_pretrained(out)
    model = LlamaForCausalLM.from_pretrained(out)
    ids = tok("w1 x0 y0 <lang>", return_tensors="pt").input_ids
    assert tok.unk_token_id not in ids[0].tolist()
    gen = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert gen.shape[1] == ids.shape[1] + 4
    assert model.get_input_embeddings().weight.shape[0] == len(tok)


def test_mismatch_without_tokenizer_source_names_the_fix(vz: dict[str, Path],
                                                         tmp_path: Path) -> None:
    recipe = parse_recipe({"merge_method": "linear", "models": _models(vz, "base", "ext")})
    folders = {str(vz[k]): open_model_folder(vz[k]) for k in ("base", "ext")}
    with pytest.raises(IncompatibleCheckpoints, match="tokenizer_source"):
        plan_recipe(recipe, folders)
    with pytest.raises(IncompatibleCheckpoints, match="tokenizer_source"):
        run_recipe(recipe, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_plan_is_header_only_and_sized_to_the_vocabulary(vz: dict[str, Path]) -> None:
    recipe = parse_recipe({"merge_method": "linear", "models": _models(vz, "base", "ext"),
                           "tokenizer": {"source": "union", "pad_to_multiple_of": 32}})
    folders = {str(vz[k]): open_model_folder(vz[k]) for k in ("base", "ext")}
    plan = plan_recipe(recipe, folders)
    shapes = {t.name: t.shape for t in plan.tensors}
    assert shapes[EMBED] == (96, 32) and shapes[HEAD] == (96, 32)
    assert plan.config_updates == {"vocab_size": 96}


def test_unparseable_tokenizer_is_invalid_tokenizer(vz: dict[str, Path],
                                                    tmp_path: Path) -> None:
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(vz["ext"], bad)
    (bad / "tokenizer.json").write_text('{"model": {"type": "Nonsense"}}')
    recipe = parse_recipe({"merge_method": "linear",
                           "models": [{"model": str(vz["base"])}, {"model": str(bad)}],
                           "tokenizer_source": "union"})
    folders = {str(vz["base"]): open_model_folder(vz["base"]), str(bad): open_model_folder(bad)}
    with pytest.raises(TokenizerError) as err:
        plan_recipe(recipe, folders)
    assert err.value.code == "invalid_tokenizer"


def test_override_naming_a_missing_token_is_refused(vz: dict[str, Path],
                                                    tmp_path: Path) -> None:
    recipe = {"merge_method": "linear", "models": _models(vz, "base", "ext"),
              "tokenizer": {"source": "union",
                            "tokens": {"x0": {"source": str(vz["base"])}}}}
    with pytest.raises(TokenizerError, match="x0"):
        run_recipe(recipe, tmp_path / "out")


def test_tokenizer_refs_are_sources_and_rewritten(vz: dict[str, Path]) -> None:
    base, ext = str(vz["base"]), str(vz["ext"])
    recipe = parse_recipe({"merge_method": "linear", "models": _models(vz, "base", "ext"),
                           "tokenizer": {"source": ext, "tokens": {
                               "x0": {"source": {"kind": "model_token", "model": base,
                                                 "token": "w1"}}}}})
    refs = [s for s in recipe.sources() if s.kind == "tokenizer"]
    assert [s.ref for s in refs] == [ext, base]
    moved = recipe.with_sources({ext: "/e", base: "/b"})
    assert moved.tokenizer is not None and moved.tokenizer.source == "/e"
    src = moved.tokenizer.tokens["x0"].source
    assert getattr(src, "model", None) == "/b"
    with pytest.raises(Exception, match="not both"):
        parse_recipe({"merge_method": "linear", "models": _models(vz, "base"),
                      "tokenizer_source": "base", "tokenizer": {"source": "union"}})


def test_slices_refuse_vocabulary_merges(vz: dict[str, Path]) -> None:
    sl = [{"sources": [{"model": str(vz["base"]), "layer_range": [0, 2]}]}]
    for extra in ({"tokenizer_source": "union"}, {"tokenizer": {"source": "base"}}):
        with pytest.raises(RecipeError, match="slices recipe"):
            parse_recipe({"merge_method": "passthrough", "slices": sl, **extra})
