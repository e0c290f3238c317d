"""manifest.json: every file with size and sha256, inputs, recipe and library versions.

No timestamps: the same recipe and inputs give a byte-identical manifest.
"""

from __future__ import annotations

import platform
from importlib import metadata
from typing import Any

from maec_core import __version__
from maec_core.io.writer import WrittenFile

MANIFEST_NAME = "manifest.json"
FORMAT_VERSION = 1


def library_versions() -> dict[str, str]:
    out = {"maec_core": __version__, "python": platform.python_version()}
    for dist in ("torch", "safetensors", "transformers"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = "absent"
    return out


def build_manifest(
    files: list[WrittenFile],
    *,
    inputs: dict[str, dict[str, Any]],
    recipe: dict[str, Any],
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "format_version": FORMAT_VERSION,
        "files": [
            {"path": f.path, "size": f.size, "sha256": f.sha256}
            for f in sorted(files, key=lambda f: f.path)
        ],
        "total_size": sum(f.size for f in files),
        "inputs": inputs,
        "recipe": recipe,
        "versions": library_versions(),
    }
    if extra:
        doc.update(extra)
    return doc
