"""Hub sources (``hf://owner/name@<sha>``), used only when ``MAEC_HUB_ENABLED``.

Both sides look at the same files of the repo, always at the pinned commit: its top-level
``*.safetensors`` and the small files a checkpoint folder may contribute
(``app.sources.SMALL_FILES``: config, shard index, generation config, tokenizer files).
Sub-folders, pickles, code and any other file are never fetched.

- ``hub_view`` (the API, at submission): one listing of the repo's top level, then
  ``config.json`` and the shard index whole (size-capped), and HTTP Range requests for the
  rest: each ``*.safetensors`` header and the first bytes of each side file go into a
  *sparse* stand-in of the file's full size, as ``app.sources`` does for S3, so
  ``maec_core``'s own validation runs unchanged while no tensor byte is transferred.
  A pickle is listed as an empty stand-in (refused by name when it is the only weights).
- ``hub_fetch`` (the worker): ``snapshot_download`` of exactly those files into a folder.

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
and a job with hub sources runs to ``succeeded`` with the same weights as from local paths.
"""

from __future__ import annotations

import glob
import struct
from pathlib import Path

import httpx

from app.sources import SMALL_FILES, Source
from app.storage.base import StorageError
from maec_core.errors import CorruptCheckpoint, MaecError, SourceNotFound
from maec_core.io.folder import (
    INDEX_FILE,
    MAX_JSON_BYTES,
    PICKLE_SUFFIXES,
    TOKENIZER_FILES,
)
from maec_core.io.headers import MAX_HEADER_BYTES

# Read whole at submission (the plan needs their content); side files are only sniffed.
WHOLE_FILES = ("config.json", INDEX_FILE)
SIDE_FILES = (*TOKENIZER_FILES, "generation_config.json")
# What open_model_folder's side-file check reads of each (maec_core.io.folder).
SNIFF_BYTES = 64
# X-Error-Code values of the Hub that mean "not there (for us)".
_NOT_FOUND_CODES = ("RepoNotFound", "RevisionNotFound", "EntryNotFound")
_TIMEOUT = 30.0


def wanted_files(listing: dict[str, int]) -> list[str]:
    """The files of a repo's top level that make up a checkpoint folder."""
    return sorted(n for n in listing if "/" not in n
                  and (n.endswith(".safetensors") or n in SMALL_FILES))


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


def _listing(source: Source) -> dict[str, int]:
    """``{name: size}`` of the files at the top level of the repo at the pinned commit."""
    from huggingface_hub import HfApi
    from huggingface_hub.hf_api import RepoFile

    try:
        return {e.path: int(e.size) for e in HfApi().list_repo_tree(
            source.repo, revision=source.revision) if isinstance(e, RepoFile)}
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

    def get(self, name: str, first: int | None = None, last: int | None = None,
            *, cap: int) -> bytes:
        """Bytes ``first..last`` (inclusive) of ``name``, or the whole file (at most ``cap``)."""
        url = self._url(self.source.repo, name, revision=self.source.revision)
        want = None if first is None or last is None else last - first + 1
        headers = {} if want is None else {"Range": f"bytes={first}-{last}"}
        data = bytearray()
        try:
            with self.http.stream("GET", url, headers=headers) as r:
                if r.status_code != (200 if want is None else 206):
                    raise self._status_error(name, r, want is not None)
                for chunk in r.iter_bytes():
                    data += chunk
                    if len(data) > cap:
                        break
        except httpx.HTTPError as exc:
            raise StorageError(f"{self.source.uri}: the hub could not be read "
                               f"({type(exc).__name__}: {exc})", source=self.source.uri,
                               file=name) from None
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
        if size < 8:
            raise CorruptCheckpoint(f"{name}: shorter than the 8-byte header length",
                                    file=name)
        (n,) = struct.unpack("<Q", self.get(name, 0, 7, cap=8))
        if n > MAX_HEADER_BYTES or 8 + n > size:
            raise CorruptCheckpoint(f"{name}: header length {n} is impossible", file=name)
        header = self.get(name, 8, 8 + n - 1, cap=n) if n else b""
        with open(dest, "wb") as f:
            f.write(struct.pack("<Q", n) + header)
            f.truncate(size)

    def sniff(self, name: str, size: int, dest: Path) -> None:
        """``dest``: ``size`` bytes, of which only the first ``SNIFF_BYTES`` are real."""
        head = self.get(name, 0, min(size, SNIFF_BYTES) - 1, cap=SNIFF_BYTES) if size else b""
        with open(dest, "wb") as f:
            f.write(head)
            f.truncate(size)


def hub_view(source: Source, into: Path) -> Path:
    """Configs plus sparse header copies of every shard (ranged GETs, no weights)."""
    listing = _listing(source)
    folder = into / source.repo.replace("/", "--")
    folder.mkdir(parents=True)
    for name in sorted(listing):
        if "/" not in name and name.endswith(PICKLE_SUFFIXES):
            (folder / name).touch()  # present, never read: open_model_folder refuses it
    reader = _Reader(source)
    try:
        for name in wanted_files(listing):
            size, dest = listing[name], folder / name
            if name.endswith(".safetensors"):
                reader.sparse(name, size, dest)
            elif name in WHOLE_FILES:
                if size > MAX_JSON_BYTES:
                    raise CorruptCheckpoint(f"{name} is {size} bytes, above the cap", file=name)
                dest.write_bytes(reader.get(name, cap=MAX_JSON_BYTES))
            elif name in SIDE_FILES:
                reader.sniff(name, size, dest)
    finally:
        reader.close()
    return folder


def hub_fetch(source: Source, dest: Path) -> Path:
    """Download the checkpoint files of the pinned commit into ``dest``."""
    from huggingface_hub import snapshot_download

    wanted = wanted_files(_listing(source))
    if not any(n.endswith(".safetensors") for n in wanted):
        raise SourceNotFound(f"{source.uri}: no safetensors weights at this commit",
                             source=source.uri)
    try:
        snapshot_download(source.repo, revision=source.revision, local_dir=dest,
                          allow_patterns=[glob.escape(n) for n in wanted])
    except _client_errors() as exc:
        raise _hub_error(source, exc) from None
    missing = [n for n in wanted if not (dest / n).is_file()]
    if missing:
        raise StorageError(f"{source.uri}: the hub download left out {', '.join(missing)}",
                           source=source.uri)
    return dest
