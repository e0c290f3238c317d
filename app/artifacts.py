"""MAEC ability-vector artifacts kept in object storage, with a local copy per worker.

Implements ``maec_core.maec.store.ArtifactStore``. Objects live under
``artifacts/<key>/``; ``ability.json`` (the metadata) is uploaded last and marks an
artifact complete, mirroring the local store's rule, so a half-uploaded artifact (a
worker killed mid-put) is never used and the next job simply extracts again.

Artifacts are collected once no job references them for a grace period (the retention
sweep, :meth:`app.jobs.worker_store.WorkerJobStore.collect_artifacts`); ``on_use`` is told
of every artifact stored or read so that an unreferenced one in use keeps its place. An
artifact deleted while a worker fetches it reads as absent: that job extracts again.
"""

from __future__ import annotations

import logging
import os
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path

from app.storage.base import Storage, StorageError
from maec_core.maec.store import META_NAME, check_key

log = logging.getLogger("maec.artifacts")
PREFIX = "artifacts"


class StorageArtifactStore:
    def __init__(self, storage: Storage, local_dir: Path,
                 on_use: Callable[[str], None] | None = None) -> None:
        self.storage = storage
        self.local_dir = Path(local_dir)
        self._on_use = on_use

    def _used(self, key: str) -> None:
        if self._on_use is not None:
            self._on_use(key)

    def _prefix(self, key: str) -> str:
        return f"{PREFIX}/{check_key(key)}"

    def get(self, key: str) -> Path | None:
        local = self.local_dir / check_key(key)
        if (local / META_NAME).is_file():
            self._used(key)
            return local
        prefix = self._prefix(key)
        if self.storage.head(f"{prefix}/{META_NAME}") is None:
            return None
        self._used(key)
        self.local_dir.mkdir(parents=True, exist_ok=True)
        staging = self.local_dir / f".{key}.{uuid.uuid4().hex[:8]}"
        try:
            objects = [o for o in self.storage.list(prefix + "/")
                       if "/" not in o.key[len(prefix) + 1:]]
            names = [o.key[len(prefix) + 1:] for o in objects]
            for name in [n for n in names if n != META_NAME] + [META_NAME]:
                self.storage.download(f"{prefix}/{name}", staging / name)
            if local.exists():
                shutil.rmtree(local)
            os.rename(staging, local)
        except (StorageError, FileNotFoundError) as exc:
            # Collected (or the store failed) mid-fetch: as if absent, extract again.
            log.warning("artifact %s not fetched: %s", key[:12], exc)
            return None
        except OSError:
            if not (local / META_NAME).is_file():
                raise
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        log.info("artifact %s fetched from storage", key[:12])
        return local

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
        """Remove the artifact from storage (StorageError when the store refuses)."""
        self.storage.delete_prefix(self._prefix(key) + "/")
