"""Vocabulary merges at submission: planned from headers and tokenizer files, local and
hub sources alike; a mismatch without tokenizer_source and a broken tokenizer refused."""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from app.queue import QUEUE
from tests.api.conftest import Api
from tests.conftest import TinyModels
from tests.factories import make_extended
from tests.fakehub import FakeHub, fake_hub


@pytest.fixture(scope="module")
def ext(tiny_models: TinyModels, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("vocab-api")
    return make_extended(root / "ext", 3, like=tiny_models.base, words=["x0", "x1"],
                         added=["<lang>"])


@pytest.fixture
def api(api_factory: Callable[..., Api]) -> Api:
    return api_factory(hub_enabled=True)


def _recipe(base: str, donor: str, lang: str, **extra: Any) -> dict[str, Any]:
    return {"recipe": {"merge_method": "task_arithmetic", "base_model": base,
                       "models": [{"model": donor, "parameters": {"weight": 0.5}},
                                  {"model": lang, "parameters": {"weight": 0.5}}], **extra}}


def _post(api: Api, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    r = api.client.post("/v1/jobs", json=body, headers=api.auth())
    return r.status_code, dict(r.json())


def _local_ext(api: Api, ext: Path) -> str:
    local = api.root / "extra" / "ext"
    if not local.exists():
        shutil.copytree(ext, local)
    return str(local)


def test_local_sources(api: Api, ext: Path) -> None:
    m = api.models
    lang = _local_ext(api, ext)
    status, doc = _post(api, _recipe(str(m.base), str(m.donor), lang))
    assert (status, doc["code"]) == (422, "incompatible_checkpoints"), doc
    assert "tokenizer_source" in doc["message"]
    assert api.r.llen(QUEUE) == 0
    status, doc = _post(api, _recipe(str(m.base), str(m.donor), lang,
                                     tokenizer_source="union"))
    assert status == 202, doc
    assert api.r.llen(QUEUE) == 1


def test_unparseable_tokenizer_is_invalid_tokenizer(api: Api, ext: Path) -> None:
    m = api.models
    bad = api.root / "extra" / "bad-tok"
    shutil.copytree(ext, bad)
    (bad / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "Nope"}}')
    status, doc = _post(api, _recipe(str(m.base), str(m.donor), str(bad),
                                     tokenizer_source="union"))
    assert (status, doc["code"]) == (422, "invalid_tokenizer"), doc
    assert api.r.llen(QUEUE) == 0


@pytest.fixture
def hub(tiny_models: TinyModels, ext: Path, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeHub]:
    with fake_hub(monkeypatch, tmp_path / "hf-home") as h:
        h.add_repo("org/base", tiny_models.base)
        h.add_repo("org/donor", tiny_models.donor)
        h.add_repo("org/ext", ext)
        yield h


def test_hub_sources_read_tokenizers_only_when_asked(api: Api, hub: FakeHub) -> None:
    base, donor, lang = (hub.uri(r) for r in ("org/base", "org/donor", "org/ext"))
    status, doc = _post(api, _recipe(base, donor, lang))
    assert (status, doc["code"]) == (422, "incompatible_checkpoints"), doc
    whole = [r for r in hub.log() if r.file == "tokenizer.json" and r.range is None]
    assert not whole  # without tokenizer settings, tokenizer files are only sniffed
    status, doc = _post(api, _recipe(base, donor, lang, tokenizer_source="union"))
    assert status == 202, doc
    assert [r for r in hub.log() if r.file == "tokenizer.json" and r.range is None]


def test_slices_over_an_extended_vocabulary_are_laid_out_and_warned(api: Api, ext: Path
                                                                     ) -> None:
    """A frankenmerge whose last slice's model adds tokens (mergekit accepts it and
    copies that model's longer head as it is): accepted, and the job's warnings say the
    head's rows are laid out in the output's vocabulary."""
    m = api.models
    lang = _local_ext(api, ext)
    body = {"recipe": {"merge_method": "passthrough", "base_model": str(m.base), "slices": [
        {"sources": [{"model": str(m.base), "layer_range": [0, 1]}]},
        {"sources": [{"model": lang, "layer_range": [1, 2]}]}]}}
    status, doc = _post(api, body)
    assert status == 202, doc
    assert any(w.startswith("lm_head.weight: rows laid out in") for w in doc["warnings"]), doc
