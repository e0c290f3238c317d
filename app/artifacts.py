"""MAEC ability-vector artifacts kept in object storage, with local copies per worker.

Implements ``maec_core.artifact_store.ArtifactStore``. Objects live under
``artifacts/<key>/``; ``ability.json`` (the metadata) is uploaded last and marks an
artifact complete, mirroring the local store's rule, so a half-uploaded artifact (a
worker killed mid-put) is never used and the next job simply extracts again.

Storage is the source of truth. A worker reads an artifact from its local copy (an entry
of a size-capped LRU ``app.disk_cache.DiskCache``, shared by the worker's processes),
but only while storage still holds the artifact: ``get`` asks storage first (one HEAD of
the metadata, nothing next to a merge), and a copy of an artifact storage no longer has
is dropped. A job holds the copies it reads until it ends, so eviction never removes one
under it.

Artifacts are scoped per API key (:func:`artifact_scope`, part of every key): a job's
``artifact_reused`` says that the same key extracted this ability before, and never that
another key did. Sharing bytes across keys while reporting reuse per key would need a
record of who made what beside every artifact, and an artifact fetched for one key could
still be timed by another (a reused extraction finishes sooner); separate artifacts cost
one extraction per key and leave nothing to infer.

Artifacts are collected once no job references them for a grace period (the retention
sweep, :meth:`app.jobs.worker_store.WorkerJobStore.collect_artifacts`); ``on_use`` is told
of every artifact stored or read so that an unreferenced one in use keeps its place. An
artifact deleted while a worker fetches it reads as absent: that job extracts again.
"""

from __future__ import annotations

import hashlib
import logging
import re
import shutil
from collections.abc import Callable
from functools import partial
from pathlib import Path

from app.disk_cache import DiskCache, Hold
from app.storage.base import ObjectInfo, Storage, StorageError
from maec_core.service import META_NAME, check_key

log = logging.getLogger("maec.artifacts")
PREFIX = "artifacts"
# What earlier versions kept directly in the local folder (a copy per key, a staging
# folder per fetch), before the copies became cache entries under objects/.
_LEGACY = re.compile(r"^\.?[0-9a-f]{64}(\.[0-9a-f]+)?$")


def artifact_scope(owner: str) -> str:
    """The artifact scope of API key ``owner`` (``RunContext.artifact_scope``): a digest,
    so the owner's name is not written into the artifacts' metadata; length-prefixed,
    so no two owners' inputs to it are one string."""
    data = owner.encode()
    return hashlib.sha256(b"maec-artifact-scope\0%d\0" % len(data) + data).hexdigest()


class StorageArtifactStore:
    """``local_dir`` holds the worker's copies, at most ``max_bytes`` of them (beyond it
    the least recently used that no job holds go first); ``hold`` keeps those ``get``
    returns from eviction until it is released (a job's: until the job ends)."""

    def __init__(self, storage: Storage, local_dir: Path, max_bytes: int, *,
                 on_use: Callable[[str], None] | None = None,
                 hold: Hold | None = None) -> None:
        self.storage = storage
        self.local_dir = Path(local_dir)
        self.copies = DiskCache(self.local_dir, max_bytes)
        self._on_use = on_use
        self._hold = hold
        # Keys whose copy ``hold`` already has: a sweep reads the same artifacts once per
        # candidate, and one lock each is enough.
        self._held: set[str] = set()

    def _used(self, key: str) -> None:
        if self._on_use is not None:
            self._on_use(key)

    def _prefix(self, key: str) -> str:
        return f"{PREFIX}/{check_key(key)}"

    def _in_storage(self, key: str) -> bool:
        """Whether storage holds the artifact; when storage cannot say, whether there is
        a local copy (StorageError when neither)."""
        try:
            return self.storage.head(f"{self._prefix(key)}/{META_NAME}") is not None
        except StorageError as exc:
            # The local copy's bytes are the artifact's (its key is a digest of its
            # inputs), so using it is never wrong; refusing would turn a storage blip into
            # a re-extraction, whose upload would fail on the same blip. At worst this job
            # reuses an artifact collected meanwhile: correct all the same, and other
            # workers, which miss it, extract it again.
            if self.copies.find(key, _complete) is None:
                raise
            log.warning("artifact %s: storage unreachable (%s), using the local copy",
                        key[:12], exc.message)
            return True

    def get(self, key: str) -> Path | None:
        check_key(key)
        if not self._in_storage(key):
            # Collected by retention: a local copy must not outlive it (other workers no
            # longer have it, and using it would keep touching a deleted artifact). The
            # job extracts again and ``put`` stores it again.
            if not self.copies.drop(key):
                log.info("artifact %s is gone from storage; its local copy, in use, "
                         "goes at a later read or eviction", key[:12])
            return None
        self._used(key)
        if key in self._held and self.copies.find(key, _complete) is not None:
            return self.copies.entry(key)
        objects: list[ObjectInfo] | None = None
        try:
            if self.copies.find(key, _complete) is None:
                # A miss: make room for it first (the copies this job holds stay).
                objects = self._objects(key)
                self.copies.evict(keep_free=sum(o.size for o in objects))
                self._drop_legacy()
            path, hit = self.copies.get_or_fill(
                key, _complete, partial(self._download, key, objects), self._hold,
                what=f"artifact {key}")
        except (StorageError, FileNotFoundError) as exc:
            # Collected (or the store failed) mid-fetch: as if absent, extract again.
            log.warning("artifact %s not fetched: %s", key[:12], exc)
            return None
        if self._hold is not None:
            self._held.add(key)
        if not hit:
            log.info("artifact %s fetched from storage", key[:12])
        return path

    def _objects(self, key: str) -> list[ObjectInfo]:
        """The artifact's files in storage (not what may lie in folders below it)."""
        prefix = self._prefix(key) + "/"
        return [o for o in self.storage.list(prefix) if "/" not in o.key[len(prefix):]]

    def _download(self, key: str, objects: list[ObjectInfo] | None, dest: Path) -> None:
        """The artifact into the new folder ``dest``, its metadata last."""
        prefix = self._prefix(key) + "/"
        names = [o.key[len(prefix):] for o in (objects or self._objects(key))]
        dest.mkdir()
        for name in [n for n in names if n != META_NAME] + [META_NAME]:
            self.storage.download(prefix + name, dest / name)

    def _drop_legacy(self) -> None:
        for p in self.local_dir.iterdir():
            if p.is_dir() and _LEGACY.match(p.name):
                shutil.rmtree(p, ignore_errors=True)

    def put(self, key: str, folder: Path) -> None:
        prefix = self._prefix(key)
        self._used(key)  # before the upload: a half-stored artifact is a candidate too
        if self.storage.head(f"{prefix}/{META_NAME}") is not None:
            return  # content-addressed: the stored one holds the same bytes
        names = sorted(p.name for p in Path(folder).iterdir() if p.is_file())
        for name in [n for n in names if n != META_NAME] + [META_NAME]:
            self.storage.put_file(f"{prefix}/{name}", Path(folder) / name)
        log.info("artifact %s stored (%d files)", key[:12], len(names))

    def delete(self, key: str) -> None:
        """Remove the artifact from storage (StorageError when the store refuses), and
        this worker's copy unless a job is using it."""
        self.storage.delete_prefix(self._prefix(key) + "/")
        self.copies.drop(key)


def _complete(copy: Path) -> bool:
    # The metadata is downloaded last, and a copy only appears whole (a rename).
    return (copy / META_NAME).is_file()
