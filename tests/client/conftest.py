from __future__ import annotations

import pytest

from maec_client import Client, ClientConfig
from maec_client.retry import RetryPolicy
from tests.client.fake_service import FakeService

BASE = "http://127.0.0.1:8000"


class FakeClock:
    """time.monotonic/time.sleep pair where sleeping advances the clock instantly."""

    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


@pytest.fixture
def fake() -> FakeService:
    return FakeService()


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


# Backoff without jitter, so tests can state the exact delays.
EXACT = RetryPolicy(jitter=0.0)


@pytest.fixture
def client(fake: FakeService, clock: FakeClock):
    c = Client(config=ClientConfig(url=BASE, api_key="k1"), transport=fake.transport(),
               retry=EXACT, sleep=clock.sleep, clock=clock)
    yield c
    c.close()
