"""The worker's GGUF steps: a fetched GGUF input dequantized into a folder the merge
reads, and the merged model's GGUF copy made before the manifest is published.

A dequantized folder is an entry of the worker's input cache, named by the file's
sha256: the same file from any source or job is dequantized once, the folder is held
while a job reads it and evicted, least recently used, under the cache's size cap like
the files fetched.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from app.disk_cache import DiskCache, Hold
from maec_core.service import (
    Recipe,
    gguf_copy,
    sha256_file,
)
from maec_core.service.running import GGUF_INFO_FILE, check_gguf_output, dequantize_gguf

__all__ = ["check_before_merge", "dequantize_input", "gguf_inputs", "with_gguf_output"]


def dequantize_input(path: Path, cache: DiskCache, hold: Hold, hash_cache: Path) -> Path:
    """The dequantized folder of the fetched GGUF file ``path`` (held by ``hold``)."""
    digest = sha256_file(path, cache=hash_cache)
    entry, _hit = cache.get_or_fill(
        f"gguf-{digest}", lambda e: (e / GGUF_INFO_FILE).is_file(),
        lambda tmp: dequantize_gguf(path, tmp, sha256=digest), hold,
        what=f"{path.name} dequantized")
    return entry


def gguf_inputs(local: Mapping[str, str]) -> dict[str, dict[str, Any]]:
    """What each GGUF input was (file, sha256, architecture, quantization), by reference."""
    out = {}
    for ref, path in local.items():
        info = Path(path) / GGUF_INFO_FILE
        if info.is_file():
            out[ref] = json.loads(info.read_text())
    return out


def check_before_merge(recipe: Recipe) -> None:
    """A GGUF output the writer cannot make fails the job before the merge (``recipe``:
    localised, so its references are the fetched folders)."""
    if recipe.output is not None and recipe.output.gguf is not None:
        check_gguf_output(recipe, recipe.output.gguf)


def with_gguf_output(out: Path, manifest: Mapping[str, Any], recipe: Recipe,
                     local: Mapping[str, str]) -> dict[str, Any]:
    """``manifest`` (as clients see it, in memory) with the GGUF inputs recorded and,
    when the recipe asks, the GGUF copy written into ``out`` and listed with its
    checksum (the manifest itself is written once, last, by the runner)."""
    inputs = gguf_inputs(local)
    doc = {**manifest, "gguf_inputs": inputs} if inputs else dict(manifest)
    if recipe.output is None or recipe.output.gguf is None:
        return doc
    return gguf_copy(out, recipe.output.gguf, doc, inputs)[1]
