"""Local sources: an absolute path under one of the allow-listed roots (``MAEC_LOCAL_ROOTS``).

The worker reads them where they are (``in_place``), so nothing is copied into the cache;
``checkpoint_files`` / ``fetch`` give the same files as the other kinds do, for a caller
that wants a copy.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import ClassVar

from app.settings import Settings
from app.sources.base import (
    Kind,
    Source,
    SourceFile,
    SourceKind,
    is_checkpoint_file,
    write_verified,
)
from maec_core.errors import SourceError, SourceNotFound
from maec_core.io.folder import ModelFolder, open_model_folder

_CHUNK = 1 << 20


class LocalSource(SourceKind):
    kind: ClassVar[Kind] = "local"
    scheme: ClassVar[str] = ""

    @classmethod
    def parse(cls, text: str, settings: Settings) -> Source:
        raw = Path(text)
        if not raw.is_absolute() or ".." in raw.parts:
            raise SourceError(f"{text}: local sources must be absolute paths without '..'",
                              source=text)
        resolved = raw.resolve()
        for root in settings.local_roots:
            if resolved == root or root in resolved.parents:
                return Source("local", text, path=str(resolved))
        raise SourceError(
            f"{text} is not under an allowed local root",
            source=text, allowed_roots=[str(r) for r in settings.local_roots],
        )

    def in_place(self) -> Path:
        return Path(self.source.path)

    def headers(self, tokenizer: bool = False) -> ModelFolder:
        # Read in place: the tokenizer files stay where the plan can read them.
        path = Path(self.source.path)
        if not path.is_dir():
            raise SourceNotFound(f"{self.source.uri}: no such checkpoint folder",
                                 source=self.source.uri)
        return open_model_folder(path)

    def _file(self, path: Path) -> SourceFile:
        st = path.stat()
        # A path names no content: the key holds its version (size, mtime) as well.
        key = f"file:{path}@{st.st_size}-{st.st_mtime_ns}"
        return SourceFile(path.name, st.st_size, key, str(path))

    def checkpoint_files(self) -> list[SourceFile]:
        path = Path(self.source.path)
        if not path.is_dir():
            raise SourceNotFound(f"{self.source.uri}: no such checkpoint folder",
                                 source=self.source.uri)
        files = [self._file(p) for p in sorted(path.iterdir())
                 if p.is_file() and is_checkpoint_file(p.name)]
        if not files:
            raise SourceNotFound(f"{self.source.uri}: no checkpoint files",
                                 source=self.source.uri)
        return files

    def corpus_file(self) -> SourceFile:
        path = Path(self.source.path)
        if not path.is_file():
            raise SourceNotFound(f"{self.source.uri}: no such corpus file",
                                 source=self.source.uri)
        return self._file(path)

    def fetch(self, file: SourceFile, dest: Path) -> None:
        write_verified(_read(Path(file.location)), dest, file, uri=self.source.uri,
                       sender="the file system", where="as listed")


def _read(path: Path) -> Iterator[bytes]:
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            yield chunk

