"""MAEC modes and the artifact life cycle, on planted hand-built checkpoints."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from maec_core.artifact_store import LocalArtifactStore
from maec_core.context import RunContext
from maec_core.errors import ArtifactMismatch, CorruptCheckpoint, IncompatibleCheckpoints
from maec_core.maec.keys import artifact_key
from maec_core.maec.pipeline import combine, extract, report_cosines
from maec_core.run import run
from tests.core.test_maec_common import (
    DOWN0,
    INCLUDED,
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
from tests.core.test_maec_invariants import KEY_RATIO, PLANT, planted


def _artifact(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(str(folder / "ability.safetensors"))


def _same_folder(a: Path, b: Path) -> None:
    names = sorted(p.name for p in a.iterdir())
    assert names == sorted(p.name for p in b.iterdir())
    for n in names:
        assert (a / n).read_bytes() == (b / n).read_bytes(), n


def test_control_is_subtracted_instead_of_base(tmp_path: Path) -> None:
    base, ability, lang = planted(tmp_path)
    w0 = base_weights(0)
    # θS differs from θ0 everywhere; key rows still come from |θA − θ0|.
    control = write_ckpt(tmp_path / "control", add(w0, noise_like(w0, 9, 0.05)))
    r = maec_recipe(base, lang, [{"model": str(ability), "control": str(control)}],
                    key_ratio=KEY_RATIO, selection_ratio=1.0)
    run(r, tmp_path / "out")
    out, ws, wa, wl = (load(p) for p in (tmp_path / "out", control, ability, lang))
    for k in wl:
        expected = wl[k].clone()
        if k in PLANT:
            rows = PLANT[k]
            expected[rows] = wl[k][rows] + (wa[k][rows] - ws[k][rows])
        assert torch.equal(out[k], expected), k


def test_rank_scope_global_ranks_across_tensors(tmp_path: Path) -> None:
    w0 = base_weights(0)
    d_a = noise_like(w0, 1, 1e-3)
    d_a[UP0][[1, 4, 9, 10]] += 1.0  # the 4 strongest rows of the model, all in up_proj
    base, ability = write_ckpt(tmp_path / "b", w0), write_ckpt(tmp_path / "a", add(w0, d_a))
    lang = write_ckpt(tmp_path / "l", add(w0, noise_like(w0, 2, 1e-2)))
    # 36 candidate rows in all; ceil(0.1 * 36) = 4 key rows, all in up_proj.
    r = maec_recipe(base, lang, [{"model": str(ability)}], key_ratio=0.1, rank_scope="global",
                    selection_ratio=1.0)
    store = LocalArtifactStore(tmp_path / "store")
    res = run(r, tmp_path / "out", RunContext(artifact_store=store))
    assert res.report is not None
    assert [t["name"] for t in res.report["tensors"]] == [UP0]
    art = _artifact(store.get(res.report["artifact_keys"][0]))  # type: ignore[arg-type]
    assert art[UP0 + "::index"].tolist() == [1, 4, 9, 10]
    assert set(art) == {UP0 + "::index", UP0 + "::delta"}
    out, wl = load(tmp_path / "out"), load(lang)
    for k in wl:
        assert torch.equal(out[k], wl[k]) == (k != UP0), k


def test_element_granularity_keeps_planted_weights(tmp_path: Path) -> None:
    w0 = base_weights(0)
    d_a = noise_like(w0, 1, 1e-3)
    # ceil(0.03 * 96) = 3 elements of up/down_proj, ceil(0.03 * 64) = 2 of q_proj.
    plant = {UP0: [5, 40, 95], DOWN0: [0, 17, 18], Q0: [9, 63], Q1: [30, 31]}
    for name, flat in plant.items():
        d_a[name].view(-1)[flat] += torch.tensor([2.0, -3.0, 4.0][: len(flat)])
    base, ability = write_ckpt(tmp_path / "b", w0), write_ckpt(tmp_path / "a", add(w0, d_a))
    lang = write_ckpt(tmp_path / "l", add(w0, noise_like(w0, 2, 1e-2)))
    r = maec_recipe(base, lang, [{"model": str(ability)}], key_ratio=0.03,
                    granularity="element", selection_ratio=1.0)
    store = LocalArtifactStore(tmp_path / "store")
    res = run(r, tmp_path / "out", RunContext(artifact_store=store))
    assert res.report is not None
    art = _artifact(store.get(res.report["artifact_keys"][0]))  # type: ignore[arg-type]
    out, w0s, was, wl = (load(p) for p in (tmp_path / "out", base, ability, lang))
    for name, flat in plant.items():
        assert art[name + "::index"].tolist() == flat
        assert art[name + "::index"].dtype == torch.int32
        expected = wl[name].clone().view(-1)
        expected[flat] += was[name].view(-1)[flat] - w0s[name].view(-1)[flat]
        assert torch.equal(out[name].view(-1), expected), name


def test_threshold_selection_drops_parallel_and_antiparallel(tmp_path: Path) -> None:
    w0 = base_weights(0)
    d_a = noise_like(w0, 1, 1e-3)
    for name, rows in PLANT.items():
        d_a[name][rows] += 0.5
    d_l = noise_like(w0, 2, 1e-2)
    d_l[Q1] = 3.0 * d_a[Q1]
    d_l[Q0] = -2.0 * d_a[Q0]
    base, ability = write_ckpt(tmp_path / "b", w0), write_ckpt(tmp_path / "a", add(w0, d_a))
    lang = write_ckpt(tmp_path / "l", add(w0, d_l))
    r = maec_recipe(base, lang, [{"model": str(ability)}], key_ratio=KEY_RATIO,
                    selection="threshold", selection_threshold=0.99)
    res = run(r, tmp_path / "out")
    assert res.report is not None
    c = {t["name"]: t["abilities"][0] for t in res.report["tensors"]}
    assert c[Q1]["c_t"] == pytest.approx(1.0) and c[Q0]["c_t"] == pytest.approx(-1.0)
    assert {n for n, d in c.items() if d["kept"]} == {UP0, DOWN0}
    out, wl = load(tmp_path / "out"), load(lang)
    assert torch.equal(out[Q0], wl[Q0]) and torch.equal(out[Q1], wl[Q1])
    assert not torch.equal(out[UP0], wl[UP0])


def test_several_abilities_with_their_own_mu(tmp_path: Path) -> None:
    w0 = base_weights(0)
    base = write_ckpt(tmp_path / "b", w0)
    lang = write_ckpt(tmp_path / "l", add(w0, noise_like(w0, 2, 1e-2)))
    donors, rows_of = [], []
    for i, rows in enumerate(({UP0: [0, 1], Q0: [2, 3]}, {UP0: [1, 5], Q0: [3, 7]})):
        d_a = noise_like(w0, 10 + i, 1e-3)
        for name, rs in rows.items():
            d_a[name][rs] += 0.5
        donors.append(write_ckpt(tmp_path / f"a{i}", add(w0, d_a)))
        rows_of.append(rows)
    # Powers of two: μ·R is exact, so the closed form below is bitwise.
    mus = [2.0, 0.5]
    r = maec_recipe(base, lang, [{"model": str(d), "mu": m, "name": f"skill{i}"}
                                 for i, (d, m) in enumerate(zip(donors, mus, strict=True))],
                    key_ratio=KEY_RATIO, selection_ratio=1.0,
                    include=r"(up_proj|layers\.0\.self_attn\.q_proj)")
    res = run(r, tmp_path / "out")
    assert res.report is not None and len(res.report["artifact_keys"]) == 2
    out, w0s, wl = load(tmp_path / "out"), load(base), load(lang)
    was = [load(d) for d in donors]
    for k in wl:
        expected = wl[k].clone()
        for i in range(2):
            if k in rows_of[i]:
                rs = rows_of[i][k]
                expected[rs] = expected[rs] + mus[i] * (was[i][k][rs] - w0s[k][rs])
        assert torch.equal(out[k], expected), k


def test_extract_store_combine_equals_one_run(tmp_path: Path) -> None:
    base, ability, lang = planted(tmp_path, torch.bfloat16)
    r = maec_recipe(base, lang, [{"model": str(ability)}], key_ratio=KEY_RATIO)
    one = run(r, tmp_path / "one", RunContext(artifact_store=LocalArtifactStore(tmp_path / "s1")))
    assert one.report is not None and one.report["abilities"][0]["artifact_reused"] is False
    ex = extract(r, 0, tmp_path / "artifact")
    assert ex.key == artifact_key(r, 0) == one.report["artifact_keys"][0]
    store = LocalArtifactStore(tmp_path / "s2")
    store.put(ex.key, ex.folder)
    got = store.get(ex.key)
    assert got is not None
    res = combine(r, [got], tmp_path / "two")
    assert res.report is not None and res.report["abilities"][0]["artifact_reused"] is True
    _same_folder(tmp_path / "one", tmp_path / "two")
    # And a second one-run merge with the first store reuses the artifact, same bytes.
    again = run(
        r, tmp_path / "three", RunContext(artifact_store=LocalArtifactStore(tmp_path / "s1"))
    )
    assert again.report is not None and again.report["abilities"][0]["artifact_reused"] is True
    _same_folder(tmp_path / "one", tmp_path / "three")


@pytest.mark.parametrize("links", [True, False], ids=["hard-link", "copy"])
def test_store_keeps_the_artifact_after_its_folder_is_removed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, links: bool) -> None:
    """The local store links the files when it can and copies them when it cannot: either
    way the stored artifact outlives the extraction's folder, byte for byte."""
    if not links:
        def no_link(src: object, dst: object) -> None:
            raise OSError(18, "Invalid cross-device link")

        monkeypatch.setattr("maec_core.artifact_store.os.link", no_link)
    base, ability, lang = planted(tmp_path, torch.bfloat16)
    r = maec_recipe(base, lang, [{"model": str(ability)}], key_ratio=KEY_RATIO)
    ex = extract(r, 0, tmp_path / "artifact")
    before = {p.name: p.read_bytes() for p in ex.folder.iterdir()}
    store = LocalArtifactStore(tmp_path / "store")
    store.put(ex.key, ex.folder)
    got = store.get(ex.key)
    assert got is not None
    src_inode = (ex.folder / "ability.safetensors").stat().st_ino
    assert ((got / "ability.safetensors").stat().st_ino == src_inode) is links
    shutil.rmtree(ex.folder)
    assert {p.name: p.read_bytes() for p in got.iterdir()} == before
    combine(r, [got], tmp_path / "merged")
    assert (tmp_path / "merged" / "model.safetensors").is_file()


@pytest.mark.parametrize("params", [{"selection_ratio": 0.5},
                                    {"selection_ratio": 0.5, "importance_control": True},
                                    {"selection_ratio": 0.5, "rank_scope": "global"}],
                         ids=["delta", "control", "global"])
def test_one_run_cosines_equal_those_selection_computes(tmp_path: Path,
                                                        params: dict[str, object]) -> None:
    """A one-run merge takes c_t from the key rows extraction reads; combining the same
    artifact alone computes them in selection: the same report and bytes."""
    base, ability, lang = planted(tmp_path, torch.bfloat16)
    ab: dict[str, object] = {"model": str(ability)}
    if params.pop("importance_control", False):
        w0 = base_weights(0)
        ab["control"] = str(write_ckpt(tmp_path / "control", add(w0, noise_like(w0, 9, 0.05)),
                                       torch.bfloat16))
    r = maec_recipe(base, lang, [ab], key_ratio=KEY_RATIO, **params)
    one = run(r, tmp_path / "one")
    assert one.report is not None
    ex = extract(r, 0, tmp_path / "artifact")
    combine(r, [ex.folder], tmp_path / "two")
    _same_folder(tmp_path / "one", tmp_path / "two")
    # Not vacuous: the selection dropped a tensor by its c_t.
    assert any(a["tensors_dropped"] for a in one.report["abilities"])


def test_combine_reuses_known_cosines(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                      ) -> None:
    # The c_t of a first combination, handed to the next one, give the same folder
    # (tensors and report) without reading the key rows again; they are what decides
    # the selection, so other values would keep other tensors.
    base, ability, lang = planted(tmp_path, torch.float32)
    r = maec_recipe(base, lang, [{"model": str(ability)}], key_ratio=KEY_RATIO,
                    selection_ratio=0.5)
    first = run(r, tmp_path / "one", RunContext(artifact_store=LocalArtifactStore(tmp_path / "s")))
    assert first.report is not None
    art = LocalArtifactStore(tmp_path / "s").get(first.report["artifact_keys"][0])
    assert art is not None
    known = report_cosines(first.report)
    assert set(known) == set(first.report["artifact_keys"])
    reads: list[str] = []
    import maec_core.maec.combine as combine_module

    real = combine_module._key_values

    def counted(io: Any, art: Any, info: Any, idx: torch.Tensor) -> torch.Tensor:
        reads.append(info.name)
        return real(io, art, info, idx)

    monkeypatch.setattr(combine_module, "_key_values", counted)
    combine(r, [art], tmp_path / "two", cosines=known)
    assert reads == []
    combine(r, [art], tmp_path / "three")
    assert reads
    _same_folder(tmp_path / "two", tmp_path / "three")
    kept = {t["name"] for t in first.report["tensors"] if t["abilities"][0]["kept"]}
    flipped = {k: {n: (0.0 if n not in kept else 1.0) for n in v} for k, v in known.items()}
    other = combine(r, [art], tmp_path / "four", cosines=flipped)
    assert other.report is not None
    assert {t["name"] for t in other.report["tensors"] if t["abilities"][0]["kept"]} != kept


def test_engine_routes_maec_and_artifact_field(tmp_path: Path) -> None:
    base, ability, lang = planted(tmp_path)
    r = maec_recipe(base, lang, [{"model": str(ability)}], key_ratio=KEY_RATIO)
    via_engine = run(r, tmp_path / "one")
    ex = extract(r, 0, tmp_path / "artifact")
    with_artifact = r.model_copy(update={"artifact": str(ex.folder)})
    run(with_artifact, tmp_path / "two")
    assert via_engine.report is not None
    for name in ("model.safetensors", "maec_report.json"):
        assert (tmp_path / "one" / name).read_bytes() == (tmp_path / "two" / name).read_bytes()


def test_key_changes_with_extraction_inputs_and_parameters_only(tmp_path: Path) -> None:
    base, ability, lang = planted(tmp_path)
    ab = {"model": str(ability)}
    key = artifact_key(maec_recipe(base, lang, [ab], key_ratio=KEY_RATIO), 0)
    changed = [
        maec_recipe(base, lang, [ab], key_ratio=0.2),
        maec_recipe(base, lang, [ab], key_ratio=KEY_RATIO, granularity="element"),
        maec_recipe(base, lang, [ab], key_ratio=KEY_RATIO, rank_scope="global"),
        maec_recipe(base, lang, [ab], key_ratio=KEY_RATIO, artifact_dtype="bfloat16"),
        maec_recipe(base, lang, [ab], key_ratio=KEY_RATIO, exclude="q_proj"),
        maec_recipe(base, lang, [{**ab, "control": str(lang)}], key_ratio=KEY_RATIO),
    ]
    keys = {artifact_key(r, 0) for r in changed}
    assert key not in keys and len(keys) == len(changed)
    # A changed input byte changes the key.
    w = load(ability)
    w[Q0][0, 0] += 1.0
    other = write_ckpt(tmp_path / "ability2", w)
    assert artifact_key(maec_recipe(base, lang, [{"model": str(other)}],
                                    key_ratio=KEY_RATIO), 0) != key
    # Combination-only settings, paths, and artifact_dtype spelled out as the checkpoints'
    # dtype (float32 here) keep the key: the same artifact serves them all.
    copy = shutil.copytree(ability, tmp_path / "elsewhere")
    same = [
        maec_recipe(base, lang, [{**ab, "mu": 3.0}], key_ratio=KEY_RATIO, selection_ratio=0.5),
        maec_recipe(base, lang, [{"model": str(copy)}], key_ratio=KEY_RATIO),
        maec_recipe(base, tmp_path / "other_lang", [ab], key_ratio=KEY_RATIO,
                    artifact_dtype="float32"),
    ]
    assert {artifact_key(r, 0) for r in same} == {key}


def test_artifact_size_follows_key_ratio_in_artifact_dtype(tmp_path: Path) -> None:
    base, ability, lang = planted(tmp_path, torch.bfloat16)
    r = maec_recipe(base, lang, [{"model": str(ability)}], key_ratio=KEY_RATIO)
    ex = extract(r, 0, tmp_path / "art")
    art = _artifact(ex.folder)
    for name in INCLUDED:
        assert art[name + "::delta"].dtype == torch.bfloat16  # default: checkpoints' dtype
        assert art[name + "::delta"].shape == (2, SHAPES[name][1])
    meta = json.loads((ex.folder / "ability.json").read_text())
    assert meta["totals"]["kept"] == 8 and meta["totals"]["weights"] == 2 * 8 + 2 * 12 + 2 * 8 * 2
    ex32 = extract(maec_recipe(base, lang, [{"model": str(ability)}], key_ratio=KEY_RATIO,
                               artifact_dtype="float32"), 0, tmp_path / "art32")
    assert _artifact(ex32.folder)[Q0 + "::delta"].dtype == torch.float32


# --- refusals ---------------------------------------------------------------------------


def test_artifact_from_another_base_is_refused(tmp_path: Path) -> None:
    base, ability, lang = planted(tmp_path)
    r = maec_recipe(base, lang, [{"model": str(ability)}], key_ratio=KEY_RATIO)
    ex = extract(r, 0, tmp_path / "art")
    w = load(base)
    w[Q0][0, 0] += 1e-3  # same shapes and names, different bytes
    other_base = write_ckpt(tmp_path / "base2", w)
    r2 = maec_recipe(other_base, lang, [{"model": str(ability)}], key_ratio=KEY_RATIO)
    with pytest.raises(ArtifactMismatch, match="different base model"):
        combine(r2, [ex.folder], tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_artifact_with_other_parameters_is_refused(tmp_path: Path) -> None:
    base, ability, lang = planted(tmp_path)
    r = maec_recipe(base, lang, [{"model": str(ability)}], key_ratio=KEY_RATIO)
    ex = extract(r, 0, tmp_path / "art")
    r2 = maec_recipe(base, lang, [{"model": str(ability)}], key_ratio=0.5)
    with pytest.raises(ArtifactMismatch, match="key_ratio"):
        combine(r2, [ex.folder], tmp_path / "out")


def test_artifact_shapes_must_match_the_language_base(tmp_path: Path) -> None:
    base, ability, lang = planted(tmp_path)
    r = maec_recipe(base, lang, [{"model": str(ability)}], key_ratio=KEY_RATIO)
    ex = extract(r, 0, tmp_path / "art")
    meta_path = ex.folder / "ability.json"
    meta = json.loads(meta_path.read_text())
    entry = next(e for e in meta["tensors"] if e["name"] == Q0)
    entry["shape"] = [16, 8]  # a taller q_proj than the language base has
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(ArtifactMismatch, match="shape"):
        combine(r, [ex.folder], tmp_path / "out")


def test_damaged_artifact_is_refused(tmp_path: Path) -> None:
    base, ability, lang = planted(tmp_path)
    r = maec_recipe(base, lang, [{"model": str(ability)}], key_ratio=KEY_RATIO)
    ex = extract(r, 0, tmp_path / "art")
    data = bytearray((ex.folder / "ability.safetensors").read_bytes())
    data[-1] ^= 0xFF
    (ex.folder / "ability.safetensors").write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpoint, match="sha256"):
        combine(r, [ex.folder], tmp_path / "out")
    with pytest.raises(ArtifactMismatch, match="not an ability-vector artifact"):
        combine(r, [tmp_path], tmp_path / "out")


def test_incompatible_shapes_are_refused_before_reading(tmp_path: Path) -> None:
    base, ability, _ = planted(tmp_path)
    w = base_weights(5)
    w[UP0] = torch.zeros(INTER_BIG := 16, SHAPES[UP0][1])
    assert SHAPES[UP0][0] != INTER_BIG
    lang = write_ckpt(tmp_path / "lang_bad", w)
    r = maec_recipe(base, lang, [{"model": str(ability)}], key_ratio=KEY_RATIO)
    with pytest.raises(IncompatibleCheckpoints, match="shape"):
        run(r, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_one_donor_twice_is_extracted_once(tmp_path: Path) -> None:
    base, ability, lang = planted(tmp_path)
    r = maec_recipe(base, lang, [{"model": str(ability), "mu": 0.5, "name": "x"},
                                 {"model": str(ability), "mu": 0.5, "name": "y"}],
                    key_ratio=KEY_RATIO)
    steps: list[tuple[str, int, int]] = []
    res = run(r, tmp_path / "out", RunContext(progress=lambda s, d, t: steps.append((s, d, t))))
    assert res.report is not None and len(set(res.report["artifact_keys"])) == 1
    extract_steps = [s for s in steps if s[0] == "extract"]
    assert extract_steps[-1] == ("extract", len(INCLUDED), len(INCLUDED))
    # μ 0.5 + 0.5 adds the ability once (up to the rounding of two float32 additions).
    single = maec_recipe(base, lang, [{"model": str(ability)}], key_ratio=KEY_RATIO)
    run(single, tmp_path / "single")
    twice, once, wl = load(tmp_path / "out")[UP0], load(tmp_path / "single")[UP0], load(lang)[UP0]
    assert torch.allclose(twice, once, rtol=0, atol=1e-6) and not torch.equal(twice, wl)


def test_key_rows_straddling_stream_slices(tmp_path: Path) -> None:
    # The engine streams θL in flat slices; key rows that cross a slice boundary must get
    # each part of their addition exactly once (rows and elements alike).
    from maec_core.streaming import CHUNK_CPU

    width = 1000
    rows = 2 * CHUNK_CPU // width + 4
    cross = [CHUNK_CPU // width, 2 * CHUNK_CPU // width]  # rows holding a boundary
    g = torch.Generator().manual_seed(0)
    name = "model.layers.0.mlp.up_proj.weight"
    w0 = {name: torch.randn(rows, width, generator=g)}
    d_a = 1e-3 * torch.randn(rows, width, generator=g)
    d_a[cross] += 1.0
    flat = [cross[0] * width + width // 2 - 1, CHUNK_CPU - 1, CHUNK_CPU, 2 * CHUNK_CPU]
    d_a.view(-1)[flat] += 50.0  # the four largest single weights, two at a boundary
    base = write_ckpt(tmp_path / "b", w0)
    ability = write_ckpt(tmp_path / "a", {name: w0[name] + d_a})
    lang = write_ckpt(tmp_path / "l", {name: w0[name] + 1e-2 * torch.randn(rows, width,
                                                                        generator=g)})
    wa, wl = load(ability)[name], load(lang)[name]
    # Ratios a little under 2 rows and 4 weights: ceil() gives exactly those counts.
    for gran, ratio in (("row", 1.5 / rows), ("element", 3.5 / (rows * width))):
        r = maec_recipe(base, lang, [{"model": str(ability), "mu": 0.5}], key_ratio=ratio,
                        granularity=gran, selection_ratio=1.0)
        run(r, tmp_path / gran)
        expected = wl.clone()
        if gran == "row":
            expected[cross] = wl[cross] + 0.5 * (wa[cross] - w0[name][cross])
        else:
            e, a0, a1 = expected.view(-1), wa.view(-1), w0[name].view(-1)
            e[flat] = e[flat] + 0.5 * (a0[flat] - a1[flat])
        assert torch.equal(load(tmp_path / gran)[name], expected), gran


def test_progress_stages_and_cancel(tmp_path: Path) -> None:
    base, ability, lang = planted(tmp_path)
    r = maec_recipe(base, lang, [{"model": str(ability)}], key_ratio=KEY_RATIO)
    seen: list[tuple[str, int, int]] = []
    run(r, tmp_path / "out", RunContext(progress=lambda s, d, t: seen.append((s, d, t))))
    # Extraction is announced before its first step (a gradient corpus pass comes first):
    # a job's status says "extract" from the start, not the stage before it.
    assert seen[0][:2] == ("extract", 0)
    assert [s for s, _, _ in seen] == sorted((s for s, _, _ in seen), key=["extract",
                                             "combine"].index)
    for stage in ("extract", "combine"):
        done = [(d, t) for s, d, t in seen if s == stage]
        assert [d for d, _ in done] == sorted(d for d, _ in done)
        assert done[-1][0] == done[-1][1]
    # Cancelled in either stage: no output folder, no stored artifact, no staging debris.
    for stage in ("extract", "combine"):
        _cancel_during(r, tmp_path, stage)


def _cancel_during(r: object, tmp_path: Path, stage: str) -> None:
    from maec_core.errors import Cancelled

    flag = {"on": False}

    def progress(s: str, d: int, t: int) -> None:
        flag["on"] = flag["on"] or s == stage

    store = LocalArtifactStore(tmp_path / f"store-{stage}")
    with pytest.raises(Cancelled):
        run(
            r,
            tmp_path / f"cancel-{stage}",
            RunContext(progress=progress, cancel=lambda: flag["on"], artifact_store=store),
        )
    assert not (tmp_path / f"cancel-{stage}").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".cancel")] == []
    if stage == "extract":
        assert not store.root.exists() or not any(store.root.iterdir())


def test_element_granularity_with_global_ranking(tmp_path: Path) -> None:
    w0 = base_weights(0)
    d_a = noise_like(w0, 1, 1e-3)
    d_a[Q0].view(-1)[[3, 50]] += 5.0
    d_a[DOWN0].view(-1)[[7]] -= 4.0
    d_a[Q1].view(-1)[[60]] += 3.0
    base, ability = write_ckpt(tmp_path / "b", w0), write_ckpt(tmp_path / "a", add(w0, d_a))
    lang = write_ckpt(tmp_path / "l", add(w0, noise_like(w0, 2, 1e-2)))
    # 320 candidate weights; ceil(0.0125 * 320) = 4: exactly the planted ones.
    r = maec_recipe(base, lang, [{"model": str(ability)}], key_ratio=0.0125,
                    granularity="element", rank_scope="global", selection_ratio=1.0)
    store = LocalArtifactStore(tmp_path / "store")
    res = run(r, tmp_path / "out", RunContext(artifact_store=store))
    assert res.report is not None
    art = _artifact(store.get(res.report["artifact_keys"][0]))  # type: ignore[arg-type]
    assert {k: v.tolist() for k, v in art.items() if k.endswith("::index")} == {
        Q0 + "::index": [3, 50], DOWN0 + "::index": [7], Q1 + "::index": [60]}
    out, wl, wa, w0s = (load(p) for p in (tmp_path / "out", lang, ability, base))
    assert torch.equal(out[UP0], wl[UP0])
    e = wl[Q0].clone().view(-1)
    e[[3, 50]] += wa[Q0].view(-1)[[3, 50]] - w0s[Q0].view(-1)[[3, 50]]
    assert torch.equal(out[Q0].view(-1), e)


def test_existing_output_is_refused_before_extraction(tmp_path: Path) -> None:
    from maec_core.errors import OutputExists

    base, ability, lang = planted(tmp_path)
    (tmp_path / "out").mkdir()
    r = maec_recipe(base, lang, [{"model": str(ability)}], key_ratio=KEY_RATIO)
    steps: list[str] = []
    with pytest.raises(OutputExists):
        run(r, tmp_path / "out", RunContext(progress=lambda s, d, t: steps.append(s)))
    assert steps == []
    run(r, tmp_path / "out", RunContext(overwrite=True))
    assert (tmp_path / "out" / "maec_report.json").is_file()


def test_output_under_folders_not_yet_made(tmp_path: Path) -> None:
    """A MAEC merge into a path whose parents do not exist makes them, as every other
    method's output does (extraction's scratch folder sits beside the output)."""
    base, ability, lang = planted(tmp_path)
    r = maec_recipe(base, lang, [{"model": str(ability)}], key_ratio=KEY_RATIO)
    out = tmp_path / "not" / "yet" / "out"
    run(r, out)
    assert (out / "maec_report.json").is_file()
    assert sorted(p.name for p in out.parent.iterdir()) == ["out"]
