"""``tmp_path`` with a name the session has never used, removed when its test passes.

pytest's own fixture names a test's folder after the test and the lowest free number, so
with ``tmp_path_retention_policy = "failed"`` (a passing test's folder removed as it ends)
the next test of the same name prefix gets the very same path. Code that caches by path in
the test process then serves the last test's inputs: mergekit, run in-process by the
conformance suite, gave a merge of models built earlier at that path. These folders are
``mkdtemp`` names under the session's base folder, never reused; a failing test's stays
for a look, and a passing session's base folder goes at its end (pytest's policy).
"""

from __future__ import annotations

import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

# Whether the test's call passed (absent: it never ran, its setup failed).
_CALL_PASSED = pytest.StashKey[bool]()


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item) -> Iterator[None]:
    report = yield
    if report.when == "call":
        item.stash[_CALL_PASSED] = report.passed
    return report


@pytest.fixture
def tmp_path(request: pytest.FixtureRequest,
             tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    name = re.sub(r"\W", "_", request.node.name)[:30]
    path = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=tmp_path_factory.getbasetemp()))
    yield path
    # Torn down before the teardown's own report: the call's outcome decides.
    if request.node.stash.get(_CALL_PASSED, False):
        shutil.rmtree(path, ignore_errors=True)
