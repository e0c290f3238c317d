"""The real-weights tier: merges of a real chat model (tests/real_model.py).

Every test here is marked ``real``; all skip, with the reason, where the package that
ships the model is not installed.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests import real_model


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.real)


@pytest.fixture(scope="session")
def family() -> dict[str, Path]:
    reason = real_model.available()
    if reason:
        pytest.skip(reason)
    return real_model.real_family()
