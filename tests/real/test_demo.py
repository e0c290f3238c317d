"""`make demo`'s family and answers: the demo folders hold the real family, and the
answer the demo prints for a merge that changes nothing is the base's."""

from __future__ import annotations

from pathlib import Path

from scripts import demo
from tests import real_model
from tests.factories import run_recipe


def test_the_demo_family_is_the_real_one_and_an_identity_merge_answers_as_the_base(
        family: dict[str, Path], tmp_path: Path) -> None:
    paths = demo.build_models(tmp_path / "models")
    stamp = (tmp_path / "models" / "demo" / demo.STAMP).read_text()
    assert real_model.PACKAGE in stamp and real_model.VERSION in stamp
    for name in demo.DEMO:
        assert (paths[name] / "model.safetensors").read_bytes() == \
            (family[name] / "model.safetensors").read_bytes()
    # Built once: a second call keeps the folder.
    before = (paths["base"] / "model.safetensors").stat().st_ino
    demo.build_models(tmp_path / "models")
    assert (paths["base"] / "model.safetensors").stat().st_ino == before
    # SLERP at t=0 is the base: the demo's comparison must show the base's answer.
    out = tmp_path / "merged"
    run_recipe({"merge_method": "slerp", "base_model": str(paths["base"]),
                "models": [{"model": str(paths["donor"])}], "parameters": {"t": 0.0},
                "dtype": "bfloat16"}, out, device="cpu")
    found = demo.answers(paths["base"], out)
    assert found["merged"] == found["base"]
    assert "Paris" in found["base"]["answer"]
    assert found["base"]["next"] == real_model.ANSWER
