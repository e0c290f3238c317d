"""Combination copies θL's bytes and patches only the key rows: the result must be the
documented float32 sum θL + Σ_k μ_k R(A_k), cast once, however the engine cuts the
tensors into slices (rows cut by a slice's ends, several abilities on the same rows)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from maec_core import streaming
from maec_core.artifact_store import LocalArtifactStore
from maec_core.context import RunContext
from maec_core.maec.artifact import load_artifact
from maec_core.maec.rowio import RowReader
from maec_core.run import run
from tests.core.test_maec_common import (
    _private_cache,  # noqa: F401 - autouse fixture
    add,
    base_weights,
    load,
    maec_recipe,
    noise_like,
    write_ckpt,
)

MUS = (0.7, 1.3)


def _inputs(tmp: Path) -> tuple[Path, Path, list[Path]]:
    w0 = base_weights(0)
    donors = [write_ckpt(tmp / f"donor{i}", add(w0, noise_like(w0, 10 + i, 0.1)),
                         torch.bfloat16) for i in range(2)]
    return (write_ckpt(tmp / "base", w0, torch.bfloat16),
            write_ckpt(tmp / "lang", add(w0, noise_like(w0, 2, 1e-2)), torch.bfloat16),
            donors)


def _expected(out: Path, lang: Path, store: LocalArtifactStore) -> dict[str, torch.Tensor]:
    """θL + Σ_k μ_k R(A_k) per kept tensor, from the stored artifacts, in float32."""
    report = json.loads((out / "maec_report.json").read_text())
    keys = report["artifact_keys"]
    want = {k: v.float() for k, v in load(lang).items()}
    changed: set[str] = set()
    with RowReader() as reader:
        for k, key in enumerate(keys):
            folder = store.get(key)
            assert folder is not None
            art = load_artifact(folder)
            for t in report["tensors"]:
                entry = next((e for e in t["abilities"] if e["ability"] == k), None)
                if entry is None or not entry["kept"]:
                    continue
                idx, values = art.read(t["name"], reader)
                rows = want[t["name"]].view(want[t["name"]].shape[0], -1)
                rows[idx] = rows[idx].add_(values.view(idx.numel(), -1), alpha=MUS[k])
                changed.add(t["name"])
    assert changed, "no tensor was kept: the test would check nothing"
    return {k: v.to(torch.bfloat16) for k, v in want.items()}


@pytest.mark.parametrize("unit", [None, 5, 29])
def test_patched_rows_equal_the_float32_sum_however_sliced(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, unit: int | None) -> None:
    if unit is not None:
        # Slices shorter than a row (5) and a few rows long, not a multiple of any
        # width (29): rows cut at both ends of slices.
        monkeypatch.setattr(streaming, "UNIT_CPU", unit)
        monkeypatch.setattr(streaming, "CHUNK_CPU", unit)
    base, lang, donors = _inputs(tmp_path)
    store = LocalArtifactStore(tmp_path / "store")
    # The same donor twice (the same rows, two μ) and another donor (other rows).
    abilities = [{"model": str(donors[0]), "mu": MUS[0]}, {"model": str(donors[1]),
                                                           "mu": MUS[1]}]
    recipe = maec_recipe(base, lang, abilities, key_ratio=0.4, selection_ratio=1.0)
    run(recipe, tmp_path / "out", RunContext(artifact_store=store))
    got = load(tmp_path / "out")
    for name, want in _expected(tmp_path / "out", lang, store).items():
        assert torch.equal(got[name].view(torch.int16), want.view(torch.int16)), name


def test_one_donor_twice_adds_both_mus_before_one_cast(tmp_path: Path) -> None:
    base, lang, donors = _inputs(tmp_path)
    store = LocalArtifactStore(tmp_path / "store")
    abilities = [{"model": str(donors[0]), "mu": MUS[0]}, {"model": str(donors[0]),
                                                           "mu": MUS[1]}]
    run(maec_recipe(base, lang, abilities, key_ratio=0.4, selection_ratio=1.0),
        tmp_path / "out", RunContext(artifact_store=store))
    got = load(tmp_path / "out")
    for name, want in _expected(tmp_path / "out", lang, store).items():
        assert torch.equal(got[name].view(torch.int16), want.view(torch.int16)), name


def test_one_entry_rows_take_the_float32_path_itself(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    # Norm weights (1-D: rows of one entry) included explicitly, slices cutting them.
    monkeypatch.setattr(streaming, "UNIT_CPU", 5)
    monkeypatch.setattr(streaming, "CHUNK_CPU", 5)
    base, lang, donors = _inputs(tmp_path)
    store = LocalArtifactStore(tmp_path / "store")
    abilities = [{"model": str(donors[0]), "mu": MUS[0]}, {"model": str(donors[1]),
                                                           "mu": MUS[1]}]
    recipe = maec_recipe(base, lang, abilities, key_ratio=0.4, selection_ratio=1.0,
                         include=[r"layernorm", r"proj"])
    run(recipe, tmp_path / "out", RunContext(artifact_store=store))
    got = load(tmp_path / "out")
    want = _expected(tmp_path / "out", lang, store)
    assert any(t.dim() == 1 and not torch.equal(got[k], load(lang)[k]) for k, t in got.items())
    for name in want:
        assert torch.equal(got[name].view(torch.int16), want[name].view(torch.int16)), name
