"""Every merge method on the real family: each output loads in transformers and
generates, and the identities hold exactly on real weights."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from tests import real_model
from tests.factories import run_recipe


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def _two(f: dict[str, Path], **params: Any) -> list[dict[str, Any]]:
    return [{"model": str(f["donor"]), "parameters": dict(params)},
            {"model": str(f["lang"]), "parameters": dict(params)}]


def recipe(method: str, f: dict[str, Path], sparse: bool = False) -> dict[str, Any]:
    """A recipe of ``method`` over the family (base, donor, lang), bfloat16 like it.

    The sparsifying methods (TIES, DARE, DELLA, Breadcrumbs) keep every entry unless
    ``sparse``: a magnitude mask costs a sort of every tensor, tens of seconds a method
    at this size on two cores. TIES' mask is tested on these weights against mergekit
    (test_mergekit.py), and ``make bench-real`` merges with ``sparse``.
    """
    density = 0.5 if sparse else 1.0
    base = str(f["base"])
    r: dict[str, Any]
    if method == "maec":
        r = {"base_model": base, "language_base": str(f["lang"]),
             "abilities": [{"model": str(f["donor"])}], "parameters": {"key_ratio": 0.1}}
    elif method == "layer_swap":
        r = {"models": [{"model": str(f["donor"]), "parameters": {"role": "ability"}},
                        {"model": str(f["lang"]), "parameters": {"role": "language"}}],
             "parameters": {"bottom_k": 6, "top_k": 2}}
    elif method == "passthrough":
        r = {"slices": [{"sources": [{"model": base, "layer_range": [0, 15]}]},
                        {"sources": [{"model": str(f["donor"]), "layer_range": [15, 30]}]}]}
    elif method in ("slerp", "nearswap"):
        r = {"base_model": base, "models": [{"model": str(f["donor"])}],
             "parameters": {"t": 0.5 if method == "slerp" else 0.001}}
    elif method == "arcee_fusion":
        r = {"base_model": base, "models": [{"model": str(f["donor"])}]}
    elif method in ("karcher", "nuslerp", "multislerp"):
        r = {"models": _two(f, **({} if method == "karcher" else {"weight": 0.5}))}
    elif method in ("model_stock", "sce", "ram", "ramplus_tl"):
        r = {"base_model": base, "models": _two(f)}
    elif method == "linear":
        r = {"models": _two(f, weight=0.5)}
    elif method in ("breadcrumbs", "breadcrumbs_ties"):
        r = {"base_model": base, "models": _two(f, weight=0.5, density=0.9 if sparse else 1.0,
                                                gamma=0.01 if sparse else 0.0)}
    elif method in ("della", "della_linear"):
        r = {"base_model": base, "models": _two(f, weight=0.5, density=density,
                                                epsilon=0.1 if sparse else 0.0)}
    else:  # task_arithmetic, ties, dare_linear, dare_ties
        r = {"base_model": base, "models": _two(f, weight=0.5, density=density)}
    return {"merge_method": method, "dtype": "bfloat16", **r}


def _methods() -> list[str]:
    from maec_core.methods import all_methods

    return [m.name for m in all_methods()]


# The family's other members: a donor with two added chat tokens (a union vocabulary) and
# a PEFT LoRA adapter as a model.
EXTRA = {
    "linear-chat-tokens": lambda f: {
        "merge_method": "linear", "dtype": "bfloat16",
        "models": [{"model": str(f["base"]), "parameters": {"weight": 0.5}},
                   {"model": str(f["chat"]), "parameters": {"weight": 0.5}}],
        "tokenizer": {"source": "union"}},
    "task_arithmetic-lora": lambda f: {
        "merge_method": "task_arithmetic", "dtype": "bfloat16", "base_model": str(f["base"]),
        "models": [{"model": str(f["lora"]), "parameters": {"weight": 1.0}}]},
}


def _loads_and_generates(out: Path) -> Any:
    """The output through transformers: finite logits and three greedy tokens."""
    model, tok = real_model.load(out)
    enc = tok(real_model.ANSWER_PREFIX, return_tensors="pt")
    with torch.no_grad():
        logits = model(**enc).logits
        gen = model.generate(**enc, max_new_tokens=3, do_sample=False,
                             pad_token_id=tok.pad_token_id)
    assert torch.isfinite(logits).all()
    assert gen.shape[1] == enc["input_ids"].shape[1] + 3
    return model, tok


@pytest.mark.parametrize("method", _methods())
def test_every_method_merges_the_real_family(method: str, family: dict[str, Path],
                                             tmp_path: Path) -> None:
    run_recipe(recipe(method, family), tmp_path / "out", device="cpu")
    _loads_and_generates(tmp_path / "out")


@pytest.mark.parametrize("case", sorted(EXTRA))
def test_vocabulary_and_adapter_members(case: str, family: dict[str, Path],
                                        tmp_path: Path) -> None:
    run_recipe(EXTRA[case](family), tmp_path / "out", device="cpu")
    model, tok = _loads_and_generates(tmp_path / "out")
    if case == "linear-chat-tokens":
        # The union vocabulary: the chat tokens are tokens, with their rows.
        ids = tok.convert_tokens_to_ids(real_model.CHAT_TOKENS)
        assert len(tok) == 49152 + len(real_model.CHAT_TOKENS) and min(ids) >= 49152
        assert model.get_input_embeddings().weight.shape[0] >= len(tok)


def _assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for k in want:
        assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), k


@pytest.mark.parametrize("case", ["slerp_t0", "linear_weight0", "task_arithmetic_weight0"])
def test_identities_give_the_base_exactly(case: str, family: dict[str, Path],
                                          tmp_path: Path) -> None:
    base, donor = str(family["base"]), str(family["donor"])
    cases: dict[str, dict[str, Any]] = {
        "slerp_t0": {"merge_method": "slerp", "base_model": base,
                     "models": [{"model": donor}], "parameters": {"t": 0.0}},
        "linear_weight0": {"merge_method": "linear", "models": [
            {"model": base, "parameters": {"weight": 1.0}},
            {"model": donor, "parameters": {"weight": 0.0}}]},
        "task_arithmetic_weight0": {"merge_method": "task_arithmetic", "base_model": base,
                                    "models": [{"model": donor, "parameters": {"weight": 0.0}}]},
    }
    run_recipe({**cases[case], "dtype": "bfloat16"}, tmp_path / "out", device="cpu")
    _assert_same(_weights(tmp_path / "out"), _weights(family["base"]))


def test_maec_with_the_base_as_donor_gives_the_language_model(family: dict[str, Path],
                                                              tmp_path: Path) -> None:
    run_recipe({"merge_method": "maec", "base_model": str(family["base"]),
                "language_base": str(family["lang"]),
                "abilities": [{"model": str(family["base"])}],
                "parameters": {"key_ratio": 0.1}}, tmp_path / "out", device="cpu")
    _assert_same(_weights(tmp_path / "out"), _weights(family["lang"]))
