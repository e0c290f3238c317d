"""The suite cleans up after itself: a passing test's temporary folder is gone when it
ends and a passing session leaves no base folder behind, while a failing test's folder is
kept to look at. The suite writes gigabytes of checkpoints into these folders; pytest's
default keeps every one of its last three sessions, which fills a small disk. And no two
tests get the same path (``tests/tmp_folders.py``), although the first was removed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SESSION = '''
from pathlib import Path

import pytest

@pytest.mark.parametrize("which", ["a", "b"])
def test_with_a_name_longer_than_pytest_keeps_for_folders(tmp_path: Path, which: str) -> None:
    (tmp_path / "weights.bin").write_bytes(bytes(1 << 20))
    Path({record!r}, which).write_text(str(tmp_path))

def test_passes(tmp_path: Path) -> None:
    (tmp_path / "weights.bin").write_bytes(bytes(1 << 20))
    Path({record!r}, "passed").write_text(str(tmp_path))

def test_fails(tmp_path: Path) -> None:
    (tmp_path / "weights.bin").write_bytes(bytes(1 << 20))
    Path({record!r}, "failed").write_text(str(tmp_path))
    assert {ok}
'''


def _session(tmp_path: Path, name: str, fail: bool) -> tuple[int, Path, Path, Path]:
    """A nested pytest session under this project's configuration and temp folders, with a
    temp root of its own (so it never touches this session's folders): its exit code, the
    base folder root and the folders of the test that passes and of the one that may fail
    (the two with one long name checked here: never the same path)."""
    work = tmp_path / name
    (work / "record").mkdir(parents=True)
    (work / "root").mkdir()
    test = work / "test_nested.py"
    test.write_text(SESSION.format(record=str(work / "record"), ok=not fail))
    env = {**os.environ, "PYTEST_DEBUG_TEMPROOT": str(work / "root"),
           "PYTHONPATH": str(ROOT)}
    rc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         "-p", "tests.tmp_folders", "-c", str(ROOT / "pyproject.toml"),
         "--rootdir", str(work), str(test)],
        env=env, cwd=work, capture_output=True, timeout=120).returncode
    a, b = ((work / "record" / k).read_text() for k in "ab")
    assert a != b
    return (rc, work / "root", Path((work / "record" / "passed").read_text()),
            Path((work / "record" / "failed").read_text()))


def test_a_passing_session_leaves_no_temporary_folders(tmp_path: Path) -> None:
    rc, root, passed, failed = _session(tmp_path, "ok", fail=False)
    assert rc == 0
    assert not passed.exists() and not failed.exists()
    assert not any(root.rglob("weights.bin")), list(root.rglob("*"))


def test_a_failing_test_keeps_its_folder_and_only_its(tmp_path: Path) -> None:
    rc, root, passed, failed = _session(tmp_path, "bad", fail=True)
    assert rc == 1
    assert not passed.exists()
    assert (failed / "weights.bin").is_file()
    assert [p.parent for p in root.rglob("weights.bin")] == [failed]
