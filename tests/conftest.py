"""Shared fixtures: real processes from tests/stack.py, started lazily, stopped by pid.

- ``redis_server`` (session): one redis-server; stacks get their own DB on it.
- ``s3_server`` (session): one SeaweedFS S3 server with bucket ``maec-test``.
- ``tiny_models`` (session): base / donor / donor2 / lang / lang2 / control checkpoints.
- ``make_stack`` (function) and ``make_module_stack`` (module): factories
  ``make_stack(storage="local"|"s3", workers=1, api=True, own_redis=False, env={...},
  local_roots=[...])`` returning a started :class:`tests.stack.Stack`; everything they
  start is stopped when the fixture's scope ends. Use ``own_redis=True`` to restart or
  kill Redis without disturbing other tests.
- ``default_api_port_taken`` (function): 127.0.0.1:8000 listened on while the test runs,
  as another ``make run`` would; every test also fails if it connected to a well-known
  port (8000, 6379, SeaweedFS's) on loopback (``tests/ports.py``).
- The experiment smoke test's run starts in the background as soon as collection selects
  that test, which then runs last (``tests/smoke_experiment.py``).
- ``test_device`` (session): the device the core's device-dependent tests merge on,
  ``MAEC_TEST_DEVICE`` (``cpu`` by default; ``cuda`` runs them on the GPU and skips
  them where there is none).
"""

from __future__ import annotations

import contextlib
import itertools
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests import ports, smoke_experiment
from tests.stack import RedisServer, S3Server, Stack, stack_context

# Every test's ``tmp_path`` a folder of its own, removed when it passes.
pytest_plugins = ["tests.tmp_folders"]

_DBS = itertools.cycle(range(1, 16))


def _is_smoke_test(item: pytest.Item) -> bool:
    return (item.name == smoke_experiment.TEST_NAME
            and item.nodeid.startswith(smoke_experiment.TEST_FILE))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # The smoke test waits for a run started at the beginning of the session: last, it
    # finds that run (nearly) done instead of blocking the tests behind it.
    items.sort(key=_is_smoke_test)


def pytest_collection_finish(session: pytest.Session) -> None:
    if session.config.option.collectonly:
        return
    if any(_is_smoke_test(item) for item in session.items):
        smoke_experiment.started = smoke_experiment.SmokeRun(smoke_experiment.NICENESS)


def pytest_sessionfinish() -> None:
    if smoke_experiment.started is not None:
        smoke_experiment.started.stop()
        smoke_experiment.started = None


@pytest.fixture(scope="session", autouse=True)
def _well_known_ports_refused() -> Iterator[None]:
    with ports.guard_connections():
        yield


@pytest.fixture(autouse=True)
def _no_well_known_port_used(_well_known_ports_refused: None) -> Iterator[None]:
    before = len(ports.attempts)
    yield
    if len(ports.attempts) > before:
        pytest.fail("connected to another service's port: "
                    + ", ".join(sorted(set(ports.attempts[before:]))), pytrace=False)


@pytest.fixture
def default_api_port_taken() -> Iterator[None]:
    with ports.hold(8000):
        assert ports.taken(8000)
        yield


@pytest.fixture(scope="session")
def test_device() -> str:
    device = os.environ.get("MAEC_TEST_DEVICE", "cpu")
    if device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            pytest.skip("MAEC_TEST_DEVICE=cuda and no CUDA device here")
    return device


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    server = S3Server(tmp_path_factory.mktemp("seaweedfs")).start()
    yield server
    # Its data is the session's temporary folder: nothing to shut down gracefully, and
    # weed's own SIGTERM shutdown takes ~25 s (stop() would wait 15 s, then SIGKILL).
    server.kill()


@dataclass(frozen=True)
class TinyModels:
    root: Path
    base: Path
    donor: Path
    donor2: Path
    lang: Path
    lang2: Path
    control: Path


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> TinyModels:
    from tests.factories import make_llama

    root = tmp_path_factory.mktemp("models")
    base = make_llama(root / "base", 0)
    return TinyModels(
        root=root, base=base,
        donor=make_llama(root / "donor", 1, like=base),
        donor2=make_llama(root / "donor2", 4, like=base),
        lang=make_llama(root / "lang", 2, like=base),
        lang2=make_llama(root / "lang2", 5, like=base),
        control=make_llama(root / "control", 3, like=base),
    )


StackFactory = Callable[..., Stack]


def _factory(request: pytest.FixtureRequest, root: Path) -> Iterator[StackFactory]:
    with contextlib.ExitStack() as exits:
        n = itertools.count()

        def make(*, storage: str = "local", own_redis: bool = False, **kw: Any) -> Stack:
            redis = None if own_redis else request.getfixturevalue("redis_server")
            s3 = request.getfixturevalue("s3_server") if storage == "s3" else None
            return exits.enter_context(stack_context(
                root / f"stack{next(n)}", redis, db=next(_DBS), storage=storage, s3=s3, **kw
            ))

        yield make


@pytest.fixture
def make_stack(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[StackFactory]:
    yield from _factory(request, tmp_path)


@pytest.fixture(scope="module")
def make_module_stack(request: pytest.FixtureRequest,
                      tmp_path_factory: pytest.TempPathFactory) -> Iterator[StackFactory]:
    yield from _factory(request, tmp_path_factory.mktemp("stack"))
