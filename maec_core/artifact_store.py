"""Where a method's artifacts (work a later job can reuse: MAEC's ability vectors) are
kept between jobs, by content-addressed key.

The library needs only two operations; the service's worker passes an object-storage
implementation, the CLI and tests the local one below (in a folder they choose). The
store knows no method: an artifact is a folder of files whose metadata file is written
last, so a folder without it is incomplete.
"""

from __future__ import annotations

import os
import re
import shutil
import uuid
from pathlib import Path
from typing import Protocol, runtime_checkable

from maec_core.errors import MaecError

_KEY = re.compile(r"^[0-9a-f]{64}$")
# The file an artifact folder is complete with (its metadata, stored last). The name is
# kept from the first method with artifacts: stored artifacts stay readable.
META_NAME = "ability.json"


@runtime_checkable
class ArtifactStore(Protocol):
    def get(self, key: str) -> Path | None:
        """A local folder holding the artifact with ``key``, or None when absent."""
        ...

    def put(self, key: str, folder: Path) -> None:
        """Keep the artifact in ``folder`` under ``key`` (the folder stays the caller's,
        to remove when it likes; a store may link its files rather than copy them, so
        they are never rewritten in place)."""
        ...


def check_key(key: str) -> str:
    if not _KEY.match(key):
        # Keys become path components and object names: refuse anything but a sha256.
        raise MaecError(f"artifact key {key!r} is not a lowercase sha256 hex digest")
    return key


class LocalArtifactStore:
    """Artifacts as folders ``<root>/<key>/``, published by an atomic rename."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)

    def get(self, key: str) -> Path | None:
        folder = self.root / check_key(key)
        # The metadata file is copied last, so a folder without it is not an artifact.
        return folder if (folder / META_NAME).is_file() else None

    def put(self, key: str, folder: Path) -> None:
        final = self.root / check_key(key)
        if (final / META_NAME).is_file():
            return  # content-addressed: an existing entry holds the same bytes
        self.root.mkdir(parents=True, exist_ok=True)
        staging = self.root / f".{key}.staging-{uuid.uuid4().hex[:12]}"
        try:
            staging.mkdir()
            names = sorted(p.name for p in Path(folder).iterdir() if p.is_file())
            for name in [n for n in names if n != META_NAME] + [META_NAME]:
                _link_or_copy(Path(folder) / name, staging / name)
            if final.exists():
                shutil.rmtree(final)  # a leftover without metadata: incomplete
            os.rename(staging, final)
        except FileExistsError:
            pass  # another process published the same key first
        except OSError as exc:
            if not (final / META_NAME).is_file():
                raise MaecError(f"cannot store artifact {key}: {exc}") from exc
        finally:
            if staging.exists():
                shutil.rmtree(staging, ignore_errors=True)


def _link_or_copy(src: Path, dst: Path) -> None:
    """``dst`` as a second name of ``src`` when both are on one filesystem, else a copy.

    An artifact's files are never changed once written, so a hard link is as good as a
    copy, and a one-run merge's artifact (hundreds of MB at 7B) is then stored without
    reading or writing its bytes again."""
    try:
        os.link(src, dst)
    except OSError:
        # Another filesystem, or one without hard links.
        shutil.copyfile(src, dst)
