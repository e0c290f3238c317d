"""The one run entry and the run-time module: layering, threads, caches the caller names."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from maec_core.artifact_store import LocalArtifactStore
from maec_core.context import RunContext
from maec_core.parsing import parse_recipe
from maec_core.run import run
from maec_core.runtime import torch_threads
from tests.core.test_maec_common import maec_recipe
from tests.core.test_maec_pipeline import planted

ROOT = Path(__file__).resolve().parents[2]


def test_the_engine_knows_nothing_of_maec() -> None:
    """The engine streams; MAEC builds on it, never the reverse (cycles in general are
    checked package-wide by tests/test_structure.py)."""
    import grimp

    graph = grimp.build_graph("maec_core", exclude_type_checking_imports=True)
    imported = graph.find_modules_directly_imported_by("maec_core.engine")
    assert not [m for m in imported if m.startswith("maec_core.maec")]
    assert not graph.chain_exists(importer="maec_core.engine", imported="maec_core.maec.pipeline")


def test_maec_modules_take_only_the_streaming_loop_from_the_engine() -> None:
    # The loop and the description of the work it runs (its argument type).
    for path in (ROOT / "maec_core" / "maec").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "maec_core.engine":
                assert {a.name for a in node.names} <= {"stream_merge", "MergeWork"}, path.name


def test_runtime_types_import_without_torch() -> None:
    code = ("import sys; from maec_core.runtime import CancelFn, MergeResult, ProgressFn; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, check=True)
    assert out.stdout.strip() == "False"


def test_torch_threads_restores_the_count() -> None:
    before = torch.get_num_threads()
    with torch_threads(1) as threads:
        assert torch.get_num_threads() == 1
        threads.use(2)
        assert torch.get_num_threads() == 2
    assert torch.get_num_threads() == before
    with pytest.raises(RuntimeError), torch_threads(1):
        raise RuntimeError("boom")
    assert torch.get_num_threads() == before


def test_run_writes_only_where_the_caller_says(zoo: dict[str, Path], tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("XDG_CACHE_HOME", str(home / ".cache"))
    monkeypatch.delenv("MAEC_CACHE_DIR", raising=False)
    recipe = parse_recipe({
        "merge_method": "task_arithmetic", "base_model": str(zoo["base"]),
        "models": [{"model": str(zoo["a"]), "parameters": {"weight": 0.5}}]})
    run(recipe, tmp_path / "ta")
    base, ability, lang = planted(tmp_path / "maec")
    run(maec_recipe(base, lang, [{"model": str(ability)}], key_ratio=0.1), tmp_path / "m1")
    assert list(home.iterdir()) == []
    # Named caches are used: the artifact lands in the store, digests in the hash cache.
    store = LocalArtifactStore(tmp_path / "store")
    res = run(
        maec_recipe(base, lang, [{"model": str(ability)}], key_ratio=0.1),
        tmp_path / "m2",
        RunContext(artifact_store=store, hash_cache=tmp_path / "sha256"),
    )
    assert res.report is not None
    assert store.get(res.report["artifact_keys"][0]) is not None
    assert any((tmp_path / "sha256").iterdir())
    assert list(home.iterdir()) == []
    # Without a store nothing is kept, and the merge is the same.
    for name in ("model.safetensors", "maec_report.json"):
        assert (tmp_path / "m1" / name).read_bytes() == (tmp_path / "m2" / name).read_bytes()
    assert json.loads((tmp_path / "m1" / "manifest.json").read_text())["files"]
