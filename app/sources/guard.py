"""The one rule every parsed source passes: the service's own storage is never a source.

Published results, ability artifacts, staging prefixes and the worker's cache hold other
keys' data (and job ids are not secrets), so a source that reaches them would hand one
key another's outputs past the ownership check of the files route. A key reuses its own
outputs as ``job:<id>`` (``app.sources.job``), which checks ownership; nothing else may
name the service's storage.

- ``s3://``: the service's bucket (``MAEC_S3_BUCKET``) is refused as a whole, not prefix
  by prefix: everything in it is the service's, and a list of its prefixes would leak the
  first one added later. Bucket names are compared case-folded (a store that folds case
  must not let ``MAEC`` through for ``maec``); the S3 client addresses buckets by path,
  so ``maec.<endpoint host>`` names another bucket, but it is refused too, so that no
  virtual-host spelling of the service's bucket is ever read, whatever the store does
  with it. Percent-encoding and ``..`` never reach here: the bucket pattern and
  ``S3Source.parse`` refuse them.
- local paths: any path at or below the storage directory (``MAEC_STORAGE_DIR``) or the
  work directory (``MAEC_WORK_DIR``: input cache, staging, artifact copies), compared
  after resolving links, so an allowed root that contains either of them, or lies
  inside one, exposes nothing of it.

The refusal is ``source_forbidden`` (422), decided from the string and the settings
before any I/O, so it says nothing about whether anything exists there. The settings
name one bucket: a second name the store itself gives the same data (an alias bucket)
is beyond what the service can see, and docs/deploy.md tells operators not to make one.
"""

from __future__ import annotations

from pathlib import Path
from urllib.parse import urlsplit

from app.settings import Settings
from app.sources.base import Source
from maec_core.service import SourceError


class SourceForbidden(SourceError):
    """The source names the service's own storage (its bucket, storage or work
    directory), which no request may read as an input."""

    code = "source_forbidden"


def service_buckets(settings: Settings) -> frozenset[str]:
    """Every spelling of the service's bucket a source could use, case-folded: the
    bucket, and the bucket as the first label of each host the store answers on."""
    own = settings.s3_bucket.casefold()
    hosts = {"s3.amazonaws.com", f"s3.{settings.s3_region}.amazonaws.com",
             f"s3-{settings.s3_region}.amazonaws.com"}
    for url in (settings.s3_endpoint_url, settings.s3_public_endpoint_url):
        host = urlsplit(url).hostname if url else None
        if host:
            hosts.add(host)
    return frozenset({own, *(f"{own}.{h.casefold()}" for h in hosts)})


def service_dirs(settings: Settings) -> tuple[Path, ...]:
    """The service's own local directories, resolved."""
    return tuple(p.resolve() for p in (settings.storage_dir, settings.work_dir))


def check_not_service_storage(source: Source, settings: Settings) -> Source:
    """``source`` unless it names the service's own storage (``SourceForbidden``)."""
    if source.kind == "s3" and source.bucket.casefold() in service_buckets(settings):
        raise SourceForbidden(
            f"{source.uri}: bucket {source.bucket} is this service's own storage, which "
            "is never a source; name your own outputs as job:<id>", source=source.uri)
    if source.kind == "local":
        path = Path(source.path).resolve()
        for own in service_dirs(settings):
            if path == own or own in path.parents:
                raise SourceForbidden(
                    f"{source.uri}: this path is inside the service's own storage, which "
                    "is never a source; name your own outputs as job:<id>",
                    source=source.uri)
    return source
