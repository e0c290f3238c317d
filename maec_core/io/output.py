"""The merged checkpoint folder: staged, then renamed into place only when complete.

An interrupted or failed merge removes its staging folder, so a reader never sees a
half-written model: the output path either does not exist or holds a full checkpoint
whose ``manifest.json`` (written last) lists every file with its sha256.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import Any

from maec_core.errors import OutputExists
from maec_core.io.folder import ModelFolder
from maec_core.io.writer import WrittenFile


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class StagedOutput:
    """Context manager: ``folder`` is the staging path; success renames to ``final``."""

    def __init__(self, final: Path, *, overwrite: bool = False) -> None:
        self.final = Path(final)
        if self.final.exists() and not overwrite:
            raise OutputExists(f"output folder {self.final} already exists", path=str(final))
        self.overwrite = overwrite
        self.final.parent.mkdir(parents=True, exist_ok=True)
        self.folder = self.final.parent / f".{self.final.name}.staging-{uuid.uuid4().hex[:12]}"
        self.folder.mkdir()
        self.files: list[WrittenFile] = []

    def write_bytes(self, name: str, data: bytes) -> None:
        (self.folder / name).write_bytes(data)
        self.files.append(WrittenFile(name, len(data), sha256_bytes(data)))

    def write_json(self, name: str, doc: Any) -> None:
        self.write_bytes(name, (json.dumps(doc, indent=2, sort_keys=True) + "\n").encode())

    def copy_side_files(self, source: ModelFolder, skip: tuple[str, ...] = ()) -> None:
        """Tokenizer and generation files, from an allow-list (never code or pickles);
        those named in ``skip`` are left out."""
        for path in source.side_files():
            if path.name not in skip:
                self.write_bytes(path.name, path.read_bytes())

    def add(self, files: list[WrittenFile]) -> None:
        self.files.extend(files)

    def commit(self) -> None:
        for f in os.scandir(self.folder):
            os.chmod(f.path, 0o644)
        if self.overwrite and self.final.exists():
            shutil.rmtree(self.final)
        os.rename(self.folder, self.final)

    def abort(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)

    def __enter__(self) -> StagedOutput:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is not None:
            self.abort()


def output_config(
    config: dict[str, Any], dtype: str, updates: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """The reference config with its dtype set to the output dtype and ``updates``
    (fields the merge changed, such as a slices recipe's layer count) applied."""
    out = {**config, **(updates or {})}
    out["dtype"] = dtype
    if "torch_dtype" in out:
        out["torch_dtype"] = dtype
    return out
