"""``maec extract`` / ``maec combine`` / ``maec merge`` with a MAEC recipe."""

from __future__ import annotations

from pathlib import Path

import yaml
from click.testing import CliRunner

from maec_core.cli import main
from maec_core.maec.keys import artifact_key
from maec_core.parsing import parse_recipe
from tests.core.test_maec_common import _private_cache  # noqa: F401 - autouse fixture
from tests.core.test_maec_invariants import KEY_RATIO, planted


def test_extract_then_combine_equals_merge(tmp_path: Path) -> None:
    base, ability, lang = planted(tmp_path)
    doc = {"merge_method": "maec", "base_model": str(base), "language_base": str(lang),
           "abilities": [{"model": str(ability), "name": "math"}],
           "parameters": {"key_ratio": KEY_RATIO}}
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(doc))
    runner = CliRunner()
    res = runner.invoke(main, ["extract", str(recipe), str(tmp_path / "art"), "--ability", "0",
                               "--no-progress"])
    assert res.exit_code == 0, res.output
    assert artifact_key(parse_recipe(doc), 0) in res.output
    res = runner.invoke(main, ["combine", str(recipe), str(tmp_path / "art"),
                               str(tmp_path / "combined")])
    assert res.exit_code == 0, res.output
    assert "math: 3/4 tensors" in res.output
    res = runner.invoke(main, ["merge", str(recipe), str(tmp_path / "merged"), "--no-progress"])
    assert res.exit_code == 0, res.output
    for name in ("model.safetensors", "maec_report.json", "README.md"):
        assert (tmp_path / "combined" / name).read_bytes() == (
            tmp_path / "merged" / name).read_bytes()


def test_cli_errors_are_reported_with_their_code(tmp_path: Path) -> None:
    base, ability, lang = planted(tmp_path)
    doc = {"merge_method": "maec", "base_model": str(base), "language_base": str(lang),
           "abilities": [{"model": str(ability)}], "parameters": {"key_ratio": KEY_RATIO}}
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(doc))
    runner = CliRunner()
    res = runner.invoke(main, ["combine", str(recipe), str(tmp_path), str(tmp_path / "out")])
    assert res.exit_code == 2 and "artifact_mismatch" in res.output
    res = runner.invoke(main, ["combine", str(recipe), str(tmp_path / "out")])
    assert res.exit_code != 0 and "ARTIFACT_DIR" in res.output
    res = runner.invoke(main, ["extract", str(recipe), str(tmp_path / "a"), "--ability", "3"])
    assert res.exit_code == 2 and "out of range" in res.output
