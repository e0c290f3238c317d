"""A published merge's GGUF copy: written beside the safetensors, its provenance taken
from the folder's manifest, and the manifest amended to list (and checksum) it."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from maec_core.gguf.writer import GGUF_TYPES, check_type, gguf_name, write_gguf
from maec_core.manifest import MANIFEST_NAME, write_manifest

__all__ = ["add_gguf", "gguf_copy"]


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def add_gguf(folder: Path, qtype: str,
             gguf_inputs: Mapping[str, Mapping[str, Any]] | None = None) -> dict[str, Any]:
    """Write ``folder``'s model as GGUF ``qtype`` into ``folder`` and list it in the
    manifest on disk (the command line's way; a job keeps its manifest in memory:
    :func:`gguf_copy`). Returns the new file's entry (path, size, sha256, type)."""
    manifest_path = folder / MANIFEST_NAME
    doc: dict[str, Any] = (json.loads(manifest_path.read_text())
                           if manifest_path.is_file() else {})
    entry, amended = gguf_copy(folder, qtype, doc, gguf_inputs)
    if doc:
        write_manifest(folder, amended)
    return entry


def gguf_copy(folder: Path, qtype: str, doc: Mapping[str, Any],
              gguf_inputs: Mapping[str, Mapping[str, Any]] | None = None
              ) -> tuple[dict[str, Any], dict[str, Any]]:
    """Write ``folder``'s model as GGUF ``qtype`` into ``folder``, its provenance taken
    from the folder's manifest ``doc`` (``gguf_inputs``: the GGUF sources that went in,
    by reference: file, sha256, quantization). Returns the new file's entry (path, size,
    sha256, type) and ``doc`` listing it (and the GGUF inputs); nothing else is
    written."""
    qtype = check_type(qtype)
    inputs = {name: {k: v for k, v in entry.items() if k in ("sha256", "files", "uri")}
              for name, entry in (doc.get("inputs") or {}).items()}
    provenance = {"recipe": json.dumps(doc.get("recipe", {}), sort_keys=True),
                  "inputs": json.dumps(inputs, sort_keys=True),
                  "gguf_sources": json.dumps(dict(gguf_inputs or {}), sort_keys=True)}
    dest = folder / gguf_name(qtype)
    write_gguf(folder, dest, qtype, name=folder.name, provenance=provenance)
    entry = {"path": dest.name, "size": dest.stat().st_size, "sha256": _sha256(dest)}
    amended = dict(doc)
    if doc:
        files = [f for f in doc.get("files", []) if f.get("path") != dest.name] + [entry]
        amended["files"] = sorted(files, key=lambda f: f["path"])
        amended["total_size"] = sum(int(f["size"]) for f in amended["files"])
        amended["gguf"] = {"file": dest.name, "type": qtype,
                           "tensor_type": GGUF_TYPES[qtype][0].name}
        if gguf_inputs:
            amended["gguf_inputs"] = {ref: dict(v) for ref, v in gguf_inputs.items()}
    return {**entry, "type": qtype}, amended
