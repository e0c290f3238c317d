"""The one run entry and the run-time module: layering, threads, caches the caller names."""

from __future__ import annotations

import ast
import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

from maec_core.maec.store import LocalArtifactStore
from maec_core.recipe import parse_recipe
from maec_core.run import run
from maec_core.runtime import torch_threads
from tests.core.test_maec_common import maec_recipe
from tests.core.test_maec_pipeline import planted

ROOT = Path(__file__).resolve().parents[2]
# Modules that must stay out of any import cycle: the run entry, the run-time types,
# the engine and the MAEC pipeline built on it.
RUN_MODULES = {"maec_core.run", "maec_core.runtime", "maec_core.engine",
               "maec_core.maec.pipeline", "maec_core.maec.combine", "maec_core.maec.extract"}


def _cycles_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("import_cycles",
                                                  ROOT / "scripts" / "import_cycles.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_run_modules_are_in_no_import_cycle() -> None:
    script = _cycles_script()
    graph = script.module_graph(ROOT / "maec_core")
    assert not [c for c in script.cycles(graph) if RUN_MODULES & set(c)]
    # The engine streams; it knows nothing of MAEC.
    assert not [m for m in graph["maec_core.engine"] if m.startswith("maec_core.maec")]


def test_cycle_finder_finds_a_cycle() -> None:
    script = _cycles_script()
    assert script.cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_maec_modules_take_only_the_streaming_loop_from_the_engine() -> None:
    for path in (ROOT / "maec_core" / "maec").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "maec_core.engine":
                assert {a.name for a in node.names} <= {"stream_merge"}, path.name


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
    res = run(maec_recipe(base, lang, [{"model": str(ability)}], key_ratio=0.1),
              tmp_path / "m2", artifact_store=store, hash_cache=tmp_path / "sha256")
    assert res.report is not None
    assert store.get(res.report["artifact_keys"][0]) is not None
    assert any((tmp_path / "sha256").iterdir())
    assert list(home.iterdir()) == []
    # Without a store nothing is kept, and the merge is the same.
    for name in ("model.safetensors", "maec_report.json"):
        assert (tmp_path / "m1" / name).read_bytes() == (tmp_path / "m2" / name).read_bytes()
    assert json.loads((tmp_path / "m1" / "manifest.json").read_text())["files"]
