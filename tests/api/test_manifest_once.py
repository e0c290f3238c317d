"""Each manifest.json a job publishes is assembled in memory and written once, last, per
attempt: the merge, its evaluation and the naming of its inputs change the manifest in
memory, never through the file (a merge, an evaluated merge, a sweep, an MoE build)."""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from maec_core.manifest import MANIFEST_NAME
from tests.api.conftest import Api
from tests.api.test_evaluate_sweep import _sets
from tests.api.test_moe_jobs import _moe


def _count_manifest_writes(monkeypatch: pytest.MonkeyPatch, work: Path) -> Counter[str]:
    """Every write of a file named manifest.json in the worker's folders (``work``): a
    rename onto it, or a direct write. (Storing it is publishing, not counted.)"""
    writes: Counter[str] = Counter()
    replace, write_text, write_bytes = os.replace, Path.write_text, Path.write_bytes

    def count(path: Path) -> None:
        if path.name == MANIFEST_NAME and path.is_relative_to(work):
            writes[str(path.relative_to(work))] += 1

    def counting_replace(src: Any, dst: Any, **kw: Any) -> None:
        count(Path(dst))
        replace(src, dst, **kw)

    def counting_text(self: Path, *a: Any, **kw: Any) -> int:
        count(self)
        return write_text(self, *a, **kw)

    def counting_bytes(self: Path, data: Any) -> int:
        count(self)
        return write_bytes(self, data)

    monkeypatch.setattr(os, "replace", counting_replace)
    monkeypatch.setattr(Path, "write_text", counting_text)
    monkeypatch.setattr(Path, "write_bytes", counting_bytes)
    return writes


def _body(api: Api, kind: str) -> dict[str, Any]:
    if kind == "merge":
        return api.named("linear", parameters={"weight": 0.5})
    if kind == "evaluated":
        return api.named("linear", evaluate=_sets(api), parameters={"weight": 1.0})
    if kind == "sweep":
        return api.named("task_arithmetic", evaluate=_sets(api), sweep={
            "grid": {"weight": [0.0, 1.0]},
            "objective": {"set": "wiki-sw", "metric": "perplexity"}, "publish": "all"})
    return _moe(api)


@pytest.mark.parametrize("kind", ["merge", "evaluated", "sweep", "moe"])
def test_each_published_manifest_is_written_once(api: Api, kind: str,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    job = api.submit(_body(api, kind))
    writes = _count_manifest_writes(monkeypatch, api.settings.work_dir)
    urls, _manifest = api.run_published(str(job["id"]))
    monkeypatch.undo()
    published = [p for p in urls if p.rsplit("/", 1)[-1] == MANIFEST_NAME]
    # The job's own manifest, and a sweep's candidates' (publish: all).
    assert len(published) == (3 if kind == "sweep" else 1), published
    assert sum(writes.values()) == len(published), writes
    assert set(writes.values()) == {1}, writes
