"""MAEC ability-vector artifacts kept in object storage, with a local copy per worker.

Implements ``maec_core.maec.store.ArtifactStore``. Objects live under
``artifacts/<key>/``; ``ability.json`` (the metadata) is uploaded last and marks an
artifact complete, mirroring the local store's rule, so a half-uploaded artifact (a
worker killed mid-put) is never used and the next job simply extracts again.
"""

from __future__ import annotations

import logging
import os
import shutil
import uuid
from pathlib import Path

from app.storage.base import Storage
from maec_core.maec.store import META_NAME, check_key

log = logging.getLogger("maec.artifacts")
PREFIX = "artifacts"


class StorageArtifactStore:
    def __init__(self, storage: Storage, local_dir: Path) -> None:
        self.storage = storage
        self.local_dir = Path(local_dir)

    def _prefix(self, key: str) -> str:
        return f"{PREFIX}/{check_key(key)}"

    def get(self, key: str) -> Path | None:
        local = self.local_dir / check_key(key)
        if (local / META_NAME).is_file():
            return local
        prefix = self._prefix(key)
        if self.storage.head(f"{prefix}/{META_NAME}") is None:
            return None
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
        except OSError:
            if not (local / META_NAME).is_file():
                raise
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        log.info("artifact %s fetched from storage", key[:12])
        return local

    def put(self, key: str, folder: Path) -> None:
        prefix = self._prefix(key)
        if self.storage.head(f"{prefix}/{META_NAME}") is not None:
            return  # content-addressed: the stored one holds the same bytes
        names = sorted(p.name for p in Path(folder).iterdir() if p.is_file())
        for name in [n for n in names if n != META_NAME] + [META_NAME]:
            self.storage.put_file(f"{prefix}/{name}", Path(folder) / name)
        log.info("artifact %s stored (%d files)", key[:12], len(names))
