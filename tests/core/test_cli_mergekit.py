"""``maec merge`` takes the options users type for ``mergekit-yaml``: the same meaning,
no effect (with a note saying why), or refused with the reason, before anything runs."""

from __future__ import annotations

import json
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from maec_core.cli import main
from maec_core.cli_mergekit import MERGEKIT_FLAGS, parse_parameter_count
from maec_core.errors import RecipeError
from tests.core.conftest import leftovers
from tests.core.test_cli_merge import ta_doc, write_recipe


def _options(command: click.Command) -> set[str]:
    return {o for p in command.params for o in (*p.opts, *p.secondary_opts)
            if o.startswith("-")}


def test_every_mergekit_yaml_option_is_taken() -> None:
    """Each option mergekit-yaml 0.1.5 lists is one ``maec merge`` lists too."""
    from mergekit.scripts.run_yaml import main as mergekit_main

    merge = main.commands["merge"]  # type: ignore[attr-defined]
    theirs, ours = _options(mergekit_main), _options(merge)
    assert theirs <= ours, sorted(theirs - ours)
    table = {d.split("/")[0] for f in MERGEKIT_FLAGS for d in f.decls}
    assert table <= ours


def test_shard_size_counts_parameters_and_seed_and_notes(zoo: dict[str, Path],
                                                          tmp_path: Path) -> None:
    doc = {**ta_doc(zoo), "dtype": "float32"}
    recipe = write_recipe(tmp_path / "r.yaml", doc)
    out = tmp_path / "o"
    result = CliRunner().invoke(main, ["merge", "--out-shard-size", "2K", "--random-seed",
                                       "3", "--lazy-unpickle", "--copy-tokenizer", "-j", "2",
                                       "--quiet", str(recipe), str(out)])
    assert result.exit_code == 0, result.output
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert "note: --lazy-unpickle has no effect here" in result.stderr
    assert "note: --num-threads has no effect here" in result.stderr
    assert "merge" not in result.stderr.replace("--", "")  # quiet: no bar


@pytest.mark.parametrize("option", ["--trust-remote-code", "--allow-crimes",
                                    "--no-copy-tokenizer", "--no-write-model-card",
                                    "--no-safe-serialization", "--unsafe-truncate-embeddings"])
def test_refused_options_name_the_reason(option: str, zoo: dict[str, Path],
                                         tmp_path: Path) -> None:
    recipe = write_recipe(tmp_path / "r.yaml", ta_doc(zoo))
    out = tmp_path / "o"
    result = CliRunner().invoke(main, ["merge", option, str(recipe), str(out)])
    assert result.exit_code == 2
    assert f"error: {option} is not supported: " in result.stderr
    assert not out.exists() and leftovers(out) == []


def test_parameter_counts() -> None:
    assert parse_parameter_count("5B") == 5 * 10**9
    assert parse_parameter_count("500m") == 500 * 10**6
    assert parse_parameter_count("1000") == 1000
    for bad in ("", "x", "-1", "5Q"):
        with pytest.raises(RecipeError, match="--out-shard-size"):
            parse_parameter_count(bad)


def test_the_compatibility_page_lists_every_option_as_handled() -> None:
    page = (Path(__file__).parents[2] / "docs" / "compatibility.md").read_text()
    for flag in MERGEKIT_FLAGS:
        row = f"| `{' / '.join(flag.decls)}` | {flag.handling.replace('_', ' ')} | {flag.why} |"
        assert row in page, row
