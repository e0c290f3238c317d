"""Ours against mergekit 0.1.5 on the real family: the same tensors where mergekit is
deterministic, and output tokenizers that tokenize and render chats identically."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conformance.suite import compare_tensors, run_mergekit, run_ours
from tests.real.test_methods import _weights

pytest.importorskip("mergekit.merge")

# Text in several scripts, with digits, whitespace runs and a ChatML token: what a
# tokenizer's pre-tokenizer, byte fallback and special-token handling all touch.
MULTILINGUAL = ("The quick brown fox, 1,234.5 times!  Le garçon a mangé une pomme. "
                "Der Straßenbahnfahrer grüßt. Быстрая лиса. 東京は日本の首都です。 "
                "মাছে ভাতে বাঙালি। مرحبا بالعالم 🙂\n\tcode: x = f(y) <|im_end|>")
CONVERSATION = [{"role": "system", "content": "You answer briefly."},
                {"role": "user", "content": "Quelle est la capitale de la France ?"},
                {"role": "assistant", "content": "Paris."},
                {"role": "user", "content": "And of Bangladesh?"}]


def _recipe(method: str, f: dict[str, Path]) -> dict[str, Any]:
    base, donor, lang = str(f["base"]), str(f["donor"]), str(f["lang"])
    two = [{"model": donor, "parameters": {"weight": 0.6, "density": 0.5}},
           {"model": lang, "parameters": {"weight": 0.4, "density": 0.5}}]
    recipes: dict[str, dict[str, Any]] = {
        "linear": {"models": [{"model": donor, "parameters": {"weight": 0.6}},
                              {"model": lang, "parameters": {"weight": 0.4}}]},
        "task_arithmetic": {"base_model": base, "models": [
            {"model": donor, "parameters": {"weight": 0.6}},
            {"model": lang, "parameters": {"weight": 0.4}}]},
        "slerp": {"base_model": base, "models": [{"model": donor}],
                  "parameters": {"t": 0.3}},
        "ties": {"base_model": base, "models": two},
    }
    return {"merge_method": method, "dtype": "bfloat16", **recipes[method]}


@pytest.fixture(scope="module")
def merged(family: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
           ) -> dict[str, tuple[Path, Path]]:
    """Each method's output from both tools, merged once for the module."""
    root = tmp_path_factory.mktemp("real-mergekit")
    out: dict[str, tuple[Path, Path]] = {}
    for method in ("linear", "task_arithmetic", "slerp", "ties"):
        recipe = _recipe(method, family)
        ours, theirs = root / f"{method}-ours", root / f"{method}-mergekit"
        verdicts = run_ours(recipe, ours), run_mergekit(recipe, theirs)
        assert all(v.accepted for v in verdicts), verdicts
        out[method] = (ours, theirs)
    return out


@pytest.mark.parametrize("method", ["linear", "task_arithmetic", "slerp", "ties"])
def test_tensors_match_mergekits_within_rounding(method: str,
                                                 merged: dict[str, tuple[Path, Path]]) -> None:
    problems, _ = compare_tensors(*(_weights(p) for p in merged[method]))
    assert not problems, problems[:5]


# SLERP in bfloat16 streams its norms and dot over mergekit's own chunks, on torch's
# threads as mergekit reduces them: its bytes, like the element-wise methods.
@pytest.mark.parametrize("method", ["linear", "task_arithmetic", "slerp", "ties"])
def test_tensors_equal_mergekits(method: str, merged: dict[str, tuple[Path, Path]]) -> None:
    ours, theirs = merged[method]
    mine, ref = _weights(ours), _weights(theirs)
    # Same compute dtype, same operations: mergekit's bytes.
    assert sorted(mine) == sorted(ref)
    different = [k for k in ref if not torch.equal(mine[k], ref[k])]
    assert not different, f"{len(different)} tensors differ, e.g. {different[:3]}"


def test_output_tokenizers_agree_with_mergekits(merged: dict[str, tuple[Path, Path]]
                                                ) -> None:
    from transformers import AutoTokenizer

    ours, theirs = (AutoTokenizer.from_pretrained(p) for p in merged["linear"])
    assert ours(MULTILINGUAL)["input_ids"] == theirs(MULTILINGUAL)["input_ids"]
    assert ours.decode(ours(MULTILINGUAL)["input_ids"]) == \
        theirs.decode(theirs(MULTILINGUAL)["input_ids"])
    rendered = [str(t.apply_chat_template(CONVERSATION, tokenize=False,
                                          add_generation_prompt=True)) for t in (ours, theirs)]
    assert rendered[0] == rendered[1]
    assert rendered[0].endswith("<|im_start|>assistant\n")
    assert (ours.eos_token, ours.bos_token, ours.pad_token) == \
        (theirs.eos_token, theirs.bos_token, theirs.pad_token)
