"""The invariants of docs/maec-method.md, each its own test, on hand-built checkpoints."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from maec_core.artifact_store import LocalArtifactStore
from maec_core.context import RunContext
from maec_core.maec.keys import artifact_key
from maec_core.run import run
from tests.core.test_maec_common import (
    DOWN0,
    EMBED,
    HEAD,
    INCLUDED,
    NORM0,
    Q0,
    Q1,
    SHAPES,
    UP0,
    _private_cache,  # noqa: F401 - autouse fixture
    add,
    base_weights,
    load,
    maec_recipe,
    noise_like,
    write_ckpt,
)

# Planted rows with the largest |θA − θ0| in each included tensor. key_ratio 0.16 keeps
# ceil(0.16 * 12) = 2 rows of up_proj and ceil(0.16 * 8) = 2 of the others.
PLANT = {UP0: [3, 7], DOWN0: [1, 6], Q0: [0, 5], Q1: [2, 4]}
KEY_RATIO = 0.16


def planted(tmp: Path, dtype: torch.dtype = torch.float32) -> tuple[Path, Path, Path]:
    """θ0, θA (planted rows), θL (whose Q1 delta is parallel to the ability's)."""
    w0 = base_weights(0)
    d_a = noise_like(w0, 1, 1e-3)
    g = torch.Generator().manual_seed(7)
    for name, rows in PLANT.items():
        d_a[name][rows] += 0.5 * torch.randn(len(rows), SHAPES[name][1], generator=g)
    d_l = noise_like(w0, 2, 1e-2)
    d_l[Q1] = 2.0 * d_a[Q1]  # the language update of Q1 points the same way as the ability
    return (write_ckpt(tmp / "base", w0, dtype), write_ckpt(tmp / "ability", add(w0, d_a), dtype),
            write_ckpt(tmp / "lang", add(w0, d_l), dtype))


def _bits(t: torch.Tensor) -> torch.Tensor:
    width = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}
    return t.view(width[t.dtype])


def test_mu_zero_gives_the_language_base_bitwise(tmp_path: Path) -> None:
    base, ability, _ = planted(tmp_path, torch.bfloat16)
    w_l = {k: v.to(torch.bfloat16) for k, v in add(base_weights(0), noise_like(
        base_weights(0), 3, 1e-2)).items()}
    w_l[Q0][0, :4] = -0.0  # θL + 0·R would turn these into +0.0
    lang = write_ckpt(tmp_path / "lang_negzero", w_l, torch.bfloat16)
    r = maec_recipe(base, lang, [{"model": str(ability), "mu": 0.0}], key_ratio=KEY_RATIO,
                    selection_ratio=1.0)
    run(r, tmp_path / "out")
    out, ref = load(tmp_path / "out"), load(lang)
    assert out.keys() == ref.keys()
    for k in ref:
        assert out[k].dtype == torch.bfloat16
        assert torch.equal(_bits(out[k]), _bits(ref[k])), k


def test_full_ratios_equal_task_arithmetic(tmp_path: Path) -> None:
    base, ability, lang = planted(tmp_path, torch.bfloat16)
    r = maec_recipe(base, lang, [{"model": str(ability)}], key_ratio=1.0, selection_ratio=1.0,
                    artifact_dtype="float32")
    run(r, tmp_path / "out")
    out, w0, wa, wl = (load(p) for p in (tmp_path / "out", base, ability, lang))
    for k in wl:
        if k in INCLUDED:
            expected = (wl[k].float() + (wa[k].float() - w0[k].float())).to(torch.bfloat16)
        else:
            expected = wl[k]
        assert torch.equal(_bits(out[k]), _bits(expected)), k
    # Not vacuous: the included tensors did change.
    assert not torch.equal(out[Q0], wl[Q0])


def test_planted_rows_are_the_key_rows_and_parallel_tensor_is_dropped(tmp_path: Path) -> None:
    base, ability, lang = planted(tmp_path)
    r = maec_recipe(base, lang, [{"model": str(ability)}], key_ratio=KEY_RATIO)
    store = LocalArtifactStore(tmp_path / "store")
    res = run(r, tmp_path / "out", RunContext(artifact_store=store))
    report = json.loads((tmp_path / "out" / "maec_report.json").read_text())
    # The artifact holds exactly the planted rows.
    folder = store.get(report["artifact_keys"][0])
    assert folder is not None
    from safetensors.torch import load_file

    art = load_file(str(folder / "ability.safetensors"))
    for name, rows in PLANT.items():
        assert art[name + "::index"].tolist() == rows
    # ceil(0.75 * 4) = 3 tensors kept: the one whose language delta is parallel is dropped.
    decisions = {t["name"]: t["abilities"][0] for t in report["tensors"]}
    assert {n for n, d in decisions.items() if not d["kept"]} == {Q1}
    assert abs(decisions[Q1]["c_t"] - 1.0) < 1e-6
    assert res.report is not None and res.report["abilities"][0]["tensors_dropped"] == [Q1]
    # Output in closed form: θL + (θA − θ0) on the key rows of the kept tensors.
    out, w0, wa, wl = (load(p) for p in (tmp_path / "out", base, ability, lang))
    for k in wl:
        expected = wl[k].clone()
        if k in PLANT and k != Q1:
            rows = PLANT[k]
            expected[rows] = wl[k][rows] + (wa[k][rows] - w0[k][rows])
        assert torch.equal(out[k], expected), k


def test_same_inputs_give_identical_bytes_and_key(tmp_path: Path) -> None:
    base, ability, lang = planted(tmp_path, torch.bfloat16)
    r = maec_recipe(base, lang, [{"model": str(ability)}], key_ratio=KEY_RATIO)
    run(r, tmp_path / "one", RunContext(artifact_store=LocalArtifactStore(tmp_path / "s1")))
    run(r, tmp_path / "two", RunContext(artifact_store=LocalArtifactStore(tmp_path / "s2")))
    files = sorted(p.name for p in (tmp_path / "one").iterdir())
    assert files == sorted(p.name for p in (tmp_path / "two").iterdir())
    for name in files:
        assert (tmp_path / "one" / name).read_bytes() == (tmp_path / "two" / name).read_bytes()
    key = artifact_key(r, 0)
    assert key == artifact_key(r, 0)
    for store in ("s1", "s2"):
        folder = tmp_path / store / key
        assert (folder / "ability.json").is_file()
    for name in ("ability.json", "ability.safetensors"):
        assert (tmp_path / "s1" / key / name).read_bytes() == (
            tmp_path / "s2" / key / name).read_bytes()


def test_excluded_tensors_are_never_touched(tmp_path: Path) -> None:
    base, ability, lang = planted(tmp_path)
    r = maec_recipe(base, lang, [{"model": str(ability)}], key_ratio=1.0, selection_ratio=1.0)
    run(r, tmp_path / "out")
    out, wl = load(tmp_path / "out"), load(lang)
    for k in (EMBED, HEAD, NORM0, "model.norm.weight"):
        assert torch.equal(out[k], wl[k])
