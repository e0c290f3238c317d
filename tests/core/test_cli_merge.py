"""``maec merge RECIPE.yaml OUT_DIR`` through click's CliRunner."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from maec_core.cli import _imports_frozen, _one_blas_thread, main
from tests.core.conftest import leftovers


def write_recipe(path: Path, doc: dict[str, object]) -> Path:
    path.write_text(yaml.safe_dump(doc))
    return path


def ta_doc(zoo: dict[str, Path]) -> dict[str, object]:
    return {"merge_method": "task_arithmetic", "base_model": str(zoo["base"]),
            "models": [{"model": str(zoo["a"]), "parameters": {"weight": 0.5}}]}


def test_merge_writes_folder_and_shows_progress(zoo: dict[str, Path], tmp_path: Path) -> None:
    recipe = write_recipe(tmp_path / "r.yaml", ta_doc(zoo))
    out = tmp_path / "merged"
    result = CliRunner().invoke(main, ["merge", str(recipe), str(out)])
    assert result.exit_code == 0, result.output
    assert "wrote" in result.stdout and "21 tensors" in result.stdout
    # The tqdm bar goes to stderr and ends at the tensor count.
    assert "merge" in result.stderr and "21/21" in result.stderr
    assert (out / "manifest.json").is_file() and (out / "model.safetensors").is_file()
    again = CliRunner().invoke(main, ["merge", "--no-progress", str(recipe), str(out)])
    assert again.exit_code == 2 and "output_exists" in again.stderr


def test_unknown_top_level_key_is_warned_and_a_nested_one_named(zoo: dict[str, Path],
                                                                 tmp_path: Path) -> None:
    # mergekit ignores a top-level key it does not know: the merge runs, the key is named
    # on stderr and in the model card.
    doc = {**ta_doc(zoo), "out_shard_sise": "1GB"}
    recipe = write_recipe(tmp_path / "r.yaml", doc)
    out = tmp_path / "merged"
    result = CliRunner().invoke(main, ["merge", "--no-progress", str(recipe), str(out)])
    assert result.exit_code == 0, result.output
    warning = "out_shard_sise ignored: not a recipe field"
    assert f"warning: {warning}" in result.stderr
    assert "`out_shard_sise`: not a recipe field" in (out / "README.md").read_text()
    # Inside a block a typo stays an error that names it.
    doc = ta_doc(zoo)
    doc["models"] = [{"model": str(zoo["a"]), "parameter": {"weight": 0.5}}]
    recipe = write_recipe(tmp_path / "r2.yaml", doc)
    out = tmp_path / "merged2"
    result = CliRunner().invoke(main, ["merge", str(recipe), str(out)])
    assert result.exit_code == 2
    assert "unknown key 'models.0.parameter'" in result.stderr
    assert leftovers(out) == []


def test_unknown_method_is_named_and_unknown_parameter_warned(zoo: dict[str, Path],
                                                             tmp_path: Path) -> None:
    recipe = write_recipe(tmp_path / "r.yaml", {**ta_doc(zoo), "merge_method": "frobnicate"})
    result = CliRunner().invoke(main, ["merge", str(recipe), str(tmp_path / "o1")])
    assert result.exit_code == 2
    assert "unknown merge_method 'frobnicate'" in result.stderr and "ties" in result.stderr
    doc = ta_doc(zoo)
    doc["parameters"] = {"lamda": 0.5}
    recipe = write_recipe(tmp_path / "r2.yaml", doc)
    result = CliRunner().invoke(main, ["merge", str(recipe), str(tmp_path / "o2")])
    # Accepted as mergekit accepts it, and named on stderr (and in the model card).
    assert result.exit_code == 0, result.output
    warning = "parameters.lamda ignored: no merge method knows this name"
    assert f"warning: {warning}" in result.stderr
    assert warning.split(" ignored")[0] in (tmp_path / "o2" / "README.md").read_text()


def test_bad_checkpoint_reports_its_code(zoo: dict[str, Path], tmp_path: Path) -> None:
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text((zoo["a"] / "config.json").read_text())
    (bad / "model.pt").write_bytes(b"x")
    doc = ta_doc(zoo)
    doc["models"] = [{"model": str(bad)}]
    recipe = write_recipe(tmp_path / "r.yaml", doc)
    out = tmp_path / "merged"
    result = CliRunner().invoke(main, ["merge", str(recipe), str(out)])
    assert result.exit_code == 2 and "pickle_refused" in result.stderr
    assert leftovers(out) == []


def test_what_the_engine_import_builds_is_left_out_of_later_collections() -> None:
    """The collector is off while the engine is imported, what was built is frozen, and
    the collector is left as it was found (on, or off)."""
    frozen = gc.get_freeze_count()
    try:
        with _imports_frozen():
            assert not gc.isenabled()
            kept = [[i] for i in range(1000)]
        assert gc.isenabled()
        assert gc.get_freeze_count() >= frozen + len(kept)
        gc.disable()
        with _imports_frozen():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()
        gc.unfreeze()


def test_the_merge_command_loads_without_what_a_plain_merge_never_uses() -> None:
    """Loading ``maec merge`` (what the script does on every start) imports neither the
    GGUF parser (numpy and ``gguf``), the pattern engine MAEC's recipes need, the LoRA
    exporter, the eval report nor the service's response models; torch comes only once
    the command runs."""
    code = ("import json, sys; import maec_core.cli, maec_core.gguf.sources; "
            "print(json.dumps(sorted(m for m in ('gguf', 'numpy', 'regex', 'torch', "
            "'maec_core.gguf.header', 'maec_core.lora.export', 'maec_core.eval.report', "
            "'maec_contract.jobs') if m in sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert json.loads(out.stdout) == []


def test_numpy_blas_gets_one_thread_unless_the_user_chose(monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    monkeypatch.delenv("OPENBLAS_NUM_THREADS", raising=False)
    _one_blas_thread()
    assert os.environ["OPENBLAS_NUM_THREADS"] == "1"
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "4")
    _one_blas_thread()
    assert os.environ["OPENBLAS_NUM_THREADS"] == "4"


def test_the_script_publishes_the_same_folder_as_the_command(zoo: dict[str, Path],
                                                             tmp_path: Path) -> None:
    """Run as the ``maec`` script (which ends its process without the interpreter's
    teardown), the merge leaves every file as the command run in-process does."""
    recipe = write_recipe(tmp_path / "r.yaml", ta_doc(zoo))
    here = tmp_path / "here"
    args = ["merge", "--no-progress", "--cache-dir", str(tmp_path / "cache"), str(recipe)]
    assert CliRunner().invoke(main, [*args, str(here)]).exit_code == 0
    script = tmp_path / "script"
    code = ("import sys; from maec_client.cli import main; "
            f"sys.argv = ['maec', *{[*args, str(script)]!r}]; main()")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"wrote {script} (21 tensors")
    names = sorted(p.name for p in here.iterdir())
    assert sorted(p.name for p in script.iterdir()) == names and "manifest.json" in names
    for name in names:
        assert (script / name).read_bytes() == (here / name).read_bytes(), name
