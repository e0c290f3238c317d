"""Reading a checkpoint's tokenizer: its token -> id map and its added tokens.

Only the fast tokenizer's ``tokenizer.json`` is read, parsed by the ``tokenizers``
library (no tokenizer code, no sentencepiece pickle). Torch-free: the API reads these
when it plans a recipe with a vocabulary merge.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from maec_core.errors import TokenizerError
from maec_core.io.folder import MAX_SIDE_FILE_BYTES, ModelFolder

TOKENIZER_JSON = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"


@dataclass(frozen=True)
class Vocab:
    """One tokenizer: ``ids`` maps every token (added ones too) to its id; ``added`` holds
    the added tokens' settings (content, special, normalized, ...) by content; ``text``
    is the tokenizer.json it was read from (a union vocabulary is built on it)."""

    ids: dict[str, int]
    added: dict[str, dict[str, Any]] = field(default_factory=dict)
    text: str = ""
    config: dict[str, Any] | None = None  # tokenizer_config.json, when present


def keep_tokenizer(folder: ModelFolder) -> None:
    """Read ``folder``'s tokenizer files into it, for planning after its files are gone
    (a remote source's header view)."""
    folder.tokenizer_data = {}
    for name in (TOKENIZER_JSON, TOKENIZER_CONFIG):
        path = folder.root / name
        if path.is_file():
            folder.tokenizer_data[name] = _read_bytes(path, name)


def _read_bytes(path: Path, what: str) -> bytes:
    try:
        if path.stat().st_size > MAX_SIDE_FILE_BYTES:
            raise TokenizerError(f"{what} is above the {MAX_SIDE_FILE_BYTES} byte cap",
                                 file=path.name)
        return path.read_bytes()
    except OSError as exc:
        raise TokenizerError(f"cannot read {what}: {exc.strerror}", file=path.name) from None


def _file_text(folder: ModelFolder, name: str, what: str) -> str | None:
    """The text of tokenizer file ``name`` of ``folder`` (None when it has none)."""
    if folder.tokenizer_data is not None:
        data = folder.tokenizer_data.get(name)
    else:
        path = folder.root / name
        data = _read_bytes(path, what) if path.is_file() else None
    try:
        return None if data is None else data.decode("utf-8")
    except UnicodeDecodeError:
        raise TokenizerError(f"{what} is not UTF-8", file=name) from None


def parse_tokenizer(text: str, *, label: str) -> Vocab:
    """Parse tokenizer.json ``text``; ``TokenizerError`` (invalid_tokenizer) when the
    ``tokenizers`` library cannot load it or its ids are not 0..n-1."""
    from tokenizers import Tokenizer

    try:
        tok = Tokenizer.from_str(text)
    except Exception as exc:  # the library raises a bare Exception for any parse error
        raise TokenizerError(f"{label}: tokenizer.json cannot be parsed: {exc}",
                             model=label) from None
    ids = tok.get_vocab(with_added_tokens=True)
    if sorted(ids.values()) != list(range(len(ids))):
        raise TokenizerError(f"{label}: tokenizer.json token ids are not 0..{len(ids) - 1}",
                             model=label)
    added = {
        t.content: {"content": t.content, "single_word": t.single_word, "lstrip": t.lstrip,
                    "rstrip": t.rstrip, "normalized": t.normalized, "special": t.special}
        for _, t in sorted(tok.get_added_tokens_decoder().items())
    }
    return Vocab(ids, added, text)


def has_tokenizer(folder: ModelFolder) -> bool:
    if folder.tokenizer_data is not None:
        return TOKENIZER_JSON in folder.tokenizer_data
    return (folder.root / TOKENIZER_JSON).is_file()


def read_vocab(folder: ModelFolder, *, label: str) -> Vocab | None:
    """The tokenizer of ``folder``, or None when it has no tokenizer.json."""
    text = _file_text(folder, TOKENIZER_JSON, f"{label}: {TOKENIZER_JSON}")
    if text is None:
        return None
    vocab = parse_tokenizer(text, label=label)
    cfg_text = _file_text(folder, TOKENIZER_CONFIG, f"{label}: {TOKENIZER_CONFIG}")
    config: dict[str, Any] | None = None
    if cfg_text is not None:
        try:
            doc = json.loads(cfg_text)
        except ValueError:
            raise TokenizerError(f"{label}: {TOKENIZER_CONFIG} is not valid JSON",
                                 model=label) from None
        if not isinstance(doc, dict):
            raise TokenizerError(f"{label}: {TOKENIZER_CONFIG} is not a JSON object",
                                 model=label)
        config = doc
    return Vocab(vocab.ids, vocab.added, vocab.text, config)
