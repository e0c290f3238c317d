"""Local sources: an absolute path under one of the allow-listed roots (``MAEC_LOCAL_ROOTS``).

A path is checked when the job is submitted, but read later by a worker: in between,
whoever can write under the root could swap the folder (or one of its files) for a link
to something outside it. So a path is never trusted twice. Every open walks from the
root one component at a time through directory descriptors, refusing a link anywhere
below the root (``O_NOFOLLOW``), and opens the file itself without following a link;
its identity (device, inode, size, mtime) is read from the open descriptor. ``pin``
records that identity per file at submission; ``fetch`` copies exactly that file into
the worker's cache, or refuses with ``source_changed`` when it is gone, is another
file, was rewritten, or is reached through a link. The engine then reads only the
worker's copy, never the shared folder.
"""

from __future__ import annotations

import errno
import hashlib
import os
import stat
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import BinaryIO, ClassVar

from app.settings import Settings
from app.sources.base import (
    Kind,
    Source,
    SourceFile,
    SourceKind,
    is_checkpoint_file,
    write_verified,
)
from app.storage.base import StorageError
from maec_core.service import (
    ModelFolder,
    SourceChanged,
    SourceError,
    SourceNotFound,
    open_model_folder,
)

_CHUNK = 1 << 20
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# O_NONBLOCK: a FIFO swapped in for a shard must not hang the open.
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK


def identity(st: os.stat_result) -> str:
    """A local file's version: the same path with another file, or the same file
    rewritten, has another one."""
    return f"{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}"


class _Refused(Exception):
    """A path below the root that is missing (``missing``) or not a plain folder/file."""

    def __init__(self, where: str, missing: bool) -> None:
        super().__init__(where)
        self.where = where
        self.missing = missing


def _open_dir(root: Path, path: Path) -> int:
    """A descriptor of the folder ``path``, reached from ``root`` without following any
    link below it (the root itself is the operator's, and resolved in the settings)."""
    try:
        rel = path.relative_to(root)
    except ValueError:
        raise _Refused(str(path), missing=False) from None
    where = str(root)
    try:
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        raise _Refused(where, missing=exc.errno == errno.ENOENT) from None
    try:
        for where in rel.parts:
            nxt = os.open(where, _DIR_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = nxt
    except OSError as exc:
        os.close(fd)
        raise _Refused(where, missing=exc.errno == errno.ENOENT) from None
    return fd


def _open_file(dir_fd: int, name: str) -> tuple[int, os.stat_result]:
    """``name`` in the folder ``dir_fd``, opened without following a link; a regular
    file only."""
    try:
        fd = os.open(name, _FILE_FLAGS, dir_fd=dir_fd)
    except OSError as exc:
        raise _Refused(name, missing=exc.errno == errno.ENOENT) from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise _Refused(name, missing=False)
    os.set_blocking(fd, True)
    return fd, st


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
                return Source("local", text, path=str(resolved), root=str(root))
        raise SourceError(
            f"{text} is not under an allowed local root",
            source=text, allowed_roots=[str(r) for r in settings.local_roots],
        )

    def headers(self, tokenizer: bool = False, base: ModelFolder | None = None
                ) -> ModelFolder:
        # Read in place: the tokenizer files stay where the plan can read them.
        path = Path(self.source.path)
        if path.is_file() and path.suffix.lower() == ".gguf":
            # Merge recipes take GGUF sources (app.sources.gguf); this reader does not.
            raise SourceError(f"{self.source.uri} is a GGUF file: GGUF is a source of merge "
                              "recipes only (docs/gguf.md)", source=self.source.uri)
        if not path.is_dir():
            raise SourceNotFound(f"{self.source.uri}: no such checkpoint folder",
                                 source=self.source.uri)
        return open_model_folder(path, base=base)

    @property
    def _root(self) -> Path:
        # A record written before roots were kept: its path was resolved, so it holds
        # no link from / down either.
        return Path(self.source.root or "/")

    def _refusal(self, exc: _Refused, what: str) -> SourceError:
        """Listing (submission, or an unpinned record): a missing path is not found, one
        through a link invalid; links are never followed, even inside the root."""
        uri = self.source.uri
        if exc.missing:
            return SourceNotFound(f"{uri}: no such {what}", source=uri)
        return SourceError(f"{uri}: {exc.where} is a link, or not a plain folder or file; "
                           "local sources are read without following links", source=uri,
                           path=exc.where)

    def _listed(self, dir_fd: int, name: str, folder: Path) -> SourceFile | None:
        try:
            fd, st = _open_file(dir_fd, name)
        except _Refused as exc:
            if exc.missing:
                return None  # gone between the listing and the open
            raise self._refusal(exc, "file") from None
        os.close(fd)
        version = identity(st)
        path = folder / name
        # A path names no content: the key holds the file's version as well.
        return SourceFile(name, st.st_size, f"file:{path}@{version}", str(path), version)

    def checkpoint_files(self) -> list[SourceFile]:
        folder = Path(self.source.path)
        try:
            dir_fd = _open_dir(self._root, folder)
        except _Refused as exc:
            raise self._refusal(exc, "checkpoint folder") from None
        try:
            names = sorted(n for n in os.listdir(dir_fd) if is_checkpoint_file(n))
            files = [f for n in names
                     if (f := self._listed_checkpoint_file(dir_fd, n, folder)) is not None]
        finally:
            os.close(dir_fd)
        if not files:
            raise SourceNotFound(f"{self.source.uri}: no checkpoint files",
                                 source=self.source.uri)
        return files

    def _listed_checkpoint_file(self, dir_fd: int, name: str, folder: Path
                                ) -> SourceFile | None:
        # Anything but a file or a link (a folder named x.safetensors) is not a file of
        # the checkpoint, as before; a link is refused by _listed.
        try:
            st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        except FileNotFoundError:
            return None
        if not (stat.S_ISREG(st.st_mode) or stat.S_ISLNK(st.st_mode)):
            return None
        return self._listed(dir_fd, name, folder)

    def corpus_file(self) -> SourceFile:
        path = Path(self.source.path)
        try:
            dir_fd = _open_dir(self._root, path.parent)
        except _Refused as exc:
            raise self._refusal(exc, "corpus file") from None
        try:
            file = self._listed(dir_fd, path.name, path.parent)
        finally:
            os.close(dir_fd)
        if file is None:
            raise SourceNotFound(f"{self.source.uri}: no such corpus file",
                                 source=self.source.uri)
        return file

    def fetch(self, file: SourceFile, dest: Path) -> None:
        """Copy the very file listed (pinned): opened below the root without following
        links, its identity checked before and after the copy."""
        with self._open_pinned(file) as f:
            try:
                write_verified(_read(f), dest, file, uri=self.source.uri,
                               sender="the file system", where="as listed")
            except StorageError:
                self._check(file, os.fstat(f.fileno()))  # rewritten while copied
                raise
            self._check(file, os.fstat(f.fileno()))

    def check_unchanged(self, files: Iterable[SourceFile]) -> None:
        for file in files:
            self._open_pinned(file).close()

    def ranged_for(self, files: Iterable[SourceFile]) -> bool:
        return True  # pread; digests read from the pinned file itself (digest)

    def read_range(self, file: SourceFile, start: int, end: int) -> Iterator[bytes]:
        with self._open_pinned(file) as f:
            fd = f.fileno()
            pos = start
            while pos < end:
                chunk = os.pread(fd, min(_CHUNK, end - pos), pos)
                if not chunk:
                    break
                pos += len(chunk)
                yield chunk
            self._check(file, os.fstat(fd))  # rewritten while read
        if pos != end:
            raise self._changed(file, "is shorter than listed")

    def digest(self, file: SourceFile) -> str:
        """A path names no content: the pinned file is hashed where it lies (a local
        read, not a fetch), its identity checked after."""
        digest = hashlib.sha256()
        with self._open_pinned(file) as f:
            for chunk in _read(f):
                digest.update(chunk)
            self._check(file, os.fstat(f.fileno()))
        return digest.hexdigest()

    def _open_pinned(self, file: SourceFile) -> BinaryIO:
        path = Path(file.location)
        try:
            dir_fd = _open_dir(self._root, path.parent)
            try:
                fd, st = _open_file(dir_fd, path.name)
            finally:
                os.close(dir_fd)
        except _Refused as exc:
            why = ("is gone" if exc.missing else
                   f"is now reached through a link or is not a plain file ({exc.where})")
            raise self._changed(file, why) from None
        f = os.fdopen(fd, "rb")
        try:
            self._check(file, st)
        except SourceChanged:
            f.close()
            raise
        return f

    def _check(self, file: SourceFile, st: os.stat_result) -> None:
        if file.version and identity(st) != file.version:
            raise self._changed(file, "was replaced or rewritten")

    def _changed(self, file: SourceFile, why: str) -> SourceChanged:
        uri = self.source.uri
        return SourceChanged(f"{uri}: {file.name} {why} since the job was submitted",
                             source=uri, file=file.name)


def _read(f: BinaryIO) -> Iterator[bytes]:
    while chunk := f.read(_CHUNK):
        yield chunk
