"""MAEC over a language base whose tokenizer extends the donor's.

The ability artifact is extracted in θ0's token order (θA shares θ0's vocabulary); the
language base θL may have added tokens (and lost some). Its key rows in the embedding and
LM head are moved to the θL row of the same token string; rows of tokens θL lacks are
dropped, and θL's new tokens keep θL's rows. Torch-free (the API plans with it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from maec_core.errors import IncompatibleCheckpoints, RecipeError, TokenizerError
from maec_core.io.folder import ModelFolder
from maec_core.maec.params import maec_inputs
from maec_core.recipe import Recipe
from maec_core.vocab.build import VocabSpec, embedding_rows, union_vocab
from maec_core.vocab.tokens import Vocab, read_vocab


@dataclass(frozen=True)
class TokenMap:
    """``to_lang[r]``: θL's row for the token at θ0's row ``r`` (-1: θL lacks it)."""

    to_lang: list[int]
    lang_rows: int
    shared: int
    added: int
    dropped: int

    def report(self) -> dict[str, Any]:
        return {"tokens_shared": self.shared, "tokens_added": self.added,
                "tokens_dropped": self.dropped, "language_base_rows": self.lang_rows,
                "base_rows": len(self.to_lang)}


def _vocab(folder: ModelFolder, label: str) -> Vocab:
    found = read_vocab(folder, label=label)
    if found is None:
        raise TokenizerError(f"{label} has no tokenizer.json: matching tokens between "
                             "vocabularies needs each model's fast tokenizer", model=label)
    return found


def maec_token_map(
    recipe: Recipe, base: ModelFolder, lang: ModelFolder, donors: Sequence[ModelFolder]
) -> TokenMap | None:
    """How θ0's rows map to θL's, or None when there is nothing to map (same vocabulary,
    or no tokenizer settings: the plan then refuses a mismatch, naming the fix)."""
    spec = VocabSpec.of(recipe)
    if spec is None:
        return None
    if spec.source not in ("union", maec_inputs(recipe).language_base):
        raise RecipeError(
            "MAEC keeps the language base's vocabulary: set tokenizer_source to the "
            f"language base ({maec_inputs(recipe).language_base})", key="tokenizer_source")
    if spec.tokens or spec.pad_to_multiple_of:
        raise RecipeError("tokenizer.tokens and pad_to_multiple_of do not apply to MAEC: "
                          "θL's rows are kept for its own tokens", key="tokenizer")
    rows_b, rows_l = embedding_rows(base), embedding_rows(lang)
    for i, donor in enumerate(donors):
        if embedding_rows(donor) != rows_b:
            raise IncompatibleCheckpoints(
                f"ability checkpoint {i} has {embedding_rows(donor)} vocabulary rows but "
                f"base_model has {rows_b}: donors must share the base model's vocabulary",
                field="vocab_size")
    vb, vl = _vocab(base, "base_model"), _vocab(lang, "language_base")
    if spec.source == "union":
        _check_union(vb, vl, rows_b, rows_l, maec_inputs(recipe).language_base, donors)
    by_row = {i: t for t, i in vb.ids.items() if i < rows_b}
    to_lang = [-1] * rows_b
    for r, tok in by_row.items():
        j = vl.ids.get(tok, -1)
        to_lang[r] = j if j < rows_l else -1
    if rows_b == rows_l and to_lang == list(range(rows_b)):
        return None
    shared = sum(1 for j in to_lang if j >= 0)
    lang_tokens = sum(1 for i in vl.ids.values() if i < rows_l)
    return TokenMap(to_lang, rows_l, shared, lang_tokens - shared, len(by_row) - shared)


def _check_union(vb: Vocab, vl: Vocab, rows_b: int, rows_l: int, lang_ref: str | None,
                 donors: Sequence[ModelFolder]) -> None:
    """Accept ``tokenizer_source: union`` when mergekit's union of the inputs (θ0 first,
    then the donors, then θL) is exactly the language base's vocabulary, the usual case
    of a θL that appends its tokens to θ0's: then the union and what MAEC keeps are the
    same tokens at the same ids. Otherwise refuse, saying how they differ."""
    vocabs = {"base_model": vb, "language_base": vl}
    rows = {"base_model": rows_b, "language_base": rows_l}
    for i, donor in enumerate(donors):
        key = f"donor{i}"
        vocabs[key] = read_vocab(donor, label=key) or vb
        rows[key] = rows_b
    order = ["base_model", *[k for k in vocabs if k.startswith("donor")], "language_base"]
    union = union_vocab(vocabs, rows, order).ids
    lang = {t: i for t, i in vl.ids.items() if i < rows_l}
    if union == lang:
        return
    missing = sorted(set(union) - set(lang))
    moved = sorted(t for t in set(union) & set(lang) if union[t] != lang[t])
    raise RecipeError(
        "tokenizer_source union is not the language base's vocabulary here "
        f"({len(missing)} token(s) the language base lacks, e.g. {missing[:3]}; "
        f"{len(moved)} at other ids, e.g. {moved[:3]}); MAEC keeps the language base's "
        f"vocabulary: set tokenizer_source to the language base ({lang_ref})",
        key="tokenizer_source")
