"""GGUF checkpoint references in a recipe: found, dequantized once into a cache keyed by
the file's sha256, and replaced by the dequantized folder (the command line's path; the
worker does the same through its own input cache).

Torch is imported only when a file is dequantized (``maec_core.gguf.dequantize``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from maec_core.checksums import sha256_file
from maec_core.gguf.names import LOSSY_WARNING, find_gguf, is_gguf_name
from maec_core.recipe import Recipe

__all__ = ["LOSSY_WARNING", "GgufInput", "check_gguf_output", "gguf_file_of",
           "resolve_gguf"]




@dataclass(frozen=True)
class GgufInput:
    """One GGUF reference and the folder it was dequantized into."""

    ref: str
    folder: Path
    info: dict[str, Any]  # gguf_source.json: file, sha256, architecture, quantization, ...

    @property
    def warning(self) -> str:
        return LOSSY_WARNING.format(source=self.ref,
                                    quantization=self.info.get("quantization", "?"))


def gguf_file_of(path: Path) -> Path | None:
    """The GGUF file a local reference names: the file itself, or the one ``.gguf`` in a
    folder without a config.json (a folder with one is a Hugging Face checkpoint)."""
    if path.is_file() and is_gguf_name(path.name):
        return path
    if path.is_dir() and not (path / "config.json").exists():
        name = find_gguf([p.name for p in path.iterdir() if p.is_file()])
        return path / name if name else None
    return None


def dequantized(file: Path, cache: Path, digest_cache: Path | None = None) -> GgufInput:
    """``file`` dequantized under ``cache/<sha256>`` (reused when already there)."""
    from maec_core.gguf.dequantize import GGUF_INFO_FILE, dequantize_gguf

    digest = sha256_file(file, cache=digest_cache)
    folder = cache / digest
    if (folder / GGUF_INFO_FILE).is_file():
        info = json.loads((folder / GGUF_INFO_FILE).read_text())
    else:
        info = dequantize_gguf(file, folder, sha256=digest)
    return GgufInput(str(file), folder, info)


def resolve_gguf(recipe: Recipe, cache: Path, digest_cache: Path | None = None
                 ) -> tuple[Recipe, list[GgufInput]]:
    """``recipe`` with every local GGUF reference replaced by its dequantized folder."""
    found: dict[str, GgufInput] = {}
    for ref in recipe.sources():
        if ref.kind == "corpus" or ref.ref in found or "://" in ref.ref:
            continue
        file = gguf_file_of(Path(ref.ref))
        if file is not None:
            found[ref.ref] = dequantized(file, cache, digest_cache)
    if not found:
        return recipe, []
    mapping = {ref: str(g.folder) for ref, g in found.items()}
    return recipe.with_sources(mapping), list(found.values())


def check_gguf_output(recipe: Recipe, qtype: str) -> str:
    """Refuse, before any merge, a GGUF output the writer cannot make: an unknown type,
    or a model (the recipe's base, else its first checkpoint, read where it is a local
    folder) of an architecture it does not write. Returns the type, lower-cased."""
    from maec_core.gguf.writer import check_output, check_type

    qtype = check_type(qtype)
    refs = [r.ref for r in recipe.sources() if r.kind == "checkpoint"]
    config = Path(refs[0]) / "config.json" if refs else None
    if config is not None and config.is_file():
        doc = json.loads(config.read_text())
        check_output(doc if isinstance(doc, dict) else {})
    return qtype
