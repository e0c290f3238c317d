"""Content-addressed keys of ability-vector artifacts (torch-free).

An artifact is determined by the bytes of its inputs (θ0, θA, optional θS; for
``importance: gradient`` also the corpus and θ0's tokenizer files) and by the extraction
parameters. The key hashes exactly those, so the same donor is extracted once and any
job with the same inputs and parameters finds it, whatever the paths were called.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from maec_core.checksums import sha256_file
from maec_core.errors import CorpusError
from maec_core.io.folder import TOKENIZER_FILES, ModelFolder, open_model_folder
from maec_core.maec.params import MaecParams, maec_inputs, maec_params
from maec_core.plan import DTYPE_NAMES
from maec_core.recipe import Recipe

ARTIFACT_FORMAT = "maec-ability-vector"
# Bump when the artifact layout or the extraction arithmetic changes: old artifacts then
# get new keys instead of being silently reused.
ARTIFACT_FORMAT_VERSION = 1


def folder_checksums(folder: ModelFolder, hash_cache: Path | None = None) -> dict[str, str]:
    """sha256 of each weight file, by file name (remembered: cheap on repeats).

    ``hash_cache`` is a folder keeping digests across processes (see ``checksums``).
    """
    return {p.name: sha256_file(p, cache=hash_cache) for p in folder.weight_files}


def tokenizer_checksums(folder: ModelFolder, hash_cache: Path | None = None) -> dict[str, str]:
    return {
        n: sha256_file(folder.root / n, cache=hash_cache)
        for n in TOKENIZER_FILES if (folder.root / n).is_file()
    }


def corpus_checksum(path: str, hash_cache: Path | None = None) -> str:
    p = Path(path)
    if not p.is_file():
        raise CorpusError(f"ability corpus not found: {path}", path=path)
    return sha256_file(p, cache=hash_cache)


def checkpoint_dtype(folder: ModelFolder) -> str:
    """The dominant weight dtype as a torch name (what ``artifact_dtype: null`` means)."""
    counts: dict[str, int] = {}
    for t in folder.tensors.values():
        if t.dtype in DTYPE_NAMES:
            counts[t.dtype] = counts.get(t.dtype, 0) + t.numel
    return DTYPE_NAMES[max(counts, key=lambda k: counts[k])] if counts else "float32"


def key_document(
    params: MaecParams,
    base: ModelFolder,
    ability: ModelFolder,
    control: ModelFolder | None,
    corpus: str | None,
    hash_cache: Path | None = None,
    scope: str = "",
) -> dict[str, Any]:
    """Everything the key hashes, also stored in the artifact's metadata. ``scope``
    (``RunContext.artifact_scope``) makes the key, and so the artifact, one scope's: the
    same extraction in two scopes is two artifacts."""
    doc: dict[str, Any] = {
        "format": ARTIFACT_FORMAT,
        "format_version": ARTIFACT_FORMAT_VERSION,
        "parameters": params.extraction_dict(checkpoint_dtype(base)),
        "inputs": {
            "base": folder_checksums(base, hash_cache),
            "ability": folder_checksums(ability, hash_cache),
            "control": folder_checksums(control, hash_cache) if control is not None else None,
        },
    }
    if params.importance == "gradient":
        assert corpus is not None  # validate_maec_recipe guarantees it
        doc["inputs"]["corpus"] = corpus_checksum(corpus, hash_cache)
        doc["inputs"]["tokenizer"] = tokenizer_checksums(base, hash_cache)
    if scope:
        doc["scope"] = scope
    return doc


def key_of(doc: dict[str, Any]) -> str:
    canonical = json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(canonical.encode()).hexdigest()


def artifact_key(recipe: Recipe, ability_index: int, *, hash_cache: Path | None = None
                 ) -> str:
    """The content-addressed key of ability ``ability_index``'s artifact.

    Hashes the input files (remembered by path, size, mtime and inode, so a second call
    on the same files costs nothing) and the canonical extraction parameters.
    """
    params = maec_params(recipe)
    ab = maec_inputs(recipe).abilities[ability_index]
    assert recipe.base_model is not None
    base = open_model_folder(recipe.base_model)
    ability = open_model_folder(ab.model, base=recipe.base_model)
    control = open_model_folder(ab.control, base=recipe.base_model) if ab.control else None
    return key_of(key_document(params, base, ability, control, ab.corpus, hash_cache))
