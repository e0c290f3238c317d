"""Hub sources (``hf://owner/name@<sha>``), used only when ``MAEC_HUB_ENABLED``.

Only safetensors, JSON and tokenizer files are ever fetched, always at the pinned commit.
Untested here (no network in CI); the refusals in ``app.sources`` are what the tests cover.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import TYPE_CHECKING

import httpx

from maec_core.errors import CorruptCheckpoint, SourceNotFound
from maec_core.io.folder import PICKLE_SUFFIXES, TOKENIZER_FILES
from maec_core.io.headers import MAX_HEADER_BYTES

if TYPE_CHECKING:
    from app.sources import Source

ALLOW_PATTERNS = ["*.safetensors", "*.json", *TOKENIZER_FILES]


def hub_view(source: Source, into: Path) -> Path:
    """Configs plus sparse header copies of every shard (ranged GETs, no weights)."""
    from huggingface_hub import HfApi, hf_hub_download, hf_hub_url

    api = HfApi()
    try:
        files = api.list_repo_files(source.repo, revision=source.revision)
    except Exception as exc:  # the hub client raises many types; all mean "not found"
        raise SourceNotFound(f"{source.uri}: {exc}", source=source.uri) from None
    folder = into / source.repo.replace("/", "--")
    folder.mkdir(parents=True)
    with httpx.Client(follow_redirects=True, timeout=30) as http:
        for name in files:
            if "/" in name:
                continue
            if name.endswith(PICKLE_SUFFIXES):
                (folder / name).touch()
            elif name.endswith(".json"):
                hf_hub_download(source.repo, name, revision=source.revision,
                                local_dir=folder)
            elif name.endswith(".safetensors"):
                url = hf_hub_url(source.repo, name, revision=source.revision)
                head = http.get(url, headers={"Range": "bytes=0-7"})
                total = int(head.headers["Content-Range"].rsplit("/", 1)[1])
                (n,) = struct.unpack("<Q", head.content[:8])
                if n > MAX_HEADER_BYTES or 8 + n > total:
                    raise CorruptCheckpoint(f"{name}: impossible header length", file=name)
                body = http.get(url, headers={"Range": f"bytes=8-{8 + n - 1}"}).content
                with open(folder / name, "wb") as f:
                    f.write(head.content[:8] + body)
                    f.truncate(total)
    return folder


def hub_fetch(source: Source, dest: Path) -> Path:
    """Download the allowed files of the pinned commit into ``dest``."""
    from huggingface_hub import snapshot_download

    snapshot_download(source.repo, revision=source.revision, local_dir=dest,
                      allow_patterns=ALLOW_PATTERNS)
    return dest
