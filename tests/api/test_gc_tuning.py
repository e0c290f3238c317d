"""The API process freezes its start-up objects and raises the young-GC threshold."""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator

import pytest

from tests.api.conftest import Api


@pytest.fixture
def restore_gc() -> Iterator[None]:
    before = gc.get_threshold()
    try:
        yield
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)


def test_startup_tunes_the_collector_and_the_api_still_serves(
        api_factory: Callable[..., Api], restore_gc: None) -> None:
    gc.unfreeze()
    api = api_factory(api_gc_threshold=12_345)
    assert gc.get_threshold()[0] == 12_345
    assert gc.get_freeze_count() > 10_000, "the app's start-up objects are frozen"
    job = api.submit()
    got = api.client.get(f"/v1/jobs/{job['id']}", headers=api.auth())
    assert got.status_code == 200 and got.json()["id"] == job["id"]


def test_zero_leaves_the_collector_alone(api_factory: Callable[..., Api],
                                         restore_gc: None) -> None:
    gc.unfreeze()
    before = gc.get_threshold()
    api_factory(api_gc_threshold=0)
    assert gc.get_threshold() == before
    assert gc.get_freeze_count() == 0
