"""The output vocabulary of a merge and, per input, where each output token's rows are.

mergekit's meaning of ``tokenizer_source`` (``base``, ``union`` or a model) and of the
``tokenizer.tokens`` overrides: the output vocabulary comes from the named tokenizer(s);
every model's embedding and LM-head rows are gathered into it by token string; a token a
model lacks gets a default row, the same for every model lacking it: the row of the one
model that has it, else the base model's, else the mean of the models that have it,
else zeros (an override names another source, and ``force`` uses it for every model).
The recipe's method then merges the aligned rows.

Torch-free and header-only (tokenizer files are small): the API plans with it, the
engine gathers rows with ``maec_core.vocab.rows``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from maec_core.errors import RecipeError, TokenizerError
from maec_core.io.folder import ModelFolder
from maec_core.recipe import ModelTokenEmbedding, Recipe, TokenEmbedding, ZeroEmbedding
from maec_core.vocab.tokens import (
    TOKENIZER_CONFIG,
    TOKENIZER_JSON,
    Vocab,
    has_tokenizer,
    read_vocab,
)

# Tensors indexed by token on their first axis: the input embedding and the LM head.
_VOCAB_TENSOR = re.compile(r"(^|\.)(embed_tokens|lm_head)\.weight$")


def is_vocab_tensor(name: str) -> bool:
    return _VOCAB_TENSOR.search(name) is not None


def embedding_rows(folder: ModelFolder) -> int:
    """Rows of the input embedding (the model's real vocabulary size)."""
    for name, info in folder.tensors.items():
        if is_vocab_tensor(name) and "embed_tokens" in name and info.shape:
            return info.shape[0]
    size = folder.config.get("vocab_size") or (folder.config.get("text_config") or {}).get(
        "vocab_size")
    return int(size or 0)


@dataclass(frozen=True)
class VocabSpec:
    """What a recipe asks: the vocabulary's source, per-token overrides, padding."""

    source: str
    tokens: Mapping[str, TokenEmbedding] = field(default_factory=dict)
    pad_to_multiple_of: int | None = None

    @classmethod
    def of(cls, recipe: Recipe) -> VocabSpec | None:
        if recipe.tokenizer is not None:
            t = recipe.tokenizer
            return cls(t.source, dict(t.tokens), t.pad_to_multiple_of)
        if recipe.tokenizer_source is not None:
            return cls(recipe.tokenizer_source)
        return None


@dataclass(frozen=True)
class VocabPlan:
    """The output vocabulary and how every input's rows map into it.

    ``own[k][i]``: the row of model ``k`` that output token ``i`` takes, -1 when ``k``
    lacks it (or an override forces the default). ``fill_ids``: the output tokens some
    model lacks; their default row is ``sum(w * model_k[row])`` over ``fill[k]`` (rows,
    weights), zeros when no term. Rows past ``len(tokens)`` (padding) take the mean of
    each model's aligned rows. ``files``: tokenizer files to write (empty: copy those of
    ``copy_from``).
    """

    tokens: list[str]
    rows: int
    own: dict[str, list[int]]
    fill_ids: list[int]
    fill: dict[str, tuple[list[int], list[float]]]
    copy_from: str
    files: dict[str, bytes]
    present: dict[str, int]  # output tokens each model has
    dropped: dict[str, int]  # each model's tokens the output lacks
    identity: bool  # every model's rows already are the output's: nothing to remap


def plan_vocab(
    spec: VocabSpec,
    folders: Mapping[str, ModelFolder],
    *,
    base: str | None,
    refs: Mapping[str, str],
    donor: ModelFolder | None = None,
) -> VocabPlan:
    """The vocabulary plan over ``folders`` (keys in recipe order); ``base`` is the
    recipe's base model key (None: the first model's tokenizer is the base one, and no
    model is preferred when filling); ``refs`` maps recipe references to keys.

    ``donor``: the checkpoint ``spec.source`` names when it is none of ``folders`` (a
    tokenizer donor, as mergekit takes one): the output vocabulary is its tokenizer's,
    every merged model's rows gathered into it by token as for any named source, and
    its tokenizer files written (the config and other files follow the base)."""
    keys = list(folders)
    tok_base = base if base is not None else keys[0]
    rows = {k: embedding_rows(f) for k, f in folders.items()}
    if donor is None and len(set(rows.values())) == 1 and not spec.tokens and (
            not spec.pad_to_multiple_of and not has_tokenizer(folders[tok_base])):
        # Same vocabulary size and no tokenizer to match tokens by: rows stay as they are
        # and the named model's tokenizer files (if any) are copied.
        return _unchanged(spec, keys, tok_base, rows[keys[0]], refs)
    vocabs = _vocabs(folders, tok_base)
    if donor is not None:
        copy_from, out = tok_base, _donor_vocab(donor, spec.source)
    else:
        copy_from, out = _output_vocab(spec, vocabs, rows, keys, tok_base, refs)
    files: dict[str, bytes] = {}
    extra = [t for t in spec.tokens if t not in out.ids]
    if extra:
        # Override tokens the vocabulary lacks are added to it (as mergekit does).
        out = extend_vocab(out, [{"content": t, "normalized": True, "special": False}
                                 for t in extra])
    if out is not vocabs[copy_from]:
        files = tokenizer_files(out)
    tokens = [""] * len(out.ids)
    for tok, i in out.ids.items():
        tokens[i] = tok
    own = {k: [_row(vocabs[k], rows[k], t) for t in tokens] for k in keys}
    fill_ids, fill = _fill(spec, tokens, own, keys, base, vocabs, rows, refs)
    padded = _padded(len(tokens), spec.pad_to_multiple_of)
    identity = not fill_ids and padded == len(tokens) and all(
        rows[k] == len(tokens) and own[k] == list(range(len(tokens))) for k in keys)
    present = {k: sum(1 for r in own[k] if r >= 0) for k in keys}
    dropped = {k: sum(1 for t, i in vocabs[k].ids.items() if i < rows[k] and t not in out.ids)
               for k in keys}
    return VocabPlan(tokens, padded, own, fill_ids, fill, copy_from, files, present,
                     dropped, identity)


def _unchanged(spec: VocabSpec, keys: list[str], tok_base: str, rows: int,
               refs: Mapping[str, str]) -> VocabPlan:
    copy_from = tok_base if spec.source in ("base", "union") else refs.get(spec.source)
    if copy_from is None or copy_from not in keys:
        raise RecipeError(f"tokenizer source {spec.source!r} is not 'base', 'union' or one "
                          "of the recipe's models", key="tokenizer_source")
    every = list(range(rows))
    return VocabPlan([], rows, {k: every for k in keys}, [], {}, copy_from, {},
                     {k: rows for k in keys}, {k: 0 for k in keys}, True)


def _donor_vocab(donor: ModelFolder, label: str) -> Vocab:
    """A tokenizer donor's vocabulary: all of it (mergekit takes the donor's tokenizer
    whole; its embedding rows are never read)."""
    vocab = read_vocab(donor, label=label)
    if vocab is None:
        raise TokenizerError(f"tokenizer source {label} has no tokenizer.json: a "
                             "tokenizer donor needs its fast tokenizer", model=label)
    return vocab


def _padded(n: int, multiple: int | None) -> int:
    return n if not multiple or n % multiple == 0 else (n // multiple + 1) * multiple


def _row(vocab: Vocab, rows: int, token: str) -> int:
    i = vocab.ids.get(token, -1)
    return i if i < rows else -1


def _vocabs(folders: Mapping[str, ModelFolder], tok_base: str) -> dict[str, Vocab]:
    """Every model's tokenizer; one without tokenizer.json is taken to share the base
    model's (mergekit assumes the same)."""
    base_vocab = read_vocab(folders[tok_base], label=tok_base)
    if base_vocab is None:
        raise TokenizerError(f"{tok_base} has no tokenizer.json: merging vocabularies needs "
                             "each model's fast tokenizer", model=tok_base)
    out: dict[str, Vocab] = {}
    for key, folder in folders.items():
        found = base_vocab if key == tok_base else read_vocab(folder, label=key)
        out[key] = found if found is not None else base_vocab
    return out


def _output_vocab(
    spec: VocabSpec, vocabs: Mapping[str, Vocab], rows: Mapping[str, int], keys: list[str],
    tok_base: str, refs: Mapping[str, str],
) -> tuple[str, Vocab]:
    """(the model whose tokenizer files the output starts from, the output vocabulary)."""
    if spec.source == "base":
        return tok_base, vocabs[tok_base]
    if spec.source == "union":
        return tok_base, union_vocab(vocabs, rows, [tok_base, *[k for k in keys
                                                               if k != tok_base]])
    key = refs.get(spec.source)
    if key is None or key not in vocabs:
        raise RecipeError(f"tokenizer source {spec.source!r} is not 'base', 'union' or one "
                          "of the recipe's models", key="tokenizer_source")
    return key, vocabs[key]


def union_vocab(vocabs: Mapping[str, Vocab], rows: Mapping[str, int], order: list[str]
                ) -> Vocab:
    """The first model's tokenizer plus every other token of the others: plain tokens
    first (model by model, in id order), then added tokens with their settings (the
    first model's settings win). Tokens past a model's embedding rows are skipped."""
    plain: dict[str, None] = {}
    added: dict[str, dict[str, Any]] = {}
    for key in order:
        v = vocabs[key]
        for tok, i in sorted(v.ids.items(), key=lambda kv: kv[1]):
            if i < rows[key] and tok not in v.added:
                plain.setdefault(tok)
        for tok, info in v.added.items():
            if v.ids[tok] < rows[key]:
                added.setdefault(tok, info)
    first = vocabs[order[0]]
    new = [{"content": t, "normalized": True, "special": False}
           for t in plain if t not in added and t not in first.ids]
    new += [info for t, info in added.items() if t not in first.ids]
    return extend_vocab(first, new) if new else first


def extend_vocab(vocab: Vocab, new: list[dict[str, Any]]) -> Vocab:
    """``vocab`` with the tokens ``new`` appended (ids in order), as a new tokenizer."""
    from tokenizers import AddedToken, Tokenizer

    tok = Tokenizer.from_str(vocab.text)
    # In runs of one kind: each call rebuilds the added-token matcher, so one call per
    # token would be quadratic in the number of new tokens.
    run: list[AddedToken] = []
    for j, info in enumerate(new):
        run.append(AddedToken(info["content"],
                              single_word=bool(info.get("single_word", False)),
                              lstrip=bool(info.get("lstrip", False)),
                              rstrip=bool(info.get("rstrip", False)),
                              normalized=bool(info.get("normalized", True)),
                              special=bool(info.get("special", False))))
        special = bool(info.get("special"))
        if j + 1 == len(new) or bool(new[j + 1].get("special")) != special:
            (tok.add_special_tokens if special else tok.add_tokens)(run)
            run = []
    ids = tok.get_vocab(with_added_tokens=True)
    added = {t.content: {"content": t.content, "single_word": t.single_word,
                         "lstrip": t.lstrip, "rstrip": t.rstrip, "normalized": t.normalized,
                         "special": t.special}
             for _, t in sorted(tok.get_added_tokens_decoder().items())}
    return Vocab(ids, added, tok.to_str(), vocab.config)


def tokenizer_files(vocab: Vocab) -> dict[str, bytes]:
    """tokenizer.json and tokenizer_config.json (its added-token table updated) for
    ``vocab``."""
    config = dict(vocab.config or {"tokenizer_class": "PreTrainedTokenizerFast"})
    config["added_tokens_decoder"] = {str(vocab.ids[t]): info for t, info in vocab.added.items()}
    return {TOKENIZER_JSON: vocab.text.encode(),
            TOKENIZER_CONFIG: (json.dumps(config, indent=2, ensure_ascii=False) + "\n").encode()}


def _fill(
    spec: VocabSpec, tokens: list[str], own: dict[str, list[int]], keys: list[str],
    base: str | None, vocabs: Mapping[str, Vocab], rows: Mapping[str, int],
    refs: Mapping[str, str],
) -> tuple[list[int], dict[str, tuple[list[int], list[float]]]]:
    """The default rows of tokens some model lacks (or an override forces)."""
    fill_ids: list[int] = []
    terms: dict[str, tuple[list[int], list[float]]] = {k: ([], []) for k in keys}
    for i, tok in enumerate(tokens):
        cfg = spec.tokens.get(tok)
        has = [k for k in keys if own[k][i] >= 0]
        forced = cfg is not None and cfg.force
        if len(has) == len(keys) and not forced:
            continue
        chosen = (_override(tok, i, cfg, own, vocabs, rows, refs)
                  if cfg is not None and cfg.source is not None
                  else _default(has, i, own, base))
        slot = len(fill_ids)
        fill_ids.append(i)
        for k, row, w in chosen:
            r, ws = terms[k]
            r += [0] * (slot - len(r)) + [row]
            ws += [0.0] * (slot - len(ws)) + [w]
        if forced:
            for k in keys:
                own[k][i] = -1
    for k in keys:
        r, ws = terms[k]
        r += [0] * (len(fill_ids) - len(r))
        ws += [0.0] * (len(fill_ids) - len(ws))
    return fill_ids, {k: v for k, v in terms.items() if any(v[1])}


def _default(has: list[str], i: int, own: Mapping[str, list[int]], base: str | None
             ) -> list[tuple[str, int, float]]:
    """mergekit's rule: the one model that has it, else the base model, else the mean."""
    if len(has) == 1 or (base is not None and base in has):
        k = has[0] if len(has) == 1 else base
        assert k is not None
        return [(k, own[k][i], 1.0)]
    return [(k, own[k][i], 1.0 / len(has)) for k in has]  # empty: zeros


def _override(
    tok: str, i: int, cfg: TokenEmbedding, own: Mapping[str, list[int]],
    vocabs: Mapping[str, Vocab], rows: Mapping[str, int], refs: Mapping[str, str],
) -> list[tuple[str, int, float]]:
    src = cfg.source
    if isinstance(src, ZeroEmbedding):
        return []
    ref = src.model if isinstance(src, ModelTokenEmbedding) else src
    assert isinstance(ref, str)
    key = refs.get(ref)
    if key is None or key not in own:
        raise RecipeError(f"tokenizer.tokens[{tok!r}]: {ref!r} is not one of the recipe's "
                          "models", token=tok)
    if isinstance(src, ModelTokenEmbedding):
        row = src.token_id if src.token_id is not None else vocabs[key].ids.get(
            src.token or "", -1)
        if not 0 <= row < rows[key]:
            raise TokenizerError(f"tokenizer.tokens[{tok!r}]: the named token is not in "
                                 f"{ref}'s vocabulary", token=tok, model=ref)
        return [(key, row, 1.0)]
    if own[key][i] < 0:
        raise TokenizerError(f"tokenizer.tokens[{tok!r}]: {ref} has no such token",
                             token=tok, model=ref)
    return [(key, own[key][i], 1.0)]
