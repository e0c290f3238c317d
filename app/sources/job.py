"""Job sources: the outputs of one of the caller's own succeeded jobs, ``job:<id>`` (the
checkpoint it published) or ``job:<id>/<path>`` (a sub-folder of its outputs, or one of
its files: a corpus, an eval set).

The service's storage is never a source by its address (``app.sources.guard``); this is
the one way into it, and it goes through the same check as the files route: the job is
the caller's and has succeeded. The API looks the job up with the caller's key
(:func:`published`) and hands the result to ``parse_source``; an id that is unknown,
another key's, or of a job that has not succeeded all answer ``source_not_found`` with
the same message, so a reference says nothing about other keys' jobs.

The files are those of the job's manifest, each named by its sha256 there: they are
pinned at submission like any source's, and the worker (which reads the service's storage
itself, the ownership having been checked) fetches exactly those bytes, checked against
that digest while they stream. A job deleted or expired in between fails the job that
reads it with ``source_changed``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any, ClassVar

from app.settings import Settings
from app.sources.base import (
    SMALL_FILES,
    Kind,
    Source,
    SourceFile,
    SourceKind,
    download_verified,
    is_checkpoint_file,
    sparse_header_copy,
    write_whole,
)
from maec_core.service import (
    MAX_JSON_BYTES,
    ModelFolder,
    SourceChanged,
    SourceError,
    SourceNotFound,
)

# A job id (``app.jobs.record.new_job_id``), then an optional path inside its outputs.
_REF = re.compile(r"^job:(j_[0-9a-f]{1,64})(?:/(.*))?$")
MAX_PATH_CHARS = 512


@dataclass(frozen=True)
class Published:
    """What one of the caller's succeeded jobs published: its storage prefix and its
    manifest's files (``{"path", "size", "sha256"}`` each)."""

    prefix: str
    files: tuple[Mapping[str, Any], ...]


def published(status: str, result_prefix: str | None, result: Mapping[str, Any] | None
              ) -> Published | None:
    """The outputs a job record offers as a source: only a succeeded job's, as listed in
    its result (what the files route serves), else None."""
    if status != "succeeded" or not result_prefix or not result:
        return None
    return Published(result_prefix, tuple(result.get("files", ())))


def referenced_job(text: str) -> str | None:
    """The job id ``text`` names when it is a ``job:`` source, else None."""
    m = _REF.match(text) if isinstance(text, str) else None
    return m.group(1) if m else None


class JobSource(SourceKind):
    kind: ClassVar[Kind] = "job"
    # Not a scheme://... URI: ``parse_source`` picks this kind by its ``job:`` prefix.
    scheme: ClassVar[str] = ""

    @classmethod
    def parse(cls, text: str, settings: Settings) -> Source:
        m = _REF.match(text)
        if m is None:
            raise SourceError(f"{text}: a job source is job:<id> or job:<id>/<path>",
                              source=text)
        path = (m.group(2) or "").strip("/")
        if len(path) > MAX_PATH_CHARS or (
                path and any(p in ("", ".", "..") for p in path.split("/"))):
            raise SourceError(f"{text}: the path must be a plain path", source=text)
        return Source("job", text, job=m.group(1), path=path)

    @staticmethod
    def resolve(source: Source, outputs: Mapping[str, Published]) -> Source:
        """``source`` with the files of the job it names, from ``outputs`` (the caller's
        succeeded jobs, looked up with the caller's key): every file of the manifest
        under its path, which ``pin`` narrows to what the input reads."""
        found = outputs.get(source.job)
        if found is None:
            # One answer for unknown, another key's and unfinished: no oracle.
            raise SourceNotFound(f"{source.uri}: no such source", source=source.uri)
        under = f"{source.path}/" if source.path else ""
        files = []
        for f in found.files:
            path = str(f["path"])
            if path == source.path or path.startswith(under):
                name = path.rsplit("/", 1)[-1] if path == source.path else path[len(under):]
                files.append(SourceFile(name, int(f["size"]), f"sha256:{f['sha256']}",
                                        f"{found.prefix}/{path}"))
        if not files:
            raise SourceNotFound(f"{source.uri}: no such source", source=source.uri)
        return replace(source, prefix=found.prefix, files=tuple(files))

    def _listed(self) -> tuple[SourceFile, ...]:
        if not self.source.files:
            # Resolution lists the files; a job source is never read without it.
            raise SourceNotFound(f"{self.source.uri}: no such source", source=self.source.uri)
        return self.source.files

    def checkpoint_files(self) -> list[SourceFile]:
        files = [f for f in self._listed() if is_checkpoint_file(f.name)]
        if not files:
            raise SourceNotFound(f"{self.source.uri}: no checkpoint files",
                                 source=self.source.uri)
        return files

    def corpus_file(self) -> SourceFile:
        whole = [f for f in self._listed()
                 if f.location == f"{self.source.prefix}/{self.source.path}"]
        if not whole:
            raise SourceNotFound(f"{self.source.uri}: not one file of the job's outputs",
                                 source=self.source.uri)
        return whole[0]

    def headers(self, tokenizer: bool = False, base: ModelFolder | None = None
                ) -> ModelFolder:
        return self.remote_view(self._view, tokenizer, base)

    def _view(self, into: Path) -> Path:
        folder = into / (self.source.path.rsplit("/", 1)[-1] or self.source.job)
        folder.mkdir(parents=True)
        for f in self.checkpoint_files():
            dest = folder / f.name
            if f.name.endswith(".safetensors"):
                sparse_header_copy(partial(self.storage.get_range, f.location), f.size, dest)
            elif f.name in SMALL_FILES and f.name.endswith(".json"):
                write_whole(dest, f.size, MAX_JSON_BYTES,
                            partial(self.storage.get_bytes, f.location))
        return folder

    def check_unchanged(self, files: Iterable[SourceFile]) -> None:
        for file in files:
            self._check_present(file)

    def _check_present(self, file: SourceFile) -> None:
        # Published files are never rewritten, only deleted with their job.
        if self.storage.head(file.location) is None:
            raise SourceChanged(f"{self.source.uri}: {file.name} is gone (the job was "
                                "deleted or expired) since the job was submitted",
                                source=self.source.uri, file=file.name)

    def fetch(self, file: SourceFile, dest: Path) -> None:
        self._check_present(file)
        download = partial(self.storage.download_pinned, file.location, dest, file.size,
                           if_match=None)
        download_verified(lambda sink: download(sink=sink), file, uri=self.source.uri,
                          sender="the store", where="in the job's manifest")
