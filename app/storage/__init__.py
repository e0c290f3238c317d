"""Object storage behind one small interface: a local directory or any S3-compatible store."""

from __future__ import annotations

from app.settings import Settings
from app.storage.base import ObjectInfo, Storage, StorageError
from app.storage.local import LocalStorage

__all__ = ["LocalStorage", "ObjectInfo", "Storage", "StorageError", "make_storage"]


def make_storage(settings: Settings) -> Storage:
    if settings.storage_backend == "s3":
        # boto3 is imported only when S3 is configured (it costs ~0.3 s at start).
        from app.storage.s3 import S3Storage

        return S3Storage.from_settings(settings)
    return LocalStorage(settings.storage_dir)
