"""The run flags every ``maec`` command shares come from one model (RunFlags)."""

from __future__ import annotations

import re
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from maec_core.cli import main
from maec_core.cli_options import FLAG_NAMES, RunFlags, run_flags
from maec_core.sweep.cli import sweep_command

ROOT = Path(__file__).resolve().parents[2]
SHARED = {"--device": "device", "--overwrite": "overwrite", "--no-progress": "no_progress",
          "--cache-dir": "cache_dir"}
# Which shared flags each command has (unchanged from when each declared its own).
EXPECTED = {
    "merge": ["--device", "--overwrite", "--no-progress", "--cache-dir"],
    "extract": ["--device", "--overwrite", "--no-progress", "--cache-dir"],
    "combine": ["--device", "--overwrite", "--no-progress", "--cache-dir"],
    "extract-lora": ["--device", "--overwrite", "--no-progress"],
    "eval": ["--device", "--no-progress"],
    "sweep": ["--device", "--cache-dir"],
}


def _command(name: str) -> click.Command:
    return sweep_command if name == "sweep" else main.commands[name]


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_each_command_has_its_shared_flags_as_the_model_declares_them(name: str) -> None:
    options = {opt: p for p in _command(name).params for opt in p.opts if opt in SHARED}
    assert list(options) == EXPECTED[name]
    for opt, param in options.items():
        assert param.name == SHARED[opt]
        assert param.name in FLAG_NAMES
    if "--cache-dir" in options:
        assert options["--cache-dir"].envvar == "MAEC_CACHE_DIR"


def test_no_command_declares_a_shared_flag_by_hand() -> None:
    # The flag strings appear in the options model only.
    declared = re.compile(r"""click\.option\(\s*["'](--device|--overwrite|--no-progress|"""
                          r"""--cache-dir)["']""")
    offenders = [str(p.relative_to(ROOT)) for p in sorted((ROOT / "maec_core").rglob("*.py"))
                 if declared.search(p.read_text())]
    assert offenders == []


def test_the_flags_become_one_run_context(tmp_path: Path) -> None:
    seen: list[RunFlags] = []

    @click.command()
    @run_flags(*FLAG_NAMES)
    def probe(flags: RunFlags) -> None:
        seen.append(flags)

    res = CliRunner().invoke(probe, ["--device", "cpu", "--overwrite", "--no-progress",
                                     "--cache-dir", str(tmp_path)])
    assert res.exit_code == 0, res.output
    ctx = seen[0].context()
    assert (ctx.device, ctx.overwrite, ctx.hash_cache) == ("cpu", True, tmp_path / "sha256")
    assert seen[0].no_progress


def test_an_unknown_flag_name_is_refused() -> None:
    with pytest.raises(ValueError, match="no run flag named"):
        run_flags("verbose")


def test_every_installed_maec_command_loads() -> None:
    """The ``maec`` script finds the library's commands through its installed entry
    points: each must load as a click command (a moved function leaves a name that
    ``maec --help`` would only warn about)."""
    from maec_client.cli import main as script
    from maec_client.extensions import COMMANDS, registered

    points = registered(COMMANDS)
    assert set(EXPECTED) | {"merge", "moe"} <= set(points)
    result = CliRunner().invoke(script, ["--help"])
    assert result.exit_code == 0, result.output
    assert "cannot be loaded" not in result.output
    for name, point in points.items():
        assert isinstance(point.load(), click.Command), name
        assert name in result.output
