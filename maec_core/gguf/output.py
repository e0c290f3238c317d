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

__all__ = ["add_gguf"]


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def add_gguf(folder: Path, qtype: str,
             gguf_inputs: Mapping[str, Mapping[str, Any]] | None = None) -> dict[str, Any]:
    """Write ``folder``'s model as GGUF ``qtype`` into ``folder`` and list it in its
    manifest (``gguf_inputs``: the GGUF sources that went in, by reference: file,
    sha256, quantization; recorded there too). Returns the new file's entry (path,
    size, sha256, type)."""
    qtype = check_type(qtype)
    manifest_path = folder / MANIFEST_NAME
    doc: dict[str, Any] = (json.loads(manifest_path.read_text())
                           if manifest_path.is_file() else {})
    inputs = {name: {k: v for k, v in entry.items() if k in ("sha256", "files", "uri")}
              for name, entry in (doc.get("inputs") or {}).items()}
    provenance = {"recipe": json.dumps(doc.get("recipe", {}), sort_keys=True),
                  "inputs": json.dumps(inputs, sort_keys=True),
                  "gguf_sources": json.dumps(dict(gguf_inputs or {}), sort_keys=True)}
    dest = folder / gguf_name(qtype)
    write_gguf(folder, dest, qtype, name=folder.name, provenance=provenance)
    entry = {"path": dest.name, "size": dest.stat().st_size, "sha256": _sha256(dest)}
    if doc:
        files = [f for f in doc.get("files", []) if f.get("path") != dest.name] + [entry]
        doc["files"] = sorted(files, key=lambda f: f["path"])
        doc["total_size"] = sum(int(f["size"]) for f in doc["files"])
        doc["gguf"] = {"file": dest.name, "type": qtype,
                       "tensor_type": GGUF_TYPES[qtype][0].name}
        if gguf_inputs:
            doc["gguf_inputs"] = {ref: dict(v) for ref, v in gguf_inputs.items()}
        write_manifest(folder, doc)
    return {**entry, "type": qtype}
