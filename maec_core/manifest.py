"""manifest.json: every file with size and sha256, inputs, recipe and library versions,
and where every input tensor went (``accounting``, see :mod:`maec_core.accounting`).

No timestamps: the same recipe and inputs give a byte-identical manifest. Torch-free.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

from maec_core import __version__
from maec_core.naming import renamed

if TYPE_CHECKING:
    from maec_core.accounting import Accounting
    from maec_core.io.writer import WrittenFile

MANIFEST_NAME = "manifest.json"
FORMAT_VERSION = 1


@dataclass(frozen=True)
class FileEntry:
    """One file of a published folder, as its manifest lists it."""

    path: str
    size: int
    sha256: str

    @staticmethod
    def of(doc: Mapping[str, Any]) -> FileEntry:
        return FileEntry(str(doc["path"]), int(doc["size"]), str(doc["sha256"]))

    def to_json(self) -> dict[str, Any]:
        return {"path": self.path, "size": self.size, "sha256": self.sha256}

    def under(self, prefix: str) -> FileEntry:
        """This entry with its path below ``prefix`` (a folder published inside another)."""
        return FileEntry(f"{prefix}/{self.path}", self.size, self.sha256)


@dataclass(frozen=True)
class Manifest:
    """A folder's manifest as a value: the JSON document clients read (``doc``, written
    as is by :meth:`write`) and the parts a publisher needs, read from it once."""

    doc: Mapping[str, Any]
    # Every file but the manifest itself.
    files: tuple[FileEntry, ...]
    # The ability artifacts the folder was made from (MAEC; empty for other methods).
    artifact_keys: tuple[str, ...] = ()

    @staticmethod
    def of(doc: Mapping[str, Any]) -> Manifest:
        keys = (doc.get("maec") or {}).get("artifact_keys", [])
        return Manifest(doc, tuple(FileEntry.of(f) for f in doc.get("files", [])),
                        tuple(str(k) for k in keys))

    @property
    def nbytes(self) -> int:
        """Bytes of the files listed (the manifest's own not included)."""
        return sum(f.size for f in self.files)

    def with_doc(self, doc: Mapping[str, Any]) -> Manifest:
        """The same folder's manifest with another document (renamed inputs, added
        keys); the files and artifact keys read again from it."""
        return Manifest.of(doc)

    def write(self, folder: Path) -> FileEntry:
        """:func:`write_manifest` of this document; the manifest's own entry."""
        return FileEntry.of(write_manifest(folder, dict(self.doc)))


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
    accounting: Accounting | None = None,
    names: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """The manifest of ``files``. ``names`` (local input path -> reference, a job's
    ``RunContext.names``) names the inputs by reference in the recorded recipe and in the
    accounting's keys: the one place a manifest is assembled names them, so a caller
    never renames one afterwards. ``inputs`` is the caller's own."""
    names = names or {}
    doc: dict[str, Any] = {
        "format_version": FORMAT_VERSION,
        "files": [
            {"path": f.path, "size": f.size, "sha256": f.sha256}
            for f in sorted(files, key=lambda f: f.path)
        ],
        "total_size": sum(f.size for f in files),
        "inputs": inputs,
        "recipe": renamed(recipe, names),
        "versions": library_versions(),
    }
    if accounting is not None:
        doc["accounting"] = {names.get(k, k): v for k, v in accounting.to_json().items()}
    if extra:
        doc.update(extra)
    return doc


def manifest_bytes(doc: dict[str, Any]) -> bytes:
    return (json.dumps(doc, indent=2, sort_keys=True) + "\n").encode()


def write_manifest(folder: Path, doc: dict[str, Any]) -> dict[str, Any]:
    """Write ``doc`` as ``folder``'s manifest.json (whole or not at all) and return the
    manifest's own file entry (path, size, sha256), taken from the bytes written: the
    manifest lists every other file, and a publisher lists the manifest beside them."""
    data = manifest_bytes(doc)
    tmp = folder / f".{MANIFEST_NAME}.partial"
    tmp.write_bytes(data)
    os.replace(tmp, folder / MANIFEST_NAME)
    return {"path": MANIFEST_NAME, "size": len(data),
            "sha256": hashlib.sha256(data).hexdigest()}
