"""Fetching one large S3 input from a local SeaweedFS: ours (boto3's managed transfer,
parallel ranged GETs pinned to the listed ETag, the SHA-256 taken in file order as the
parts land) against the peer, one streamed GET per file hashed as it streams (how inputs
were fetched before), in the same run, interleaved.

Both sides fetch the same object (uploaded in one part with a SHA-256, so both check the
digest) through the same S3Storage and write it to the same disk; the files are removed
between runs. ``BENCH_FETCH_MIB`` (default 768) sets the object's size, ``BENCH_ROUNDS``
(default 3) the runs per side, ``MAEC_S3_TRANSFER_CONCURRENCY`` and
``MAEC_S3_DOWNLOAD_PART_BYTES`` the transfer.

Ends with ``RESULT s3_fetch mib=<n> concurrency=<c> ranged_s=<median> streamed_s=<median>
speedup_vs_streamed=<streamed/ranged>`` (at least 1.0: no slower).
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from app.settings import Settings, hash_key
from app.sources import open_source, parse_source
from app.sources.base import SourceFile, write_verified
from app.storage.s3 import S3Storage
from tests.stack import S3_BUCKET, S3_INPUTS_BUCKET, S3_KEY_ID, S3_SECRET, S3Server

MIB = int(os.environ.get("BENCH_FETCH_MIB", 768))
ROUNDS = int(os.environ.get("BENCH_ROUNDS", 3))
KEY = "bench/fetch/input.bin"


def _settings(s3: S3Server) -> Settings:
    return Settings.model_validate(dict(
        api_keys={"a": hash_key("a")}, storage_backend="s3", s3_endpoint_url=s3.endpoint,
        s3_bucket=S3_BUCKET, s3_access_key=S3_KEY_ID, s3_secret_key=S3_SECRET))


def _upload(s3: S3Server, size: int) -> None:
    """``size`` pseudo-random bytes as one object with a whole-object SHA-256."""
    block = os.urandom(16 * 1024 * 1024)
    data = bytearray()
    while len(data) < size:
        data += block[: size - len(data)]
        block = block[1:] + block[:1]  # no two blocks alike
    s3.client().put_object(Bucket=S3_INPUTS_BUCKET, Key=KEY, Body=bytes(data),
                           ChecksumAlgorithm="SHA256")


def _streamed(storage: S3Storage, file: SourceFile, dest: Path) -> None:
    """The peer: one GET streamed to disk and hashed as it streams."""
    chunks = storage.iter_range(file.location, 0, file.size - 1, if_match=file.version)
    write_verified(chunks, dest, file, uri=f"s3://{S3_INPUTS_BUCKET}/{KEY}", sender="the store",
                   where="as listed")


def _timed(fetch: Callable[[Path], None], dest: Path) -> float:
    t0 = time.perf_counter()
    fetch(dest)
    took = time.perf_counter() - t0
    dest.unlink()
    return took


def main() -> int:
    var = Path(tempfile.mkdtemp(prefix="maec-bench-fetch-"))
    s3 = S3Server(var / "s3").start()
    try:
        settings = _settings(s3)
        storage = S3Storage.from_settings(settings)
        _upload(s3, MIB * 1024 * 1024)
        reader = open_source(parse_source(f"s3://{S3_INPUTS_BUCKET}/{KEY}", settings), storage)
        file = reader.corpus_file()
        assert file.content_key.startswith("sha256:"), "both sides must check the digest"
        sides: dict[str, Callable[[Path], None]] = {
            "ranged": lambda d: reader.fetch(file, d),
            "streamed": lambda d: _streamed(storage, file, d),
        }
        _timed(sides["streamed"], var / "warm")  # the store's own caches, for both
        times: dict[str, list[float]] = {name: [] for name in sides}
        for r in range(ROUNDS):
            order = list(sides) if r % 2 == 0 else list(reversed(sides))
            for name in order:
                times[name].append(_timed(sides[name], var / name))
                print(f"bench: {name:8s} {MIB} MiB in {times[name][-1]:.2f} s "
                      f"({MIB / times[name][-1]:.0f} MiB/s)", flush=True)
    finally:
        s3.stop()
        shutil.rmtree(var, ignore_errors=True)
    ranged, streamed = (statistics.median(times[n]) for n in ("ranged", "streamed"))
    print(f"bench: {os.cpu_count()} cores; ranged GETs of {settings.s3_download_part_bytes} "
          f"bytes, {settings.s3_transfer_concurrency} at once")
    print(f"RESULT s3_fetch mib={MIB} concurrency={settings.s3_transfer_concurrency} "
          f"ranged_s={ranged:.2f} streamed_s={streamed:.2f} "
          f"speedup_vs_streamed={streamed / ranged:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
