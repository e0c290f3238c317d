"""``importance: gradient`` on a tiny Llama whose loss depends on two planted hidden dims.

lm_head is zeroed except for columns A and B, so the logits (and the loss) read the
final hidden state only through dims A and B. The residual stream carries those dims
straight from every layer's o_proj and down_proj *rows* A and B, so ∂loss/∂W is large
on those rows and small elsewhere (only the final RMSNorm's denominator couples the
other dims, at O(1/hidden)). θA's own largest deltas are planted on other rows, so delta
importance would pick those: only a real gradient pass finds A and B.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM

from maec_core.artifact_store import LocalArtifactStore
from maec_core.context import RunContext
from maec_core.errors import CorpusError
from maec_core.maec.keys import artifact_key
from maec_core.maec.pipeline import extract
from maec_core.parsing import parse_recipe
from maec_core.recipe import Recipe
from maec_core.run import run
from tests.core.test_maec_common import _private_cache  # noqa: F401 - autouse fixture
from tests.factories import TINY, make_llama, tiny_tokenizer

A, B = 5, 17
WRITERS = [f"model.layers.{i}.{m}.weight" for i in range(2)
           for m in ("self_attn.o_proj", "mlp.down_proj")]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("grad")
    torch.manual_seed(0)
    m = LlamaForCausalLM(LlamaConfig(**TINY))
    with torch.no_grad():
        cols = torch.zeros(TINY["hidden_size"])
        cols[[A, B]] = 20.0
        m.lm_head.weight.mul_(cols)
    m.save_pretrained(root / "base")
    tiny_tokenizer().save_pretrained(root / "base")
    make_llama(root / "lang", 2, like=root / "base")
    ability = make_llama(root / "ability", 1, like=root / "base", noise=1e-3)
    # The donor's largest deltas sit on rows 0 and 1 of every writer tensor.
    weights = load_file(str(ability / "model.safetensors"))
    for name in WRITERS:
        weights[name][[0, 1]] += 0.5
    save_file(weights, str(ability / "model.safetensors"), metadata={"format": "pt"})
    rng = random.Random(0)
    lines = [json.dumps({"text": " ".join(f"w{rng.randrange(61)}" for _ in range(30))})
             for _ in range(20)]
    (root / "corpus.jsonl").write_text("\n".join(lines) + "\n")
    return {"root": root, "base": root / "base", "lang": root / "lang",
            "ability": ability, "corpus": root / "corpus.jsonl"}


def _recipe(models: dict[str, Path], corpus: Path | str | None, **params: object) -> Recipe:
    ability: dict[str, object] = {"model": str(models["ability"])}
    if corpus is not None:
        ability["corpus"] = str(corpus)
    return Recipe.model_validate({
        "merge_method": "maec", "base_model": str(models["base"]),
        "language_base": str(models["lang"]), "abilities": [ability],
        # hidden 32: ceil(0.0625 * 32) = 2 rows of each writer tensor.
        "parameters": {"key_ratio": 0.0625, "token_budget": 512, "seq_len": 32,
                       "batch_size": 4, **params},
    })


def _indices(folder: Path) -> dict[str, list[int]]:
    art = load_file(str(folder / "ability.safetensors"))
    return {k.removesuffix("::index"): v.tolist() for k, v in art.items()
            if k.endswith("::index")}


def test_gradient_ranks_the_rows_the_loss_depends_on(models: dict[str, Path],
                                                     tmp_path: Path) -> None:
    grad = extract(_recipe(models, models["corpus"], importance="gradient"), 0,
                   tmp_path / "grad")
    got = _indices(grad.folder)
    for name in WRITERS:
        assert got[name] == [A, B], name
    assert grad.metadata["gradient"]["tokens"] == 512
    # Delta importance on the same donor picks the planted delta rows instead.
    delta = _indices(extract(_recipe(models, None), 0, tmp_path / "delta").folder)
    for name in WRITERS:
        assert delta[name] == [0, 1], name


def test_gradient_mode_is_deterministic_and_combines(models: dict[str, Path],
                                                     tmp_path: Path) -> None:
    r = _recipe(models, models["corpus"], importance="gradient")
    store = LocalArtifactStore(tmp_path / "store")
    res = run(r, tmp_path / "out", RunContext(artifact_store=store))
    assert res.report is not None and res.report["abilities"][0]["gradient"]["batches"] == 4
    a = extract(r, 0, tmp_path / "a")
    assert [a.key] == res.report["artifact_keys"] and a.key == artifact_key(r, 0)
    stored = store.get(a.key)
    assert stored is not None
    for name in ("ability.json", "ability.safetensors"):
        assert (a.folder / name).read_bytes() == (stored / name).read_bytes()
    # The token budget is part of the key.
    assert artifact_key(_recipe(models, models["corpus"], importance="gradient",
                                token_budget=256), 0) != a.key


def test_plain_text_corpus(models: dict[str, Path], tmp_path: Path) -> None:
    text = tmp_path / "corpus.txt"
    text.write_text("w1 w2 w3 w4\nw5 w6\n\nw7 w8 w9\n")
    res = extract(_recipe(models, text, importance="gradient"), 0, tmp_path / "art")
    # Two paragraphs of 6 and 3 tokens, each followed by EOS: 11 tokens.
    assert res.metadata["gradient"]["tokens"] == 11


def test_gradient_without_corpus_is_refused(models: dict[str, Path]) -> None:
    r = _recipe(models, None).model_dump()
    r["parameters"]["importance"] = "gradient"
    with pytest.raises(CorpusError, match="needs an ability corpus"):
        parse_recipe(r)


def test_missing_corpus_file_is_refused(models: dict[str, Path], tmp_path: Path) -> None:
    with pytest.raises(CorpusError, match="not found"):
        extract(_recipe(models, tmp_path / "nope.jsonl", importance="gradient"), 0,
                tmp_path / "art")
    assert not (tmp_path / "art").exists()


def test_corpus_without_usable_text_is_refused(models: dict[str, Path], tmp_path: Path) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text('{"text": "   "}\n\n{"text": ""}\n')
    with pytest.raises(CorpusError, match="no usable text"):
        extract(_recipe(models, empty, importance="gradient"), 0, tmp_path / "art")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "w1 w2"}\n{"body": "w3"}\n')
    with pytest.raises(CorpusError, match="line 2"):
        extract(_recipe(models, bad, importance="gradient"), 0, tmp_path / "art")
    assert not (tmp_path / "art").exists()
