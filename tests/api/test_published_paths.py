"""Published files name inputs by reference, never by the worker's paths: a merge, a MAEC
job, an evaluated job, a sweep publishing every candidate and an MoE build run
in-process (the bodies of scripts/published_digests.py), and every text file each
publishes is searched for the worker's work folder, temporary folders and job ids."""

from __future__ import annotations

import re
import tempfile
from pathlib import Path

import pytest

from scripts.published_digests import TEXT, job_bodies
from tests.api.conftest import Api

# A job id as the service makes them (app.jobs), in a path or anywhere else.
JOB_ID = re.compile(r"j_[0-9a-f]{24}")
# Published files read as bytes (weights, plots); everything else is text.
BINARY = (".safetensors", ".png", ".gguf", ".bin")


@pytest.mark.slow
def test_no_published_file_names_a_worker_path(api: Api) -> None:
    extra = api.root / "extra"
    extra.mkdir(exist_ok=True)
    (extra / "wiki.txt").write_text(TEXT)
    sets = [{"name": "wiki-sw", "language": "sw", "kind": "perplexity",
             "path": str(extra / "wiki.txt")}]
    forbidden = [str(api.settings.work_dir), str(Path(tempfile.gettempdir()) / "maec-"),
                 ".out.sweep-"]
    seen: set[str] = set()
    for kind, body in job_bodies(api.models, sets).items():
        job = api.submit(body)
        jid = str(job["id"])
        urls, _ = api.run_published(jid)
        for path, url in urls.items():
            if path.endswith(BINARY):
                continue
            text = api.client.get(url, headers=api.auth()).text
            seen.add(path.rsplit("/", 1)[-1])
            for bad in forbidden:
                assert bad not in text, (kind, path, bad)
            assert JOB_ID.search(text) is None, (kind, path, JOB_ID.search(text))
    # The files that named worker paths before are among those searched.
    assert {"moe_config.yaml", "README.md", "eval_report.json", "recipe.yaml",
            "manifest.json", "leaderboard.json"} <= seen
