"""Hub sources (``hf://owner/name@<sha>``, and ``hf://owner/name@<sha>/<path>.gguf`` for
one GGUF file of a repo: ``app.sources.gguf``), used only when ``MAEC_HUB_ENABLED``.

Both sides look at the same files of the repo, always at the pinned commit: its top-level
``*.safetensors`` and the small files a checkpoint folder may contribute
(``app.sources.base.SMALL_FILES``: config, shard index, generation config, tokenizer
files). Sub-folders, pickles, code and any other file are never fetched.

- ``HubSource.headers`` (the API, at submission): one listing of the repo's top level, then
  ``config.json`` and the shard index whole (size-capped), and HTTP Range requests for the
  rest: each ``*.safetensors`` header and the first bytes of each side file go into a
  *sparse* stand-in of the file's full size, as ``app.sources.s3`` does, so
  ``maec_core``'s own validation runs unchanged while no tensor byte is transferred.
  A pickle is listed as an empty stand-in (refused by name when it is the only weights).
- ``HubSource.checkpoint_files`` + ``fetch`` (the worker, through
  ``worker.inputs.InputCache``): the same listing gives each file's size and content key
  (``sha256:<LFS sha256>``, else ``git-blob:<git blob id>``); ``fetch`` streams one whole
  file at the pinned commit and checks its size and that digest, so a truncated or
  corrupt transfer is a ``StorageError`` and never becomes a cache entry.

An unknown repository or revision (a private or gated repo this service has no token
for looks the same) is ``source_not_found``; any other hub failure (unreachable, 5xx, a
range request not honoured) is a ``StorageError``, which submission reports as
``invalid_source`` ("cannot read it") and a job as ``storage_unavailable``. Requests carry
the ``huggingface_hub`` credentials (``HF_TOKEN``) to the hub, never to the CDN it
redirects weights to.

Tested against a fake Hub served on 127.0.0.1 (``tests/fakehub.py``: the endpoints the
installed ``huggingface_hub`` calls, LFS files redirected to a separate CDN origin) by
``tests/api/test_hub_sources.py``: submission reads headers only (the request log shows
ranged GETs within each safetensors header, never a weights download, a pickle, a ``.py``
or a stray JSON file), unknown revisions and repos are ``source_not_found``, architecture
mismatches and hostile repos get the same codes as local paths, a private repo needs the
token and the token never reaches the CDN, a hub ignoring ``Range`` is refused cleanly,
the worker fetch takes exactly the checkpoint files, byte-identical, at the pinned commit,
once (a second fetch, or the same weights in another repo, comes from the cache), a
corrupt, short or dropped download is ``storage_unavailable`` and leaves no cache entry,
and a job with hub sources runs to ``succeeded`` with the same weights as from local paths.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterable, Iterator
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import ClassVar

import httpx

from app.settings import Settings
from app.sources.base import (
    Kind,
    Source,
    SourceFile,
    SourceKind,
    is_checkpoint_file,
    sparse_header_copy,
    write_verified,
    write_whole,
)
from app.storage.base import StorageError
from maec_core.service import (
    ADAPTER_CONFIG,
    INDEX_FILE,
    MAX_JSON_BYTES,
    MAX_SIDE_FILE_BYTES,
    PICKLE_SUFFIXES,
    TOKENIZER_FILES,
    CorruptCheckpoint,
    MaecError,
    ModelFolder,
    SourceError,
    SourceNotFound,
    is_gguf_name,
)

# Read whole at submission (the plan needs their content); side files are only sniffed.
WHOLE_FILES = ("config.json", INDEX_FILE, ADAPTER_CONFIG)
SIDE_FILES = (*TOKENIZER_FILES, "generation_config.json")
# Read whole when the recipe merges vocabularies.
TOKENIZER_WHOLE = ("tokenizer.json", "tokenizer_config.json")
# What open_model_folder's side-file check reads of each (maec_core.io.folder).
SNIFF_BYTES = 64
# X-Error-Code values of the Hub that mean "not there (for us)".
_NOT_FOUND_CODES = ("RepoNotFound", "RevisionNotFound", "EntryNotFound")
_TIMEOUT = 30.0
_CHUNK = 1 << 20
_HF = re.compile(r"^hf://(?P<repo>[A-Za-z0-9][\w.\-]*/[\w.\-]+)"
                 r"(?:@(?P<rev>[^@/]*))?(?:/(?P<file>[^@]+))?$")
_REV = re.compile(r"^[0-9a-f]{40}$")


def _content_key(blob_id: str, lfs_sha256: str | None) -> str:
    """What names a file's exact bytes on any repo: the LFS sha256 (of the content), else
    the git blob id (for an LFS file that is only its pointer's)."""
    return f"sha256:{lfs_sha256}" if lfs_sha256 else f"git-blob:{blob_id}"


def wanted_files(listing: Iterable[str]) -> list[str]:
    """The files of a repo's top level that make up a checkpoint folder."""
    return sorted(n for n in listing if is_checkpoint_file(n))


def _hub_error(source: Source, exc: Exception) -> MaecError:
    """A typed error for a failure of the ``huggingface_hub`` client."""
    from huggingface_hub.errors import (
        RemoteEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    if isinstance(exc, RevisionNotFoundError):
        return SourceNotFound(f"{source.uri}: the repository has no commit {source.revision}",
                              source=source.uri)
    if isinstance(exc, RepositoryNotFoundError):  # GatedRepoError included
        return SourceNotFound(
            f"{source.uri}: no such repository on the hub (or it is private or gated and "
            "this service has no access to it)", source=source.uri)
    if isinstance(exc, RemoteEntryNotFoundError):
        return SourceNotFound(f"{source.uri}: a file listed at this commit is missing",
                              source=source.uri)
    reason = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return StorageError(f"{source.uri}: the hub could not be read ({type(exc).__name__}"
                        f"{': ' + reason if reason else ''})", source=source.uri)


def _client_errors() -> tuple[type[Exception], ...]:
    """What the ``huggingface_hub`` client raises for hub and network failures (narrow on
    purpose: a worker's soft time limit is an ``Exception`` too, and must pass through)."""
    errors: list[type[Exception]] = [OSError, ValueError, httpx.HTTPError]
    try:  # the client's own transport (httpx2 in huggingface_hub 2.x)
        import httpx2

        errors.append(httpx2.HTTPError)
    except ImportError:
        pass
    return tuple(errors)


def _listing(source: Source, folder: str | None = None) -> dict[str, SourceFile]:
    """The files at the top level of the repo (or of its ``folder``) at the pinned
    commit, by path in the repo."""
    from huggingface_hub import HfApi
    from huggingface_hub.hf_api import RepoFile

    try:
        return {e.path: SourceFile(e.path.rsplit("/", 1)[-1], int(e.size),
                                   _content_key(e.blob_id, e.lfs.sha256 if e.lfs else None),
                                   e.path, e.blob_id)
                for e in HfApi().list_repo_tree(source.repo, path_in_repo=folder,
                                                revision=source.revision)
                if isinstance(e, RepoFile)}
    except _client_errors() as exc:  # HfHubHTTPError and friends are OSErrors
        raise _hub_error(source, exc) from None


class _Reader:
    """GETs of one repo's files at the pinned commit, following the hub's redirects."""

    def __init__(self, source: Source) -> None:
        from huggingface_hub import hf_hub_url
        from huggingface_hub.utils import build_hf_headers  # type: ignore[attr-defined]

        self.source = source
        self._url = hf_hub_url
        # httpx drops Authorization when a redirect leaves the hub's origin (the CDN).
        self.http = httpx.Client(follow_redirects=True, timeout=_TIMEOUT,
                                 headers=build_hf_headers())

    def close(self) -> None:
        self.http.close()

    @contextlib.contextmanager
    def _stream(self, name: str, headers: dict[str, str]) -> Iterator[Iterator[bytes]]:
        """The body of a GET of ``name`` (ranged when ``headers`` has a Range), as chunks;
        transport failures, here or while the caller reads, are ``StorageError``s."""
        url = self._url(self.source.repo, name, revision=self.source.revision)
        ranged = "Range" in headers
        try:
            with self.http.stream("GET", url, headers=headers) as r:
                if r.status_code != (206 if ranged else 200):
                    raise self._status_error(name, r, ranged)
                yield r.iter_bytes(_CHUNK)
        except httpx.HTTPError as exc:
            raise StorageError(f"{self.source.uri}: the hub could not be read "
                               f"({type(exc).__name__}: {exc})", source=self.source.uri,
                               file=name) from None

    def get(self, name: str, first: int | None = None, last: int | None = None,
            *, cap: int) -> bytes:
        """Bytes ``first..last`` (inclusive) of ``name``, or the whole file (at most ``cap``)."""
        want = None if first is None or last is None else last - first + 1
        headers = {} if want is None else {"Range": f"bytes={first}-{last}"}
        data = bytearray()
        with self._stream(name, headers) as chunks:
            for chunk in chunks:
                data += chunk
                if len(data) > cap:
                    break
        if len(data) > cap:
            raise CorruptCheckpoint(f"{name} is more than {cap} bytes", file=name)
        if want is not None and len(data) != want:
            raise StorageError(f"{self.source.uri}: the hub sent {len(data)} bytes of {name} "
                               f"for a {want} byte range", source=self.source.uri, file=name)
        return bytes(data)

    def _status_error(self, name: str, r: httpx.Response, ranged: bool) -> MaecError:
        if r.headers.get("X-Error-Code") in _NOT_FOUND_CODES or r.status_code in (401, 404):
            return SourceNotFound(f"{self.source.uri}: {name} cannot be read at this commit "
                                  f"(HTTP {r.status_code})", source=self.source.uri, file=name)
        what = "a range request" if ranged else "a download"
        return StorageError(f"{self.source.uri}: the hub answered HTTP {r.status_code} to "
                            f"{what} of {name}", source=self.source.uri, file=name)

    def sparse(self, name: str, size: int, dest: Path) -> None:
        """``dest``: ``size`` bytes, of which only the safetensors header is real."""
        sparse_header_copy(lambda first, last: self.get(name, first, last,
                                                        cap=last - first + 1), size, dest)

    def sniff(self, name: str, size: int, dest: Path) -> None:
        """``dest``: ``size`` bytes, of which only the first ``SNIFF_BYTES`` are real."""
        head = self.get(name, 0, min(size, SNIFF_BYTES) - 1, cap=SNIFF_BYTES) if size else b""
        with open(dest, "wb") as f:
            f.write(head)
            f.truncate(size)

    def download(self, file: SourceFile, dest: Path) -> None:
        """``dest``: the whole of ``file``, checked against the listing while it streams."""
        with self._stream(file.location, {}) as chunks:
            write_verified(chunks, dest, file, uri=self.source.uri, sender="the hub",
                           where="at this commit")


def hub_view(source: Source, into: Path, *, tokenizer: bool = False) -> Path:
    """Configs plus sparse header copies of every shard (ranged GETs, no weights);
    ``tokenizer``: the tokenizer files whole too (a vocabulary merge plans with them)."""
    listing = _listing(source)
    folder = into / source.repo.replace("/", "--")
    folder.mkdir(parents=True)
    for name in sorted(listing):
        if "/" not in name and name.endswith(PICKLE_SUFFIXES):
            (folder / name).touch()  # present, never read: open_model_folder refuses it
    reader = _Reader(source)
    try:
        for name in wanted_files(listing):
            size, dest = listing[name].size, folder / name
            if name.endswith(".safetensors"):
                reader.sparse(name, size, dest)
            elif tokenizer and name in TOKENIZER_WHOLE:
                write_whole(dest, size, MAX_SIDE_FILE_BYTES,
                            partial(reader.get, name, cap=MAX_SIDE_FILE_BYTES))
            elif name in WHOLE_FILES:
                write_whole(dest, size, MAX_JSON_BYTES,
                            partial(reader.get, name, cap=MAX_JSON_BYTES))
            elif name in SIDE_FILES:
                reader.sniff(name, size, dest)
    finally:
        reader.close()
    return folder


def hub_file(source: Source) -> SourceFile:
    """The one file a file reference (``hf://owner/name@<sha>/<path>``) names, with its
    size and content key from the listing of its folder at the pinned commit."""
    folder = source.path.rpartition("/")[0] or None
    found = _listing(source, folder).get(source.path)
    if found is None:
        raise SourceNotFound(f"{source.uri}: no file {source.path} at this commit",
                             source=source.uri, file=source.path)
    return found


def read_hub_range(source: Source, file: SourceFile, first: int, last: int) -> bytes:
    """Bytes ``first..last`` (inclusive) of ``file`` at the pinned commit (a GGUF header
    is read this way at submission, as an ``s3://`` one is)."""
    reader = _Reader(source)
    try:
        return reader.get(file.location, first, last, cap=last - first + 1)
    finally:
        reader.close()


def hub_files(source: Source) -> list[SourceFile]:
    """The checkpoint files of the pinned commit (``wanted_files``), with their identities."""
    listing = _listing(source)
    wanted = [listing[n] for n in wanted_files(listing)]
    if not any(f.name.endswith(".safetensors") for f in wanted):
        raise SourceNotFound(f"{source.uri}: no safetensors weights at this commit",
                             source=source.uri)
    return wanted


def _file_in_repo(text: str, file: str | None) -> str:
    """The path in the repo a file reference names ("" for a repository reference):
    a ``.gguf`` file, the one kind of hub source that is a single file."""
    if file is None:
        return ""
    parts = file.split("/")
    if any(p in ("", ".", "..") for p in parts) or not is_gguf_name(parts[-1]):
        raise SourceError(f"{text}: a hub file reference names one .gguf file in the "
                          "repository (hf://owner/name@<sha>/<path>.gguf)", source=text)
    return file


class HubSource(SourceKind):
    kind: ClassVar[Kind] = "hf"
    scheme: ClassVar[str] = "hf"

    @classmethod
    def parse(cls, text: str, settings: Settings) -> Source:
        if not settings.hub_enabled:
            raise SourceError(
                f"{text}: hub sources are disabled on this service (MAEC_HUB_ENABLED)",
                source=text,
            )
        m = _HF.match(text)
        if m is None:
            raise SourceError(f"{text}: expected hf://owner/name@<revision> (or "
                              "hf://owner/name@<revision>/<file>.gguf)", source=text)
        rev = m.group("rev") or ""
        if not _REV.match(rev):
            raise SourceError(
                f"{text}: hub sources need a pinned 40-hex commit revision "
                "(hf://owner/name@<sha>); branches and tags can move",
                source=text,
            )
        return Source("hf", text, repo=m.group("repo"), revision=rev,
                      path=_file_in_repo(text, m.group("file")))

    def headers(self, tokenizer: bool = False, base: ModelFolder | None = None
                ) -> ModelFolder:
        return self.remote_view(partial(hub_view, self.source, tokenizer=tokenizer),
                                tokenizer, base)

    def pin(self, *, single: bool = False) -> Source:
        # The 40-hex revision already pins every byte (each file is checked against its
        # digest at that commit): nothing to record, no extra listing at submission.
        # A file reference is pinned to its file all the same: a job record's one pinned
        # .gguf file is what tells the worker to dequantize it.
        if self.source.path:
            return replace(self.source, files=(hub_file(self.source),))
        return self.source

    def checkpoint_files(self) -> list[SourceFile]:
        if self.source.path:
            raise SourceError(f"{self.source.uri}: a hub file reference names a GGUF "
                              "file; name the repository for a checkpoint folder",
                              source=self.source.uri)
        return hub_files(self.source)

    def corpus_file(self) -> SourceFile:
        raise SourceError(f"{self.source.uri}: a corpus must be an s3:// object or a local "
                          "file", source=self.source.uri)

    def fetch(self, file: SourceFile, dest: Path) -> None:
        """Write ``file`` of the pinned commit to ``dest``, verified (size and digest)."""
        reader = _Reader(self.source)
        try:
            reader.download(file, dest)
        finally:
            reader.close()
