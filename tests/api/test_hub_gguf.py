"""A GGUF file on the hub as a source: ``hf://owner/name@<sha>/<path>.gguf``, against the
fake Hub (tests/fakehub.py). Its header is read by ranged GETs at submission, the file is
fetched by the worker, checked against the listing's sha256 and dequantized."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.api.conftest import Api
from tests.fakehub import FakeHub, fake_hub, fake_sha
from tests.gguf_factory import tiny_gguf, tiny_hf

# The first window of a GGUF header read (app.sources.gguf).
WINDOW = 1 << 20


@pytest.fixture
def hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeHub]:
    with fake_hub(monkeypatch, tmp_path / "hf-home") as h:
        yield h


def _recipe(base: Path, model: str) -> dict[str, object]:
    return {"recipe": {"merge_method": "task_arithmetic", "base_model": str(base),
                       "dtype": "float32",
                       "models": [{"model": model, "parameters": {"weight": 0.5}}]}}


def test_a_gguf_file_on_the_hub_is_a_source(api_factory: Callable[..., Api],
                                             hub: FakeHub) -> None:
    api = api_factory(hub_enabled=True)
    extra = api.root / "extra"
    base = tiny_hf(extra / "base", seed=0)
    other = tiny_hf(extra / "other", seed=1, like=base)
    repo = extra / "repo"
    (repo / "quants").mkdir(parents=True)
    gguf_file = tiny_gguf(other, repo / "quants" / "other.Q8_0.gguf")
    (repo / "README.md").write_text("a model card\n")
    hub.add_repo("org/gg", repo)
    ref = f"{hub.uri('org/gg')}/quants/other.Q8_0.gguf"
    r = api.client.post("/v1/jobs", json=_recipe(base, ref), headers=api.auth())
    assert r.status_code == 202, r.text
    assert any("Q8_0 GGUF file" in w for w in r.json()["warnings"])
    # Submission read the header with ranged GETs only, and nothing else of the repo.
    reads = [q for q in hub.log() if q.file is not None]
    assert reads and {q.file for q in reads} == {"quants/other.Q8_0.gguf"}
    for q in reads:
        m = re.fullmatch(r"bytes=0-(\d+)", q.range or "")
        assert m is not None and int(m.group(1)) < WINDOW, q
    hub.clear()
    _, manifest = api.run_published(str(r.json()["id"]))
    assert hub.downloads("org/gg") == {"quants/other.Q8_0.gguf": 1}
    want = hashlib.sha256(gguf_file.read_bytes()).hexdigest()
    assert manifest["gguf_inputs"][ref]["sha256"] == want


def test_bad_hub_gguf_references_are_refused(api_factory: Callable[..., Api],
                                             hub: FakeHub) -> None:
    api = api_factory(hub_enabled=True)
    extra = api.root / "extra"
    base = tiny_hf(extra / "base", seed=0)
    (extra / "repo").mkdir()
    tiny_gguf(base, extra / "repo" / "base.gguf")
    hub.add_repo("org/gg", extra / "repo")
    uri = hub.uri("org/gg")
    cases = [(f"{uri}/missing.gguf", "source_not_found"),
             (f"{uri}/config.json", "invalid_source"),
             (f"{uri}/../base.gguf", "invalid_source"),
             ("hf://org/gg@main/base.gguf", "invalid_source"),
             (f"hf://org/gg@{fake_sha('never')}/base.gguf", "source_not_found")]
    for ref, code in cases:
        r = api.client.post("/v1/jobs", json=_recipe(base, ref), headers=api.auth())
        assert r.status_code in (404, 422) and r.json()["code"] == code, (ref, r.text)
